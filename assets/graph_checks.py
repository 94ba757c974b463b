"""Asset checks that put a state on the lineage graph which a green materialization would hide.

- `drift` on `validated_data`: the data side's drift verdict of the version
  (`trainyard.data.drift_detection.drift_verdict`, recorded in the expectations
  check's metadata as `drift_verdict`, `drift_summary`, `schema_change`) as its
  own check: a drifted delivery or a schema change is a WARN, with the reason,
  even when the `on_drift` policy let the version through;
- `promotion` on `registered_model` (`assets.registration.promotion_check`): a
  rejected retrain, champion not moved, is a WARN with the failed checks.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

from dagster import AssetCheckResult, AssetCheckSeverity, MetadataValue

DRIFT_CHECK = "drift"
"""The asset check on `validated_data` that tells the drift verdict (`with_drift_check`)."""


def accepted_check(context: Any, key: str, check_name: str, meta: dict[str, Any], verdict: Any) -> AssetCheckResult:
    """The passed expectations check of an accepted version (a table's or a shard set's): the verdict's warnings
    logged and listed, a release by `trainyard data release` recorded with who and why."""
    for line in verdict.warnings:
        context.log.warning(f"{key}: {line}")
    if verdict.warnings:
        meta["warnings"] = MetadataValue.md("\n".join(f"- {w}" for w in verdict.warnings))
    if verdict.release:
        meta["released_by"] = verdict.release["released_by"]
        meta["release_reason"] = verdict.release["reason"]
    return AssetCheckResult(check_name=check_name, passed=True, metadata=meta)


def drift_check(expectations: AssetCheckResult) -> AssetCheckResult:
    """The `drift` check of the version the expectations check judged, from that check's metadata."""
    meta = {k: getattr(v, "value", v) for k, v in (expectations.metadata or {}).items()}
    level = meta.get("drift_verdict")
    if level is None:
        return AssetCheckResult(check_name=DRIFT_CHECK, passed=True, metadata={"drift_verdict": "unknown"},
                                description="the expectations check recorded no drift verdict")
    schema = str(meta.get("schema_change") or "")
    summary = str(meta.get("drift_summary") or level)
    passed = level != "drifted" and not schema
    out: dict[str, Any] = {
        "drift_verdict": str(level),
        "drift_summary": summary,
        "drift_scope": str(meta.get("drift_scope", "none")),
    }
    if schema:
        out["schema_change"] = schema
    for key in ("max_psi", "max_ks"):
        if meta.get(key) is not None:
            out[key] = float(meta[key])  # type: ignore[arg-type]  # a float the check stored
    return AssetCheckResult(check_name=DRIFT_CHECK, passed=passed, severity=AssetCheckSeverity.WARN, metadata=out,
                            description=summary[:1000])


def with_drift_check(results: Iterable[Any], expectations_check: str) -> Iterator[Any]:
    """`results` of `validated_data`, with the `drift` check right after the expectations check it reads.

    Yielded before the body goes on, so a rejected version (the body raises
    after its failed expectations check) still shows its drift verdict.
    """
    for item in results:
        yield item
        if isinstance(item, AssetCheckResult) and item.check_name == expectations_check:
            yield drift_check(item)
