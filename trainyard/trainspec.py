"""The `TrainSpec` of one trial, assembled from the pipeline, the trial and the environment.

A pure function: everything a trial's training process needs arrives as an
argument, so the contract that crosses to the pod is built and tested without
Dagster, a launcher or a study.

Configuration layers, lowest first: the platform's defaults (`TrainSpec`'s
field defaults) < the pipeline spec (`ModelSpec`, `CheckpointPolicy`, ...) <
the trial's sampled parameters (over `ModelSpec.hparams`) < the run config of
the launch (`max_epochs`, fault drills).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from training.spec import (
    DataSpec,
    Distribution,
    FaultInjection,
    ImportTarget,
    OptunaSpec,
    PrunerSpec,
    TrackerSpec,
    TrainSpec,
)
from trainyard.shardspec import TextShards
from trainyard.spec import PipelineSpec
from trainyard.values import ValidatedData


@dataclass(frozen=True)
class TrialInputs:
    """What one trial adds to its pipeline.

    Attributes:
        trial_id: The trial's partition key (`trial-0003`).
        number: The trial's number in its study.
        study: The Optuna study.
        params: The sampled hyperparameters (over `ModelSpec.hparams`).
        accepts_reports: Whether the trial still takes intermediate values; a
            finished trial trained again (its result is gone) takes none, so
            it gets no pruner.
    """

    trial_id: str
    number: int
    study: str
    params: dict[str, Any] = field(default_factory=dict)
    accepts_reports: bool = True


def model_kwargs(spec: PipelineSpec, params: dict[str, Any]) -> dict[str, Any]:
    """The model's constructor arguments: the spec's `hparams`, overridden by the trial's parameters."""
    return {**spec.model.hparams, **params}


def datamodule_kwargs(spec: PipelineSpec) -> dict[str, Any]:
    """What the pipeline tells its data module beyond the splits: a text corpus's `block_size` (tokens a sample)."""
    if isinstance(spec.shards, TextShards):
        return {"block_size": spec.shards.block_size}
    return {}


def data_spec(spec: PipelineSpec, data: ValidatedData) -> DataSpec:
    """Where the trial's splits are and what their columns are (a sharded pipeline's: its kind's input and target)."""
    if spec.shards is not None:
        return DataSpec(train_uri=data.train, val_uri=data.val, test_uri=data.test, features=spec.features,
                        target=spec.target_name, version=data.md5)
    return DataSpec(
        train_uri=data.train,
        val_uri=data.val,
        test_uri=data.test,
        features=spec.features,
        target=spec.target,
        version=data.md5,
        feature_types={c: spec.columns[c].dtype for c in spec.features},
        domains={c: list(domain) for c in spec.features
                 if (domain := spec.columns[c].domain) is not None and spec.columns[c].categorical},
        keep=spec.keep_columns,
        positive_label=spec.positive_label,
    )


def build_train_spec(
    spec: PipelineSpec,
    trial: TrialInputs,
    data: ValidatedData,
    *,
    output_uri: str,
    distribution: Distribution,
    tracker: TrackerSpec,
    optuna_storage_url: str,
    lineage: dict[str, Any],
    max_epochs: Optional[int] = None,
    faults: Optional[FaultInjection] = None,
) -> TrainSpec:
    """The `TrainSpec` of one trial (layers in the module docstring).

    Args:
        spec: The pipeline.
        trial: The trial (id, number, study, parameters).
        data: The `validated_data` value whose split the trial trains on.
        output_uri: The trial directory (`trainyard.naming.run_dir`).
        distribution: The planned distribution (strategy `auto` already resolved).
        tracker: The tracker settings of the environment.
        optuna_storage_url: The study's storage, for pruning reports. The spec
            carries it without credentials; a URL with a password is named by
            reference (`training.spec.OPTUNA_URL_ENV`), which the pod reads from
            its environment (see `OptunaSpec.connect_url`).
        lineage: The lineage record the tracker and the result carry.
        max_epochs: The run config's override of `ModelSpec.max_epochs`.
        faults: Fault drills of this launch.
    """
    return TrainSpec(
        pipeline=spec.key,
        trial_id=trial.trial_id,
        task=spec.model.task,
        prediction_task=spec.task,
        model=ImportTarget(path=spec.model.path, kwargs=model_kwargs(spec, trial.params)),
        datamodule=ImportTarget(path=spec.model.datamodule, kwargs=datamodule_kwargs(spec)),
        data=data_spec(spec, data),
        preprocessing=spec.preprocessing,
        class_weight=spec.model.class_weight,
        output_uri=output_uri,
        max_epochs=max_epochs or spec.model.max_epochs,
        batch_size=spec.model.batch_size,
        monitor=spec.model.monitor,
        faults=faults if faults is not None else FaultInjection(),
        monitor_mode=spec.model.monitor_mode,
        distribution=distribution,
        seed=spec.model.seed,
        checkpoint=spec.checkpoint,
        tracker=tracker,
        optuna=OptunaSpec.by_reference(
            optuna_storage_url,
            study_name=trial.study,
            trial_number=trial.number,
            pruner=spec.search.pruner if trial.accepts_reports else PrunerSpec(),
        ),
        lineage=lineage,
    )
