"""The landing sensor asks for one prepare run per new landing state and skips unchanged data."""

from __future__ import annotations

from pathlib import Path

import pytest
from dagster import AssetKey, DagsterInstance, RunRequest, SkipReason, build_sensor_context

from pipelines.factory import build_definitions, job_names
from pipelines.landing_sensor import build_landing_sensor, evaluate_landing
from resources.launcher import Launcher
from resources.storage import ObjectStore
from tests.digits import digits_frame
from tests.pipelines.pipeline_fixtures import Harness, failure_text, small_spec, write_landing
from trainyard.data import ingest
from trainyard.naming import landing_sensor_name


@pytest.fixture
def store(tmp_path: Path) -> ObjectStore:
    return ObjectStore(root=str(tmp_path / "store"))


def test_new_files_request_a_run_and_unchanged_data_is_skipped(store: ObjectStore, tmp_path: Path) -> None:
    spec = small_spec()
    result, cursor = evaluate_landing(spec, store, None)
    assert isinstance(result, SkipReason) and "no landing files match" in result.skip_message and cursor is None

    write_landing(tmp_path, digits_frame(200), "part-0.csv")
    result, cursor = evaluate_landing(spec, store, None)
    assert isinstance(result, RunRequest)
    digest = ingest.landing_digest(ingest.list_landing(store, spec.source))
    assert cursor == digest and result.run_key == f"landing-{digest}"
    assert result.tags["trainyard/new_files"] == "1" and result.tags["trainyard/new_file_names"] == "part-0.csv"

    again, same = evaluate_landing(spec, store, cursor)
    assert (
        isinstance(again, SkipReason)
        and again.skip_message == "1 landing file(s), unchanged since the last tick"
        and same == cursor
    )

    ingest.ingest(store, spec)  # e.g. a manual run ingested it before the sensor ticked
    done, moved = evaluate_landing(spec, store, None)
    assert (
        isinstance(done, SkipReason)
        and "all already ingested in their current state" in done.skip_message
        and moved == digest
    )

    write_landing(tmp_path, digits_frame(300).iloc[200:], "part-1.csv")
    new, newer = evaluate_landing(spec, store, moved)
    assert isinstance(new, RunRequest) and new.tags["trainyard/new_file_names"] == "part-1.csv" and newer != moved


def test_sensor_definition_targets_prepare_and_keeps_its_cursor(store: ObjectStore, tmp_path: Path) -> None:
    spec = small_spec()
    sensor = build_landing_sensor(spec, job_names(spec)["prepare"])
    assert sensor.name == landing_sensor_name(spec) == "test__digits__landing"
    assert sensor.job_name == "test__digits__prepare"
    assert sensor.default_status.value == "RUNNING"  # RetrainPolicy.automatic, the default
    write_landing(tmp_path, digits_frame(200))
    with DagsterInstance.ephemeral() as instance:
        tick = sensor.evaluate_tick(
            build_sensor_context(instance=instance, resources={"store": store, "launcher": Launcher()})
        )
        assert [r.run_key for r in tick.run_requests] == [f"landing-{tick.cursor}"]
        quiet = sensor.evaluate_tick(
            build_sensor_context(
                instance=instance, cursor=tick.cursor, resources={"store": store, "launcher": Launcher()}
            )
        )
        assert quiet.run_requests == [] and "unchanged since the last tick" in quiet.skip_message
    defs = build_definitions(spec, resources={"store": store})
    assert "test__digits__landing" in [s.name for s in defs.sensors]


class PrestartCounter(Launcher):
    """A launcher that notes each `prestart_warm` call in `calls` (one line each) and says a start was begun."""

    calls: str

    def prestart_warm(self) -> bool:
        with open(self.calls, "a") as f:
            f.write("prestart\n")
        return True


def test_a_tick_that_requests_a_sweeping_run_starts_the_warm_worker_server(store: ObjectStore, tmp_path: Path) -> None:
    """New data whose run sweeps: the warm server starts now; no new data, or an ingest-only run (drift-gated):
    nothing."""
    calls = tmp_path / "prestarts"
    calls.touch()
    launcher = PrestartCounter(calls=str(calls))
    spec = small_spec()
    sweeping = build_landing_sensor(spec, job_names(spec)["prepare"])
    ingest_only = build_landing_sensor(
        spec, job_names(spec)["prepare"], asset_selection=[AssetKey(["test", "digits", "raw_data"])]
    )
    with DagsterInstance.ephemeral() as instance:
        def tick(sensor, cursor=None):
            return sensor.evaluate_tick(
                build_sensor_context(instance=instance, cursor=cursor, resources={"store": store, "launcher": launcher})
            )

        assert tick(sweeping).skip_message and calls.read_text() == ""  # no landing files yet
        write_landing(tmp_path, digits_frame(200))
        first = tick(sweeping)
        assert len(first.run_requests) == 1 and calls.read_text() == "prestart\n"
        assert tick(sweeping, first.cursor).run_requests == [] and calls.read_text() == "prestart\n"
        gated = tick(ingest_only)
        assert [r.asset_selection for r in gated.run_requests] == [[AssetKey(["test", "digits", "raw_data"])]]
        assert calls.read_text() == "prestart\n"


@pytest.mark.slow
def test_sensor_run_ingests_only_the_new_file(tmp_path: Path) -> None:
    spec = small_spec()
    write_landing(tmp_path, digits_frame(300).iloc[:150].reset_index(drop=True), "part-0.csv")
    harness = Harness(tmp_path, spec)
    store = harness.resources["store"]
    sensor = build_landing_sensor(spec, harness.names["prepare"])

    def tick(cursor):
        return sensor.evaluate_tick(
            build_sensor_context(
                instance=harness.instance,
                cursor=cursor,
                resources={"store": store, "launcher": harness.resources["launcher"]},
            )
        )

    first = tick(None)
    assert len(first.run_requests) == 1
    run = harness.run("prepare")
    assert run.success, failure_text(run)
    raw = run.output_for_node(harness.node("raw_data"))
    assert raw.files == 1 and raw.rows == 150

    assert tick(first.cursor).run_requests == []
    write_landing(tmp_path, digits_frame(300).iloc[150:].reset_index(drop=True), "part-1.csv")
    second = tick(first.cursor)
    assert len(second.run_requests) == 1 and second.run_requests[0].tags["trainyard/new_file_names"] == "part-1.csv"
    run = harness.run("prepare")
    assert run.success, failure_text(run)
    raw2 = run.output_for_node(harness.node("raw_data"))
    assert raw2.files == 2 and raw2.rows == 300 and raw2.md5 != raw.md5
    materialization = next(
        e for e in run.all_events if e.event_type_value == "ASSET_MATERIALIZATION" and "raw_data" in str(e.asset_key)
    )
    meta = materialization.event_specific_data.materialization.metadata
    assert meta["new_files"].value == 1 and meta["files"].value == 2
    assert tick(second.cursor).run_requests == []


def test_a_removed_file_requests_a_run_and_leaves_the_snapshot(store: ObjectStore, tmp_path: Path) -> None:
    spec = small_spec()
    write_landing(tmp_path, digits_frame(200), "part-0.csv")
    bad = write_landing(tmp_path, digits_frame(300).iloc[200:], "part-1.csv")
    first = ingest.ingest(store, spec)
    _, cursor = evaluate_landing(spec, store, None)
    bad.unlink()
    result, moved = evaluate_landing(spec, store, cursor)
    assert isinstance(result, RunRequest) and moved != cursor  # a deletion is a change, not "all already ingested"
    assert (
        result.tags["trainyard/removed_files"] == "1"
        and result.tags["trainyard/new_file_names"] == "part-1.csv (removed)"
    )
    after = ingest.ingest(store, spec)
    assert after.snapshot.md5 != first.snapshot.md5 and after.snapshot.rows == 200
    quiet, _ = evaluate_landing(spec, store, None)
    assert isinstance(quiet, SkipReason) and "all already ingested" in quiet.skip_message


def test_a_copy_under_a_new_name_is_ingested_as_a_duplicate_once(store: ObjectStore, tmp_path: Path) -> None:
    spec = small_spec()
    original = write_landing(tmp_path, digits_frame(200), "part-0.csv")
    first = ingest.ingest(store, spec)
    (original.parent / "part-0-again.csv").write_bytes(original.read_bytes())
    request, cursor = evaluate_landing(spec, store, None)
    assert isinstance(request, RunRequest)  # the sensor reads no content: the run finds out
    again = ingest.ingest(store, spec)
    assert again.snapshot.md5 == first.snapshot.md5 and len(again.duplicates) == 1
    quiet, _ = evaluate_landing(spec, store, None)
    assert isinstance(quiet, SkipReason)


@pytest.mark.slow
def test_removing_a_bad_file_unblocks_the_pipeline(tmp_path: Path) -> None:
    # Issue 15, item 4: a file that parses but fails validation; deleting it is the way out.
    spec = small_spec()
    write_landing(tmp_path, digits_frame(300), "part-0.csv")
    harness = Harness(tmp_path, spec)
    store = harness.resources["store"]
    sensor = build_landing_sensor(spec, harness.names["prepare"])

    def tick(cursor):
        return sensor.evaluate_tick(
            build_sensor_context(
                instance=harness.instance,
                cursor=cursor,
                resources={"store": store, "launcher": harness.resources["launcher"]},
            )
        )

    run = harness.run("prepare")
    assert run.success, failure_text(run)
    good = run.output_for_node(harness.node("raw_data"))
    bad = digits_frame(300).iloc[:20].assign(label=42)
    path = write_landing(tmp_path, bad, "part-1.csv")
    cursor = tick(None).cursor
    failed = harness.run("prepare")
    assert not failed.success and "rejected" in failure_text(failed)
    path.unlink()
    recovery = tick(cursor)
    assert len(recovery.run_requests) == 1
    run = harness.run("prepare")
    assert run.success, failure_text(run)
    assert run.output_for_node(harness.node("raw_data")).md5 == good.md5
