"""The `sweep` asset's body: create or resume the study, register its trials as partitions, report."""

from __future__ import annotations

from dagster import AssetExecutionContext, MetadataValue, Output

from resources.launcher import Launcher
from resources.storage import ObjectStore
from resources.sweeps import SweepStore, build_report, objectives_of, report_metadata, study_directions
from resources.tracking import Tracking
from trainyard import naming
from trainyard.spec import PipelineSpec
from trainyard.values import Sweep, ValidatedData


def sweep_body(
    context: AssetExecutionContext, spec: PipelineSpec, validated: ValidatedData, sweeps: SweepStore, store: ObjectStore, tracking: Tracking,
    launcher: Launcher,
) -> Output[Sweep]:
    """Ask the study's first trials, add them as `trial_model` partitions and report best parameters, history and importance.

    With trials left to run and a launcher that trains on this machine, its warm
    worker server starts in the background now, while the sweep sensor and the
    run queue bring the first trial run (`LocalLauncher.prestart_warm`).
    """
    name = naming.study_name(spec, validated.md5)
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
        context.log.info(f"{spec.key}: removed {len(stale)} trial partitions of an earlier study ({stale[0]} .. {stale[-1]}); study {name} has not asked them")
    report = build_report(sweeps, study, spec)
    if not report.status.done and launcher.prestart_warm():
        context.log.info(f"{spec.key}: starting the warm worker server in the background for the trials to come")
    meta = report_metadata(report, store, naming.sweep_report_dir(store, spec.team, spec.name, name), objectives_of(spec))
    if report.status.stop_reason:
        context.log.warning(f"{spec.key}: sweep {name} stopped: {report.status.stop_reason}")
    project = naming.tracker_project(spec)
    wandb = {"wandb_project": project, "wandb_group": name, "wandb_mode": tracking.resolved_mode()}
    if tracking.resolved_mode() == "online" and tracking.entity:
        wandb["wandb_url"] = MetadataValue.url(f"https://wandb.ai/{tracking.entity}/{project}/groups/{name}")
    return Output(
        Sweep(study=name, trials=keys, data_md5=validated.md5),
        metadata={"study": name, "storage": sweeps.shown_url(), "trials": len(keys), "new_partitions": len(new), "removed_partitions": len(stale), **meta, **wandb},
    )
