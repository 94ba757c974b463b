"""The champion policy: a new version takes `champion` only when it beats the current one on the same test data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipelines.spec import PipelineSpec
from resources.registry import ModelRegistry

CHAMPION = "champion"


@dataclass(frozen=True)
class Decision:
    promoted: bool
    already_champion: bool
    reason: str
    new_value: float
    champion_value: float | None


def decide_promotion(
    spec: PipelineSpec, registry: ModelRegistry, version: Any, metrics: dict[str, float], test_df: Any, split_id: str
) -> Decision:
    """Compare `version` with the current champion on `test_df` and move the alias if it wins.

    The champion's score comes from its recorded metric when it was evaluated on
    the same test split; otherwise it is evaluated on this split now, so two
    versions are never compared on different data.
    """
    policy = spec.promotion
    if policy.metric not in metrics:
        raise ValueError(f"promotion.metric {policy.metric!r} is not among the trial's metrics {sorted(metrics)}")
    new_value = metrics[policy.metric]
    current = registry.get_alias(spec.model_name, CHAMPION)
    if current is not None and current.version == version.version:
        return Decision(False, True, f"version {version.version} is already {CHAMPION}", new_value, new_value)
    if current is None:
        registry.set_alias(spec.model_name, CHAMPION, version.version)
        decision = Decision(True, False, f"version {version.version} is the first of {spec.model_name}: {CHAMPION}", new_value, None)
    else:
        if current.tags.get("trainyard.test_split") == split_id and f"trainyard.metric.{policy.metric}" in current.tags:
            champ = float(current.tags[f"trainyard.metric.{policy.metric}"])
        elif policy.metric.endswith("acc"):
            champ = registry.evaluate_accuracy(current.model_uri, test_df, spec.target)
        else:
            raise ValueError(f"cannot re-evaluate champion on metric {policy.metric!r}; only accuracy metrics are supported")
        beats = new_value > champ + policy.min_improvement if policy.mode == "max" else new_value < champ - policy.min_improvement
        verdict = "beats" if beats else "does not beat"
        reason = (
            f"version {version.version} {policy.metric}={new_value:.4f} {verdict} {CHAMPION} version {current.version} "
            f"({champ:.4f}, min improvement {policy.min_improvement}) on test split {split_id}"
        )
        if beats:
            registry.set_alias(spec.model_name, CHAMPION, version.version)
        decision = Decision(beats, False, reason, new_value, champ)
    registry.set_version_tags(
        spec.model_name,
        version.version,
        {"trainyard.promotion.decision": "champion" if decision.promoted else "rejected", "trainyard.promotion.reason": decision.reason},
    )
    return decision
