"""Probe of the streaming data path (not yet a registered benchmark; `bench.__main__.BENCHMARKS` does not list it).

Two measurements on text shards written as the shard writer writes them:

- throughput: samples/s of `training.streaming.StreamingShardDataModule`'s train
  loader against litdata's own `StreamingDataLoader` over a shuffled
  `StreamingDataset` of the same shards (same batch size, `num_workers=0`),
  each one epoch, alternated `--repeats` times; the best of each counts.
- memory: the peak RSS (`VmHWM`) of a child process that reads one epoch of the
  platform's train loader from a corpus of 1x and of 10x the tokens, through
  the loopback-free local path or, with `--s3`, not (local only here).

Run: `.venv/bin/python -m bench.stream_probe [--tokens 4000000] [--repeats 3]`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 128
BATCH = 64


def write_corpus(path: str, tokens: int, seed: int = 0, chunk_bytes: int = 1 << 22) -> dict[str, Any]:
    """A text split of about `tokens` token ids (documents of 200-2000 tokens, vocabulary 2048)."""
    import numpy as np
    import torch
    from litdata.streaming.item_loader import TokensLoader
    from litdata.streaming.writer import BinaryWriter

    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    writer = BinaryWriter(cache_dir=path, chunk_bytes=chunk_bytes, item_loader=TokensLoader())
    written, i = 0, 0
    while written < tokens:
        doc = np.append(rng.integers(0, 2047, size=int(rng.integers(200, 2000))), 2047).astype(np.int32)
        writer[i] = torch.from_numpy(doc)
        written += len(doc)
        i += 1
    writer.done()
    writer.merge()
    meta = {"kind": "text", "format_version": 1, "vocab_size": 2048, "eos_id": 2047, "tokenizer": "tokenizer.json",
            "items": i, "tokens": written, "block_size": BLOCK}
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump(meta, f)
    return meta


def _epoch(loader: Any) -> tuple[int, float]:
    started, n = time.perf_counter(), 0
    for batch in loader:
        n += len(batch[0]) if isinstance(batch, (tuple, list)) else len(batch)
    return n, time.perf_counter() - started


def throughput(split: str, repeats: int) -> dict[str, Any]:
    """Samples/s of each loader, one epoch a run, in ABBA order; the median of the pairs' ratios and the best of each."""
    import statistics

    from litdata import StreamingDataLoader, StreamingDataset
    from litdata.streaming.item_loader import TokensLoader

    from training.streaming import StreamingShardDataModule

    def platform() -> float:
        n, s = _epoch(StreamingShardDataModule(split, split, split, batch_size=BATCH).train_dataloader())
        return n / s

    def litdata() -> float:
        ds = StreamingDataset(split, item_loader=TokensLoader(block_size=BLOCK + 1), shuffle=True, seed=0, drop_last=True)
        n, s = _epoch(StreamingDataLoader(ds, batch_size=BATCH, num_workers=0))
        return n / s

    ours, theirs = [], []
    for k in range(repeats):
        first, second = (platform, litdata) if k % 2 == 0 else (litdata, platform)
        a, b = first(), second()
        ours.append(a if first is platform else b)
        theirs.append(b if first is platform else a)
    ratios = [o / t for o, t in zip(ours, theirs)]
    return {"platform_samples_per_s": max(ours), "litdata_samples_per_s": max(theirs), "ratio_of_best": max(ours) / max(theirs),
            "ratio_median_of_pairs": statistics.median(ratios), "ratios": ratios}


def child(split: str) -> None:
    """Runs in the measured process: one epoch of the platform's train loader, then its peak RSS as JSON."""
    from bench.harness import peak_rss_bytes
    from training.streaming import StreamingShardDataModule

    dm = StreamingShardDataModule(split, split, split, batch_size=BATCH)
    n, s = _epoch(dm.train_dataloader())
    print(json.dumps({"samples": n, "seconds": s, "peak_rss_mib": peak_rss_bytes() / 2**20}))


def memory(root: str, tokens: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for scale in (1, 10):
        split = os.path.join(root, f"x{scale}")
        if not os.path.exists(split):
            write_corpus(split, tokens * scale)
        proc = subprocess.run([sys.executable, "-m", "bench.stream_probe", "--child", split], cwd=ROOT, capture_output=True, text=True,
                              check=True, timeout=1800)
        out[f"x{scale}"] = json.loads(proc.stdout.strip().splitlines()[-1])
    out["ratio"] = out["x10"]["peak_rss_mib"] / out["x1"]["peak_rss_mib"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child")
    parser.add_argument("--root")
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    root = args.root or tempfile.mkdtemp(prefix="stream-probe-")
    x1 = os.path.join(root, "x1")
    if not os.path.exists(x1):
        write_corpus(x1, args.tokens)
    print(json.dumps({"throughput": throughput(x1, args.repeats)}), flush=True)
    print(json.dumps({"memory": memory(root, args.tokens)}), flush=True)


if __name__ == "__main__":
    main()
