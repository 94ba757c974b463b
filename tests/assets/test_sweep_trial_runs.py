"""The `sweep` asset starts its first window's trial runs itself under the daemon with the sweep sensor on, and only
then.

The sweep runs here as a run worker runs it (`dagster._core.execution.api.execute_run`)
from a run record with both origins, as the daemon makes one from a code location: this
module's `location`. The instance is real (SQLite, `QueuedRunCoordinator` from its
dagster.yaml); no daemon runs, so the trial runs stay QUEUED. A sensor daemon's
liveness is its heartbeat in the instance, written here as the daemon writes it. The
real daemon drill is in tests/pipelines/test_sensors.py.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

import pytest
from dagster import (
    AssetKey,
    DagsterInstance,
    DagsterRun,
    DagsterRunStatus,
    DefaultSensorStatus,
    Definitions,
    RunRequest,
    RunsFilter,
)

from pipelines.factory import build_definitions, job_names
from pipelines.sensors import SweepCursor, run_tick
from resources.sweeps import CLAIMED_BY
from resources.sweeps.trial_runs import count_in_flight, free_slots, sensor_is_running
from tests.pipelines.sweep_drill import TrivialLauncher, drill_resources, drill_spec, prepared_data, prepared_home
from trainyard.naming import sweep_sensor_name

ROOT = Path(__file__).resolve().parent.parent.parent
HOME_ENV = "SWEEP_START_HOME"
TRIGGER = "trainyard/trigger"


def location() -> Definitions:
    """The code location the runs here come from: the drill pipeline (4 trials, 2 in flight), its home from
    `SWEEP_START_HOME`."""
    return build_definitions(spec(), resources=drill_resources(Path(os.environ[HOME_ENV]), TrivialLauncher()))


def spec() -> Any:
    return drill_spec(n_trials=4, parallelism=2)


def queued_instance(home: Path, team_limit: Optional[int] = None) -> DagsterInstance:
    """A real instance whose dagster.yaml configures Dagster's run queue (with a team limit when given)."""
    (home / "dagster").mkdir(parents=True)
    text = "telemetry:\n  enabled: false\nrun_queue:\n  max_concurrent_runs: 10\n"
    if team_limit is not None:
        text += (
            "  tag_concurrency_limits:\n    - key: trainyard/team\n      value:\n        applyLimitPerUniqueValue: "
            f"true\n      limit: {team_limit}\n"
        )
    (home / "dagster" / "dagster.yaml").write_text(text)
    return DagsterInstance.from_config(str(home / "dagster"))


def sensor_daemon_beats(instance: DagsterInstance, age: float = 0.0) -> None:
    """A heartbeat as a running `dagster-daemon`'s sensor thread writes it (`age` seconds old)."""
    from dagster._daemon.types import DaemonHeartbeat

    instance.add_daemon_heartbeat(DaemonHeartbeat(time.time() - age, "SENSOR", "test-daemon", None))


def origins(job_name: str) -> tuple[Any, Any]:
    """The reconstructable job (its python origin) and the remote origin a daemon gives a run of `job_name` from
    `location`."""
    from dagster._core.definitions.reconstruct import ReconstructableRepository
    from dagster._core.remote_origin import (
        ManagedGrpcPythonEnvCodeLocationOrigin,
        RemoteJobOrigin,
        RemoteRepositoryOrigin,
    )
    from dagster._core.types.loadable_target_origin import LoadableTargetOrigin

    recon = ReconstructableRepository.for_module(__name__, "location", str(ROOT)).get_reconstructable_job(job_name)
    target = LoadableTargetOrigin(
        executable_path=sys.executable, module_name=__name__, attribute="location", working_directory=str(ROOT)
    )
    repository = RemoteRepositoryOrigin(
        ManagedGrpcPythonEnvCodeLocationOrigin(target, location_name="sweep_start"), "__repository__"
    )
    return recon, RemoteJobOrigin(repository, job_name)


def write_validated(home: Path) -> Any:
    """The pipeline's resources, with the `validated_data` value the sweep reads written (not the sweep
    materialized)."""
    resources = drill_resources(home, TrivialLauncher())
    prepared_data(home, spec(), resources)
    return resources


def sweep_from_location(home: Path, instance: DagsterInstance, monkeypatch: pytest.MonkeyPatch) -> DagsterRun:
    """Materialize `sweep` in a run made as the daemon makes a queued run of `prepare` (both origins), executed as a run
    worker executes it."""
    from dagster._core.execution.api import execute_run

    monkeypatch.setenv(HOME_ENV, str(home))
    recon, remote = origins(job_names(spec())["prepare"])
    run = instance.create_run_for_job(
        recon.get_definition(),
        asset_selection={AssetKey(["test", "digits", "sweep"])},
        status=DagsterRunStatus.NOT_STARTED,
        remote_job_origin=remote,
        job_code_origin=recon.get_python_origin(),
    )
    assert execute_run(recon, run, instance).success
    done = instance.get_run_by_id(run.run_id)
    assert done is not None and done.status == DagsterRunStatus.SUCCESS
    return done


def sweep_metadata(instance: DagsterInstance) -> dict:
    return instance.get_latest_materialization_event(
        AssetKey(["test", "digits", "sweep"])
    ).asset_materialization.metadata


def train_runs(instance: DagsterInstance) -> list[DagsterRun]:
    return sorted(
        instance.get_runs(RunsFilter(job_name=job_names(spec())["train"])), key=lambda r: r.tags["dagster/partition"]
    )


def logged(instance: DagsterInstance, run_id: str, text: str) -> list[str]:
    return [e.user_message for e in instance.all_logs(run_id) if text in (e.user_message or "")]


def tick(instance: DagsterInstance, resources: dict, cursor: Optional[str] = None) -> Any:
    names = job_names(spec())
    return run_tick(
        spec(), instance, resources["sweeps"], cursor, train_job=names["train"], prepare_job=names["prepare"]
    )


def test_under_the_daemon_the_sweep_starts_the_first_window_and_the_sensor_takes_them_as_in_flight(
    tmp_path: Path, monkeypatch
) -> None:
    instance = queued_instance(tmp_path)
    resources = write_validated(tmp_path)
    sensor_daemon_beats(instance)
    prepare = sweep_from_location(tmp_path, instance, monkeypatch)
    meta = sweep_metadata(instance)
    study = meta["study"].value
    assert meta["started_trial_runs"].value == 2
    runs = train_runs(instance)
    assert [r.tags["dagster/partition"] for r in runs] == ["trial-0000", "trial-0001"]
    for run in runs:
        key = run.tags["dagster/partition"]
        # what the sensor daemon puts on the sweep sensor's run: the job's tags, the request's, its partition's, the
        # sensor and the run key
        assert run.tags == {
            "trainyard/team": "test",
            "trainyard/study": study,
            "trainyard/pipeline": "test/digits",
            "dagster/partition": key,
            "dagster/partition_set": "test__digits__train_partition_set",
            "dagster/sensor_name": sweep_sensor_name(spec()),
            "dagster/run_key": f"{study}/{key}",
            TRIGGER: "sweep materialized",
            "dagster/code_location": "sweep_start",
        }  # Dagster's create_run adds it for a run with a remote origin
        assert run.status == DagsterRunStatus.QUEUED  # enqueued for the daemon to dequeue: nothing launched here
        # the same code location and repository as the sweep's run: the daemon's run-key check matches it to the sensor
        assert run.remote_job_origin.repository_origin == prepare.remote_job_origin.repository_origin
        assert (run.remote_job_origin.job_name, run.job_code_origin.job_name) == (job_names(spec())["train"],) * 2
        assert run.job_code_origin.repository_origin == prepare.job_code_origin.repository_origin
    assert logged(instance, prepare.run_id, "started 2 trial run(s): trial-0000 " + runs[0].run_id)
    # Were the sensor to request them, the sensor daemon would drop both requests as runs it already made.
    from dagster._core.remote_origin import RemoteInstigatorOrigin
    from dagster._daemon.sensor import fetch_existing_runs

    class TickedSensor:  # what fetch_existing_runs reads of the RemoteSensor the daemon ticks: its name and origin
        name = sweep_sensor_name(spec())

        def get_remote_origin(self) -> Any:
            return RemoteInstigatorOrigin(prepare.remote_job_origin.repository_origin, self.name)

    keys = ["trial-0000", "trial-0001"]
    requests = [RunRequest(partition_key=k, run_key=f"{study}/{k}", job_name=job_names(spec())["train"]) for k in keys]
    assert {k: r.run_id for k, r in fetch_existing_runs(instance, TickedSensor(), requests).items()} == {
        f"{study}/{r.tags['dagster/partition']}": r.run_id for r in runs
    }
    # The sensor's first tick counts both in flight and requests nothing: no run twice, no third trial in a window of 2.
    first = tick(instance, resources)
    assert (
        first.run_requests == []
        and first.asked == []
        and "0 trial run(s)" in first.message
        and "2 in flight of parallelism 2" in first.message
    )
    assert SweepCursor.parse(first.cursor.dump()).next == 2
    again = tick(instance, resources, first.cursor.dump())
    assert again.run_requests == [] and again.asked == []
    assert [r.run_id for r in train_runs(instance)] == [r.run_id for r in runs]
    assert [(t.number, t.state.name) for t in resources["sweeps"].load(study).get_trials()] == [
        (0, "RUNNING"),
        (1, "RUNNING"),
    ]


def test_the_sweep_starts_no_more_than_the_teams_free_run_slots(tmp_path: Path, monkeypatch) -> None:
    from dagster._core.utils import make_new_run_id

    instance = queued_instance(tmp_path, team_limit=2)
    resources = write_validated(tmp_path)
    sensor_daemon_beats(instance)
    instance.add_run(
        DagsterRun(
            job_name="other", run_id=make_new_run_id(), status=DagsterRunStatus.STARTED, tags={"trainyard/team": "test"}
        )
    )
    prepare = sweep_from_location(tmp_path, instance, monkeypatch)
    assert sweep_metadata(instance)["started_trial_runs"].value == 1
    assert [r.tags["dagster/partition"] for r in train_runs(instance)] == ["trial-0000"]
    assert logged(
        instance, prepare.run_id, "0 in flight of parallelism 2, team test 1/2 runs"
    )  # counted before its run
    first = tick(instance, resources)
    assert first.run_requests == [] and "1 in flight of parallelism 2, team test 2/2 runs" in first.message


def test_a_trial_run_that_ended_untold_before_the_sensors_first_look_still_fails_its_trial(
    tmp_path: Path, monkeypatch
) -> None:
    """The sensor's first look at a study reads runs that ended since the sweep's run was created, not only since that
    look."""
    instance = queued_instance(tmp_path)
    resources = write_validated(tmp_path)
    sensor_daemon_beats(instance)
    sweep_from_location(tmp_path, instance, monkeypatch)
    crashed = train_runs(instance)[0]
    instance.report_run_failed(crashed)  # as Dagster marks a run whose worker died before its step told the study
    first = tick(instance, resources)
    assert first.failed == [0]
    assert resources["sweeps"].trial(sweep_metadata(instance)["study"].value, 0).user_attrs["error"] == (
        f"run {crashed.run_id} ended FAILURE without reporting the trial")
    assert [r.partition_key for r in first.run_requests] == ["trial-0002"] and first.asked == [
        2
    ]  # its replacement; trial-0001 is in flight


@pytest.mark.parametrize("why", ["no heartbeat", "stale heartbeat", "sensor stopped"])
def test_without_a_sensor_daemon_or_with_the_sensor_stopped_the_sweep_starts_nothing(
    tmp_path: Path, monkeypatch, why: str
) -> None:
    from dagster._core.remote_origin import RemoteInstigatorOrigin
    from dagster._core.scheduler.instigation import (
        InstigatorState,
        InstigatorStatus,
        InstigatorType,
        SensorInstigatorData,
    )

    instance = queued_instance(tmp_path)
    resources = write_validated(tmp_path)
    if why != "no heartbeat":
        sensor_daemon_beats(instance, age=200.0 if why == "stale heartbeat" else 0.0)
    if why == "sensor stopped":  # what `dagster sensor stop` stores for a sensor without a state
        _, remote = origins(job_names(spec())["prepare"])
        origin = RemoteInstigatorOrigin(remote.repository_origin, sweep_sensor_name(spec()))
        instance.add_instigator_state(
            InstigatorState(
                origin, InstigatorType.SENSOR, InstigatorStatus.STOPPED, SensorInstigatorData(min_interval=9)
            )
        )
    prepare = sweep_from_location(tmp_path, instance, monkeypatch)
    assert sweep_metadata(instance)["started_trial_runs"].value == 0 and train_runs(instance) == []
    expected = (
        f"sensor {sweep_sensor_name(spec())} is stopped" if why == "sensor stopped" else "no sensor daemon is alive"
    )
    assert logged(instance, prepare.run_id, "not starting trial runs: " + expected)
    first = tick(instance, resources)  # as before: the sensor's tick requests the first window
    assert [r.partition_key for r in first.run_requests] == ["trial-0000", "trial-0001"]


def test_in_process_the_sweep_starts_nothing(tmp_path: Path) -> None:
    """`trainyard demo` and in-process tests: no origins, so nothing changes, even with a run queue and a live sensor
    daemon."""
    instance = queued_instance(tmp_path)
    sensor_daemon_beats(instance)
    resources = drill_resources(tmp_path, TrivialLauncher())
    prepared_home(tmp_path, spec(), resources, instance)
    assert sweep_metadata(instance)["started_trial_runs"].value == 0 and train_runs(instance) == []
    sweep_run = instance.get_latest_materialization_event(AssetKey(["test", "digits", "sweep"])).run_id
    assert logged(instance, sweep_run, "not starting trial runs: this run executes in process")
    assert [r.partition_key for r in tick(instance, resources).run_requests] == ["trial-0000", "trial-0001"]


def test_a_failure_to_start_a_run_leaves_it_to_the_sensor_and_the_sweep_stands(tmp_path: Path, monkeypatch) -> None:
    import assets.sweeps.sweep

    made = {"runs": 0}
    real = assets.sweeps.sweep.create_trial_run

    def second_fails(*args: Any, **kwargs: Any) -> DagsterRun:
        made["runs"] += 1
        if made["runs"] == 2:
            raise ConnectionError("injected: the run storage went away")
        return real(*args, **kwargs)

    monkeypatch.setattr(assets.sweeps.sweep, "create_trial_run", second_fails)
    instance = queued_instance(tmp_path)
    resources = write_validated(tmp_path)
    sensor_daemon_beats(instance)
    prepare = sweep_from_location(tmp_path, instance, monkeypatch)
    assert sweep_metadata(instance)["started_trial_runs"].value == 1
    warning = logged(instance, prepare.run_id, "could not create the trial runs")
    assert warning and "ConnectionError: injected: the run storage went away" in warning[0]
    assert [(r.tags["dagster/partition"], r.status) for r in train_runs(instance)] == [
        ("trial-0000", DagsterRunStatus.QUEUED)
    ]
    first = tick(instance, resources)
    assert [r.partition_key for r in first.run_requests] == ["trial-0001"] and first.asked == []


def test_a_run_the_queue_refused_is_discarded_for_the_sensor_and_the_sweep_stands(tmp_path: Path, monkeypatch) -> None:
    instance = queued_instance(tmp_path)
    resources = write_validated(tmp_path)
    sensor_daemon_beats(instance)
    real = instance.submit_run
    calls: list[str] = []

    def second_refused(run_id: str, workspace: Any) -> DagsterRun:
        calls.append(run_id)
        if len(calls) == 2:
            raise ConnectionError("injected: the event log went away")
        return real(run_id, workspace)

    monkeypatch.setattr(instance, "submit_run", second_refused)
    prepare = sweep_from_location(tmp_path, instance, monkeypatch)
    warning = logged(instance, prepare.run_id, "could not enqueue trial run")
    assert (
        warning and "ConnectionError: injected: the event log went away" in warning[0] and "(trial-0001)" in warning[0]
    )
    assert [(r.tags["dagster/partition"], r.status) for r in train_runs(instance)] == [
        ("trial-0000", DagsterRunStatus.QUEUED)
    ]
    assert instance.get_run_by_id(calls[1]) is None  # discarded, so its run key is free for the sensor's request
    assert logged(instance, prepare.run_id, "started 1 trial run(s): trial-0000")
    first = tick(instance, resources)
    assert [r.partition_key for r in first.run_requests] == ["trial-0001"] and first.asked == []


def test_a_sensor_runs_as_its_stored_state_says_else_as_its_code_says() -> None:
    from dagster._core.scheduler.instigation import InstigatorStatus

    class Stored:  # only the status of a stored InstigatorState is read
        def __init__(self, status: InstigatorStatus) -> None:
            self.status = status

    on, off = DefaultSensorStatus.RUNNING, DefaultSensorStatus.STOPPED
    assert sensor_is_running(None, on) and not sensor_is_running(None, off)
    assert sensor_is_running(Stored(InstigatorStatus.DECLARED_IN_CODE), on) and not sensor_is_running(
        Stored(InstigatorStatus.DECLARED_IN_CODE), off
    )
    assert not sensor_is_running(Stored(InstigatorStatus.STOPPED), on)  # stopped by a person
    assert sensor_is_running(Stored(InstigatorStatus.RUNNING), off)  # started by a person


def test_in_flight_and_free_slots() -> None:
    class State:
        def __init__(self, name: str) -> None:
            self.name = name

        def is_finished(self) -> bool:
            return self.name != "RUNNING"

    class Trial:
        def __init__(self, number: int, state: str = "RUNNING", claim: str = "") -> None:
            self.number, self.state, self.user_attrs = number, State(state), ({CLAIMED_BY: claim} if claim else {})

    trials = [Trial(0, "COMPLETE"), Trial(1), Trial(2, claim="run-a"), Trial(3), Trial(4)]
    assert count_in_flight(trials, set(), lambda t: False) == 1  # claimed
    assert (
        count_in_flight(trials, {"trial-0000", "trial-0003"}, lambda t: False) == 2
    )  # a finished trial's partition counts nothing
    assert count_in_flight(trials, {"trial-0003"}, lambda t: t.number == 1) == 3
    assert free_slots(4, 3, "test", None, []) == (1, "")
    assert free_slots(2, 3, "test", None, []) == (0, "")
    team = [
        type("R", (), {"dagster_run": DagsterRun(job_name="x", run_id=f"r{i}", tags={"trainyard/team": t})})
        for i, t in enumerate(["test", "test", "b"])
    ]
    assert free_slots(4, 1, "test", 3, team) == (1, ", team test 2/3 runs")


def test_the_shipped_queue_runs_a_teams_whole_window_beside_one_other_run(tmp_path: Path) -> None:
    """deploy/local/dagster.yaml as Dagster reads it: more runs at once than a team's quota.

    The `sweep` asset starts its first window's trial runs while its prepare run is still
    running; with the instance's limit at the team's quota one of them waited for that run to end.
    """
    from resources.sweeps.trial_runs import team_run_limit

    (tmp_path / "dagster.yaml").write_text((ROOT / "deploy" / "local" / "dagster.yaml").read_text())
    with DagsterInstance.from_config(str(tmp_path)) as instance:
        quota = team_run_limit(instance, "vision")
        assert quota == 2
        assert instance.run_coordinator.get_run_queue_config().max_concurrent_runs == quota + 1
