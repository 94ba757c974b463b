"""Data quality for `raw_data` and `validated_data`: pure functions over tables and frames.

The chain, as the assets use it:

1. `read_landing` reads every landing file of a `SourceSpec` from the object store;
2. `to_canonical` keeps the declared columns in declared order and declared types;
3. `write_parquet_deterministic` writes them so equal data gives equal bytes
   (hence an equal DVC md5, hence an equal Dagster data version);
4. `validate` runs a Great Expectations suite built from the `PipelineSpec`;
5. `split` makes the deterministic stratified train/val/test split;
6. `drift_report` compares a new version with the previous one by PSI.

Nothing here talks to Dagster. Errors about the data itself derive from
`DataQualityError` and are terminal: retrying cannot fix the data. Storage
errors from the object store pass through unchanged (some are retryable).
Great Expectations and scikit-learn are imported inside the functions that
need them, because both are slow to import.
"""

from __future__ import annotations

import math
import os
import uuid
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
from pydantic import BaseModel, ConfigDict

from pipelines.spec import PipelineSpec, SourceSpec

if TYPE_CHECKING:
    from resources.storage import ObjectStore

ARROW_TYPES: dict[str, pa.DataType] = {"int": pa.int64(), "float": pa.float64(), "str": pa.string(), "bool": pa.bool_()}
"""Canonical Arrow type of each `ColumnSpec.dtype`."""

# Type names Great Expectations accepts for each declared dtype: the numpy or
# pandas-extension dtype of a column, or, for object columns, the Python type
# of every value.
GX_TYPE_NAMES: dict[str, list[str]] = {
    "int": ["int64", "int", "Int64Dtype"],
    "float": ["float64", "float", "Float64Dtype"],
    "str": ["str", "StringDtype"],
    "bool": ["bool", "BooleanDtype"],
}

# Parquet layout is pinned so that the bytes depend on the data alone.
PARQUET_OPTIONS: dict[str, Any] = {
    "compression": "zstd",
    "compression_level": 3,
    "row_group_size": 128 * 1024,
    "data_page_size": 1024 * 1024,
    "use_dictionary": True,
    "write_statistics": True,
    "version": "2.6",
    "data_page_version": "1.0",
}

PSI_EPSILON = 1e-4
"""Share given to a bin that is empty on one side, so PSI stays finite."""

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


# --------------------------------------------------------------------------- reading


def landing_pattern(store: "ObjectStore", source: SourceSpec) -> str:
    """The glob pattern of a source's landing files as a full URI.

    `source.prefix` is relative to the store root unless it is absolute
    (`s3://...` or `/...`).
    """
    prefix = source.prefix
    if prefix.startswith("s3://"):
        return f"{prefix.rstrip('/')}/{source.pattern.lstrip('/')}"
    if prefix.startswith("/"):
        return os.path.join(prefix, source.pattern.lstrip("/"))
    return store.uri(prefix, source.pattern)


def _parse(uri: str, data: bytes, fmt: str) -> pa.Table:
    import pyarrow.csv as pacsv
    import pyarrow.json as pajson
    import pyarrow.parquet as pq

    readers = {"csv": pacsv.read_csv, "parquet": pq.read_table, "jsonl": pajson.read_json}
    try:
        return readers[fmt](pa.BufferReader(data))
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
        raise MalformedLandingFile(f"cannot parse {uri} as {fmt}: {e}") from e


def read_landing(store: "ObjectStore", source: SourceSpec) -> pa.Table:
    """Read and concatenate every landing file of `source`, in sorted URI order.

    Columns are matched by name (the first file fixes their order); numeric
    types that differ between files are promoted (int64 + double -> double).

    Args:
        store: The object store holding the landing prefix.
        source: Prefix, glob pattern and format (`csv`, `parquet`, `jsonl`) of the files.

    Returns:
        All rows of all files.

    Raises:
        MissingLandingData: No file matches.
        MalformedLandingFile: A file cannot be parsed as `source.format`.
        SchemaMismatch: A file's columns differ from the first file's, or a
            column's types cannot be reconciled across files.
        StorageError: Listing or reading failed (see `resources.storage`).
    """
    pattern = landing_pattern(store, source)
    uris = store.glob(pattern)
    if not uris:
        raise MissingLandingData(
            f"no landing files match prefix {source.prefix!r} with pattern {source.pattern!r} (looked for {pattern})"
        )
    tables = [_parse(uri, store.read_bytes(uri), source.format) for uri in uris]
    reference = tables[0].column_names
    for uri, table in zip(uris[1:], tables[1:]):
        names = table.column_names
        if set(names) != set(reference) or len(names) != len(reference):
            missing = [c for c in reference if c not in names]
            extra = [c for c in names if c not in reference]
            raise SchemaMismatch(
                f"{uri} has different columns from {uris[0]}: missing {missing}, extra {extra} "
                f"(expected {reference}, found {names})"
            )
    tables = [t.select(reference) for t in tables]
    try:
        return pa.concat_tables(tables, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise SchemaMismatch(_type_conflicts(uris, tables) or f"landing files cannot be concatenated: {e}") from e


def _type_conflicts(uris: Sequence[str], tables: Sequence[pa.Table]) -> str:
    conflicts = []
    for name in tables[0].column_names:
        first_seen: dict[str, str] = {}
        for uri, table in zip(uris, tables):
            first_seen.setdefault(str(table.schema.field(name).type), uri)
        kinds = {t for t in first_seen if t != "null"}
        if len(kinds) > 1:
            conflicts.append(f"column {name!r} is " + ", ".join(f"{t} in {u}" for t, u in first_seen.items()))
    return "; ".join(conflicts)


# --------------------------------------------------------------------------- canonical form


def to_canonical(table: pa.Table, spec: PipelineSpec) -> pa.Table:
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
    found = table.column_names
    missing = [c for c in spec.columns if c not in found]
    if missing:
        raise SchemaMismatch(f"declared column(s) {missing} not found; the data has columns {found}")
    arrays, fields = [], []
    for name, column in spec.columns.items():
        target = ARROW_TYPES[column.dtype]
        values = table.column(name)
        try:
            cast = values.cast(target, safe=True)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
            samples = _uncastable(values, target)
            why = f"offending values: {samples}" if samples else f"Arrow has no cast from {values.type}"
            raise SchemaMismatch(
                f"column {name!r} cannot be cast from {values.type} to declared dtype {column.dtype!r} ({target}); "
                f"{why} ({e})"
            ) from e
        arrays.append(cast)
        fields.append(pa.field(name, target))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def _uncastable(values: pa.ChunkedArray, target: pa.DataType, limit: int = _SAMPLE) -> list[Any]:
    """Up to `limit` distinct values, in order of first appearance, that do not cast to `target`."""
    import pyarrow.compute as pc

    try:
        unique = pc.unique(values.combine_chunks()).drop_null()
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


def write_parquet_deterministic(table: pa.Table, path: str) -> None:
    """Write `table` to a local Parquet file whose bytes depend only on the data.

    Schema metadata is dropped and chunks are combined, so tables that are
    equal as data (whatever their chunking or pandas metadata) give identical
    files; compression, row groups and pages are fixed by `PARQUET_OPTIONS`.
    Parquet stores no write time; the footer names the pyarrow version, so
    bytes are stable for one pyarrow release. The file appears atomically.
    """
    import pyarrow.parquet as pq

    table = table.replace_schema_metadata(None).combine_chunks()
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    try:
        pq.write_table(table, tmp, **PARQUET_OPTIONS)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# --------------------------------------------------------------------------- validation


class ValidationReport(BaseModel):
    """The outcome of running a pipeline's expectation suite on one data version.

    Attributes:
        success: Every expectation passed.
        evaluated: Number of expectations run.
        failed: Number that did not pass (including those that raised).
        results: One dict per expectation, in suite order, with keys
            `expectation`, `column` (None for table-level ones), `kwargs`,
            `success`, `observed_value`, `unexpected_count`,
            `unexpected_values` (up to five samples) and `exception` (the
            error message when the expectation could not be evaluated).
        suite: The suite as Great Expectations JSON (without generated ids).
    """

    model_config = ConfigDict(frozen=True)

    success: bool
    evaluated: int
    failed: int
    results: list[dict[str, Any]]
    suite: dict[str, Any]

    def failures(self) -> list[dict[str, Any]]:
        """The results that did not pass."""
        return [r for r in self.results if not r["success"]]

    def to_markdown(self) -> str:
        """A Markdown summary and table of every expectation, for Dagster metadata."""
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


def _md_cell(value: Any, width: int = 120) -> str:
    text = str(value).replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= width else text[: width - 1] + "…"


def expectation_configs(spec: PipelineSpec) -> list[dict[str, Any]]:
    """The expectation suite of a pipeline, as Great Expectations `type`/`kwargs` pairs.

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


def validate(df: pd.DataFrame, spec: PipelineSpec) -> ValidationReport:
    """Run the pipeline's expectation suite (see `expectation_configs`) on `df`.

    Uses an ephemeral Great Expectations context: a pandas datasource, a
    dataframe asset, a whole-dataframe batch definition and a
    `ValidationDefinition`. Nothing is written to disk.

    Args:
        df: The data, e.g. the canonical Parquet read with pandas.
        spec: The pipeline whose columns and row bounds give the expectations.

    Returns:
        The report; `success` is False when any expectation failed or could
        not be evaluated (e.g. a range check on a text column).
    """
    # Must be set before Great Expectations is imported.
    os.environ["GX_ANALYTICS_ENABLED"] = "False"
    import great_expectations as gx
    import great_expectations.expectations as gxe
    from great_expectations.data_context.types.base import ProgressBarsConfig

    classes = {
        "expect_table_row_count_to_be_between": gxe.ExpectTableRowCountToBeBetween,
        "expect_table_columns_to_match_ordered_list": gxe.ExpectTableColumnsToMatchOrderedList,
        "expect_column_to_exist": gxe.ExpectColumnToExist,
        "expect_column_values_to_be_in_type_list": gxe.ExpectColumnValuesToBeInTypeList,
        "expect_column_values_to_not_be_null": gxe.ExpectColumnValuesToNotBeNull,
        "expect_column_values_to_be_between": gxe.ExpectColumnValuesToBeBetween,
        "expect_column_values_to_be_in_set": gxe.ExpectColumnValuesToBeInSet,
    }
    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    batch_definition = (
        context.data_sources.add_pandas(name="trainyard")
        .add_dataframe_asset(name="data")
        .add_batch_definition_whole_dataframe(name="all")
    )
    suite = context.suites.add(
        gx.ExpectationSuite(
            name=spec.key,
            expectations=[classes[c["type"]](**c["kwargs"]) for c in expectation_configs(spec)],
        )
    )
    definition = context.validation_definitions.add(gx.ValidationDefinition(name=spec.key, data=batch_definition, suite=suite))
    outcome = definition.run(
        batch_parameters={"dataframe": _for_gx(df)},
        result_format={"result_format": "SUMMARY", "partial_unexpected_count": _SAMPLE},
    )
    results = [_result_dict(r) for r in outcome.results]
    failed = sum(1 for r in results if not r["success"])
    return ValidationReport(
        success=bool(outcome.success) and failed == 0,
        evaluated=len(results),
        failed=failed,
        results=results,
        suite=_without_ids(suite.to_json_dict()),
    )


def _for_gx(df: pd.DataFrame) -> pd.DataFrame:
    """Hand string-dtype columns to GE as object columns.

    Great Expectations 1.x cannot name pandas' string dtypes in a type list
    (pandas 3 reads text as `str`, i.e. `StringDtype(na_value=nan)`); as
    object columns each value's Python type is checked instead, which is
    what "is a string column" means.
    """
    text = {c: object for c in df.columns if isinstance(df[c].dtype, pd.StringDtype)}
    return df.astype(text) if text else df


def _result_dict(result: Any) -> dict[str, Any]:
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
        "exception": _exception_message(result.exception_info),
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


def _without_ids(value: Any) -> Any:
    """GE gives every suite and expectation a random id; drop them so equal specs give equal JSON."""
    if isinstance(value, dict):
        return {k: _without_ids(v) for k, v in value.items() if k != "id"}
    if isinstance(value, list):
        return [_without_ids(v) for v in value]
    return value


# --------------------------------------------------------------------------- split


def split(df: pd.DataFrame, spec: PipelineSpec) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Deterministic train/val/test split, stratified on the target when it is a class label.

    The target is stratified on when its dtype is int, str or bool or it
    declares a domain; a float target without a domain is split at random.
    The test share is taken first, then the validation share of the rest,
    both with `spec.split.seed`. Each part keeps the input's row order and
    gets a fresh index, so the same input always gives the same rows in the
    same order.

    Returns:
        (train, val, test).

    Raises:
        SplitError: The rows cannot be split as asked, e.g. a class has too
            few rows to appear in every part.
    """
    from sklearn.model_selection import train_test_split

    target = spec.target
    if target not in df.columns:
        raise SchemaMismatch(f"target column {target!r} not found; the data has columns {list(df.columns)}")
    declared = spec.columns[target]
    stratify = declared.dtype in ("int", "str", "bool") or declared.domain is not None
    labels = df[target].to_numpy() if stratify else None
    positions = np.arange(len(df))
    fractions = spec.split
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
        how = f"stratified on {target!r}" if stratify else "at random"
        counts = df[target].value_counts(dropna=False).sort_index().to_dict() if stratify else {}
        raise SplitError(
            f"cannot split {len(df)} rows {how} with val_fraction={fractions.val_fraction}, "
            f"test_fraction={fractions.test_fraction}: {e}" + (f"; rows per class: {counts}" if counts else "")
        ) from e
    return tuple(df.iloc[np.sort(part)].reset_index(drop=True) for part in (train, val, test))  # type: ignore[return-value]


# --------------------------------------------------------------------------- drift


def psi(
    prev: pd.Series, cur: pd.Series, bins: int = 10, categories: Optional[Sequence[Any]] = None
) -> float:
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
    if categories is None:
        known = list(dict.fromkeys([*p_freq.index, *c_freq.index]))
    else:
        known = list(dict.fromkeys(categories))

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
