"""The hands-free journey: a materialized sweep trains to its budget and ends in one `promote` run.

Materializing `raw_data` alone (or a file landing, the landing sensor running
by default) carries on through `validated_data` and `sweep`. The sweep sensor
runs from the start (`RetrainPolicy.automatic`, default on), keeps the study's
trials in flight, and once the study is done requests its
final report and the `promote` job exactly once; a team that opts out gets a
stopped sensor that never promotes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from dagster import DefaultSensorStatus, RunRequest, SensorResult, asset, build_sensor_context, materialize

from assets.factory import asset_key
from pipelines.factory import build_definitions, job_names
from pipelines.landing_sensor import RAW_DATA_RUN_TAG, build_landing_sensor, evaluate_landing, evaluate_raw_data
from pipelines.sensors import STUDY_TAG, SweepCursor, final_requests, run_tick
from resources.storage import ObjectStore
from resources.sweeps import SweepStatus
from tests.digits import digits_frame
from tests.pipelines.pipeline_fixtures import small_spec, write_landing
from tests.pipelines.sweep_drill import (
    TrivialLauncher,
    drill_resources,
    drill_spec,
    open_instance,
    prepared_home,
    submit,
)
from trainyard.data import ingest
from trainyard.naming import RAW_DATA, SWEEP, VALIDATED_DATA, sweep_sensor_name
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


@pytest.mark.slow
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
    status = SweepStatus(
        budget=2, complete=0, pruned=0, failed=2, running=0, waiting=0, best=None, stop_reason="2 trials failed"
    )
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
    tick = run_tick(
        spec,
        instance,
        resources["sweeps"],
        None,
        train_job=names["train"],
        prepare_job=names["prepare"],
        promote_job=names["promote"],
    )
    assert [r.job_name for r in tick.run_requests] == [names["prepare"]]  # the final report only
    assert f"already promoted study {sweep['study']}" in tick.message


# The first asset is enough: a raw_data materialized alone (the UI's Materialize on it) is carried through prepare.


def stand_ins(spec):
    """Assets under the pipeline's raw_data and validated_data keys that compute nothing: the sensor reads only the
    event log."""
    raw_key, validated_key = (asset_key(spec, n) for n in (RAW_DATA, VALIDATED_DATA))

    @asset(key=raw_key)
    def raw() -> None:
        return None

    @asset(key=validated_key, deps=[raw_key])
    def validated() -> None:
        return None

    return raw, validated


def test_the_landing_sensor_runs_by_default_and_stops_for_a_team_that_opts_out() -> None:
    spec = drill_spec()
    assert build_landing_sensor(spec, job_names(spec)["prepare"]).default_status == DefaultSensorStatus.RUNNING
    manual = spec.model_copy(update={"retrain": RetrainPolicy(automatic=False)})
    assert build_landing_sensor(manual, job_names(manual)["prepare"]).default_status == DefaultSensorStatus.STOPPED


def test_raw_data_materialized_alone_requests_the_rest_of_prepare_once(tmp_path: Path) -> None:
    spec = drill_spec()
    prepare = job_names(spec)["prepare"]
    raw, validated = stand_ins(spec)
    with open_instance(tmp_path) as instance:
        assert evaluate_raw_data(spec, instance, None, prepare) == ([], None, "")
        run = materialize([raw], instance=instance)
        requests, cursor, note = evaluate_raw_data(spec, instance, None, prepare)
        assert [r.asset_selection for r in requests] == [[asset_key(spec, VALIDATED_DATA), asset_key(spec, SWEEP)]]
        request = requests[0]
        assert request.job_name == prepare and request.run_key == f"raw_data/{cursor}"
        assert (
            request.tags[RAW_DATA_RUN_TAG] == run.run_id
            and request.tags["trainyard/trigger"] == "raw_data materialized"
        )
        assert run.run_id in note and "validated_data, sweep" in note
        # the next tick has seen it: nothing more for the same materialization
        assert evaluate_raw_data(spec, instance, cursor, prepare) == ([], cursor, "")
        # a run that planned validated_data too (prepare, the landing sensor) needs nothing
        materialize([raw, validated], instance=instance)
        quiet, later, _ = evaluate_raw_data(spec, instance, cursor, prepare)
        assert quiet == [] and later is not None and later > cursor
        # two materializations alone before a tick: one run follows both (validated_data reads the newest)
        materialize([raw], instance=instance)
        materialize([raw], instance=instance)
        both, newest, _ = evaluate_raw_data(spec, instance, later, prepare)
        assert [r.run_key for r in both] == [f"raw_data/{newest}"]


def test_a_raw_data_that_validated_data_already_followed_is_left_alone(tmp_path: Path) -> None:
    """E.g. the user materialized raw_data, then validated_data by hand, before the sensor's first tick."""
    spec = drill_spec()
    raw, validated = stand_ins(spec)
    with open_instance(tmp_path) as instance:
        materialize([raw], instance=instance)
        materialize([raw, validated], instance=instance, selection=[validated])
        requests, cursor, _ = evaluate_raw_data(spec, instance, None, job_names(spec)["prepare"])
        assert requests == [] and cursor is not None


def test_a_drift_gated_pipeline_continues_with_validation_only(tmp_path: Path) -> None:
    spec = drill_spec().model_copy(update={"retrain": RetrainPolicy(drift_psi=0.25)})
    raw, _ = stand_ins(spec)
    with open_instance(tmp_path) as instance:
        materialize([raw], instance=instance)
        requests, _, _ = evaluate_raw_data(spec, instance, None, job_names(spec)["prepare"])
        assert [r.asset_selection for r in requests] == [[asset_key(spec, VALIDATED_DATA)]]


def test_the_sweep_sensor_carries_raw_data_through_prepare_before_any_sweep(tmp_path: Path) -> None:
    spec = drill_spec()
    resources = drill_resources(tmp_path, TrivialLauncher())
    defs = build_definitions(spec, resources=resources)
    raw, _ = stand_ins(spec)
    with open_instance(tmp_path) as instance:
        materialize([raw], instance=instance)
        first = evaluate(defs, spec, instance, resources)
        assert [(r.job_name, r.run_key) for r in first.run_requests] == [
            (job_names(spec)["prepare"], f"raw_data/{SweepCursor.parse(first.cursor).raw}")
        ]
        assert evaluate(defs, spec, instance, resources, first.cursor).run_requests == []
        # a team that opts out starts everything after raw_data itself
        manual = spec.model_copy(update={"retrain": RetrainPolicy(automatic=False)})
        materialize([raw], instance=instance)
        tick = run_tick(
            manual,
            instance,
            resources["sweeps"],
            first.cursor,
            train_job=job_names(manual)["train"],
            prepare_job=job_names(manual)["prepare"],
        )
        assert tick.run_requests == []


def test_deleting_a_bad_file_requests_a_run_although_the_listing_is_back_to_an_earlier_state(tmp_path: Path) -> None:
    """The listing after the deletion equals the one before the bad file landed, whose run key Dagster already used."""
    spec = small_spec()
    store = ObjectStore(root=str(tmp_path / "store"))
    write_landing(tmp_path, digits_frame(200), "part-0.csv")
    first, before = evaluate_landing(spec, store, None)
    assert isinstance(first, RunRequest)
    ingest.ingest(store, spec)
    bad_frame = digits_frame(230).iloc[200:].astype({"px0_1": object})
    bad_frame.iloc[3, bad_frame.columns.get_loc("px0_1")] = "not-a-number"
    bad = write_landing(tmp_path, bad_frame, "part-1.csv")
    landed, with_bad = evaluate_landing(spec, store, before)
    assert isinstance(landed, RunRequest)
    with pytest.raises(ingest.IngestRejected):
        ingest.ingest(store, spec)
    bad.unlink()
    removal, after = evaluate_landing(spec, store, with_bad)
    assert isinstance(removal, RunRequest) and removal.tags["trainyard/removed_files"] == "1"
    assert after == before  # the same listing as before the bad file landed
    assert removal.run_key not in {first.run_key, landed.run_key}
