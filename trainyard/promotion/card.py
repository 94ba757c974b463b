"""The model card: the MLflow version description written at registration."""

from __future__ import annotations

from typing import Any, Optional

from trainyard import lineage
from trainyard.lineage import CODE_VERSION_TAG, LOCK_HASH_TAG
from trainyard.promotion.evidence import ValidationEvidence
from trainyard.promotion.lineage_gate import CLEAN_LINEAGE_DEFAULTS, CODE_DIRTY_TAG, lineage_findings
from trainyard.promotion.records import CHAMPION
from trainyard.shardspec import ImageShards, TextShards


def model_card(
    spec: Any,
    best: dict[str, Any],
    validated: dict[str, Any],
    validation: ValidationEvidence,
    *,
    deployed_lock: Optional[str] = None,
) -> str:
    """The version description: what it is for, how it did, what data and code made it, how it was validated.

    Args:
        spec: The `PipelineSpec`.
        best: The `best_model` value (trial, study, params, metrics, lineage).
        validated: The `validated_data` value (split id, row counts).
        validation: Data validation evidence of the training data.
        deployed_lock: The deploying orchestrator's dependency lock hash (default: this process's,
        `lineage.lock_hash()`).
    """
    rec = best["lineage"]
    deployed = lineage.lock_hash() if deployed_lock is None else deployed_lock
    policy = spec.promotion
    metrics = "\n".join(f"- {k}: {v:.4f}" for k, v in sorted(best["metrics"].items()))
    rows = validated.get("rows", {})
    features = spec.features
    shown = ", ".join(features[:4]) + (f", ... ({len(features)} in all)" if len(features) > 4 else "")
    threshold = "none" if policy.threshold is None else f"{'>=' if policy.mode == 'max' else '<='} {policy.threshold}"
    return (
        f"# {spec.model_name}\n\n{spec.description or 'Trained by trainyard.'}\n\n"
        f"## Intended use\n"
        f"{_intended_use(spec, features, shown)} "
        f'Load the promoted version with `mlflow.pyfunc.load_model("models:/{spec.model_name}@{CHAMPION}")`; '
        f"it needs mlflow, torch, numpy and pandas only. Inputs outside the validated ranges of the training data "
        f"are out of scope.\n\n"
        f"## Metrics (held-out test split {validated['split_id']})\n{metrics}\n\n"
        f"## Data\n- data version (DVC md5): {rec['data_version']}\n"
        f"- rows: train {rows.get('train')}, val {rows.get('val')}, test {rows.get('test')}\n\n"
        f"## Validation\n- result: {'passed' if validation.passed else 'FAILED'}\n- {validation.detail}\n\n"
        f"## Training\n- trial: {best['trial']} of study {best['study']}\n- params: {best['params']}\n"
        f"- code: {rec['code_version']}{' (dirty)' if rec['code_dirty'] else ''}\n- dependency lock: "
        f"{rec['lock_hash']}\n"
        f"- seed {rec.get('seed')}, world size {rec.get('world_size')}, strategy {rec.get('strategy')}\n"
        f"- {_lineage_line(rec, deployed)}\n\n"
        f"## Promotion policy\n- metric: {policy.metric} ({policy.mode}), threshold: {threshold}, "
        f"must beat the champion by more than {policy.min_improvement} on the same test split\n"
        f"- it must beat the trivial baseline (baseline_{policy.metric}: the train split's prior or mean for every "
        "row)\n"
        f"- data validation must pass; a serving-only process must load it and reproduce {policy.metric} "
        f"within {policy.served_metric_tolerance}\n"
        "- clean lineage (committed code, the deployed dependency lock): "
        f"{_requirement(policy.require_clean_lineage)}\n"
    )


def _intended_use(spec: Any, features: list[str], shown: str) -> str:
    """What the model predicts from what, and what serving takes and returns."""
    shards = getattr(spec, "shards", None)
    if isinstance(shards, TextShards):
        return (
            f"A causal language model of the corpus of pipeline `{spec.key}` (vocabulary {shards.vocabulary}, context "
            f"{shards.block_size} tokens). Input: a table with one column `tokens`, a list of token ids per row (the "
            "tokenizer ships with the model as `tokenizer.json`); output: the next token's logits of each row, or "
            "with "
            f'params {{"output": "token_nll"}} each row\'s mean next-token loss.'
        )
    if isinstance(shards, ImageShards):
        shape = "x".join(str(d) for d in shards.shape)
        return (
            f"Classifies {shape} images of pipeline `{spec.key}` into {len(shards.labels)} classes. Input: a table "
            "with "
            f"one column `image`, each row's pixel values flattened in row-major order, raw ({shards.dtype}, "
            f"{shards.min:g}..{shards.max:g}); output: a table with `label` per row{_probabilities(spec)}."
        )
    return (f"Predicts `{spec.target}` from {len(features)} features ({shown}) of pipeline `{spec.key}`. "
            f"Input: a table with those columns, raw (any other columns are ignored); output: a table with "
            f"{_kept(spec)}`{spec.target}` per row{_probabilities(spec)}.")


def _kept(spec: Any) -> str:
    kept = list(getattr(spec, "keep_columns", []) or [])
    return f"the kept columns {', '.join(f'`{c}`' for c in kept)}, then " if kept else ""


def _probabilities(spec: Any) -> str:
    return (
        ", and `proba_<label>`, the probability of each class"
        if getattr(spec, "task", None) == "classification"
        else ""
    )


def _lineage_line(rec: dict[str, Any], deployed_lock: str) -> str:
    tags = {
        CODE_VERSION_TAG: str(rec.get("code_version")),
        CODE_DIRTY_TAG: str(rec.get("code_dirty")),
        LOCK_HASH_TAG: str(rec.get("lock_hash")),
    }
    findings = lineage_findings(tags, deployed_lock)
    if not findings:
        return f"lineage: clean (committed code, the deployed dependency lock {deployed_lock})"
    return "lineage WARNING: " + "; ".join(findings) + " (blocks promotion where clean lineage is required)"


def _requirement(required: Optional[bool]) -> str:
    if required is None:
        return f"the environment's default (required in {', '.join(e for e, r in CLEAN_LINEAGE_DEFAULTS.items() if r)})"
    return "required" if required else "not required (a warning)"
