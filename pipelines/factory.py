"""Turn declarative `PipelineSpec`s into Dagster `Definitions`."""

from __future__ import annotations

from typing import Any, Optional

from dagster import AssetSelection, Definitions, define_asset_job

from assets.factory import asset_key, build_assets, trials_partitions
from instance.storage_connections import trainyard_executor
from pipelines.environments import resources_for
from pipelines.landing_sensor import build_landing_sensor
from pipelines.retrain import build_drift_sensor, build_retrain_schedule, prepare_selection
from pipelines.sensors import sweep_sensor
from trainyard import naming
from trainyard.naming import job_names
from trainyard.spec import PipelineSpec

__all__ = ["build_definitions", "job_names"]


def build_definitions(*specs: PipelineSpec, resources: Optional[dict[str, Any]] = None) -> Definitions:
    """All assets and jobs of the given pipelines, with the environment's resources.

    Jobs per pipeline: `prepare` (raw_data, validated_data, sweep), `train`
    (one trial_model partition per run) and `promote` (best_model,
    registered_model). Sensors per pipeline: `<team>__<name>__landing`
    (new landing files -> `prepare`, see `pipelines.landing_sensor`) and
    `<team>__<name>__sweep` (carries a `raw_data` materialized alone through
    the rest of `prepare`, keeps `search.parallelism` trials in flight, then
    starts `promote` once per finished study, see `pipelines.sensors`); both
    run from the start unless `RetrainPolicy.automatic` is off. Every `train` run is tagged `trainyard/team=<team>`,
    the key of the per-team run limit in `dagster.yaml`. The pipeline's
    `RetrainPolicy` adds the schedule `<team>__<name>__retrain` (cron) and the
    sensor `<team>__<name>__drift` (drift against the champion's data), see
    `pipelines.retrain`; without `on_new_data` there is no landing sensor.
    A team module builds them with `pipelines.team.team_definitions`.

    Every job, and every materialization started from the UI, runs its steps in
    the run worker's process (Dagster's in-process executor, as `trainyard_executor`, which also keeps the run
    worker's PostgreSQL connections open, see `instance.storage_connections`): the steps of each job run
    one after the other anyway (prepare and promote are chains, a train run is
    one step), and Dagster's default multiprocess executor would start a fresh
    process per step that imports the code location again (5 s per step in
    `gbt_overhead`). Trials still train in their own processes or pods.
    """
    seen: set[str] = set()
    assets: list[Any] = []
    jobs: list[Any] = []
    sensors: list[Any] = []
    schedules: list[Any] = []
    for spec in specs:
        if spec.key in seen:
            raise ValueError(f"pipeline {spec.key!r} is defined twice")
        seen.add(spec.key)
        assets += build_assets(spec)
        names = job_names(spec)
        keys = {n: asset_key(spec, n) for n in naming.ASSETS}
        prepare = define_asset_job(
            names["prepare"],
            selection=AssetSelection.assets(*(keys[n] for n in (naming.RAW_DATA, naming.VALIDATED_DATA, naming.SWEEP))),
        )
        train = define_asset_job(
            names["train"],
            selection=AssetSelection.assets(keys[naming.TRIAL_MODEL]),
            partitions_def=trials_partitions(spec),
            tags={naming.TEAM_TAG: spec.team},
        )
        promote = define_asset_job(
            names["promote"], selection=AssetSelection.assets(keys[naming.BEST_MODEL], keys[naming.REGISTERED_MODEL])
        )
        jobs += [prepare, train, promote]
        policy = spec.retrain_policy
        gated = policy.drift_psi is not None
        if policy.on_new_data:
            sensors.append(
                build_landing_sensor(spec, names["prepare"], asset_selection=prepare_selection(spec) if gated else None)
            )
        sensors.append(sweep_sensor(spec, train, prepare, promote if policy.automatic else None))
        if gated:
            sensors.append(build_drift_sensor(spec, names["prepare"]))
        if policy.cron is not None:
            schedules.append(build_retrain_schedule(spec, names["prepare"]))
    return Definitions(
        assets=assets,
        jobs=jobs,
        sensors=sensors,
        schedules=schedules,
        resources=resources if resources is not None else resources_for(),
        executor=trainyard_executor,
    )
