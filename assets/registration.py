"""The `registered_model` asset's body: register the best trial with its lineage, then apply the promotion policy."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetExecutionContext,
    AssetKey,
    Failure,
    MetadataValue,
    Output,
)

from resources.handoff import HandoffPublisher
from resources.registry import ModelRegistry, promotion
from resources.storage import ObjectStore
from trainyard import promotion as policy
from trainyard import shard_samples
from trainyard.data.feast import read_lineage
from trainyard.feast_source import FeastSourceSpec
from trainyard.lineage import (
    FEAST_MODEL_METADATA_KEY,
    LineageError,
    LineageRecord,
    feast_card,
    feast_fields,
    feast_serving,
)
from trainyard.promotion.served import LM_PARAMS
from trainyard.shardspec import ImageShards, TextShards
from trainyard.spec import PipelineSpec
from trainyard.values import BestModel, RegisteredModel, ValidatedData

PROMOTION_CHECK = "promotion"
"""The asset check on `registered_model` that tells the decision on the lineage graph (`promotion_check`)."""


def registered_model_results(
    context: AssetExecutionContext,
    spec: PipelineSpec,
    best: BestModel,
    validated: ValidatedData,
    registry: ModelRegistry,
    store: ObjectStore,
    handoff: HandoffPublisher,
    check: tuple[AssetKey, str],
) -> Iterator[Any]:
    """Register `best` (idempotent per trial), decide on `champion`, then yield the `promotion` asset check of the
    decision.

    A model trained on a Feast source carries the retrieval's lineage in its
    tags and card, and in its MLflow model's metadata (`feast`: each input
    column's feature reference, the feature service, the entity keys) so that
    serving knows which online features to fetch.

    Args:
        check: The `validated_data` asset key and its check's name: the evidence that the data was validated.
    """
    metrics = {k: float(v) for k, v in best.metrics.items()}
    if spec.promotion.metric not in metrics:
        raise Failure(
            description=f"{spec.key}: promotion.metric {spec.promotion.metric!r} is not among the trial's metrics "
            f"{sorted(metrics)}; declare one of them in PromotionSpec(metric=...)"
        )
    served = served_test(spec, validated, store)
    test_df, kept = served.frame, served.kept
    validation = promotion.validation_evidence(
        context.instance, check[0], check[1], validated.md5, policy.is_quarantined(store, spec.key, validated.md5),
    )
    record = best.lineage
    features = read_lineage(store, spec, validated.md5)  # None unless the source is a feature store
    # From the data version's own lineage, also for trials recorded before their record carried it.
    feast = {"feast": feast_fields(features)} if features is not None else {}
    tags = LineageRecord.from_config(
        record, trial=best.trial, study=best.study, checkpoint_uri=str(best.checkpoint_uri),
        tracker_run=str(best.tracker_run or ""), test_split=validated.split_id, test_uri=validated.test,
        target=spec.target_name, promotion_policy=spec.promotion.model_dump_json(), metrics=metrics,
        **validation.lineage_fields(), **feast,
    ).to_tags()
    if spec.positive_label is not None:
        tags[policy.POSITIVE_LABEL_TAG] = json.dumps(spec.positive_label)
    card = policy.model_card(spec, best.model_dump(mode="json"), validated.model_dump(mode="json"), validation)
    model_metadata = None
    if features is not None:
        card += feast_card(features)
        model_metadata = {FEAST_MODEL_METADATA_KEY: serving_features(spec, features)}
    version = registry.register(
        spec.model_name,
        best.model_uri,
        trial_key=f"{best.study}/{best.trial}",
        tags=tags,
        metrics=metrics,
        description=card,
        input_example=served.example,
        params_example=served.example_params,
        model_metadata=model_metadata,
    )
    candidate = policy.Candidate(
        version=version, policy=spec.promotion, metrics=metrics, split_id=validated.split_id,
        test_df=test_df[[*kept, *spec.features, served.target]], target=served.target, validation=validation,
        positive_label=spec.positive_label, params=served.params, sample_note=served.note,
    )
    decision = promotion.decide(
        registry, handoff, candidate, action="register", decided_by=f"dagster run {context.run_id}"
    )
    context.log.info(f"{spec.model_name} v{version.version}: {decision.outcome}: {decision.reason}")
    value = RegisteredModel(
        name=spec.model_name, version=version.version, model_uri=version.model_uri, champion=decision.champion,
        created=version.created, decision=decision.outcome, **metrics,
    )
    yield Output(
        value,
        metadata={
            "model": spec.model_name,
            "version": version.version,
            "model_uri": version.model_uri,
            "new_version": version.created,
            **promotion.decision_metadata(decision),
            **metrics,
            "data_version": record.get("data_version", ""),
            "code_version": record.get("code_version", ""),
            "validation": validation.detail,
        },
    )
    yield promotion_check(decision)


@dataclass(frozen=True)
class ServedTest:
    """The test split as the promotion serves it (see `served_test`).

    Attributes:
        frame: The rows: the model's input columns and `target`.
        target: The column served predictions are scored against.
        kept: Id and timestamp columns sent along and returned beside predictions.
        example: The input example logged with the model (a few rows of its input columns).
        example_params: The predict params logged with the example, so the signature declares them (None: none).
        params: The predict params the test rows are served with (None: none).
        note: Set when `frame` is a part of the test split.
    """

    frame: Any
    target: str
    kept: list[str]
    example: Any
    example_params: Optional[dict[str, Any]] = None
    params: Optional[dict[str, Any]] = None
    note: Optional[str] = None


def served_test(spec: PipelineSpec, validated: ValidatedData, store: ObjectStore) -> ServedTest:
    """What registration logs as the input example and what the promotion serves: the test split's rows.

    A table: its rows as they are. A text corpus: its test token blocks, served with `{"output": "token_nll"}`
    (the example: a few blocks' first `block_size` tokens, asking for next-token logits). An image set: its images.
    """
    import pandas as pd

    if isinstance(spec.shards, TextShards):
        sample = shard_samples.text_sample(store, validated.test, spec.shards.block_size)
        if sample.frame.empty:
            raise Failure(
                description=f"{spec.key}: the test split {validated.test} holds no block of "
                f"{spec.shards.block_size + 1} tokens to serve; land more text or lower TextShards.block_size"
            )
        example = pd.DataFrame({"tokens": [row[: spec.shards.block_size] for row in sample.frame["tokens"].head(3)]})
        return ServedTest(
            sample.frame, sample.target, [], example, {"output": "next_token_logits"}, dict(LM_PARAMS), sample.note
        )
    if isinstance(spec.shards, ImageShards):
        sample = shard_samples.image_sample(store, validated.test)
        if sample.frame.empty:
            raise Failure(description=f"{spec.key}: the test split {validated.test} holds no image to serve")
        return ServedTest(sample.frame, sample.target, [], sample.frame[["image"]].head(5), note=sample.note)
    with store.open(validated.test, "rb") as f:
        test_df = pd.read_parquet(f)
    kept = [
        c for c in spec.keep_columns if c in test_df.columns
    ]  # ids and timestamps: sent to serving, returned beside predictions
    return ServedTest(test_df, spec.target, kept, test_df[[*kept, *spec.features]].head(5))


def serving_features(spec: PipelineSpec, lineage: dict[str, Any]) -> dict[str, Any]:
    """`feast_serving` of the pipeline's model inputs: each feature column's reference, the service, the entity keys.

    Raises:
        Failure: The source is not a Feast source, or a model input has no feature reference.
    """
    if not isinstance(spec.source, FeastSourceSpec):
        raise Failure(
            description=f"{spec.key}: data version has Feast lineage but the source is {type(spec.source).__name__}, "
                        "not a FeastSourceSpec"
        )
    try:
        return feast_serving(lineage, spec.features, list(spec.source.keys))
    except LineageError as e:
        raise Failure(description=f"{spec.key}: {e}") from e


def promotion_check(decision: policy.Decision) -> AssetCheckResult:
    """The decision as an asset check: passes when the version holds `champion`; a rejected one is a WARN with the
    failed checks.

    A rejected retrain leaves the champion where it was, which is the policy
    working, not a failed run: the run stays green and the graph shows the
    warning, with the failed checks as the reason.
    """
    failed = [c for c in decision.checks if not c.passed]
    meta: dict[str, Any] = {
        "decision": decision.outcome,
        "version": decision.version,
        "champion_before": decision.champion_before or "",
        "reason": decision.reason,
        "failed_checks": ", ".join(c.name for c in failed),
    }
    if decision.override:
        meta["override_reason"] = decision.override_reason or ""
    if failed:
        meta["failed"] = MetadataValue.md("\n".join(f"- **{c.name}**: {c.detail}" for c in failed))
    return AssetCheckResult(
        check_name=PROMOTION_CHECK,
        passed=decision.champion,
        severity=AssetCheckSeverity.WARN,
        metadata=meta,
        description=decision.reason[:1000],
    )
