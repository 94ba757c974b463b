"""The bodies of `trial_model` (one partition per trial) and `best_model`.

A trial is trained by the launcher from a `TrainSpec` (`trainyard.trainspec`),
never in this process; its outcome is told to the study and returned with
the metrics, checkpoint, tracker run and goodput as metadata.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, NoReturn, Optional

from dagster import (
    AssetExecutionContext,
    Config,
    Failure,
    MetadataValue,
    Output,
    RetryRequested,
)

from assets.metadata import to_dagster
from resources.launch_errors import nodes_to_avoid, read_watchdog_events
from resources.launcher import Launcher, LaunchError, TrainingConfigError, TrainingPreempted, pod_environment
from resources.model_facts import describe_model
from resources.storage import ObjectStore
from resources.sweeps import (
    CONFIG_ERROR,
    SweepError,
    SweepStore,
    failure_reason,
    objective_values,
    objectives_of,
    pareto_front,
    pick_trial,
    redefined,
    trials_markdown,
)
from resources.tracking import Tracking
from training.spec import FaultInjection
from trainyard import lineage, naming, planner
from trainyard.curves import CURVES_FILE, curves_markdown, curves_png, epoch_rows
from trainyard.data.feast import read_lineage
from trainyard.plots import markdown_image
from trainyard.redact import redact_text
from trainyard.spec import PipelineSpec
from trainyard.trainspec import TrialInputs, build_train_spec, model_kwargs
from trainyard.trials import (
    best_single_objective,
    count_failures,
    model_bytes,
    record_launch_failure,
    trial_comparison,
    trials_markdown_table,
)
from trainyard.values import BestModel, Sweep, TrialModel, ValidatedData


class TrialConfig(Config):
    """Run config of a trial: launch-time overrides (the last configuration layer), retraining and fault drills.

    A drill rehearses recovery before a long job: e.g. `drill_kill_rank=1,
    drill_kill_at_step=50` kills a rank mid-epoch; the trial must finish with the
    same weights. `drill_hang_rank=1, drill_hang_at_step=50` blocks a rank forever
    before a step's gradient all-reduce (the watchdog must name it and restart the
    gang); `drill_slow_rank=1, drill_slow_seconds=0.5` makes a rank sleep in every
    step (the watchdog must report the straggler with its node). Each drill fires
    once per training directory.

    A finished trial (complete, pruned or failed) is not trained again unless
    `retrain` is set; a drill on a finished trial implies `retrain`, since a
    drill exists to be watched. A retrain trains the trial's recorded inputs
    from scratch into `<trial>/retrain-<run id>/` and reports its result beside
    the recorded one; the study keeps its record of the trial untouched (Optuna
    never rewrites a finished trial, and `best_model` reads the result the
    study points to), so retraining is for drills and debugging and never
    changes what the sweep picks. A drill that cannot fire on the trial (a rank
    or step it never reaches) fails before compute, and one that was meant to
    restart the trial but did not fails the run: a drill never silently passes.

    Example (Launchpad of the `train` job, one finished partition):
        ops: {<team>__<pipeline>__trial_model: {config: {drill_kill_rank: 1, drill_kill_at_step: 5}}}
    """

    max_epochs: Optional[int] = None
    retrain: bool = False
    drill_kill_rank: Optional[int] = None
    drill_kill_at_step: Optional[int] = None
    drill_sigterm_at_step: Optional[int] = None
    drill_corrupt_latest_checkpoint: bool = False
    drill_fail_storage_writes: int = 0
    drill_hang_rank: Optional[int] = None
    drill_hang_at_step: Optional[int] = None
    drill_slow_rank: Optional[int] = None
    drill_slow_seconds: float = 0.0

    def faults(self) -> FaultInjection:
        return FaultInjection(
            kill_rank=self.drill_kill_rank,
            kill_at_step=self.drill_kill_at_step,
            sigterm_at_step=self.drill_sigterm_at_step,
            corrupt_latest_checkpoint=self.drill_corrupt_latest_checkpoint,
            fail_storage_writes=self.drill_fail_storage_writes,
            hang_rank=self.drill_hang_rank,
            hang_at_step=self.drill_hang_at_step,
            slow_rank=self.drill_slow_rank,
            slow_seconds=self.drill_slow_seconds,
        )

    def drill(self) -> dict[str, Any]:
        """The drill's settings that differ from no drill (empty: no drill)."""
        return self.faults().model_dump(exclude_defaults=True)

    def restarts_expected(self) -> bool:
        """Whether the drill should restart the trial at least once (a killed rank, a preemption or a hung rank)."""
        return (
            self.drill_kill_at_step is not None
            or self.drill_sigterm_at_step is not None
            or self.drill_hang_at_step is not None
        )


def handle_launch_error(
    context: AssetExecutionContext,
    error: LaunchError,
    spec: PipelineSpec,
    store: ObjectStore,
    sweeps: SweepStore,
    study: str,
    number: int,
    output_uri: str,
    tell: bool = True,
) -> NoReturn:
    """Fail at once on user errors; re-launch on infrastructure errors and preemption within budget.

    Every launch failure is appended to `<trial>/launches.json` (reset on the
    first attempt of a run), which is the budget's ledger and the record of
    restart causes. With `tell` off (a retrain) the study is not told: it keeps
    its record of the trial.
    """
    message = redact_text(str(error))  # a pod's output may hold what it should not have printed
    launches = record_launch_failure(
        store,
        output_uri,
        retry_number=context.retry_number,
        cause=type(error).__name__,
        message=message,
        at=time.time(),
    )
    log_tail = MetadataValue.md(f"```\n{redact_text(error.log_tail)}\n```")
    if not error.retryable:
        config = isinstance(error, TrainingConfigError)
        if tell:
            sweeps.tell(
                study, number, None, {"error": message[:2000], **({CONFIG_ERROR: True} if config else {})}, failed=True
            )
        if config:
            # Deterministic: the sweep stops asking while no trial of the study has succeeded
            # (resources.sweeps.rules.sweep_status).
            message += (f"\n(a configuration error: no retry, and the sweep sensor asks no new trial of study {study} "
                        "while none of its trials has succeeded; fix the pipeline definition)")
        raise Failure(
            description=message, metadata={"log_tail": log_tail, "retried": False, "config_error": config}
        ) from error
    infra, preemptions = count_failures(launches, TrainingPreempted.__name__)
    budget = spec.retries
    if infra > budget.max_infra_retries or preemptions > budget.max_preemptions:
        if tell:
            sweeps.tell(study, number, None, {"error": message[:2000]}, failed=True)
        raise Failure(
            description=f"{context.partition_key}: giving up after {infra} infrastructure failure(s) (budget "
                        f"{budget.max_infra_retries}) "
            f"and {preemptions} preemption(s) (budget {budget.max_preemptions}); last: {message}",
            metadata={"log_tail": log_tail, "launches": MetadataValue.json(launches)},
        ) from error
    context.log.warning(
        f"{context.partition_key}: {type(error).__name__}: {(message.splitlines() or [''])[0]} -- retrying "
        f"(infrastructure failures {infra}/{budget.max_infra_retries}, preemptions "
        f"{preemptions}/{budget.max_preemptions}); "
        "the next attempt resumes from the newest committed checkpoint"
    )
    raise RetryRequested(max_retries=context.retry_number + 1, seconds_to_wait=budget.wait_seconds) from error


def tell_result(
    context: AssetExecutionContext,
    spec: PipelineSpec,
    store: ObjectStore,
    sweeps: SweepStore,
    trial: TrialInputs,
    result: dict[str, Any],
    output_uri: str,
) -> None:
    """Tell the study how the trial ended (pruned, or its objective values); adds `status`/`objectives` to `result`."""
    attrs = {"result_uri": f"{output_uri}/result.json", "metrics": result["metrics"]}
    if result["status"] == "pruned" or sweeps.trial(trial.study, trial.number).state.name == "PRUNED":
        sweeps.tell(trial.study, trial.number, None, attrs, pruned=True)
        result["status"] = "pruned"
        return
    objectives = objectives_of(spec)
    size = model_bytes(store, result["model_uri"]) if any(o.metric == "model_bytes" for o in objectives) else None
    try:
        values = objective_values(result, objectives, spec.model.monitor, size)
    except SweepError as e:
        sweeps.tell(trial.study, trial.number, None, {**attrs, "error": str(e)}, failed=True)
        raise Failure(description=f"{context.partition_key}: {e}") from e
    result["objectives"] = dict(zip([o.metric for o in objectives], values))
    sweeps.tell(trial.study, trial.number, values if spec.search.multi_objective else values[0], attrs)


def trial_metadata(spec: PipelineSpec, value: TrialModel, record: dict[str, Any], plan: Any) -> dict[str, Any]:
    """What a person reads on a trial's materialization: status, objectives, metrics, throughput, recovery, plan."""
    pruned = value.status == "pruned"
    return {
        "status": value.status,
        **({"pruned_at_epoch": value.epochs} if pruned else {}),
        **{f"objective_{k}": float(v) for k, v in (value.objectives or {}).items()},
        **{k: float(v) for k, v in value.metrics.items()},
        spec.model.monitor: value.best_metric,
        "params": MetadataValue.json(value.params),
        "samples_per_second": value.samples_per_second,
        "device_hours": value.device_hours,
        "world_size": value.world_size,
        "checkpoint": MetadataValue.path(value.checkpoint_uri or ""),
        "model": MetadataValue.path(value.model_uri),
        "tracker_run": value.tracker_run or "",
        "lineage": MetadataValue.json(record),
        "resumed_from": value.resumed_from or "",
        "checkpoint_interval_seconds": value.checkpoint_interval_seconds or 0.0,
        "checkpoint_interval_source": value.checkpoint_interval_source or "",
        "goodput": MetadataValue.json(value.goodput or {}),
        **({"watchdog": MetadataValue.json(value.watchdog)} if value.watchdog else {}),
        **to_dagster(plan.metadata()),
    }


def train_trial(
    context: AssetExecutionContext,
    config: TrialConfig,
    spec: PipelineSpec,
    trial: TrialInputs,
    validated: ValidatedData,
    plan: Any,
    record: dict[str, Any],
    output_uri: str,
    *,
    store: ObjectStore,
    launcher: Launcher,
    tracking: Tracking,
    sweeps: SweepStore,
    tell: bool = True,
) -> dict[str, Any]:
    """Launch the trial from its `TrainSpec` under the study's heartbeat, tell the study, and return the result as JSON.

    With `tell` off (a retrain of a finished trial) there is no heartbeat and the study is not told.
    """
    if plan.error:
        if tell:
            sweeps.tell(trial.study, trial.number, None, {"error": plan.error[:2000]}, failed=True)
        raise Failure(description=f"{context.partition_key}: {plan.error}", metadata=to_dagster(plan.metadata()))
    for warning in plan.warnings:
        context.log.warning(f"{context.partition_key}: {warning}")
    train_spec = build_train_spec(
        spec,
        trial,
        validated,
        output_uri=output_uri,
        distribution=plan.distribution,
        optuna_storage_url=sweeps.connect_url(),
        tracker=tracking.tracker_spec(
            project=naming.tracker_project(spec),
            group=trial.study,
            name=trial.trial_id if tell else f"{trial.trial_id}-retrain",
            config=record,
        ),
        lineage=record,
        max_epochs=config.max_epochs,
        faults=config.faults(),
    )
    launched = time.time()
    try:
        # The spec names the storage's credentials by reference; a local launch hands them to its processes.
        with (
            sweeps.heartbeat(trial.study, trial.number) if tell else contextlib.nullcontext(),
            pod_environment(sweeps.pod_environment()),
        ):
            outcome = launcher.launch(train_spec, context=context)
    except LaunchError as e:
        log_watchdog_events(context, output_uri, launched)
        handle_launch_error(context, e, spec, store, sweeps, trial.study, trial.number, output_uri, tell=tell)
    result = outcome.result.model_dump(mode="json")
    result["watchdog"] = log_watchdog_events(context, output_uri, launched)
    rows = epoch_rows(outcome.progress)
    if rows:
        store.write_json(f"{output_uri}/{CURVES_FILE}", rows)
    if tell:
        tell_result(context, spec, store, sweeps, trial, result, output_uri)
    return result


CLOCK_SKEW_SECONDS = 2.0  # how far a pod's clock may lag the orchestrator's


def log_watchdog_events(context: AssetExecutionContext, output_uri: str, since: float) -> dict[str, Any]:
    """Tell the run log what the pod-side agents found since `since`: hung ranks (rank, pod, node, where it was
    stuck) and stragglers (rank, node); the summary the trial's metadata keeps (`avoid_nodes`: where a later launch
    should not run; docs/operations.md, "Hung and slow ranks")."""
    events = read_watchdog_events(output_uri, since - CLOCK_SKEW_SECONDS)
    for e in events:
        message = f"{context.partition_key}: {redact_text(str(e.get('message', '')))}"
        if e.get("kind") == "straggler_cleared":
            context.log.info(message)
        else:
            context.log.warning(message)
    if not events:
        return {}
    return {
        "hangs": sum(e.get("kind") == "hang" for e in events),
        "stragglers": sum(e.get("kind") == "straggler" for e in events),
        "avoid_nodes": nodes_to_avoid(events),
        "events": [{k: e.get(k) for k in ("kind", "rank", "pod", "node", "step", "stack")} for e in events],
    }


def curves_metadata(store: ObjectStore, result_uri: str, title: str) -> dict[str, Any]:
    """The training curves kept beside a result (`curves.json`): a per-epoch table, and a plot once there are two
    epochs; empty when there are none.

    The same epochs were observations of the partition while it trained; these
    show the whole curve on the materialization, also when the result is reused.
    One epoch (a one-epoch trial, a GBT trial whose only report is its last
    iteration) is no curve: the table holds all of it, and a plot of one marker
    would cost the run worker matplotlib's import and a render (0.3-0.5 s).
    """
    uri = f"{result_uri.rsplit('/', 1)[0]}/{CURVES_FILE}"
    rows = store.read_json(uri) if store.exists(uri) else []
    if not rows:
        return {}
    plot = (
        {"curves_plot": MetadataValue.md(markdown_image(curves_png(rows, title), "training curves"))}
        if len(rows) >= 2
        else {}
    )
    return {"epochs_reported": len(rows), **plot, "curves": MetadataValue.md(curves_markdown(rows))}


RETRAIN_DIR_PREFIX = "retrain-"


def check_drill(partition_key: str, config: TrialConfig, world_size: int, recorded: Optional[dict[str, Any]]) -> None:
    """Fail before compute when the drill names a rank or step the trial never reaches.

    Steps are checked against the recorded result's `global_step` unless
    `max_epochs` overrides the length of training.
    """
    problems = []
    for name in ("drill_kill_rank", "drill_hang_rank", "drill_slow_rank"):
        rank = getattr(config, name)
        if rank is not None and rank >= world_size:
            problems.append(f"{name}={rank} names no rank of a {world_size}-process trial (ranks 0..{world_size - 1})")
    if config.drill_slow_rank is not None and world_size < 2:
        problems.append("drill_slow_rank needs a trial of 2 or more processes: a straggler is slower than the others")
    steps = recorded.get("global_step") if recorded is not None and config.max_epochs is None else None
    for name in ("drill_kill_at_step", "drill_sigterm_at_step", "drill_hang_at_step"):
        at = getattr(config, name)
        if at is not None and steps is not None and at > steps:
            problems.append(
                f"{name}={at} is past the trial's last step (it trained {steps} steps); use a step in 1..{steps}"
            )
    if problems:
        raise Failure(description=f"{partition_key}: the drill cannot run: {'; '.join(problems)}")


def retrain_trial(
    context: AssetExecutionContext,
    config: TrialConfig,
    spec: PipelineSpec,
    trial: TrialInputs,
    state: str,
    validated: ValidatedData,
    plan: Any,
    record: dict[str, Any],
    output_uri: str,
    **resources: Any,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Train a finished trial again, into a fresh directory, without telling the study (see `TrialConfig`).

    Returns:
        The new result (its `result_uri` under `<trial>/retrain-<run id>/`) and
        the metadata that compares it with the recorded one and reports the drill.

    Raises:
        Failure: the drill cannot fire on this trial, or should have restarted the trial and did not.
    """
    store: ObjectStore = resources["store"]
    recorded_uri = f"{output_uri}/result.json"
    recorded = store.read_json(recorded_uri) if store.exists(recorded_uri) else None
    drill = config.drill()
    check_drill(context.partition_key, config, plan.distribution.world_size, recorded)
    reason = "retrain requested" if config.retrain else "a drill on a finished trial retrains it"
    retrain_uri = f"{output_uri}/{RETRAIN_DIR_PREFIX}{context.run_id[:8]}"
    context.log.info(
        f"{context.partition_key} is {state.lower()} in study {trial.study}; {reason}: training its recorded inputs "
        f"again in {retrain_uri} "
        f"(the study keeps its record{'; drill ' + str(drill) if drill else ''})"
    )
    result = train_trial(context, config, spec, trial, validated, plan, record, retrain_uri, tell=False, **resources)
    restarts = (result.get("goodput") or {}).get("restarts")
    if config.restarts_expected() and restarts == 0:
        raise Failure(
            description=f"{context.partition_key}: drill {drill} never fired: the retrain finished without a restart"
        )
    monitor = spec.model.monitor
    meta: dict[str, Any] = {
        "retrain": MetadataValue.json(
            {
                "reason": reason,
                "study_state": state,
                "recorded_result": recorded_uri if recorded else None,
                "study_unchanged": True,
            }
        ),
        **({f"recorded_{monitor}": float(recorded["best_metric"])} if recorded else {}),
    }
    if drill:
        causes = (result.get("goodput") or {}).get("restart_causes", [])
        meta.update(
            {
                "drill": MetadataValue.json(drill),
                "drill_recovered": True,
                **({"drill_restarts": int(restarts)} if restarts is not None else {}),
            }
        )
        context.log.info(
            f"{context.partition_key}: drill {drill} recovered: {restarts if restarts is not None else 'unknown'} "
            f"restart(s) {causes}, "
            f"finished with {monitor}={result['best_metric']:.6g}"
            + (f" (recorded {recorded['best_metric']:.6g})" if recorded else "")
        )
    return {**result, "result_uri": f"{retrain_uri}/result.json"}, meta


_CLASSES: dict[tuple[str, ...], int] = {}


def classes_of(spec: PipelineSpec, validated: ValidatedData, store: ObjectStore) -> int:
    """`planner.count_classes` of a split, read once per process (a split's files never change: their paths carry
    `split_id`)."""
    key = (spec.target, validated.train, validated.val, validated.test)
    if key not in _CLASSES:
        _CLASSES[key] = planner.count_classes(spec, validated.model_dump(), store)
    return _CLASSES[key]


def trial_model_body(
    context: AssetExecutionContext,
    config: TrialConfig,
    spec: PipelineSpec,
    validated: ValidatedData,
    sweep: Sweep,
    store: ObjectStore,
    launcher: Launcher,
    tracking: Tracking,
    sweeps: SweepStore,
) -> Output[TrialModel]:
    """Train one trial through the launcher (or reuse its stored result) and tell the study how it went.

    A finished trial is reused as recorded, or retrained into a fresh directory
    when the run config asks for it (`retrain`, or any drill; see `TrialConfig`).
    """
    number = naming.trial_number(context.partition_key)
    trial = sweeps.trial(sweep.study, number)
    inputs = TrialInputs(
        context.partition_key, number, sweep.study, trial.params, accepts_reports=trial.state.name == "RUNNING"
    )
    output_uri = naming.run_dir(store, spec.team, spec.name, sweep.study, context.partition_key)
    record = lineage.record(
        spec, validated.md5, params=trial.params, seed=spec.model.seed, feast=read_lineage(store, spec, validated.md5)
    )
    record["max_epochs"] = config.max_epochs or spec.model.max_epochs  # run config overrides the spec
    # The capacity plan (strategy 'auto' resolved here, before any TrainSpec exists), shown for every trial.
    # The model is built by `training.describe` on a warm worker, so this run worker never imports torch to plan.
    describe = functools.partial(describe_model, warm=getattr(launcher, "warm_workers", True))
    plan = planner.plan_trial(
        spec,
        model_kwargs(spec, trial.params),
        functools.partial(classes_of, spec, validated, store),
        launcher,
        describe=describe,
    )
    record["strategy"] = plan.distribution.strategy
    resources: dict[str, Any] = {"store": store, "launcher": launcher, "tracking": tracking, "sweeps": sweeps}
    extra: dict[str, Any] = {}
    result_uri = f"{output_uri}/result.json"
    if trial.state.is_finished() and (config.retrain or config.drill()):
        result, extra = retrain_trial(
            context, config, spec, inputs, trial.state.name, validated, plan, record, output_uri, **resources
        )
        result_uri = result.pop("result_uri")
    elif trial.state.name in ("COMPLETE", "PRUNED") and store.exists(result_uri):
        context.log.info(
            f"{context.partition_key} already {trial.state.name.lower()} with these inputs; reusing its result "
            "(run config `retrain: true` trains it again)"
        )
        result = store.read_json(result_uri)
    elif trial.state.name in ("FAIL", "PRUNED"):
        raise Failure(
            description=f"{context.partition_key}: trial {number} of study {sweep.study} is {trial.state.name} "
            f"({failure_reason(trial) if trial.state.name == 'FAIL' else 'stopped early by the pruner'}) and has no "
            "result; "
            "finished trials are not trained again (the sweep asks a new trial in its place; "
            "run config `retrain: true` trains it again for debugging, without changing the study)"
        )
    else:
        changed = redefined(spec, sweep.study)
        if (
            changed is not None
        ):  # asked before the definition changed: training it now would mix two definitions in one study
            sweeps.tell(sweep.study, number, None, {"error": f"not trained: {changed}"[:2000]}, failed=True)
            raise Failure(description=f"{context.partition_key}: not trained: {changed}")
        result = train_trial(context, config, spec, inputs, validated, plan, record, output_uri, **resources)
    value = TrialModel.model_validate(
        {"trial": context.partition_key, "number": number, "params": trial.params, "result_uri": result_uri, **result}
    )
    curves = curves_metadata(store, result_uri, f"{spec.key} {context.partition_key}")
    return Output(value, metadata={**trial_metadata(spec, value, record, plan), **curves, **extra})


def best_model_body(
    context: AssetExecutionContext, spec: PipelineSpec, sweep: Sweep, sweeps: SweepStore, store: ObjectStore
) -> Output[BestModel]:
    """Pick the best finished trial (by the monitor, or from the Pareto front by `search.pick`) with its test
    metrics."""
    trials = sweeps.load(sweep.study).get_trials(deepcopy=False)
    done = [t for t in trials if t.state.name == "COMPLETE"]
    if not done:
        raise Failure(
            description=f"{spec.key}: study {sweep.study} has no completed trial; materialize trial_model partitions "
                        "first"
        )
    objectives = objectives_of(spec)
    extra: dict[str, Any] = {}
    if spec.search.multi_objective:
        front = pareto_front(trials, [o.mode for o in objectives])
        try:
            best, reason = pick_trial(front, objectives, spec.search.pick)
        except SweepError as e:
            raise Failure(description=f"{spec.key}: study {sweep.study}: {e}; relax search.pick.limits") from e
        extra = {
            "pareto_front": MetadataValue.md(trials_markdown(front, objectives, limit=len(front))),
            "pareto_size": len(front),
        }
    else:
        best = best_single_objective(done, spec.model.monitor_mode)
        reason = f"best {spec.model.monitor} ({spec.model.monitor_mode}) of {len(done)} completed trial(s)"
    result = store.read_json(best.user_attrs["result_uri"])
    value = BestModel.model_validate(
        {"study": sweep.study, "trial": naming.trial_key(best.number), "number": best.number, "params": best.params,
         "value": best.values[0], "values": list(best.values), "result_uri": best.user_attrs["result_uri"], **result}
    )
    rows = sorted(done, key=lambda t: t.values[0], reverse=objectives[0].mode == "max")
    return Output(
        value,
        metadata={
            "study": sweep.study,
            "trial": value.trial,
            spec.model.monitor: value.best_metric,
            **{f"objective_{o.metric}": float(v) for o, v in zip(objectives, best.values)},
            **{k: float(v) for k, v in value.metrics.items()},
            "completed_trials": len(done),
            "pick": reason,
            "trials": MetadataValue.md(trials_markdown_table(rows, [o.metric for o in objectives])),
            "comparison": MetadataValue.md(trial_comparison(store, rows)),
            **extra,
        },
    )
