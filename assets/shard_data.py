"""The data assets' bodies for a sharded pipeline (`spec.shards` set): shards ingested, then checked and split.

`assets.data.raw_data_body` and `validated_data_body` hand a sharded pipeline
to these, as they do a Feast source to its own: the same outputs (`RawData`,
`ValidatedData` with the split directories as train/val/test), the same
blocking `expectations` check and the drift verdict in its metadata
(`assets.graph_checks.with_drift_check` turns it into the `drift` check).
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
from resources.storage import ObjectStore, PermanentStorageError
from resources.versioning import DataVersioning, DataVersioningError
from trainyard.data import ingest
from trainyard.data.drift_detection import drift_markdown, drift_verdict
from trainyard.data.errors import DataQualityError
from trainyard.data.quarantine import quarantine_root
from trainyard.data.shard_validation import (
    ShardVersionOutcome,
    problems_markdown,
    shards_markdown,
    validate_shard_version,
)
from trainyard.data.shards import ingest_shards, markdown_splits
from trainyard.spec import PipelineSpec
from trainyard.values import RawData, ValidatedData


def shard_raw_data_body(
    context: AssetExecutionContext, spec: PipelineSpec, store: ObjectStore, versioning: DataVersioning, raw_output: Any
) -> Output[RawData]:
    """Landing files to a DVC-pinned shard version; its md5 is the data version (`raw_output` builds the output as for
    tables)."""
    try:
        result = ingest_shards(store, spec, versioning, log=context.log.warning)
    except ingest.IngestRejected as e:
        raise Failure(
            description=f"{spec.key}: landing files rejected: {e}",
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
        raise Failure(description=f"{spec.key}: ingest could not store the shards: {e}", allow_retries=False) from e
    items = {name: c["items"] for name, c in result.splits.items()}
    tokens = sum(c.get("tokens", 0) for c in result.splits.values())
    return raw_output(spec, result.snapshot, result.warnings, {
        "kind": spec.shards.kind if spec.shards else "",
        "items": result.snapshot.rows,
        **({"tokens": tokens, "tokenizer": result.tokenizer} if result.tokenizer else {}),
        "splits": MetadataValue.md(markdown_splits(result.splits)),
        "train_items": items.get("train", 0),
        "files": len(result.snapshot.files),
        "new_files": len(result.ingested),
        "rejected_files": len(result.rejected),
        "duplicate_files": len(result.duplicates),
        "removed_files": len(result.removed),
        "reused_snapshot": result.reused_snapshot,
        "warnings": len(result.warnings),
        "ingest": MetadataValue.md(result.files_markdown()),
        "manifest": MetadataValue.path(ingest.manifest_uri(store, spec)),
    })


def shard_check_metadata(outcome: ShardVersionOutcome, spec: PipelineSpec) -> dict[str, Any]:
    """The check's evidence: the per-shard table, every problem by file and line, the suite's results and the drift."""
    report = outcome.report
    verdict = drift_verdict(outcome.drift, spec)
    return {
        "expectations": report.evaluated,
        "failed": report.failed,
        "rows": report.rows,
        "problems": outcome.problem_count,
        "report": MetadataValue.md(problems_markdown(outcome.problems, outcome.problem_count)),
        "shards": MetadataValue.md(shards_markdown(outcome.shards)),
        "results": MetadataValue.md(report.to_markdown()),
        "drift_verdict": verdict["level"],
        "drift_summary": verdict["message"],
        "drift_scope": verdict["scope"] or "none",
        "drift": MetadataValue.md(drift_markdown(outcome.drift, spec)),
        "max_psi": max((d["psi"] for d in outcome.drift if d["psi"] is not None), default=0.0),
    }


def shard_validated_data_body(
    context: AssetExecutionContext, spec: PipelineSpec, raw: RawData, store: ObjectStore, check_name: str
) -> Iterator[Any]:
    """Validate a shard version: the check's result, then the split directories (or a failure that keeps the report in
    quarantine)."""
    try:
        outcome = validate_shard_version(store, spec, raw.model_dump(mode="json"))
    except DataQualityError as e:
        raise Failure(description=f"{spec.key}: cannot validate shard version {raw.md5}: {e}") from e
    verdict = outcome.verdict
    meta = shard_check_metadata(outcome, spec)
    context.log.info(f"{spec.key}: shard version {raw.md5} drift: {meta['drift_summary']}")
    if not verdict.accepted:
        meta["quarantine"] = MetadataValue.path(outcome.quarantine or "")
        yield AssetCheckResult(check_name=check_name, passed=False, severity=AssetCheckSeverity.ERROR, metadata=meta)
        first = "; ".join(outcome.problems[:3]) or "; ".join(verdict.reasons[:3])
        raise Failure(
            description=f"{spec.key}: shard version {raw.md5} rejected ({outcome.problem_count} problem(s): {first}); "
            f"report kept in quarantine at {outcome.quarantine}",
            metadata=meta,
        )
    yield accepted_check(context, spec.key, check_name, meta, verdict)
    assert outcome.value is not None, "an accepted version has its splits"
    value = ValidatedData.model_validate(outcome.value)
    yield Output(
        value,
        data_version=DataVersion(value.split_id),
        metadata={
            "train_items": value.rows["train"],
            "val_items": value.rows["val"],
            "test_items": value.rows["test"],
            "data_version": raw.md5,
            "train": MetadataValue.path(value.train),
            "profile": MetadataValue.path(value.profile or ""),
        },
    )
