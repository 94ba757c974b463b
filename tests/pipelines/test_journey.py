"""The hands-free journey: a materialized sweep trains to its budget and ends in one `promote` run.

The sweep sensor runs from the start (`RetrainPolicy.automatic`, default on),
keeps the study's trials in flight, and once the study is done requests its
final report and the `promote` job exactly once; a team that opts out gets a
stopped sensor that never promotes.
"""

from __future__ import annotations

from pathlib import Path

from dagster import DefaultSensorStatus, SensorResult, build_sensor_context

from pipelines.factory import build_definitions, job_names
from pipelines.sensors import STUDY_TAG, SweepCursor, final_requests, run_tick
from resources.sweeps import SweepStatus
from tests.pipelines.sweep_drill import TrivialLauncher, drill_resources, drill_spec, open_instance, prepared_home, submit
from trainyard.naming import sweep_sensor_name
from trainyard.spec import RetrainPolicy


def evaluate(defs, spec, instance, resources, cursor=None) -> SensorResult:
    """One tick of the pipeline's sweep sensor, with its partitions added as the daemon adds them."""
    sensor = defs.get_sensor_def(sweep_sensor_name(spec))
    result = sensor(build_sensor_context(instance=instance, cursor=cursor, resources={"sweeps": resources["sweeps"]}))
    for request in result.dynamic_partitions_requests or []:
        instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
    return result


def test_sweep_sensor_runs_by_default_and_targets_promote(tmp_path: Path) -> None:
    spec = drill_spec()
    defs = build_definitions(spec, resources=drill_resources(tmp_path, TrivialLauncher()))
    sensor = defs.get_sensor_def(sweep_sensor_name(spec))
    assert sensor.default_status == DefaultSensorStatus.RUNNING
    assert job_names(spec)["promote"] in {t.job_name for t in sensor.targets}


def test_sweep_sensor_requests_promote_exactly_once_when_the_study_finishes(tmp_path: Path) -> None:
    spec = drill_spec(n_trials=3, parallelism=2)
    resources = drill_resources(tmp_path, TrivialLauncher())
    instance = open_instance(tmp_path)
    sweep = prepared_home(tmp_path, spec, resources, instance)
    defs = build_definitions(spec, resources=resources)
    names = job_names(spec)
    promotes = []
    cursor = None
    for _ in range(10):
        result = evaluate(defs, spec, instance, resources, cursor)
        cursor = result.cursor
        for request in result.run_requests:
            if request.job_name == names["promote"]:
                promotes.append(request)  # the promote run itself is not the sensor's business here
            else:
                assert submit(defs, instance, request).success
        if promotes:
            break
    study = resources["sweeps"].load(sweep["study"])
    assert [t.state.name for t in study.get_trials()] == ["COMPLETE"] * 3
    assert len(promotes) == 1
    promote = promotes[0]
    assert promote.run_key == f"{sweep['study']}/promote/3"
    assert promote.tags[STUDY_TAG] == sweep["study"] and promote.tags["trainyard/trigger"] == "sweep finished"
    # the ticks after it rest: no second promote for the same study
    for _ in range(3):
        again = evaluate(defs, spec, instance, resources, cursor)
        cursor = again.cursor
        assert [r for r in again.run_requests if r.job_name == names["promote"]] == []
    assert SweepCursor.parse(cursor).reported == 3
    # a reset cursor asks again under the same run key, which Dagster drops (once per sensor and key)
    reset = evaluate(defs, spec, instance, resources, None)
    assert [r.run_key for r in reset.run_requests if r.job_name == names["promote"]] == [promote.run_key]


def test_a_team_that_opts_out_gets_a_stopped_sensor_that_never_promotes(tmp_path: Path) -> None:
    spec = drill_spec(n_trials=1, parallelism=1).model_copy(update={"retrain": RetrainPolicy(automatic=False)})
    resources = drill_resources(tmp_path, TrivialLauncher())
    instance = open_instance(tmp_path)
    prepared_home(tmp_path, spec, resources, instance)
    defs = build_definitions(spec, resources=resources)
    sensor = defs.get_sensor_def(sweep_sensor_name(spec))
    assert sensor.default_status == DefaultSensorStatus.STOPPED
    assert job_names(spec)["promote"] not in {t.job_name for t in sensor.targets}
    seen = []
    cursor = None
    for _ in range(5):
        result = evaluate(defs, spec, instance, resources, cursor)
        cursor = result.cursor
        seen += result.run_requests
        for request in result.run_requests:
            assert submit(defs, instance, request).success
    assert any(r.tags.get("trainyard/report") == "final" for r in seen)
    assert not any(r.job_name == job_names(spec)["promote"] for r in seen)


def test_a_study_without_a_completed_trial_is_not_promoted() -> None:
    spec = drill_spec()
    status = SweepStatus(budget=2, complete=0, pruned=0, failed=2, running=0, waiting=0, best=None, stop_reason="2 trials failed")
    requests, note = final_requests(spec, "s", status, {}, "prep", "promo")
    assert [r.job_name for r in requests] == ["prep"]
    assert note == "; not promoting: no trial of study s completed"


def test_a_study_promoted_before_the_sensor_saw_it_is_not_promoted_again(tmp_path: Path) -> None:
    """E.g. `trainyard demo` trained and promoted in-process, then `make ui` started the running sensor."""
    spec = drill_spec(n_trials=1, parallelism=1)
    resources = drill_resources(tmp_path, TrivialLauncher())
    instance = open_instance(tmp_path)
    sweep = prepared_home(tmp_path, spec, resources, instance)
    defs = build_definitions(spec, resources=resources)
    names = job_names(spec)
    train = defs.resolve_job_def(names["train"]).execute_in_process(instance=instance, partition_key="trial-0000")
    assert train.success
    # best_model materializes before registered_model (whose trivial model cannot be served): the decision was reached
    defs.resolve_job_def(names["promote"]).execute_in_process(instance=instance, raise_on_error=False)
    tick = run_tick(spec, instance, resources["sweeps"], None, train_job=names["train"], prepare_job=names["prepare"], promote_job=names["promote"])
    assert [r.job_name for r in tick.run_requests] == [names["prepare"]]  # the final report only
    assert f"already promoted study {sweep['study']}" in tick.message
