"""Train from shards that do not fit in memory: litdata chunks streamed through a bounded local cache.

A split is a litdata dataset (`index.json` and chunks written by litdata's
`BinaryWriter`) beside a `meta.json` that says what it holds, local or on
s3:// (the pod reaches its object store through `AWS_ENDPOINT_URL`, as for
Parquet). `StreamingShardDataModule` reads two kinds:

- `text`: one 1-D int tensor per document (end-of-document appended) written
  with `TokensLoader()`; a sample is `block_size + 1` consecutive tokens of the
  split's token stream (litdata's `TokensLoader(block_size + 1)`; blocks do not
  overlap), its id the block's index in that stream. A batch is `(x, y)`: x the
  `[B, block_size]` tokens, y the next token of each, `[B, block_size]`, both
  views of the stacked int32 `[B, block_size + 1]` blocks as stored (litGPT's
  pattern: the model widens on its device, where it is cheap, and the copy to
  the device carries half the bytes of int64).
- `image`: items `{"image": uint8 array, "label": class index, "id": int}`; a
  batch is `(x, y)`: x float32 `[B, C, H, W]` scaled to [0, 1] from the declared
  min and max, y the int64 labels. A sample's id is the item's `id`.

With `return_ids=True` a batch has a third element, the int64 `[B]` sample ids,
so a test can check the exact sample stream.

The training order (`training.stream_order`): epoch `e` of a split is one
canonical stream of its samples, the same for any world size and any number
of loader workers: the chunks in a permutation drawn from `(seed, e)`, each
chunk's items in a permutation drawn from `(seed, e, chunk)`. This is litdata's
canonical stream with `num_canonical_nodes=1`, the one setting for which the
order does not depend on the first run's topology; its own assignment of chunks
to ranks (`FullShuffle`) does depend on world size and workers, so the plan is
ours and litdata reads it. Global batch `g` is stream positions `[g*B, (g+1)*B)`;
data-parallel rank `r` of `world` trains global batches `r, r + world, r + 2*world, ...`,
so interleaving the ranks' batches gives back the stream. An epoch is the first
`world * (N // (world * B))` global batches (`drop_last`: every rank gets the same
number, `N // (world * B)`; at most `world * B - 1` samples of the epoch are left
out, a different few each epoch). A rank's loader workers take its batches in
turn, which is the order `DataLoader` yields them in, so workers do not change
what a rank sees. Each rank reads every chunk (for 1/world of its items): with
the default per-process cache a chunk is fetched once per rank, not once per node.

Validation and test: every rank reads the whole split in stored order (no
shuffle, the last batch partial), as `training.data.ParquetDataModule` does, so
metrics logged with `sync_dist` are exact without a gather; evaluation costs
`world` times the compute, which for a held-out split is small next to training.

Mid-epoch resume: the train loader keeps the position the run has TRAINED
(`mark_consumed`, called by `training.fault_tolerance.FaultTolerance` after each
optimizer step, exactly as for `training.resumable.ResumableDataLoader`), not the
position it has read (Lightning and the loader workers prefetch ahead). Lightning
saves `state_dict()` in every checkpoint and calls `load_state_dict` before the
first iterator of a resumed run, which then starts at the next untrained batch.
The position is kept in samples of the canonical stream too, so a resume on another
world size or batch size continues the stream at exactly the next untrained sample
(the plan starts at a sample offset, not a whole global batch of the new world):
within the epoch no sample is repeated or skipped.

Memory: a rank holds one chunk's item permutation and its plan of batches
(a few ints a batch), never a split's samples; litdata keeps at most
`max_pre_download` chunks ahead, and the cache directory is bounded by
`max_cache_bytes` (litdata deletes a chunk once every reader of it has passed
it and the cache is over budget). litdata's `MAX_CACHE_SIZE` environment
variable overrides the bound. A local split is read in place (memory-mapped),
with no cache.

This module is pod-side: it imports neither Dagster nor trainyard.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections import deque
from dataclasses import dataclass
from time import time
from typing import Any, Callable, Iterator, Optional, Sequence

import lightning as L
import numpy as np
import torch
from litdata import StreamingDataLoader, StreamingDataset
from litdata.streaming.item_loader import TokensLoader
from litdata.streaming.sampler import ChunkedIndex
from litdata.utilities.env import _WorkerEnv

from training import shard_format
from training.errors import ConfigError
from training.stream_order import EpochStream, VisitItems, batches_per_rank, chunks_read_by_others, worker_plan

DEFAULT_MAX_CACHE_BYTES = 1 << 30
"""1 GiB of chunks per process: with litdata's `max_pre_download` of 2 and chunks of a few MiB it never binds
the read-ahead, and it keeps a pod's local disk use fixed whatever the corpus."""
MAX_PRE_DOWNLOAD = 2


class _DeliberateCacheBound(logging.Filter):
    """Drops litdata's advice to cache at least 25GB: the bound here is deliberate (a pod's disk use stays fixed)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "max_cache_size` is less than" not in record.getMessage()


logging.getLogger("litdata.streaming.dataset").addFilter(_DeliberateCacheBound())


def allow_plain_http_endpoint() -> None:
    """Let litdata's obstore path fetch chunks from an `http://` `AWS_ENDPOINT_URL` (a loopback or in-cluster endpoint),
    in the process that downloads (the loader worker): `training.shard_format.allow_plain_http`, the one adapter."""
    shard_format.allow_plain_http({"endpoint_url": os.environ.get("AWS_ENDPOINT_URL", "")})


def _join(uri: str, name: str) -> str:
    return uri.rstrip("/") + "/" + name


def read_meta(uri: str) -> dict[str, Any]:
    """A split's `meta.json` (`training.shard_format.read_meta`).

    Raises:
        ConfigError: it is missing, not JSON, of an unknown kind or format version.
    """
    try:
        return shard_format.read_meta(uri)
    except shard_format.ShardFormatError as e:
        raise ConfigError(f"shard split {uri!r} cannot be read: {e}") from e


@dataclass
class _Plan:
    """What the next iteration reads: set by the loader in the main process, carried to the workers with the dataset."""

    epoch: int
    start: int  # the stream sample this iteration starts at (a resumed epoch's trained samples)
    world: int
    rank: int
    shuffle: bool
    drop_last: bool
    shared_ranks: tuple[int, ...]  # ranks whose readers share this process's cache directory


class _PlannedDataset(StreamingDataset):
    """litdata's `StreamingDataset` reading the platform's plan (`worker_plan`) and returning its items as litdata does.

    The one adapter to litdata's internals: `__iter__` sets up the reader as
    litdata's own `__iter__` does and hands `__next__` the worker's visits through
    the attributes litdata's elastic resume uses (`worker_chunks`,
    `worker_intervals`, `_elastic_item_lists`, `stop_length`); litdata then reads,
    prefetches and evicts chunks as for its own plans. `tests/training/test_streaming.py`
    names these attributes, so an upgrade that moves one fails there.
    """

    plan: Optional[_Plan] = None

    def __iter__(self) -> "_PlannedDataset":
        plan = self.plan
        if plan is None:
            raise RuntimeError("the shard loader sets the plan before iterating")
        allow_plain_http_endpoint()
        self.worker_env = _WorkerEnv.detect()
        self.cache = self._create_cache(worker_env=self.worker_env)
        self.shuffler = self._create_shuffler(self.cache)
        intervals = [(iv[1], iv[2]) for iv in self.cache.get_chunk_intervals()]
        self._shuffle_num_chunks = len(intervals)
        self.on_demand_bytes = False
        stream = EpochStream(intervals, self.seed, plan.epoch, plan.shuffle)
        workers, worker = self.worker_env.world_size, self.worker_env.rank
        visits = worker_plan(
            stream, self.batch_size, plan.world, plan.rank, workers, worker, plan.start, plan.drop_last
        )
        self.worker_chunks = [int(stream.order[v.position]) for v in visits]
        self.worker_intervals = [[0, 0, v.size, v.size] for v in visits]
        self._elastic_item_lists = VisitItems(stream, visits)
        self.stop_length = sum(v.size for v in visits)
        self.num_chunks = len(visits)
        if self.input_dir.url:  # chunks are copied into the cache: count the co-readers of each
            shared = chunks_read_by_others(stream, self.batch_size, plan.world, plan.rank, workers, worker, plan.start,
                                           plan.drop_last, plan.shared_ranks)
            self.cache._reader.acquire_shared_locks(shared)
            self.cache._reader.enable_mmap_for_chunks(set(self.worker_chunks) - shared)
        else:  # read in place, never deleted
            self.cache._reader.enable_mmap_for_chunks(set(self.worker_chunks))
        self.upcoming_indexes: deque[int] = deque()
        self.worker_next_chunk_index = 0
        self.global_index = 0
        self.consumed_sample_count_in_curr_chunk = 0
        self.has_triggered_download = False
        self.last_time = time()
        return self


class _IdPlannedDataset(_PlannedDataset):
    """`_PlannedDataset` returning `(item id, item)`: text batches with ids need the block's index, which the item
    lacks.

    A class apart so that the loader without ids keeps litdata's own `__getitem__`: one Python frame and a tuple less
    per sample, ~4% of the loader's time on 129-token blocks (`bench.stream_throughput`).
    """

    def __getitem__(self, index: Any) -> Any:
        item = StreamingDataset.__getitem__(self, index)  # one lookup less than super() on the hot path
        return (index.index, item) if type(index) is ChunkedIndex and self.plan is not None else item


# -- batches --------------------------------------------------------------------------------------


def collate_text(items: list[Any], return_ids: bool) -> tuple[torch.Tensor, ...]:
    """`(x, y[, ids])` from `block_size + 1` token items, or from `(block id, tokens)` items with `return_ids`."""
    blocks = [t for _, t in items] if return_ids else items
    tokens = torch.stack(blocks) if isinstance(blocks[0], torch.Tensor) else torch.from_numpy(np.stack(blocks))
    # views of the one stacked block, in the stored int32: the model widens on its device (half the bytes to copy there)
    out = (tokens[:, :-1], tokens[:, 1:])
    return (*out, torch.tensor([i for i, _ in items], dtype=torch.int64)) if return_ids else out


class ImageCollate:
    """`(x, y[, ids])` from image items: float32 `[B, C, H, W]` scaled from `[low, high]` to [0, 1], int64 labels."""

    def __init__(self, low: float, high: float, return_ids: bool) -> None:
        if high <= low:
            raise ValueError(f"image max {high} must be above min {low}")
        self.low, self.scale, self.return_ids = float(low), 1.0 / (float(high) - float(low)), return_ids

    def __call__(self, items: list[dict[str, Any]]) -> tuple[torch.Tensor, ...]:
        images = np.stack([np.asarray(it["image"]) for it in items])
        x = torch.from_numpy(images).to(torch.float32)
        if x.ndim == 3:  # [B, H, W]: one channel
            x = x.unsqueeze(1)
        else:  # [B, H, W, C]
            x = x.permute(0, 3, 1, 2).contiguous()
        x = (x - self.low) * self.scale
        y = torch.tensor([int(it["label"]) for it in items], dtype=torch.int64)
        if not self.return_ids:
            return x, y
        return x, y, torch.tensor([int(it["id"]) for it in items], dtype=torch.int64)


class ShardLoader(StreamingDataLoader):
    """litdata's `StreamingDataLoader` over a `_PlannedDataset`: one rank's batches of the canonical stream, resumable.

    Each iteration is the next epoch (the first is `epoch`); `set_epoch` names it
    explicitly. The position saved is the trained one (`mark_consumed`), never
    the read-ahead one. Workers are not persistent: the plan travels with the
    dataset to each epoch's workers.

    Args:
        dataset: the split.
        batch_size: per-rank batch size.
        rank, world: this process's data-parallel place.
        shuffle, drop_last: training (both) or evaluation (neither; `world` must be 1).
        epoch: the epoch of the first iteration.
        shared_ranks: ranks whose readers share this process's cache directory.
    """

    def __init__(self, dataset: _PlannedDataset, batch_size: int, rank: int = 0, world: int = 1, shuffle: bool = True,
                 drop_last: bool = True, epoch: int = 0, shared_ranks: Sequence[int] = (0,), num_workers: int = 0,
                 collate_fn: Optional[Callable[..., Any]] = None, **kwargs: Any) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside world size {world}")
        if not drop_last and world != 1:
            raise ValueError(
                "an evaluation loader (drop_last=False) reads the whole split on one rank; world must be 1"
            )
        if kwargs.get("persistent_workers"):
            raise ValueError("persistent_workers must be off: each epoch's workers get that epoch's plan")
        super().__init__(dataset, batch_size=batch_size, num_workers=num_workers, collate_fn=collate_fn, **kwargs)
        self.rank, self.world, self.shuffle, self.plan_drop_last = rank, world, shuffle, drop_last
        self.shared_ranks = tuple(shared_ranks)
        self._epoch, self._start = epoch, 0
        self.consumed = (epoch, 0)
        # Where a resumed epoch starts: (epoch, this loader's batches counted as done, stream sample it starts at).
        self._base = (epoch, 0, 0)
        self._total: Optional[int] = None

    @property
    def samples(self) -> int:
        """Samples in the split (blocks for text)."""
        if self._total is None:
            self._total = int(sum(iv[2] - iv[1] for iv in self._intervals()))
        return self._total

    def _intervals(self) -> list[Any]:
        ds = self.dataset
        if ds.cache is None:
            ds.worker_env = _WorkerEnv.detect()
            ds.cache = ds._create_cache(worker_env=ds.worker_env)
        return list(ds.cache.get_chunk_intervals())

    def __len__(self) -> int:
        return batches_per_rank(self.samples, self.batch_size, self.world, self.plan_drop_last)

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch `epoch` (from its start, unless a resume was loaded for that epoch)."""
        if epoch != self._epoch:
            self._epoch, self._start = epoch, 0

    def __iter__(self) -> Iterator[Any]:
        epoch, start = self._epoch, self._start
        self._epoch, self._start = epoch + 1, 0
        self.dataset.plan = _Plan(
            epoch, start, self.world, self.rank, self.shuffle, self.plan_drop_last, self.shared_ranks
        )
        self.restore = False  # litdata's own resume is not used: the plan says where to start
        yield from super().__iter__()

    # -- the trained position, saved in checkpoints ----------------------------------------------------

    def mark_consumed(self, epoch: int, batches_done: int) -> None:
        """Record the trained position: `batches_done` batches of epoch `epoch` (the loader may have read past it)."""
        self.consumed = (epoch, batches_done)

    def state_dict(self) -> dict[str, int]:
        epoch, done = self.consumed
        batch = int(self.batch_size or 1)
        base_epoch, base_done, base_start = self._base
        if epoch != base_epoch:
            base_done, base_start = 0, 0
        return {"epoch": epoch, "batches_done": done, "world": self.world, "batch_size": batch,
                "samples_done": base_start + (done - base_done) * self.world * batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue at the trained sample of the canonical stream, at this world size and batch size or another.

        The next iteration starts at stream sample `samples_done` exactly (a
        resume at another world size need not land on a whole global batch of
        the new world), and the position counts as the batches this loader's
        epoch has left fewer than its `len` (`consumed`), which the trainer's
        loop is aligned to (`training.resumable.align_loop_to_loader`).
        """
        epoch, done = int(state["epoch"]), int(state["batches_done"])
        world, batch = int(state.get("world", self.world)), int(state.get("batch_size", self.batch_size or 1))
        start = int(state.get("samples_done", done * world * batch))
        left = batches_per_rank(
            max(0, self.samples - start), int(self.batch_size or 1), self.world, self.plan_drop_last
        )
        done = len(self) - left
        if left == 0:  # saved at the end of an epoch: the next one starts fresh
            epoch, done, start = epoch + 1, 0, 0
        self._epoch, self._start = epoch, start
        self._base = (epoch, done, start)
        self.consumed = (epoch, done)


# -- the data module --------------------------------------------------------------------------------


def _data_parallel_place(trainer: Any) -> tuple[int, int]:
    """(rank, world) among the data-parallel replicas: the strategy's, else torch.distributed's, else (0, 1)."""
    shard = (getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}) if trainer is not None else {}
    if "rank" in shard and "num_replicas" in shard:
        return int(shard["rank"]), int(shard["num_replicas"])
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class StreamingShardDataModule(L.LightningDataModule):
    """Train/val/test shard splits (text or image, local or s3://) streamed through a bounded cache.

    Batches, order, resume and memory: see the module docstring. The kind and its
    facts come from the train split's `meta.json` when the module is built.

    Args:
        train_uri, val_uri, test_uri: split directories written by the shard writer.
        features, target: the platform passes them to every data module; the shard kind fixes both, so they are unused.
        batch_size: per-rank batch size.
        seed: seed of the training order (epoch `e` draws from `(seed, e)`).
        task: the trial's task (`causal_lm` for text); checked against the kind.
        block_size: tokens per sample (text); default the meta's `block_size`.
        num_workers: loader workers per rank (0 reads in the training process).
        cache_dir: where chunks of a remote split are cached; default a temporary directory of this process,
            removed at teardown.
        max_cache_bytes: the cache's bound in bytes (default 1 GiB, `DEFAULT_MAX_CACHE_BYTES`).
        return_ids: add each batch's sample ids as a third element.

    Attributes:
        kind: `text` or `image`.
        meta: the train split's `meta.json`.
        vocab_size, eos_id, block_size: text.
        input_shape, n_features, n_classes: image (`[C, H, W]`, `C * H * W`, the labels' count).
    """

    handles_distributed_sampling = True  # the entrypoint leaves sampling to us (Lightning's sampler does not apply)

    def __init__(
        self,
        train_uri: str,
        val_uri: str,
        test_uri: str,
        features: Optional[list[str]] = None,
        target: Optional[str] = None,
        batch_size: int = 64,
        seed: int = 0,
        task: str = "causal_lm",
        block_size: Optional[int] = None,
        num_workers: int = 0,
        cache_dir: Optional[str] = None,
        max_cache_bytes: int = DEFAULT_MAX_CACHE_BYTES,
        return_ids: bool = False,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if max_cache_bytes < 1:
            raise ValueError(f"max_cache_bytes must be >= 1, got {max_cache_bytes}")
        self.uris = {"train": train_uri, "val": val_uri, "test": test_uri}
        self.features, self.target = features, target
        self.batch_size, self.seed, self.task = batch_size, seed, task
        self.num_workers, self.max_cache_bytes, self.return_ids = num_workers, max_cache_bytes, return_ids
        self._cache_root = cache_dir
        self._own_cache: Optional[str] = None
        self.meta = read_meta(train_uri)
        self.kind: str = self.meta["kind"]
        if self.kind == "text":
            if task not in ("causal_lm",):
                raise ConfigError(f"text shards train task 'causal_lm', got task {task!r}")
            size = block_size if block_size is not None else self.meta.get("block_size")
            if size is None:
                raise ConfigError(f"block_size is not given and {_join(train_uri, shard_format.META_FILE)} has none")
            if int(size) < 1:
                raise ValueError(f"block_size must be >= 1, got {size}")
            self.block_size: Optional[int] = int(size)
            self.vocab_size: Optional[int] = int(self.meta["vocab_size"])
            self.eos_id: Optional[int] = int(self.meta["eos_id"])
        else:
            if task not in ("classification",):
                raise ConfigError(f"image shards train task 'classification', got task {task!r}")
            self.block_size = self.vocab_size = self.eos_id = None
        self._tokenizer_path: Optional[str] = None

    # -- facts of the data ----------------------------------------------------------------------------

    @property
    def cache_dir(self) -> str:
        """This module's chunk cache (created on first use; a temporary one is removed at teardown)."""
        if self._cache_root is not None:
            os.makedirs(self._cache_root, exist_ok=True)
            return self._cache_root
        if self._own_cache is None or not os.path.isdir(self._own_cache):
            self._own_cache = tempfile.mkdtemp(prefix="trainyard-shards-")
        return self._own_cache

    @property
    def tokenizer_path(self) -> Optional[str]:
        """Local path of the text split's tokenizer file (`meta["tokenizer"]`), fetched into the cache; None without
        one."""
        name = self.meta.get("tokenizer")
        if self.kind != "text" or not name:
            return None
        if self._tokenizer_path is None or not os.path.exists(self._tokenizer_path):
            dest = os.path.join(self.cache_dir, "tokenizer", os.path.basename(name))
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            try:
                data = shard_format.read_file_bytes(self.uris["train"], name)
            except shard_format.ShardFormatError as e:
                raise ConfigError(f"the tokenizer of shard split {self.uris['train']!r}: {e}") from e
            with open(dest, "wb") as out:
                out.write(data)
            self._tokenizer_path = dest
        return self._tokenizer_path

    def train_token_counts(self) -> Optional[np.ndarray]:
        """Unigram counts of the train split's tokens (`token_counts.npy`, int64 by token id), or None when absent."""
        if self.kind != "text":
            return None
        try:
            return shard_format.read_token_counts(self.uris["train"])
        except shard_format.ShardFormatError:
            return None

    @property
    def input_shape(self) -> list[int]:
        """An image's shape as the model gets it, `[C, H, W]` (text: `[block_size]`)."""
        if self.kind == "text":
            return [int(self.block_size or 0)]
        shape = [int(s) for s in self.meta["shape"]]
        return [1, *shape] if len(shape) == 2 else [shape[2], shape[0], shape[1]]

    @property
    def n_features(self) -> int:
        """Values in one sample: `C * H * W` for an image, `block_size` tokens for text."""
        return int(np.prod(self.input_shape))

    def classes(self) -> list[Any]:
        """The image labels (a label's index is its class); empty for text."""
        return list(self.meta.get("labels", [])) if self.kind == "image" else []

    @property
    def n_classes(self) -> int:
        return len(self.classes())

    def class_counts(self) -> list[int]:
        """Images of each class in the train split: the meta's `class_counts` when the writer recorded them, else one
        streamed pass over the split's labels (every chunk read once, nothing kept but the counts)."""
        if self.kind != "image":
            return []
        if "class_counts" in self.meta:
            return [int(c) for c in self.meta["class_counts"]]
        counts = np.zeros(self.n_classes, dtype=np.int64)
        for batch in self._loader("train", train=False):
            counts += np.bincount(batch[1].numpy(), minlength=self.n_classes)
        return counts.tolist()

    def example_input(self) -> torch.Tensor:
        """Two samples of the validation split, as the model gets them."""
        return next(iter(self._loader("val", train=False, batch_size=2, return_ids=False)))[0]

    # -- loaders ----------------------------------------------------------------------------------

    def _dataset(self, split: str, return_ids: bool = False) -> _PlannedDataset:
        item_loader = TokensLoader(block_size=self.block_size + 1) if self.block_size is not None else None
        # a text block's id is its index in the stream, which only the index carries; an image carries its own `id`
        cls = _IdPlannedDataset if return_ids and self.kind == "text" else _PlannedDataset
        return cls(
            self.uris[split],
            cache_dir=self.cache_dir,
            item_loader=item_loader,
            shuffle=False,  # litdata's own shuffler is not used: the plan orders the stream
            drop_last=False,
            seed=self.seed,
            max_cache_size=self.max_cache_bytes,
            max_pre_download=MAX_PRE_DOWNLOAD,
            num_canonical_nodes=1,
            storage_options=shard_format.storage_options_for(self.uris[split]) or None,
        )

    def _collate(self, return_ids: bool) -> Callable[..., Any]:
        if self.kind == "text":
            return _TextCollate(return_ids)
        return ImageCollate(self.meta.get("min", 0), self.meta.get("max", 255), return_ids)

    def _loader(self, split: str, train: bool, batch_size: Optional[int] = None, rank: int = 0, world: int = 1,
                epoch: int = 0, return_ids: Optional[bool] = None) -> ShardLoader:
        ids = self.return_ids if return_ids is None else return_ids
        return ShardLoader(
            self._dataset(split, ids),
            batch_size=batch_size or self.batch_size,
            rank=rank,
            world=world,
            shuffle=train,
            drop_last=train,
            epoch=epoch,
            # a cache directory of our own is this process's alone; one given may be shared by a node's ranks
            shared_ranks=(rank,) if self._cache_root is None else tuple(range(world)),
            num_workers=self.num_workers,
            collate_fn=self._collate(ids),
        )

    def train_dataloader(self) -> ShardLoader:
        # Shard by the strategy's data-parallel rank: under tensor parallelism the ranks of one group see the same
        # batch.
        rank, world = _data_parallel_place(self.trainer)
        epoch = int(self.trainer.current_epoch) if self.trainer is not None else 0
        return self._loader("train", train=True, rank=rank, world=world, epoch=epoch)

    def val_dataloader(self) -> ShardLoader:
        return self._loader("val", train=False)

    def test_dataloader(self) -> ShardLoader:
        return self._loader("test", train=False)

    def eval_dataloader(self, split: str) -> ShardLoader:
        """The whole `split` (`val` or `test`) as `(x, y)` batches in stored order, for the final evaluation on one
        process (`training.lightning_eval`); never with ids."""
        if split not in ("val", "test"):
            raise ValueError(f"split must be 'val' or 'test', got {split!r}")
        return self._loader(split, train=False, return_ids=False)

    def teardown(self, stage: str) -> None:
        if self._own_cache is not None:
            shutil.rmtree(self._own_cache, ignore_errors=True)
            self._own_cache = None
            self._tokenizer_path = None


class _TextCollate:
    """Picklable `collate_text` with its `return_ids` (loader workers may be spawned)."""

    def __init__(self, return_ids: bool) -> None:
        self.return_ids = return_ids

    def __call__(self, items: list[Any]) -> tuple[torch.Tensor, ...]:
        return collate_text(items, self.return_ids)
