"""A distributed sampler whose position can be saved and restored mid-epoch.

The order of epoch `e` is a permutation drawn from a generator seeded with
`seed + e`, so it depends on nothing but the seed, the epoch and the dataset
length. Each rank takes every `world`-th index (padded like
`DistributedSampler`), so position `p` of the epoch's order is trained by rank
`p % world`, and the ranks' `j`-th batches together are positions
`[j*world*B, (j+1)*world*B)`. After a restart the sampler starts at the sample
the run had trained (`resume(epoch, samples_done)`): the ranks take the rest of
the order in turn from there, so at the same world size the resumed run sees
exactly the sample stream an uninterrupted run would have seen, and at another
world size or batch size it sees every remaining sample of the epoch once.

`align_loop_to_loader` is the one adapter to Lightning's loop counters: a
resume at another world size counts the trained batches in the new world's
units.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Optional

import torch
from torch.utils.data import DataLoader, Sampler


def _dist() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class ResumableSampler(Sampler[int]):
    """Deterministic, sharded, shuffling sampler with mid-epoch resume.

    Args:
        length: dataset length.
        batch_size: batch size of the loader (skips are counted in batches).
        seed: shuffling seed; epoch `e` uses `seed + e`.
        shuffle: shuffle each epoch (training) or keep dataset order.
        rank, world: this process's place; default from torch.distributed.
    """

    def __init__(
        self,
        length: int,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        rank: Optional[int] = None,
        world: Optional[int] = None,
    ) -> None:
        if length < 1:
            raise ValueError(f"length must be >= 1, got {length}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        r, w = _dist()
        self.rank = r if rank is None else rank
        self.world = w if world is None else world
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is outside world size {self.world}")
        self.length = length
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self._start_epoch: Optional[int] = None
        self._start = 0  # the sample (position in the epoch's order) the resumed epoch starts at
        self.consumed = (0, 0)

    @property
    def per_rank(self) -> int:
        return math.ceil(self.length / self.world)

    def __len__(self) -> int:
        return self.per_rank

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def mark_consumed(self, epoch: int, batches_done: int) -> None:
        """Record the trained position (the loader may have prefetched past it)."""
        self.consumed = (epoch, batches_done)

    def resume(self, epoch: int, samples_done: int) -> None:
        """Start at position `samples_done` of epoch `epoch`'s order the next time that epoch is iterated."""
        self._start_epoch = epoch
        self._start = samples_done

    def remaining(self, samples_done: int) -> int:
        """Samples this rank trains in an epoch resumed at position `samples_done` (the last ones padded like the
        epoch)."""
        return math.ceil(max(0, self.length - samples_done) / self.world)

    def order(self, epoch: int) -> list[int]:
        """Epoch `epoch`'s order of the dataset's indices (every rank's samples, unpadded)."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            return torch.randperm(self.length, generator=g).tolist()
        return list(range(self.length))

    def indices(self, epoch: int, start: int = 0) -> list[int]:
        """This rank's indices of epoch `epoch` from position `start` of its order: every `world`-th, padded with
        the order's first samples so that every rank gets the same number."""
        order = self.order(epoch)
        rest = order[start:]
        total = self.remaining(start) * self.world
        rest += (order * (1 + total // max(1, len(order))))[: total - len(rest)]
        return rest[self.rank : total : self.world]

    def __iter__(self) -> Iterator[int]:
        start = self._start if self._start_epoch == self.epoch else 0
        self._start_epoch, self._start = None, 0
        return iter(self.indices(self.epoch, start))


def align_loop_to_loader(trainer: Any, batches_done: int) -> int:
    """Make the resumed epoch's batch counters of `trainer`'s fit loop say `batches_done`; returns the shift.

    Lightning restores the counters in the checkpoint's units (the batches each
    rank of the saving run had trained); at another world size, batch size or
    accumulation the train loader counts its resumed position in its own
    (`ResumableDataLoader.load_state_dict`, `training.streaming.ShardLoader`).
    Called from `on_train_start`, after the loader's state is loaded and before
    the epoch loop resets: every counter of the epoch's batch progress moves by
    the same amount, so the epoch loop resumes (and ends, and accumulates) at the
    loader's batch. The totals over epochs are left as counted.
    """
    current = trainer.fit_loop.epoch_loop.batch_progress.current
    shift = batches_done - current.ready
    if shift:
        current.ready += shift
        current.started += shift
        current.processed += shift
        current.completed += shift
    return shift


class ResumableDataLoader(DataLoader):
    """A DataLoader over a `ResumableSampler` that Lightning saves and restores with the fit loop.

    Lightning calls `state_dict` when it writes a checkpoint and `load_state_dict`
    before it creates the first iterator of a resumed run.
    """

    @property
    def resumable_sampler(self) -> ResumableSampler:
        """The loader's sampler, which must be a `ResumableSampler` for its position to be saved."""
        sampler = self.sampler
        if not isinstance(sampler, ResumableSampler):
            raise TypeError(f"ResumableDataLoader needs a ResumableSampler as sampler, got {type(sampler).__name__}")
        return sampler

    def state_dict(self) -> dict[str, int]:
        sampler = self.resumable_sampler
        epoch, done = sampler.consumed
        base_epoch, base_done, base_start = getattr(self, "_base", (epoch, 0, 0))
        if epoch != base_epoch:
            base_done, base_start = 0, 0
        return {"epoch": epoch, "batches_done": done, "world": sampler.world, "batch_size": sampler.batch_size,
                "samples_done": base_start + (done - base_done) * sampler.world * sampler.batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue at the trained sample, at this world size and batch size or another.

        The position counts as the batches this loader's epoch has left fewer
        than its `len`, which the trainer's loop is aligned to (`align_loop_to_loader`).
        """
        sampler = self.resumable_sampler
        epoch, done = int(state["epoch"]), int(state["batches_done"])
        world, batch = int(state.get("world", sampler.world)), int(state.get("batch_size", sampler.batch_size))
        start = int(state.get("samples_done", done * world * batch))
        rest = sampler.remaining(start)
        left = rest // sampler.batch_size if self.drop_last else math.ceil(rest / sampler.batch_size)
        done = len(self) - left
        if left == 0:  # saved at the end of an epoch: the next one starts fresh
            epoch, done, start = epoch + 1, 0, 0
        self._base = (epoch, done, start)
        sampler.set_epoch(epoch)
        sampler.resume(epoch, start)
        sampler.mark_consumed(epoch, done)
