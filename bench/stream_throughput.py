"""Streaming throughput: samples/s of the platform's shard train loader against litdata's own loader on the same shards.

Corpus: one text split of `TOKENS` token ids (`bench.stream_support.write_corpus`: 4 MiB litdata
chunks, as the shard writer writes them), read in place from local disk. A sample is 129 tokens
(`block_size` 128 + 1); batches of `BATCH`; `num_workers=0` on both sides (the reading is in the
measured process, so the machine's other load shows on both alike).

- platform: `training.streaming.StreamingShardDataModule(...).train_dataloader()`, one epoch:
  the canonical shuffled order (`training.stream_order`), batches `(x, y)` `[B, 128]`, views of the stacked int32
  blocks.
- litdata: `StreamingDataLoader(StreamingDataset(split, TokensLoader(129), shuffle=True, drop_last=True))`,
  one epoch: litdata's own shuffle, batches int32 `[B, 129]` (no split into inputs and targets:
  the platform does that on top, and it counts against it).
- litdata_same_batches (`details.like_for_like`): the same litdata loader with a `collate_fn` that
  makes the platform's batches, `(x, y)` views; platform / it is what the platform's order, plan
  and adapter cost beyond the work both then do.

A repetition is one epoch of every side read batch by batch in turn (`interleaved_epoch`, the
order rotating each turn): each side is charged its own calls only (building its loader, `iter()`,
every `next()`), so all meet the same moments of the machine's other load; `PAIRS` repetitions
after one untimed one. Value: the platform's median samples/s; baseline: litdata's; ratio =
value / baseline (higher is better, target >= 0.95). `details.paired` gives each repetition's
platform / litdata ratio, their median and a 95% t-interval; its verdict is "not resolved" while
the interval spans the target.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any, Optional, Sequence

from bench.harness import Target, write_result
from bench.stream_support import paired_ratios, write_corpus

TOKENS, BLOCK, BATCH, PAIRS = 4_000_000, 128, 64, 12
TARGET = 0.95


def _platform_loader(split: str, batch: int) -> Any:
    from training.streaming import StreamingShardDataModule

    return StreamingShardDataModule(split, split, split, batch_size=batch, block_size=BLOCK).train_dataloader()


def _litdata_loader(split: str, batch: int, collate_fn: Any = None) -> Any:
    from litdata import StreamingDataLoader, StreamingDataset
    from litdata.streaming.item_loader import TokensLoader

    ds = StreamingDataset(split, item_loader=TokensLoader(block_size=BLOCK + 1), shuffle=True, seed=0, drop_last=True)
    return StreamingDataLoader(ds, batch_size=batch, num_workers=0, collate_fn=collate_fn)


def _inputs_and_targets(items: list[Any]) -> tuple[Any, Any]:
    """litdata's blocks as the platform hands them to a model: inputs and next-token targets, views of the stacked int32
    blocks."""
    import torch

    tokens = torch.stack(items)
    return tokens[:, :-1], tokens[:, 1:]


def _litdata_same_batches(split: str, batch: int) -> Any:
    return _litdata_loader(split, batch, _inputs_and_targets)


MAKERS = {"platform": _platform_loader, "litdata": _litdata_loader, "litdata_same_batches": _litdata_same_batches}
SIDES = tuple(MAKERS)


def interleaved_epoch(split: str, first: int, batch: int = BATCH) -> dict[str, tuple[int, float]]:
    """One epoch of every side, read batch by batch in turn, the order rotating each turn: per side (samples, seconds).

    Turn t reads one batch of each side still reading, starting with side number `first + t` (mod the sides).
    A side's seconds are its own calls only: building its loader, `iter()`, every `next()` and freeing its own
    previous batch (left to the next call, a side would pay for freeing another's batch). Taking turns at
    each batch puts the sides under the same moments of the machine's other load (it varies by tens of
    per cent over seconds here), which timing whole epochs one after the other does not; rotating the order
    keeps any side from always following the same other (read in a fixed order, the side that went first
    read ~10% faster than it did second).
    """
    order = SIDES[first % len(SIDES):] + SIDES[:first % len(SIDES)]
    spent = dict.fromkeys(order, 0.0)
    samples = dict.fromkeys(order, 0)
    iters: dict[str, Any] = {}
    for name in order:
        t = time.perf_counter()
        iters[name] = iter(MAKERS[name](split, batch))
        spent[name] += time.perf_counter() - t
    held: dict[str, Any] = dict.fromkeys(order)  # each side's last batch, freed in that side's own timed call
    live, turn = list(order), 0
    while live:
        for name in live[turn % len(live):] + live[:turn % len(live)]:
            t = time.perf_counter()
            held[name] = None
            held[name] = next(iters[name], None)
            spent[name] += time.perf_counter() - t
            item = held[name]
            if item is None:
                live.remove(name)
            else:
                samples[name] += len(item[0]) if isinstance(item, (tuple, list)) else len(item)
            item = None
        turn += 1
    return {name: (samples[name], spent[name]) for name in order}


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=TOKENS)
    parser.add_argument("--pairs", type=int, default=PAIRS)
    args = parser.parse_args(argv)
    runs: dict[str, list[float]] = {name: [] for name in SIDES}
    samples: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="trainyard-bench-stream-") as root:
        split = os.path.join(root, "train")
        t0 = time.perf_counter()
        meta = write_corpus(split, args.tokens, block_size=BLOCK)
        write_s = time.perf_counter() - t0
        with open(os.path.join(split, "index.json")) as f:
            chunks = len(json.load(f)["chunks"])
        interleaved_epoch(split, 0)  # untimed: imports and the page cache warm for every side
        for k in range(args.pairs):
            for name, (n, s) in interleaved_epoch(split, k).items():
                samples[name] = n
                runs[name].append(n / s)
    value, baseline = statistics.median(runs["platform"]), statistics.median(runs["litdata"])
    paired = paired_ratios(runs["platform"], runs["litdata"], TARGET, "higher")
    same = paired_ratios(runs["platform"], runs["litdata_same_batches"], TARGET, "higher")
    return write_result(
        "stream_throughput",
        value,
        "samples/s",
        baseline,
        {
            "what": "samples/s of one epoch (fresh loader, construction included; the two sides' batches read in "
                    "turn) of "
            f"training.streaming.StreamingShardDataModule's train "
            f"loader vs litdata's StreamingDataLoader over a shuffled StreamingDataset, same local text split "
            f"({meta['tokens']} tokens, {chunks} chunks), {BLOCK + 1}-token samples, batch {BATCH}, num_workers=0, in "
            "this process",
            "paired": paired,
            "like_for_like": {
                "what": "platform / litdata's loader with a collate_fn making the platform's batches (inputs and "
                "next-token targets, views of the stacked blocks): what the platform's order, plan and adapter cost "
                "beyond that work",
                **same,
            },
            "samples_per_s": runs,
            "samples_per_epoch": samples,
            "order": "batches in turn within a repetition (the sides' order rotating each turn); repetition k starts "
                     "at side k mod 3",
            "corpus": {
                "tokens": meta["tokens"],
                "documents": meta["items"],
                "chunks": chunks,
                "write_seconds": round(write_s, 2),
            },
        },
        targets=[Target("ratio", ">=", TARGET), Target("details.paired.ci_low", ">=", TARGET, unit="x, interval low")],
        better="higher",
        runs=runs["platform"],
        baseline_runs=runs["litdata"],
    )


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
