"""Resume at another world size: the global batch a resumed run keeps, and rank ranges for its log lines. Pure."""

from __future__ import annotations

from typing import Optional


def rank_range(begin: int, end: int) -> str:
    """`rank 3` or `ranks 2-3`: ranks `[begin, end)` for a log line."""
    return f"rank {begin}" if end - begin == 1 else f"ranks {begin}-{end - 1}"


def keep_global_batch(
    saved: Optional[dict[str, int]], data_parallel: int, batch_size: int
) -> tuple[int, Optional[str]]:
    """(accumulate_grad_batches, what changed) for a run of `data_parallel` ranks x `batch_size` resuming a checkpoint
    trained at `saved` (`{"data_parallel", "batch_size", "accumulate"}`, None: not recorded).

    The global batch (ranks x per-rank batch x accumulation) is kept when the
    saved one is a whole multiple of this run's ranks x batch; otherwise the run
    trains with accumulation 1 and the message names the old and new global batch.

    Example:
        >>> keep_global_batch({"data_parallel": 4, "batch_size": 8, "accumulate": 1}, 2, 8)
        (2, None)
        >>> accumulate, message = keep_global_batch({"data_parallel": 2, "batch_size": 8, "accumulate": 1}, 4, 8)
        >>> accumulate
        1
        >>> print(message)  # doctest: +NORMALIZE_WHITESPACE
        global batch 16 -> 32 (data-parallel ranks 2 -> 4, per-rank batch 8 -> 8): 16 is not a multiple of 4 x 8,
        so gradient accumulation cannot keep it
    """
    if not saved:
        return 1, None
    before = int(saved["data_parallel"]) * int(saved["batch_size"]) * int(saved.get("accumulate", 1))
    step = data_parallel * batch_size
    if before % step == 0:
        return before // step, None
    return 1, (
        f"global batch {before} -> {step} (data-parallel ranks {saved['data_parallel']} -> {data_parallel}, per-rank "
        f"batch {saved['batch_size']} -> {batch_size}): {before} is not a multiple of {data_parallel} x {batch_size}, "
        "so gradient accumulation cannot keep it"
    )
