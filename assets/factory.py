"""The six-asset chain every team pipeline gets, built from a `PipelineSpec`.

raw_data -> validated_data -> sweep -> trial_model[trial-NNNN] -> best_model -> registered_model

This module only wires: each definition below is a thin closure over the
pipeline's spec that calls a top-level body (`assets.data`, `assets.sweeps.sweep`,
`assets.sweeps.trials`, `assets.registration`), which a test can call directly.
Values passed between assets are the pydantic models of `trainyard.values`,
kept as JSON by `ObjectStoreJsonIOManager`; data and models live in the
object store. Names come from `trainyard.naming`.
"""

import time
from typing import Any, Iterator

from dagster import (
    AssetCheckSpec,
    AssetExecutionContext,
    AssetKey,
    AssetsDefinition,
    DynamicPartitionsDefinition,
    Output,
    asset,
)

from assets.data import CHECK_NAME, raw_data_body, validated_data_body
from assets.graph_checks import DRIFT_CHECK, with_drift_check
from assets.registration import PROMOTION_CHECK, registered_model_results
from assets.sweeps.sweep import sweep_body
from assets.sweeps.trial_handover import continue_sweep
from assets.sweeps.trials import TrialConfig, best_model_body, trial_model_body
from instance import pool_slots
from resources.handoff import HandoffPublisher
from resources.launcher import Launcher
from resources.registry import ModelRegistry
from resources.storage import ObjectStore
from resources.sweeps import SweepStore
from resources.tracking import Tracking
from resources.versioning import DataVersioning
from trainyard import naming
from trainyard.spec import PipelineSpec
from trainyard.values import BestModel, RawData, Sweep, ValidatedData

# trial_model's pool limit must hold when several runs claim a slot at once: Dagster's own claim can give one slot
# to two steps on PostgreSQL (instance/pool_slots.py). Every process that runs a trial step imports this module first.
pool_slots.install()

__all__ = ["CHECK_NAME", "TrialConfig", "asset_key", "build_assets", "trials_partitions"]


def asset_key(spec: PipelineSpec, asset_name: str) -> AssetKey:
    """The key `<team>/<pipeline>/<asset>` of one of the pipeline's assets."""
    return AssetKey(naming.asset_path(spec, asset_name))


def trials_partitions(spec: PipelineSpec) -> DynamicPartitionsDefinition:
    """The dynamic partitions of `trial_model`: one per trial, keyed `trial-NNNN`."""
    return DynamicPartitionsDefinition(name=naming.trials_partitions_name(spec))


def _data_assets(spec: PipelineSpec, common: dict[str, Any]) -> list[AssetsDefinition]:
    validated_key = asset_key(spec, naming.VALIDATED_DATA)

    @asset(
        key=asset_key(spec, naming.RAW_DATA),
        description=f"Incremental snapshot of {spec.source.prefix}/{spec.source.pattern} as canonical Parquet, pinned "
                    "with DVC.",
        **common,
    )
    def raw_data(
        context: AssetExecutionContext, store: ObjectStore, versioning: DataVersioning, launcher: Launcher
    ) -> Output[RawData]:
        # Trials follow this data (validation, then the sweep): the warm worker server imports torch and Lightning
        # meanwhile, not after the sweep has started its first trial runs (bench.sweep_throughput: the first trials
        # waited ~9 s for it when the sweep started it).
        if launcher.prestart_warm():
            context.log.info(f"{spec.key}: starting the warm worker server in the background for the trials to come")
        return raw_data_body(context, spec, store, versioning)

    @asset(
        key=validated_key,
        check_specs=[
            AssetCheckSpec(
                CHECK_NAME,
                asset=validated_key,
                blocking=True,
                description="Great Expectations suite, platform checks and drift",
            ),
            AssetCheckSpec(
                DRIFT_CHECK,
                asset=validated_key,
                description="The delivery's drift verdict: a drift or a schema change is a WARN",
            ),
        ],
        description="Great Expectations suite, platform checks and drift, then a deterministic train/val/test split.",
        **common,
    )
    def validated_data(context: AssetExecutionContext, raw_data: RawData, store: ObjectStore) -> Iterator[Any]:
        yield from with_drift_check(validated_data_body(context, spec, raw_data, store), CHECK_NAME)

    return [raw_data, validated_data]


def _sweep_assets(spec: PipelineSpec, common: dict[str, Any]) -> list[AssetsDefinition]:
    @asset(
        key=asset_key(spec, naming.SWEEP),
        description=f"Optuna study of {spec.search.n_trials} trial(s), {spec.search.window} in flight; registers them "
                    "as "
        "partitions of trial_model, starts their runs under the daemon (the sweep sensor asks the rest) and reports "
        "best "
        "parameters, history and importance.",
        **common,
    )
    def sweep(
        context: AssetExecutionContext,
        validated_data: ValidatedData,
        sweeps: SweepStore,
        store: ObjectStore,
        tracking: Tracking,
        launcher: Launcher,
    ) -> Iterator[Output[Sweep]]:
        yield from sweep_body(context, spec, validated_data, sweeps, store, tracking, launcher)

    @asset(
        key=asset_key(spec, naming.TRIAL_MODEL),
        partitions_def=trials_partitions(spec),
        pool=spec.gpu_pool,  # per-team limit on trials training at once (TeamSpec.gpu_pool_limit)
        description="One Optuna trial trained by the launcher (torchrun) from a TrainSpec.",
        **common,
    )
    def trial_model(
        context: AssetExecutionContext,
        config: TrialConfig,
        validated_data: ValidatedData,
        sweep: Sweep,
        store: ObjectStore,
        launcher: Launcher,
        tracking: Tracking,
        sweeps: SweepStore,
    ) -> Iterator[Any]:
        resources: dict[str, Any] = {"store": store, "launcher": launcher, "tracking": tracking, "sweeps": sweeps}
        trains = sweeps.trial(sweep.study, naming.trial_number(context.partition_key)).state.name == "RUNNING"
        started = time.monotonic()
        yield trial_model_body(context, config, spec, validated_data, sweep, **resources)
        # A short trial's run goes on with the sweep's next trials (SearchSpec.reuse_run_under_seconds).
        yield from continue_sweep(
            context, config, spec, validated_data, sweep, trains, time.monotonic() - started, **resources
        )

    @asset(
        key=asset_key(spec, naming.BEST_MODEL),
        deps=[trial_model],
        description="The best finished trial of the sweep, with its held-out test metrics.",
        **common,
    )
    def best_model(
        context: AssetExecutionContext, sweep: Sweep, sweeps: SweepStore, store: ObjectStore
    ) -> Output[BestModel]:
        return best_model_body(context, spec, sweep, sweeps, store)

    return [sweep, trial_model, best_model]


def _registration_asset(spec: PipelineSpec, common: dict[str, Any]) -> AssetsDefinition:
    check = (asset_key(spec, naming.VALIDATED_DATA), CHECK_NAME)

    registered_key = asset_key(spec, naming.REGISTERED_MODEL)

    @asset(
        key=registered_key,
        check_specs=[
            AssetCheckSpec(
                PROMOTION_CHECK,
                asset=registered_key,
                description="The promotion decision: a rejected version (champion not moved) is a WARN with the "
                            "failed checks",
            )
        ],
        description="An MLflow model version with lineage tags and a model card; it becomes 'challenger', and "
        "'champion' only when the pipeline's promotion policy passes (metric vs threshold and champion on the same "
        "test split, data validation, serving smoke test). Champion changes are published as handoff events.",
        **common,
    )
    def registered_model(
        context: AssetExecutionContext,
        best_model: BestModel,
        validated_data: ValidatedData,
        registry: ModelRegistry,
        store: ObjectStore,
        handoff: HandoffPublisher,
    ) -> Iterator[Any]:
        yield from registered_model_results(context, spec, best_model, validated_data, registry, store, handoff, check)

    return registered_model


def build_assets(spec: PipelineSpec) -> list[AssetsDefinition]:
    """The asset definitions of one pipeline, keyed `<team>/<pipeline>/<asset>`, in lineage order."""
    common: dict[str, Any] = {"group_name": naming.group_name(spec), "code_version": spec.fingerprint()}
    return [*_data_assets(spec, common), *_sweep_assets(spec, common), _registration_asset(spec, common)]
