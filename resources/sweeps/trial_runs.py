"""A sweep's trial runs: which trials are in flight, how many may start, and starting one as the sweep sensor would.

Shared by the sweep sensor (`pipelines.sensors`, every tick) and the `sweep`
asset (`assets.sweeps.sweep`), which starts the first window's trial runs itself when
the platform runs under the daemon with the sweep sensor on, instead of leaving
them to the sensor's next tick (2-10 s later). Both count a trial in flight and
a team's free run slots the same way, so the sensor's next tick takes the
asset's runs as its own and requests none of their trials again:

- a trial is *pending* while it is not finished and no run that goes on with
  the sweep claimed it (`claimed`); a pending trial is *in flight* once a run
  trains it (`trained_partitions` of the active runs) or was requested for it;
- free slots = min(window - in flight, the team's limit in the run queue's
  `tag_concurrency_limits` - its active runs) (`free_slots`).

A run the asset starts (`create_trial_run`) carries exactly the tags the
sensor's RunRequest gets from the sensor daemon (the job's, team, study,
pipeline, partition, `dagster/sensor_name` of the sweep sensor and the run key
`<study>/<trial key>`), so the daemon, which drops a request whose run key has a
run of the same sensor and repository, never makes a second; and
`trainyard/trigger=sweep materialized`, so a person can tell who started it.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Optional

from dagster import (
    DagsterInstance,
    DagsterRun,
    DagsterRunStatus,
    DefaultSensorStatus,
    JobDefinition,
    QueuedRunCoordinator,
    RepositoryDefinition,
    RunsFilter,
)

from resources.sweeps import CLAIMED_BY
from trainyard import naming
from trainyard.naming import PIPELINE_TAG, STUDY_TAG, TEAM_TAG, TRIGGER_TAG, trial_key
from trainyard.spec import PipelineSpec

PARTITION_TAG = "dagster/partition"  # the tag Dagster puts on a partitioned run
RUN_KEY_TAG = "dagster/run_key"  # Dagster's RUN_KEY_TAG: the sensor daemon starts one run per key and sensor
SENSOR_NAME_TAG = "dagster/sensor_name"  # Dagster's SENSOR_NAME_TAG: the sensor a run counts as requested by
ACTIVE = [DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING, DagsterRunStatus.STARTED]
SWEEP_TRIGGER = "sweep materialized"  # `trainyard/trigger` of a trial run the `sweep` asset started
# of a trial run started by the run of a long trial as it ended (`assets.sweeps.trial_handover.start_successor`)
SUCCESSOR_TRIGGER = "trial run ended"

SENSOR_DAEMON = "SENSOR"  # Dagster's SensorDaemon.daemon_type()
HEARTBEAT_INTERVAL_SECONDS = (
    30.0  # how often a daemon thread writes its heartbeat (Dagster's DEFAULT_HEARTBEAT_INTERVAL_SECONDS)
)
# Dagster's own tolerance on top is 30 minutes, far too long to say that a daemon that stopped is still there.
HEARTBEAT_TOLERANCE_SECONDS = 60.0


def team_run_limit(instance: DagsterInstance, team: str) -> Optional[int]:
    """The run queue's limit on concurrent runs tagged `trainyard/team=<team>` (None: no limit).

    Rules with `value: <team>` or `value: {applyLimitPerUniqueValue: true}` on
    key `trainyard/team` apply; with several, the smallest wins.
    """
    coordinator = instance.run_coordinator
    if not isinstance(coordinator, QueuedRunCoordinator):
        return None
    limits = []
    for rule in coordinator.get_run_queue_config().tag_concurrency_limits:
        if rule.get("key") != TEAM_TAG:
            continue
        value = rule.get("value")
        if value == team or (isinstance(value, dict) and value.get("applyLimitPerUniqueValue")):
            limits.append(int(rule["limit"]))
    return min(limits) if limits else None


def active_runs(instance: DagsterInstance) -> list[Any]:
    """The instance's queued and running runs (records), in one query.

    The sensor reads what it needs of them here (the team's count, the trials
    a run already trains) instead of one tag-filtered query each: a tag filter
    joins every run carrying the tag (a 10k sweep's 10,000 finished trial runs
    carry the team's; 20-25 ms a query on PostgreSQL), and a query per pending
    trial made a tick that requests 64 of them take 0.8 s.
    """
    return list(instance.get_run_records(RunsFilter(statuses=ACTIVE)))


def active_team_runs(records: list[Any], team: str) -> int:
    """Of `active_runs`, those tagged `trainyard/team=<team>`: what the run queue counts against the team's limit."""
    return sum(1 for record in records if record.dagster_run.tags.get(TEAM_TAG) == team)


def trained_partitions(records: list[Any], job_name: str) -> set[str]:
    """Of `active_runs`, the partitions that runs of `job_name` train."""
    return {record.dagster_run.tags[PARTITION_TAG] for record in records
            if record.dagster_run.job_name == job_name and PARTITION_TAG in record.dagster_run.tags}


def claimed(trial: Any) -> Optional[str]:
    """The run that asked this trial to train it next (`SweepStore.ask_claimed`), if one did."""
    return trial.user_attrs.get(CLAIMED_BY) or None


def pending(trial: Any) -> bool:
    """Whether the trial still wants a run: not finished, and no run going on with the sweep claimed it."""
    return not trial.state.is_finished() and not (trial.state.name == "RUNNING" and claimed(trial))


def count_in_flight(trials: Iterable[Any], trained: set[str], requested: Callable[[Any], bool]) -> int:
    """RUNNING trials that a run claimed, that an active run trains (`trained`) or whose run was `requested`."""
    return sum(
        1
        for t in trials
        if t.state.name == "RUNNING" and (claimed(t) or trial_key(t.number) in trained or requested(t))
    )


def free_slots(window: int, in_flight: int, team: str, limit: Optional[int], records: list[Any]) -> tuple[int, str]:
    """How many trial runs may start: min(window - in flight, the team's free run slots), at least 0; and a note of the
    team's count.

    Args:
        limit: `team_run_limit` (None: the window alone bounds them).
        records: `active_runs` (read when `limit` is not None).
    """
    free = window - in_flight
    if limit is None:
        return max(0, free), ""
    active = active_team_runs(records, team)
    return max(0, min(free, limit - active)), f", team {team} {active}/{limit} runs"


def trial_run_key(study: str, key: str) -> str:
    """The run key of trial `key`'s run: Dagster's sensor daemon starts one run per key and sensor."""
    return f"{study}/{key}"


def trial_run_tags(spec: PipelineSpec, study: str) -> dict[str, str]:
    """The tags the sweep sensor's RunRequest for a trial run carries."""
    return {TEAM_TAG: spec.team, STUDY_TAG: study, PIPELINE_TAG: spec.key}


def has_run(instance: DagsterInstance, run_key: str) -> bool:
    """Whether any run carries this run key (one query on the key's tag, as the sensor daemon's `fetch_existing_runs`
    makes)."""
    return instance.get_runs_count(RunsFilter(tags={RUN_KEY_TAG: run_key})) > 0


def trials_to_start(
    instance: DagsterInstance, spec: PipelineSpec, study: str, trials: list[Any], train_job: str
) -> tuple[list[str], str]:
    """The trial keys the sweep sensor's next tick would request runs for, oldest first; and a note of the count.

    Pending trials (`pending`) that no active run trains and that never had a
    run under their run key (the sensor may have ticked since the ask), at most
    `free_slots`: a trial with a run of its key, like one a run trains or
    claimed, counts in flight.
    """
    limit = team_run_limit(instance, spec.team)
    records = active_runs(instance)
    trained = trained_partitions(records, train_job)
    waiting = sorted((t for t in trials if pending(t) and trial_key(t.number) not in trained), key=lambda t: t.number)
    requested = {t.number for t in waiting if has_run(instance, trial_run_key(study, trial_key(t.number)))}
    in_flight = count_in_flight(trials, trained, lambda t: t.number in requested)
    free, team_note = free_slots(spec.search.window, in_flight, spec.team, limit, records)
    keys = [trial_key(t.number) for t in waiting if t.number not in requested][:free]
    return keys, f"{in_flight} in flight of parallelism {spec.search.window}{team_note}"


def sensor_is_running(stored: Any, default_status: DefaultSensorStatus) -> bool:
    """Whether a sensor ticks, from its stored `InstigatorState` (None: none stored) and its status in code.

    As Dagster reads it (`RemoteSensor.get_current_instigator_state`): a state
    the UI or CLI stored (RUNNING, STOPPED) wins; without one, or with the
    DECLARED_IN_CODE state the daemon stores on its first tick, the code's
    `default_status` says.
    """
    from dagster._core.scheduler.instigation import InstigatorStatus

    if stored is None or stored.status == InstigatorStatus.DECLARED_IN_CODE:
        return default_status == DefaultSensorStatus.RUNNING
    return stored.status == InstigatorStatus.RUNNING


def sensor_daemon_alive(instance: DagsterInstance, now: Optional[float] = None) -> bool:
    """Whether a sensor daemon wrote a heartbeat in the last `HEARTBEAT_INTERVAL_SECONDS` +
    `HEARTBEAT_TOLERANCE_SECONDS` (90 s)."""
    from dagster._daemon.controller import get_daemon_statuses

    status = get_daemon_statuses(
        instance,
        [SENSOR_DAEMON],
        curr_time_seconds=time.time() if now is None else now,
        ignore_errors=True,
        heartbeat_interval_seconds=HEARTBEAT_INTERVAL_SECONDS,
        heartbeat_tolerance_seconds=HEARTBEAT_TOLERANCE_SECONDS,
    )[SENSOR_DAEMON]
    return bool(status.required and status.healthy)


def from_code_location(run: DagsterRun) -> bool:
    """Whether a daemon or the webserver launched `run` from a code location (both origins set); not so in process."""
    return run.remote_job_origin is not None and run.job_code_origin is not None


IN_PROCESS = (
    "this run executes in process (no code location origin): the sweep sensor starts trial runs under the daemon"
)


def why_not_start(
    instance: DagsterInstance, run: DagsterRun, repository: RepositoryDefinition, sensor_name: str
) -> Optional[str]:
    """Why the run `run` (e.g. the `sweep` asset's) leaves its trial runs to the sweep sensor `sensor_name`; None when
    it may start them.

    It may when the run came from a code location (it has both origins, so
    runs made like it launch the same way), the instance's run queue is
    Dagster's (a daemon dequeues: nothing is launched from here), the sensor
    ticks for this repository (`sensor_is_running`) and a sensor daemon is alive.
    Under `trainyard demo` or in-process tests nothing changes: no origins.
    """
    from dagster._core.remote_origin import RemoteInstigatorOrigin

    if run.remote_job_origin is None or run.job_code_origin is None:  # not from_code_location(run)
        return IN_PROCESS
    if not isinstance(instance.run_coordinator, QueuedRunCoordinator):
        return (
            f"the instance's run coordinator is {type(instance.run_coordinator).__name__}, not a run queue a daemon "
            "dequeues"
        )
    if not repository.has_sensor_def(sensor_name):
        return f"the repository has no sensor {sensor_name}"
    origin = RemoteInstigatorOrigin(run.remote_job_origin.repository_origin, sensor_name)
    stored = instance.get_instigator_state(origin.get_id(), origin.get_selector().get_id())
    if not sensor_is_running(stored, repository.get_sensor_def(sensor_name).default_status):
        return f"sensor {sensor_name} is stopped"
    if not sensor_daemon_alive(instance):
        seconds = HEARTBEAT_INTERVAL_SECONDS + HEARTBEAT_TOLERANCE_SECONDS
        return (
            f"no sensor daemon is alive (no heartbeat in the last {seconds:.0f} s): queued runs might wait for nobody"
        )
    return None


def create_trial_run(
    instance: DagsterInstance,
    origin_run: DagsterRun,
    job: JobDefinition,
    spec: PipelineSpec,
    study: str,
    key: str,
    trigger: str = SWEEP_TRIGGER,
) -> DagsterRun:
    """Create (NOT_STARTED) the run of trial `key` that the sweep sensor would request, from the same code location as
    `origin_run`.

    Tags as the sensor daemon's `_create_sensor_run` makes them: the job's, the
    request's with its partition's, the sensor's name and the run key; plus
    `trainyard/trigger=<trigger>` (who started it: the `sweep` asset, or a trial run as it ended).
    Enqueue it with `instance.submit_run`.
    """
    if origin_run.remote_job_origin is None or origin_run.job_code_origin is None:
        raise ValueError(
            f"run {origin_run.run_id} has no code location origin to start trial runs from (see why_not_start)"
        )
    tags = {
        **job.run_tags,
        **trial_run_tags(spec, study),
        **job.get_tags_for_partition_key(key, selected_asset_keys=None),
        SENSOR_NAME_TAG: naming.sweep_sensor_name(spec),
        RUN_KEY_TAG: trial_run_key(study, key),
        TRIGGER_TAG: trigger,
    }
    # The execution plan is made here as the daemon's code server makes it (create_execution_plan with the tags).
    return instance.create_run_for_job(
        job,
        run_config=job.get_run_config_for_partition_key(key),
        status=DagsterRunStatus.NOT_STARTED,
        tags=tags,
        remote_job_origin=origin_run.remote_job_origin._replace(job_name=job.name),
        job_code_origin=origin_run.job_code_origin._replace(job_name=job.name),
    )


def discard_runs(instance: DagsterInstance, runs: list[DagsterRun], log: Any) -> None:
    """Delete runs made here that never reached the queue (or failed to): as if never made, so their run keys stay free
    for the sensor.

    A run that cannot be deleted is named in a warning on `log`: until it is, the sweep sensor counts its trial in
    flight.
    """
    for run in runs:
        try:
            current = instance.get_run_by_id(run.run_id)
            if current is not None and current.status in (DagsterRunStatus.NOT_STARTED, DagsterRunStatus.FAILURE):
                instance.delete_run(run.run_id)
        except Exception as e:  # still starting runs: the sweep stands, but the run must be named
            log.warning(
                f"{run.tags.get(PARTITION_TAG, '?')}: could not delete run {run.run_id} ({type(e).__name__}: {e}); "
                "until it is deleted "
                f"(`dagster run delete {run.run_id}`) the sweep sensor counts its trial in flight"
            )
