"""A distributed sampler whose position can be saved and restored mid-epoch.

The order of epoch `e` is a permutation drawn from a generator seeded with
`seed + e`, so it depends on nothing but the seed, the epoch and the dataset
length. Each rank takes every `world`-th index (padded like
`DistributedSampler`). After a restart the sampler skips the batches the run
had already consumed, so the resumed run sees exactly the sample stream an
uninterrupted run would have seen.
"""

from __future__ import annotations

import math
from typing import Iterator, Optional

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
        self._skip_batches = 0
        self._skip_epoch: Optional[int] = None
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

    def resume(self, epoch: int, batches_done: int) -> None:
        """Skip `batches_done` batches the next time epoch `epoch` is iterated."""
        self._skip_epoch = epoch
        self._skip_batches = batches_done

    def indices(self, epoch: int) -> list[int]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            order = torch.randperm(self.length, generator=g).tolist()
        else:
            order = list(range(self.length))
        total = self.per_rank * self.world
        order += order[: total - len(order)]
        return order[self.rank : total : self.world]

    def __iter__(self) -> Iterator[int]:
        mine = self.indices(self.epoch)
        if self._skip_epoch == self.epoch and self._skip_batches:
            mine = mine[self._skip_batches * self.batch_size :]
            self._skip_epoch, self._skip_batches = None, 0
        return iter(mine)


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
        epoch, done = self.resumable_sampler.consumed
        return {"epoch": epoch, "batches_done": done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, done = int(state["epoch"]), int(state["batches_done"])
        if done >= len(self):  # saved at the end of an epoch: the next one starts fresh
            epoch, done = epoch + 1, 0
        sampler = self.resumable_sampler
        sampler.set_epoch(epoch)
        sampler.resume(epoch, done)
        sampler.mark_consumed(epoch, done)
