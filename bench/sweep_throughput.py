"""Sweep throughput: 1-epoch digits trials per hour at parallelism 2 through the platform, vs the same trials back to
back in one warm process.

Platform (the real path): a fresh PostgreSQL database for every Dagster
storage, a fresh DAGSTER_HOME (deploy/local/dagster.yaml's run queue and team
limit of 2, plus `storage: postgres:`), `dagster dev` serving this module: the
vision team's digits pipeline with one process per trial, 1 epoch, 4 trials,
parallelism 2, and its sweep sensor at the shipped interval (10 s). `prepare`
is launched through GraphQL; the sweep sensor then starts the trials' runs, two
at a time; a run whose trial was short goes on with the sweep's next trial
(`SearchSpec.reuse_run_under_seconds`, the pipeline's default), otherwise a new
run starts at the tick after one finishes. Window: the `sweep` materialized (in
`prepare`, whose run ends a little later) -> every trial materialized and the
last trial run's success.

Reference: the trials' own TrainSpecs (their `spec.json`, the same parameters
and data), each with a fresh output directory and no study to report to,
trained back to back by `training.entrypoint.train` in this one process after
its imports are done (warm). Window: the first trial's start -> the last's end.

Value: platform trials per hour; baseline: reference trials per hour; ratio =
platform / reference (higher is better). Target (issue 16): ratio >= 0.7.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from bench.harness import Target, write_result

ROOT = Path(__file__).resolve().parent.parent
HOME_ENV = "TRAINYARD_BENCH_SWEEP_HOME"  # set for the code server: this module then defines the location
LOCATION = "bench_sweep"
TRIALS = 4
PARALLELISM = 2
TARGET_RATIO = 0.7
TIMEOUT_S = 420


def _spec() -> Any:
    from pipelines.vision.digits import digits
    from training.spec import Distribution

    model = digits.model.model_copy(update={"max_epochs": 1})
    search = digits.search.model_copy(
        update={"n_trials": TRIALS, "parallelism": PARALLELISM, "sampler": "random", "seed": 0}
    )
    return digits.model_copy(update={"model": model, "search": search, "distribution": Distribution(procs_per_node=1)})


def _definitions() -> Any:
    from dagster import Definitions

    from pipelines.environments import local_resources
    from pipelines.factory import build_definitions
    from pipelines.sensors import with_sweep_sensors

    spec = _spec()
    full = build_definitions(spec, resources=local_resources(Path(os.environ[HOME_ENV])))
    bare = Definitions(
        assets=list(full.assets or []), jobs=list(full.jobs or []), resources=full.resources, executor=full.executor
    )
    return with_sweep_sensors(bare, spec)  # the sweep sensor only: no landing or drift sensor starts anything else


def _landing(home: Path, spec: Any) -> None:
    from sklearn.datasets import load_digits

    from pipelines.vision.digits import PIXELS

    data = load_digits(as_frame=True).frame
    data.columns = [*PIXELS, "label"]
    landing = home / "store" / spec.source.prefix
    landing.mkdir(parents=True)
    data.to_csv(landing / "part-0.csv", index=False)


def _trials_materialized(instance: Any, spec: Any) -> dict[str, tuple[float, str]]:
    """trial_model's materialized partitions: partition -> (timestamp, run id) of its latest materialization."""
    from dagster import AssetKey, DagsterEventType, EventRecordsFilter

    from trainyard import naming

    key = AssetKey(naming.asset_path(spec, naming.TRIAL_MODEL))
    records = instance.get_event_records(
        EventRecordsFilter(event_type=DagsterEventType.ASSET_MATERIALIZATION, asset_key=key), ascending=True
    )
    return {r.event_log_entry.dagster_event.partition: (float(r.timestamp), r.run_id) for r in records}


def _sweep_materialized(instance: Any, spec: Any, run_id: str) -> float:
    """When `prepare` run `run_id` materialized the sweep (its trials exist from then; the run itself ends a little
    later)."""
    from dagster import AssetKey, DagsterEventType, EventRecordsFilter

    from trainyard import naming

    key = AssetKey(naming.asset_path(spec, naming.SWEEP))
    records = instance.get_event_records(
        EventRecordsFilter(event_type=DagsterEventType.ASSET_MATERIALIZATION, asset_key=key), ascending=True
    )
    times = [float(r.timestamp) for r in records if r.run_id == run_id]
    if not times:
        raise RuntimeError(f"prepare run {run_id} succeeded without materializing the sweep")
    return times[-1]


def _platform(dev: Any, instance: Any, home: Path) -> dict[str, Any]:
    """Platform window: the sweep materialized -> every trial materialized and every trial run ended (successfully).

    A run may train more than its own trial (`SearchSpec.reuse_run_under_seconds`), so the trials
    are counted by trial_model's materialized partitions, not by runs.
    """
    from dagster import DagsterRunStatus, RunsFilter

    from bench.e2e_support import run_events, run_phases, wait_for, wait_for_run
    from pipelines.factory import job_names

    spec = _spec()
    names = job_names(spec)
    prepare = dev.launch(names["prepare"])
    wait_for_run(instance, prepare, TIMEOUT_S, dev.log)
    swept = _sweep_materialized(instance, spec, prepare)
    prepare_ended = instance.get_run_record_by_id(prepare).end_time

    def finished() -> Any:
        records = instance.get_run_records(RunsFilter(job_name=names["train"]))
        failed = [r.dagster_run.run_id for r in records if r.dagster_run.status == DagsterRunStatus.FAILURE]
        if failed:
            raise RuntimeError(f"trial runs failed: {failed}\n{dev.log.read_text(errors='replace')[-3000:]}")
        if len(_trials_materialized(instance, spec)) < TRIALS:
            return None
        return records if records and all(r.dagster_run.status == DagsterRunStatus.SUCCESS for r in records) else None

    records = wait_for(finished, TIMEOUT_S, f"{TRIALS} trials materialized and their runs ended", log=dev.log)
    trials = _trials_materialized(instance, spec)
    ended = max(r.end_time for r in records)
    runs = [
        {
            "partition": r.dagster_run.tags.get("dagster/partition"),
            "created": r.create_timestamp.timestamp(),
            "ended": r.end_time,
            "trials": sorted(p for p, (_, run) in trials.items() if run == r.dagster_run.run_id),
            "phases": run_phases(run_events(instance, r.dagster_run.run_id), submitted=r.create_timestamp.timestamp()),
        }
        for r in records
    ]
    first_created = min(r["created"] for r in runs)
    return {
        "seconds": ended - swept,
        "first_trial_run_after_sweep_seconds": first_created - swept,
        "prepare_run_ended_after_sweep_seconds": prepare_ended - swept,
        "runs": sorted(runs, key=lambda r: r["created"]),
        "trial_materialized_after_sweep_seconds": {p: round(t - swept, 3) for p, (t, _) in sorted(trials.items())},
    }


def _reference(home: Path, work: Path) -> dict[str, Any]:
    """The platform's trials again, back to back in this process (imports done first)."""
    import training.lightning_task  # noqa: F401 - warm: the imports a trial would pay are paid before timing
    from training.entrypoint import load_spec, train
    from training.spec import SPEC_FILE

    specs = sorted((home / "store").rglob(f"trial-*/{SPEC_FILE}"))
    if len(specs) != TRIALS:
        raise RuntimeError(f"expected {TRIALS} trial specs under {home / 'store'}, found {len(specs)}")
    seconds = []
    started = time.perf_counter()
    for n, path in enumerate(specs):
        spec = load_spec(str(path)).model_copy(
            update={"output_uri": str(work / "reference" / f"trial-{n}"), "optuna": None}
        )
        t0 = time.perf_counter()
        train(spec)
        seconds.append(time.perf_counter() - t0)
    return {"seconds": time.perf_counter() - started, "trial_seconds": seconds}


def main() -> dict:
    warnings.filterwarnings("ignore")
    sys.path.insert(0, str(ROOT))
    from dagster import DagsterInstance

    from bench.e2e_support import dagster_dev, dagster_home, fresh_database
    from pipelines.sensors import MINIMUM_INTERVAL_SECONDS as sweep_interval

    spec = _spec()
    with tempfile.TemporaryDirectory(prefix="sweep-throughput-") as tmp, fresh_database() as pg_url:
        work = Path(tmp)
        home = work / "trainyard"
        _landing(home, spec)
        dhome = dagster_home(work / "dagster", pg_url)
        env = {"DAGSTER_HOME": str(dhome), "TRAINYARD_HOME": str(home), HOME_ENV: str(home)}
        instance = DagsterInstance.from_config(str(dhome))
        with dagster_dev("bench.sweep_throughput", LOCATION, env, work, expected_assets=1) as dev:
            platform = _platform(dev, instance, home)
        instance.dispose()
        reference = _reference(home, work)
    per_hour = TRIALS * 3600.0 / platform["seconds"]
    reference_per_hour = TRIALS * 3600.0 / reference["seconds"]
    return write_result(
        "sweep_throughput",
        per_hour,
        "trials/h",
        reference_per_hour,
        {
            "what": f"{TRIALS} one-epoch digits trials, parallelism {PARALLELISM}: sweep materialized -> last trial "
                    "run succeeded, "
            "vs the same TrainSpecs back to back in one warm process",
            "platform_seconds": platform["seconds"],
            "reference_seconds": reference["seconds"],
            "reference_trial_seconds": reference["trial_seconds"],
            "first_trial_run_after_sweep_seconds": platform["first_trial_run_after_sweep_seconds"],
            "prepare_run_ended_after_sweep_seconds": platform["prepare_run_ended_after_sweep_seconds"],
            "platform_runs": platform["runs"],
            "platform_run_count": len(platform["runs"]),
            "trial_materialized_after_sweep_seconds": platform["trial_materialized_after_sweep_seconds"],
            "reuse_run_under_seconds": spec.search.reuse_run_under_seconds,
            "sweep_sensor_interval_seconds": sweep_interval,
        },
        targets=[Target("ratio", ">=", TARGET_RATIO)],
        better="higher",
    )


defs = _definitions() if HOME_ENV in os.environ else None

if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
