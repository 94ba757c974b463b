"""Run reuse: a short trial's run goes on with the sweep's next trials (`SearchSpec.reuse_run_under_seconds`), through
real Dagster runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from dagster import AssetKey, DagsterEventType, EventRecordsFilter, RunsFilter

from assets.sweeps.trial_handover import REUSED_RUN_TAG
from pipelines.factory import build_definitions, job_names
from pipelines.sensors import run_tick
from resources.launcher import LaunchOutcome, TrainingCodeError
from resources.sweeps import CLAIMED_BY, SweepStore
from tests.pipelines.sweep_drill import (
    TrivialLauncher,
    drill_resources,
    drill_spec,
    open_instance,
    prepared_home,
    submit,
)
from training.spec import TrainSpec
from trainyard import naming
from trainyard.search import FloatParam, IntParam

TRIAL_ASSET = AssetKey(["test", "digits", "trial_model"])


def tick(spec, instance, resources, cursor=None):
    names = job_names(spec)
    return run_tick(spec, instance, resources["sweeps"], cursor, train_job=names["train"], prepare_job=names["prepare"])


def materializations(instance) -> list[Any]:
    """Every materialization of trial_model, oldest first: (partition, run id, metadata)."""
    records = instance.get_event_records(
        EventRecordsFilter(event_type=DagsterEventType.ASSET_MATERIALIZATION, asset_key=TRIAL_ASSET), ascending=True
    )
    return [
        (r.event_log_entry.dagster_event.partition, r.event_log_entry.run_id, r.asset_materialization.metadata)
        for r in records
    ]


def started(tmp_path: Path, launcher: Any = None, **search: Any) -> tuple[Any, dict, Any, dict]:
    """A drill sweep with run reuse (60 s) and `search`, its `sweep` materialized: spec, resources, instance, sweep."""
    spec = drill_spec(**{"reuse_run_under_seconds": 60, **search})
    resources = drill_resources(tmp_path, launcher or TrivialLauncher())
    instance = open_instance(tmp_path)
    return spec, resources, instance, prepared_home(tmp_path, spec, resources, instance)


def test_a_short_trial_run_goes_on_with_the_sweep_and_each_trial_stays_its_partition(tmp_path: Path) -> None:
    spec, resources, instance, sweep = started(tmp_path, n_trials=5, parallelism=2)
    defs = build_definitions(spec, resources=resources)
    first = tick(spec, instance, resources)
    assert [r.partition_key for r in first.run_requests] == ["trial-0000", "trial-0001"]
    run = submit(defs, instance, first.run_requests[0])
    assert run.success
    # trial-0001 is in flight (requested, not started): the run kept one slot and took trials 2, 3 and 4, then the
    # budget was spent
    mats = materializations(instance)
    assert [(p, r) for p, r, _ in mats] == [(f"trial-{n:04d}", run.run_id) for n in (0, 2, 3, 4)]
    assert instance.get_run_by_id(run.run_id).tags[REUSED_RUN_TAG] == "trial-0002,trial-0003,trial-0004"
    study = resources["sweeps"].load(sweep["study"])
    trials = {t.number: t for t in study.get_trials()}
    assert {n: t.state.name for n, t in trials.items()} == {
        0: "COMPLETE",
        1: "RUNNING",
        2: "COMPLETE",
        3: "COMPLETE",
        4: "COMPLETE",
    }
    assert [trials[n].user_attrs.get(CLAIMED_BY) for n in range(5)] == [None, None, run.run_id, run.run_id, run.run_id]
    for partition, _, meta in mats[
        1:
    ]:  # each went on trial reads as a run of its own would: value, metadata, stored value
        number = int(partition.split("-")[1])
        assert meta["val_acc"].value == pytest.approx(trials[number].value)
        assert meta["params"].value == trials[number].params and meta["trained_in_run_of"].value == "trial-0000"
        store = resources["store"]
        stored = store.read_json(naming.asset_value_uri(store, list(TRIAL_ASSET.path), partition))
        assert stored["trial"] == partition and stored["params"] == trials[number].params
    assert sorted(instance.get_dynamic_partitions("test__digits__trials")) == [f"trial-{n:04d}" for n in range(5)]
    # the sensor requests no run for the trials the run claimed, and asks nothing: the budget is spent
    after = tick(spec, instance, resources, first.cursor.dump())
    assert after.run_requests == [] and after.asked == [] and after.cursor.next == 5
    assert "1 in flight" in after.message
    assert submit(defs, instance, first.run_requests[1]).success
    done = tick(spec, instance, resources, after.cursor.dump())
    assert [r.run_key for r in done.run_requests] == [f"{sweep['study']}/report/5"]
    assert len(instance.get_runs(RunsFilter(job_name=job_names(spec)["train"]))) == 2  # five trials, two runs


def test_the_sensor_counts_a_claimed_trial_in_flight_and_requests_no_run_for_it(tmp_path: Path) -> None:
    spec, resources, instance, sweep = started(tmp_path, n_trials=6, parallelism=3)
    sweeps: SweepStore = resources["sweeps"]
    first = tick(spec, instance, resources)
    assert [r.partition_key for r in first.run_requests] == ["trial-0000", "trial-0001", "trial-0002"]
    sweeps.tell(sweep["study"], 0, 0.5, {})  # trial 0's run told its result and asks its next trial claimed
    claimed = sweeps.ask_claimed(sweeps.load(sweep["study"], spec.search), spec.search, "run-a")
    assert claimed == 3
    # the window (3) is full again: a second ask gets nothing, and neither does the sensor
    assert sweeps.ask_claimed(sweeps.load(sweep["study"], spec.search), spec.search, "run-b") is None
    again = tick(spec, instance, resources, first.cursor.dump())
    assert again.run_requests == [] and again.asked == [] and again.cursor.next == 4
    assert "3 in flight of parallelism 3" in again.message
    # a fresh storage reads the claim with the trial: it was written with it
    fresh = SweepStore(storage_url=sweeps.storage_url)
    assert fresh.trial(sweep["study"], 3).user_attrs[CLAIMED_BY] == "run-a"


def test_ask_claimed_keeps_to_the_budget_and_asks_nothing_once_stopped(tmp_path: Path) -> None:
    spec, resources, instance, sweep = started(tmp_path, n_trials=2, parallelism=4)  # asks the two trials of the budget
    sweeps: SweepStore = resources["sweeps"]
    assert sweeps.ask_claimed(sweeps.load(sweep["study"], spec.search), spec.search, "run-a") is None
    sweeps.tell(sweep["study"], 0, None, {"error": "boom"}, failed=True)  # a failed trial is replaced
    assert sweeps.ask_claimed(sweeps.load(sweep["study"], spec.search), spec.search, "run-a") == 2
    sweeps.record_stop(sweeps.load(sweep["study"]), "target reached")
    sweeps.tell(sweep["study"], 1, 0.9, {})
    assert sweeps.ask_claimed(sweeps.load(sweep["study"], spec.search), spec.search, "run-a") is None


@pytest.mark.parametrize("sampler", ["tpe", "random"])
def test_ask_claimed_draws_within_the_search_space(tmp_path: Path, sampler: str) -> None:
    """TPE before its startup trials draws as `Study.ask` would (its independent random draw); after them, from its
    batch fit."""
    params = {"lr": FloatParam(low=1e-4, high=1.0, log=True), "hidden": IntParam(low=16, high=128, step=16)}
    spec, resources, instance, sweep = started(tmp_path, n_trials=30, parallelism=1, sampler=sampler, params=params)
    sweeps: SweepStore = resources["sweeps"]
    sweeps.tell(sweep["study"], 0, 0.1, {})
    seen = []
    for n in range(1, 14):  # past TPE's 10 startup trials
        number = sweeps.ask_claimed(sweeps.load(sweep["study"], spec.search), spec.search, f"run-{n}")
        assert number == n
        trial = sweeps.trial(sweep["study"], number)
        assert 1e-4 <= trial.params["lr"] <= 1.0 and trial.params["hidden"] in range(16, 129, 16)
        seen.append(trial.params["lr"])
        sweeps.tell(sweep["study"], number, -abs(trial.params["lr"] - 0.01), {})
    assert len(set(seen)) == len(seen)


class FailAfterFirst(TrivialLauncher):
    """Trains the first trial; every later one raises a terminal error (bad user code)."""

    def launch(self, spec: TrainSpec, context: Any = None) -> LaunchOutcome:
        if spec.trial_id != "trial-0000":
            raise TrainingCodeError(f"trial {spec.trial_id}: rank 0 raised ValueError: bad hidden size")
        return super().launch(spec, context)


def test_a_failing_trial_taken_on_is_told_failed_and_ends_the_going_on_without_failing_the_run(tmp_path: Path) -> None:
    spec, resources, instance, sweep = started(tmp_path, FailAfterFirst(), n_trials=4, parallelism=1)
    first = tick(spec, instance, resources)
    run = submit(build_definitions(spec, resources=resources), instance, first.run_requests[0])
    assert run.success  # its own trial's materialization stands
    trials = resources["sweeps"].load(sweep["study"]).get_trials()
    assert [(t.number, t.state.name) for t in trials] == [(0, "COMPLETE"), (1, "FAIL")]
    assert "bad hidden size" in trials[1].user_attrs["error"]
    assert [p for p, _, _ in materializations(instance)] == ["trial-0000"]
    warnings = [e.message for e in instance.all_logs(run.run_id) if e.level == 30 and e.message]
    assert any("trial-0001 failed in trial-0000's run" in m and "bad hidden size" in m for m in warnings), warnings
    nxt = tick(spec, instance, resources, first.cursor.dump())  # the sensor asks the failed trial's replacement
    assert [r.partition_key for r in nxt.run_requests] == ["trial-0002"]


def test_a_long_trial_or_a_run_the_sensor_did_not_start_does_not_go_on(tmp_path: Path) -> None:
    spec, resources, instance, sweep = started(tmp_path, n_trials=3, parallelism=1)
    defs = build_definitions(spec, resources=resources)
    # launched by hand (the UI's Materialize): no study tag, one trial
    result = defs.resolve_job_def(job_names(spec)["train"]).execute_in_process(
        instance=instance, partition_key="trial-0000"
    )
    assert result.success and [p for p, _, _ in materializations(instance)] == ["trial-0000"]
    short = drill_spec(n_trials=3, parallelism=1, reuse_run_under_seconds=0.001)  # every trial takes longer than this
    first = tick(short, instance, resources)
    assert submit(build_definitions(short, resources=resources), instance, first.run_requests[0]).success
    assert [p for p, _, _ in materializations(instance)] == ["trial-0000", "trial-0001"]


def test_a_successor_run_that_cannot_be_made_fails_its_trial_untrained_and_the_sensor_asks_another(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """`start_successor`'s failure path, through a real run: the trial it asked is told failed with the reason (its
    claim
    would leave it in flight with no run: the sensor's cursor has passed it), the run itself succeeds, and the sensor's
    next tick asks a replacement. The gate (code location, sensor on, daemon alive) is opened by hand; the run, made in
    process, has no repository definition to make its successor's run from, so making it fails for real."""
    import assets.sweeps.trial_handover

    monkeypatch.setattr(assets.sweeps.trial_handover, "successor_blocked", lambda context, spec: None)
    spec, resources, instance, sweep = started(tmp_path, n_trials=4, parallelism=2, reuse_run_under_seconds=0.001)
    sweeps: SweepStore = resources["sweeps"]
    first = tick(spec, instance, resources)
    assert [r.partition_key for r in first.run_requests] == ["trial-0000", "trial-0001"]
    run = submit(build_definitions(spec, resources=resources), instance, first.run_requests[0])
    assert run.success
    assert [p for p, _, _ in materializations(instance)] == ["trial-0000"]  # a long trial: the run did not go on
    failed = sweeps.trial(sweep["study"], 2)
    assert failed.state.name == "FAIL" and failed.user_attrs[CLAIMED_BY] == run.run_id
    assert (
        failed.user_attrs["error"].startswith(f"run {run.run_id} could not start its run (")
        and "repository definition" in failed.user_attrs["error"]
    )
    warnings = [
        e.user_message
        for e in instance.all_logs(run.run_id)
        if "could not start the run of trial-0002" in e.user_message
    ]
    assert warnings and "asks another trial in its place" in warnings[0]
    assert instance.get_runs_count(RunsFilter(tags={"dagster/partition": "trial-0002"})) == 0  # no run was left behind
    again = tick(spec, instance, resources, first.cursor.dump())
    assert [r.partition_key for r in again.run_requests] == ["trial-0003"] and again.asked == [3]


def _reuse_through_promotion(tmp_path: Path, spec: Any, frame: Any) -> tuple[Any, list[str]]:
    """Prepare, one `train` run tagged as the sweep sensor tags it (it goes on with every other trial), then
    `promote`."""
    from tests.pipelines.pipeline_fixtures import Harness, failure_text, write_landing
    from trainyard.naming import STUDY_TAG

    spec = spec.model_copy(update={"search": spec.search.model_copy(update={"n_trials": 3, "parallelism": 1})})
    write_landing(tmp_path, frame, prefix=spec.source.prefix)
    harness = Harness(tmp_path, spec)
    prepare = harness.run("prepare")
    assert prepare.success, failure_text(prepare)
    study = prepare.output_for_node(harness.node("sweep")).study
    run = harness.defs.resolve_job_def(harness.names["train"]).execute_in_process(
        instance=harness.instance, partition_key="trial-0000", tags={STUDY_TAG: study}, raise_on_error=False)
    assert run.success, failure_text(run)
    key = AssetKey([spec.team, spec.name, "trial_model"])
    records = harness.instance.get_event_records(
        EventRecordsFilter(event_type=DagsterEventType.ASSET_MATERIALIZATION, asset_key=key)
    )
    assert {r.run_id for r in records} == {run.run_id}
    promote = harness.run("promote")
    assert promote.success, failure_text(promote)
    states = [t.state.name for t in harness.resources["sweeps"].load(study).get_trials()]
    assert states == ["COMPLETE"] * 3, states
    return promote.output_for_node(harness.node("best_model")), sorted(
        r.event_log_entry.dagster_event.partition for r in records
    )


@pytest.mark.slow
def test_run_reuse_on_a_regression_target_and_a_gbt_team(tmp_path: Path) -> None:
    """Inputs the feature was not built around: a Lightning regression (val_rmse, minimized; TPE before its startup
    trials) and the tabular team's LightGBM trials (the GBT runner, a classification of another team), real launches."""
    from pipelines.tabular.breast_cancer import breast_cancer, landing_frame
    from tests import diabetes
    from tests.pipelines.test_regression_pipeline import diabetes_pipeline

    regression = diabetes_pipeline()
    regression = regression.model_copy(update={"search": regression.search.model_copy(update={"params": {
        "lr": FloatParam(low=0.02, high=0.1, log=True), "hidden": IntParam(low=8, high=32, step=8)}})})
    best, partitions = _reuse_through_promotion(tmp_path / "regression", regression, diabetes.diabetes_frame())
    assert partitions == ["trial-0000", "trial-0001", "trial-0002"]
    assert best.best_metric > 0 and best.metrics["test_rmse"] > 0 and "val_acc" not in best.metrics

    best, partitions = _reuse_through_promotion(tmp_path / "gbt", breast_cancer, landing_frame())
    assert partitions == ["trial-0000", "trial-0001", "trial-0002"]
    assert 0.0 < best.best_metric < 0.5 and best.metrics["test_acc"] > 0.8  # val_logloss, minimized
