"""The `sweep` asset's body: create or resume the study, register its trials as partitions, start their runs, report.

Under the daemon with the pipeline's sweep sensor on, the asset starts the
first window's trial runs itself rather than leaving them to the sensor's next
tick (2-10 s later): the runs that tick would request (`resources.sweeps.trial_runs`:
asked, unfinished, unclaimed trials no run trains, within the window and the
team's free run slots), tagged as the sensor's with their run keys. They are
created (NOT_STARTED) before the output, so the sensor counts them in flight
and the daemon's run-key check drops a repeat, and enqueued once the output is
stored, so no trial run reads the previous `sweep` value. In process
(`trainyard demo`, tests), without a run queue, with the sensor stopped or no
sensor daemon alive, it starts none and its log says why; nor does a failure to
start them fail the asset: a warning names it, and the sensor starts them.
"""

from __future__ import annotations

from typing import Any, Iterator

from dagster import AssetExecutionContext, DagsterRun, Failure, MetadataValue, Output

from resources.launcher import Launcher
from resources.storage import ObjectStore
from resources.sweeps import SweepStore, build_report, inert_pruner, objectives_of, report_metadata, study_directions
from resources.sweeps.trial_runs import (
    IN_PROCESS,
    PARTITION_TAG,
    create_trial_run,
    discard_runs,
    from_code_location,
    trials_to_start,
    why_not_start,
)
from resources.tracking import Tracking
from trainyard import naming
from trainyard.spec import PipelineSpec
from trainyard.values import Sweep, ValidatedData


def sweep_body(
    context: AssetExecutionContext,
    spec: PipelineSpec,
    validated: ValidatedData,
    sweeps: SweepStore,
    store: ObjectStore,
    tracking: Tracking,
    launcher: Launcher,
) -> Iterator[Output[Sweep]]:
    """Ask the study's first trials, add them as `trial_model` partitions, start their runs and report best parameters,
    history and importance.

    First `preflight`: what would fail every trial with a configuration error fails
    the asset instead, naming the columns, before a study or a trial exists.

    Trial runs: see the module docstring; metadata `started_trial_runs` counts
    those created, enqueued right after the output (a run the queue refuses is
    named in a warning and discarded). With trials left to run and a launcher that trains on this machine,
    its warm worker server starts in the background now, while the run queue
    brings the first trial run (`LocalLauncher.prestart_warm`).
    """
    name = naming.study_name(spec, validated.md5)
    problems = preflight(spec, validated, store)
    if problems:  # every trial would exit 78 on these: no study, no trial
        raise Failure(description=f"{spec.key}: the sweep cannot train: " + "; ".join(problems))
    study = sweeps.load_or_create(name, study_directions(spec), spec.search)
    keys = [naming.trial_key(n) for n in sweeps.ensure_trials(study, spec.search)]
    partitions = naming.trials_partitions_name(spec)
    existing = set(context.instance.get_dynamic_partitions(partitions))
    new = [k for k in keys if k not in existing]
    if new:
        context.instance.add_dynamic_partitions(partitions, new)
    # The partitions are the trials of the current study: keys an earlier study asked
    # beyond this one's trials would stay red (or green) in the UI with another study's
    # outcome. Their materializations stay in the event log, naming their study.
    ours = {naming.trial_key(t.number) for t in study.get_trials(deepcopy=False)}
    stale = sorted(existing - ours)
    for key in stale:
        context.instance.delete_dynamic_partition(partitions, key)
    if stale:
        context.log.info(
            f"{spec.key}: removed {len(stale)} trial partitions of an earlier study ({stale[0]} .. {stale[-1]}); "
            f"study {name} has not asked them"
        )
    report = build_report(sweeps, study, spec)
    if not report.status.done and launcher.prestart_warm():
        context.log.info(f"{spec.key}: starting the warm worker server in the background for the trials to come")
    meta = report_metadata(
        report, store, naming.sweep_report_dir(store, spec.team, spec.name, name), objectives_of(spec)
    )
    if report.status.stop_reason:
        context.log.warning(f"{spec.key}: sweep {name} stopped: {report.status.stop_reason}")
    pruning = inert_pruner(spec.search)
    if pruning:
        context.log.warning(f"{spec.key}: {pruning}")
    project = naming.tracker_project(spec)
    wandb: dict[str, Any] = {"wandb_project": project, "wandb_group": name, "wandb_mode": tracking.resolved_mode()}
    if tracking.resolved_mode() == "online" and tracking.entity:
        wandb["wandb_url"] = MetadataValue.url(f"https://wandb.ai/{tracking.entity}/{project}/groups/{name}")
    runs = _create_trial_runs(context, spec, name, study.get_trials(deepcopy=False)) if not report.status.done else []
    stored = False
    try:
        yield Output(
            Sweep(study=name, trials=keys, data_md5=validated.md5),
            metadata={
                "study": name,
                "storage": sweeps.shown_url(),
                "trials": len(keys),
                "new_partitions": len(new),
                "removed_partitions": len(stale),
                "started_trial_runs": len(runs),
                **meta,
                **({"pruner_inert": pruning} if pruning else {}),
                **wandb,
            },
        )
        stored = True
    finally:
        if (
            runs and not stored
        ):  # the output failed: no run made here may wait NOT_STARTED, holding its trial and a team slot
            discard_runs(context.instance, runs, context.log)
    _enqueue(context, spec, runs)


NON_NUMERIC = ("str", "category", "date", "datetime")


def preflight(spec: PipelineSpec, validated: ValidatedData, store: ObjectStore) -> list[str]:
    """What fails every trial of this definition on this data, found before the study asks one (empty: nothing found).

    With the platform's preprocessing off (`PipelineSpec.preprocessing.enabled=False`)
    the model gets the raw columns as numbers: a text, category or date feature,
    or a missing value in the train split (Parquet statistics, no data read),
    would stop each trial with a configuration error.
    """
    if spec.preprocessing.enabled:
        return []
    problems = [
        f"feature {c!r} is declared {spec.columns[c].dtype!r}, and preprocessing is off "
        "(PipelineSpec.preprocessing.enabled=False): "
        "the model takes numbers only; turn preprocessing on or drop the column"
        for c in spec.features
        if spec.columns[c].dtype in NON_NUMERIC
    ]
    numeric = [c for c in spec.features if spec.columns[c].dtype not in NON_NUMERIC]
    try:
        import pyarrow.parquet as pq

        with store.open(validated.train, "rb") as f:
            meta = pq.ParquetFile(f).metadata
        nulls = dict.fromkeys(numeric, 0)
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            for i in range(group.num_columns):
                chunk = group.column(i)
                name = chunk.path_in_schema
                if name in nulls and chunk.statistics is not None and chunk.statistics.has_null_count:
                    nulls[name] += chunk.statistics.null_count
    except Exception:  # statistics are a shortcut, not a requirement: the pod names the column if it comes to that
        return problems
    problems += [
        f"feature {c!r} has {n} missing value(s) in the train split, and preprocessing is off: the model cannot take "
        "NaN; "
        "turn preprocessing on (it imputes) or fill the column"
        for c, n in nulls.items()
        if n
    ]
    return problems


def _create_trial_runs(
    context: AssetExecutionContext, spec: PipelineSpec, study: str, trials: list[Any]
) -> list[DagsterRun]:
    """Create (NOT_STARTED) the trial runs the sweep sensor's next tick would request, when this run may start them
    (`why_not_start`)."""
    if not from_code_location(context.dagster_run):  # in process there is no repository definition to look at either
        context.log.debug(f"{spec.key}: not starting trial runs: {IN_PROCESS}")
        return []
    runs: list[DagsterRun] = []
    try:
        why = why_not_start(
            context.instance, context.dagster_run, context.repository_def, naming.sweep_sensor_name(spec)
        )
        if why is not None:
            context.log.info(f"{spec.key}: not starting trial runs: {why}")
            return []
        train = naming.job_names(spec)["train"]
        keys, note = trials_to_start(context.instance, spec, study, trials, train)
        job = context.repository_def.get_job(train)
        for key in keys:
            runs.append(create_trial_run(context.instance, context.dagster_run, job, spec, study, key))
    except Exception as e:  # the sweep stands and the sweep sensor requests these trials at its next tick
        context.log.warning(
            f"{spec.key}: could not create the trial runs of study {study} ({type(e).__name__}: {e}); "
            f"the sweep sensor requests them at its next tick"
            + (f"; the {len(runs)} created before it start now" if runs else "")
        )
        return runs
    context.log.info(
        f"{spec.key}: created {len(runs)} trial run(s) of study {study} ({note}); they are enqueued once the sweep is "
        "stored"
    )
    return runs


def _enqueue(context: AssetExecutionContext, spec: PipelineSpec, runs: list[DagsterRun]) -> None:
    """Submit the created runs to the run queue; on a failure, discard those not enqueued (the sweep sensor requests
    their trials)."""
    started: list[DagsterRun] = []
    try:
        for run in runs:
            context.instance.submit_run(run.run_id, workspace=None)  # the run queue only enqueues: no workspace needed
            started.append(run)
    except Exception as e:  # the sweep stands and the sweep sensor requests these trials at its next tick
        left = runs[len(started):]
        context.log.warning(
            f"{spec.key}: could not enqueue trial run {left[0].run_id} ({type(e).__name__}: {e}); discarding the "
            f"{len(left)} not enqueued ({', '.join(_partition(r) for r in left)}): the sweep sensor requests them at "
            "its next tick"
        )
        discard_runs(context.instance, left, context.log)
    if started:
        context.log.info(
            f"{spec.key}: started {len(started)} trial run(s): "
            + ", ".join(f"{_partition(r)} {r.run_id}" for r in started)
        )


def _partition(run: DagsterRun) -> str:
    return run.tags.get(PARTITION_TAG, "?")
