"""The canonical sample order of a shard split: one stream per epoch, the same for any world size and loader workers.

Epoch `e` of a split is its chunks in a permutation drawn from `(seed, e)`,
each chunk's items in a permutation drawn from `(seed, e, chunk)`
(`EpochStream`). Global batch `g` is stream positions `[g*B, (g+1)*B)`;
data-parallel rank `r` of `world` trains global batches `r, r + world, ...`
(`local_batches`), its loader workers take them in turn (`worker_plan`). A
resumed epoch starts at a sample offset `start` of the stream: its global batch
`g` is positions `[start + g*B, start + (g+1)*B)`, so a resume at another world
size continues at the exact sample the run had trained, whole global batches of
the new world or not. Pure functions of the chunk layout, the seed and the
place: `training.streaming` hands litdata the plan they make.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np


class EpochStream:
    """The canonical sample stream of one epoch: chunk order and each chunk's item order, drawn lazily.

    Args:
        intervals: per chunk, in litdata's chunk order, the `[begin, end)` global item ids it holds.
        seed, epoch: what the permutations are drawn from.
        shuffle: permute (training) or keep the stored order.

    Example:
        >>> s = EpochStream([(0, 3), (3, 5)], seed=0, epoch=0, shuffle=False)
        >>> s.total, s.items(1, 0, 2).tolist()
        (5, [3, 4])
    """

    def __init__(self, intervals: Sequence[tuple[int, int]], seed: int, epoch: int, shuffle: bool) -> None:
        if seed < 0 or epoch < 0:
            raise ValueError(f"seed and epoch must be >= 0, got seed={seed}, epoch={epoch}")
        self.intervals = [(int(b), int(e)) for b, e in intervals]
        self.seed, self.epoch, self.shuffle = seed, epoch, shuffle
        n = len(self.intervals)
        self.order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
        sizes = np.array([self.intervals[c][1] - self.intervals[c][0] for c in self.order], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.total = int(self.offsets[-1])
        self._cached: tuple[int, np.ndarray] = (-1, np.empty(0, dtype=np.int64))

    def chunk_items(self, chunk: int) -> np.ndarray:
        """The item ids of litdata chunk `chunk`, in this epoch's order."""
        if self._cached[0] != chunk:
            begin, end = self.intervals[chunk]
            items = np.arange(begin, end, dtype=np.int64)
            if self.shuffle:
                items = np.random.default_rng([self.seed, self.epoch, chunk]).permutation(items)
            self._cached = (chunk, items)
        return self._cached[1]

    def items(self, position: int, lo: int, hi: int) -> np.ndarray:
        """Item ids at offsets `[lo, hi)` of the chunk at stream position `position` (its place in `order`)."""
        return self.chunk_items(int(self.order[position]))[lo:hi]

    def segments(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """Stream positions `[start, stop)` as `(chunk position, lo, hi)` pieces, one per chunk they cross."""
        out = []
        p = int(np.searchsorted(self.offsets, start, side="right")) - 1
        while start < stop:
            end = min(stop, int(self.offsets[p + 1]))
            if end > start:
                out.append((p, start - int(self.offsets[p]), end - int(self.offsets[p])))
            start = end
            p += 1
        return out


def batches_per_rank(total: int, batch_size: int, world: int, drop_last: bool = True) -> int:
    """Batches each rank trains in an epoch of `total` samples (`drop_last`), or the one rank's batches (last one
    partial)."""
    if drop_last:
        return total // (world * batch_size)
    if world != 1:
        raise ValueError("without drop_last the stream is read by one rank")
    return math.ceil(total / batch_size)


@dataclass
class Visit:
    """A worker's consecutive reads from one chunk: the chunk's position in the stream and `(lo, hi)` offsets in it."""

    position: int
    pieces: list[tuple[int, int]]

    @property
    def size(self) -> int:
        return sum(hi - lo for lo, hi in self.pieces)


def local_batches(total: int, batch_size: int, world: int, rank: int, start: int = 0, drop_last: bool = True) -> range:
    """The indices `j` of rank `rank`'s batches in the stream from sample `start` on (global batch `rank + world * j`
    of that remainder, positions `[start + g*B, start + (g+1)*B)`)."""
    return range(batches_per_rank(max(0, total - start), batch_size, world, drop_last))


def _span(stream: EpochStream, batch_size: int, start: int, g: int) -> tuple[int, int]:
    """Stream positions of global batch `g` of the remainder from sample `start`."""
    begin = start + g * batch_size
    return begin, min(begin + batch_size, stream.total)


def worker_plan(stream: EpochStream, batch_size: int, world: int, rank: int, num_workers: int, worker: int,
                start: int = 0, drop_last: bool = True) -> list[Visit]:
    """What loader worker `worker` of rank `rank` reads, in order: its batches from sample `start` on, as chunk visits.

    The rank's batches go to its workers in turn (the `k`-th to worker `k % num_workers`),
    the order `DataLoader` collects them in.
    """
    visits: list[Visit] = []
    for k, j in enumerate(local_batches(stream.total, batch_size, world, rank, start, drop_last)):
        if k % num_workers != worker:
            continue
        for position, lo, hi in stream.segments(*_span(stream, batch_size, start, rank + world * j)):
            if visits and visits[-1].position == position:
                visits[-1].pieces.append((lo, hi))
            else:
                visits.append(Visit(position, [(lo, hi)]))
    return visits


def chunks_read_by_others(stream: EpochStream, batch_size: int, world: int, rank: int, num_workers: int, worker: int,
                          start: int, drop_last: bool, ranks: Sequence[int]) -> set[int]:
    """Chunks this worker reads that another reader among `ranks`' workers also reads this epoch (litdata
    reference-counts them in a shared cache so none is deleted under a reader)."""
    readers: dict[int, set[tuple[int, int]]] = {}
    for r in ranks:
        for k, j in enumerate(local_batches(stream.total, batch_size, world, r, start, drop_last)):
            for position, _, _ in stream.segments(*_span(stream, batch_size, start, r + world * j)):
                readers.setdefault(int(stream.order[position]), set()).add((r, k % num_workers))
    return {c for c, who in readers.items() if (rank, worker) in who and len(who) > 1}


class VisitItems(Sequence[list[int]]):
    """The item ids of each visit, drawn when litdata reaches it (one chunk's permutation in memory at a time)."""

    def __init__(self, stream: EpochStream, visits: list[Visit]) -> None:
        self.stream, self.visits = stream, visits

    def __len__(self) -> int:
        return len(self.visits)

    def __getitem__(self, i: Any) -> Any:
        v = self.visits[i]
        return np.concatenate([self.stream.items(v.position, lo, hi) for lo, hi in v.pieces]).tolist()
