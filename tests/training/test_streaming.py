"""The pod's streaming data path (`training.streaming`): batches, the canonical order, resume, the bounded cache."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from litdata import StreamingDataset
from litdata.streaming.item_loader import TokensLoader

from tests.support.shards import write_splits
from training.errors import ConfigError
from training.stream_order import EpochStream, worker_plan
from training.streaming import ShardLoader, StreamingShardDataModule, _PlannedDataset

B = 4


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return write_splits(str(tmp_path_factory.mktemp("text")), "text", n_docs=300, block_size=8)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return write_splits(str(tmp_path_factory.mktemp("images")), "image", n=400)


def text_module(paths: dict[str, str], **kw: Any) -> StreamingShardDataModule:
    return StreamingShardDataModule(
        paths["train"], paths["val"], paths["test"], batch_size=kw.pop("batch_size", B), return_ids=True, **kw
    )


def ids_of(loader: Any, batches: int | None = None) -> list[list[int]]:
    out = []
    for k, batch in enumerate(loader):
        if batches is not None and k == batches:
            break
        out.append(batch[-1].tolist())
    return out


def flat(batches: list[list[int]]) -> list[int]:
    return [i for b in batches for i in b]


# -- batches --------------------------------------------------------------------------------------


def test_text_batches_are_blocks_and_their_next_tokens(text: dict[str, str]) -> None:
    dm = text_module(text)
    assert (dm.kind, dm.vocab_size, dm.eos_id, dm.block_size) == ("text", 64, 63, 8)
    plain = StreamingDataset(text["train"], item_loader=TokensLoader(block_size=9))
    x, y, ids = next(iter(dm.train_dataloader()))
    assert (
        x.shape == y.shape == (B, 8)
        and x.dtype == y.dtype == torch.int32
        and ids.dtype == torch.int64
        and ids.shape == (B,)
    )
    assert x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()  # views of one stacked block: no copies
    for row, i in enumerate(ids.tolist()):  # the id is the block's index in the split's stream
        block = torch.as_tensor(plain[i]).long()
        assert torch.equal(x[row], block[:-1]) and torch.equal(y[row], block[1:])
    without = StreamingShardDataModule(text["train"], text["val"], text["test"], batch_size=B)
    assert len(next(iter(without.train_dataloader()))) == 2


def test_block_size_from_the_pipeline_wins_over_the_meta(text: dict[str, str]) -> None:
    dm = text_module(text, block_size=5)
    x, y, _ = next(iter(dm.train_dataloader()))
    assert dm.block_size == 5 and x.shape == (B, 5)


def test_image_batches_are_scaled_channels_first_with_item_ids(images: dict[str, str]) -> None:
    from sklearn.datasets import load_digits

    digits = load_digits()
    dm = StreamingShardDataModule(
        images["train"], images["val"], images["test"], batch_size=8, task="classification", return_ids=True
    )
    assert (dm.kind, dm.input_shape, dm.n_features, dm.n_classes, dm.classes()) == (
        "image",
        [1, 8, 8],
        64,
        10,
        list(range(10)),
    )
    x, y, ids = next(iter(dm.train_dataloader()))
    assert x.shape == (8, 1, 8, 8) and x.dtype == torch.float32 and y.dtype == ids.dtype == torch.int64
    for row, i in enumerate(ids.tolist()):
        assert torch.allclose(x[row, 0], torch.tensor(digits.images[i] / 16.0, dtype=torch.float32))
        assert y[row].item() == digits.target[i]
    assert dm.class_counts() == np.bincount(digits.target[:400], minlength=10).tolist()
    assert dm.example_input().shape == (2, 1, 8, 8)


def test_rgb_images_come_channels_first(tmp_path: Path) -> None:
    paths = write_splits(str(tmp_path), "image", n=20, digits=False, shape=(4, 6, 3))
    dm = StreamingShardDataModule(paths["train"], paths["val"], paths["test"], batch_size=4, task="classification")
    x, _ = next(iter(dm.val_dataloader()))
    plain = StreamingDataset(paths["val"])
    assert dm.input_shape == [3, 4, 6] and x.shape == (4, 3, 4, 6)
    assert torch.allclose(x[1], torch.from_numpy(plain[1]["image"]).permute(2, 0, 1).float() / 255)


# -- the order ------------------------------------------------------------------------------------


def test_interleaving_the_ranks_gives_back_the_one_rank_stream(text: dict[str, str]) -> None:
    dm = text_module(text)
    one = ids_of(dm._loader("train", train=True))
    ranks = [ids_of(dm._loader("train", train=True, rank=r, world=2)) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1])  # drop_last: every rank the same number of batches
    interleaved = [b for pair in zip(*ranks) for b in pair]
    assert interleaved == one[: len(interleaved)] and len(one) - len(interleaved) <= 1


@pytest.mark.parametrize("workers", [1, 2])
def test_loader_workers_do_not_change_the_stream(text: dict[str, str], workers: int) -> None:
    assert ids_of(text_module(text, num_workers=workers).train_dataloader()) == ids_of(
        text_module(text).train_dataloader()
    )


def test_an_epoch_reads_every_sample_once_over_the_ranks(text: dict[str, str]) -> None:
    dm = text_module(text)
    loaders = [dm._loader("train", train=True, rank=r, world=2) for r in range(2)]
    n = loaders[0].samples
    seen = flat(ids_of(loaders[0])) + flat(ids_of(loaders[1]))
    assert len(seen) == len(set(seen)) == 2 * B * (n // (2 * B))
    assert set(seen) <= set(range(n)) and n - len(seen) < 2 * B


def test_epochs_are_seeded_permutations(text: dict[str, str]) -> None:
    loader = text_module(text).train_dataloader()
    e0, e1 = flat(ids_of(loader)), flat(ids_of(loader))
    assert e0 != e1 and e0 == flat(ids_of(text_module(text).train_dataloader()))
    assert e0 != flat(ids_of(text_module(text, seed=1).train_dataloader()))
    assert e0 != sorted(e0)  # shuffled, across chunks too
    assert flat(ids_of(text_module(text).val_dataloader())) == list(range(text_module(text).val_dataloader().samples))


def test_worker_plan_splits_batches_at_chunk_boundaries() -> None:
    stream = EpochStream([(0, 3), (3, 8)], seed=0, epoch=0, shuffle=False)
    visits = worker_plan(stream, batch_size=2, world=1, rank=0, num_workers=1, worker=0)
    assert [(v.position, v.pieces) for v in visits] == [(0, [(0, 2), (2, 3)]), (1, [(0, 1), (1, 3), (3, 5)])]
    # 2 workers: worker 1 reads the rank's batches 1 and 3 (positions 2-3 and 6-7)
    assert [(v.position, v.pieces) for v in worker_plan(stream, 2, 1, 0, 2, 1)] == [
        (0, [(2, 3)]),
        (1, [(0, 1), (3, 5)]),
    ]


# -- resume ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_starts_at_the_first_untrained_batch(text: dict[str, str], workers: int) -> None:
    dm = text_module(text, num_workers=workers)
    reference = ids_of(dm._loader("train", train=True, rank=1, world=2))
    loader = dm._loader("train", train=True, rank=1, world=2)
    it = iter(loader)
    for _ in range(9):  # read ahead of what was trained, as Lightning's fetcher and the workers do
        next(it)
    loader.mark_consumed(0, 6)
    state = loader.state_dict()
    resumed = dm._loader("train", train=True, rank=1, world=2)
    resumed.load_state_dict(state)
    assert ids_of(resumed) == reference[6:]
    assert ids_of(resumed) == ids_of(
        dm._loader("train", train=True, rank=1, world=2, epoch=1)
    )  # then the next epoch whole


def test_a_state_saved_at_the_end_of_an_epoch_resumes_at_the_next(text: dict[str, str]) -> None:
    dm = text_module(text)
    loader = dm.train_dataloader()
    loader.mark_consumed(2, len(loader))
    resumed = dm.train_dataloader()
    resumed.load_state_dict(loader.state_dict())
    assert ids_of(resumed) == ids_of(dm._loader("train", train=True, epoch=3))


@pytest.mark.parametrize(("before", "after", "done"), [(2, 1, 5), (2, 4, 3), (4, 2, 3), (4, 3, 2)])
def test_resume_on_another_world_size_continues_the_stream(
    text: dict[str, str], before: int, after: int, done: int
) -> None:
    """`done` batches trained on each of `before` ranks, resumed on `after`: the stream goes on at the next untrained
    sample, a whole global batch of the new world or not (3 x 2 x 4 samples are one and a half of 4 ranks' batches)."""
    dm = text_module(text)
    stream = flat(ids_of(dm._loader("train", train=True)))  # one rank: global batch g is positions [g*B, (g+1)*B)
    old = dm._loader("train", train=True, rank=0, world=before)
    old.mark_consumed(0, done)
    start = done * before * B
    loaders = [dm._loader("train", train=True, rank=r, world=after) for r in range(after)]
    for loader in loaders:
        loader.load_state_dict(old.state_dict())
    resumed = [ids_of(loader) for loader in loaders]
    # Interleaving the ranks' batches (rank r trains the remainder's global batches r, r + after, ...) gives the stream
    # back.
    merged = [i for j in range(len(resumed[0])) for r in range(after) for i in resumed[r][j]]
    assert merged == stream[start:start + len(merged)] and len(stream) - start - len(merged) < after * B
    assert not set(merged) & set(stream[:start])
    # Each loader counts the resumed position in its own batches (what the trainer's loop is aligned to), and saves it
    # in samples.
    for loader, batches in zip(loaders, resumed):
        assert (loader.consumed[0], len(loader) - loader.consumed[1]) == (0, len(batches))
    loaders[0].mark_consumed(0, loaders[0].consumed[1] + 2)
    assert loaders[0].state_dict()["samples_done"] == start + 2 * after * B


def test_fault_tolerance_records_the_trained_position_on_the_loader(text: dict[str, str]) -> None:
    from training.fault_tolerance import _train_sampler

    loader = text_module(text).train_dataloader()

    class Trainer:
        train_dataloader = loader

    assert _train_sampler(Trainer()) is loader  # type: ignore[arg-type]


# -- storage --------------------------------------------------------------------------------------


def test_meta_facts_tokenizer_and_token_counts(text: dict[str, str]) -> None:
    dm = text_module(text)
    assert (
        dm.tokenizer_path is not None
        and open(dm.tokenizer_path).read() == open(os.path.join(text["train"], "tokenizer.json")).read()
    )
    assert dm.tokenizer_path.startswith(dm.cache_dir)
    counts = dm.train_token_counts()
    assert counts is not None and counts.shape == (64,) and counts.sum() == dm.meta["tokens"]
    cache = dm.cache_dir
    dm.teardown("fit")
    assert not os.path.exists(cache)  # a temporary cache of its own goes at teardown
    assert dm.classes() == [] and dm.class_counts() == []


def test_eval_loader_reads_the_whole_split_without_ids(text: dict[str, str]) -> None:
    dm = text_module(text)
    batches = list(dm.eval_dataloader("val"))
    assert all(len(b) == 2 for b in batches)
    assert sum(len(b[0]) for b in batches) == dm.val_dataloader().samples


def test_wrong_arguments_fail_naming_them(text: dict[str, str], images: dict[str, str], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="causal_lm"):
        text_module(text, task="classification")
    with pytest.raises(ConfigError, match="classification"):
        StreamingShardDataModule(images["train"], images["val"], images["test"], task="causal_lm")
    with pytest.raises(ValueError, match="batch_size"):
        text_module(text, batch_size=0)
    with pytest.raises(ConfigError, match="cannot be read"):
        StreamingShardDataModule(str(tmp_path), str(tmp_path), str(tmp_path))
    with pytest.raises(ValueError, match="persistent_workers"):
        ShardLoader(text_module(text)._dataset("train"), batch_size=2, persistent_workers=True, num_workers=1)


def test_litdata_still_has_what_the_adapter_uses() -> None:
    """`_PlannedDataset` drives litdata's reader through these; an upgrade that renames one fails here, by name."""
    for name in ("_create_cache", "_create_shuffler", "__next__", "state_dict"):
        assert callable(getattr(StreamingDataset, name, None)), name
    source = open(StreamingDataset.__next__.__code__.co_filename).read()
    for attr in (
        "worker_chunks",
        "worker_intervals",
        "_elastic_item_lists",
        "stop_length",
        "num_chunks",
        "upcoming_indexes",
        "worker_next_chunk_index",
        "global_index",
        "has_triggered_download",
        "acquire_shared_locks",
        "enable_mmap_for_chunks",
    ):
        assert f".{attr}" in source, attr
    assert issubclass(_PlannedDataset, StreamingDataset)
    from litdata.streaming import downloader

    assert isinstance(downloader._OBSTORE_CLIENT_OPTIONS, dict)  # allow_plain_http_endpoint adds allow_http to them


def test_s3_reads_through_a_bounded_cache(
    text: dict[str, str], s3_endpoint: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    client = s3_endpoint.client()
    for split, path in text.items():
        for name in os.listdir(path):
            client.upload_file(os.path.join(path, name), s3_endpoint.bucket, f"shards/{split}/{name}")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint.url)
    chunk_sizes = [
        os.path.getsize(os.path.join(text["train"], n)) for n in os.listdir(text["train"]) if n.endswith(".bin")
    ]
    assert len(chunk_sizes) >= 8
    bound = 3 * max(chunk_sizes)
    cache = tmp_path / "cache"
    remote = {s: s3_endpoint.root("shards", s) for s in text}
    dm = StreamingShardDataModule(
        remote["train"],
        remote["val"],
        remote["test"],
        batch_size=B,
        return_ids=True,
        cache_dir=str(cache),
        max_cache_bytes=bound,
    )
    assert dm.vocab_size == 64 and dm.train_token_counts() is not None

    def cached() -> int:  # litdata may delete a chunk between the listing and its stat
        total = 0
        for f in cache.rglob("*.bin"):
            try:
                total += f.stat().st_size
            except FileNotFoundError:
                pass
        return total

    peak, got = 0, []
    for batch in dm.train_dataloader():
        got.append(batch[2].tolist())
        peak = max(peak, cached())
    assert got == ids_of(text_module(text).train_dataloader())  # the same stream as from a local copy
    assert 0 < peak <= bound + max(chunk_sizes), (peak, bound)
    assert len(list(dm.eval_dataloader("val"))) > 0


# -- the drill: a rank killed mid-epoch under torchrun ------------------------------------------------

DRILL_BATCH, DRILL_EVERY, DRILL_KILL = 16, 4, 10  # 400 train images: 12 batches a rank an epoch on 2 ranks


def drill_spec(tmp: Path, **over: Any) -> Any:
    """Two processes training `IdRecordingMLP` on streamed digit images; the Parquet digits serve the final
    evaluation."""
    from tests.support.train_specs import make_spec
    from training.spec import CheckpointPolicy, Distribution, ImportTarget

    shards = write_splits(str(tmp / "shards"), "image", n=400)
    base = dict(
        model=ImportTarget(path="tests.support.stream_models:IdRecordingMLP", kwargs={"log_dir": str(tmp / "ids")}),
        datamodule=ImportTarget(
            path="training.streaming:StreamingShardDataModule",
            kwargs={
                "train_uri": shards["train"],
                "val_uri": shards["val"],
                "test_uri": shards["test"],
                "return_ids": True,
            },
        ),
        distribution=Distribution(procs_per_node=2, max_restarts=1),
        checkpoint=CheckpointPolicy(every_n_steps=DRILL_EVERY, keep_last=2),
        max_epochs=2,
        batch_size=DRILL_BATCH,
    )
    base.update(over)
    return make_spec(tmp, **base)


def trained(tmp: Path) -> list[dict[str, Any]]:
    import json

    return [
        json.loads(line) for rank in (0, 1) for line in (tmp / "ids" / f"ids-rank{rank}.jsonl").read_text().splitlines()
    ]


@pytest.fixture(scope="module")
def drill_reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from resources.launcher import LocalLauncher
    from tests.training.test_fault_tolerance import final_weights

    tmp = tmp_path_factory.mktemp("stream-reference")
    spec = drill_spec(tmp)
    result = LocalLauncher().launch(spec).result
    return result, final_weights(spec), trained(tmp)


@pytest.mark.slow
def test_a_rank_killed_mid_epoch_resumes_the_exact_sample_stream(drill_reference: Any, tmp_path: Path) -> None:
    from resources.launcher import LocalLauncher
    from tests.training.test_fault_tolerance import assert_same, final_weights
    from training.attempts import FaultMarkers
    from training.spec import FaultInjection

    ref_result, ref_weights, ref_records = drill_reference
    spec = drill_spec(tmp_path, faults=FaultInjection(kill_rank=1, kill_at_step=DRILL_KILL))
    result = LocalLauncher().launch(spec).result
    records = trained(tmp_path)

    # The fault fired: rank 1 died at step 10 of attempt 0, the job restarted and resumed from the step-8 checkpoint.
    assert FaultMarkers(spec.output_uri).fired("kill")
    resumed_at = (DRILL_KILL // DRILL_EVERY) * DRILL_EVERY
    assert result.resumed_from and result.resumed_from.endswith(f"step-{resumed_at:09d}")
    first = [r for r in records if r["attempt"] == 0]
    second = [r for r in records if r["attempt"] == 1]
    assert (
        max(r["step"] for r in first if r["rank"] == 1) == DRILL_KILL - 1
    )  # killed in step 10's hooks, before recording it
    assert max(r["step"] for r in first) >= DRILL_KILL - 1 > resumed_at and second

    # Each rank's resumed attempt starts with the batch after the checkpoint.
    for rank in (0, 1):
        head = min((r for r in second if r["rank"] == rank), key=lambda r: r["step"])
        assert (head["epoch"], head["step"], head["batch_idx"]) == (0, resumed_at + 1, resumed_at)

    # The committed stream (attempt 0 up to the checkpoint, then attempt 1) is the uninterrupted run's, batch for batch.
    committed = [r for r in first if r["step"] <= resumed_at] + second
    key = lambda r: (r["epoch"], r["step"], r["rank"])
    assert [(key(r), r["ids"]) for r in sorted(committed, key=key)] == [
        (key(r), r["ids"]) for r in sorted(ref_records, key=key)
    ]
    for epoch in (0, 1):
        ids = [i for r in committed if r["epoch"] == epoch for i in r["ids"]]
        per_epoch = 2 * DRILL_BATCH * (400 // (2 * DRILL_BATCH))
        assert len(ids) == len(set(ids)) == per_epoch  # every sample of the epoch once, none twice
    # ...and the stream the data module promises (rank r trains global batches r, r + 2, ...).
    dm = StreamingShardDataModule(
        *(spec.datamodule.kwargs[k] for k in ("train_uri", "val_uri", "test_uri")),
        batch_size=DRILL_BATCH,
        task="classification",
        seed=spec.seed,
        return_ids=True,
    )
    for rank in (0, 1):
        expected = ids_of(dm._loader("train", train=True, rank=rank, world=2))
        assert [r["ids"] for r in sorted(committed, key=key) if r["rank"] == rank and r["epoch"] == 0] == expected

    assert result.global_step == ref_result.global_step
    assert_same(final_weights(spec), ref_weights)
