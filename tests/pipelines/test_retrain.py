"""Retraining triggers: a cron schedule that skips unchanged data versions, and a drift sensor against the champion's
data."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from dagster import (
    AssetKey,
    AssetMaterialization,
    DagsterInstance,
    RunRequest,
    SkipReason,
    build_schedule_context,
    build_sensor_context,
)

from pipelines.retrain import DATA_VERSION_TAG, evaluate_drift, prepare_selection
from resources.registry import ModelRegistry, ModelVersionInfo
from resources.storage import ObjectStore
from tests.digits import digits_frame
from tests.pipelines.pipeline_fixtures import Harness, failure_text, small_spec, write_landing
from tests.pipelines.test_landing_sensor import PrestartCounter
from trainyard import data as dq
from trainyard.lineage import TEST_SPLIT_TAG
from trainyard.naming import drift_sensor_name, retrain_schedule_name, study_name
from trainyard.promotion import CHAMPION
from trainyard.spec import RetrainPolicy


def key(name: str) -> AssetKey:
    return AssetKey(["test", "digits", name])


def inverted(frame):
    """The same digits drawn white on black: every pixel feature drifts."""
    out = frame.copy()
    pixels = [c for c in out.columns if c != "label"]
    out[pixels] = 16 - out[pixels]
    return out


def validated_version(store: ObjectStore, spec, frame, md5: str) -> dict:
    """What `validated_data` keeps of an accepted version (profile, sample, latest.json), without the suite."""
    base = store.uri("data", spec.team, spec.name, "validated", f"{md5}-split")
    local = Path(base)
    local.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), str(local / "snapshot.parquet"))
    profile, sample = dq.profile_snapshot(store, f"{base}/snapshot.parquet")
    store.write_json(f"{base}/profile.json", profile)
    pq.write_table(sample, str(local / "sample.parquet"))
    latest = {
        "md5": md5,
        "split_id": f"{md5}-split",
        "profile_uri": f"{base}/profile.json",
        "sample_uri": f"{base}/sample.parquet",
    }
    store.write_json(store.uri("data", spec.team, spec.name, "validated", "latest.json"), latest)
    return latest


def champion_on(latest: dict, version: str = "1") -> ModelVersionInfo:
    return ModelVersionInfo(
        name="test.digits", version=version, run_id=None, model_uri=f"models:/test.digits/{version}", source="",
        tags={DATA_VERSION_TAG: latest["md5"], TEST_SPLIT_TAG: latest["split_id"]}, aliases=(CHAMPION,),
    )


def test_drift_against_the_champions_data_decides_retraining(tmp_path: Path) -> None:
    spec = small_spec(retrain=RetrainPolicy(drift_psi=0.25))
    store = ObjectStore(root=str(tmp_path / "store"))
    (tmp_path / "dagster").mkdir()
    instance = DagsterInstance.local_temp(str(tmp_path / "dagster"), overrides={"telemetry": {"enabled": False}})
    first = validated_version(store, spec, digits_frame(300), "a" * 32)

    no_champion, cursor = evaluate_drift(spec, store, instance, None, None)
    assert isinstance(no_champion, RunRequest) and no_champion.asset_selection == [key("sweep")]
    assert no_champion.tags["trainyard/drift_reason"] == "no champion yet" and cursor is None

    champion = champion_on(first)
    same, _ = evaluate_drift(spec, store, instance, champion, None)
    assert (
        isinstance(same, SkipReason)
        and same.skip_message == f"test/digits: champion v1 was trained on the newest data version {'a' * 32}"
    )

    validated_version(store, spec, digits_frame(600), "b" * 32)  # more of the same digits
    calm, cursor = evaluate_drift(spec, store, instance, champion, None)
    assert isinstance(calm, SkipReason) and "is within drift_psi 0.25; not retraining" in calm.skip_message
    state = json.loads(cursor)
    assert state["pair"] == f"{'b' * 32}:1" and 0 <= state["psi"] <= 0.25
    again, kept = evaluate_drift(spec, store, instance, champion, cursor)
    assert isinstance(again, SkipReason) and again.skip_message.endswith("(measured before)") and kept == cursor

    drifted_frame = digits_frame(600)
    drifted_frame.iloc[300:] = inverted(drifted_frame.iloc[300:])
    validated_version(store, spec, drifted_frame, "c" * 32)
    fire, cursor = evaluate_drift(spec, store, instance, champion, cursor)
    assert isinstance(fire, RunRequest) and fire.asset_selection == [key("sweep")]
    assert fire.run_key == f"drift-{'c' * 32}-1"
    psi = float(fire.tags["trainyard/drift_psi"])
    assert psi > 0.25 and json.loads(cursor)["psi"] == pytest.approx(psi, abs=1e-4)
    assert fire.tags["trainyard/trigger"] == "drift" and fire.tags["trainyard/champion_data_version"] == "a" * 32
    assert fire.tags["trainyard/data_version"] == "c" * 32 and fire.tags["trainyard/drift_column"].startswith("px")

    # once the drifted version is swept, the sensor rests
    instance.report_runless_asset_event(
        AssetMaterialization(key("sweep"), metadata={"study": study_name(spec, "c" * 32)})
    )
    rest, _ = evaluate_drift(spec, store, instance, champion, None)
    assert (
        isinstance(rest, SkipReason)
        and rest.skip_message
        == f"test/digits: data version {'c' * 32} already swept (study {study_name(spec, 'c' * 32)})"
    )


def test_drift_gating_narrows_landing_runs_to_ingest_and_validation(tmp_path: Path) -> None:
    from pipelines.environments import local_resources
    from pipelines.factory import build_definitions

    gated = small_spec(retrain=RetrainPolicy(drift_psi=0.25))
    assert prepare_selection(gated) == [key("raw_data"), key("validated_data")]
    assert prepare_selection(small_spec()) == [key("raw_data"), key("validated_data"), key("sweep")]
    resources = local_resources(tmp_path)
    write_landing(tmp_path, digits_frame(200))
    defs = build_definitions(gated, resources=resources)
    with DagsterInstance.ephemeral() as instance:
        tick = defs.get_sensor_def("test__digits__landing").evaluate_tick(
            build_sensor_context(
                instance=instance, resources={"store": resources["store"], "launcher": resources["launcher"]}
            )
        )
    assert [r.asset_selection for r in tick.run_requests] == [[key("raw_data"), key("validated_data")]]
    assert drift_sensor_name(gated) in [s.name for s in defs.sensors]
    off = build_definitions(small_spec(retrain=RetrainPolicy(on_new_data=False, cron="0 3 * * *")), resources=resources)
    assert sorted(s.name for s in off.sensors) == ["test__digits__sweep"]


@pytest.mark.slow
def test_schedule_retrains_on_a_new_data_version_only(tmp_path: Path) -> None:
    """Real prepare runs: a tick with new landing data retrains; the next tick, same data version, is skipped."""
    spec = small_spec(retrain=RetrainPolicy(cron="0 3 * * *", on_new_data=False))
    harness = Harness(tmp_path, spec)
    store = harness.resources["store"]
    schedule = harness.defs.get_schedule_def(retrain_schedule_name(spec))
    (tmp_path / "prestarts").touch()
    launcher = PrestartCounter(calls=str(tmp_path / "prestarts"))

    def tick():
        return schedule.evaluate_tick(
            build_schedule_context(instance=harness.instance, resources={"store": store, "launcher": launcher})
        )

    empty = tick()
    assert empty.run_requests == [] and "no landing files match" in empty.skip_message
    write_landing(tmp_path, digits_frame(300).iloc[:150].reset_index(drop=True), "part-0.csv")
    new = tick()
    assert len(new.run_requests) == 1 and new.run_requests[0].tags["trainyard/trigger"] == "cron"
    assert new.run_requests[0].asset_selection == [key("raw_data"), key("validated_data"), key("sweep")]
    assert (tmp_path / "prestarts").read_text() == "prestart\n"  # the run sweeps: the warm server starts at the tick
    run = harness.run("prepare")
    assert run.success, failure_text(run)
    sweep = run.output_for_node(harness.node("sweep"))
    md5 = sweep.data_md5

    unchanged = tick()
    assert unchanged.run_requests == []
    assert (
        unchanged.skip_message
        == f"test/digits: data version {md5} unchanged since the last sweep (study {sweep.study}); not retraining"
    )

    # had it run anyway, the sweep resumes the same study: no new trials on the same data
    rerun = harness.run("prepare")
    assert rerun.success, failure_text(rerun)
    assert rerun.output_for_node(harness.node("sweep")).study == sweep.study
    assert sorted(harness.instance.get_dynamic_partitions("test__digits__trials")) == sweep.trials

    # a trial of this study fails (as its train run would record it): the next sweep replaces it
    harness.resources["sweeps"].tell(sweep.study, 1, None, {"error": "boom"}, failed=True)
    replaced = harness.run("prepare")
    assert replaced.success, failure_text(replaced)
    old_keys = sorted(harness.instance.get_dynamic_partitions("test__digits__trials"))
    assert old_keys == ["trial-0000", "trial-0001", "trial-0002"]

    write_landing(tmp_path, digits_frame(300).iloc[150:].reset_index(drop=True), "part-1.csv")
    more = tick()
    assert len(more.run_requests) == 1 and more.run_requests[0].tags["trainyard/new_files"] == "1"
    assert (tmp_path / "prestarts").read_text() == "prestart\n" * 2  # the skipped ticks started nothing

    # new data, new study: the partitions are its trials, not the last study's failed and replaced ones
    fresh = harness.run("prepare")
    assert fresh.success, failure_text(fresh)
    new_sweep = fresh.output_for_node(harness.node("sweep"))
    assert new_sweep.study != sweep.study
    assert (
        sorted(harness.instance.get_dynamic_partitions("test__digits__trials"))
        == new_sweep.trials
        == ["trial-0000", "trial-0001"]
    )
    meta = fresh.get_asset_materialization_events()
    removed = [
        e.materialization.metadata["removed_partitions"].value
        for e in meta
        if e.materialization.metadata.get("removed_partitions")
    ]
    assert removed == [1], removed


@pytest.mark.slow
def test_drift_sensor_fires_on_drifted_data_and_skips_undrifted_data(tmp_path: Path) -> None:
    """Real runs, a real MLflow champion and the sensor as the daemon evaluates it.

    The sensor measures each delivery's own 300 rows against the champion's 300: for
    64 pixel features chance alone reaches PSI 0.35 at that size, so the threshold is 0.5.
    """
    import mlflow

    spec = small_spec(retrain=RetrainPolicy(drift_psi=0.5))
    harness = Harness(tmp_path, spec)
    store, registry = harness.resources["store"], harness.resources["registry"]
    sensor = harness.defs.get_sensor_def(drift_sensor_name(spec))
    (tmp_path / "prestarts").touch()
    launcher = PrestartCounter(calls=str(tmp_path / "prestarts"))
    job = harness.defs.resolve_job_def(harness.names["prepare"])

    def ingest_and_validate() -> dict:
        run = job.execute_in_process(
            instance=harness.instance, asset_selection=prepare_selection(spec), raise_on_error=False
        )
        assert run.success, failure_text(run)
        return run.output_for_node(harness.node("validated_data")).model_dump()

    def tick(cursor=None):
        context = build_sensor_context(
            instance=harness.instance,
            cursor=cursor,
            resources={"store": store, "registry": registry, "launcher": launcher},
        )
        return sensor.evaluate_tick(context)

    frame = digits_frame(900)
    write_landing(tmp_path, frame.iloc[:300].reset_index(drop=True), "part-0.csv")
    first = ingest_and_validate()
    (tmp_path / "model").mkdir()
    client = mlflow.MlflowClient(registry.tracking_uri)
    client.create_registered_model(spec.model_name)
    version = client.create_model_version(
        spec.model_name,
        source=str(tmp_path / "model"),
        tags={DATA_VERSION_TAG: first["md5"], TEST_SPLIT_TAG: first["split_id"]},
    )
    registry.set_alias(spec.model_name, CHAMPION, version.version)
    assert tick().run_requests == []  # the champion was trained on the newest data

    write_landing(tmp_path, frame.iloc[300:600].reset_index(drop=True), "part-1.csv")  # more digits, same distribution
    second = ingest_and_validate()
    calm = tick()
    assert calm.run_requests == [] and "is within drift_psi 0.5; not retraining" in calm.skip_message
    assert (
        f"of data version {second['md5']} against champion v{version.version}'s data {first['md5']}"
        in calm.skip_message
    )

    write_landing(tmp_path, inverted(frame.iloc[600:900]).reset_index(drop=True), "part-2.csv")  # white on black
    third = ingest_and_validate()
    fire = tick(calm.cursor)
    assert len(fire.run_requests) == 1
    assert (tmp_path / "prestarts").read_text() == "prestart\n"  # only the tick that requests the sweep
    request = fire.run_requests[0]
    assert request.asset_selection == [key("sweep")] and request.run_key == f"drift-{third['md5']}-{version.version}"
    assert (
        float(request.tags["trainyard/drift_psi"]) > 0.5
        and request.tags["trainyard/champion_data_version"] == first["md5"]
    )
    run = job.execute_in_process(instance=harness.instance, asset_selection=request.asset_selection, tags=request.tags)
    assert run.success
    assert run.output_for_node(harness.node("sweep")).data_md5 == third["md5"]
    rest = tick(fire.cursor)
    assert rest.run_requests == [] and "already swept" in rest.skip_message


class NoChampion(ModelRegistry):
    """A registry with no champion: the drift sensor sweeps the newest version (the first model)."""

    def get_alias(self, name: str, alias: str) -> None:  # type: ignore[override]
        return None


def test_the_drift_sensor_and_the_schedule_start_the_warm_worker_server_for_the_runs_that_sweep(tmp_path: Path) -> None:
    """A request whose run sweeps starts the server at the tick; a skip, or a run that only ingests and validates, does
    not."""
    from pipelines.environments import local_resources
    from pipelines.factory import build_definitions

    calls = tmp_path / "prestarts"
    calls.touch()
    launcher = PrestartCounter(calls=str(calls))
    resources = local_resources(tmp_path)
    store = resources["store"]
    gated = small_spec(retrain=RetrainPolicy(drift_psi=0.25, cron="0 3 * * *", on_new_data=False))
    swept_each_time = small_spec(retrain=RetrainPolicy(cron="0 3 * * *", on_new_data=False))
    (tmp_path / "dagster").mkdir()
    with DagsterInstance.local_temp(str(tmp_path / "dagster"), overrides={"telemetry": {"enabled": False}}) as instance:
        def schedule_tick(spec):
            schedule = build_definitions(spec, resources=resources).get_schedule_def(retrain_schedule_name(spec))
            return schedule.evaluate_tick(
                build_schedule_context(instance=instance, resources={"store": store, "launcher": launcher})
            )

        def drift_tick():
            sensor = build_definitions(gated, resources=resources).get_sensor_def(drift_sensor_name(gated))
            context = build_sensor_context(
                instance=instance,
                resources={
                    "store": store,
                    "registry": NoChampion(
                        tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", artifact_root=str(tmp_path / "artifacts")
                    ),
                    "launcher": launcher,
                },
            )
            return sensor.evaluate_tick(context)

        assert (
            schedule_tick(swept_each_time).skip_message and drift_tick().skip_message
        )  # no landing files, no validated data
        assert calls.read_text() == ""
        write_landing(tmp_path, digits_frame(200))
        assert schedule_tick(gated).run_requests[0].asset_selection == [key("raw_data"), key("validated_data")]
        assert calls.read_text() == ""  # ingest and validation only: the drift sensor decides whether trials follow
        assert key("sweep") in schedule_tick(swept_each_time).run_requests[0].asset_selection
        assert calls.read_text() == "prestart\n"
        validated_version(store, gated, digits_frame(300), "a" * 32)
        assert drift_tick().run_requests[0].asset_selection == [key("sweep")]
        assert calls.read_text() == "prestart\nprestart\n"
        instance.report_runless_asset_event(
            AssetMaterialization(key("sweep"), metadata={"study": study_name(gated, "a" * 32)})
        )
        assert drift_tick().skip_message.endswith("already swept (study " + study_name(gated, "a" * 32) + ")")
        assert calls.read_text() == "prestart\nprestart\n"
