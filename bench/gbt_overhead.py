"""GBT platform overhead through the real path: `dagster dev`, the run queue, the default run launcher, PostgreSQL run
storage.

Set-up (not timed): a fresh PostgreSQL database holds every Dagster storage; a
fresh DAGSTER_HOME has the shipped deploy/local/dagster.yaml (run queue, so the
QueuedRunCoordinator, and the DefaultRunLauncher: one run worker process per
run) plus `storage: postgres:`; a fresh TRAINYARD_HOME has the breast-cancer
landing file. `dagster dev` serves this module as a code location: the tabular
team's breast_cancer pipeline with a 3-trial search of fixed hyperparameters and
20 boosting rounds (no sensors: nothing starts runs behind the benchmark's back).
`prepare` is launched and awaited (raw_data, validated_data, sweep: three trial
partitions).

Timed, per trial (3, one after the other): the `train` run of the partition is
launched through the webserver's GraphQL API as the Launchpad does, and awaited.
Per run: submit -> dequeued by the daemon (queue) -> run worker running the job
(launch: process start-up and imports) -> the step's process at STEP_START ->
step success -> run success, and inside the step the trial's own wall time and
its training time (the result's `fit_seconds`).

Value: median over the runs of platform overhead = submit -> run success minus
the trial's training time. Target (issue 16): at most 5 s per run. Lower is better.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from bench.harness import Target, write_result

ROOT = Path(__file__).resolve().parent.parent
HOME_ENV = "TRAINYARD_BENCH_GBT_HOME"  # set for the code server: this module then defines the location
LOCATION = "bench_gbt"
REPEATS = 3
ROUNDS = 20
TARGET_SECONDS = 5.0
HPARAMS = {"objective": "binary", "early_stopping_rounds": 30, "num_leaves": 15, "learning_rate": 0.1}
RUN_TIMEOUT_S = 240


def _spec() -> Any:
    from pipelines.tabular.breast_cancer import breast_cancer
    from trainyard.search import FloatParam, SearchSpec

    model = breast_cancer.model.model_copy(update={"hparams": HPARAMS, "max_epochs": ROUNDS})
    # a search needs a space: a narrow one around HPARAMS' rate, all trials in flight (partitions) at once
    search = SearchSpec(
        params={"learning_rate": FloatParam(low=0.09, high=0.11)},
        n_trials=REPEATS,
        parallelism=REPEATS,
        sampler="random",
        seed=0,
    )
    return breast_cancer.model_copy(update={"model": model, "search": search})


def _definitions() -> Any:
    from dagster import Definitions

    from pipelines.environments import local_resources
    from pipelines.factory import build_definitions

    full = build_definitions(_spec(), resources=local_resources(Path(os.environ[HOME_ENV])))
    return Definitions(
        assets=list(full.assets or []), jobs=list(full.jobs or []), resources=full.resources, executor=full.executor
    )


def _trial_result(home: Path, partition: str) -> dict[str, Any]:
    """The trial's own result (`result.json` in its run directory): its training and wall time as the trial measured
    them."""
    found = sorted((home / "store").rglob(f"{partition}/result.json"))
    if len(found) != 1:
        raise RuntimeError(
            f"expected one result.json of {partition} under {home / 'store'}, found {[str(p) for p in found]}"
        )
    result = json.loads(found[0].read_text())
    return {
        "fit_seconds": result.get("fit_seconds"),
        "trial_wall_seconds": result.get("wall_seconds"),
        "pod_startup_seconds": (result.get("goodput") or {}).get("startup_seconds"),
        "test_acc": (result.get("metrics") or {}).get("test_acc"),
    }


def _measure(dev: Any, instance: Any, names: dict[str, str], home: Path) -> list[dict[str, Any]]:
    from bench.e2e_support import run_events, run_phases, wait_for_run

    prepare = dev.launch(names["prepare"])
    wait_for_run(instance, prepare, RUN_TIMEOUT_S, dev.log)
    runs = []
    for n in range(REPEATS):
        submitted = time.time()
        partition = f"trial-{n:04d}"
        run_id = dev.launch(names["train"], tags={"dagster/partition": partition})
        wait_for_run(instance, run_id, RUN_TIMEOUT_S, dev.log)
        phases = run_phases(run_events(instance, run_id), submitted=submitted)
        trial = _trial_result(home, partition)
        if not isinstance(trial["fit_seconds"], (int, float)):
            raise RuntimeError(f"train run {run_id}: no fit_seconds in the trial's result: {trial}")
        inside = {"step_outside_trial_process": phases["steps"] - (trial["trial_wall_seconds"] or 0.0)}
        runs.append(
            {
                "run_id": run_id,
                "phases": phases,
                **inside,
                **trial,
                "overhead_seconds": phases["total"] - trial["fit_seconds"],
            }
        )
    return runs


def main() -> dict:
    warnings.filterwarnings("ignore")
    sys.path.insert(0, str(ROOT))
    from dagster import DagsterInstance

    from bench.e2e_support import dagster_dev, dagster_home, fresh_database
    from pipelines.factory import job_names
    from pipelines.tabular.breast_cancer import landing_frame

    spec = _spec()
    with tempfile.TemporaryDirectory(prefix="gbt-overhead-") as tmp, fresh_database() as pg_url:
        work = Path(tmp)
        home = work / "trainyard"
        landing = home / "store" / spec.source.prefix
        landing.mkdir(parents=True)
        landing_frame().to_csv(landing / "part-0.csv", index=False)
        dhome = dagster_home(work / "dagster", pg_url)
        env = {"DAGSTER_HOME": str(dhome), "TRAINYARD_HOME": str(home), HOME_ENV: str(home)}
        instance = DagsterInstance.from_config(str(dhome))
        coordinator, launcher = type(instance.run_coordinator).__name__, type(instance.run_launcher).__name__
        with dagster_dev("bench.gbt_overhead", LOCATION, env, work, expected_assets=1) as dev:
            runs = _measure(dev, instance, job_names(spec), home)
        instance.dispose()
    overhead = [r["overhead_seconds"] for r in runs]
    phases = {k: round(statistics.median(r["phases"][k] for r in runs), 3) for k in runs[0]["phases"]}
    fit = statistics.median(r["fit_seconds"] for r in runs)
    return write_result(
        "gbt_overhead",
        statistics.median(overhead),
        "s",
        None,
        {
            "what": "per train run: submit -> run success minus the trial's training time (fit_seconds)",
            "median_phases_seconds": phases,
            "median_fit_seconds": fit,
            "median_step_outside_trial_process_seconds": statistics.median(
                r["step_outside_trial_process"] for r in runs
            ),
            "median_trial_wall_seconds": statistics.median(r["trial_wall_seconds"] or 0.0 for r in runs),
            "runs": runs,
            "instance": {
                "run_coordinator": coordinator,
                "run_launcher": launcher,
                "storage": "postgres",
                "executor": "in_process (the platform default, pipelines.factory)",
            },
            "data": "scikit-learn breast cancer, 569 rows x 30 features",
            "params": {**HPARAMS, "rounds": ROUNDS},
        },
        targets=[Target("value", "<=", TARGET_SECONDS)],
        better="lower",
        runs=overhead,
    )


defs = _definitions() if HOME_ENV in os.environ else None

if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
