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
baseline are the medians of `REPEATS` runs.
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

REPEATS = 2
ROOT = Path(__file__).resolve().parent.parent


def _splits(directory: Path) -> list[str]:
    """All 1797 digits as train/val/test Parquet files (70/15/15, in order); returns the feature columns."""
    sys.path.insert(0, str(ROOT))
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.digits import digits_frame

    df = digits_frame()
    n = len(df)
    cuts = {"train": df.iloc[: int(n * 0.7)], "val": df.iloc[int(n * 0.7) : int(n * 0.85)], "test": df.iloc[int(n * 0.85) :]}
    for name, part in cuts.items():
        pq.write_table(pa.Table.from_pandas(part, preserve_index=False), directory / f"{name}.parquet")
    return [c for c in df.columns if c != "label"]


def run(tmp: Path, features: list[str], i: int) -> tuple[float, float, dict]:
    out = tmp / f"run-{i}"
    spec = TrainSpec(
        pipeline="bench/recovery",
        trial_id="trial-0000",
        model=ImportTarget(path="pipelines.vision.models:DigitsMLP", kwargs={"hidden": 64, "lr": 0.01}),
        data=DataSpec(train_uri=str(tmp / "train.parquet"), val_uri=str(tmp / "val.parquet"), test_uri=str(tmp / "test.parquet"),
                      features=features, target="label", version="bench"),
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


def main() -> dict:
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
