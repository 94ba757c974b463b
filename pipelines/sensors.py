"""The sweep sensor: keeps `parallelism` trials of a pipeline's sweep in flight.

Each tick does a bounded amount of work, so no tick nears Dagster's sensor
timeout (60 s unless `DAGSTER_SENSOR_GRPC_TIMEOUT_SECONDS` says otherwise):

0. when the pipeline is automatic, request the rest of `prepare` for a
   `raw_data` materialized on its own (`pipelines.landing_sensor.evaluate_raw_data`),
   so materializing the first asset in the UI is enough to train the sweep;
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
   once nothing is in flight request one `sweep` run to refresh its report and,
   when the pipeline is automatic (`RetrainPolicy.automatic`, the default) and
   a trial completed, one run of the `promote` job (best_model,
   registered_model): the promotion decision.

The report and the promotion are requested once per finished study (once
more only if its budget is raised and more trials finish): the cursor records
the finished count they were requested for, and their run keys
`<study>/report/<n>` and `<study>/promote/<n>` make Dagster drop a repeat even
when the cursor is reset.

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
from pipelines.landing_sensor import evaluate_raw_data
from pipelines.sensor_timing import ticks_every
from resources.sweeps import CLAIMED_BY, SweepError, SweepStatus, SweepStore
from trainyard import naming
from trainyard.naming import PIPELINE_TAG, STUDY_TAG, TEAM_TAG, TRIGGER_TAG, job_names, trial_key
from trainyard.spec import PipelineSpec

PARTITION_TAG = "dagster/partition"  # the tag Dagster puts on a partitioned run
ACTIVE = [DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING, DagsterRunStatus.STARTED]
ENDED_UNTOLD = [DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED]

# The sweep sensor ticks every 10 s (`pipelines.sensor_timing`: an interval of 10 gave ticks 15 s apart). A trial
# slot that frees waits for the next tick: with ticks 30 s apart, 4 one-epoch digits trials at parallelism 2 spent
# 54 of 64 s waiting for them (bench.sweep_throughput). A tick costs the code server 0.4-0.6 s even for a small study,
# so 10 s, not 5, per pipeline; one near the 20 s budget (tens of thousands of trials) simply runs again at the next
# look after it ends.
MINIMUM_INTERVAL_SECONDS = ticks_every(10)
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


@dataclass
class SweepCursor:
    """What the sensor remembers between ticks (JSON in the sensor cursor)."""

    study: Optional[str] = None
    next: int = 0  # lowest trial number not yet requested
    checked: float = 0.0  # runs that ended before this were already looked at
    reported: int = -1  # finished-trial count of the last report (and promote) run
    raw: Optional[int] = None  # storage id of the last raw_data materialization looked at

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


def claimed(trial: Any) -> Optional[str]:
    """The run that asked this trial to train it next (`SweepStore.ask_claimed`), if one did."""
    return trial.user_attrs.get(CLAIMED_BY) or None


def _fail_untold(instance: DagsterInstance, sweeps: SweepStore, job_name: str, study_name: str, since: float) -> list[int]:
    """Fail trials whose run ended (failed or canceled) without telling the study, unless another run has taken over.

    A run's trials are its partition's and those it claimed to go on with (`claimed`).

    The study's tag is matched here, not in the query: a tag filter joins every
    run carrying the tag (every trial run of the study, 10,000 in a 10k sweep;
    30-40 ms a tick on PostgreSQL), while the job, status and time filters alone
    select only the few runs that ended badly since the last look.
    """
    records = instance.get_run_records(
        RunsFilter(job_name=job_name, statuses=ENDED_UNTOLD, updated_after=datetime.fromtimestamp(since, tz=UTC))
    )
    failed: list[int] = []
    ours = [r for r in records if r.dagster_run.tags.get(STUDY_TAG) == study_name]
    if not ours:
        return failed
    running = [t for t in sweeps.load(study_name).get_trials(deepcopy=False) if t.state.name == "RUNNING"]
    for record in ours:
        run_id = record.dagster_run.run_id
        key = record.dagster_run.tags.get(PARTITION_TAG, "")
        numbers = [naming.trial_number(key)] if naming.is_trial_key(key) else []
        numbers += [t.number for t in running if claimed(t) == run_id]
        for number in numbers:
            if sweeps.trial(study_name, number).state.name != "RUNNING":
                continue
            if instance.get_runs_count(RunsFilter(job_name=job_name, statuses=ACTIVE, tags={PARTITION_TAG: trial_key(number)})):
                continue
            status = record.dagster_run.status.value
            sweeps.tell(study_name, number, None, {"error": f"run {run_id} ended {status} without reporting the trial"}, failed=True)
            failed.append(number)
    return failed


def promoted_by(instance: DagsterInstance, spec: PipelineSpec, study_name: str, trials: list[Any]) -> Optional[str]:
    """The run whose `best_model` of this study came after its last trial finished (a decision already made), or None.

    E.g. `trainyard demo` promoted in-process before the daemon first ticked.
    """
    event = instance.get_latest_materialization_event(AssetKey(naming.asset_path(spec, naming.BEST_MODEL)))
    ended = [t.datetime_complete.timestamp() for t in trials if t.datetime_complete is not None]
    if event is None or event.asset_materialization is None or not ended:
        return None
    study = event.asset_materialization.metadata.get("study")
    return event.run_id if study is not None and study.value == study_name and event.timestamp >= max(ended) else None


def final_requests(
    spec: PipelineSpec, study_name: str, status: SweepStatus, tags: dict[str, str], prepare_job: str, promote_job: Optional[str],
    promoted: Optional[str] = None,
) -> tuple[list[RunRequest], str]:
    """The runs that close a finished study: its final report and, when wanted and not yet made, its promotion decision.

    Args:
        promoted: the run that already promoted this study (`promoted_by`), if any.
    """
    requests = [
        RunRequest(
            run_key=f"{study_name}/report/{status.finished}",
            job_name=prepare_job,
            asset_selection=[AssetKey(naming.asset_path(spec, naming.SWEEP))],
            tags={**tags, "trainyard/report": "final"},
        )
    ]
    if promote_job is None:
        return requests, ""
    if not status.complete:
        return requests, f"; not promoting: no trial of study {study_name} completed"
    if promoted is not None:
        return requests, f"; not promoting: run {promoted} already promoted study {study_name}"
    requests.append(
        RunRequest(run_key=f"{study_name}/promote/{status.finished}", job_name=promote_job, tags={**tags, TRIGGER_TAG: "sweep finished"})
    )
    return requests, f"; study finished, requested {promote_job} (the promotion decision)"


def evaluate_sweep(
    spec: PipelineSpec,
    instance: DagsterInstance,
    sweeps: SweepStore,
    cursor: Optional[str],
    *,
    train_job: str,
    prepare_job: str,
    promote_job: Optional[str] = None,
    max_asks_per_tick: int = MAX_ASKS_PER_TICK,
    tick_budget_seconds: float = TICK_BUDGET_SECONDS,
) -> SweepTick:
    """One tick of the sweep sensor (see the module docstring); bounded by `max_asks_per_tick` and `tick_budget_seconds`.

    Args:
        promote_job: the job to start once the study is done (None: nobody promotes automatically).
    """
    started = time.monotonic()
    deadline = started + tick_budget_seconds
    state = SweepCursor.parse(cursor)
    carried: list[RunRequest] = []
    carry_note = ""
    if spec.retrain_policy.automatic:
        carried, state.raw, carry_note = evaluate_raw_data(spec, instance, state.raw, prepare_job)
    study_name = latest_study(instance, spec)
    if study_name is None:
        message = f"{spec.key}: the sweep asset has not been materialized yet (run the prepare job){carry_note}"
        return SweepTick(run_requests=carried, cursor=state, message=message)
    if state.study != study_name:
        state = SweepCursor(study=study_name, checked=time.time(), raw=state.raw)
    search = spec.search
    study = sweeps.load(study_name, search)
    now = time.time()
    failed = sweeps.fail_stale(study) + _fail_untold(instance, sweeps, train_job, study_name, state.checked)
    state.checked = now
    status = sweeps.status(study, search)
    if status.stop_reason:
        sweeps.record_stop(study, status.stop_reason)

    trials = sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)
    # A trial that a trial run asked to go on with (`claimed`) is in flight in that run: never requested here.
    in_flight = sum(1 for t in trials if t.state.name == "RUNNING" and (t.number < state.next or claimed(t)))
    free = search.window - in_flight
    limit = team_run_limit(instance, spec.team)
    team_note = ""
    records: Optional[list[Any]] = None  # active_runs(instance), read once when needed
    if limit is not None:
        records = active_runs(instance)
        active = active_team_runs(records, spec.team)
        free = min(free, limit - active)
        team_note = f", team {spec.team} {active}/{limit} runs"
    free = max(0, min(free, max_asks_per_tick))

    tags = {TEAM_TAG: spec.team, STUDY_TAG: study_name, PIPELINE_TAG: spec.key}
    requested: list[int] = []
    trained: Optional[set[str]] = None
    for t in trials:
        if t.number < state.next:
            continue
        if t.state.is_finished() or (t.state.name == "RUNNING" and claimed(t)):
            state.next = t.number + 1
            continue
        if trained is None:
            records = active_runs(instance) if records is None else records
            trained = trained_partitions(records, train_job)
        if trial_key(t.number) in trained:
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
    requests = carried + [RunRequest(partition_key=k, run_key=f"{study_name}/{k}", job_name=train_job, tags=tags) for k in keys]
    after = sweeps.status(study, search) if asked or failed else status
    promote_note = ""
    if after.done and after.finished != state.reported:
        promoted = promoted_by(instance, spec, study_name, trials) if promote_job is not None else None
        finals, promote_note = final_requests(spec, study_name, after, tags, prepare_job, promote_job, promoted)
        requests += finals
        state.reported = after.finished
    message = (
        f"{spec.key} study {study_name}: {after.summary()}; requested {len(keys)} trial run(s) "
        f"({len(asked)} newly asked), {in_flight + len(keys)} in flight of parallelism {search.window}{team_note}{promote_note}{carry_note}"
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
    promote_job: Any = None,
    *,
    minimum_interval_seconds: int = MINIMUM_INTERVAL_SECONDS,
    max_asks_per_tick: int = MAX_ASKS_PER_TICK,
    tick_budget_seconds: float = TICK_BUDGET_SECONDS,
    default_status: Optional[DefaultSensorStatus] = None,
) -> SensorDefinition:
    """The sweep sensor of one pipeline, targeting its `train` job (`prepare` for report and continuation runs, `promote` at the end).

    With `RetrainPolicy.automatic` (the default) it starts running, so a
    materialized `sweep` trains to its budget and ends in a `promote` run with
    nobody starting anything; otherwise it starts stopped: turn it on in the
    Dagster UI (Automation) or with `dagster sensor start <team>__<name>__sweep`.
    A sensor only ticks under the daemon (`dagster dev`, `make ui`), so
    `trainyard demo` and in-process tests run nothing behind one's back.

    Args:
        train_job, prepare_job: the pipeline's job definitions.
        promote_job: the job started once per finished study (None: none is started).
        max_asks_per_tick, tick_budget_seconds: the bound on one tick's work.
        default_status: overrides the status the pipeline's policy implies.
    """
    partitions = trials_partitions(spec)
    train_name, prepare_name = train_job.name, prepare_job.name
    promote_name = promote_job.name if promote_job is not None else None
    if default_status is None:
        default_status = DefaultSensorStatus.RUNNING if spec.retrain_policy.automatic else DefaultSensorStatus.STOPPED

    @sensor(
        name=naming.sweep_sensor_name(spec),
        jobs=[train_job, prepare_job, *([promote_job] if promote_job is not None else [])],
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        description=f"Keeps {spec.search.window} trial(s) of the {spec.key} sweep in flight until {spec.search.n_trials} finish"
        + (f", then starts {promote_name} (the promotion decision)" if promote_name else ""),
    )
    def sweep_trials(context: SensorEvaluationContext, sweeps: SweepStore) -> SensorResult:
        try:
            tick = evaluate_sweep(
                spec, context.instance, sweeps, context.cursor, train_job=train_name, prepare_job=prepare_name, promote_job=promote_name,
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
    """Sweep sensors for pipelines whose jobs are in `defs` (options as for `sweep_sensor`).

    Each targets its pipeline's `promote` job too when `defs` has it and the pipeline is automatic.
    """
    jobs = {j.name: j for j in (defs.jobs or [])}
    out = []
    for spec in specs:
        names = job_names(spec)
        missing = [n for n in (names["train"], names["prepare"]) if n not in jobs]
        if missing:
            raise ValueError(f"pipeline {spec.key!r}: Definitions has no job {missing}; build them with pipelines.factory.build_definitions")
        promote = jobs.get(names["promote"]) if spec.retrain_policy.automatic else None
        out.append(sweep_sensor(spec, jobs[names["train"]], jobs[names["prepare"]], promote, **options))
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
