"""Recovery time: from a rank's death to the first training step after resume (local launcher).

A 2-process DDP run of the digits model, checkpointing every 20 steps, loses
rank 1 to SIGKILL mid-epoch; the launch's agent (the warm worker supervisor on
the default local path since aeff01a, torchrun's agent on the cold one)
restarts the worker group, which resumes from the newest committed checkpoint. Measured from the kill (the drill's
marker time) to the first step of the restarted group (its attempt record),
so it covers failure detection, worker-group restart, process start-up
(imports, none left on warm workers), checkpoint load and data set-up. Baseline:
a start of the same job on the same path (launch to first step), so the ratio
(recovery / start, lower is better) says how many starts a recovery costs. Target: ratio <= 1.5 -- a recovery
may cost a cold start plus half of one for failure detection and checkpoint
load (a target set by principle, not fitted to a measurement). Value and
baseline are the medians of `REPEATS` runs. The warm server the launches fork
from is started before the first timed run and its start-up reported apart
(`warm_server_start_seconds`): paid once per server, not per start.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import Target, write_result
from resources.launcher import LocalLauncher
from training.fault_tolerance import read_attempts
from training.spec import CheckpointPolicy, DataSpec, Distribution, FaultInjection, ImportTarget, TrainSpec

REPEATS = 5  # the start it is divided by varies 0.13-0.8 s between runs here: 3 made one run decide the median
ROOT = Path(__file__).resolve().parent.parent


def _splits(directory: Path) -> list[str]:
    """All 1797 digits as train/val/test Parquet files (70/15/15, in order); returns the feature columns."""
    sys.path.insert(0, str(ROOT))
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.digits import digits_frame

    df = digits_frame()
    n = len(df)
    cuts = {
        "train": df.iloc[: int(n * 0.7)],
        "val": df.iloc[int(n * 0.7) : int(n * 0.85)],
        "test": df.iloc[int(n * 0.85) :],
    }
    for name, part in cuts.items():
        pq.write_table(pa.Table.from_pandas(part, preserve_index=False), directory / f"{name}.parquet")
    return [c for c in df.columns if c != "label"]


def run(tmp: Path, features: list[str], i: int) -> tuple[float, float, dict]:
    out = tmp / f"run-{i}"
    spec = TrainSpec(
        pipeline="bench/recovery",
        trial_id="trial-0000",
        model=ImportTarget(path="pipelines.vision.models:DigitsMLP", kwargs={"hidden": 64, "lr": 0.01}),
        data=DataSpec(
            train_uri=str(tmp / "train.parquet"),
            val_uri=str(tmp / "val.parquet"),
            test_uri=str(tmp / "test.parquet"),
            features=features,
            target="label",
            version="bench",
        ),
        output_uri=str(out),
        max_epochs=4,
        batch_size=16,
        distribution=Distribution(procs_per_node=2, max_restarts=1),
        checkpoint=CheckpointPolicy(every_n_steps=20),
        faults=FaultInjection(kill_rank=1, kill_at_step=50),
    )
    launched = time.time()
    result = LocalLauncher().launch(spec).result
    killed_at = float((out / "faults" / "kill").read_text())
    attempts = read_attempts(str(out))
    assert len(attempts) == 2, attempts
    recovery = attempts[1]["first_step_at"] - killed_at
    startup = attempts[0]["first_step_at"] - launched  # the launcher's default path: warm workers (torchrun when none)
    return recovery, startup, result.goodput


def warm_server_seconds() -> float | None:
    """Start (or find) the warm worker server the launches use, before any is timed; its start-up time, None when
    warm workers are off. A start inside the first run would make that run's start and the median a mix of both."""
    import os

    from resources.warm import WarmUnavailable, connect, training_env, training_root, warm_dir, warm_workers_enabled

    if not warm_workers_enabled(os.environ):
        return None
    started = time.perf_counter()
    try:
        connect(warm_dir(os.environ), python=sys.executable, root=training_root(), idle_seconds=300, start_timeout=180,
                env=training_env(os.environ)).close()
    except WarmUnavailable:
        return None
    return time.perf_counter() - started


def main() -> dict:
    server = warm_server_seconds()
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        features = _splits(tmp_path)
        runs = [run(tmp_path, features, i) for i in range(REPEATS)]
    recoveries = [r for r, _, _ in runs]
    startups = [s for _, s, _ in runs]
    return write_result(
        "recovery_seconds",
        statistics.median(recoveries),
        "s",
        statistics.median(startups),
        {
            "recovery_seconds": recoveries,
            "baseline_is": "start of the same job on the same path (warm workers by default): launch to first step",
            "startup_seconds": startups,
            "warm_server_start_seconds": server,  # paid once per server, before the timed runs (None: cold path)
            "lost_steps": [g["lost_steps"] for _, _, g in runs],
            "goodput": [g["goodput"] for _, _, g in runs],
            "checkpoint_every_steps": 20,
            "processes": 2,
        },
        targets=[Target("ratio", "<=", 1.5)],
        better="lower",
        runs=recoveries,
        baseline_runs=startups,
    )


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
