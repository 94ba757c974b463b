"""Retention deletes dropped checkpoints off the save's path: uncommitted before `save` returns, bytes removed behind
it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from training.checkpointing import MANIFEST, PAYLOAD, CheckpointStore

ROOT = Path(__file__).resolve().parents[2]


def _state(seed: int) -> dict:
    return {"w": torch.full((256,), float(seed)), "step": seed}


def _dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))


class _SlowRemovals:
    """Wraps the store's `fs.rm` so recursive removals wait for `release`; records the thread of each."""

    def __init__(self, store: CheckpointStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.threads: list[str] = []
        rm = store.fs.rm

        def slow_rm(path: Any, recursive: bool = False, **kw: Any) -> Any:
            if recursive:
                self.threads.append(threading.current_thread().name)
                self.started.set()
                assert self.release.wait(30), "the test never released the removal"
            return rm(path, recursive=recursive, **kw)

        monkeypatch.setattr(store.fs, "rm", slow_rm)


def test_save_returns_before_the_dropped_checkpoint_is_deleted_and_no_reader_can_choose_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CheckpointStore(str(tmp_path / "ckpt"), keep_last=1)
    store.save(1, _state(1))
    slow = _SlowRemovals(store, monkeypatch)

    store.save(2, _state(2))  # returns although the deletion of step 1 is held
    assert slow.started.wait(10)
    old = tmp_path / "ckpt" / "step-000000001"
    assert (old / PAYLOAD).exists() and not (old / MANIFEST).exists()  # uncommitted, bytes still there
    assert slow.threads == ["trainyard-checkpoint-retention_0"]

    # A reader waits for the removal in progress instead of listing a half-removed directory.
    reader = threading.Thread(target=lambda: store.latest())
    reader.start()
    reader.join(0.3)
    assert reader.is_alive()
    slow.release.set()
    reader.join(10)
    assert not reader.is_alive()
    assert _dirs(tmp_path / "ckpt") == ["step-000000002"]
    assert store.latest().step == 2
    assert len(store.retention_seconds) == 1


def test_saving_again_the_step_being_removed_waits_for_the_removal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Resumed from 10 after 20 was written: saving 15 drops 20 (an abandoned timeline); the run then saves 20 again.
    store = CheckpointStore(str(tmp_path / "ckpt"), keep_last=2)
    store.save(10, _state(10))
    store.save(20, _state(20))
    slow = _SlowRemovals(store, monkeypatch)
    store.save(15, _state(15))
    assert slow.started.wait(10)

    done = threading.Event()
    saver = threading.Thread(target=lambda: (store.save(20, _state(21)), done.set()))
    saver.start()
    assert not done.wait(0.3)  # held behind the removal of the old step-20
    slow.release.set()
    saver.join(10)
    assert done.is_set()
    loaded = store.latest()
    assert loaded.step == 20 and float(loaded.state["w"][0]) == 21.0
    assert [m["step"] for m in store.list_committed()] == [20, 15]


def test_a_failed_removal_is_logged_and_retried_by_the_next_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    store = CheckpointStore(str(tmp_path / "ckpt"), keep_last=1)
    store.save(1, _state(1))
    rm = store.fs.rm
    fail = [True]

    def flaky_rm(path: Any, recursive: bool = False, **kw: Any) -> Any:
        if recursive and fail[0]:
            fail[0] = False
            raise PermissionError(13, "Permission denied", str(path))
        return rm(path, recursive=recursive, **kw)

    monkeypatch.setattr(store.fs, "rm", flaky_rm)
    with caplog.at_level("WARNING", logger="trainyard.training.checkpointing"):
        store.save(2, _state(2))
        store.flush()
    assert f"could not delete old checkpoint {store.root_uri}/step-000000001" in caplog.text
    assert _dirs(tmp_path / "ckpt") == ["step-000000001", "step-000000002"]
    assert [m["step"] for m in store.list_committed()] == [2]  # uncommitted although its bytes stayed

    store.save(3, _state(3))
    store.flush()
    assert _dirs(tmp_path / "ckpt") == ["step-000000003"]


def _run(script: str, root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), str(root)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_process_exits_only_once_the_removal_is_done(tmp_path: Path) -> None:
    # The script saves and returns at once; the interpreter's exit waits for the background thread.
    proc = _run(
        """
        import sys, time, torch
        from training.checkpointing import CheckpointStore
        store = CheckpointStore(sys.argv[1], keep_last=1)
        store.save(1, {"w": torch.zeros(4_000_000)})
        rm = store.fs.rm
        store.fs.rm = lambda p, recursive=False, **kw: (
            time.sleep(0.5) if recursive else None,
            rm(p, recursive=recursive, **kw),
        )
        store.save(2, {"w": torch.ones(4_000_000)})
        print("saved", flush=True)
    """,
        tmp_path / "ckpt",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "saved"
    assert _dirs(tmp_path / "ckpt") == ["step-000000002"]


def test_a_save_while_the_interpreter_shuts_down_removes_in_line(tmp_path: Path) -> None:
    # No thread can start after shutdown began (an atexit hook's save): retention removes before `save` returns.
    proc = _run("""
        import atexit, sys, torch
        from training.checkpointing import CheckpointStore
        store = CheckpointStore(sys.argv[1], keep_last=1)
        store.save(1, {"w": torch.zeros(8)})
        def last_save():
            store.save(2, {"w": torch.ones(8)})
            print("saved at exit", flush=True)
        atexit.register(last_save)
    """, tmp_path / "ckpt")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "saved at exit"
    assert _dirs(tmp_path / "ckpt") == ["step-000000002"]


def test_a_process_killed_during_the_removal_leaves_nothing_a_reader_chooses(tmp_path: Path) -> None:
    # SIGKILL while the old checkpoint's bytes are being removed: it is uncommitted already, and the next save removes
    # it.
    root = tmp_path / "ckpt"
    proc = _run(
        """
        import os, signal, sys, torch
        from training.checkpointing import CheckpointStore
        store = CheckpointStore(sys.argv[1], keep_last=1)
        store.save(1, {"w": torch.zeros(8)})
        store.fs.rm = lambda p, recursive=False, **kw: (
            os.kill(os.getpid(), signal.SIGKILL) if recursive else os.remove(p)
        )
        store.save(2, {"w": torch.ones(8)})
        store.flush()
    """,
        root,
    )
    assert proc.returncode == -9, proc.stderr
    assert _dirs(root) == ["step-000000001", "step-000000002"]
    store = CheckpointStore(str(root), keep_last=1)
    assert [m["step"] for m in store.list_committed()] == [2]
    assert store.latest().step == 2  # no warning: the uncommitted one is older
    store.save(3, _state(3))
    store.flush()
    assert _dirs(root) == ["step-000000003"]
