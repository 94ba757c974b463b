"""Data quality for `raw_data` and `validated_data`: canonical form, validation, drift, split, quarantine.

The chain, as the assets use it (ingestion itself is `assets.ingest`):

1. `to_canonical` keeps the declared columns in declared order and declared types;
2. `CanonicalParquetWriter` writes record batches so equal data gives equal
   bytes (hence an equal DVC md5, hence an equal Dagster data version),
   holding at most one row group in memory;
3. `validate_snapshot` streams a snapshot once through the pipeline's Great
   Expectations suite (`trainyard.data.expectations.ArrowSuite`), the platform checks
   (finite floats, duplicate rows) and the profiler (schema, ranges, domains,
   a sample for drift), then renders GE's Data Docs;
4. `drift` compares the profile with the previous validated version's: PSI
   for every feature (categories, or quantile bins of numerics), KS for numerics;
5. `decide` applies the pipeline's `on_bad_data` policy; `set_aside_rows`
   moves bad rows out when the policy is "warn";
6. `split_snapshot` writes the deterministic stratified train/val/test split;
7. the quarantine functions keep rejected data with its report, list it,
   and record releases (who, when, why).

`validate`, `split`, `psi` and `drift_report` are the same operations on
in-memory frames, for small data and tests.

Errors about the data itself derive from `DataQualityError` and are terminal:
retrying reads the same data. Storage errors from the object store pass
through unchanged (some are retryable). Great Expectations, scikit-learn and
SciPy are imported inside the functions that need them (slow imports).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
import os
import tempfile
import uuid
import warnings
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict

from trainyard.spec import PipelineSpec, load_suite_file

if TYPE_CHECKING:
    from trainyard.data.expectations import ArrowSuite
    from trainyard.store import FileStore

ARROW_TYPES: dict[str, pa.DataType] = {"int": pa.int64(), "float": pa.float64(), "str": pa.string(), "bool": pa.bool_()}
"""Canonical Arrow type of each `ColumnSpec.dtype`."""

# Type names Great Expectations accepts for each declared dtype: the numpy or
# pandas-extension dtype of a column, or, for object (text) columns, the Python
# type of every value.
GX_TYPE_NAMES: dict[str, list[str]] = {
    "int": ["int64", "int", "Int64Dtype"],
    "float": ["float64", "float", "Float64Dtype"],
    "str": ["str", "StringDtype"],
    "bool": ["bool", "BooleanDtype"],
}

# Parquet layout is pinned so that the bytes depend on the data alone. Dictionary
# encoding is used for every column but floats (see `dictionary_columns`): float
# columns rarely repeat values, and building a dictionary only to abandon it
# costs more than the rest of the write.
PARQUET_OPTIONS: dict[str, Any] = {
    "compression": "zstd",
    "compression_level": 3,
    "row_group_size": 128 * 1024,
    "data_page_size": 1024 * 1024,
    "write_statistics": True,
    "version": "2.6",
    "data_page_version": "1.0",
}


def dictionary_columns(schema: pa.Schema) -> list[str]:
    """The columns written with dictionary encoding: all but floating-point ones."""
    return [f.name for f in schema if not pa.types.is_floating(f.type)]

BATCH_ROWS = 128 * 1024
"""Rows per record batch when streaming a snapshot (one canonical row group)."""

PSI_EPSILON = 1e-4
"""Share given to a bin that is empty on one side, so PSI stays finite."""

PROFILE_SAMPLE_ROWS = 20_000
"""Rows kept (seeded, uniform) in a profile's sample, from which numeric drift is measured."""

PROFILE_DOMAIN_LIMIT = 50
"""A column with at most this many distinct values gets them listed in its profile (and a generated suite)."""

CATEGORY_LIMIT = 1000
"""Most categories whose counts a profile keeps; past that, categorical drift of the column is not measured."""

DEDUP_MEMORY_BYTES = 64 * 1024 * 1024
"""Memory for row hashes in the duplicate check; beyond it hashes are spilled to disk in buckets."""

SUITE_CHECK = "suite"
PLATFORM_CHECK = "platform"
FINITE_EXPECTATION = "trainyard_values_are_finite"
UNIQUE_ROWS_EXPECTATION = "trainyard_rows_are_unique"

_SAMPLE = 5


class DataQualityError(Exception):
    """The data is unusable as declared. Terminal: retrying reads the same data."""


class MissingLandingData(DataQualityError):
    """No landing file matches the source's prefix and pattern."""


class MalformedLandingFile(DataQualityError):
    """A landing file cannot be parsed in the source's format."""


class SchemaMismatch(DataQualityError):
    """Columns differ between files, are missing, or cannot take their declared type."""


class SplitError(DataQualityError):
    """The rows cannot be split as the `SplitSpec` asks (e.g. too few rows of a class to stratify)."""


class QuarantineError(DataQualityError):
    """A quarantine entry does not exist, or cannot be released as asked."""


# --------------------------------------------------------------------------- canonical form


def canonical_schema(spec: PipelineSpec) -> pa.Schema:
    """The declared columns, in declared order, with their canonical Arrow types."""
    return pa.schema([pa.field(name, ARROW_TYPES[column.dtype]) for name, column in spec.columns.items()])


def to_canonical(table: pa.Table | pa.RecordBatch, spec: PipelineSpec) -> pa.Table:
    """The declared columns, in declared order, cast to their declared types.

    Undeclared columns are dropped, and so is schema metadata (e.g. pandas'),
    so the canonical table depends on the data alone. Casts are safe: a
    float with a fractional part does not become an int, text that is not a
    number does not become one.

    Raises:
        SchemaMismatch: A declared column is missing, or its values cannot be
            cast to the declared dtype; the message names the column, the
            dtype and up to five offending values.
    """
    found = table.column_names if isinstance(table, pa.Table) else table.schema.names
    missing = [c for c in spec.columns if c not in found]
    if missing:
        raise SchemaMismatch(f"declared column(s) {missing} not found; the data has columns {found}")
    arrays = []
    schema = canonical_schema(spec)
    for field in schema:
        values = table.column(field.name)
        if values.type == field.type:
            arrays.append(values)
            continue
        try:
            arrays.append(values.cast(field.type, safe=True))
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
            samples = _uncastable(values, field.type)
            why = f"offending values: {samples}" if samples else f"Arrow has no cast from {values.type}"
            raise SchemaMismatch(
                f"column {field.name!r} cannot be cast from {values.type} to declared dtype "
                f"{spec.columns[field.name].dtype!r} ({field.type}); {why} ({e})"
            ) from e
    if isinstance(table, pa.RecordBatch):
        return pa.Table.from_batches([pa.RecordBatch.from_arrays(arrays, schema=schema)], schema=schema)
    return pa.Table.from_arrays(arrays, schema=schema)


def _uncastable(values: pa.Array | pa.ChunkedArray, target: pa.DataType, limit: int = _SAMPLE) -> list[Any]:
    """Up to `limit` distinct values, in order of first appearance, that do not cast to `target`."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    try:
        unique = pc.unique(values).drop_null()
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        return []  # e.g. nested types: no per-value cast to try either
    bad: list[Any] = []
    step = 1024
    for start in range(0, len(unique), step):
        batch = unique.slice(start, step)
        try:
            batch.cast(target, safe=True)
            continue
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
            pass
        for i in range(len(batch)):
            try:
                batch.slice(i, 1).cast(target, safe=True)
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
                bad.append(batch[i].as_py())
                if len(bad) >= limit:
                    return bad
    return bad


class CanonicalParquetWriter:
    """Write record batches to a local Parquet file whose bytes depend only on the rows.

    Rows are regrouped into row groups of exactly `PARQUET_OPTIONS["row_group_size"]`
    rows (the last one shorter) whatever the incoming batch sizes, and schema
    metadata is dropped, so equal rows in equal order give identical bytes --
    the same bytes `pq.write_table` gives for the whole table at once. At most
    about two row groups are held in memory. Parquet stores no write time; the
    footer names the pyarrow version, so bytes are stable for one pyarrow
    release. The file appears atomically on `close()`; `abort()` (or an
    exception inside `with`) leaves nothing behind.

    Example:
        >>> with CanonicalParquetWriter("/tmp/data.parquet", schema) as w:  # doctest: +SKIP
        ...     for batch in batches:
        ...         w.write(batch)
    """

    def __init__(self, path: str, schema: pa.Schema) -> None:
        import pyarrow.parquet as pq

        self.path = os.path.abspath(path)
        self.schema = schema.remove_metadata()
        self.rows = 0
        self._group = PARQUET_OPTIONS["row_group_size"]
        self._pending: list[pa.RecordBatch] = []
        self._pending_rows = 0
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._tmp = f"{self.path}.tmp-{uuid.uuid4().hex}"
        options = {k: v for k, v in PARQUET_OPTIONS.items() if k != "row_group_size"}
        self._writer: Any = pq.ParquetWriter(self._tmp, self.schema, use_dictionary=dictionary_columns(self.schema), **options)

    def write(self, batch: pa.RecordBatch | pa.Table) -> None:
        """Append rows (their schema must equal the writer's, metadata aside)."""
        batches = batch.to_batches() if isinstance(batch, pa.Table) else [batch]
        for b in batches:
            if not b.schema.remove_metadata().equals(self.schema):
                raise ValueError(f"batch schema {b.schema} differs from the writer's schema {self.schema}")
            if b.num_rows == 0:
                continue
            self._pending.append(b.replace_schema_metadata(None))
            self._pending_rows += b.num_rows
            self.rows += b.num_rows
            while self._pending_rows >= self._group:
                self._flush(self._group)

    def _flush(self, rows: int) -> None:
        table = pa.Table.from_batches(self._pending, schema=self.schema)
        self._writer.write_table(table.slice(0, rows).combine_chunks(), row_group_size=self._group)
        rest = table.slice(rows)
        self._pending = rest.combine_chunks().to_batches() if rest.num_rows else []
        self._pending_rows = rest.num_rows

    def close(self) -> str:
        """Write the last row group and move the file into place; returns its path."""
        if self._writer is None:
            return self.path
        try:
            if self._pending_rows:
                self._flush(self._pending_rows)
            self._writer.close()
            self._writer = None
            os.replace(self._tmp, self.path)
        finally:
            self.abort()
        return self.path

    def abort(self) -> None:
        """Drop everything written so far."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if os.path.exists(self._tmp):
            os.remove(self._tmp)

    def __enter__(self) -> "CanonicalParquetWriter":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_parquet_deterministic(table: pa.Table, path: str) -> None:
    """Write `table` to a local Parquet file whose bytes depend only on the data (see `CanonicalParquetWriter`).

    Tables that are equal as data, whatever their chunking or pandas
    metadata, give identical files. The file appears atomically.
    """
    table = table.replace_schema_metadata(None)
    with CanonicalParquetWriter(path, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=BATCH_ROWS):
            writer.write(batch)


def read_rows(store: "FileStore", uri: str, positions: Iterable[int]) -> dict[int, dict[str, Any]]:
    """The rows at global `positions` of a Parquet file, as dicts, reading only their row groups."""
    import pyarrow.parquet as pq

    wanted = sorted(set(int(p) for p in positions))
    if not wanted:
        return {}
    out: dict[int, dict[str, Any]] = {}
    with store.open(uri, "rb") as f:
        pf = pq.ParquetFile(f)
        start = 0
        for group in range(pf.metadata.num_row_groups):
            size = pf.metadata.row_group(group).num_rows
            local = [p - start for p in wanted if start <= p < start + size]
            if local:
                rows = pf.read_row_group(group).take(pa.array(local)).to_pylist()
                out.update({start + i: _jsonable(row) for i, row in zip(local, rows)})
            start += size
    return out


# --------------------------------------------------------------------------- the suite


def expectation_configs(spec: PipelineSpec) -> list[dict[str, Any]]:
    """The expectation suite built from a pipeline's columns, as Great Expectations `type`/`kwargs` pairs.

    Table-level expectations come first (row count, exact ordered columns),
    then per declared column: it exists, its type, no nulls (unless
    `nullable`), its range (if `min`/`max`), its domain (if `domain`).

    A nullable int column may also be float64: pandas (`to_pandas`,
    `read_parquet`) turns int64 with nulls into float64. Integrality is
    still guaranteed by `to_canonical`, which refuses fractional values.

    Example:
        >>> expectation_configs(spec)[0]  # doctest: +SKIP
        {'type': 'expect_table_row_count_to_be_between', 'kwargs': {'min_value': 10, 'max_value': None}}
    """
    configs: list[dict[str, Any]] = [
        {"type": "expect_table_row_count_to_be_between", "kwargs": {"min_value": spec.min_rows, "max_value": spec.max_rows}},
        {"type": "expect_table_columns_to_match_ordered_list", "kwargs": {"column_list": list(spec.columns)}},
    ]
    for name, column in spec.columns.items():
        types = list(GX_TYPE_NAMES[column.dtype])
        if column.dtype == "int" and column.nullable:
            types.append("float64")
        configs.append({"type": "expect_column_to_exist", "kwargs": {"column": name}})
        configs.append({"type": "expect_column_values_to_be_in_type_list", "kwargs": {"column": name, "type_list": types}})
        if not column.nullable:
            configs.append({"type": "expect_column_values_to_not_be_null", "kwargs": {"column": name}})
        if column.min is not None or column.max is not None:
            configs.append(
                {
                    "type": "expect_column_values_to_be_between",
                    "kwargs": {"column": name, "min_value": column.min, "max_value": column.max},
                }
            )
        if column.domain is not None:
            configs.append({"type": "expect_column_values_to_be_in_set", "kwargs": {"column": name, "value_set": list(column.domain)}})
    return configs


def suite_expectations(spec: PipelineSpec) -> list[dict[str, Any]]:
    """The pipeline's suite: the `suite` file when the spec names one, else `expectation_configs(spec)`."""
    if spec.suite is None:
        return expectation_configs(spec)
    doc = load_suite_file(spec.suite)
    return [{"type": e["type"], "kwargs": dict(e.get("kwargs") or {})} for e in doc["expectations"]]


def suite_hash(spec: PipelineSpec) -> str:
    """Short hash of the suite and platform settings: equal hashes accept and reject the same rows."""
    payload = {
        "suite": suite_expectations(spec),
        "finite": {n: c.finite for n, c in spec.columns.items()},
        "duplicates": spec.allow_duplicate_rows,
        "policy": spec.on_bad_data,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:8]


# --------------------------------------------------------------------------- results


class ValidationReport(BaseModel):
    """The outcome of the pipeline's suite and the platform checks on one data version.

    Attributes:
        success: Every expectation and platform check passed.
        evaluated: Number of expectations and checks run.
        failed: Number that did not pass (including those that raised).
        rows: Rows validated.
        results: One dict per expectation (suite order) then per platform
            check, with keys `expectation`, `column` (None for table-level
            ones), `kwargs`, `success`, `observed_value`, `unexpected_count`,
            `unexpected_values` and `unexpected_index_list` (up to five
            samples and their row positions), `exception` (the error message
            when the expectation could not be evaluated), `source`
            (`"suite"` or `"platform"`), `row_level` (whether failing rows can
            be told apart and set aside) and `sample_rows` (the failing rows
            themselves, when known).
        suite: The suite as Great Expectations JSON (without generated ids).
    """

    model_config = ConfigDict(frozen=True)

    success: bool
    evaluated: int
    failed: int
    results: list[dict[str, Any]]
    suite: dict[str, Any]
    rows: int = 0

    def failures(self) -> list[dict[str, Any]]:
        """The results that did not pass."""
        return [r for r in self.results if not r["success"]]

    def to_markdown(self) -> str:
        """A Markdown summary and table of every expectation and check, for Dagster metadata."""
        head = "passed" if self.success else "FAILED"
        lines = [
            f"**{head}**: {self.evaluated - self.failed} of {self.evaluated} expectations passed",
            "",
            "| expectation | column | success | observed | unexpected | sample |",
            "|---|---|---|---|---|---|",
        ]
        for r in self.results:
            observed = r["exception"] if r["exception"] else r["observed_value"]
            cells = [
                r["expectation"],
                r["column"] if r["column"] is not None else "(table)",
                "yes" if r["success"] else "**no**",
                "" if observed is None else observed,
                "" if r["unexpected_count"] is None else r["unexpected_count"],
                ", ".join(repr(v) for v in r["unexpected_values"]),
            ]
            lines.append("| " + " | ".join(_md_cell(c) for c in cells) + " |")
        return "\n".join(lines) + "\n"

    def failing_rows_markdown(self, max_columns: int = 12) -> str:
        """For each failing expectation with known rows, a Markdown table of those rows."""
        parts = []
        for r in self.failures():
            rows = r.get("sample_rows") or []
            if not rows:
                continue
            where = f" on `{r['column']}`" if r["column"] else ""
            columns = [c for c in rows[0] if c != "_row"]
            if r["column"] in columns and len(columns) > max_columns:
                columns.remove(r["column"])
                columns = [r["column"], *columns]
            shown = columns[:max_columns]
            more = f" (first {max_columns} of {len(columns)} columns)" if len(columns) > max_columns else ""
            parts.append(f"**{r['expectation']}**{where}: {r['unexpected_count']} unexpected{more}")
            parts.append("")
            parts.append("| row | " + " | ".join(shown) + " |")
            parts.append("|---|" + "---|" * len(shown))
            for row in rows:
                parts.append("| " + " | ".join(_md_cell(v) for v in [row["_row"], *(row.get(c) for c in shown)]) + " |")
            parts.append("")
        return "\n".join(parts) if parts else "no failing rows\n"


def _md_cell(value: Any, width: int = 120) -> str:
    text = str(value).replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= width else text[: width - 1] + "…"


def _result_dict(result: Any, row_level: bool) -> dict[str, Any]:
    config = result.expectation_config
    kwargs = {k: v for k, v in config.kwargs.items() if k != "batch_id"}
    body = result.result or {}
    return {
        "expectation": config.type,
        "column": kwargs.get("column"),
        "kwargs": _jsonable(kwargs),
        "success": bool(result.success),
        "observed_value": _jsonable(body.get("observed_value")),
        "unexpected_count": _jsonable(body.get("unexpected_count")),
        "unexpected_values": _jsonable(list(body.get("partial_unexpected_list") or [])[:_SAMPLE]),
        "unexpected_index_list": _jsonable(list(body.get("partial_unexpected_index_list") or [])[:_SAMPLE]),
        "exception": _exception_message(result.exception_info),
        "source": SUITE_CHECK,
        "row_level": row_level and not _exception_message(result.exception_info),
        "sample_rows": [],
    }


def _exception_message(info: Any) -> Optional[str]:
    """The message of a raised expectation; GE nests it under metric ids when a metric failed."""
    if not isinstance(info, dict):
        return None
    entries = [info] if "raised_exception" in info else [v for v in info.values() if isinstance(v, dict)]
    messages = [str(e.get("exception_message")) for e in entries if e.get("raised_exception")]
    return "; ".join(messages) or None


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else value
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if value is pd.NA or value is pd.NaT:
        return None
    return str(value)


# --------------------------------------------------------------------------- platform checks


class _FiniteCheck:
    """NaN and +-inf in the float columns that must be finite."""

    def __init__(self, columns: Sequence[str]) -> None:
        self.columns = list(columns)
        self.counts = {c: {"nan": 0, "+inf": 0, "-inf": 0} for c in columns}
        self.samples: dict[str, list[tuple[int, Any]]] = {c: [] for c in columns}

    @staticmethod
    def mask(col: pa.Array) -> pa.Array:
        return pc.fill_null(pc.or_(pc.is_nan(col), pc.is_inf(col)), False)

    def update(self, batch: pa.RecordBatch, offset: int) -> None:
        for name in self.columns:
            col = batch.column(name)
            bad = self.mask(col)
            if not pc.any(bad).as_py():
                continue
            counts = self.counts[name]
            counts["nan"] += pc.sum(pc.fill_null(pc.is_nan(col), False)).as_py() or 0
            counts["+inf"] += pc.sum(pc.fill_null(pc.equal(col, math.inf), False)).as_py() or 0
            counts["-inf"] += pc.sum(pc.fill_null(pc.equal(col, -math.inf), False)).as_py() or 0
            if len(self.samples[name]) < _SAMPLE:
                where = pc.indices_nonzero(bad).slice(0, _SAMPLE - len(self.samples[name]))
                values = pc.take(col, where).to_pylist()
                self.samples[name].extend((offset + i, v) for i, v in zip(where.to_pylist(), values))

    def results(self) -> list[dict[str, Any]]:
        out = []
        for name in self.columns:
            counts = self.counts[name]
            total = sum(counts.values())
            out.append(
                _platform_result(
                    FINITE_EXPECTATION,
                    name,
                    success=total == 0,
                    observed=counts,
                    unexpected=total,
                    samples=[("nan" if isinstance(v, float) and math.isnan(v) else v) for _, v in self.samples[name]],
                    positions=[p for p, _ in self.samples[name]],
                )
            )
        return out


def _platform_result(
    name: str, column: Optional[str], success: bool, observed: Any, unexpected: int, samples: list[Any], positions: list[int]
) -> dict[str, Any]:
    return {
        "expectation": name,
        "column": column,
        "kwargs": {} if column is None else {"column": column},
        "success": success,
        "observed_value": _jsonable(observed),
        "unexpected_count": unexpected,
        "unexpected_values": _jsonable(samples),
        "unexpected_index_list": positions,
        "exception": None,
        "source": PLATFORM_CHECK,
        "row_level": True,
        "sample_rows": [],
    }


_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _mix(h: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, vectorised: spreads every input bit over the 64-bit hash."""
    h = h ^ (h >> np.uint64(30))
    h = h * _MIX1
    h = h ^ (h >> np.uint64(27))
    h = h * _MIX2
    return h ^ (h >> np.uint64(31))


def _column_hash(col: pa.Array) -> np.ndarray:
    """A uint64 per value; equal values (null with null, NaN with NaN, 0.0 with -0.0) hash equal."""
    n = len(col)
    if _is_text_type(col.type):
        encoded = col.dictionary_encode()
        words = pd.util.hash_array(np.asarray(encoded.dictionary.to_pylist(), dtype=object), categorize=False)
        indices = encoded.indices.fill_null(0).to_numpy(zero_copy_only=False)
        values = words[indices] if len(words) else np.zeros(n, dtype=np.uint64)
    elif pa.types.is_floating(col.type):
        floats = col.fill_null(0.0).to_numpy(zero_copy_only=False).astype(np.float64, copy=True)
        floats[floats == 0.0] = 0.0  # -0.0 == 0.0
        floats[np.isnan(floats)] = np.nan  # one NaN bit pattern
        values = floats.view(np.uint64)
    elif pa.types.is_boolean(col.type):
        values = col.fill_null(False).to_numpy(zero_copy_only=False).astype(np.uint64)
    elif pa.types.is_integer(col.type) or pa.types.is_temporal(col.type):
        values = col.fill_null(0).cast(pa.int64()).to_numpy(zero_copy_only=False).view(np.uint64)
    else:  # nested and other types never appear in canonical data; hash their text form
        values = pd.util.hash_array(np.asarray([repr(v) for v in col.to_pylist()], dtype=object), categorize=False)
    if col.null_count:
        values = values ^ (pc.is_null(col).to_numpy(zero_copy_only=False).astype(np.uint64) * _NULL_TAG)
    return values


_NULL_TAG = np.uint64(0x9E3779B97F4A7C15)
_ODD = np.uint64(0xD6E8FEB86659FD93)


def row_hashes(batch: pa.RecordBatch) -> np.ndarray:
    """A 64-bit hash of every row over all columns, in column order.

    Each column's value bits are folded in by xor and multiplication with an
    odd constant (a bijection, so rows differing in one column differ in the
    running hash), then splitmix64's finaliser spreads the bits.
    """
    h = np.full(batch.num_rows, np.uint64(0x243F6A8885A308D3), dtype=np.uint64)
    for col in batch.columns:
        h ^= _column_hash(col)
        h *= _ODD
        h ^= h >> np.uint64(29)
    return _mix(h)


def _is_text_type(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


class _DuplicateRows:
    """Rows equal to an earlier row, found by 64-bit row hashes in bounded memory.

    Hashes and row positions stay in memory when they fit `memory_bytes`;
    otherwise they are spilled to 2^bits bucket files on disk, partitioned
    by the hash's top bits, and each bucket is then sorted on its own. A hash
    collision between different rows (probability about rows^2 / 2^65)
    would count as a duplicate.
    """

    def __init__(self, total_rows: int, workdir: str, memory_bytes: int = DEDUP_MEMORY_BYTES) -> None:
        needed = max(1, total_rows) * 16
        self.bits = max(0, math.ceil(math.log2(needed / memory_bytes))) if needed > memory_bytes else 0
        self.workdir = workdir
        self._hashes: list[np.ndarray] = []
        self._positions: list[np.ndarray] = []
        self.count = 0
        self.positions = np.zeros(0, dtype=np.int64)
        self.samples: list[tuple[int, int]] = []  # (duplicate row, first row with the same values)

    def _bucket_path(self, b: int, kind: str) -> str:
        return os.path.join(self.workdir, f"dedup-{b:05d}.{kind}")

    def update(self, batch: pa.RecordBatch, offset: int) -> None:
        h = row_hashes(batch)
        pos = np.arange(offset, offset + batch.num_rows, dtype=np.int64)
        if not self.bits:
            self._hashes.append(h)
            self._positions.append(pos)
            return
        bucket = (h >> np.uint64(64 - self.bits)).astype(np.uint16 if self.bits <= 16 else np.int64)
        order = np.argsort(bucket, kind="stable")  # a radix sort for 16-bit keys
        bucket, h, pos = bucket[order], h[order], pos[order]
        bounds = np.searchsorted(bucket, np.arange((1 << self.bits) + 1))
        for b in np.unique(bucket):
            lo, hi = bounds[b], bounds[b + 1]
            with open(self._bucket_path(int(b), "h"), "ab") as f:
                h[lo:hi].tofile(f)
            with open(self._bucket_path(int(b), "p"), "ab") as f:
                pos[lo:hi].tofile(f)

    def _buckets(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        if not self.bits:
            if self._hashes:
                yield np.concatenate(self._hashes), np.concatenate(self._positions)
            return
        for b in range(1 << self.bits):
            hp, pp = self._bucket_path(b, "h"), self._bucket_path(b, "p")
            if os.path.exists(hp):
                yield np.fromfile(hp, dtype=np.uint64), np.fromfile(pp, dtype=np.int64)
                os.remove(hp)
                os.remove(pp)

    def finish(self) -> None:
        dups: list[np.ndarray] = []
        samples: list[tuple[int, int]] = []
        for h, pos in self._buckets():
            # Within a bucket rows arrive in position order, so "first" is the earliest row.
            repeat = pd.Series(h, copy=False).duplicated(keep="first").to_numpy()
            if not repeat.any():
                continue
            dups.append(pos[repeat])
            for i in np.flatnonzero(repeat)[:_SAMPLE]:
                samples.append((int(pos[i]), int(pos[np.flatnonzero(h == h[i])[0]])))
        self._hashes, self._positions = [], []
        self.positions = np.sort(np.concatenate(dups)) if dups else np.zeros(0, dtype=np.int64)
        self.count = int(len(self.positions))
        self.samples = sorted(samples)[:_SAMPLE]

    def result(self) -> dict[str, Any]:
        return _platform_result(
            UNIQUE_ROWS_EXPECTATION,
            None,
            success=self.count == 0,
            observed={"duplicate_rows": self.count},
            unexpected=self.count,
            samples=[f"row {d} repeats row {f}" for d, f in self.samples],
            positions=[d for d, _ in self.samples],
        )


# --------------------------------------------------------------------------- profile


class _Profiler:
    """Per-column statistics of a snapshot, gathered while it streams by.

    For each column: rows, nulls (null or NaN), NaN and +-inf counts, finite
    min and max, the distinct values when there are at most
    `PROFILE_DOMAIN_LIMIT`, and category counts (up to `CATEGORY_LIMIT`) for
    text, bool and int columns. A seeded uniform sample of about
    `PROFILE_SAMPLE_ROWS` rows (all rows of smaller data) is kept for numeric
    drift; the same rows in the same order always give the same sample.
    """

    def __init__(self, schema: pa.Schema, total_rows: int, seed: int = 0) -> None:
        self.schema = schema
        self.total = total_rows
        self.seed = seed
        self.rows = 0
        self.batches = 0
        self.stats: dict[str, dict[str, Any]] = {
            f.name: {"type": str(f.type), "nulls": 0, "nan": 0, "posinf": 0, "neginf": 0, "min": None, "max": None}
            for f in schema
        }
        self._distinct: dict[str, Optional[set]] = {f.name: set() for f in schema if not pa.types.is_floating(f.type)}
        self._counts: dict[str, Optional[dict]] = {f.name: {} for f in schema if not pa.types.is_floating(f.type)}
        self._sample: list[pa.RecordBatch] = []

    def update(self, batch: pa.RecordBatch) -> None:
        for f in self.schema:
            col = batch.column(f.name)
            st = self.stats[f.name]
            floating = pa.types.is_floating(f.type)
            st["nulls"] += (pc.sum(pc.is_null(col, nan_is_null=True)).as_py() or 0) if floating else col.null_count
            present = col.drop_null()
            if floating:
                nan = pc.is_nan(present)
                inf = pc.is_inf(present)
                st["nan"] += pc.sum(nan).as_py() or 0
                st["posinf"] += pc.sum(pc.equal(present, math.inf)).as_py() or 0
                st["neginf"] += pc.sum(pc.equal(present, -math.inf)).as_py() or 0
                present = pc.filter(present, pc.invert(pc.or_(nan, inf)))
            if len(present):
                bounds = pc.min_max(present)
                lo, hi = bounds["min"].as_py(), bounds["max"].as_py()
                st["min"] = lo if st["min"] is None else min(st["min"], lo)
                st["max"] = hi if st["max"] is None else max(st["max"], hi)
            counts = self._counts.get(f.name)
            if counts is not None and len(present):
                vc = pc.value_counts(present)
                for value, n in zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist()):
                    counts[value] = counts.get(value, 0) + n
                if len(counts) > CATEGORY_LIMIT:
                    self._counts[f.name] = None
        share = min(1.0, PROFILE_SAMPLE_ROWS / max(1, self.total))
        if share >= 1.0:
            self._sample.append(batch)
        else:
            rng = np.random.default_rng([self.seed, self.batches])
            keep = rng.random(batch.num_rows) < share
            self._sample.append(batch.filter(pa.array(keep)))
        self.rows += batch.num_rows
        self.batches += 1

    def profile(self) -> dict[str, Any]:
        columns = {}
        for f in self.schema:
            st = dict(self.stats[f.name])
            counts = self._counts.get(f.name)
            if counts is not None:
                st["counts"] = sorted(([_jsonable(k), v] for k, v in counts.items()), key=lambda kv: (-kv[1], str(kv[0])))
                st["distinct"] = sorted(_jsonable(k) for k in counts) if len(counts) <= PROFILE_DOMAIN_LIMIT else None
            else:
                st["counts"] = None
                st["distinct"] = None
            st["min"], st["max"] = _jsonable(st["min"]), _jsonable(st["max"])
            columns[f.name] = st
        return {"rows": self.rows, "columns": columns}

    def sample(self) -> pa.Table:
        return pa.Table.from_batches(self._sample, schema=self.schema) if self._sample else self.schema.empty_table()


def profile_to_suite(profile: dict[str, Any], name: str, *, row_margin: float = 0.5, range_margin: float = 0.0) -> dict[str, Any]:
    """A Great Expectations suite describing a trusted snapshot's profile, to be reviewed and edited.

    Expectations: the row count within `row_margin` (a share) of the
    profiled count, the exact ordered columns; per column its type, not null
    (when it had no nulls), its observed range widened by `range_margin` of
    its width (numeric columns), and its set of values (when it had at most
    `PROFILE_DOMAIN_LIMIT` distinct ones and is text, bool or int).

    Args:
        profile: A profile from `profile_snapshot` or `validate_snapshot`.
        name: The suite's name (e.g. the pipeline key).
        row_margin: Allowed relative change of the row count (0.5: half to 1.5 times).
        range_margin: Share of each range's width added on both sides.

    Returns:
        The suite as GE 1.x JSON: `{"name", "expectations": [{"type", "kwargs", "meta"}], "meta"}`.
    """
    rows = profile["rows"]
    expectations: list[dict[str, Any]] = [
        {
            "type": "expect_table_row_count_to_be_between",
            "kwargs": {"min_value": max(1, math.floor(rows * (1 - row_margin))), "max_value": math.ceil(rows * (1 + row_margin))},
        },
        {"type": "expect_table_columns_to_match_ordered_list", "kwargs": {"column_list": list(profile["columns"])}},
    ]
    kinds = {"int64": "int", "double": "float", "string": "str", "large_string": "str", "bool": "bool"}
    for column, st in profile["columns"].items():
        kind = kinds.get(st["type"])
        if kind is not None:
            expectations.append({"type": "expect_column_values_to_be_in_type_list", "kwargs": {"column": column, "type_list": GX_TYPE_NAMES[kind]}})
        if st["nulls"] == 0:
            expectations.append({"type": "expect_column_values_to_not_be_null", "kwargs": {"column": column}})
        if kind in ("int", "float") and st["min"] is not None and st["max"] is not None:
            pad = (st["max"] - st["min"]) * range_margin
            low, high = st["min"] - pad, st["max"] + pad
            if kind == "int":
                low, high = math.floor(low), math.ceil(high)
            expectations.append({"type": "expect_column_values_to_be_between", "kwargs": {"column": column, "min_value": low, "max_value": high}})
        if kind in ("int", "str", "bool") and st.get("distinct") is not None:
            expectations.append({"type": "expect_column_values_to_be_in_set", "kwargs": {"column": column, "value_set": st["distinct"]}})
    for e in expectations:
        e["meta"] = {"generated_from": "profile"}
    return {"name": name, "expectations": expectations, "meta": {"profiled_rows": rows}}


# --------------------------------------------------------------------------- validation


@dataclasses.dataclass
class SnapshotValidation:
    """Everything one pass over a snapshot found.

    Attributes:
        report: Suite and platform results, with failing rows attached.
        profile: Per-column statistics (see `_Profiler`).
        sample: The profile's row sample (for drift).
        docs_html: GE's Data Docs page for the suite results.
        suite: The suite engine, which can re-judge rows (`set_aside_rows`).
        duplicate_positions: Sorted positions of rows that repeat an earlier row.
    """

    report: ValidationReport
    profile: dict[str, Any]
    sample: pa.Table
    docs_html: str
    suite: "ArrowSuite"
    duplicate_positions: np.ndarray


def _validate_batches(
    batches: Iterable[pa.RecordBatch], schema: pa.Schema, total_rows: int, spec: PipelineSpec, workdir: str, run_name: Optional[str], seed: int = 0
) -> tuple[ValidationReport, dict[str, Any], pa.Table, str, "ArrowSuite", np.ndarray]:
    """One pass of suite, platform checks and profiler; Data Docs only when `run_name` is given."""
    from trainyard.data.expectations import ArrowSuite, render_data_docs

    suite = ArrowSuite(suite_expectations(spec), schema, name=spec.key)
    floats = [
        n for n, c in spec.columns.items() if c.dtype == "float" and c.finite and n in schema.names and pa.types.is_floating(schema.field(n).type)
    ]
    finite = _FiniteCheck(floats)
    dedup = None if spec.allow_duplicate_rows else _DuplicateRows(total_rows, workdir)
    profiler = _Profiler(schema, total_rows, seed=seed)
    offset = 0
    for batch in batches:
        suite.update(batch)
        finite.update(batch, offset)
        if dedup is not None:
            dedup.update(batch, offset)
        profiler.update(batch)
        offset += batch.num_rows
    ge_results = suite.results()
    results = [_result_dict(r, suite.map_condition(i) is not None) for i, r in enumerate(ge_results)]
    results += finite.results()
    duplicates = np.zeros(0, dtype=np.int64)
    if dedup is not None:
        dedup.finish()
        results.append(dedup.result())
        duplicates = dedup.positions
    failed = sum(1 for r in results if not r["success"])
    report = ValidationReport(
        success=failed == 0, evaluated=len(results), failed=failed, results=results, suite=suite.suite_json(), rows=offset
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
        report, *_ = _validate_batches(table.to_batches(max_chunksize=BATCH_ROWS), table.schema, table.num_rows, spec, work, None)
    positions = {p for r in report.failures() for p in r["unexpected_index_list"] if r["row_level"]}
    if not positions:
        return report
    rows = {p: _jsonable(table.slice(p, 1).to_pylist()[0]) for p in sorted(positions)}
    return _with_sample_rows(report, rows)


def _with_sample_rows(report: ValidationReport, rows: dict[int, dict[str, Any]]) -> ValidationReport:
    results = []
    for r in report.results:
        if not r["success"] and r["row_level"]:
            r = {**r, "sample_rows": [{"_row": p, **rows[p]} for p in r["unexpected_index_list"] if p in rows]}
        results.append(r)
    return report.model_copy(update={"results": results})


def validate_snapshot(
    store: "FileStore", uri: str, spec: PipelineSpec, *, run_name: Optional[str] = None, batch_rows: int = BATCH_ROWS
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
    return SnapshotValidation(report=report, profile=profile, sample=sample, docs_html=docs, suite=suite, duplicate_positions=dups)


def profile_snapshot(store: "FileStore", uri: str, batch_rows: int = BATCH_ROWS) -> tuple[dict[str, Any], pa.Table]:
    """The profile and sample of a Parquet snapshot (one streaming pass, no suite)."""
    import pyarrow.parquet as pq

    with store.open(uri, "rb") as f:
        pf = pq.ParquetFile(f)
        profiler = _Profiler(pf.schema_arrow.remove_metadata(), pf.metadata.num_rows)
        for batch in pf.iter_batches(batch_size=batch_rows, use_threads=True):
            profiler.update(batch)
    return profiler.profile(), profiler.sample()


# --------------------------------------------------------------------------- policy


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


def decide(report: ValidationReport, drift_rows: Sequence[dict[str, Any]], spec: PipelineSpec, release: Optional[dict[str, Any]] = None) -> Verdict:
    """Apply the pipeline's `on_bad_data` policy to validation and drift results.

    - Everything passed: accepted.
    - Released by a person (`release_quarantine`): accepted as it is, with the
      failures as warnings.
    - "warn": drift is a warning; failing row-level checks set their rows
      aside; table-level failures (row count, columns, types of whole
      columns, aggregates, expectations that raised) still reject.
    - "reject": any failure or drift beyond a threshold rejects.
    """
    failures = report.failures()
    drifted = [d for d in drift_rows if d["drifted"]]
    problems = [f"{report.failed} of {report.evaluated} expectations failed"] if failures else []
    problems += [f"drift above threshold in {[d['column'] for d in drifted]}"] if drifted else []
    details = [_summary(r) for r in failures] + [_drift_summary(d) for d in drifted]
    if not failures and not drifted:
        return Verdict(accepted=True, set_aside=False, reasons=[], warnings=[])
    if release is not None:
        note = f"released by {release['released_by']} at {release['released_at']}: {release['reason']}"
        return Verdict(accepted=True, set_aside=False, reasons=[], warnings=[note, *details], release=release)
    table_level = [r for r in failures if not r["row_level"]]
    if spec.on_bad_data == "warn" and not table_level:
        rows = sum(r["unexpected_count"] or 0 for r in failures)
        aside = [f"{rows} failing value(s) set aside in quarantine"] if failures else []
        return Verdict(accepted=True, set_aside=bool(failures), reasons=[], warnings=[*aside, *details])
    return Verdict(accepted=False, set_aside=False, reasons=problems + details, warnings=[])


def set_aside_rows(
    store: "FileStore", uri: str, validation: SnapshotValidation, spec: PipelineSpec, accepted_path: str, rejected_path: str, batch_rows: int = BATCH_ROWS
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
        validation.report.results[i]["column"] for i in failing if validation.report.results[i]["expectation"] == FINITE_EXPECTATION
    ]
    duplicates = any(validation.report.results[i]["expectation"] == UNIQUE_ROWS_EXPECTATION for i in failing)
    dup_positions = validation.duplicate_positions if duplicates else np.zeros(0, dtype=np.int64)
    import pyarrow.parquet as pq

    offset = 0
    with store.open(uri, "rb") as f:
        pf = pq.ParquetFile(f)
        schema = pf.schema_arrow.remove_metadata()
        rejected_schema = schema.append(pa.field("_row", pa.int64()))
        with CanonicalParquetWriter(accepted_path, schema) as good, CanonicalParquetWriter(rejected_path, rejected_schema) as bad:
            for batch in pf.iter_batches(batch_size=batch_rows, use_threads=True):
                batch = batch.replace_schema_metadata(None)
                n = batch.num_rows
                mask = np.zeros(n, dtype=bool)
                for i in suite_checks:
                    mask |= validation.suite.unexpected_mask(i, batch).to_numpy(zero_copy_only=False)
                for column in finite_columns:
                    mask |= _FiniteCheck.mask(batch.column(column)).to_numpy(zero_copy_only=False)
                if len(dup_positions):
                    lo, hi = np.searchsorted(dup_positions, [offset, offset + n])
                    mask[dup_positions[lo:hi] - offset] = True
                keep = pa.array(~mask)
                good.write(batch.filter(keep))
                if mask.any():
                    where = np.flatnonzero(mask)
                    rows = batch.filter(pa.array(mask))
                    bad.write(pa.RecordBatch.from_arrays([*rows.columns, pa.array(where + offset)], schema=rejected_schema))
                offset += n
        return good.rows, bad.rows


# --------------------------------------------------------------------------- one validated version


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


def _load_profile(store: "FileStore", latest: dict[str, Any]) -> tuple[dict[str, Any], pa.Table]:
    import pyarrow.parquet as pq

    if latest.get("profile_uri") and store.exists(latest["profile_uri"]):
        with store.open(latest["sample_uri"], "rb") as f:
            sample = pq.read_table(f)
        return store.read_json(latest["profile_uri"]), sample
    return profile_snapshot(store, latest["raw_uri"])  # versions validated before profiles were kept


def validate_version(store: "FileStore", spec: PipelineSpec, raw: dict[str, Any]) -> VersionOutcome:
    """Validate one raw snapshot, measure drift, apply the policy, and quarantine or split it.

    Steps: `validate_snapshot`; Data Docs to `data_docs/<team>/<name>/<md5>/index.html`;
    `drift` against the version `validated/latest.json` points to; `decide`
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
    docs_uri = store.uri("data_docs", spec.team, spec.name, md5, "index.html")
    store.write_bytes(docs_uri, validation.docs_html.encode("utf-8"))
    latest_uri = store.uri("data", spec.team, spec.name, "validated", "latest.json")
    latest = store.read_json(latest_uri) if store.exists(latest_uri) else None
    drift_rows: list[dict[str, Any]] = []
    if latest is not None and latest["md5"] != md5:
        prev_profile, prev_sample = _load_profile(store, latest)
        drift_rows = drift(prev_profile, prev_sample, validation.profile, validation.sample, spec)
    elif latest is not None and latest.get("drift_uri") and store.exists(latest["drift_uri"]):
        drift_rows = store.read_json(latest["drift_uri"])  # this version again: the drift measured when it was new
    verdict = decide(validation.report, drift_rows, spec, release_of(store, spec.team, spec.name, md5))
    if not verdict.accepted:
        where = quarantine_snapshot(
            store,
            spec.team,
            spec.name,
            md5,
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
        return VersionOutcome(verdict, validation, drift_rows, docs_uri, where, None)
    split_id = f"{md5}-{spec.fingerprint()}" + (f"-{suite_hash(spec)}" if verdict.set_aside else "")
    base = store.uri("data", spec.team, spec.name, "validated", split_id)
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
                {"raw": raw, "policy": spec.on_bad_data, "reasons": verdict.warnings, "rows": set_aside, "validation": validation.report.model_dump(mode="json")},
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
    value = {"md5": md5, "split_id": split_id, **uris, "rows": parts, "set_aside": set_aside, "profile": f"{base}/profile.json"}
    return VersionOutcome(verdict, validation, drift_rows, docs_uri, where, value)


# --------------------------------------------------------------------------- split


def split_positions(labels: Optional[np.ndarray], n: int, spec: PipelineSpec) -> np.ndarray:
    """Which part each of `n` rows goes to: 0 train, 1 val, 2 test (int8).

    The test share is taken first, then the validation share of the rest,
    both with `spec.split.seed`, stratified on `labels` when given.

    Raises:
        SplitError: The rows cannot be split as asked.
    """
    from sklearn.model_selection import train_test_split

    fractions = spec.split
    positions = np.arange(n)
    try:
        rest, test = train_test_split(
            positions, test_size=fractions.test_fraction, random_state=fractions.seed, shuffle=True, stratify=labels
        )
        train, val = train_test_split(
            rest,
            test_size=fractions.val_fraction / (1.0 - fractions.test_fraction),
            random_state=fractions.seed,
            shuffle=True,
            stratify=labels[rest] if labels is not None else None,
        )
    except ValueError as e:
        how = f"stratified on {spec.target!r}" if labels is not None else "at random"
        counts = ""
        if labels is not None:
            values, freq = np.unique(labels, return_counts=True)
            counts = f"; rows per class: {dict(zip(_jsonable(values.tolist()), freq.tolist()))}"
        raise SplitError(
            f"cannot split {n} rows {how} with val_fraction={fractions.val_fraction}, "
            f"test_fraction={fractions.test_fraction}: {e}{counts}"
        ) from e
    parts = np.zeros(n, dtype=np.int8)
    parts[val] = 1
    parts[test] = 2
    return parts


def _stratify(spec: PipelineSpec) -> bool:
    declared = spec.columns[spec.target]
    return declared.dtype in ("int", "str", "bool") or declared.domain is not None


def split(df: pd.DataFrame, spec: PipelineSpec) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Deterministic train/val/test split, stratified on the target when it is a class label.

    The target is stratified on when its dtype is int, str or bool or it
    declares a domain; a float target without a domain is split at random
    (see `split_positions`). Each part keeps the input's row order and gets a
    fresh index, so the same input always gives the same rows in the same order.

    Returns:
        (train, val, test).

    Raises:
        SplitError: The rows cannot be split as asked, e.g. a class has too
            few rows to appear in every part.
    """
    target = spec.target
    if target not in df.columns:
        raise SchemaMismatch(f"target column {target!r} not found; the data has columns {list(df.columns)}")
    labels = df[target].to_numpy() if _stratify(spec) else None
    parts = split_positions(labels, len(df), spec)
    return tuple(df.iloc[np.flatnonzero(parts == k)].reset_index(drop=True) for k in range(3))  # type: ignore[return-value]


def split_snapshot(store: "FileStore", uri: str, spec: PipelineSpec, out_dir: str, batch_rows: int = BATCH_ROWS) -> dict[str, int]:
    """Write the split of a Parquet snapshot to `out_dir/{train,val,test}.parquet` in canonical form.

    Only the target column is read whole (to stratify); rows then stream to
    the three writers, keeping their order.

    Returns:
        Rows per part.
    """
    import pyarrow.parquet as pq

    with store.open(uri, "rb") as f:
        pf = pq.ParquetFile(f)
        n = pf.metadata.num_rows
        schema = pf.schema_arrow.remove_metadata()
        if spec.target not in schema.names:
            raise SchemaMismatch(f"target column {spec.target!r} not found; the data has columns {schema.names}")
        labels = pf.read(columns=[spec.target]).column(0).to_numpy() if _stratify(spec) else None
        parts = split_positions(labels, n, spec)
        del labels
        names = ("train", "val", "test")
        writers = [CanonicalParquetWriter(os.path.join(out_dir, f"{name}.parquet"), schema) for name in names]
        try:
            offset = 0
            for batch in pf.iter_batches(batch_size=batch_rows, use_threads=True):
                batch = batch.replace_schema_metadata(None)
                which = parts[offset : offset + batch.num_rows]
                for k, writer in enumerate(writers):
                    writer.write(batch.filter(pa.array(which == k)))
                offset += batch.num_rows
        except BaseException:
            for writer in writers:
                writer.abort()
            raise
        for writer in writers:
            writer.close()
    return {name: w.rows for name, w in zip(names, writers)}


# --------------------------------------------------------------------------- drift


def psi(prev: pd.Series, cur: pd.Series, bins: int = 10, categories: Optional[Sequence[Any]] = None) -> float:
    """Population stability index of `cur` against `prev`.

    PSI = sum over bins of (cur% - prev%) * ln(cur% / prev%). Numeric series
    use up to `bins` quantile bins of `prev` (fewer when quantiles
    coincide); bool, text and other non-numeric series, or any series given
    `categories`, use one bin per category (values outside `categories`
    share one extra bin). Nulls get a bin of their own. An empty bin on
    either side counts as `PSI_EPSILON`. Rule of thumb: < 0.1 stable,
    0.1-0.25 moderate shift, > 0.25 large shift.

    Args:
        prev: The reference (previous) values.
        cur: The new values.
        bins: Number of quantile bins for numeric series.
        categories: The known categories (e.g. a column's domain).

    Raises:
        ValueError: `bins` < 1 or either series is empty.
    """
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    if len(prev) == 0 or len(cur) == 0:
        raise ValueError(f"psi needs values on both sides; got {len(prev)} previous and {len(cur)} current")
    numeric = categories is None and all(
        pd.api.types.is_numeric_dtype(s) and not pd.api.types.is_bool_dtype(s) for s in (prev, cur)
    )
    if numeric:
        p_counts, c_counts = _quantile_counts(prev, cur, bins)
    else:
        p_counts, c_counts = _category_counts(prev, cur, categories)
    return _psi_of_counts(p_counts, c_counts)


def _psi_of_counts(p_counts: np.ndarray, c_counts: np.ndarray) -> float:
    p = np.maximum(p_counts / p_counts.sum(), PSI_EPSILON)
    c = np.maximum(c_counts / c_counts.sum(), PSI_EPSILON)
    return float(np.sum((c - p) * np.log(c / p)))


def _quantile_counts(prev: pd.Series, cur: pd.Series, bins: int) -> tuple[np.ndarray, np.ndarray]:
    p_values = prev.dropna().to_numpy(dtype=float)
    c_values = cur.dropna().to_numpy(dtype=float)
    inner = np.linspace(0.0, 1.0, bins + 1)[1:-1]
    edges = np.unique(np.quantile(p_values, inner)) if len(p_values) else np.array([])

    def counts(values: np.ndarray, nulls: int) -> np.ndarray:
        # Bin i holds edges[i-1] < x <= edges[i]; the last bin is open above.
        idx = np.searchsorted(edges, values, side="left")
        return np.append(np.bincount(idx, minlength=len(edges) + 1), nulls).astype(float)

    return counts(p_values, int(prev.isna().sum())), counts(c_values, int(cur.isna().sum()))


def _category_counts(
    prev: pd.Series, cur: pd.Series, categories: Optional[Sequence[Any]]
) -> tuple[np.ndarray, np.ndarray]:
    p_freq = prev.dropna().value_counts()
    c_freq = cur.dropna().value_counts()
    known = list(dict.fromkeys([*p_freq.index, *c_freq.index])) if categories is None else list(dict.fromkeys(categories))

    def counts(freq: pd.Series, series: pd.Series) -> np.ndarray:
        inside = [int(freq.get(k, 0)) for k in known]
        other = int(series.notna().sum()) - sum(inside)
        return np.array([*inside, other, int(series.isna().sum())], dtype=float)

    return counts(p_freq, prev), counts(c_freq, cur)


def drift_report(prev_df: pd.DataFrame, cur_df: pd.DataFrame, spec: PipelineSpec) -> dict[str, float]:
    """PSI of every feature column of `cur_df` against `prev_df`, in declared order.

    Columns with a `domain` are compared by category over that domain; text
    and bool columns by observed category; other numeric columns by
    quantile bins of the previous data. The target is not included.

    Raises:
        SchemaMismatch: A feature column is missing from either frame.
    """
    report: dict[str, float] = {}
    for name in spec.features:
        for frame, label in ((prev_df, "previous"), (cur_df, "current")):
            if name not in frame.columns:
                raise SchemaMismatch(f"feature column {name!r} not found in the {label} data; it has {list(frame.columns)}")
        report[name] = psi(prev_df[name], cur_df[name], categories=spec.columns[name].domain)
    return report


def _categorical(spec: PipelineSpec, name: str) -> bool:
    column = spec.columns[name]
    return column.domain is not None or column.dtype in ("str", "bool")


def drift(
    prev_profile: dict[str, Any], prev_sample: pa.Table, cur_profile: dict[str, Any], cur_sample: pa.Table, spec: PipelineSpec
) -> list[dict[str, Any]]:
    """Per-feature drift of a validated version against the previous one, from their profiles.

    Categorical features (a `domain`, or text/bool) get PSI over their
    category counts, which profiles keep exactly. Numeric features get PSI
    over quantile bins of the previous sample and the two-sample KS
    statistic (SciPy) over the finite sampled values; both samples are the
    whole data when it has at most `PROFILE_SAMPLE_ROWS` rows, so then the
    PSI equals `drift_report`'s.

    Returns:
        One dict per feature: `column`, `method`, `psi`, `ks`, `ks_pvalue`,
        `drifted` (PSI above `spec.max_drift_psi` or KS above
        `spec.max_drift_ks`), and `note` when a test was skipped.
    """
    from scipy.stats import ks_2samp

    rows = []
    for name in spec.features:
        row: dict[str, Any] = {"column": name, "psi": None, "ks": None, "ks_pvalue": None, "drifted": False, "note": ""}
        prev_st = prev_profile["columns"].get(name)
        cur_st = cur_profile["columns"].get(name)
        if prev_st is None or cur_st is None:
            row.update(method="none", note="column missing from the previous version")
            rows.append(row)
            continue
        if _categorical(spec, name):
            row["method"] = "psi-categories"
            if prev_st.get("counts") is None or cur_st.get("counts") is None:
                row["note"] = f"more than {CATEGORY_LIMIT} categories; not measured"
            else:
                row["psi"] = _psi_of_profile_counts(prev_st, prev_profile["rows"], cur_st, cur_profile["rows"], spec.columns[name].domain)
        else:
            row["method"] = "psi-quantiles+ks"
            p = prev_sample.column(name).to_pandas().astype(float)
            c = cur_sample.column(name).to_pandas().astype(float)
            if len(p) and len(c):
                row["psi"] = psi(p, c)
                pf, cf = p[np.isfinite(p)], c[np.isfinite(c)]
                if len(pf) and len(cf):
                    with warnings.catch_warnings():
                        # SciPy falls back from the exact to the asymptotic p-value on ties, and says so.
                        warnings.simplefilter("ignore", RuntimeWarning)
                        test = ks_2samp(pf.to_numpy(), cf.to_numpy())
                    row["ks"], row["ks_pvalue"] = float(test.statistic), float(test.pvalue)
            else:
                row["note"] = "no rows to compare"
        row["drifted"] = bool(
            (spec.max_drift_psi is not None and row["psi"] is not None and row["psi"] > spec.max_drift_psi)
            or (spec.max_drift_ks is not None and row["ks"] is not None and row["ks"] > spec.max_drift_ks)
        )
        rows.append(row)
    return rows


def _psi_of_profile_counts(prev: dict[str, Any], prev_rows: int, cur: dict[str, Any], cur_rows: int, domain: Optional[list[Any]]) -> float:
    def freq(st: dict[str, Any]) -> dict[Any, int]:
        return {_category_key(k): n for k, n in st["counts"]}

    p_freq, c_freq = freq(prev), freq(cur)
    known = [_category_key(k) for k in domain] if domain is not None else list(dict.fromkeys([*p_freq, *c_freq]))
    known = list(dict.fromkeys(known))

    def counts(f: dict[Any, int], rows: int, nulls: int) -> np.ndarray:
        inside = [f.get(k, 0) for k in known]
        present = sum(f.values())
        return np.array([*inside, present - sum(inside), nulls], dtype=float)

    return _psi_of_counts(counts(p_freq, prev_rows, prev["nulls"]), counts(c_freq, cur_rows, cur["nulls"]))


def _category_key(value: Any) -> Any:
    # 1, 1.0 and True are one category, as in pandas' value_counts.
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _drift_summary(d: dict[str, Any]) -> str:
    parts = [f"PSI {d['psi']:.3f}" if d["psi"] is not None else "", f"KS {d['ks']:.3f}" if d["ks"] is not None else ""]
    return f"drift on {d['column']!r}: " + ", ".join(p for p in parts if p)


def drift_markdown(rows: Sequence[dict[str, Any]], spec: PipelineSpec) -> str:
    """A Markdown table of `drift` results with the thresholds."""
    if not rows:
        return "no previous validated version to compare with\n"
    lines = [
        f"thresholds: PSI > {spec.max_drift_psi}, KS > {spec.max_drift_ks}",
        "",
        "| column | method | PSI | KS | KS p-value | drifted | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for d in rows:
        fmt = lambda v: "" if v is None else f"{v:.4f}"  # noqa: E731
        lines.append(
            f"| {d['column']} | {d['method']} | {fmt(d['psi'])} | {fmt(d['ks'])} | {fmt(d['ks_pvalue'])} | "
            f"{'**yes**' if d['drifted'] else 'no'} | {_md_cell(d['note'])} |"
        )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- quarantine


_SUBDIRS = ("files", "rows")


def quarantine_root(store: "FileStore", team: str, name: str) -> str:
    """`<store>/quarantine/<team>/<name>`: rejected versions under `<md5>/`, rejected landing
    files under `files/<id>/`, rows set aside from accepted versions under `rows/<md5>/`."""
    return store.uri("quarantine", team, name)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def quarantine_snapshot(
    store: "FileStore", team: str, name: str, md5: str, snapshot_uri: str, report: dict[str, Any], docs_uri: Optional[str] = None
) -> str:
    """Keep a rejected snapshot: a copy of its data and its report under `quarantine/<team>/<name>/<md5>/`.

    Quarantining the same version again replaces the report (the data is
    the same bytes) and keeps any release record.

    Returns:
        The quarantine directory URI.
    """
    where = store.uri("quarantine", team, name, md5)
    if not store.exists(f"{where}/data.parquet"):
        store.copy(snapshot_uri, f"{where}/data.parquet")
    store.write_json(
        f"{where}/report.json",
        {"kind": "snapshot", "pipeline": f"{team}/{name}", "md5": md5, "quarantined_at": _now(), "data": f"{where}/data.parquet", "data_docs": docs_uri, **report},
    )
    return where


def quarantine_rows(store: "FileStore", team: str, name: str, md5: str, rows_file: str, report: dict[str, Any]) -> str:
    """Keep rows set aside from an accepted snapshot under `quarantine/<team>/<name>/rows/<md5>/rows.parquet`.

    They live apart from rejected versions (`quarantine/<team>/<name>/<md5>/`):
    the version itself was accepted.
    """
    where = store.uri("quarantine", team, name, "rows", md5)
    store.put_file(rows_file, f"{where}/rows.parquet")
    store.write_json(
        f"{where}/report.json",
        {"kind": "rows", "pipeline": f"{team}/{name}", "md5": md5, "quarantined_at": _now(), "data": f"{where}/rows.parquet", **report},
    )
    return where


@dataclasses.dataclass(frozen=True)
class QuarantineEntry:
    """One quarantined item, as `trainyard data list` shows it.

    Attributes:
        pipeline: `<team>/<name>`.
        id: The snapshot md5 (kinds `snapshot` and `rows`) or the file id (kind `file`).
        kind: `snapshot` (a rejected version), `rows` (rows set aside from an
            accepted version) or `file` (a rejected landing file).
        uri: The entry's directory.
        quarantined_at: When (UTC, ISO 8601).
        summary: The first reason.
        released: The release record, if any.
    """

    pipeline: str
    id: str
    kind: str
    uri: str
    quarantined_at: str
    summary: str
    released: Optional[dict[str, Any]]


def list_quarantine(store: "FileStore", pipeline: Optional[str] = None) -> list[QuarantineEntry]:
    """Every quarantine entry (of one `<team>/<name>` pipeline, or all), oldest first."""
    base = store.uri("quarantine")
    pattern_parts = pipeline.split("/") if pipeline else ["*", "*"]
    reports = store.glob(store.uri("quarantine", *pattern_parts, "*", "report.json"))
    for sub in _SUBDIRS:
        reports += store.glob(store.uri("quarantine", *pattern_parts, sub, "*", "report.json"))
    entries = []
    for uri in reports:
        directory = uri.rsplit("/", 1)[0] if store.is_s3 else os.path.dirname(uri)
        rel = directory[len(base) :].strip("/").split("/")
        if len(rel) not in (3, 4) or (len(rel) == 3 and rel[2] in _SUBDIRS):
            continue
        report = store.read_json(uri)
        release_uri = f"{directory}/release.json"
        reasons = report.get("reasons") or [report.get("reason", "")]
        entries.append(
            QuarantineEntry(
                pipeline=f"{rel[0]}/{rel[1]}",
                id=rel[-1],
                kind=report.get("kind", "snapshot"),
                uri=directory,
                quarantined_at=report.get("quarantined_at", ""),
                summary=str(reasons[0] if reasons else ""),
                released=store.read_json(release_uri) if store.exists(release_uri) else None,
            )
        )
    return sorted(entries, key=lambda e: (e.quarantined_at, e.pipeline, e.id))


def _entry_dir(store: "FileStore", pipeline: str, entry_id: str) -> str:
    team, _, name = pipeline.partition("/")
    if not team or not name or "/" in name:
        raise QuarantineError(f"pipeline {pipeline!r} must be '<team>/<name>', e.g. 'vision/digits'")
    for where in [store.uri("quarantine", team, name, entry_id), *(store.uri("quarantine", team, name, sub, entry_id) for sub in _SUBDIRS)]:
        if entry_id not in _SUBDIRS and store.exists(f"{where}/report.json"):
            return where
    known = [e.id for e in list_quarantine(store, pipeline)]
    raise QuarantineError(f"no quarantine entry {entry_id!r} for pipeline {pipeline!r}; entries: {known or 'none'}")


def read_quarantine(store: "FileStore", pipeline: str, entry_id: str) -> dict[str, Any]:
    """The report of a quarantine entry, with `uri` and `release` (or None) added.

    Raises:
        QuarantineError: No such entry; the message lists the pipeline's entries.
    """
    where = _entry_dir(store, pipeline, entry_id)
    report = store.read_json(f"{where}/report.json")
    release_uri = f"{where}/release.json"
    return {**report, "uri": where, "release": store.read_json(release_uri) if store.exists(release_uri) else None}


def release_quarantine(store: "FileStore", pipeline: str, md5: str, reason: str, by: str, at: Optional[str] = None) -> dict[str, Any]:
    """Record that a person accepts a quarantined snapshot; the next `validated_data` run lets it through.

    The data stays in quarantine (nothing is moved or deleted); the release
    is written next to it as `release.json` with who, when and why.

    Args:
        store: The object store.
        pipeline: `<team>/<name>`.
        md5: The quarantined data version.
        reason: Why it may be used; required, not blank.
        by: Who releases it.
        at: When (ISO 8601); now when None.

    Returns:
        The release record.

    Raises:
        QuarantineError: The entry does not exist, is a rejected file (fix
            or replace the landing file instead), is rows already set aside
            from an accepted version, was already released, or the reason is blank.
    """
    if not reason or not reason.strip():
        raise QuarantineError("release needs a reason: say why this data may be used (e.g. --reason 'outliers checked with the data owner')")
    if not by or not by.strip():
        raise QuarantineError("release needs the name of who releases it")
    where = _entry_dir(store, pipeline, md5)
    report = store.read_json(f"{where}/report.json")
    kind = report.get("kind", "snapshot")
    if kind == "file":
        raise QuarantineError(f"{md5!r} is a rejected landing file, which cannot be used as it is; fix or replace the file in the landing area")
    if kind != "snapshot":
        raise QuarantineError(f"{md5!r} holds rows set aside from an accepted version, not a rejected version; nothing to release")
    release_uri = f"{where}/release.json"
    if store.exists(release_uri):
        previous = store.read_json(release_uri)
        raise QuarantineError(f"{pipeline} {md5} was already released by {previous['released_by']} at {previous['released_at']}: {previous['reason']}")
    record = {"pipeline": pipeline, "md5": md5, "released_by": by.strip(), "released_at": at or _now(), "reason": reason.strip()}
    store.write_json(release_uri, record)
    return record


def release_of(store: "FileStore", team: str, name: str, md5: str) -> Optional[dict[str, Any]]:
    """The release record of a quarantined snapshot, or None."""
    uri = store.uri("quarantine", team, name, md5, "release.json")
    return store.read_json(uri) if store.exists(uri) else None
