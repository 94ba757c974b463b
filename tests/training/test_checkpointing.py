from __future__ import annotations

import collections
import hashlib
import json
import math
import random
import re
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from training.checkpointing import (
    MANIFEST,
    PAYLOAD,
    AsyncCheckpointWriter,
    CheckpointStore,
    CheckpointWriteError,
    SkippedCheckpointWarning,
    rng_state,
    set_rng_state,
    snapshot_to_cpu,
    young_daly_interval,
)


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(4, 3, generator=g), "b": torch.zeros(3)},
        "optimizer": {"state": {0: {"step": torch.tensor(float(seed))}}, "param_groups": [{"lr": 0.1}]},
        "sampler": {"epoch": 1, "position": 17 * seed},
    }


def _same(a: dict, b: dict) -> bool:
    return torch.equal(a["model"]["w"], b["model"]["w"]) and a["sampler"] == b["sampler"]


def _steps(store: CheckpointStore) -> list[int]:
    return [m["step"] for m in store.list_committed()]


@pytest.fixture
def sleeps() -> list[float]:
    return []


@pytest.fixture
def store(tmp_path: Path, sleeps: list[float]) -> CheckpointStore:
    return CheckpointStore(str(tmp_path / "ckpt"), keep_last=2, sleep=sleeps.append)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"keep_last": 0}, "keep_last=0 is invalid; it must be an integer >= 1"),
        ({"max_write_attempts": 0}, "max_write_attempts=0 is invalid; it must be an integer >= 1"),
        ({"retry_backoff_s": -1.0}, r"retry_backoff_s=-1.0 is invalid; it must be a finite number of seconds >= 0"),
        ({"fail_next_writes": -2}, "fail_next_writes=-2 is invalid; it must be an integer >= 0"),
        ({"root_uri": ""}, "root_uri='' is invalid; it must be a non-empty path or URI"),
    ],
)
def test_constructor_names_field_value_and_rule(tmp_path: Path, kwargs: dict, message: str) -> None:
    args = {"root_uri": str(tmp_path), **kwargs}
    with pytest.raises(ValueError, match=re.escape(message)):
        CheckpointStore(**args)


def test_commit_and_load_round_trip(store: CheckpointStore, tmp_path: Path) -> None:
    state = _state(1)
    uri = store.save(12, state, epoch=3, metrics={"val_acc": 0.75}, best=True)

    assert uri == f"{tmp_path}/ckpt/step-000000012"
    directory = tmp_path / "ckpt" / "step-000000012"
    assert sorted(p.name for p in directory.iterdir()) == [MANIFEST, PAYLOAD]
    manifest = json.loads((directory / MANIFEST).read_text())
    payload = (directory / PAYLOAD).read_bytes()
    assert manifest["files"] == {PAYLOAD: {"sha256": hashlib.sha256(payload).hexdigest(), "size": len(payload)}}
    assert (manifest["step"], manifest["epoch"], manifest["metrics"], manifest["best"]) == (12, 3, {"val_acc": 0.75}, True)

    loaded = store.latest()
    assert loaded is not None
    assert (loaded.uri, loaded.step, loaded.epoch, loaded.metrics, loaded.best) == (uri, 12, 3, {"val_acc": 0.75}, True)
    assert _same(loaded.state, state)
    assert loaded.state["optimizer"]["state"][0]["step"].item() == 1.0
    assert store.list_committed()[0]["uri"] == uri
    assert store.best().step == 12


def test_empty_store_has_nothing(store: CheckpointStore) -> None:
    assert store.latest() is None
    assert store.list_committed() == []


def test_retention_keeps_last_k_plus_best(store: CheckpointStore) -> None:
    for step in (1, 2, 3, 4, 5):
        store.save(step, _state(step), best=step == 2)
    assert _steps(store) == [5, 4, 2]

    store.save(6, _state(6), best=True)
    assert _steps(store) == [6, 5]
    assert store.best().step == 6


def test_saving_after_resuming_from_an_older_checkpoint_drops_the_abandoned_ones(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "ckpt"), keep_last=1)
    store.save(10, _state(1), best=True)
    store.save(20, _state(2))
    store.corrupt_latest()
    with pytest.warns(SkippedCheckpointWarning):
        assert store.latest().step == 10  # the run resumes here and continues
    store.save(15, _state(3))
    assert _steps(store) == [15, 10]
    assert store.latest().step == 15


def test_saving_a_step_again_replaces_it(store: CheckpointStore) -> None:
    store.save(3, _state(1))
    store.save(3, _state(2))
    assert _steps(store) == [3]
    assert _same(store.latest().state, _state(2))


def test_partial_directory_is_skipped_and_later_removed(store: CheckpointStore, tmp_path: Path) -> None:
    store.save(1, _state(1))
    partial = tmp_path / "ckpt" / "step-000000002"
    partial.mkdir()
    (partial / PAYLOAD).write_bytes((tmp_path / "ckpt" / "step-000000001" / PAYLOAD).read_bytes())

    with pytest.warns(SkippedCheckpointWarning, match=re.escape(f"{tmp_path}/ckpt/step-000000002") + ".*missing manifest"):
        loaded = store.latest()
    assert loaded.step == 1
    assert _steps(store) == [1]

    store.save(3, _state(3))
    assert not partial.exists()


def test_corrupted_newest_falls_back_to_previous(store: CheckpointStore) -> None:
    store.save(1, _state(1))
    store.save(2, _state(2))
    corrupted = store.corrupt_latest()
    assert corrupted.endswith("step-000000002")

    with pytest.warns(SkippedCheckpointWarning) as record:
        loaded = store.latest()
    assert loaded.step == 1 and _same(loaded.state, _state(1))
    [w] = record
    assert f"skipping checkpoint {corrupted}: checksum mismatch for file {PAYLOAD}" in str(w.message)


def test_unreadable_manifest_is_skipped(store: CheckpointStore, tmp_path: Path) -> None:
    store.save(1, _state(1))
    store.save(2, _state(2))
    (tmp_path / "ckpt" / "step-000000002" / MANIFEST).write_text("{not json")
    with pytest.warns(SkippedCheckpointWarning, match="step-000000002: unreadable manifest"):
        assert store.latest().step == 1


def test_skip_is_logged_too(store: CheckpointStore, caplog: pytest.LogCaptureFixture) -> None:
    store.save(1, _state(1))
    store.save(2, _state(2))
    uri = store.corrupt_latest()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        store.latest()
    assert any(uri in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)


def test_transient_write_failures_are_retried_with_backoff(store: CheckpointStore, sleeps: list[float]) -> None:
    store.fail_next_writes = 2
    store.save(1, _state(1))
    assert sleeps == [0.2, 0.4]
    assert store.fail_next_writes == 0
    assert store.latest().step == 1


def test_backoff_doubles_without_a_cap_and_each_retry_is_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    sleeps: list[float] = []
    store = CheckpointStore(str(tmp_path / "ckpt"), max_write_attempts=4, retry_backoff_s=40.0, sleep=sleeps.append)
    store.fail_next_writes = 3
    with caplog.at_level("WARNING", logger="trainyard.training.checkpointing"):
        store.save(1, _state(1))
    assert sleeps == [40.0, 80.0, 160.0]
    retries = [r.getMessage() for r in caplog.records if "retrying in" in r.getMessage()]
    assert [m.split("(attempt ")[1].split(")")[0] for m in retries] == ["1 of 4", "2 of 4", "3 of 4"]
    assert store.latest().step == 1


def test_failed_move_is_retried_and_leaves_no_temporary_files(
    store: CheckpointStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_mv = store.fs.mv
    failures = iter([TimeoutError("slow disk"), ConnectionError("reset")])

    def flaky_mv(src: str, dst: str, **kw: object) -> None:
        err = next(failures, None)
        if err is not None:
            raise err
        real_mv(src, dst, **kw)

    monkeypatch.setattr(store.fs, "mv", flaky_mv)
    store.save(1, _state(1))
    assert sorted(p.name for p in (tmp_path / "ckpt" / "step-000000001").iterdir()) == [MANIFEST, PAYLOAD]


def test_permanent_failure_raises_and_keeps_earlier_checkpoints(store: CheckpointStore, sleeps: list[float]) -> None:
    store.save(1, _state(1))
    store.save(2, _state(2))
    before = store.list_committed()

    store.fail_next_writes = 10
    with pytest.raises(CheckpointWriteError, match=re.escape(f"{store.uri(3)}/{PAYLOAD} after 3 attempts")) as info:
        store.save(3, _state(3))
    assert info.value.attempts == 3
    assert isinstance(info.value.__cause__, OSError)
    assert sleeps == [0.2, 0.4]

    assert store.list_committed() == before
    loaded = store.latest()
    assert loaded.step == 2 and _same(loaded.state, _state(2))


def test_state_that_cannot_be_pickled_is_not_retried(store: CheckpointStore, sleeps: list[float]) -> None:
    with pytest.raises(TypeError, match="pickle"):
        store.save(1, {"lock": threading.Lock()})
    assert sleeps == []
    assert store.latest() is None


def test_async_writer_blocks_only_for_the_copy(store: CheckpointStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ~50 MB state whose payload move is held by a gate: `submit` returns while the write is still held."""
    release_payload = threading.Event()
    payload_in_place = threading.Event()
    release_manifest = threading.Event()
    real_mv = store.fs.mv

    def gated_mv(src: str, dst: str, **kw: object) -> None:
        if dst.endswith(PAYLOAD):
            assert release_payload.wait(10)
            real_mv(src, dst, **kw)
            payload_in_place.set()
        else:
            assert release_manifest.wait(10)
            real_mv(src, dst, **kw)

    in_flight, peak = 0, 0
    real_save = store.save

    def counting_save(*args: object, **kw: object) -> str:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            return real_save(*args, **kw)
        finally:
            in_flight -= 1

    monkeypatch.setattr(store.fs, "mv", gated_mv)
    monkeypatch.setattr(store, "save", counting_save)
    state = {"w": torch.randn(13_107_200)}  # 52 MB of float32
    expected = state["w"].clone()

    writer = AsyncCheckpointWriter(store)
    writer.submit(1, state, metrics={"loss": 1.0})
    # submit returned although the payload cannot have been written: it waited for the copy only.
    assert writer.in_flight and not payload_in_place.is_set()
    first_block = writer.blocking_seconds
    state["w"].zero_()  # training goes on mutating the weights
    release_payload.set()

    # Payload in place, manifest not yet: the checkpoint does not count.
    assert payload_in_place.wait(10)
    assert writer.in_flight
    with pytest.warns(SkippedCheckpointWarning, match="step-000000001: missing manifest"):
        assert store.latest() is None
    release_manifest.set()

    writer.submit(2, state)  # waits for write 1 to finish first
    assert _steps(store) == [1]
    assert writer.wait() == store.uri(2)
    writer.close()

    assert peak == 1
    assert len(writer.save_seconds) == 2
    assert writer.blocking_seconds >= first_block
    latest = store.latest()
    assert latest.step == 2 and torch.equal(latest.state["w"], torch.zeros_like(expected))
    store.corrupt_latest()
    with pytest.warns(SkippedCheckpointWarning):
        first = store.latest()
    assert first.step == 1 and torch.equal(first.state["w"], expected)  # the copy taken at submit


def test_async_writer_surfaces_errors(store: CheckpointStore) -> None:
    store.max_write_attempts = 2
    store.fail_next_writes = 2
    writer = AsyncCheckpointWriter(store)
    writer.submit(1, _state(1))
    with pytest.raises(CheckpointWriteError, match="after 2 attempts"):
        writer.wait()
    assert writer.wait() is None  # raised once

    store.fail_next_writes = 2
    writer.submit(2, _state(2))
    with pytest.raises(CheckpointWriteError):
        writer.submit(3, _state(3))  # the failed write 2 is reported before 3 is taken
    writer.submit(4, _state(4))
    writer.close()
    assert _steps(store) == [4]
    with pytest.raises(RuntimeError, match="closed"):
        writer.submit(5, _state(5))


def test_snapshot_copies_tensors_and_keeps_structure() -> None:
    Pair = collections.namedtuple("Pair", "a b")
    shared = torch.ones(3, requires_grad=True)
    state = collections.OrderedDict(
        x=shared, y=shared, pair=Pair(torch.arange(2), [1, "s"]), arr=np.arange(3)
    )
    snap = snapshot_to_cpu(state)
    assert type(snap) is collections.OrderedDict and isinstance(snap["pair"], Pair)
    assert snap["x"] is snap["y"] and snap["x"] is not shared and not snap["x"].requires_grad
    with torch.no_grad():
        shared.zero_()
    assert torch.equal(snap["x"], torch.ones(3))
    assert snap["arr"] is not state["arr"] and snap["pair"].b == [1, "s"]


def _draws() -> tuple:
    return (random.random(), float(np.random.rand()), float(np.random.randn()), torch.rand(3).tolist())


def test_rng_round_trip_reproduces_draws(store: CheckpointStore) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.randn()  # leave a cached gaussian in numpy's state
    saved = rng_state()
    store.save(1, {"rng": saved})
    expected = _draws()

    _draws()
    set_rng_state(saved)
    assert _draws() == expected

    _draws()
    set_rng_state(store.latest().state["rng"])  # through torch.save / weights_only=True
    assert _draws() == expected


def test_young_daly_interval() -> None:
    assert young_daly_interval(60.0, 1000.0, 100) == pytest.approx(math.sqrt(2 * 60 * 36000))
    assert round(young_daly_interval(60.0, 1000.0, 100)) == 2078
    assert young_daly_interval(10.0, 5.0, 1) == pytest.approx(600.0)
    for args, field in (((0.0, 1.0, 1), "save_seconds"), ((1.0, -1.0, 1), "node_mtbf_hours"), ((1.0, 1.0, 0), "nodes")):
        with pytest.raises(ValueError, match=f"^{field}="):
            young_daly_interval(*args)


def test_s3_round_trip(s3_endpoint) -> None:
    store = CheckpointStore(
        s3_endpoint.root("runs/trial-0000/checkpoints"),
        keep_last=2,
        retry_backoff_s=0.0,
        storage_options={"client_kwargs": {"endpoint_url": s3_endpoint.url}},
    )
    for step in (1, 2, 3):
        store.save(step, _state(step), epoch=step, metrics={"val_acc": step / 10}, best=step == 1)
    assert _steps(store) == [3, 2, 1]

    keys = s3_endpoint.client().list_objects_v2(Bucket=s3_endpoint.bucket, Prefix="runs/")["Contents"]
    assert not [k["Key"] for k in keys if ".tmp-" in k["Key"]]

    loaded = store.latest()
    assert loaded.uri == f"s3://{s3_endpoint.bucket}/runs/trial-0000/checkpoints/step-000000003"
    assert (loaded.step, loaded.epoch, loaded.metrics) == (3, 3, {"val_acc": 0.3})
    assert _same(loaded.state, _state(3))

    corrupted = store.corrupt_latest()
    with pytest.warns(SkippedCheckpointWarning, match=re.escape(corrupted) + ": checksum mismatch"):
        assert store.latest().step == 2


# --- sharded checkpoints: every rank writes its part, rank 0 commits -------------------------------

from training.checkpointing import DTENSOR, CheckpointLayoutError, CheckpointUnusable, ShardSpec, merge_shards  # noqa: E402


def _marker(local: torch.Tensor, global_shape: list[int], offset: list[int]) -> dict:
    return {DTENSOR: 1, "local": local, "global_shape": global_shape, "offset": offset}


def _rank_state(rank: int) -> dict:
    # A 4x3 weight sharded on dim 0 over 2 ranks, a replicated bias, and per-rank bookkeeping.
    weight = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    return {
        "state_dict": {
            "w": _marker(weight[2 * rank: 2 * rank + 2].clone(), [4, 3], [2 * rank, 0]),
            "b": _marker(torch.ones(3), [3], [0]),
        },
        "global_step": 5,
    }


def _save_sharded(store: CheckpointStore, step: int, token: str, ranks=(0, 1)) -> list[str]:
    """Both ranks' saves at once, as two threads (rank 0 blocks until rank 1's shard is there)."""
    out: list = [None] * len(ranks)

    def run(i: int, rank: int) -> None:
        try:
            out[i] = store.save(step, _rank_state(rank), shard=ShardSpec(rank=rank, world_size=2, token=token, commit_timeout_s=5))
        except Exception as e:  # surfaced below
            out[i] = e

    threads = [threading.Thread(target=run, args=(i, r)) for i, r in enumerate(ranks)]
    for t in reversed(threads):  # rank 1 first or last makes no difference; start rank 0 last
        t.start()
    for t in threads:
        t.join()
    return out


def test_sharded_save_commits_once_every_rank_wrote_and_merges_back(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path))
    assert _save_sharded(store, 5, "a:1") == [store.uri(5)] * 2
    manifest = store.list_committed()[0]
    assert manifest["world_size"] == 2 and sorted(manifest["files"]) == ["shard-00000.pt", "shard-00001.pt"]
    mine = store.load("step-000000005", rank=1, world_size=2)
    assert torch.equal(mine.state["state_dict"]["w"]["local"], torch.arange(6, 12, dtype=torch.float32).reshape(2, 3))
    whole = store.latest()  # one process, every shard verified and merged
    assert torch.equal(whole.state["state_dict"]["w"], torch.arange(12, dtype=torch.float32).reshape(4, 3))
    assert torch.equal(whole.state["state_dict"]["b"], torch.ones(3)) and whole.state["global_step"] == 5


def test_sharded_save_never_commits_with_a_stale_shard_of_an_earlier_attempt(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), max_write_attempts=1)
    _save_sharded(store, 5, "old:1")
    store.fs.rm(str(tmp_path / "step-000000005" / MANIFEST))  # the old attempt never committed
    # The new attempt's rank 1 dies before writing: rank 0 must not commit with the old sidecar.
    (result,) = _save_sharded(store, 5, "new:1", ranks=(0,))
    assert isinstance(result, CheckpointWriteError) and "rank(s) [1] did not write their shard" in str(result)
    assert store.latest() is None


def test_sharded_checkpoint_refuses_another_world_size_with_the_fix(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path))
    _save_sharded(store, 5, "a:1")
    with pytest.raises(CheckpointLayoutError, match="sharded over 2 ranks but this run has 4.*same distribution"):
        store.load("step-000000005", rank=0, world_size=4)


def test_a_corrupt_shard_makes_the_checkpoint_unusable_for_that_rank_only(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path))
    _save_sharded(store, 5, "a:1")
    assert store.corrupt_latest().endswith("step-000000005")
    with pytest.raises(CheckpointUnusable, match="checksum mismatch for file shard-00000.pt"):
        store.load("step-000000005", rank=0, world_size=2)
    assert store.load("step-000000005", rank=1, world_size=2).step == 5  # the ranks must agree (entrypoint)
    with pytest.warns(SkippedCheckpointWarning, match="shard-00000.pt"):
        assert store.latest() is None


def test_merge_refuses_shards_that_do_not_cover_the_tensor() -> None:
    half = _marker(torch.zeros(2, 3), [4, 3], [0, 0])
    with pytest.raises(Exception, match=r"do not cover"):
        merge_shards([{"w": half}, {"w": half}])


def test_discard_after_removes_an_abandoned_timeline(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), keep_last=5)
    for step in (4, 8, 12):
        store.save(step, {"x": torch.zeros(1)})
    assert store.discard_after(4) == [store.uri(8), store.uri(12)]
    assert [m["step"] for m in store.list_committed()] == [4]


def test_sharded_save_on_s3_commits_and_merges(s3_endpoint) -> None:
    def store() -> CheckpointStore:  # one client per "rank", as in separate processes
        return CheckpointStore(s3_endpoint.root("runs/trial-0001/checkpoints"), retry_backoff_s=0.0,
                               storage_options={"client_kwargs": {"endpoint_url": s3_endpoint.url}})

    results: dict = {}
    threads = [threading.Thread(target=lambda r=r: results.__setitem__(r, store().save(
        7, _rank_state(r), shard=ShardSpec(rank=r, world_size=2, token="s3:1", commit_timeout_s=30)))) for r in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results[0] == results[1] == f"s3://{s3_endpoint.bucket}/runs/trial-0001/checkpoints/step-000000007"
    whole = store().latest()
    assert whole.world_size == 2 and torch.equal(whole.state["state_dict"]["w"], torch.arange(12, dtype=torch.float32).reshape(4, 3))
    assert store().load("step-000000007", rank=0, world_size=2).state["global_step"] == 5
