"""A trial run that hands on: it goes on with the sweep's next trials while they stay short, or starts the next trial's
run as it ends.

Split from `assets.sweeps.trials` (the trial's own body, which both use): how a run
started by the sweep sensor keeps a sweep's slots busy without waiting for the
sensor's next tick. `continue_sweep` trains the next trials in the same run
(`SearchSpec.reuse_run_under_seconds`, as Ray Tune reuses an actor);
`start_successor` starts the run of the next trial as a run whose last trial
was long ends. docs/sweeps.md has both.
"""

from __future__ import annotations

import time
from typing import Any, Iterator, Optional

from dagster import AssetExecutionContext, AssetMaterialization, DagsterRun, Failure, PartitionKeyRange, RetryRequested

from assets.sweeps.trials import TrialConfig, trial_model_body
from resources.io_manager import ObjectStoreJsonIOManager
from resources.launcher import Launcher
from resources.storage import ObjectStore
from resources.sweeps import SweepStore
from resources.sweeps.trial_runs import (
    IN_PROCESS,
    SUCCESSOR_TRIGGER,
    create_trial_run,
    discard_runs,
    from_code_location,
    why_not_start,
)
from resources.tracking import Tracking
from trainyard import naming
from trainyard.naming import STUDY_TAG
from trainyard.spec import PipelineSpec
from trainyard.values import Sweep, ValidatedData

REUSED_RUN_TAG = "trainyard/also_trained"  # on a trial run that went on with the sweep: the other trials it trained


class TrialContext:
    """A trial run's asset context, lent to the next trial the run goes on with (`continue_sweep`).

    Everything is the run's own context except the partition (the trial's
    key: what Pipes hands the training processes, what its progress
    observations and messages name) and the retry count, which starts at 0
    for each trial the run takes on.
    """

    has_partition_key = True

    def __init__(self, context: AssetExecutionContext, partition_key: str) -> None:
        self._context = context
        self.partition_key = partition_key
        self.retry_number = 0

    @property
    def partition_key_range(self) -> PartitionKeyRange:
        return PartitionKeyRange(self.partition_key, self.partition_key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


def _may_hand_on(
    context: AssetExecutionContext, config: TrialConfig, spec: PipelineSpec, sweep: Sweep, trained: bool
) -> Optional[str]:
    """Why this trial run may neither go on with the sweep nor start its successor, whatever its trial took; None when
    it may."""
    if spec.search.reuse_run_under_seconds <= 0:
        return "reuse_run_under_seconds is 0"
    if context.run.tags.get(STUDY_TAG) != sweep.study:
        return "the run was not started by the sweep sensor for this study"
    if config.retrain or config.drill() or config.max_epochs is not None:
        return "the run config retrains, drills or overrides max_epochs"
    if not trained:
        return "the run trained no trial (its result was reused, or a retrain)"
    return None


def goes_on(
    context: AssetExecutionContext, config: TrialConfig, spec: PipelineSpec, sweep: Sweep, trained: bool, seconds: float
) -> Optional[str]:
    """Why this trial run does not go on with the sweep's next trial, or None when it does
    (`SearchSpec.reuse_run_under_seconds`)."""
    why = _may_hand_on(context, config, spec, sweep, trained)
    if why is None and seconds >= spec.search.reuse_run_under_seconds:
        return f"its trial took {seconds:.1f} s (reuse_run_under_seconds {spec.search.reuse_run_under_seconds:g})"
    return why


def continue_sweep(
    context: AssetExecutionContext,
    config: TrialConfig,
    spec: PipelineSpec,
    validated: ValidatedData,
    sweep: Sweep,
    trained: bool,
    seconds: float,
    *,
    store: ObjectStore,
    launcher: Launcher,
    tracking: Tracking,
    sweeps: SweepStore,
) -> Iterator[AssetMaterialization]:
    """Train the sweep's next trials in this run while they stay short and the sweep has a slot and a trial left.

    Each is asked claimed by this run (`SweepStore.ask_claimed`: the sweep
    sensor counts it in flight and starts no run for it), added as a
    partition, trained exactly as a run of its own would train it (heartbeat,
    launch, retries of infrastructure failures within the pipeline's budget,
    the study told), and recorded as that partition's materialization with
    the same metadata and stored value. A trial that fails is told to the
    study as failed (as in a run of its own) and ends the run's going on: the
    sensor asks its replacement.

    Args:
        trained: whether the run trained its own trial (not a reused result, not a retrain).
        seconds: how long the run's own trial took (the first test of `reuse_run_under_seconds`).
    """
    why = _may_hand_on(context, config, spec, sweep, trained)
    if why is not None:
        context.log.debug(f"{context.partition_key}: not going on with the sweep: {why}")
        return
    partitions = naming.trials_partitions_name(spec)
    io_manager = getattr(context.resources, "io_manager", None)
    also: list[str] = []
    while seconds < spec.search.reuse_run_under_seconds:
        number = sweeps.ask_claimed(sweeps.load(sweep.study, spec.search), spec.search, context.run_id)
        if number is None:
            break
        key = naming.trial_key(number)
        context.instance.add_dynamic_partitions(partitions, [key])
        context.log.info(f"{context.partition_key}'s run goes on with {key} (its last trial took {seconds:.1f} s)")
        view = TrialContext(context, key)
        started = time.monotonic()
        try:
            while True:
                try:
                    output = trial_model_body(view, config, spec, validated, sweep, store, launcher, tracking, sweeps)  # type: ignore[arg-type]
                    break
                except RetryRequested as retry:
                    view.retry_number += 1
                    time.sleep(retry.seconds_to_wait or 0)
        except Failure as failure:
            context.log.warning(
                f"{key} failed in {context.partition_key}'s run: {failure.description}; the run stops going on with "
                "the sweep"
            )
            break
        seconds = time.monotonic() - started
        if isinstance(io_manager, ObjectStoreJsonIOManager):
            io_manager.write_value(context.asset_key, key, output.value)
        else:
            context.log.warning(
                f"{key}: the io_manager is a {type(io_manager).__name__}, not the platform's; its value is kept only "
                "in the study and "
                "its result files, so an asset that takes trial_model as input cannot load this partition"
            )
        yield AssetMaterialization(
            asset_key=context.asset_key,
            partition=key,
            metadata={**output.metadata, "trained_in_run_of": context.partition_key},
        )
        also.append(key)
    else:
        # the last trial took too long to go on with another: this run ends, and starts the run of the sweep's next
        # trial
        start_successor(context, spec, sweep, sweeps, seconds)
    if also:
        shown = ",".join(also) if len(also) <= 10 else f"{also[0]}..{also[-1]} ({len(also)})"
        context.instance.add_run_tags(context.run_id, {REUSED_RUN_TAG: shown})
        context.log.info(
            f"{context.partition_key}'s run also trained {len(also)} more trial(s) of study {sweep.study}: {shown}"
        )


def successor_blocked(context: AssetExecutionContext, spec: PipelineSpec) -> Optional[str]:
    """Why this trial run leaves its successor's run to the sweep sensor (`why_not_start`), or None when it may start
    it."""
    if not from_code_location(context.dagster_run):
        return IN_PROCESS
    try:
        return why_not_start(
            context.instance, context.dagster_run, context.repository_def, naming.sweep_sensor_name(spec)
        )
    except Exception as e:  # the sensor starts it at its next tick
        return f"could not tell whether it may ({type(e).__name__}: {e})"


def start_successor(
    context: AssetExecutionContext, spec: PipelineSpec, sweep: Sweep, sweeps: SweepStore, seconds: float
) -> Optional[str]:
    """Start the run of the sweep's next trial as this trial run ends after a long trial; its run id, or None when left
    to the sensor.

    Without it the slot this run frees waits for the sweep sensor's next tick
    (0-10 s) before a run is even requested. The trial is asked claimed by
    this run (`SweepStore.ask_claimed`: within the window and budget, under
    the study's lock, so a tick at the same moment neither takes the slot
    too nor requests a run for the trial), then its partition is added and
    its run created exactly as the sensor's request would make it (tags, run
    key; `trainyard/trigger=trial run ended`) and submitted to the run queue.
    Started only where the `sweep` asset would start the first window's runs
    (`why_not_start`: a run from a code location, a run queue, the sweep
    sensor on, a sensor daemon alive), so whatever is left undone, the sensor
    does. What may go wrong loses nothing:

    - nothing to ask (window full, budget spent, stopped, a sampler whose
      draw cannot be made apart from its ask): the sensor goes on as before;
    - the run cannot be made or enqueued: the run made is deleted and the
      trial, which never trained, is told failed with the reason, so the
      sensor asks another in its place (releasing the claim would not do:
      the sensor's cursor has passed the claimed trial, which would then sit
      in flight with no run);
    - this run dies between the ask and the submit: the sensor fails the
      trial it claimed (`_fail_untold`: a run that ended badly, and no
      active run trains the trial) and asks another in its place. Once the
      successor exists, the claim is harmless: a run that ends badly fails
      only trials that no active run trains.
    """
    run = context.dagster_run
    why = successor_blocked(context, spec)
    if why is not None:  # in process (`trainyard demo`, tests) there is no sensor to start it either: nothing to tell
        log = context.log.debug if why == IN_PROCESS else context.log.info
        log(
            f"{context.partition_key}: not starting the next trial's run: {why}; the sweep sensor starts it at its "
            "next tick"
        )
        return None
    number = sweeps.ask_claimed(sweeps.load(sweep.study, spec.search), spec.search, run.run_id)
    if number is None:
        context.log.debug(
            f"{context.partition_key}: the sweep has no slot or trial for this run to start (or its sampler asks only "
            "in the sensor)"
        )
        return None
    key = naming.trial_key(number)
    created: Optional[DagsterRun] = None
    try:
        context.instance.add_dynamic_partitions(naming.trials_partitions_name(spec), [key])
        job = context.repository_def.get_job(naming.job_names(spec)["train"])
        created = create_trial_run(context.instance, run, job, spec, sweep.study, key, trigger=SUCCESSOR_TRIGGER)
        context.instance.submit_run(created.run_id, workspace=None)  # the run queue only enqueues: no workspace needed
    except Exception as e:
        if created is not None:
            discard_runs(context.instance, [created], context.log)
        why = f"run {run.run_id} could not start its run ({type(e).__name__}: {e})"
        sweeps.tell(
            sweep.study, number, None, {"error": why}, failed=True
        )  # it never trained: the sensor asks another in its place
        context.log.warning(
            f"{context.partition_key}: could not start the run of {key}, the sweep's next trial ({type(e).__name__}: "
            f"{e}); "
            f"{key} is failed untrained and the sweep sensor asks another trial in its place at its next tick"
        )
        return None
    context.log.info(
        f"{context.partition_key}: the last trial this run trained took {seconds:.1f} s (reuse_run_under_seconds "
        f"{spec.search.reuse_run_under_seconds:g}): this run ends and started run {created.run_id} for {key}, the "
        "sweep's next trial"
    )
    return created.run_id
