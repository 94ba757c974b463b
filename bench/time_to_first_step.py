"""Time to first step: a file lands -> the first trial's first training step, with the sensors on and a real daemon.

Set-up (not timed): a fresh PostgreSQL database for every Dagster storage, a
fresh DAGSTER_HOME (the shipped deploy/local/dagster.yaml plus `storage:
postgres:`), a fresh TRAINYARD_HOME, and `dagster dev` serving this module as a
code location: a small pipeline built as a team builds one
(`build_definitions` with `local_resources`), three separable Gaussian blobs
(300 rows, 4 features), a Lightning MLP, one 1-epoch trial on one process, with
its landing sensor and sweep sensor at their shipped intervals (60 s and 10 s)
and default statuses (on). The benchmark waits for the daemon's first tick of
the landing sensor (an empty landing folder), so daemon start-up is not timed.

Timed, once: the CSV lands (written aside, renamed into the pattern) -> the
first trial's first training step (`first_step_at` of the trial's attempt
record). Breakdown: landing sensor tick (land -> `prepare` run created), the
`prepare` run (queue, launch, steps: raw_data, validated_data, sweep), sweep
sensor tick (prepare success -> `train` run created), the train run's queue
and launch, STEP_START -> the trial's process running (step process, launcher,
torchrun, imports), and the trial's process -> its first step.

Target, set before measuring (the issue gives none): at most 120 s. A person
who drops a file should see training start within two minutes; that holds the
mean waits of the sensor intervals shipped when it was set (30 s + 15 s; the
sweep sensor's is 10 s since) plus 75 s for the two runs and the trial's start-up. The file lands just after a landing
sensor
tick, so that sensor's wait is its whole interval (its worst case, 60 s, not
its mean, 30 s); the sweep sensor's wait (0-10 s) depends on where in its
interval `prepare` ends. The breakdown reports both apart.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Optional

from bench.harness import Target, write_result

ROOT = Path(__file__).resolve().parent.parent
HOME_ENV = "TRAINYARD_BENCH_TTFS_HOME"  # set for the code server: this module then defines the location
LOCATION = "bench_ttfs"
TARGET_SECONDS = 120.0
TIMEOUT_S = 200
ROWS = 300
FEATURES = ["f0", "f1", "f2", "f3"]


def _spec() -> Any:
    from training.spec import Distribution
    from trainyard import ColumnSpec, ModelSpec, PipelineSpec, SourceSpec
    from trainyard.search import FloatParam, SearchSpec

    return PipelineSpec(
        team="bench",
        name="blobs",
        description="Three separable blobs: the time-to-first-step benchmark.",
        source=SourceSpec(prefix="landing/bench/blobs", pattern="*.csv"),
        columns={
            **{f: ColumnSpec(dtype="float") for f in FEATURES},
            "label": ColumnSpec(dtype="int", domain=[0, 1, 2]),
        },
        target="label",
        min_rows=200,
        model=ModelSpec(
            path="training.parallel:MLPClassifier",
            hparams={"width": 16, "blocks": 1, "expansion": 2},
            max_epochs=1,
            batch_size=32,
        ),
        search=SearchSpec(
            params={"lr": FloatParam(low=0.02, high=0.05, log=True)}, n_trials=1, sampler="random", seed=0
        ),
        distribution=Distribution(procs_per_node=1),
    )


def _definitions() -> Any:
    from pipelines.environments import local_resources
    from pipelines.factory import build_definitions

    return build_definitions(_spec(), resources=local_resources(Path(os.environ[HOME_ENV])))


def _land(home: Path, spec: Any) -> float:
    """Write the blobs CSV aside and rename it into the landing pattern; the time of the rename."""
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(0)
    labels = np.arange(ROWS) % 3
    x = rng.normal(0.0, 0.3, size=(ROWS, len(FEATURES)))
    x[np.arange(ROWS), labels] += 6.0
    landing = home / "store" / spec.source.prefix
    landing.mkdir(parents=True, exist_ok=True)
    aside = landing / ".part-0.csv.partial"
    pd.DataFrame({**{f: x[:, i].round(6) for i, f in enumerate(FEATURES)}, "label": labels}).to_csv(aside, index=False)
    landed = time.time()
    aside.replace(landing / "part-0.csv")
    return landed


def _first_attempt(home: Path) -> Optional[dict[str, Any]]:
    """The first trial attempt record that has reached its first step, if any."""
    from training.spec import ATTEMPTS_DIR

    for path in sorted((home / "store").rglob(f"{ATTEMPTS_DIR}/*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if record.get("first_step_at") is not None:
            return dict(record)
    return None


def _run(instance: Any, job: str) -> Any:
    from dagster import RunsFilter

    records = instance.get_run_records(RunsFilter(job_name=job), limit=1, ascending=True)
    return records[0] if records else None


def breakdown(landed: float, prepare_created: float, prepare: dict[str, float], train_created: float,
              train_events: list[tuple[str, float, Optional[str]]], attempt: dict[str, Any]) -> dict[str, float]:
    """The phases from landing to first step; they add up to `total` (first step - landed)."""
    from bench.e2e_support import START, STEP_START, first_event

    start, step_start = first_event(train_events, START), first_event(train_events, STEP_START)
    phases = {
        "landing_sensor_tick": prepare_created - landed,
        "prepare_queue_and_launch": prepare["queued"] + prepare["launch"],
        "prepare_steps": prepare["to_first_step"] + prepare["steps"] + prepare["finish"],
        "sweep_sensor_tick": train_created - (prepare_created + prepare["total"]),
        "train_queue_and_launch": start - train_created,
        "train_run_to_step_start": step_start - start,
        "step_to_trial_process": attempt["started"] - step_start,
        "trial_process_to_first_step": attempt["first_step_at"] - attempt["started"],
    }
    return {**phases, "total": attempt["first_step_at"] - landed}


def _measure(dev: Any, instance: Any, home: Path) -> dict[str, Any]:
    from bench.e2e_support import run_events, run_phases, wait_for
    from pipelines.factory import job_names
    from trainyard import naming

    spec = _spec()
    names = job_names(spec)
    landing_sensor = naming.landing_sensor_name(spec)
    wait_for(lambda: f"Checking for new runs for sensor: {landing_sensor}" in dev.log.read_text(errors="replace"), 120,
             "the daemon's first landing sensor tick", log=dev.log)
    landed = _land(home, spec)
    attempt = wait_for(lambda: _first_attempt(home), TIMEOUT_S, "the first trial's first step", log=dev.log)
    prepare, train = _run(instance, names["prepare"]), _run(instance, names["train"])
    prepare_phases = run_phases(
        run_events(instance, prepare.dagster_run.run_id), submitted=prepare.create_timestamp.timestamp()
    )
    train_events = run_events(instance, train.dagster_run.run_id)
    phases = breakdown(
        landed,
        prepare.create_timestamp.timestamp(),
        prepare_phases,
        train.create_timestamp.timestamp(),
        train_events,
        attempt,
    )
    return {"phases": phases, "prepare_phases": prepare_phases, "attempt": attempt}


def main() -> dict:
    warnings.filterwarnings("ignore")
    sys.path.insert(0, str(ROOT))
    from dagster import DagsterInstance

    from bench.e2e_support import dagster_dev, dagster_home, fresh_database
    from pipelines.landing_sensor import MINIMUM_INTERVAL_SECONDS as landing_interval
    from pipelines.sensors import MINIMUM_INTERVAL_SECONDS as sweep_interval

    with tempfile.TemporaryDirectory(prefix="ttfs-") as tmp, fresh_database() as pg_url:
        work = Path(tmp)
        home = work / "trainyard"
        home.mkdir()
        dhome = dagster_home(work / "dagster", pg_url)
        env = {"DAGSTER_HOME": str(dhome), "TRAINYARD_HOME": str(home), HOME_ENV: str(home)}
        instance = DagsterInstance.from_config(str(dhome))
        with dagster_dev("bench.time_to_first_step", LOCATION, env, work, expected_assets=1) as dev:
            measured = _measure(dev, instance, home)
        instance.dispose()
    phases = measured["phases"]
    ticks = phases["landing_sensor_tick"] + phases["sweep_sensor_tick"]
    return write_result(
        "time_to_first_step",
        phases["total"],
        "s",
        None,
        {
            "what": "a landing file renamed into place -> the first trial's first training step (one measurement)",
            "phases_seconds": {k: round(v, 3) for k, v in phases.items()},
            "sensor_waits_seconds": round(ticks, 3),
            "excluding_sensor_waits_seconds": round(phases["total"] - ticks, 3),
            "sensor_intervals_seconds": {"landing": landing_interval, "sweep": sweep_interval},
            "note": "the file lands just after a landing sensor tick: that wait is the sensor's worst case (its whole "
                    "interval)",
            "prepare_run_phases_seconds": {k: round(v, 3) for k, v in measured["prepare_phases"].items()},
            "attempt": measured["attempt"],
            "target_reason": "set before measuring: training should start within 2 min of a file landing "
            "(the shipped sensor intervals' mean waits, 45 s, plus 75 s for the runs and the trial's start-up)",
        },
        targets=[Target("value", "<=", TARGET_SECONDS)],
        better="lower",
    )


defs = _definitions() if HOME_ENV in os.environ else None

if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
