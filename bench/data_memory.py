"""Data memory: a training rank's peak RSS on a 10x corpus over a 1x corpus, streamed through the platform's data
module.

Corpora: text splits of `TOKENS` and `10 x TOKENS` token ids over a 256-token vocabulary
(`bench.stream_support.write_corpus`, 256 KiB litdata chunks: ~7 and ~60 of them, read in place
from local disk), and a small validation split. A fresh child process (one rank) fits a small
`pipelines.language.models.DecoderLM` (vocab 256, block 128, width 32, one block, batch 32) through `L.Trainer` for one
whole epoch of the train split with
`training.streaming.StreamingShardDataModule` as its data module (`num_workers=0`, so the
loading is in the measured process), then reports its peak resident set size (`VmHWM`,
`bench.harness.peak_rss_bytes`) and its RSS before the fit (the imports' floor).

The two scales alternate, 1x 10x 10x 1x ..., `PAIRS` pairs. Value: the median peak RSS (MiB)
at 10x; baseline: at 1x; ratio = value / baseline (lower is better, target <= 1.2).
`details.paired` gives each pair's ratio, their median and a 95% t-interval; the peak's growth in
MiB (`details.growth_mib`) says what the corpus adds beyond the process's fixed footprint.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from bench.harness import Target, write_result
from bench.stream_support import paired_ratios, write_corpus

ROOT = Path(__file__).resolve().parent.parent
# A vocabulary of 256 and 256 KiB chunks: a whole epoch of the 10x corpus trains in ~30 s here, over ~60 chunks (1x:
# ~7).
TOKENS, SCALE, BLOCK, BATCH, PAIRS, VOCAB, CHUNK_BYTES = 400_000, 10, 128, 32, 2, 256, 1 << 18
TARGET = 1.2
MODEL: dict[str, Any] = {"width": 32, "heads": 2, "blocks": 1, "lr": 3e-3}


def child(train: str, val: str) -> None:
    """Runs in the measured process: one epoch of DecoderLM on `train`, then its peak RSS as JSON on the last line."""
    import lightning as L
    import torch

    from bench.harness import peak_rss_bytes
    from pipelines.language.models import DecoderLM
    from training.streaming import StreamingShardDataModule

    torch.set_num_threads(1)
    floor = _rss_bytes()
    dm = StreamingShardDataModule(train, val, val, batch_size=BATCH, block_size=BLOCK)
    model = DecoderLM(vocab_size=int(dm.vocab_size or 0), block_size=BLOCK, **MODEL)
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    started = time.perf_counter()
    trainer.fit(model, dm)
    print(
        json.dumps(
            {
                "peak_rss_mib": peak_rss_bytes() / 2**20,
                "rss_before_fit_mib": floor / 2**20,
                "steps": trainer.global_step,
                "fit_seconds": time.perf_counter() - started,
            }
        )
    )


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _measure(train: str, val: str) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.data_memory", "--child", train, val],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
        env=env,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"training child failed with exit code {proc.returncode}:\n{proc.stderr[-4000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=TOKENS)
    parser.add_argument("--pairs", type=int, default=PAIRS)
    args = parser.parse_args(argv)
    runs: dict[str, list[dict[str, Any]]] = {"x1": [], f"x{SCALE}": []}
    with tempfile.TemporaryDirectory(prefix="trainyard-bench-datamem-") as root:
        val = os.path.join(root, "val")
        write_corpus(val, 20_000, seed=1, block_size=BLOCK, vocab=VOCAB)
        corpora = {}
        for name, scale in (("x1", 1), (f"x{SCALE}", SCALE)):
            corpora[name] = write_corpus(
                os.path.join(root, name),
                args.tokens * scale,
                seed=scale,
                block_size=BLOCK,
                vocab=VOCAB,
                chunk_bytes=CHUNK_BYTES,
            )
        for k in range(args.pairs):
            order = ("x1", f"x{SCALE}") if k % 2 == 0 else (f"x{SCALE}", "x1")
            for name in order:
                runs[name].append(_measure(os.path.join(root, name), val))
    big, small = [r["peak_rss_mib"] for r in runs[f"x{SCALE}"]], [r["peak_rss_mib"] for r in runs["x1"]]
    value, baseline = statistics.median(big), statistics.median(small)
    return write_result(
        "data_memory",
        value,
        "MiB peak RSS",
        baseline,
        {
            "what": f"peak RSS (VmHWM) of one training process fitting DecoderLM {MODEL} through L.Trainer for one "
                    "epoch, "
            f"training.streaming.StreamingShardDataModule (local text split, batch {BATCH}, block {BLOCK}, "
            "num_workers=0), "
            f"on a {SCALE}x corpus ({corpora[f'x{SCALE}']['tokens']} tokens) vs a 1x corpus "
            f"({corpora['x1']['tokens']} tokens)",
            "paired": paired_ratios(big, small, TARGET, "lower"),
            "growth_mib": value - baseline,
            "rss_before_fit_mib": statistics.median(r["rss_before_fit_mib"] for rs in runs.values() for r in rs),
            "runs": runs,
            "order": "1x 10x 10x 1x ...: pair k trains on 1x first when k is even",
            "corpus_tokens": {name: c["tokens"] for name, c in corpora.items()},
            "chunk_bytes": CHUNK_BYTES,
        },
        targets=[
            Target("ratio", "<=", TARGET),
            Target("details.paired.ci_high", "<=", TARGET, unit="x, interval high"),
        ],
        better="lower",
        runs=big,
        baseline_runs=small,
    )


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
    else:
        print(json.dumps(main(), indent=2))
