"""The sweep sensor through real Dagster runs: parallelism, team limits, crashes, budgets, restarts, reports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from dagster import AssetKey, DagsterRunStatus, RunsFilter, SensorResult, build_sensor_context

from pipelines.factory import build_definitions, job_names
from pipelines.sensors import ACTIVE, STUDY_TAG, TEAM_TAG, SweepCursor, run_tick, team_run_limit, with_sweep_sensors
from resources.sweeps import CLAIMED_BY, STOPPED
from tests.pipelines.sweep_drill import (
    TrivialLauncher,
    drill_resources,
    drill_spec,
    open_instance,
    prepared_data,
    prepared_home,
    run_sweep_asset,
    score,
    submit,
)
from training.spec import PrunerSpec
from trainyard.naming import sweep_sensor_name
from trainyard.search import IntParam, Objective, PickPolicy

ROOT = Path(__file__).resolve().parent.parent.parent


def tick(spec, instance, resources, cursor=None):
    names = job_names(spec)
    return run_tick(spec, instance, resources["sweeps"], cursor, train_job=names["train"], prepare_job=names["prepare"])


def study_of(resources, sweep):
    return resources["sweeps"].load(sweep["study"])


def states(resources, sweep) -> list[tuple[int, str]]:
    return [(t.number, t.state.name) for t in study_of(resources, sweep).get_trials()]


def test_sensor_waits_for_the_sweep_asset(tmp_path: Path) -> None:
    spec = drill_spec()
    resources = drill_resources(tmp_path, TrivialLauncher())
    instance = open_instance(tmp_path)
    defs = build_definitions(spec, resources=resources)
    sensor = defs.get_sensor_def(sweep_sensor_name(spec))
    result = sensor(build_sensor_context(instance=instance, resources={"sweeps": resources["sweeps"]}))
    assert isinstance(result, SensorResult) and not result.run_requests
    assert (
        result.skip_reason.skip_message
        == "test/digits: the sweep asset has not been materialized yet (run the prepare job)"
    )


def test_keeps_parallelism_in_flight_until_the_budget(tmp_path: Path) -> None:
    spec = drill_spec(n_trials=5, parallelism=2)
    resources = drill_resources(tmp_path, TrivialLauncher())
    instance = open_instance(tmp_path)
    sweep = prepared_home(tmp_path, spec, resources, instance)
    assert sweep["trials"] == ["trial-0000", "trial-0001"]  # the sweep asset asks the first window
    defs = build_definitions(spec, resources=resources)
    sensor = defs.get_sensor_def(sweep_sensor_name(spec))
    first = sensor(build_sensor_context(instance=instance, resources={"sweeps": resources["sweeps"]}))
    assert [r.partition_key for r in first.run_requests] == ["trial-0000", "trial-0001"]
    assert [r.run_key for r in first.run_requests] == [f"{sweep['study']}/trial-0000", f"{sweep['study']}/trial-0001"]
    assert first.run_requests[0].tags == {
        TEAM_TAG: "test",
        STUDY_TAG: sweep["study"],
        "trainyard/pipeline": "test/digits",
    }
    assert first.dynamic_partitions_requests[0].partition_keys == ["trial-0000", "trial-0001"]
    cursor = SweepCursor.parse(first.cursor)
    assert (cursor.study, cursor.next) == (sweep["study"], 2)
    # nothing finished: both slots are taken, nothing is asked
    again = tick(spec, instance, resources, first.cursor)
    assert again.run_requests == [] and again.asked == []
    assert "2 in flight of parallelism 2" in again.message
    for request in first.run_requests:
        assert submit(defs, instance, request).success
    seen = list(first.run_requests)
    cursor_text = again.cursor.dump()
    for _ in range(10):
        t = tick(spec, instance, resources, cursor_text)
        cursor_text = t.cursor.dump()
        seen += t.run_requests
        for request in t.run_requests:
            assert submit(defs, instance, request).success
        if any(r.job_name == job_names(spec)["prepare"] for r in t.run_requests):
            break
    trial_keys = [r.partition_key for r in seen if r.partition_key]
    assert trial_keys == [f"trial-{n:04d}" for n in range(5)]
    assert sorted(instance.get_dynamic_partitions("test__digits__trials")) == trial_keys
    assert states(resources, sweep) == [(n, "COMPLETE") for n in range(5)]
    report = seen[-1]
    assert report.run_key == f"{sweep['study']}/report/5" and report.asset_selection == [
        AssetKey(["test", "digits", "sweep"])
    ]
    # the report run re-materialized the sweep with its report, and the sensor rests
    meta = instance.get_latest_materialization_event(
        AssetKey(["test", "digits", "sweep"])
    ).asset_materialization.metadata
    assert meta["status"].value == "finished" and meta["finished_trials"].value == 5
    best = max(study_of(resources, sweep).get_trials(), key=lambda t: t.value)
    assert meta["best_trial"].value == f"trial-{best.number:04d}" and meta["best_params"].value == best.params
    assert meta["history_plot"].value.startswith("![history](data:image/png;base64,")
    assert meta["importance_plot"].value.startswith("![importance](data:image/png;base64,")
    assert Path(meta["history_png"].value).read_bytes().startswith(b"\x89PNG")
    assert set(meta["param_importance"].value) == {"lr"}
    assert meta["wandb_group"].value == sweep["study"] and meta["wandb_project"].value == "test-digits"
    assert meta["table"].value.count("| COMPLETE |") == 5
    rest = tick(spec, instance, resources, cursor_text)
    assert rest.run_requests == [] and "5/5 finished" in rest.message


def test_team_limit_holds_with_more_pending_trials_than_slots(tmp_path: Path) -> None:
    limit = {
        "run_queue": {
            "tag_concurrency_limits": [{"key": TEAM_TAG, "value": {"applyLimitPerUniqueValue": True}, "limit": 1}]
        }
    }
    instance = open_instance(tmp_path, **limit)
    assert team_run_limit(instance, "test") == 1
    gates = tmp_path / "gates"
    spec = drill_spec(n_trials=3, parallelism=3)
    resources = drill_resources(tmp_path, TrivialLauncher(gate_dir=str(gates), started_dir=str(tmp_path / "started")))
    sweep = prepared_home(tmp_path, spec, resources, instance)
    assert len(sweep["trials"]) == 3  # three trials pending, one team slot
    defs = build_definitions(spec, resources=resources)
    first = tick(spec, instance, resources)
    assert [r.partition_key for r in first.run_requests] == ["trial-0000"]
    assert "team test 0/1 runs" in first.message
    runner = threading.Thread(target=submit, args=(defs, instance, first.run_requests[0]))
    runner.start()
    deadline = time.time() + 60
    while not (tmp_path / "started" / "trial-0000").exists():
        assert time.time() < deadline
        time.sleep(0.05)
    held = tick(spec, instance, resources, first.cursor.dump())
    assert held.run_requests == [] and "team test 1/1 runs" in held.message
    assert instance.get_runs_count(RunsFilter(tags={TEAM_TAG: "test"}, statuses=ACTIVE)) == 1
    gates.mkdir()
    (gates / "trial-0000").write_text("go")
    # The run ends once its step has, plus Dagster's own clean-up (its compute-log
    # tailer may wait 30 s on a loaded machine): wait for that, not a guess at it.
    runner.join(timeout=300)
    assert not runner.is_alive(), "trial-0000's run had not ended 300 s after its gate opened"
    freed = tick(spec, instance, resources, held.cursor.dump())
    assert [r.partition_key for r in freed.run_requests] == ["trial-0001"]


def test_a_run_that_ended_without_a_result_fails_its_trial_and_the_sweep_goes_on(tmp_path: Path) -> None:
    spec = drill_spec(n_trials=2, parallelism=1)
    resources = drill_resources(tmp_path, TrivialLauncher(crash=True))
    instance = open_instance(tmp_path)
    sweep = prepared_home(tmp_path, spec, resources, instance)
    first = tick(spec, instance, resources)
    crashed = submit(build_definitions(spec, resources=resources), instance, first.run_requests[0])
    assert not crashed.success
    assert states(resources, sweep) == [(0, "RUNNING")]
    resources["launcher"] = TrivialLauncher()
    second = tick(spec, instance, resources, first.cursor.dump())
    assert second.failed == [0] and second.asked == [1]
    trial = resources["sweeps"].trial(sweep["study"], 0)
    assert (
        trial.state.name == "FAIL"
        and trial.user_attrs["error"] == f"run {crashed.run_id} ended FAILURE without reporting the trial"
    )
    assert [r.partition_key for r in second.run_requests] == ["trial-0001"]


@pytest.mark.slow
def test_failure_budget_stops_the_sweep_with_its_reason(tmp_path: Path) -> None:
    spec = drill_spec(n_trials=4, parallelism=1, max_failures=2)
    resources = drill_resources(tmp_path, TrivialLauncher(fail=True))
    instance = open_instance(tmp_path)
    sweep = prepared_home(tmp_path, spec, resources, instance)
    defs = build_definitions(spec, resources=resources)
    cursor, requests = None, []
    for _ in range(4):
        t = tick(spec, instance, resources, cursor)
        cursor = t.cursor.dump()
        requests += t.run_requests
        for request in t.run_requests:
            submit(defs, instance, request)
    assert [r.partition_key for r in requests] == ["trial-0000", "trial-0001", None]  # two trials, then the report
    reason = (
        "failure budget spent: 2 trials failed (max_failures 2); last error: trial trial-0001: rank 0 raised "
        "RuntimeError: injected failure"
    )
    assert study_of(resources, sweep).user_attrs[STOPPED] == reason
    meta = instance.get_latest_materialization_event(
        AssetKey(["test", "digits", "sweep"])
    ).asset_materialization.metadata
    assert meta["status"].value == "stopped" and meta["stop_reason"].value == reason
    assert (
        meta["param_importance_note"].value == "parameter importance needs at least 2 completed trials, the study has 0"
    )
    assert "history_plot" not in meta


def test_target_stops_asking(tmp_path: Path) -> None:
    spec = drill_spec(n_trials=6, parallelism=1, target=0.0)
    resources = drill_resources(tmp_path, TrivialLauncher())
    instance = open_instance(tmp_path)
    sweep = prepared_home(tmp_path, spec, resources, instance)
    defs = build_definitions(spec, resources=resources)
    first = tick(spec, instance, resources)
    submit(defs, instance, first.run_requests[0])
    second = tick(spec, instance, resources, first.cursor.dump())
    value = score(resources["sweeps"].trial(sweep["study"], 0).params)
    assert second.asked == [] and f"stopped: target reached: best {value:.6g} >= target 0" in second.message
    assert [r.run_key for r in second.run_requests] == [f"{sweep['study']}/report/1"]


def test_multi_objective_sweep_promotes_by_its_pick_policy(tmp_path: Path) -> None:
    objectives = [Objective(metric="val_acc", mode="max"), Objective(metric="model_bytes", mode="min")]
    spec = drill_spec(
        params={"lr": drill_spec().search.params["lr"], "hidden": IntParam(low=16, high=128, step=16)},
        n_trials=6, objectives=objectives, pick=PickPolicy(limits={"model_bytes": 70_000}),
    )
    resources = drill_resources(tmp_path, TrivialLauncher())
    instance = open_instance(tmp_path)
    sweep = prepared_home(tmp_path, spec, resources, instance)
    defs = build_definitions(spec, resources=resources)
    for key in sweep["trials"]:
        result = defs.resolve_job_def(job_names(spec)["train"]).execute_in_process(instance=instance, partition_key=key)
        materialization = result.asset_materializations_for_node("test__digits__trial_model")[0]
        assert materialization.metadata["objective_model_bytes"].value > 0
    study = study_of(resources, sweep)
    assert [len(t.values) for t in study.get_trials()] == [2] * 6
    promote = defs.resolve_job_def(job_names(spec)["promote"]).execute_in_process(
        instance=instance, asset_selection=[AssetKey(["test", "digits", "best_model"])]
    )
    best = promote.output_for_node("test__digits__best_model")
    front = [t for t in study.best_trials if t.values[1] <= 70_000]
    expected = max(front, key=lambda t: (t.values[0], -t.values[1], -t.number))
    assert best.number == expected.number and best.values == expected.values
    meta = promote.asset_materializations_for_node("test__digits__best_model")[0].metadata
    assert meta["pick"].value.startswith("best val_acc (max) of ") and meta["pick"].value.endswith(
        "within {'model_bytes': 70000.0}"
    )
    assert meta["pareto_size"].value == len(study.best_trials)


def test_with_sweep_sensors_adds_configured_sensors(tmp_path: Path) -> None:
    from dagster import DefaultSensorStatus, Definitions

    spec = drill_spec()
    defs = build_definitions(spec, resources=drill_resources(tmp_path, TrivialLauncher()))
    bare = Definitions(assets=list(defs.assets), jobs=list(defs.jobs), resources=defs.resources, executor=defs.executor)
    out = with_sweep_sensors(bare, spec, minimum_interval_seconds=1, default_status=DefaultSensorStatus.RUNNING)
    sensor = out.get_sensor_def(sweep_sensor_name(spec))
    assert sensor.minimum_interval_seconds == 1 and sensor.default_status == DefaultSensorStatus.RUNNING
    with pytest.raises(ValueError, match="Definitions has no job"):
        with_sweep_sensors(Definitions(), spec)


@pytest.mark.slow
def test_pruned_trial_is_recorded_as_pruned_and_keeps_its_checkpoint(tmp_path: Path) -> None:
    from resources.launcher import LocalLauncher

    spec = drill_spec(n_trials=1, sampler="tpe", pruner=PrunerSpec(kind="threshold", lower=0.99, n_warmup_steps=1))
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"max_epochs": 4})})
    resources = drill_resources(tmp_path, LocalLauncher(timeout_seconds=300))
    instance = open_instance(tmp_path)
    sweep = prepared_home(tmp_path, spec, resources, instance)
    defs = build_definitions(spec, resources=resources)
    result = defs.resolve_job_def(job_names(spec)["train"]).execute_in_process(
        instance=instance, partition_key="trial-0000"
    )
    assert result.success  # a pruned trial is no failure
    meta = result.asset_materializations_for_node("test__digits__trial_model")[0].metadata
    assert meta["status"].value == "pruned" and meta["pruned_at_epoch"].value == 2
    trial = resources["sweeps"].trial(sweep["study"], 0)
    assert trial.state.name == "PRUNED" and sorted(trial.intermediate_values) == [0, 1]
    checkpoint = Path(meta["checkpoint"].value)
    assert checkpoint.exists()
    again = defs.resolve_job_def(job_names(spec)["train"]).execute_in_process(
        instance=instance, partition_key="trial-0000"
    )
    assert (
        again.success and again.output_for_node("test__digits__trial_model").status == "pruned"
    )  # reused, not retrained


def drill(home: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tests.pipelines.sweep_drill", str(home), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def drill_outcome(home: Path) -> tuple[list[tuple[int, str]], list[str], dict[str, int]]:
    spec = drill_spec()
    resources = drill_resources(home, TrivialLauncher())
    instance = open_instance(home)
    study = resources["sweeps"].load(json.loads((home / "sweep_cursor.json").read_text())["study"])
    runs: dict[str, int] = {}
    for run in instance.get_runs(RunsFilter(job_name=job_names(spec)["train"], statuses=[DagsterRunStatus.SUCCESS])):
        key = run.tags["dagster/partition"]
        runs[key] = runs.get(key, 0) + 1
    return (
        [(t.number, t.state.name) for t in study.get_trials()],
        sorted(instance.get_dynamic_partitions("test__digits__trials")),
        runs,
    )


@pytest.mark.slow
def test_sweep_killed_between_asking_and_running_restarts_without_duplicates(tmp_path: Path) -> None:
    killed = drill(tmp_path, "6", "2", "--kill-after-tick", "2")
    assert killed.returncode == -9, killed.stderr[-2000:]
    done = drill(tmp_path, "6", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    trials, partitions, runs = drill_outcome(tmp_path)
    assert trials == [(n, "COMPLETE") for n in range(6)]  # the trials asked before the kill were run, not asked again
    assert partitions == [f"trial-{n:04d}" for n in range(6)]
    assert runs == {k: 1 for k in partitions}


@pytest.mark.slow
def test_sweep_killed_mid_trial_fails_it_by_heartbeat_and_finishes_the_budget(tmp_path: Path) -> None:
    killed = drill(tmp_path, "5", "2", "--kill-in-run")
    assert killed.returncode == -9, killed.stderr[-2000:]
    done = drill(tmp_path, "5", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    trials, partitions, runs = drill_outcome(tmp_path)
    assert trials == [(0, "FAIL")] + [(n, "COMPLETE") for n in range(1, 6)]
    assert partitions == [f"trial-{n:04d}" for n in range(6)]
    assert runs == {f"trial-{n:04d}": 1 for n in range(1, 6)}


DAEMON_YAML = """telemetry:
  enabled: false
run_queue:
  max_concurrent_runs: 10
  tag_concurrency_limits:
    - key: trainyard/team
      value:
        applyLimitPerUniqueValue: true
      limit: 2
"""


def daemon_drill(
    tmp_path: Path,
    optuna_url: str,
    trials: int,
    parallelism: int,
    yaml: str = DAEMON_YAML,
    materialize: bool = True,
    **extra_env: str,
) -> tuple[Any, Any, dict, dict]:
    """The drill location's instance (dagster.yaml: `yaml`, by default with the team limit of 2), spec, resources and
    materialized sweep.

    With `materialize=False` only the `validated_data` value is written, and the sweep is `{}`.
    """
    from dagster import DagsterInstance

    from resources.sweeps import SweepStore
    from tests.pipelines.sweep_location import daemon_spec

    (tmp_path / "dagster").mkdir()
    (tmp_path / "dagster" / "dagster.yaml").write_text(yaml)
    (tmp_path / "workspace.yaml").write_text(
        "load_from:\n  - python_module:\n      module_name: tests.pipelines.sweep_location\n      working_directory: "
        f"{ROOT}\n"
    )
    spec = daemon_spec(trials, parallelism)
    if "SWEEP_DRILL_REUSE" in extra_env:
        spec = spec.model_copy(
            update={
                "search": spec.search.model_copy(
                    update={"reuse_run_under_seconds": float(extra_env["SWEEP_DRILL_REUSE"])}
                )
            }
        )
    resources = drill_resources(
        tmp_path, TrivialLauncher(), SweepStore(storage_url=optuna_url, heartbeat_interval=2, grace_period=30)
    )
    instance = DagsterInstance.from_config(str(tmp_path / "dagster"))
    if not materialize:
        prepared_data(tmp_path, spec, resources)
        return instance, spec, resources, {}
    sweep = prepared_home(tmp_path, spec, resources, instance)
    return instance, spec, resources, sweep


def run_daemon_until(
    tmp_path: Path,
    optuna_url: str,
    trials: int,
    parallelism: int,
    instance: Any,
    spec: Any,
    done: Any,
    **extra_env: str,
) -> None:
    """Run `dagster-daemon` over the drill location until `done(train runs, final report runs)`; no trial run may
    fail."""
    env = {
        **os.environ,
        "SWEEP_DRILL_HOME": str(tmp_path),
        "SWEEP_DRILL_OPTUNA_URL": optuna_url,
        "SWEEP_DRILL_TRIALS": str(trials),
        "SWEEP_DRILL_PARALLELISM": str(parallelism),
        "DAGSTER_HOME": str(tmp_path / "dagster"),
        "PYTHONPATH": str(ROOT),
        **extra_env,
    }
    daemon = subprocess.Popen(
        [str(Path(sys.executable).parent / "dagster-daemon"), "run", "-w", str(tmp_path / "workspace.yaml")],
        cwd=ROOT,
        env=env,
        stdout=open(tmp_path / "daemon.log", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 480
        while time.time() < deadline:
            runs = instance.get_runs(RunsFilter(job_name=job_names(spec)["train"]))
            assert not any(r.status == DagsterRunStatus.FAILURE for r in runs), (tmp_path / "daemon.log").read_text()[
                -3000:
            ]
            reports = instance.get_runs(
                RunsFilter(tags={"trainyard/report": "final"}, statuses=[DagsterRunStatus.SUCCESS])
            )
            if done(runs, reports):
                return
            time.sleep(1)
        pytest.fail(
            f"trial runs and the report did not finish in time: {[r.status for r in runs]}\n"
            + (tmp_path / "daemon.log").read_text()[-3000:]
        )
    finally:
        os.killpg(daemon.pid, signal.SIGTERM)
        daemon.wait(timeout=60)


@pytest.mark.slow
def test_daemon_runs_two_trials_at_once_on_postgres_and_holds_the_team_limit(tmp_path: Path, pg_databases) -> None:
    """The real thing: dagster-daemon ticks the sensor, the run queue applies dagster.yaml's team limit (2),
    run workers train real one-epoch trials under torchrun, and the study lives in PostgreSQL.

    Each trial trains inside a barrier that holds it until two train together (sweep_location.py):
    a sweep that never ran two at once fails by the barrier's timeout, and the barrier's count of
    trials inside at once shows that a third never joined.
    """
    from tests.support.barrier import FileBarrier

    optuna_url = pg_databases[0]
    instance, spec, resources, sweep = daemon_drill(tmp_path, optuna_url, 3, 3)
    assert len(sweep["trials"]) == 3  # three trials pending, two team slots
    run_daemon_until(
        tmp_path,
        optuna_url,
        3,
        3,
        instance,
        spec,
        lambda runs, reports: len([r for r in runs if r.status == DagsterRunStatus.SUCCESS]) == 3 and reports,
    )
    records = instance.get_run_records(RunsFilter(job_name=job_names(spec)["train"]))
    assert FileBarrier(tmp_path / "barrier", parties=2).peak() == 2  # two trials trained at once, never three
    study = resources["sweeps"].load(sweep["study"])
    assert [t.state.name for t in study.get_trials()] == ["COMPLETE"] * 3
    assert all(t.intermediate_values == {0: t.value} for t in study.get_trials())  # rank 0 reported to PostgreSQL
    assert sorted(r.dagster_run.tags["dagster/partition"] for r in records) == sweep["trials"]
    report = instance.get_latest_materialization_event(
        AssetKey(["test", "digits", "sweep"])
    ).asset_materialization.metadata
    assert (
        report["status"].value == "finished" and report["complete_trials"].value == 3
    )  # the daemon ran the final report
    for record in records:  # the run worker ran the step itself: no step process re-importing the code location
        engine = [
            e.message
            for e in instance.all_logs(record.dagster_run.run_id)
            if e.dagster_event and e.dagster_event.event_type_value == "ENGINE_EVENT"
        ]
        assert any(m.startswith("Executing steps in process") for m in engine), engine
        assert not any("multiprocess" in m for m in engine), engine


@pytest.mark.slow
@pytest.mark.extended
def test_under_the_daemon_the_sweeps_run_starts_the_first_window_before_the_sensor_ticks(
    tmp_path: Path, pg_databases
) -> None:
    """dagster-daemon launches the `prepare` run that materializes `sweep` (a sensor of the drill location requests it),
    with
    the sweep sensor on: that run starts the first window's trial runs itself, the sensor takes them as in flight (it
    starts
    neither again nor a third trial in a window of 2: the barrier's peak; the team limit is 3) and finishes the budget.
    Trials train nothing (TrivialLauncher) inside the barrier, which holds each until two train together."""
    from dagster._core.remote_origin import RemoteInstigatorOrigin

    from tests.pipelines.sweep_location import PREPARE_ONCE_KEY
    from tests.support.barrier import FileBarrier

    optuna_url = pg_databases[0]
    yaml = DAEMON_YAML.replace("limit: 2", "limit: 3").replace(
        "max_concurrent_runs: 10", "max_concurrent_runs: 10\n  dequeue_interval_seconds: 1"
    )
    env = {"SWEEP_DRILL_TRIVIAL": "1", "SWEEP_DRILL_PREPARE_ONCE": "1"}
    instance, spec, resources, _ = daemon_drill(tmp_path, optuna_url, 3, 2, yaml=yaml, materialize=False)
    run_daemon_until(
        tmp_path,
        optuna_url,
        3,
        2,
        instance,
        spec,
        lambda runs, reports: len([r for r in runs if r.status == DagsterRunStatus.SUCCESS]) == 3 and reports,
        **env,
    )
    [prepare] = instance.get_run_records(RunsFilter(tags={"dagster/run_key": PREPARE_ONCE_KEY}))
    assert (
        prepare.dagster_run.remote_job_origin is not None and prepare.end_time is not None
    )  # launched by the daemon, from the location
    sweeps = list(
        instance.fetch_materializations(AssetKey(["test", "digits", "sweep"]), limit=10, ascending=True).records
    )
    first, last = sweeps[0].event_log_entry, sweeps[-1].event_log_entry
    study = first.asset_materialization.metadata["study"].value
    assert (
        first.run_id == prepare.dagster_run.run_id
        and first.asset_materialization.metadata["started_trial_runs"].value == 2
    )
    records = instance.get_run_records(RunsFilter(job_name=job_names(spec)["train"]))
    by_trial = sorted((r.dagster_run.tags["dagster/partition"], r) for r in records)
    assert [k for k, _ in by_trial] == ["trial-0000", "trial-0001", "trial-0002"]  # one run per trial
    for key, record in by_trial:
        tags = record.dagster_run.tags
        assert (tags["dagster/sensor_name"], tags["dagster/run_key"]) == (sweep_sensor_name(spec), f"{study}/{key}")
        # the first window's runs: made by the sweep's run, before it ended; the third, by the sensor's tick
        assert (tags.get("trainyard/trigger") == "sweep materialized") == (key != "trial-0002"), tags
        assert (record.create_timestamp.timestamp() <= prepare.end_time) == (key != "trial-0002")
    sensor = RemoteInstigatorOrigin(prepare.dagster_run.remote_job_origin.repository_origin, sweep_sensor_name(spec))
    by_ticks = {
        run_id for t in instance.get_ticks(sensor.get_id(), sensor.get_selector().get_id()) for run_id in t.run_ids
    }
    assert {
        r.dagster_run.run_id for k, r in by_trial if k == "trial-0002"
    } <= by_ticks  # the sensor's ticks made only the third
    assert not by_ticks & {r.dagster_run.run_id for k, r in by_trial if k != "trial-0002"}
    assert FileBarrier(tmp_path / "barrier", parties=2).peak() == 2  # the window held: never a third trial at once
    assert [t.state.name for t in resources["sweeps"].load(study).get_trials()] == [
        "COMPLETE"
    ] * 3  # nothing asked twice
    assert (
        last.asset_materialization.metadata["status"].value == "finished"
        and last.asset_materialization.metadata["started_trial_runs"].value == 0
    )


@pytest.mark.slow
def test_under_the_daemon_short_trials_runs_go_on_and_every_trial_is_materialized_once(
    tmp_path: Path, pg_databases
) -> None:
    """Run reuse for real: dagster-daemon ticks the sensor and dequeues runs, run workers train real one-epoch
    trials on warm workers and go on with the sweep; the study lives in PostgreSQL. Five trials finish (complete or
    pruned), each materialized once, in fewer runs than trials, and the final report runs."""
    from dagster import DagsterEventType, EventRecordsFilter

    from assets.sweeps.trial_handover import REUSED_RUN_TAG

    optuna_url = pg_databases[0]
    instance, spec, resources, sweep = daemon_drill(tmp_path, optuna_url, 5, 2, SWEEP_DRILL_REUSE="120")
    run_daemon_until(
        tmp_path,
        optuna_url,
        5,
        2,
        instance,
        spec,
        lambda runs, reports: reports and all(r.status == DagsterRunStatus.SUCCESS for r in runs),
        SWEEP_DRILL_REUSE="120",
    )
    study = resources["sweeps"].load(sweep["study"])
    assert len(study.get_trials()) == 5 and {t.state.name for t in study.get_trials()} <= {
        "COMPLETE",
        "PRUNED",
    }  # the drill's median pruner
    records = instance.get_event_records(EventRecordsFilter(event_type=DagsterEventType.ASSET_MATERIALIZATION,
                                                            asset_key=AssetKey(["test", "digits", "trial_model"])))
    assert sorted(r.event_log_entry.dagster_event.partition for r in records) == [f"trial-{n:04d}" for n in range(5)]
    runs = instance.get_runs(RunsFilter(job_name=job_names(spec)["train"]))
    assert len(runs) < 5 and any(REUSED_RUN_TAG in r.tags for r in runs), [
        (r.tags.get("dagster/partition"), r.tags.get(REUSED_RUN_TAG)) for r in runs
    ]
    report = instance.get_latest_materialization_event(
        AssetKey(["test", "digits", "sweep"])
    ).asset_materialization.metadata
    assert report["status"].value == "finished" and report["finished_trials"].value == 5


@pytest.mark.slow
@pytest.mark.extended
def test_under_the_daemon_a_long_trials_run_starts_the_next_trials_run_as_it_ends(tmp_path: Path, pg_databases) -> None:
    """The sweep sensor ticks once here (its interval, 10 minutes, outlasts the test) and requests the first window's
    two
    runs. Every trial takes longer than `reuse_run_under_seconds`, so no run goes on with the sweep: each ends, and
    starts
    the run of the sweep's next trial itself (`start_successor`). Four trials finish with nobody ticking: without it the
    test waits for the sensor until its deadline. Trials train nothing (TrivialLauncher) inside the barrier, which holds
    each until two train together; the window (2) holds, each trial has one run and every trial completes. The instance
    is
    the shipped local deployment's (deploy/local/dagster.yaml)."""
    from dagster._core.remote_origin import RemoteInstigatorOrigin

    from tests.support.barrier import FileBarrier

    optuna_url = pg_databases[0]
    env = {"SWEEP_DRILL_TRIVIAL": "1", "SWEEP_DRILL_REUSE": "0.001", "SWEEP_DRILL_SENSOR_SECONDS": "600"}
    shipped = (
        ROOT / "deploy" / "local" / "dagster.yaml"
    ).read_text()  # the 0.5 s run queue, the warm run launcher, a team limit of 2
    instance, spec, resources, sweep = daemon_drill(tmp_path, optuna_url, 4, 2, yaml=shipped, **env)
    assert sweep["trials"] == ["trial-0000", "trial-0001"]  # the window the sweep asked; in process it starts no run
    run_daemon_until(tmp_path, optuna_url, 4, 2, instance, spec,
                     lambda runs, reports: len([r for r in runs if r.status == DagsterRunStatus.SUCCESS]) == 4, **env)
    records = instance.get_run_records(RunsFilter(job_name=job_names(spec)["train"]))
    by_trial = dict(sorted((r.dagster_run.tags["dagster/partition"], r) for r in records))
    assert list(by_trial) == ["trial-0000", "trial-0001", "trial-0002", "trial-0003"]  # one run per trial
    first, later = (
        [by_trial[k] for k in ("trial-0000", "trial-0001")],
        [by_trial[k] for k in ("trial-0002", "trial-0003")],
    )
    sensor = RemoteInstigatorOrigin(first[0].dagster_run.remote_job_origin.repository_origin, sweep_sensor_name(spec))
    by_ticks = {
        run_id for t in instance.get_ticks(sensor.get_id(), sensor.get_selector().get_id()) for run_id in t.run_ids
    }
    assert by_ticks == {r.dagster_run.run_id for r in first}  # the sensor made the first window's runs, and no other
    for record in later:
        tags = record.dagster_run.tags
        assert tags["trainyard/trigger"] == "trial run ended", tags
        assert (tags["dagster/sensor_name"], tags["dagster/run_key"]) == (
            sweep_sensor_name(spec),
            f"{sweep['study']}/{tags['dagster/partition']}",
        )
        created = record.create_timestamp.timestamp()
        # made by a run of the trial before it, while that run ran
        makers = [
            r
            for r in records
            if r.start_time is not None and r.end_time is not None and r.start_time <= created <= r.end_time
        ]
        assert makers and all(r.dagster_run.run_id != record.dagster_run.run_id for r in makers), (tags, created)
        maker_logs = [e.user_message for r in makers for e in instance.all_logs(r.dagster_run.run_id)]
        assert any(f"started run {record.dagster_run.run_id}" in m for m in maker_logs)
    assert FileBarrier(tmp_path / "barrier", parties=2).peak() == 2  # the window held: never a third trial at once
    assert [t.state.name for t in resources["sweeps"].load(sweep["study"]).get_trials()] == [
        "COMPLETE"
    ] * 4  # nothing asked twice


def test_sensor_intervals_land_on_the_daemons_looks() -> None:
    """The cadence `ticks_every` promises rests on Dagster's 5 s sensor loop: an upgrade that changes it fails here."""
    from dagster._daemon.sensor import MIN_INTERVAL_LOOP_TIME

    from pipelines import landing_sensor, sensors
    from pipelines.sensor_timing import DAEMON_LOOK_SECONDS, ticks_every

    assert DAEMON_LOOK_SECONDS == MIN_INTERVAL_LOOP_TIME
    assert (sensors.MINIMUM_INTERVAL_SECONDS, landing_sensor.MINIMUM_INTERVAL_SECONDS) == (9, 59)
    with pytest.raises(ValueError, match="multiple of the daemon's 5 s look"):
        ticks_every(12)


def _runs(instance, *runs: tuple[str, DagsterRunStatus, dict]) -> None:
    from dagster._core.storage.dagster_run import DagsterRun
    from dagster._core.utils import make_new_run_id

    from bench.sweep_10k import job_origin

    for job, status, tags in runs:
        instance.add_run(
            DagsterRun(
                job_name=job, run_id=make_new_run_id(), status=status, tags=tags, remote_job_origin=job_origin(job)
            )
        )


def test_active_runs_are_read_once_and_counted_as_the_tag_filtered_queries_count(tmp_path: Path) -> None:
    """The team's active runs and the trials a run already trains, from one read of the active runs: what the
    tag-filtered queries answered."""
    from pipelines.sensors import PARTITION_TAG, active_runs, active_team_runs, trained_partitions

    instance = open_instance(tmp_path)
    S = DagsterRunStatus
    _runs(instance,
          ("train", S.QUEUED, {TEAM_TAG: "a", PARTITION_TAG: "trial-0001"}),
          ("train", S.STARTED, {TEAM_TAG: "a", PARTITION_TAG: "trial-0002"}),
          ("train", S.SUCCESS, {TEAM_TAG: "a", PARTITION_TAG: "trial-0003"}),
          ("train", S.FAILURE, {TEAM_TAG: "a", PARTITION_TAG: "trial-0004"}),
          ("other", S.STARTING, {TEAM_TAG: "a", PARTITION_TAG: "trial-0005"}),
          ("train", S.NOT_STARTED, {TEAM_TAG: "b", PARTITION_TAG: "trial-0006"}),
          ("train", S.STARTED, {}))
    records = active_runs(instance)
    for team in ("a", "b", "c"):
        assert active_team_runs(records, team) == instance.get_runs_count(
            RunsFilter(tags={TEAM_TAG: team}, statuses=ACTIVE)
        )
    assert active_team_runs(records, "a") == 3
    assert trained_partitions(records, "train") == {"trial-0001", "trial-0002", "trial-0006"}
    for n in range(1, 8):
        key = f"trial-{n:04d}"
        assert (key in trained_partitions(records, "train")) == bool(
            instance.get_runs_count(RunsFilter(job_name="train", statuses=ACTIVE, tags={PARTITION_TAG: key})))


def test_a_run_of_another_study_that_ended_untold_fails_no_trial_of_this_one(tmp_path: Path) -> None:
    """`_fail_untold` matches the study tag itself: only this study's trial runs that ended FAILURE/CANCELED fail
    trials."""
    from pipelines.sensors import PARTITION_TAG, _fail_untold

    instance = open_instance(tmp_path)
    S = DagsterRunStatus
    since = time.time() - 60
    _runs(instance,
          ("train", S.FAILURE, {STUDY_TAG: "mine", PARTITION_TAG: "trial-0001"}),
          ("train", S.CANCELED, {STUDY_TAG: "mine", PARTITION_TAG: "trial-0002"}),
          ("train", S.FAILURE, {STUDY_TAG: "theirs", PARTITION_TAG: "trial-0003"}),
          ("train", S.SUCCESS, {STUDY_TAG: "mine", PARTITION_TAG: "trial-0004"}),
          ("other", S.FAILURE, {STUDY_TAG: "mine", PARTITION_TAG: "trial-0005"}),
          ("train", S.FAILURE, {PARTITION_TAG: "trial-0006"}))
    first = instance.get_runs(RunsFilter(tags={PARTITION_TAG: "trial-0001"}))[0].run_id
    theirs = instance.get_runs(RunsFilter(tags={PARTITION_TAG: "trial-0003"}))[0].run_id

    class Trial:
        class state:  # a stand-in for TrialState.RUNNING
            name = "RUNNING"

        def __init__(self, number=0, claim=None):
            self.number, self.user_attrs = number, ({CLAIMED_BY: claim} if claim else {})

    class Study:
        def get_trials(self, deepcopy=True):  # trial 7 went on in trial-0001's run, 8 in another study's run
            return [Trial(7, first), Trial(8, theirs), Trial(9)]

    class Sweeps:
        told: list[tuple[str, int]] = []

        def load(self, study):
            return Study()

        def trial(self, study, number):
            return Trial()

        def tell(self, study, number, value, attrs, failed=False):
            assert failed and "without reporting the trial" in attrs["error"]
            self.told.append((study, number))

    sweeps = Sweeps()
    # trial 7 was claimed by the failed run of trial-0001 (run reuse): it fails with it
    assert sorted(_fail_untold(instance, sweeps, "train", "mine", since)) == [1, 2, 7]  # type: ignore[arg-type]
    assert sorted(sweeps.told) == [("mine", 1), ("mine", 2), ("mine", 7)]
    assert _fail_untold(instance, Sweeps(), "train", "mine", time.time() + 60) == []  # type: ignore[arg-type]


def test_a_configuration_error_stops_the_sweep_at_the_first_trial(tmp_path: Path) -> None:
    """A pod that exits 78 (ConfigError) would fail every trial of the definition: no new trial is asked in its
    place."""
    spec = drill_spec(n_trials=2, parallelism=1, max_failures=3)
    resources = drill_resources(tmp_path, TrivialLauncher(config_error=True))
    instance = open_instance(tmp_path)
    sweep = prepared_home(tmp_path, spec, resources, instance)
    defs = build_definitions(spec, resources=resources)
    sensor = defs.get_sensor_def(sweep_sensor_name(spec))
    cursor, requests, runs = None, [], []
    for _ in range(4):
        result = sensor(
            build_sensor_context(instance=instance, resources={"sweeps": resources["sweeps"]}, cursor=cursor)
        )
        cursor = result.cursor
        requests += result.run_requests
        runs += [submit(defs, instance, r) for r in result.run_requests]
    assert [r.partition_key for r in requests] == [
        "trial-0000",
        None,
    ]  # one trial, then the report: not 4 trials for n_trials=2
    assert states(resources, sweep) == [(0, "FAIL")]
    trial = resources["sweeps"].trial(sweep["study"], 0)
    assert trial.user_attrs["trainyard.config_error"] is True
    reason = study_of(resources, sweep).user_attrs[STOPPED]
    assert reason.startswith(
        "configuration error: trial-0000 failed with a configuration error and no trial of this definition has "
        "succeeded, so every trial would fail the same way: trial trial-0000: bad config (rank 0): ConfigError: "
        "the model returns 1 logit"
    )
    # The trial's run says why, and so do the sweep's report and the sensor's tick.
    failure = next(e for e in runs[0].all_events if e.event_type_value == "STEP_FAILURE")
    assert (
        "a configuration error: no retry, and the sweep sensor asks no new trial of study"
        in failure.event_specific_data.error.message
    )
    meta = instance.get_latest_materialization_event(
        AssetKey(["test", "digits", "sweep"])
    ).asset_materialization.metadata
    assert (meta["status"].value, meta["stop_reason"].value) == ("stopped", reason)
    rest = tick(spec, instance, resources, SweepCursor.parse(cursor).dump())
    assert rest.run_requests == [] and "stopped: configuration error: trial-0000" in rest.message


def test_a_changed_definition_gets_a_new_study_and_the_old_one_no_trial(tmp_path: Path) -> None:
    """max_epochs and n_trials change and the location reloads: the old study is left as it was; prepare makes the new
    one."""
    spec = drill_spec(n_trials=2, parallelism=1)
    resources = drill_resources(tmp_path, TrivialLauncher(started_dir=str(tmp_path / "started")))
    instance = open_instance(tmp_path)
    old = prepared_home(tmp_path, spec, resources, instance)
    first = tick(spec, instance, resources)
    assert [r.partition_key for r in first.run_requests] == ["trial-0000"]  # requested, not yet run

    dump = spec.model_dump()
    dump["model"]["max_epochs"] += 3
    dump["search"]["n_trials"] = 4
    changed = type(spec).model_validate(dump)
    assert changed.fingerprint() != spec.fingerprint()
    defs = build_definitions(changed, resources=resources)
    sensor = defs.get_sensor_def(sweep_sensor_name(changed))
    context = build_sensor_context(
        instance=instance, resources={"sweeps": resources["sweeps"]}, cursor=first.cursor.dump()
    )
    result = sensor(context)
    assert not result.dynamic_partitions_requests
    [prepare] = result.run_requests
    assert (prepare.job_name, prepare.run_key) == (
        job_names(changed)["prepare"],
        f"{old['study']}/redefined/{changed.fingerprint()}",
    )
    assert prepare.asset_selection == [
        AssetKey(["test", "digits", "validated_data"]),
        AssetKey(["test", "digits", "sweep"]),
    ]
    assert prepare.tags["trainyard/trigger"] == "definition changed"
    assert states(resources, old) == [(0, "RUNNING")]  # nothing asked of the old study

    # The run the old definition's tick requested trains nothing under the new one: the old study stays one definition.
    run = submit(defs, instance, first.run_requests[0])
    assert not run.success and not (tmp_path / "started").exists()
    trial = resources["sweeps"].trial(old["study"], 0)
    assert trial.state.name == "FAIL" and trial.user_attrs["error"].startswith(
        f"not trained: the pipeline's definition changed since study {old['study']} was made")
    again = tick(changed, instance, resources, result.cursor)
    assert [r.run_key for r in again.run_requests] == [
        prepare.run_key
    ] and again.asked == []  # the daemon drops the repeated key
    assert states(resources, old) == [(0, "FAIL")]

    new = run_sweep_asset(changed, resources, instance)  # what the requested prepare run ends with
    assert new["study"] != old["study"] and new["study"].endswith(changed.fingerprint())
    ticked = tick(changed, instance, resources, again.cursor.dump())
    assert [r.run_key for r in ticked.run_requests] == [f"{new['study']}/trial-0000"]
    assert states(resources, old) == [(0, "FAIL")] and len(study_of(resources, new).get_trials()) == 1
