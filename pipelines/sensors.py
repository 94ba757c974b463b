"""The sweep sensor: keeps `parallelism` trials of a pipeline's sweep in flight.

Each tick does a bounded amount of work, so no tick nears Dagster's sensor
timeout (60 s unless `DAGSTER_SENSOR_GRPC_TIMEOUT_SECONDS` says otherwise):

0. when the pipeline is automatic, request the rest of `prepare` for a
   `raw_data` materialized on its own (`pipelines.landing_sensor.evaluate_raw_data`),
   so materializing the first asset in the UI is enough to train the sweep;
1. find the study of the latest `sweep` materialization (its `study` metadata);
   when it is of an earlier definition of the pipeline (its name ends in
   another `PipelineSpec.fingerprint`: the model, columns or search space
   changed and the location was reloaded), ask and request nothing of it: a
   study never mixes definitions. An automatic pipeline gets one `prepare` run
   (`validated_data`, `sweep`) that makes the new study, unless one is already
   requested or running;
2. fail trials whose heartbeat went stale (their run crashed or was killed) and
   trials whose run ended (failed, canceled) without telling the study;
3. request runs, oldest first, for trials that were asked but never requested
   (by the `sweep` asset when it started no runs itself, or by a tick whose
   requests were lost in a crash); a trial that a run already trains counts in
   flight and is passed over: under the daemon with this sensor on, the `sweep`
   asset starts its first window's runs itself (`resources.sweeps.trial_runs`), tagged
   as this sensor's with their run keys, so its first tick finds them in flight;
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

The in-flight count, the team's free slots and the trial runs' tags live in
`resources.sweeps.trial_runs`, shared with the `sweep` asset.

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
    EventLogEntry,
    RunRequest,
    RunsFilter,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    sensor,
)

from assets.factory import trials_partitions
from instance.storage_connections import evaluation_instance, evaluation_resources
from pipelines.landing_sensor import evaluate_raw_data
from pipelines.sensor_timing import ticks_every
from resources.sweeps import SweepError, SweepStatus, SweepStore, redefined
from resources.sweeps.trial_runs import (  # re-exported: tests, drills and benchmarks import them from here
    ACTIVE,
    PARTITION_TAG,
    active_runs,
    active_team_runs,
    claimed,
    count_in_flight,
    free_slots,
    pending,
    team_run_limit,
    trained_partitions,
    trial_run_key,
    trial_run_tags,
)
from trainyard import naming
from trainyard.naming import PIPELINE_TAG, STUDY_TAG, TEAM_TAG, TRIGGER_TAG, job_names, trial_key
from trainyard.spec import PipelineSpec

__all__ = [
    "ACTIVE",
    "MAX_ASKS_PER_TICK",
    "MINIMUM_INTERVAL_SECONDS",
    "PARTITION_TAG",
    "PIPELINE_TAG",
    "STUDY_TAG",
    "TEAM_TAG",
    "TICK_BUDGET_SECONDS",
    "TRIGGER_TAG",
    "SweepCursor",
    "SweepTick",
    "active_runs",
    "active_team_runs",
    "claimed",
    "evaluate_sweep",
    "final_requests",
    "latest_study",
    "promoted_by",
    "run_tick",
    "sweep_sensor",
    "sweep_sensors",
    "team_run_limit",
    "trained_partitions",
    "with_sweep_sensors",
]

ENDED_UNTOLD = [DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED]

# The sweep sensor ticks every 10 s (`pipelines.sensor_timing`: an interval of 10 gave ticks 15 s apart). A trial
# slot that frees waits for the next tick: with ticks 30 s apart, 4 one-epoch digits trials at parallelism 2 spent
# 54 of 64 s waiting for them (bench.sweep_throughput). A tick costs the code server 0.4-0.6 s even for a small study,
# so 10 s, not 5, per pipeline; one near the 20 s budget (tens of thousands of trials) simply runs again at the next
# look after it ends.
MINIMUM_INTERVAL_SECONDS = ticks_every(10)
MAX_ASKS_PER_TICK = 64
TICK_BUDGET_SECONDS = 20.0  # a third of Dagster's default 60 s sensor timeout


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


def _latest_sweep(instance: DagsterInstance, spec: PipelineSpec) -> Optional[EventLogEntry]:
    """The newest materialization of the pipeline's `sweep` asset (after any wipe of it), or None.

    One event-log query (2 connections on PostgreSQL, 8 ms at a 10k sweep here) rather than
    `get_latest_materialization_event`'s asset-row lookup (4 connections, 23 ms), every tick.
    """
    records = instance.fetch_materializations(AssetKey(naming.asset_path(spec, naming.SWEEP)), limit=1).records
    event = records[0].event_log_entry if records else None
    return None if event is None or event.asset_materialization is None else event


def _study_of(event: Optional[EventLogEntry]) -> Optional[str]:
    entry = (
        None
        if event is None or event.asset_materialization is None
        else event.asset_materialization.metadata.get("study")
    )
    return None if entry is None else str(entry.value)


def latest_study(instance: DagsterInstance, spec: PipelineSpec) -> Optional[str]:
    """The study of the latest `sweep` materialization, or None before the first one."""
    return _study_of(_latest_sweep(instance, spec))


def _run_created(instance: DagsterInstance, event: EventLogEntry) -> float:
    """When the run that recorded `event` was created (the event's time when the run is gone)."""
    record = instance.get_run_record_by_id(event.run_id) if event.run_id else None
    return min(event.timestamp, record.create_timestamp.timestamp()) if record is not None else event.timestamp


def _fail_untold(
    instance: DagsterInstance, sweeps: SweepStore, job_name: str, study_name: str, since: float
) -> list[int]:
    """Fail trials whose run ended (failed or canceled) without telling the study, unless another run has taken over.

    A run's trials are its partition's and those it claimed (`claimed`): to go on with, or to start the run of as it
    ended (`assets.sweeps.trial_handover.start_successor`). A claimed trial that an active run trains is left alone.

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
            if instance.get_runs_count(
                RunsFilter(job_name=job_name, statuses=ACTIVE, tags={PARTITION_TAG: trial_key(number)})
            ):
                continue
            status = record.dagster_run.status.value
            sweeps.tell(
                study_name,
                number,
                None,
                {"error": f"run {run_id} ended {status} without reporting the trial"},
                failed=True,
            )
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
    spec: PipelineSpec,
    study_name: str,
    status: SweepStatus,
    tags: dict[str, str],
    prepare_job: str,
    promote_job: Optional[str],
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
        RunRequest(
            run_key=f"{study_name}/promote/{status.finished}",
            job_name=promote_job,
            tags={**tags, TRIGGER_TAG: "sweep finished"},
        )
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
    """One tick of the sweep sensor (see the module docstring); bounded by `max_asks_per_tick` and
    `tick_budget_seconds`.

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
    event = _latest_sweep(instance, spec)
    study_name = _study_of(event)
    if event is None or study_name is None:
        message = f"{spec.key}: the sweep asset has not been materialized yet (run the prepare job){carry_note}"
        return SweepTick(run_requests=carried, cursor=state, message=message)
    changed = redefined(spec, study_name)
    if changed is not None:
        return _redefined_tick(spec, instance, state, study_name, changed, carried, carry_note, prepare_job)
    if state.study != study_name:
        # The `sweep` asset may have started trial runs of the new study before this first look (assets.sweeps.sweep):
        # runs
        # that ended since its run was created are looked at, so one that ended untold still fails its trial.
        state = SweepCursor(study=study_name, checked=_run_created(instance, event), raw=state.raw)
    with sweeps.reads_once(study_name):  # one read of the trials per write, not one per look (resources.sweeps.rdb)
        search = spec.search
        study = sweeps.load(study_name, search)
        now = time.time()
        failed = sweeps.fail_stale(study) + _fail_untold(instance, sweeps, train_job, study_name, state.checked)
        state.checked = now
        status = sweeps.status(study, search)
        if status.stop_reason:
            sweeps.record_stop(study, status.stop_reason)

        trials = sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)
        limit = team_run_limit(instance, spec.team)
        waiting = any(pending(t) for t in trials if t.number >= state.next)
        records = (
            active_runs(instance) if limit is not None or waiting else []
        )  # one read of the active runs, when needed
        trained = trained_partitions(records, train_job) if waiting else set()
        # In flight, never requested here: a trial requested by an earlier tick (below the cursor), claimed by a run
        # that
        # goes on with the sweep, or trained by a run started elsewhere (the `sweep` asset's first window, the UI, a
        # backfill).
        in_flight = count_in_flight(trials, trained, lambda t: t.number < state.next)
        free, team_note = free_slots(search.window, in_flight, spec.team, limit, records)
        free = min(free, max_asks_per_tick)

        tags = trial_run_tags(spec, study_name)
        requested = _waiting_trials(trials, state, trained, free)
        asked: list[int] = []
        slots = free - len(requested)
        if (
            slots > 0
            and status.remaining > 0
            and all(t.number < state.next for t in trials if t.state.name == "RUNNING")
        ):
            asked = sweeps.ask(study, search, min(slots, status.remaining), deadline=deadline)
            requested += asked
            if asked:
                state.next = max(asked) + 1

        keys = [trial_key(n) for n in requested]
        requests = carried + [
            RunRequest(partition_key=k, run_key=trial_run_key(study_name, k), job_name=train_job, tags=tags)
            for k in keys
        ]
        after = sweeps.status(study, search) if asked or failed else status
        promote_note = ""
        if after.done and after.finished != state.reported:
            promoted = promoted_by(instance, spec, study_name, trials) if promote_job is not None else None
            finals, promote_note = final_requests(spec, study_name, after, tags, prepare_job, promote_job, promoted)
            requests += finals
            state.reported = after.finished
        notes = f"{team_note}{promote_note}{carry_note}"
        message = _tick_message(spec, study_name, after, keys, asked, in_flight, search.window, notes, failed)
        return SweepTick(
            run_requests=requests,
            partitions=keys,
            cursor=state,
            message=message,
            asked=asked,
            failed=failed,
            seconds=time.monotonic() - started,
        )


def _waiting_trials(trials: list[Any], state: SweepCursor, trained: set[str], free: int) -> list[int]:
    """Trials at or past the cursor still waiting for a run, at most `free` of them; moves `state.next` past those
    looked at."""
    requested: list[int] = []
    for t in trials:
        if t.number < state.next:
            continue
        if not pending(t) or trial_key(t.number) in trained:
            state.next = t.number + 1  # finished, claimed, or a run started elsewhere already trains it
            continue
        if len(requested) >= free:
            break
        requested.append(t.number)
        state.next = t.number + 1
    return requested


def _tick_message(
    spec: PipelineSpec,
    study_name: str,
    after: Any,
    keys: list[str],
    asked: list[int],
    in_flight: int,
    window: int,
    notes: str,
    failed: list[int],
) -> str:
    """What a sweep tick did, for the sensor's log: the study's state, the runs requested and in flight, and the trials
    failed."""
    message = (
        f"{spec.key} study {study_name}: {after.summary()}; requested {len(keys)} trial run(s) "
        f"({len(asked)} newly asked), {in_flight + len(keys)} in flight of parallelism {window}{notes}"
    )
    if failed:
        message += f"; failed {[trial_key(n) for n in failed]} (stale heartbeat or run ended without a result)"
    return message


def _redefined_tick(
    spec: PipelineSpec,
    instance: DagsterInstance,
    state: SweepCursor,
    study_name: str,
    changed: str,
    carried: list[RunRequest],
    carry_note: str,
    prepare_job: str,
) -> SweepTick:
    """A tick whose latest study is of an earlier definition: no trial of it is asked or requested; `prepare` makes the
    new one.

    An automatic pipeline gets one run of `validated_data` and `sweep` (run key
    `<old study>/redefined/<fingerprint>`: Dagster drops a repeat) unless a
    prepare run is already requested or in progress; otherwise the message says to run it.
    """
    head = f"{spec.key}: {changed}"
    if carried:
        return SweepTick(
            run_requests=carried, cursor=state, message=f"{head}; waiting for the prepare run requested{carry_note}"
        )
    active = instance.get_runs_count(RunsFilter(job_name=prepare_job, statuses=ACTIVE))
    if active:
        return SweepTick(cursor=state, message=f"{head}; waiting for the {prepare_job} run in progress")
    if not spec.retrain_policy.automatic:
        return SweepTick(
            cursor=state, message=f"{head}; run the {prepare_job} job to start it (the pipeline is not automatic)"
        )
    request = RunRequest(
        run_key=f"{study_name}/redefined/{spec.fingerprint()}",
        job_name=prepare_job,
        asset_selection=[AssetKey(naming.asset_path(spec, n)) for n in (naming.VALIDATED_DATA, naming.SWEEP)],
        tags={PIPELINE_TAG: spec.key, TRIGGER_TAG: "definition changed"},
    )
    return SweepTick(
        run_requests=[request],
        cursor=state,
        message=f"{head}; requested {prepare_job} (validated_data, sweep) for the new study",
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
    """The sweep sensor of one pipeline, targeting its `train` job (`prepare` for report and continuation runs,
    `promote` at the end).

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
        description=f"Keeps {spec.search.window} trial(s) of the {spec.key} sweep in flight until "
                    f"{spec.search.n_trials} finish"
        + (f", then starts {promote_name} (the promotion decision)" if promote_name else ""),
    )
    def sweep_trials(context: SensorEvaluationContext) -> SensorResult:
        try:
            with evaluation_resources(context, "sweeps") as resources:
                tick = evaluate_sweep(
                    spec,
                    evaluation_instance(context),
                    resources.sweeps,
                    context.cursor,
                    train_job=train_name,
                    prepare_job=prepare_name,
                    promote_job=promote_name,
                    max_asks_per_tick=max_asks_per_tick,
                    tick_budget_seconds=tick_budget_seconds,
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
            raise ValueError(
                f"pipeline {spec.key!r}: Definitions has no job {missing}; build them with "
                "pipelines.team.team_definitions (or pipelines.factory.build_definitions, which it calls)"
            )
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
