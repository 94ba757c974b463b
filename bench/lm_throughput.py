"""LM throughput: steady-state tokens/s of DecoderLM trained through the platform's trial path against bare Lightning.

Model: `pipelines.language.models.DecoderLM` (vocab 512, block 128, width 96, 4 heads, 2 blocks,
AdamW) as `TimedDecoderLM`, which adds one step clock (`LMStepClock`, returned by
`configure_callbacks`, so both sides carry the very same clock and the platform knows nothing of
it). Data: a local text split (`bench.stream_support.write_corpus`) through
`training.streaming.StreamingShardDataModule` on both sides, batch `BATCH`, `STEPS` steps
(`limit_train_batches`), one epoch, seed 0; small val/test splits. Each run is a fresh process,
one rank, `OMP_NUM_THREADS=1`, the same environment on both sides.

A pair runs both sides AT ONCE (each process its own core when the machine is otherwise idle):
the clock holds each at the start of training until the other has reached it, and only the
step periods inside the span in which both were past their warm-up and still stepping count.
This machine's other load varies by tens of per cent from one half-minute to the next (run one
after the other, 4 pairs read 0.83-2.4), and running the sides together puts both under the
same moments of it; the absolute tokens/s are then those of two processes sharing the machine.
On two or more cores each side's training thread is pinned to one of cores 0 and 1, the other
side's on the other, and the two swap every `SWAP_EVERY` steps (`TRAINYARD_BENCH_CORE_PHASE`): a
core busier with the machine's other work then slows both sides alike. Left to the scheduler,
one pair's ratio read 0.90 and the next 1.15 (12 pairs, sd 0.065); swapping, 0.97-1.03 (sd 0.017).

- platform: `training.entrypoint.main(["--spec", spec.json])` in the child, a `causal_lm`
  `TrainSpec` (as tests/training/test_causal_lm.py runs one): the platform's Trainer
  (`training.lightning_task`: progress callback, FaultTolerance with its default Young/Daly
  checkpointing and async first save, deterministic), then validation, evaluation and export.
- bare: `L.Trainer(max_epochs=1, limit_train_batches=STEPS, deterministic=True, logger=False,
  enable_checkpointing=False, no progress bar or summary).fit(TimedDecoderLM(...), datamodule)`.

Steady state: the clock stamps every train batch end (`perf_counter` and wall time); a run's step
period is the mean of its periods after the first `WARMUP` steps and inside the pair's common span,
less those during which the platform's async checkpoint write was in flight (a fixed cost of the
attempt, measured by `checkpoint_blocking`; the mean with them is `step_ms_mean_incl_writes`).
tokens/s = BATCH x 128 / that mean. Which side is started first alternates, `PAIRS` pairs. Value:
the platform's median tokens/s; baseline: bare's; ratio = value / baseline (higher is better,
target >= 0.98). `details.paired`: each pair's ratio, their median and a 95% t-interval; "not
resolved" while the interval spans the target.
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

import lightning as L
import numpy as np

from bench.harness import Target, write_result
from bench.stream_support import paired_ratios, write_corpus
from pipelines.language.models import DecoderLM

ROOT = Path(__file__).resolve().parent.parent
BLOCK, BATCH, STEPS, WARMUP, PAIRS, VOCAB = 128, 16, 200, 20, 16, 512
TARGET = 0.98
MODEL: dict[str, Any] = {"width": 96, "heads": 4, "blocks": 2, "lr": 3e-3}


BARRIER_ENV = "TRAINYARD_BENCH_BARRIER"  # "<directory>:<side>": meet the other side there before the first step
# "0" or "1": the core this side starts on; the sides swap cores every SWAP_EVERY steps
CORE_ENV = "TRAINYARD_BENCH_CORE_PHASE"
SWAP_EVERY = 5


class LMStepClock(L.Callback):
    """Stamps every train batch end (`perf_counter` and wall time) and whether a platform checkpoint write was in
    flight.

    With `TRAINYARD_BENCH_BARRIER=<dir>:<side>` in the environment it waits at the start of training until both
    sides of a pair have reached theirs, so their steps run at the same time. Writes JSON at the end of fit.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.ends: list[float] = []
        self.walls: list[float] = []
        self.writing: list[bool] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        barrier = os.environ.get(BARRIER_ENV)
        if not barrier:
            return
        directory, side = barrier.rsplit(":", 1)
        Path(directory, side).touch()
        deadline = time.time() + 300
        while len(os.listdir(directory)) < 2:
            if time.time() > deadline:
                raise RuntimeError(f"the other side never reached the barrier in {directory}")
            time.sleep(0.005)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        phase = os.environ.get(CORE_ENV)
        if (
            phase is not None and len(self.ends) % SWAP_EVERY == 0
        ):  # the training thread onto the other core of the pair's two
            os.sched_setaffinity(0, {(int(phase) + len(self.ends) // SWAP_EVERY) % 2})
        self.ends.append(time.perf_counter())
        self.walls.append(time.time())
        self.writing.append(
            any(
                bool(getattr(getattr(getattr(c, "io", None), "writer", None), "in_flight", False))
                for c in getattr(trainer, "callbacks", [])
            )
        )

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == 0 and self.path:
            with open(self.path, "w") as f:
                json.dump({"batch_end": self.ends, "wall": self.walls, "writing": self.writing}, f)


class TimedDecoderLM(DecoderLM):
    """`DecoderLM` whose runs carry an `LMStepClock` writing to `clock_path`."""

    def __init__(
        self,
        clock_path: str = "",
        vocab_size: int = 257,
        block_size: int = 64,
        width: int = 64,
        heads: int = 4,
        blocks: int = 2,
        expansion: int = 4,
        tie_weights: bool = False,
        lr: float = 3e-3,
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__(
            vocab_size=vocab_size,
            block_size=block_size,
            width=width,
            heads=heads,
            blocks=blocks,
            expansion=expansion,
            tie_weights=tie_weights,
            lr=lr,
            weight_decay=weight_decay,
        )
        self.clock_path = clock_path

    def configure_callbacks(self) -> list[L.Callback]:
        return [LMStepClock(self.clock_path)]


def _splits(root: str, tokens: int) -> dict[str, str]:
    paths = {split: os.path.join(root, split) for split in ("train", "val", "test")}
    write_corpus(paths["train"], tokens, seed=0, block_size=BLOCK, vocab=VOCAB)
    for i, split in enumerate(("val", "test")):
        write_corpus(paths[split], 8 * BATCH * (BLOCK + 1), seed=i + 1, block_size=BLOCK, vocab=VOCAB)
    return paths


def run_platform(paths: dict[str, str], out: str, clock: str, steps: int) -> None:
    """In the child: one causal_lm trial through `training.entrypoint`."""
    from training import entrypoint
    from training.spec import DataSpec, ImportTarget, TrainSpec

    spec = TrainSpec(
        pipeline="language/bench",
        trial_id="trial-0000",
        prediction_task="causal_lm",
        model=ImportTarget(path="bench.lm_throughput:TimedDecoderLM", kwargs={"clock_path": clock, **MODEL}),
        datamodule=ImportTarget(path="training.streaming:StreamingShardDataModule", kwargs={"block_size": BLOCK}),
        data=DataSpec(
            train_uri=paths["train"],
            val_uri=paths["val"],
            test_uri=paths["test"],
            features=["tokens"],
            target="tokens",
            version="0" * 32,
        ),
        output_uri=os.path.join(out, "run"),
        max_epochs=1,
        limit_train_batches=steps,
        batch_size=BATCH,
        monitor="val_loss",
        monitor_mode="min",
    )
    spec_path = os.path.join(out, "spec.json")
    with open(spec_path, "w") as f:
        f.write(spec.to_json())
    code = entrypoint.main(["--spec", spec_path])
    if code != 0:
        raise SystemExit(f"the platform trial exited {code}")


def run_bare(paths: dict[str, str], clock: str, steps: int) -> None:
    """In the child: the same model and data module under a bare `L.Trainer`."""
    from training.streaming import StreamingShardDataModule

    L.seed_everything(0)
    dm = StreamingShardDataModule(paths["train"], paths["val"], paths["test"], batch_size=BATCH, block_size=BLOCK)
    model = TimedDecoderLM(clock_path=clock, vocab_size=int(dm.vocab_size or 0), block_size=BLOCK, **MODEL)
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        limit_train_batches=steps,
        deterministic=True,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, dm)


def steady(clock: str, warmup: int, window: Optional[tuple[float, float]] = None) -> dict[str, Any]:
    """A run's steady-state step periods from its clock file (see the module docstring).

    With `window` (wall-clock start, end) only the periods that lie within it count: the time both sides of a pair
    were stepping at once.
    """
    with open(clock) as f:
        c = json.load(f)
    ends, writing = np.asarray(c["batch_end"]), np.asarray(c["writing"], dtype=bool)
    periods = np.diff(ends)
    quiet = ~(writing[:-1] | writing[1:])
    quiet[:warmup] = False
    inside = np.ones_like(quiet)
    if window is not None:
        walls = np.asarray(c["wall"])
        inside = (walls[:-1] >= window[0]) & (walls[1:] <= window[1])
    keep = quiet & inside
    kept = periods[keep]
    if len(kept) < 2:
        raise RuntimeError(f"{clock}: only {len(kept)} steady periods of {len(ends)} steps")
    mean = float(kept.mean())
    return {
        "step_ms_mean": 1e3 * mean,
        "step_ms_median": 1e3 * float(np.median(kept)),
        "tokens_per_s": BATCH * BLOCK / mean,
        "steady_periods": int(len(kept)),
        "write_periods": int((~quiet[warmup:] & inside[warmup:]).sum()),
        "steps": int(len(ends)),
        "step_ms_mean_incl_writes": 1e3 * float(periods[warmup:][inside[warmup:]].mean()),
    }


def _window(clocks: Sequence[str], warmup: int) -> tuple[float, float]:
    """The wall-clock span in which every side of a pair was past its warm-up and still stepping."""
    walls = []
    for clock in clocks:
        with open(clock) as f:
            walls.append(json.load(f)["wall"])
    return max(w[warmup] for w in walls), min(w[-1] for w in walls)


def _pair(root: str, k: int, steps: int, warmup: int) -> dict[str, dict[str, Any]]:
    """Both sides at once, each a fresh process; their steps start together (the clock's barrier)."""
    barrier = os.path.join(root, f"barrier-{k}")
    os.makedirs(barrier)
    procs, clocks = {}, {}
    started = time.perf_counter()
    for side in ("platform", "bare") if k % 2 == 0 else ("bare", "platform"):
        out = os.path.join(root, f"{side}-{k}")
        os.makedirs(out)
        clocks[side] = os.path.join(out, "clock.json")
        env = {**os.environ, "OMP_NUM_THREADS": "1", BARRIER_ENV: f"{barrier}:{side}",
               **({CORE_ENV: str(int(side == "bare"))} if (os.cpu_count() or 1) >= 2 else {}),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        procs[side] = subprocess.Popen(
            [sys.executable, "-m", "bench.lm_throughput", "--child", side, root, out, clocks[side], str(steps)],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
    errors = {side: p.communicate(timeout=600)[1] for side, p in procs.items()}
    for side, p in procs.items():
        if p.returncode != 0:
            raise RuntimeError(f"{side} run failed with exit code {p.returncode}:\n{errors[side][-4000:]}")
    window = _window(list(clocks.values()), warmup)
    return {side: {**steady(clocks[side], warmup, window), "window_seconds": window[1] - window[0],
                   "pair_seconds": time.perf_counter() - started} for side in procs}


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--warmup", type=int, default=WARMUP)
    parser.add_argument("--pairs", type=int, default=PAIRS)
    args = parser.parse_args(argv)
    runs: dict[str, list[dict[str, Any]]] = {"platform": [], "bare": []}
    with tempfile.TemporaryDirectory(prefix="trainyard-bench-lm-") as root:
        _splits(root, (args.steps + 8) * BATCH * (BLOCK + 1))
        for k in range(args.pairs):
            for side, run in _pair(root, k, args.steps, args.warmup).items():
                runs[side].append(run)
    ours, theirs = [r["tokens_per_s"] for r in runs["platform"]], [r["tokens_per_s"] for r in runs["bare"]]
    value, baseline = statistics.median(ours), statistics.median(theirs)
    return write_result(
        "lm_throughput",
        value,
        "tokens/s",
        baseline,
        {
            "what": f"steady-state training tokens/s (mean step period after {args.warmup} warm-up steps, async "
                    "checkpoint writes apart) of "
            f"DecoderLM {MODEL} vocab {VOCAB} block {BLOCK}, batch {BATCH}, {args.steps} steps on "
            "StreamingShardDataModule, one CPU "
            "process with 1 thread each, the two sides stepping at the same time: a causal_lm trial through "
            "training.entrypoint vs bare "
            f"L.Trainer.fit",
            "paired": paired_ratios(ours, theirs, TARGET, "higher"),
            "added_ms_per_step": statistics.median(r["step_ms_mean"] for r in runs["platform"])
            - statistics.median(r["step_ms_mean"] for r in runs["bare"]),
            "runs": runs,
            "order": "both sides of a pair at once; pair k starts the platform's process first when k is even",
            "steps": args.steps,
            "warmup_steps": args.warmup,
        },
        targets=[Target("ratio", ">=", TARGET), Target("details.paired.ci_low", ">=", TARGET, unit="x, interval low")],
        better="higher",
        runs=ours,
        baseline_runs=theirs,
    )


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "--child":
        _side, _root, _out, _clock, _steps = sys.argv[2:]
        _paths = {split: os.path.join(_root, split) for split in ("train", "val", "test")}
        if _side == "platform":
            run_platform(_paths, _out, _clock, int(_steps))
        else:
            run_bare(_paths, _clock, int(_steps))
    else:
        print(json.dumps(main(), indent=2))
