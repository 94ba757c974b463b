"""Hang detection: from a rank's hang to the first step of the restarted gang (torchrun under `training.gang`).

A 2-process DDP run of the digits model, checkpointing every 20 steps, has
rank 1 block forever before step 50's gradient all-reduce (`drill_hang`; rank 0
then waits in that all-reduce). The agent's watchdog declares the gang hung
after the hang timeout (`WatchdogPolicy`: floor `FLOOR_SECONDS`, since the
step time here is milliseconds), dumps the ranks' stacks, records the hung
rank and SIGKILLs the workers; torchrun restarts the group, which resumes from
the newest committed checkpoint. Measured from the moment the drill recorded
(its marker) to the first step of the restarted group (its attempt record),
in parts: detection (hang to the agent's decision: the timeout plus up to a
poll), stack dump, kill, restart (the kill to the new group's training
process starting its task: torchrun noticing, new processes, imports) and
first step (process group, checkpoint load, data, the step).

Baseline: the timeout in force plus `BOUND_SECONDS`, the bound this project
states for everything after the timeout (a poll, the dumps, the kill, and a
cold worker group's start to its first step on CPU). Target: ratio <= 1.
Value and baseline are medians of `REPEATS` runs.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

from bench.harness import Target, write_result
from bench.recovery import _splits
from resources.launcher import LocalLauncher
from training.attempts import read_attempts
from training.spec import CheckpointPolicy, DataSpec, Distribution, FaultInjection, ImportTarget, TrainSpec, WatchdogPolicy

REPEATS = 3
FLOOR_SECONDS = 5.0
BOUND_SECONDS = 20.0  # poll 0.5 s + stack dumps <= 3 s + kill + a cold group's start to its first step (about 8-12 s here)
HANG_AT_STEP = 50


def run(tmp: Path, features: list[str], i: int) -> dict[str, float]:
    out = tmp / f"run-{i}"
    spec = TrainSpec(
        pipeline="bench/hang-detect",
        trial_id="trial-0000",
        model=ImportTarget(path="pipelines.vision.models:DigitsMLP", kwargs={"hidden": 64, "lr": 0.01}),
        data=DataSpec(train_uri=str(tmp / "train.parquet"), val_uri=str(tmp / "val.parquet"), test_uri=str(tmp / "test.parquet"),
                      features=features, target="label", version="bench"),
        output_uri=str(out),
        max_epochs=2,
        batch_size=16,
        distribution=Distribution(procs_per_node=2, max_restarts=1),
        checkpoint=CheckpointPolicy(every_n_steps=20, watchdog=WatchdogPolicy(hang_floor_seconds=FLOOR_SECONDS)),
        faults=FaultInjection(hang_rank=1, hang_at_step=HANG_AT_STEP),
    )
    LocalLauncher(warm_workers=False).launch(spec)  # the agent that watches is training.gang's
    hung_at = float((out / "faults" / "hang").read_text())
    (record_path,) = (out / "failures").glob("rank-1-hang-*.json")
    record = json.loads(record_path.read_text())
    attempts = read_attempts(str(out))
    assert len(attempts) == 2, attempts
    killed = record["time"] + record["seconds"]["stack_dump"] + record["seconds"]["kill"]
    return {
        "total": attempts[1]["first_step_at"] - hung_at,
        "timeout": record["timeout_seconds"],
        "detection": record["time"] - hung_at,
        "stack_dump": record["seconds"]["stack_dump"],
        "kill": record["seconds"]["kill"],
        "restart": attempts[1]["started"] - killed,
        "first_step": attempts[1]["first_step_at"] - attempts[1]["started"],
    }


def main() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        features = _splits(tmp_path)
        runs = [run(tmp_path, features, i) for i in range(REPEATS)]
    totals = [r["total"] for r in runs]
    baselines = [r["timeout"] + BOUND_SECONDS for r in runs]
    return write_result(
        "hang_detect_seconds",
        statistics.median(totals),
        "s",
        statistics.median(baselines),
        {
            "baseline_is": f"the hang timeout in force + {BOUND_SECONDS:g} s, the stated bound for the dumps, the kill and a cold restart to the first step",
            "parts_seconds": {k: [round(r[k], 3) for r in runs] for k in ("detection", "stack_dump", "kill", "restart", "first_step")},
            "timeout_seconds": [r["timeout"] for r in runs],
            "hang_floor_seconds": FLOOR_SECONDS,
            "bound_seconds": BOUND_SECONDS,
            "hang_at_step": HANG_AT_STEP,
            "processes": 2,
        },
        targets=[Target("ratio", "<=", 1.0)],
        better="lower",
        runs=totals,
        baseline_runs=baselines,
    )


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
