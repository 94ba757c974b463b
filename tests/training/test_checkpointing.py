from __future__ import annotations

import collections
import copy
import hashlib
import json
import math
import random
import re
import threading
import warnings
import weakref
from pathlib import Path
from typing import Any

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


def _tree(data: bytes, leaf: int = 16 * 2**20) -> str:
    """The manifest's file hash, computed here from its definition: sha256 of each leaf, then of their digests."""
    return hashlib.sha256(
        b"".join(hashlib.sha256(data[i : i + leaf]).digest() for i in range(0, len(data), leaf))
    ).hexdigest()


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
    assert manifest["files"] == {
        PAYLOAD: {"sha256_tree": _tree(payload), "leaf_bytes": 16 * 2**20, "size": len(payload)}
    }
    assert manifest["format_version"] == 2
    assert (manifest["step"], manifest["epoch"], manifest["metrics"], manifest["best"]) == (
        12,
        3,
        {"val_acc": 0.75},
        True,
    )

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

    with pytest.warns(
        SkippedCheckpointWarning, match=re.escape(f"{tmp_path}/ckpt/step-000000002") + ".*missing manifest"
    ):
        loaded = store.latest()
    assert loaded.step == 1
    assert _steps(store) == [1]

    store.save(3, _state(3))
    store.flush()  # retention deletes in the background
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


def test_backoff_doubles_without_a_cap_and_each_retry_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
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
from training.checkpointing.sharding import Region, assemble_regions  # noqa: E402


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
            out[i] = store.save(
                step, _rank_state(rank), shard=ShardSpec(rank=rank, world_size=2, token=token, commit_timeout_s=5)
            )
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


def test_a_sharded_checkpoint_read_at_another_world_size_is_verified_in_shares_and_resharded(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path))
    _save_sharded(store, 5, "a:1")  # 2 ranks: rows 0-1 and 2-3 of a 4x3 weight
    # At 4 ranks each rank verifies its share of the saved shards and gets saved rank 0's state, its tensors elided.
    views = [store.load("step-000000005", rank=r, world_size=4) for r in range(4)]
    for view in views:
        assert view.world_size == 2 and view.state["global_step"] == 5
        w = view.state["state_dict"]["w"]
        assert w["elided"] and w["local"].numel() == 0 and w["global_shape"] == [4, 3]
    # Rank 3 of 4 holds row 3 now: assembled from the saved shards, read one at a time.
    regions = {("state_dict", "w"): Region([4, 3], [1, 3], [3, 0], torch.float32, "weight 'w'")}
    (row,) = assemble_regions(regions, store.iter_shards("step-000000005")).values()
    assert torch.equal(row, torch.arange(9, 12, dtype=torch.float32).reshape(1, 3))
    # A corrupt shard is found by the rank whose share it is (rank 1 of 4 verifies saved shard 1), so the ranks skip it
    # together.
    data = bytearray((tmp_path / "step-000000005" / "shard-00001.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (tmp_path / "step-000000005" / "shard-00001.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointUnusable, match="checksum mismatch for file shard-00001.pt"):
        store.load("step-000000005", rank=1, world_size=4)
    assert store.load("step-000000005", rank=2, world_size=4).step == 5  # shard 0 only


def test_a_region_is_assembled_from_the_saved_pieces_that_intersect_it() -> None:
    full = torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4)
    # Saved by a 2-D mesh: rows in 3 data-parallel blocks x columns in 2 tensor-parallel halves, each block written
    # twice
    # (a replicated placement writes the same piece on several ranks).
    saved = [
        {"m": {"w": _marker(full[r : r + 2, c : c + 2].clone(), [6, 4], [r, c])}}
        for r in (0, 2, 4)
        for c in (0, 2)
        for _ in range(2)
    ]
    # Now FSDP over 4 ranks (torch's chunks of 6 rows: 2, 2, 2, 0), and one rank holding everything.
    for shape, offset in [([2, 4], [0, 0]), ([2, 4], [4, 0]), ([0, 4], [6, 0]), ([6, 4], [0, 0]), ([3, 1], [2, 3])]:
        region = Region([6, 4], shape, offset, torch.float32, "w")
        (got,) = assemble_regions({("m", "w"): region}, iter(saved)).values()
        assert torch.equal(got, full[offset[0]:offset[0] + shape[0], offset[1]:offset[1] + shape[1]]), (shape, offset)
    # One saved shard at a time: each is released before the next is read.
    alive: list = []

    def one_at_a_time():
        for piece in saved:
            assert all(ref() is None for ref in alive), "a saved shard is still held while the next is read"
            shard = copy.deepcopy(piece)
            alive.append(weakref.ref(shard["m"]["w"]["local"]))
            yield shard
            del shard

    (got,) = assemble_regions(
        {("m", "w"): Region([6, 4], [6, 4], [0, 0], torch.float32, "w")}, one_at_a_time()
    ).values()
    assert torch.equal(got, full) and len(alive) == len(saved)
    # The last piece lost: the region it held is not covered; another global shape is another model.
    with pytest.raises(CheckpointLayoutError, match=r"cover 20 of the 24 values"):
        assemble_regions({("m", "w"): Region([6, 4], [6, 4], [0, 0], torch.float32, "w")}, iter(saved[:-2]))
    with pytest.raises(CheckpointLayoutError, match=r"has shape \[6, 4\], the model's \[8, 4\]"):
        assemble_regions({("m", "w"): Region([8, 4], [2, 4], [0, 0], torch.float32, "w")}, iter(saved))
    with pytest.raises(CheckpointLayoutError, match="lacks w"):
        assemble_regions({("m", "v"): Region([6, 4], [2, 4], [0, 0], torch.float32, "w")}, iter(saved))


@pytest.fixture
def one_rank_mesh() -> Any:
    """A device mesh over this process alone (a one-rank gloo group), for real DTensors without other processes."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield init_device_mesh("cpu", (1,))
    if started:
        dist.destroy_process_group()


def test_a_sharded_checkpoint_of_another_model_is_refused_not_resharded(tmp_path: Path, one_rank_mesh: Any) -> None:
    """Another world size is resharded; tensors of other global shapes (another model) or unsharded ones cannot be."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from training.strategies import _place

    store = CheckpointStore(str(tmp_path))
    _save_sharded(store, 5, "a:1")
    saved = store.load("step-000000005", rank=0, world_size=1).state["state_dict"]["w"]
    regions: dict = {}
    same = distribute_tensor(torch.zeros(4, 3), one_rank_mesh, [Shard(0)])
    assert _place(saved, same, "weight 'w'", ("state_dict", "w"), regions) is saved and regions[
        ("state_dict", "w")
    ].tensor.shape == (4, 3)
    wider = distribute_tensor(torch.zeros(8, 3), one_rank_mesh, [Shard(0)])
    with pytest.raises(CheckpointLayoutError, match=r"weight 'w' has shape \[4, 3\], the model's \[8, 3\]"):
        _place(saved, wider, "weight 'w'", ("state_dict", "w"), {})
    with pytest.raises(CheckpointLayoutError, match="the model's weight 'w' is not sharded"):
        _place(saved, torch.zeros(4, 3), "weight 'w'", ("state_dict", "w"), {})


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
    assert whole.world_size == 2 and torch.equal(
        whole.state["state_dict"]["w"], torch.arange(12, dtype=torch.float32).reshape(4, 3)
    )
    assert store().load("step-000000007", rank=0, world_size=2).state["global_step"] == 5


# --- integrity of large payloads: hashed in leaves while written, verified on every load ----------

import io  # noqa: E402
import zipfile  # noqa: E402

import training.checkpointing.files as ckpt_files  # noqa: E402
from training.checkpointing.files import HashingWriter  # noqa: E402

SMALL_LEAF = 64 * 1024


@pytest.fixture
def small_leaves(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Leaves of 64 KiB and inline hashing below 4 KiB, so a 1 MB tensor takes the pipelined, threaded path;
    records the descriptors whose early write-out was started."""
    monkeypatch.setattr(ckpt_files, "LEAF", SMALL_LEAF)
    monkeypatch.setattr(ckpt_files, "_INLINE", 4096)
    monkeypatch.setattr(ckpt_files, "_HASH_THREADS", 3)
    started: list[int] = []
    monkeypatch.setattr(ckpt_files, "_start_writeback", started.append)
    return started


def _big_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(1000, 250, generator=g), "b": torch.randn(37, generator=g)}, "step": seed}


def _same_big(a: dict, b: dict) -> bool:
    return all(torch.equal(a["model"][k], b["model"][k]) for k in ("w", "b")) and a["step"] == b["step"]


def test_writer_hashes_every_byte_in_order_and_returns_only_when_done(small_leaves: list[int]) -> None:
    rng = random.Random(7)
    sink = io.BytesIO()
    written = bytearray()
    with HashingWriter(sink) as writer:
        for n in [10, 5000, 3 * SMALL_LEAF + 17, 1, SMALL_LEAF - 28, 200_000, 0, 4095, 70_000]:
            buf = bytearray(rng.randbytes(n))
            assert writer.write(buf) == n
            written += buf
            buf[:] = bytes(n)  # the caller reuses its buffer at once: what was written must be hashed already
    assert sink.getvalue() == bytes(written) and writer.size == len(written)
    assert writer.meta() == {
        "size": len(written),
        "sha256_tree": _tree(bytes(written), SMALL_LEAF),
        "leaf_bytes": SMALL_LEAF,
    }


def test_large_payload_round_trip_records_the_tree_hash_of_the_file(store: CheckpointStore, tmp_path: Path,
                                                                   small_leaves: list[int]) -> None:
    state = _big_state(1)
    store.save(1, state)
    payload = (tmp_path / "ckpt" / "step-000000001" / PAYLOAD).read_bytes()
    manifest = json.loads((tmp_path / "ckpt" / "step-000000001" / MANIFEST).read_text())
    assert len(payload) > 10 * SMALL_LEAF
    assert manifest["files"][PAYLOAD] == {
        "size": len(payload),
        "sha256_tree": _tree(payload, SMALL_LEAF),
        "leaf_bytes": SMALL_LEAF,
    }
    assert small_leaves and all(isinstance(fd, int) for fd in small_leaves)  # local disk: write-out started early
    assert _same_big(store.latest().state, state)


def test_payload_is_a_torch_file_without_torch_crc32_the_manifest_hash_covers_it(
    store: CheckpointStore, tmp_path: Path
) -> None:
    state = _big_state(2)
    store.save(1, state)
    path = tmp_path / "ckpt" / "step-000000001" / PAYLOAD
    assert {i.CRC for i in zipfile.ZipFile(path).infolist()} == {
        0
    }  # the crc32 pass is skipped (it was as slow as the write)
    assert _same_big(torch.load(path, weights_only=True), state)  # still an ordinary torch.save file


@pytest.mark.parametrize("damage", ["first byte", "tensor data", "last byte", "one byte more", "one byte less"])
def test_damage_anywhere_in_a_payload_is_detected(
    store: CheckpointStore, tmp_path: Path, small_leaves: list[int], damage: str
) -> None:
    store.save(1, _big_state(1))
    store.save(2, _big_state(2))
    path = tmp_path / "ckpt" / "step-000000002" / PAYLOAD
    data = bytearray(path.read_bytes())
    if damage == "one byte more":
        data += b"\0"
    elif damage == "one byte less":
        del data[-1]
    else:
        at = {"first byte": 0, "tensor data": len(data) * 3 // 4, "last byte": len(data) - 1}[damage]
        data[at] ^= 0x01  # a single bit
    path.write_bytes(bytes(data))
    why = "size mismatch" if "one byte" in damage else "checksum mismatch"
    with pytest.warns(SkippedCheckpointWarning, match=f"step-000000002: {why} for file {PAYLOAD}"):
        loaded = store.latest()
    assert loaded.step == 1 and _same_big(loaded.state, _big_state(1))
    with pytest.raises(CheckpointUnusable, match=why):
        store.load("step-000000002")


def test_format_1_checkpoint_with_a_plain_sha256_still_loads_and_is_verified(
    store: CheckpointStore, tmp_path: Path
) -> None:
    # As written before the tree hash: torch.save with crc32, the file's plain sha256 in the manifest.
    store.save(1, _state(1))
    old = tmp_path / "ckpt" / "step-000000002"
    old.mkdir()
    buf = io.BytesIO()
    torch.save(_big_state(2), buf)
    (old / PAYLOAD).write_bytes(buf.getvalue())
    manifest = {"format_version": 1, "step": 2, "epoch": 0, "created_unix": 0.0, "created": "1970-01-01T00:00:00+00:00",
                "metrics": {}, "best": False,
                "files": {PAYLOAD: {"sha256": hashlib.sha256(buf.getvalue()).hexdigest(), "size": len(buf.getvalue())}}}
    (old / MANIFEST).write_text(json.dumps(manifest))
    assert _same_big(store.latest().state, _big_state(2))

    store.corrupt_latest()
    with pytest.warns(SkippedCheckpointWarning, match=f"step-000000002: checksum mismatch for file {PAYLOAD}"):
        assert store.latest().step == 1


@pytest.mark.parametrize("leaf", [None, 1, "16777216"])
def test_a_manifest_with_a_tree_hash_but_no_usable_leaf_size_is_unreadable(
    store: CheckpointStore, tmp_path: Path, leaf: Any
) -> None:
    store.save(1, _state(1))
    store.save(2, _state(2))
    path = tmp_path / "ckpt" / "step-000000002" / MANIFEST
    manifest = json.loads(path.read_text())
    if leaf is None:
        del manifest["files"][PAYLOAD]["leaf_bytes"]
    else:
        manifest["files"][PAYLOAD]["leaf_bytes"] = leaf
    path.write_text(json.dumps(manifest))
    with pytest.warns(SkippedCheckpointWarning, match="step-000000002: unreadable manifest"):
        assert store.latest().step == 1


class _FailingFile:
    """Passes writes through until `fail_after` bytes, then raises OSError: a disk or connection failing mid-payload."""

    def __init__(self, f: Any, fail_after: int, failures: list[str], path: str) -> None:
        self._f, self._left, self._failures, self._path = f, fail_after, failures, path

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        if n > self._left:
            self._failures.append(self._path)
            raise OSError("injected failure in the middle of the payload")
        self._left -= n
        return self._f.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


@pytest.mark.parametrize("failing_attempts", [1, 3])
def test_a_write_failing_midway_never_leaves_a_visible_or_partial_checkpoint(
    store: CheckpointStore,
    tmp_path: Path,
    small_leaves: list[int],
    monkeypatch: pytest.MonkeyPatch,
    failing_attempts: int,
) -> None:
    store.save(1, _big_state(1))
    real_open = store.fs.open
    attempts: list[str] = []

    def open_failing(path: str, mode: str = "rb", **kw: Any) -> Any:
        f = real_open(path, mode, **kw)
        if mode == "wb" and "step-000000002" in path and len(attempts) < failing_attempts:
            return _FailingFile(f, 5 * SMALL_LEAF + 123, attempts, path)  # fails inside the 1 MB tensor's write
        return f

    monkeypatch.setattr(store.fs, "open", open_failing)
    directory = tmp_path / "ckpt" / "step-000000002"
    if failing_attempts >= store.max_write_attempts:
        with pytest.raises(CheckpointWriteError, match="after 3 attempts"):
            store.save(2, _big_state(2))
        assert store.latest().step == 1
        assert not (directory / MANIFEST).exists() and not (directory / PAYLOAD).exists()
    else:
        store.save(2, _big_state(2))
        assert _same_big(store.latest().state, _big_state(2))
    assert len(attempts) == failing_attempts and all(".tmp-" in p for p in attempts)
    assert not [p.name for p in directory.iterdir() if p.name.startswith(".tmp-")]  # staged files discarded
    assert threading.active_count() < 20  # hashing threads stopped


def test_sharded_manifest_carries_each_shards_tree_hash(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path))
    _save_sharded(store, 5, "a:1")
    files = store.list_committed()[0]["files"]
    for rank in (0, 1):
        data = (tmp_path / "step-000000005" / f"shard-0000{rank}.pt").read_bytes()
        assert files[f"shard-0000{rank}.pt"] == {
            "size": len(data),
            "sha256_tree": _tree(data),
            "leaf_bytes": 16 * 2**20,
        }


def test_large_payload_on_s3_is_hashed_in_leaves_and_verified(s3_endpoint, small_leaves: list[int]) -> None:
    store = CheckpointStore(s3_endpoint.root("runs/trial-0002/checkpoints"), retry_backoff_s=0.0,
                            storage_options={"client_kwargs": {"endpoint_url": s3_endpoint.url}})
    store.save(1, _big_state(1))
    store.save(2, _big_state(2))
    assert small_leaves == []  # no local descriptor on S3: nothing to start early
    meta = store.list_committed()[0]["files"][PAYLOAD]
    assert meta["leaf_bytes"] == SMALL_LEAF and meta["size"] > 10 * SMALL_LEAF
    assert _same_big(store.latest().state, _big_state(2))
    store.corrupt_latest()
    with pytest.warns(SkippedCheckpointWarning, match="step-000000002: checksum mismatch"):
        assert store.latest().step == 1


def test_region_of_reaches_torchs_private_helper() -> None:
    """`training.checkpointing.sharding.region_of` is the one adapter to torch's private
    `compute_local_shape_and_global_offset`."""
    import torch.distributed.tensor._utils as dtensor_utils

    assert callable(getattr(dtensor_utils, "compute_local_shape_and_global_offset", None)), (
        "torch moved compute_local_shape_and_global_offset"
    )
