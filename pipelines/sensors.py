"""The sweep sensor: keeps `parallelism` trials of a pipeline's sweep in flight.

Each tick does a bounded amount of work, so no tick nears Dagster's sensor
timeout (60 s unless `DAGSTER_SENSOR_GRPC_TIMEOUT_SECONDS` says otherwise):

1. find the study of the latest `sweep` materialization (its `study` metadata);
2. fail trials whose heartbeat went stale (their run crashed or was killed) and
   trials whose run ended (failed, canceled) without telling the study;
3. request runs, oldest first, for trials that were asked but never requested
   (by the `sweep` asset, or by a tick whose requests were lost in a crash);
4. ask new trials for the slots left: free = min(parallelism - in flight, the
   team's free run slots, `max_asks_per_tick`), asking stops at
   `tick_budget_seconds`; add them as partitions of `trial_model` and request
   their runs;
5. stop asking at the trial budget, the failure budget, the time budget or the
   target (the reason is recorded on the study, so it survives restarts), and
   once nothing is in flight request one `sweep` run to refresh its report.

Restart safety: a trial's number is its partition key, runs carry the run key
`<study>/<trial key>` (Dagster starts at most one run per key and sensor), and
the cursor holds the lowest trial number not yet requested. A tick lost between
asking and requesting leaves its trials RUNNING above the cursor; the next tick
requests them instead of asking new ones. So a sweep killed mid-way and
restarted finishes its budget with no duplicate partitions or trial numbers.

Per-team concurrency: every run of a pipeline's `train` job carries
`trainyard/team=<team>`; the run queue in `dagster.yaml` limits runs per team
(`tag_concurrency_limits`), and the sensor reads the same limit from the
instance's run coordinator and asks no trial the queue would only hold back.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Optional

from dagster import (
    AssetKey,
    DagsterInstance,
    DagsterRunStatus,
    DefaultSensorStatus,
    Definitions,
    QueuedRunCoordinator,
    RunRequest,
    RunsFilter,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    sensor,
)

from assets.factory import trials_partitions
from resources.sweeps import SweepError, SweepStore
from trainyard import naming
from trainyard.naming import PIPELINE_TAG, STUDY_TAG, TEAM_TAG, job_names, trial_key
from trainyard.spec import PipelineSpec

PARTITION_TAG = "dagster/partition"  # the tag Dagster puts on a partitioned run
ACTIVE = [DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING, DagsterRunStatus.STARTED]
ENDED_UNTOLD = [DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED]

MINIMUM_INTERVAL_SECONDS = 30
MAX_ASKS_PER_TICK = 64
TICK_BUDGET_SECONDS = 20.0  # a third of Dagster's default 60 s sensor timeout


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


@dataclass
class SweepCursor:
    """What the sensor remembers between ticks (JSON in the sensor cursor)."""

    study: Optional[str] = None
    next: int = 0  # lowest trial number not yet requested
    checked: float = 0.0  # runs that ended before this were already looked at
    reported: int = -1  # finished-trial count of the last report run

    @classmethod
    def parse(cls, text: Optional[str]) -> "SweepCursor":
        return cls(**json.loads(text)) if text else cls()

    def dump(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True)


@dataclass
class SweepTick:
    """The outcome of one evaluation: what to add and run, the new cursor, and what a person should read."""

    run_requests: list[RunRequest] = field(default_factory=list)
    partitions: list[str] = field(default_factory=list)
    cursor: SweepCursor = field(default_factory=SweepCursor)
    message: str = ""
    asked: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    seconds: float = 0.0


def latest_study(instance: DagsterInstance, spec: PipelineSpec) -> Optional[str]:
    """The study of the latest `sweep` materialization, or None before the first one."""
    event = instance.get_latest_materialization_event(AssetKey(naming.asset_path(spec, naming.SWEEP)))
    if event is None or event.asset_materialization is None:
        return None
    entry = event.asset_materialization.metadata.get("study")
    return None if entry is None else str(entry.value)


def _fail_untold(instance: DagsterInstance, sweeps: SweepStore, job_name: str, study_name: str, since: float) -> list[int]:
    """Fail trials whose run ended (failed or canceled) without telling the study, unless another run has taken over."""
    records = instance.get_run_records(
        RunsFilter(job_name=job_name, statuses=ENDED_UNTOLD, tags={STUDY_TAG: study_name}, updated_after=datetime.fromtimestamp(since, tz=UTC))
    )
    failed = []
    for record in records:
        key = record.dagster_run.tags.get(PARTITION_TAG, "")
        if not naming.is_trial_key(key):
            continue
        number = naming.trial_number(key)
        if sweeps.trial(study_name, number).state.name != "RUNNING":
            continue
        if instance.get_runs_count(RunsFilter(job_name=job_name, statuses=ACTIVE, tags={PARTITION_TAG: key})):
            continue
        status = record.dagster_run.status.value
        sweeps.tell(study_name, number, None, {"error": f"run {record.dagster_run.run_id} ended {status} without reporting the trial"}, failed=True)
        failed.append(number)
    return failed


def evaluate_sweep(
    spec: PipelineSpec,
    instance: DagsterInstance,
    sweeps: SweepStore,
    cursor: Optional[str],
    *,
    train_job: str,
    prepare_job: str,
    max_asks_per_tick: int = MAX_ASKS_PER_TICK,
    tick_budget_seconds: float = TICK_BUDGET_SECONDS,
) -> SweepTick:
    """One tick of the sweep sensor (see the module docstring); bounded by `max_asks_per_tick` and `tick_budget_seconds`."""
    started = time.monotonic()
    deadline = started + tick_budget_seconds
    state = SweepCursor.parse(cursor)
    study_name = latest_study(instance, spec)
    if study_name is None:
        return SweepTick(cursor=state, message=f"{spec.key}: the sweep asset has not been materialized yet (run the prepare job)")
    if state.study != study_name:
        state = SweepCursor(study=study_name, checked=time.time())
    search = spec.search
    study = sweeps.load(study_name, search)
    now = time.time()
    failed = sweeps.fail_stale(study) + _fail_untold(instance, sweeps, train_job, study_name, state.checked)
    state.checked = now
    status = sweeps.status(study, search)
    if status.stop_reason:
        sweeps.record_stop(study, status.stop_reason)

    trials = sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)
    in_flight = sum(1 for t in trials if t.state.name == "RUNNING" and t.number < state.next)
    free = search.window - in_flight
    limit = team_run_limit(instance, spec.team)
    team_note = ""
    if limit is not None:
        active = instance.get_runs_count(RunsFilter(tags={TEAM_TAG: spec.team}, statuses=ACTIVE))
        free = min(free, limit - active)
        team_note = f", team {spec.team} {active}/{limit} runs"
    free = max(0, min(free, max_asks_per_tick))

    tags = {TEAM_TAG: spec.team, STUDY_TAG: study_name, PIPELINE_TAG: spec.key}
    requested: list[int] = []
    for t in trials:
        if t.number < state.next:
            continue
        if t.state.is_finished():
            state.next = t.number + 1
            continue
        key = trial_key(t.number)
        if instance.get_runs_count(RunsFilter(job_name=train_job, statuses=ACTIVE, tags={PARTITION_TAG: key})):
            state.next = t.number + 1  # a run started elsewhere (UI, backfill) already trains it
            continue
        if len(requested) >= free:
            break
        requested.append(t.number)
        state.next = t.number + 1

    asked: list[int] = []
    slots = free - len(requested)
    if slots > 0 and status.remaining > 0 and all(t.number < state.next for t in trials if t.state.name == "RUNNING"):
        asked = sweeps.ask(study, search, min(slots, status.remaining), deadline=deadline)
        requested += asked
        if asked:
            state.next = max(asked) + 1

    keys = [trial_key(n) for n in requested]
    requests = [RunRequest(partition_key=k, run_key=f"{study_name}/{k}", job_name=train_job, tags=tags) for k in keys]
    after = sweeps.status(study, search) if asked or failed else status
    if after.done and after.finished != state.reported:
        requests.append(
            RunRequest(
                run_key=f"{study_name}/report/{after.finished}",
                job_name=prepare_job,
                asset_selection=[AssetKey(naming.asset_path(spec, naming.SWEEP))],
                tags={**tags, "trainyard/report": "final"},
            )
        )
        state.reported = after.finished
    message = (
        f"{spec.key} study {study_name}: {after.summary()}; requested {len(keys)} trial run(s) "
        f"({len(asked)} newly asked), {in_flight + len(keys)} in flight of parallelism {search.window}{team_note}"
    )
    if failed:
        message += f"; failed {[trial_key(n) for n in failed]} (stale heartbeat or run ended without a result)"
    return SweepTick(
        run_requests=requests, partitions=keys, cursor=state, message=message, asked=asked, failed=failed, seconds=time.monotonic() - started
    )


def sweep_sensor(
    spec: PipelineSpec,
    train_job: Any,
    prepare_job: Any,
    *,
    minimum_interval_seconds: int = MINIMUM_INTERVAL_SECONDS,
    max_asks_per_tick: int = MAX_ASKS_PER_TICK,
    tick_budget_seconds: float = TICK_BUDGET_SECONDS,
    default_status: DefaultSensorStatus = DefaultSensorStatus.STOPPED,
) -> SensorDefinition:
    """The sweep sensor of one pipeline, targeting its `train` job (and `prepare` for report runs).

    It starts stopped: turn it on in the Dagster UI (Automation) or with
    `dagster sensor start <team>__<name>__sweep`, so nothing runs behind the
    back of `trainyard demo` or a test.

    Args:
        train_job, prepare_job: the pipeline's job definitions.
        max_asks_per_tick, tick_budget_seconds: the bound on one tick's work.
    """
    partitions = trials_partitions(spec)
    train_name, prepare_name = train_job.name, prepare_job.name

    @sensor(
        name=naming.sweep_sensor_name(spec),
        jobs=[train_job, prepare_job],
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        description=f"Keeps {spec.search.window} trial(s) of the {spec.key} sweep in flight until {spec.search.n_trials} finish",
    )
    def sweep_trials(context: SensorEvaluationContext, sweeps: SweepStore) -> SensorResult:
        try:
            tick = evaluate_sweep(
                spec, context.instance, sweeps, context.cursor, train_job=train_name, prepare_job=prepare_name,
                max_asks_per_tick=max_asks_per_tick, tick_budget_seconds=tick_budget_seconds,
            )
        except SweepError as e:
            return SensorResult(skip_reason=f"{spec.key}: {e}", cursor=context.cursor)
        context.log.info(tick.message)
        return SensorResult(
            run_requests=tick.run_requests,
            dynamic_partitions_requests=[partitions.build_add_request(tick.partitions)] if tick.partitions else [],
            cursor=tick.cursor.dump(),
            skip_reason=None if tick.run_requests else tick.message,
        )

    return sweep_trials


def sweep_sensors(defs: Definitions, *specs: PipelineSpec, **options: Any) -> list[SensorDefinition]:
    """Sweep sensors for pipelines whose jobs are in `defs` (options as for `sweep_sensor`)."""
    jobs = {j.name: j for j in (defs.jobs or [])}
    out = []
    for spec in specs:
        names = job_names(spec)
        missing = [n for n in (names["train"], names["prepare"]) if n not in jobs]
        if missing:
            raise ValueError(f"pipeline {spec.key!r}: Definitions has no job {missing}; build them with pipelines.factory.build_definitions")
        out.append(sweep_sensor(spec, jobs[names["train"]], jobs[names["prepare"]], **options))
    return out


def with_sweep_sensors(defs: Definitions, *specs: PipelineSpec, **options: Any) -> Definitions:
    """`defs` plus a sweep sensor per pipeline (e.g. started, or ticking faster, for a drill)."""
    return Definitions.merge(defs, Definitions(sensors=sweep_sensors(defs, *specs, **options)))


def run_tick(
    spec: PipelineSpec,
    instance: DagsterInstance,
    sweeps: SweepStore,
    cursor: Optional[str],
    *,
    train_job: str,
    prepare_job: str,
    **options: Any,
) -> SweepTick:
    """Evaluate the sweep sensor once and add its partitions, as the sensor daemon does.

    For drills and benchmarks that drive a sweep without the daemon: the
    caller launches (or simulates) `tick.run_requests` and passes
    `tick.cursor.dump()` to the next call.
    """
    tick = evaluate_sweep(spec, instance, sweeps, cursor, train_job=train_job, prepare_job=prepare_job, **options)
    if tick.partitions:
        instance.add_dynamic_partitions(naming.trials_partitions_name(spec), tick.partitions)
    return tick
