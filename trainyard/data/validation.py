"""Validation of one data version: one streaming pass, the `on_bad_data` policy, and what follows from it.

`validate_snapshot` streams a snapshot once through the pipeline's Great
Expectations suite (`trainyard.data.expectations.ArrowSuite`), the platform
checks (finite floats, duplicate rows) and the profiler, then renders GE's
Data Docs; `decide` applies the pipeline's `on_bad_data` policy;
`set_aside_rows` moves bad rows out when the policy is "warn";
`validate_version` chains them with drift, the split and quarantine.
`validate` is the same check on an in-memory frame.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence

import numpy as np
import pyarrow as pa

from trainyard import naming
from trainyard.data.canonical import BATCH_ROWS, CanonicalParquetWriter, jsonable, read_rows
from trainyard.data.checks import (
    FINITE_EXPECTATION,
    UNIQUE_ROWS_EXPECTATION,
    DuplicateRows,
    FiniteCheck,
    RepeatedIds,
    dropped_duplicates,
    duplicate_policy,
    id_key_columns,
    warnings_of,
)
from trainyard.data.drift_detection import delivery_drift, drift_summary, drift_verdict
from trainyard.data.expectations import ArrowSuite, render_data_docs
from trainyard.data.profile import Profiler, profile_snapshot
from trainyard.data.quarantine import quarantine_rows, quarantine_snapshot, release_of
from trainyard.data.report import SUITE_CHECK, ValidationReport, result_from_ge
from trainyard.data.splitting import split_snapshot
from trainyard.data.suite import suite_expectations, suite_hash
from trainyard.spec import PipelineSpec
from trainyard.store import FileStore

if TYPE_CHECKING:
    import pandas as pd


@dataclasses.dataclass
class SnapshotValidation:
    """Everything one pass over a snapshot found.

    Attributes:
        report: Suite and platform results, with failing rows attached.
        profile: Per-column statistics (see `Profiler`).
        sample: The profile's row sample (for drift).
        docs_html: GE's Data Docs page for the suite results.
        suite: The suite engine, which can re-judge rows (`set_aside_rows`).
        duplicate_positions: Sorted positions of rows that repeat an earlier row.
    """

    report: ValidationReport
    profile: dict[str, Any]
    sample: pa.Table
    docs_html: str
    suite: ArrowSuite
    duplicate_positions: np.ndarray


def _validate_batches(
    batches: Iterable[pa.RecordBatch],
    schema: pa.Schema,
    total_rows: int,
    spec: PipelineSpec,
    workdir: str,
    run_name: Optional[str],
    seed: int = 0,
) -> tuple[ValidationReport, dict[str, Any], pa.Table, str, ArrowSuite, np.ndarray]:
    """One pass of suite, platform checks and profiler; Data Docs only when `run_name` is given."""
    suite = ArrowSuite(suite_expectations(spec), schema, name=spec.key)
    floats = [
        n
        for n, c in spec.stored_columns.items()
        if c.dtype == "float" and c.finite and n in schema.names and pa.types.is_floating(schema.field(n).type)
    ]
    finite = FiniteCheck(floats)
    policy = duplicate_policy(spec)
    dedup = None if policy == "allow" else DuplicateRows(total_rows, workdir)
    keys = [c for c in id_key_columns(spec) if c in schema.names]
    ids = RepeatedIds(keys, total_rows, workdir) if keys else None
    profiler = Profiler(schema, total_rows, seed=seed)
    missing = {f.name: 0 for f in schema}
    offset = 0
    for batch in batches:
        suite.update(batch)
        finite.update(batch, offset)
        if dedup is not None:
            dedup.update(batch, offset)
        if ids is not None:
            ids.update(batch, offset)
        profiler.update(batch)
        for name, column in zip(batch.schema.names, batch.columns):
            missing[name] += column.null_count
        offset += batch.num_rows
    ge_results = suite.results()
    results = [result_from_ge(r, suite.map_condition(i) is not None) for i, r in enumerate(ge_results)]
    results += finite.results()
    duplicates = np.zeros(0, dtype=np.int64)
    if dedup is not None:
        dedup.finish()
        results.append(dedup.result(keep_first=policy == "keep_first"))
        duplicates = dedup.positions
    if ids is not None:
        ids.finish(duplicates)
        results.append(ids.result())
    failed = sum(1 for r in results if not r["success"])
    report = ValidationReport(
        success=failed == 0,
        evaluated=len(results),
        failed=failed,
        results=results,
        suite=suite.suite_json(),
        rows=offset,
        missing=missing,
    )
    docs = render_data_docs(ge_results, spec.key, run_name=run_name, meta={"rows": offset}) if run_name else ""
    return report, profiler.profile(), profiler.sample(), docs, suite, duplicates


def validate(df: pd.DataFrame, spec: PipelineSpec) -> ValidationReport:
    """Run the pipeline's suite and platform checks on an in-memory frame.

    The same engine as `validate_snapshot` (see `trainyard.data.expectations`); the
    frame is converted to Arrow as it is, so a wrongly typed column fails
    the type expectation rather than being cast.

    Args:
        df: The data, e.g. the canonical Parquet read with pandas.
        spec: The pipeline whose suite and columns give the expectations.

    Returns:
        The report; `success` is False when any expectation failed or could
        not be evaluated (e.g. a range check on a text column).
    """
    table = pa.Table.from_pandas(df, preserve_index=False).replace_schema_metadata(None)
    with tempfile.TemporaryDirectory(prefix="trainyard-validate-") as work:
        report, *_ = _validate_batches(
            table.to_batches(max_chunksize=BATCH_ROWS), table.schema, table.num_rows, spec, work, None
        )
    positions = {p for r in report.failures() for p in r["unexpected_index_list"] if r["row_level"]}
    if not positions:
        return report
    rows = {p: jsonable(table.slice(p, 1).to_pylist()[0]) for p in sorted(positions)}
    return _with_sample_rows(report, rows)


def _with_sample_rows(report: ValidationReport, rows: dict[int, dict[str, Any]]) -> ValidationReport:
    results = []
    for r in report.results:
        if not r["success"] and r["row_level"]:
            r = {**r, "sample_rows": [{"_row": p, **rows[p]} for p in r["unexpected_index_list"] if p in rows]}
        results.append(r)
    return report.model_copy(update={"results": results})


def validate_snapshot(
    store: FileStore, uri: str, spec: PipelineSpec, *, run_name: Optional[str] = None, batch_rows: int = BATCH_ROWS
) -> SnapshotValidation:
    """Stream a canonical Parquet snapshot once through the suite, the platform checks and the profiler.

    Memory stays bounded: one batch at a time, plus the duplicate check's
    row hashes (spilled to disk past `DEDUP_MEMORY_BYTES`), the profile's
    sample and the positions of duplicate rows. The failing rows of each
    row-level expectation (up to five) are read back and attached to its
    result as `sample_rows`.

    Args:
        store: Where the snapshot is.
        uri: Its URI.
        spec: The pipeline (suite, platform settings).
        run_name: Shown in the Data Docs (e.g. the data version).
        batch_rows: Rows per batch.

    Raises:
        UnsupportedExpectation: The suite uses an expectation that cannot be streamed.
    """
    import pyarrow.parquet as pq

    with store.open(uri, "rb") as f:
        pf = pq.ParquetFile(f)
        schema = pf.schema_arrow.remove_metadata()
        total = pf.metadata.num_rows
        with tempfile.TemporaryDirectory(prefix="trainyard-validate-") as work:
            batches = pf.iter_batches(batch_size=batch_rows, use_threads=True)
            report, profile, sample, docs, suite, dups = _validate_batches(
                batches, schema, total, spec, work, run_name or os.path.basename(os.path.dirname(uri))
            )
    positions = {p for r in report.failures() if r["row_level"] for p in r["unexpected_index_list"]}
    if positions:
        report = _with_sample_rows(report, read_rows(store, uri, positions))
    return SnapshotValidation(
        report=report, profile=profile, sample=sample, docs_html=docs, suite=suite, duplicate_positions=dups
    )


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What `validated_data` does with a snapshot.

    Attributes:
        accepted: The data (or what is left of it) goes on to the split.
        set_aside: Rows failing row-level checks are moved to quarantine first.
        reasons: Why it was rejected (empty when accepted).
        warnings: What was accepted despite not passing.
        release: The release record when a person released this version.
    """

    accepted: bool
    set_aside: bool
    reasons: list[str]
    warnings: list[str]
    release: Optional[dict[str, Any]] = None


def _summary(r: dict[str, Any]) -> str:
    where = f" on {r['column']!r}" if r["column"] else ""
    if r["exception"]:
        return f"{r['expectation']}{where} could not be evaluated: {r['exception']}"
    count = f": {r['unexpected_count']} unexpected" if r["unexpected_count"] else ""
    seen = f" (observed {r['observed_value']})" if r["observed_value"] is not None and not r["unexpected_count"] else ""
    return f"{r['expectation']}{where}{count}{seen}"


def decide(
    report: ValidationReport,
    drift_rows: Sequence[dict[str, Any]],
    spec: PipelineSpec,
    release: Optional[dict[str, Any]] = None,
) -> Verdict:
    """Apply the pipeline's `on_bad_data` policy to validation and drift results.

    - Everything passed: accepted; repeated rows found under
      `source.duplicates="keep_first"` are dropped (set aside) with a count.
    - Released by a person (`release_quarantine`): accepted as it is, with the
      failures as warnings (repeated rows included).
    - A moderate drift (`PSI_WARN` <= PSI <= the threshold) is a warning; drift
      beyond a threshold is a warning too unless `on_drift="reject"`.
    - "warn": drift is a warning; failing row-level checks set their rows
      aside; table-level failures (row count, columns, types of whole
      columns, aggregates, expectations that raised) still reject.
    - "reject": any failure or drift beyond a threshold rejects.
    """
    failures = report.failures()
    verdict = drift_verdict(drift_rows, spec)
    beyond = [d for d in drift_rows if d["drifted"]]
    drifted = beyond if spec.on_drift == "reject" else []
    shift = [verdict["message"]] if verdict["level"] == "moderate" else []
    if beyond and not drifted:
        shift = [f"{verdict['message']} (on_drift='warn': accepted)", *[drift_summary(d) for d in beyond]]
    problems = [f"{report.failed} of {report.evaluated} expectations failed"] if failures else []
    problems += [f"drift above threshold in {[d['column'] for d in drifted]}"] if drifted else []
    details = [_summary(r) for r in failures] + [drift_summary(d) for d in drifted]
    dropped = dropped_duplicates(report.results)
    dedup = (
        [f"{dropped} repeated row(s) dropped, the first of each kept (source.duplicates='keep_first')"]
        if dropped
        else []
    )
    dedup += warnings_of(report.results)
    if not failures and not drifted:
        return Verdict(accepted=True, set_aside=bool(dropped), reasons=[], warnings=[*dedup, *shift])
    if release is not None:
        note = f"released by {release['released_by']} at {release['released_at']}: {release['reason']}"
        return Verdict(accepted=True, set_aside=False, reasons=[], warnings=[note, *details], release=release)
    table_level = [r for r in failures if not r["row_level"]]
    if spec.on_bad_data == "warn" and not table_level:
        rows = sum(r["unexpected_count"] or 0 for r in failures)
        aside = [f"{rows} failing value(s) set aside in quarantine"] if failures else []
        return Verdict(
            accepted=True, set_aside=bool(failures or dropped), reasons=[], warnings=[*aside, *dedup, *details, *shift]
        )
    return Verdict(accepted=False, set_aside=False, reasons=problems + details, warnings=[])


def set_aside_rows(
    store: FileStore,
    uri: str,
    validation: SnapshotValidation,
    spec: PipelineSpec,
    accepted_path: str,
    rejected_path: str,
    batch_rows: int = BATCH_ROWS,
) -> tuple[int, int]:
    """Split a snapshot into the rows that pass every row-level check and those that do not.

    A second streaming pass judges each row by the failing row-level
    expectations (their GE map conditions), the finite check of the failing
    columns and the duplicate positions. Accepted rows are written in
    canonical form to `accepted_path`; rejected ones, with their position
    in the snapshot as `_row`, to `rejected_path`.

    Returns:
        (accepted rows, rejected rows).
    """
    failing = [i for i, r in enumerate(validation.report.results) if not r["success"] and r["row_level"]]
    suite_checks = [i for i in failing if validation.report.results[i]["source"] == SUITE_CHECK]
    finite_columns = [
        validation.report.results[i]["column"]
        for i in failing
        if validation.report.results[i]["expectation"] == FINITE_EXPECTATION
    ]
    # Failing repeats (`duplicates="reject"`) and repeats to drop (`"keep_first"`) leave the same way.
    duplicates = any(
        r["expectation"] == UNIQUE_ROWS_EXPECTATION and r["unexpected_count"] for r in validation.report.results
    )
    dup_positions = validation.duplicate_positions if duplicates else np.zeros(0, dtype=np.int64)
    import pyarrow.parquet as pq

    offset = 0
    with store.open(uri, "rb") as f:
        pf = pq.ParquetFile(f)
        schema = pf.schema_arrow.remove_metadata()
        rejected_schema = schema.append(pa.field("_row", pa.int64()))
        with (
            CanonicalParquetWriter(accepted_path, schema) as good,
            CanonicalParquetWriter(rejected_path, rejected_schema) as bad,
        ):
            for batch in pf.iter_batches(batch_size=batch_rows, use_threads=True):
                batch = batch.replace_schema_metadata(None)
                n = batch.num_rows
                mask = np.zeros(n, dtype=bool)
                for i in suite_checks:
                    mask |= validation.suite.unexpected_mask(i, batch).to_numpy(zero_copy_only=False)
                for column in finite_columns:
                    mask |= FiniteCheck.mask(batch.column(column)).to_numpy(zero_copy_only=False)
                if len(dup_positions):
                    lo, hi = np.searchsorted(dup_positions, [offset, offset + n])
                    mask[dup_positions[lo:hi] - offset] = True
                keep = pa.array(~mask)
                good.write(batch.filter(keep))
                if mask.any():
                    where = np.flatnonzero(mask)
                    rows = batch.filter(pa.array(mask))
                    bad.write(
                        pa.RecordBatch.from_arrays([*rows.columns, pa.array(where + offset)], schema=rejected_schema)
                    )
                offset += n
        return good.rows, bad.rows


@dataclasses.dataclass
class VersionOutcome:
    """What `validate_version` found and did for one raw snapshot.

    Attributes:
        verdict: The policy's decision.
        validation: The streaming pass's results.
        drift: Per-feature drift against the previous validated version (empty for the first).
        docs_uri: GE Data Docs page of this version.
        quarantine: Where the rejected version, or the rows set aside, are kept.
        value: When accepted: `md5`, `split_id`, `train`/`val`/`test` URIs,
            `rows` per part, `set_aside` rows, `profile`.
    """

    verdict: Verdict
    validation: SnapshotValidation
    drift: list[dict[str, Any]]
    docs_uri: str
    quarantine: Optional[str]
    value: Optional[dict[str, Any]]


def _load_profile(store: FileStore, latest: dict[str, Any]) -> tuple[dict[str, Any], pa.Table]:
    import pyarrow.parquet as pq

    if latest.get("profile_uri") and store.exists(latest["profile_uri"]):
        with store.open(latest["sample_uri"], "rb") as f:
            sample = pq.read_table(f)
        return store.read_json(latest["profile_uri"]), sample
    return profile_snapshot(store, latest["raw_uri"])  # versions validated before profiles were kept


def _drift_rows(store: FileStore, spec: PipelineSpec, raw: dict[str, Any], validation: SnapshotValidation,
                latest: Optional[dict[str, Any]]) -> list[dict[str, Any]]:
    """The drift of version `raw` against the latest accepted one (`latest`, its `latest.json`; none for the first
    version).

    A new version: its delivery's rows against the previous accepted version
    (`trainyard.data.drift_detection.delivery_drift`).
    The latest version again: the drift measured when it was new.
    """
    if latest is not None and latest["md5"] != raw["md5"]:
        return delivery_drift(
            store,
            spec,
            _load_profile(store, latest),
            latest.get("raw_uri"),
            raw["uri"],
            (validation.profile, validation.sample),
        )
    if latest is not None and latest.get("drift_uri") and store.exists(latest["drift_uri"]):
        return store.read_json(latest["drift_uri"])
    return []


def _quarantine_version(
    store: FileStore,
    spec: PipelineSpec,
    raw: dict[str, Any],
    verdict: Verdict,
    validation: SnapshotValidation,
    drift_rows: list[dict[str, Any]],
    docs_uri: str,
) -> str:
    """Quarantine the rejected snapshot with why (`quarantine_snapshot`); returns where it is kept."""
    return quarantine_snapshot(
        store,
        spec.team,
        spec.name,
        raw["md5"],
        raw["uri"],
        {
            "raw": raw,
            "policy": spec.on_bad_data,
            "reasons": verdict.reasons,
            "validation": validation.report.model_dump(mode="json"),
            "drift": drift_rows,
            "profile": validation.profile,
        },
        docs_uri,
    )


def validate_version(store: FileStore, spec: PipelineSpec, raw: dict[str, Any]) -> VersionOutcome:
    """Validate one raw snapshot, measure drift, apply the policy, and quarantine or split it.

    Steps: `validate_snapshot`; Data Docs to `data_docs/<team>/<name>/<md5>/index.html`;
    `delivery_drift` (the rows of the files new since the version
    `validated/latest.json` points to, against that version); `decide`
    (honouring a release); then either `quarantine_snapshot`, or (after
    `set_aside_rows` when the verdict says so) `split_snapshot` into
    `validated/<split_id>/` with the profile, sample and drift kept beside
    the split, and `latest.json` moved to this version.

    Args:
        store: The object store.
        spec: The pipeline.
        raw: `raw_data`'s value (`uri`, `md5`, ...).
    """
    import pyarrow.parquet as pq

    md5 = raw["md5"]
    validation = validate_snapshot(store, raw["uri"], spec, run_name=md5)
    docs_uri = naming.data_docs(store, spec.team, spec.name, md5)
    store.write_bytes(docs_uri, validation.docs_html.encode("utf-8"))
    latest_uri = naming.validated_latest(store, spec.team, spec.name)
    latest = store.read_json(latest_uri) if store.exists(latest_uri) else None
    drift_rows = _drift_rows(store, spec, raw, validation, latest)
    verdict = decide(validation.report, drift_rows, spec, release_of(store, spec.team, spec.name, md5))
    if not verdict.accepted:
        kept = _quarantine_version(store, spec, raw, verdict, validation, drift_rows, docs_uri)
        return VersionOutcome(verdict, validation, drift_rows, docs_uri, kept, None)
    split_id = f"{md5}-{spec.fingerprint()}" + (f"-{suite_hash(spec)}" if verdict.set_aside else "")
    base = naming.validated_dir(store, spec.team, spec.name, split_id)
    source, set_aside, where = raw["uri"], 0, None
    with tempfile.TemporaryDirectory(prefix="trainyard-validated-") as tmp:
        if verdict.set_aside:
            good, bad = os.path.join(tmp, "accepted.parquet"), os.path.join(tmp, "rows.parquet")
            _, set_aside = set_aside_rows(store, raw["uri"], validation, spec, good, bad)
            source = f"{base}/accepted.parquet"
            store.put_file(good, source)
            where = quarantine_rows(
                store,
                spec.team,
                spec.name,
                md5,
                bad,
                {
                    "raw": raw,
                    "policy": spec.on_bad_data,
                    "reasons": verdict.warnings,
                    "rows": set_aside,
                    "validation": validation.report.model_dump(mode="json"),
                },
            )
        parts = split_snapshot(store, source, spec, os.path.join(tmp, "split"))
        uris = {}
        for name in ("train", "val", "test"):
            uris[name] = f"{base}/{name}.parquet"
            store.put_file(os.path.join(tmp, "split", f"{name}.parquet"), uris[name])
        sample_local = os.path.join(tmp, "sample.parquet")
        pq.write_table(validation.sample, sample_local)
        store.put_file(sample_local, f"{base}/sample.parquet")
    store.write_json(f"{base}/profile.json", validation.profile)
    store.write_json(f"{base}/drift.json", drift_rows)
    store.write_json(
        latest_uri,
        {
            "md5": md5,
            "raw_uri": raw["uri"],
            "split_id": split_id,
            "profile_uri": f"{base}/profile.json",
            "sample_uri": f"{base}/sample.parquet",
            "drift_uri": f"{base}/drift.json",
        },
    )
    value = {
        "md5": md5,
        "split_id": split_id,
        **uris,
        "rows": parts,
        "set_aside": set_aside,
        "profile": f"{base}/profile.json",
    }
    return VersionOutcome(verdict, validation, drift_rows, docs_uri, where, value)
