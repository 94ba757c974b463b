"""Warm workers that fail safe: a stopped server's trials checkpoint and are retried, a killed one's are retried too.

Real processes throughout: a real `python -m training.warm serve` started by `LocalLauncher`, a real trial of the
digits MLP forked from it, the server signalled by its pid as an operator or the system would.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from resources.launcher import InfrastructureError, LocalLauncher, TrainingPreempted
from resources.warm import WARM_DIR_ENV, stop_servers
from tests.support.train_specs import make_spec
from training.checkpointing import CheckpointStore
from training.spec import CheckpointPolicy, ImportTarget

WORKER_LINE = re.compile(r"\(spec (\S+)\): worker pid (\d+) started \(restart (\d+)\) by supervisor pid (\d+) of warm server pid (\d+)")


@pytest.fixture()
def warm_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A warm directory of the test's own (short: a socket path must stay under 108 bytes); its servers stop after the test."""
    directory = Path(tempfile.mkdtemp(prefix="tyf-"))
    monkeypatch.setenv(WARM_DIR_ENV, str(directory))
    yield directory
    stop_servers(directory)
    shutil.rmtree(directory, ignore_errors=True)


def running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def worker_of(directory: Path, spec_uri: str, timeout: float = 180.0) -> tuple[int, int]:
    """(worker pid, server pid) of `spec_uri`'s first worker, from the logs of the servers in `directory`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for log in directory.glob("*.log"):
            for m in WORKER_LINE.finditer(log.read_text()):
                if m[1] == spec_uri and m[3] == "0":
                    return int(m[2]), int(m[5])
        time.sleep(0.05)
    raise AssertionError(f"no worker of {spec_uri} in the server logs of {directory}")


def slow_spec(tmp_path: Path) -> Any:
    """A trial of 0.1 s steps (long enough to be signalled mid-training) until `tmp_path/fast` exists, then at full speed."""
    model = ImportTarget(path="tests.support.gang_models:SlowSteps",
                         kwargs={"hidden": 16, "lr": 0.02, "step_seconds": 0.1, "until": str(tmp_path / "fast")})
    return make_spec(tmp_path, model=model, checkpoint=CheckpointPolicy(every_n_steps=4), max_epochs=12, batch_size=16)


def launch_in_thread(spec: Any) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["outcome"] = LocalLauncher().launch(spec)
        except BaseException as e:  # handed to the test thread
            box["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    return thread, box


def launched_and_checkpointed(spec: Any, warm_dir: Path) -> tuple[threading.Thread, dict[str, Any], int, int]:
    """Launch `spec`, wait for its first committed checkpoint; (thread, outcome box, worker pid, server pid)."""
    thread, box = launch_in_thread(spec)
    checkpoints = Path(spec.output_uri, "checkpoints")
    deadline = time.monotonic() + 300
    while not any(checkpoints.glob("step-*/MANIFEST.json")):
        assert thread.is_alive() and time.monotonic() < deadline, f"the launch ended before its first checkpoint: {box}"
        time.sleep(0.05)
    worker, server = worker_of(warm_dir, str(Path(spec.output_uri) / "spec.json"))
    return thread, box, worker, server


def resume(spec: Any, tmp_path: Path, warm_dir: Path, old_server: int) -> tuple[int, int]:
    """Launch `spec` again at full speed, as the retry policy does; (the step it resumed from, its server's pid)."""
    (tmp_path / "fast").touch()
    outcome = LocalLauncher().launch(spec)
    [(server,)] = {(int(m[5]),) for m in WORKER_LINE.finditer(Path(outcome.log_uri).read_text())}
    assert server != old_server and running(server)
    assert outcome.result.resumed_from and "step-" in outcome.result.resumed_from
    return int(outcome.result.resumed_from.rstrip("/").rsplit("step-", 1)[1]), server


@pytest.mark.slow
def test_a_stopped_server_checkpoints_its_trials_which_are_retried_as_preempted_and_resume(warm_dir: Path, tmp_path: Path) -> None:
    spec = slow_spec(tmp_path)
    thread, box, worker, server = launched_and_checkpointed(spec, warm_dir)
    os.kill(server, signal.SIGTERM)
    thread.join(timeout=120)
    assert not thread.is_alive()
    error = box.get("error")
    assert isinstance(error, TrainingPreempted) and error.retryable, box
    assert "will resume from its last checkpoint" in str(error)
    latest = CheckpointStore(spec.output_uri + "/checkpoints").latest()
    assert latest is not None and latest.step > 0
    deadline = time.monotonic() + 30
    while (running(server) or running(worker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(server) and not running(worker)
    log = "".join(p.read_text() for p in warm_dir.glob("*.log"))
    assert f"server pid {server}: SIGTERM; forwarding SIGTERM to 1 launch(es) in flight" in log
    assert f"server pid {server}: exiting after its launches stopped\n" in log  # none left to die with it
    resumed_from, _ = resume(spec, tmp_path, warm_dir, server)
    assert resumed_from == latest.step > 0  # the preemption's checkpoint, written after the server's SIGTERM


@pytest.mark.slow
def test_a_killed_server_leaves_an_infrastructure_error_and_the_next_launch_starts_a_fresh_server(warm_dir: Path, tmp_path: Path) -> None:
    spec = slow_spec(tmp_path)
    thread, box, worker, server = launched_and_checkpointed(spec, warm_dir)
    os.kill(server, signal.SIGKILL)
    thread.join(timeout=120)
    assert not thread.is_alive()
    error = box.get("error")
    assert isinstance(error, InfrastructureError) and error.retryable, box
    assert f"(warm server pid {server}) died before the launch ended" in str(error)
    assert not running(worker)
    assert list(warm_dir.glob("*.sock")), "the killed server's socket is left behind, refusing connections"
    latest = CheckpointStore(spec.output_uri + "/checkpoints").latest()
    assert latest is not None and latest.step > 0
    resumed_from, _ = resume(spec, tmp_path, warm_dir, server)
    assert resumed_from == latest.step

