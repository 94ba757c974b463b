"""The data assets' bodies: `raw_data` (ingest) and `validated_data` with its blocking check.

Each body resolves its inputs, calls the data engine (`trainyard.data`) and
returns the value with metadata a person wants to see; `assets.factory` wires
them into definitions.
"""

from __future__ import annotations

from typing import Any, Iterator

from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetExecutionContext,
    DataVersion,
    Failure,
    MetadataValue,
    Output,
)

from assets.graph_checks import accepted_check
from assets.shard_data import shard_raw_data_body, shard_validated_data_body
from resources.storage import ObjectStore, PermanentStorageError
from resources.versioning import DataVersioning, DataVersioningError
from trainyard.data import feast, ingest
from trainyard.data.drift_detection import drift_markdown, drift_verdict
from trainyard.data.errors import DataQualityError
from trainyard.data.expectations import UnsupportedExpectation
from trainyard.data.quarantine import quarantine_root
from trainyard.data.validation import VersionOutcome, validate_version
from trainyard.feast_source import FeastSourceSpec
from trainyard.spec import PipelineSpec
from trainyard.values import RawData, ValidatedData

CHECK_NAME = "expectations"


def raw_data_body(
    context: AssetExecutionContext, spec: PipelineSpec, store: ObjectStore, versioning: DataVersioning
) -> Output[RawData]:
    """Ingest new landing files into a canonical snapshot pinned with DVC; its md5 is the data version."""
    if isinstance(spec.source, FeastSourceSpec):
        return feast_raw_data_body(context, spec, store, versioning)
    if spec.shards is not None:
        return shard_raw_data_body(context, spec, store, versioning, raw_output)
    try:
        result = ingest.ingest(store, spec, versioning, log=context.log.warning)
    except ingest.IngestRejected as e:
        raise Failure(
            description=f"{spec.key}: raw data rejected: {e}",
            metadata={
                "files": MetadataValue.md(ingest.records_markdown(e.records)),
                "quarantine": MetadataValue.path(quarantine_root(store, spec.team, spec.name)),
            },
        ) from e
    except ingest.LandingFileChanged as e:
        raise Failure(
            description=f"{spec.key}: landing data is still changing, try again once uploads finish: {e}"
        ) from e
    except DataQualityError as e:
        raise Failure(description=f"{spec.key}: raw data rejected: {e}") from e
    except (PermanentStorageError, DataVersioningError) as e:
        # Not the data's fault (a full disk, a broken remote): said plainly, never retried blindly, nothing quarantined.
        raise Failure(description=f"{spec.key}: ingest could not store the data: {e}", allow_retries=False) from e
    return raw_output(spec, result.snapshot, result.warnings, {
        "files": len(result.snapshot.files),
        "new_files": len(result.ingested),
        "rejected_files": len(result.rejected),
        "duplicate_files": len(result.duplicates),
        "removed_files": len(result.removed),
        "reused_snapshot": result.reused_snapshot,
        "warnings": len(result.warnings),
        "ingest": MetadataValue.md(result.files_markdown()),
        "missing_values": MetadataValue.md(ingest.missing_markdown(result.snapshot.missing, result.snapshot.rows)),
        "manifest": MetadataValue.path(ingest.manifest_uri(store, spec)),
    })


def raw_output(spec: PipelineSpec, snap: Any, warnings: list[str], metadata: dict[str, Any]) -> Output[RawData]:
    """The `raw_data` output of snapshot `snap`: its md5 is the data version; `metadata` adds to what every source
    shows."""
    value = RawData(
        uri=snap.uri, md5=snap.md5, rows=snap.rows, dvc_file=snap.dvc_file, files=len(snap.files), warnings=warnings
    )
    return Output(
        value,
        data_version=DataVersion(snap.md5),
        metadata={
            "dvc_md5": snap.md5,
            "rows": snap.rows,
            "columns": len(spec.columns),
            **metadata,
            "uri": MetadataValue.path(snap.uri),
            "restore": MetadataValue.md(f"`dvc pull` with this pin:\n```\n{snap.dvc_file}```"),
        },
    )


def feast_raw_data_body(
    context: AssetExecutionContext, spec: PipelineSpec, store: ObjectStore, versioning: DataVersioning
) -> Output[RawData]:
    """Entity files ingested, their features retrieved as of each row's time (Feast), pinned; the md5 covers rows,
    definitions and values."""
    try:
        made = feast.feast_snapshot(store, spec, versioning, log=context.log.warning)
    except ingest.IngestRejected as e:
        raise Failure(
            description=f"{spec.key}: entity rows rejected: {e}",
            metadata={
                "files": MetadataValue.md(ingest.records_markdown(e.records)),
                "quarantine": MetadataValue.path(quarantine_root(store, spec.team, spec.name)),
            },
        ) from e
    except ingest.LandingFileChanged as e:
        raise Failure(
            description=f"{spec.key}: entity files are still changing, try again once uploads finish: {e}"
        ) from e
    except (DataQualityError, feast.FeastUnavailable, feast.FeastFailed) as e:
        raise Failure(description=f"{spec.key}: training set not retrieved from Feast: {e}") from e
    lineage = made.lineage
    views = "\n".join(
        f"| {v['name']} | {v['definition'][:12]} | {v['version']} | {v['ttl_s']} |" for v in lineage["feature_views"]
    )
    return raw_output(spec, made.snapshot, made.entities.warnings, {
        "entity_md5": lineage["entity_md5"],
        "feature_service": (lineage["feature_service"] or {}).get("name", ""),
        "features": MetadataValue.json(lineage["features"]),
        "feature_views": MetadataValue.md("| view | definition | version | ttl (s) |\n|---|---|---|---|\n" + views),
        "time_range": " .. ".join(str(t) for t in lineage["time_range"]),
        "reused_snapshot": made.reused,
        "entity_files": MetadataValue.md(made.entities.files_markdown()),
    })


def check_metadata(outcome: VersionOutcome, spec: PipelineSpec) -> dict[str, Any]:
    """The check's evidence: suite results, failing rows, drift and where the data docs are."""
    report = outcome.validation.report
    verdict = drift_verdict(outcome.drift, spec)
    return {
        "expectations": report.evaluated,
        "failed": report.failed,
        "rows": report.rows,
        "policy": spec.on_bad_data,
        "results": MetadataValue.md(report.to_markdown()),
        "failing_rows": MetadataValue.md(report.failing_rows_markdown()),
        "missing_values": MetadataValue.md(ingest.missing_markdown(report.missing, report.rows)),
        "drift_verdict": verdict["level"],
        "drift_summary": verdict["message"],
        "drift_scope": verdict["scope"] or "none",
        **({"schema_change": verdict["schema"]} if verdict["schema"] else {}),
        "drift": MetadataValue.md(drift_markdown(outcome.drift, spec)),
        "max_psi": max((d["psi"] for d in outcome.drift if d["psi"] is not None), default=0.0),
        "max_ks": max((d["ks"] for d in outcome.drift if d["ks"] is not None), default=0.0),
        "data_docs": MetadataValue.path(outcome.docs_uri),
    }


def validated_data_body(
    context: AssetExecutionContext, spec: PipelineSpec, raw: RawData, store: ObjectStore
) -> Iterator[Any]:
    """Validate a raw version: the check's result, then the split (or a failure that keeps the data in quarantine)."""
    if spec.shards is not None:
        yield from shard_validated_data_body(context, spec, raw, store, CHECK_NAME)
        return
    try:
        outcome = validate_version(store, spec, raw.model_dump(mode="json"))
    except (DataQualityError, UnsupportedExpectation) as e:
        raise Failure(description=f"{spec.key}: cannot validate data version {raw.md5}: {e}") from e
    verdict = outcome.verdict
    check_meta = check_metadata(outcome, spec)
    context.log.info(f"{spec.key}: data version {raw.md5} drift: {check_meta['drift_summary']}")
    if not verdict.accepted:
        check_meta["quarantine"] = MetadataValue.path(outcome.quarantine or "")  # a rejected version always has one
        yield AssetCheckResult(
            check_name=CHECK_NAME, passed=False, severity=AssetCheckSeverity.ERROR, metadata=check_meta
        )
        raise Failure(
            description=f"{spec.key}: data version {raw.md5} rejected ({'; '.join(verdict.reasons[:6])}); "
            f"kept in quarantine at {outcome.quarantine}",
            metadata=check_meta,
        )
    if outcome.quarantine:  # the rows that go on passed every row-level check; what did not is set aside or released
        check_meta["set_aside"] = MetadataValue.path(outcome.quarantine)
    yield accepted_check(context, spec.key, CHECK_NAME, check_meta, verdict)
    assert outcome.value is not None, "an accepted version has a split"
    value = ValidatedData.model_validate(outcome.value)
    yield Output(
        value,
        data_version=DataVersion(value.split_id),
        metadata={
            "train_rows": value.rows["train"],
            "val_rows": value.rows["val"],
            "test_rows": value.rows["test"],
            "set_aside_rows": value.set_aside,
            "data_version": raw.md5,
            "profile": MetadataValue.path(value.profile or ""),
        },
    )
