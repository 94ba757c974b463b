"""Canonical form: the stored columns, in declared order and types, written as byte-stable Parquet.

`to_canonical` keeps the stored columns (`PipelineSpec.stored_columns`: every
declared column but those with role `ignore`) in declared order and declared
types; `CanonicalParquetWriter` writes record batches so equal data gives
equal bytes (hence an equal DVC md5, hence an equal Dagster data version),
holding at most one row group in memory.

Dates and times (`cast_values`): a `date` column is Arrow `date32`, read from
text `YYYY-MM-DD` or from a date or timestamp column (the day on the calendar
of the timestamp's own zone, UTC for a naive one); a
`datetime` column is `timestamp("us", tz="UTC")`, read from ISO 8601 text
(`2022-05-04T10:30:00`, a space for the `T` too; with `Z` or an offset it is
converted to UTC, without one it is taken as UTC), or from a date or
timestamp column (a naive timestamp is taken as UTC).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from typing import Any, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from common.atomic import atomic_path
from trainyard.data.errors import SchemaMismatch
from trainyard.spec import PipelineSpec
from trainyard.store import FileStore

ARROW_TYPES: dict[str, pa.DataType] = {
    "int": pa.int64(),
    "float": pa.float64(),
    "str": pa.string(),
    "bool": pa.bool_(),
    "category": pa.string(),
    "date": pa.date32(),
    "datetime": pa.timestamp("us", tz="UTC"),
}
"""Canonical Arrow type of each `ColumnSpec.dtype`."""

_CAST_ERRORS = (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError)

# A zone at the end of ISO 8601 text: `Z`, `+02:00`, `+0200`, `-05`.
_ZONE = r"(?:[Zz]|[+-]\d\d(?::?\d\d)?)$"

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

SAMPLE_VALUES = 5
"""Offending values (and their rows) named per failing column or check."""


def canonical_schema(spec: PipelineSpec) -> pa.Schema:
    """The stored columns (all declared but role `ignore`), in declared order, with their canonical Arrow types."""
    return pa.schema([pa.field(name, ARROW_TYPES[column.dtype]) for name, column in spec.stored_columns.items()])


def reading_type(dtype: str) -> pa.DataType:
    """The Arrow type a text reader (CSV, JSON) parses a column of `dtype` as: dates and times as text, parsed by
    `cast_values`."""
    return pa.string() if dtype in ("date", "datetime") else ARROW_TYPES[dtype]


def cast_values(values: pa.Array | pa.ChunkedArray, target: pa.DataType) -> pa.Array | pa.ChunkedArray:
    """`values` cast safely to the canonical type `target`, parsing dates and times from text (see the module
    docstring).

    Raises:
        pyarrow.ArrowInvalid, ArrowTypeError, ArrowNotImplementedError: A value does not cast.
    """
    if values.type == target:
        return values
    text = pa.types.is_string(values.type) or pa.types.is_large_string(values.type)
    if pa.types.is_timestamp(target) and target.tz is not None and text:
        if isinstance(values, pa.ChunkedArray):
            values = values.combine_chunks()
        values = pc.utf8_trim_whitespace(values)
        zoned = pc.fill_null(pc.match_substring_regex(values, _ZONE), False)
        if not pc.any(zoned).as_py():
            return values.cast(pa.timestamp(target.unit), safe=True).cast(target)
        if pc.all(zoned).as_py():
            return values.cast(target, safe=True)
        naive_text = pc.if_else(zoned, pa.scalar(None, values.type), values)
        zoned_text = pc.if_else(zoned, values, pa.scalar(None, values.type))
        naive = naive_text.cast(pa.timestamp(target.unit), safe=True).cast(target)
        return pc.if_else(zoned, zoned_text.cast(target, safe=True), naive)
    if (
        pa.types.is_timestamp(target)
        and target.tz is not None
        and pa.types.is_timestamp(values.type)
        and values.type.tz is None
    ):
        return values.cast(pa.timestamp(target.unit), safe=True).cast(target)  # naive: taken as UTC
    if pa.types.is_date32(target) and text:
        if isinstance(values, pa.ChunkedArray):
            values = values.combine_chunks()
        return pc.utf8_trim_whitespace(values).cast(target, safe=True)
    if pa.types.is_date32(target) and pa.types.is_timestamp(values.type):
        if values.type.tz is not None:
            values = pc.local_timestamp(values)  # the day on the calendar of the time's own zone, as exported
        return values.cast(target)
    return values.cast(target, safe=True)


def to_canonical(table: pa.Table | pa.RecordBatch, spec: PipelineSpec) -> pa.Table:
    """The stored columns, in declared order, cast to their declared types (`cast_values`).

    Undeclared and ignored columns are dropped, and so is schema metadata (e.g. pandas'),
    so the canonical table depends on the data alone. Casts are safe: a
    float with a fractional part does not become an int, text that is not a
    number does not become one.

    Raises:
        SchemaMismatch: A declared column is missing, or its values cannot be
            cast to the declared dtype; the message names the column, the
            dtype and up to five offending values.
    """
    found = table.column_names if isinstance(table, pa.Table) else table.schema.names
    missing = [c for c in spec.stored_columns if c not in found]
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
            arrays.append(cast_values(values, field.type))
        except _CAST_ERRORS as e:
            samples = _uncastable(values, field.type)
            why = f"offending values: {samples}" if samples else f"Arrow has no cast from {values.type}"
            raise SchemaMismatch(
                f"column {field.name!r} cannot be cast from {values.type} to declared dtype "
                f"{spec.columns[field.name].dtype!r} ({field.type}); {why} ({e})"
            ) from e
    if isinstance(table, pa.RecordBatch):
        return pa.Table.from_batches([pa.RecordBatch.from_arrays(arrays, schema=schema)], schema=schema)
    return pa.Table.from_arrays(arrays, schema=schema)


def _uncastable(values: pa.Array | pa.ChunkedArray, target: pa.DataType, limit: int = SAMPLE_VALUES) -> list[Any]:
    """Up to `limit` distinct values, in order of first appearance, that do not cast to `target`."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    try:
        unique = pc.unique(values).drop_null()
    except _CAST_ERRORS:
        return []  # e.g. nested types: no per-value cast to try either
    bad: list[Any] = []
    step = 1024
    for start in range(0, len(unique), step):
        batch = unique.slice(start, step)
        try:
            cast_values(batch, target)
            continue
        except _CAST_ERRORS:
            pass
        for i in range(len(batch)):
            try:
                cast_values(batch.slice(i, 1), target)
            except _CAST_ERRORS:
                bad.append(batch[i].as_py())
                if len(bad) >= limit:
                    return bad
    return bad


class _Aborted(Exception):
    """Thrown into `atomic_path` to discard the temporary file instead of moving it into place."""


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
        # The file is written under a temporary name and moved into place by `atomic_path` on
        # `close()`; `abort()` throws into it instead, which removes the temporary file.
        self._commit = contextlib.ExitStack()
        self._tmp = self._commit.enter_context(atomic_path(self.path))
        options = {k: v for k, v in PARQUET_OPTIONS.items() if k != "row_group_size"}
        self._writer: Any = pq.ParquetWriter(
            self._tmp, self.schema, use_dictionary=dictionary_columns(self.schema), **options
        )

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

    def add_metadata(self, metadata: dict[str, str]) -> None:
        """Record key-value metadata in the file's footer (e.g. where the rows came from); equal metadata gives equal
        bytes."""
        self._writer.add_key_value_metadata(metadata)

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
            self._commit.close()
        finally:
            self.abort()
        return self.path

    def abort(self) -> None:
        """Drop everything written so far."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._commit.__exit__(_Aborted, _Aborted(), None)

    def __enter__(self) -> CanonicalParquetWriter:
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


def read_rows(store: FileStore, uri: str, positions: Iterable[int]) -> dict[int, dict[str, Any]]:
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
                out.update({start + i: jsonable(row) for i, row in zip(local, rows)})
            start += size
    return out


def jsonable(value: Any) -> Any:
    """`value` as plain JSON data: numpy scalars unwrapped, NaN and pandas' missing values as None, the rest as text."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [jsonable(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else value
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    pd = sys.modules.get("pandas")  # pandas' missing values exist only once pandas was imported
    if pd is not None and (value is pd.NA or value is pd.NaT):
        return None
    return str(value)
