"""The pipeline's expectation suite: generated from its declared columns, or read from its suite file."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from trainyard.spec import PipelineSpec, load_suite_file

# Type names Great Expectations accepts for each declared dtype: the numpy or
# pandas-extension dtype of a column, or, for object (text) columns, the Python
# type of every value. GE cannot name a Python date, so dates and times are shown
# to it as numpy datetimes (`trainyard.data.expectations.pandas_frame_for`): a
# `date` column as `datetime64[s]` (midnight of each day), a `datetime` column as
# `datetime64[us]` in UTC (`datetime64[ns]` too, for frames from pandas).
GX_TYPE_NAMES: dict[str, list[str]] = {
    "int": ["int64", "int", "Int64Dtype"],
    "float": ["float64", "float", "Float64Dtype"],
    "str": ["str", "StringDtype"],
    "bool": ["bool", "BooleanDtype"],
    "category": ["str", "StringDtype"],
    "date": ["datetime64[s]"],
    "datetime": ["datetime64[us]", "datetime64[ns]"],
}


def expectation_configs(spec: PipelineSpec) -> list[dict[str, Any]]:
    """The expectation suite built from a pipeline's columns, as Great Expectations `type`/`kwargs` pairs.

    Table-level expectations come first (row count, exact ordered stored
    columns), then per stored column (every declared one but role `ignore`):
    it exists, its type, no nulls (unless `nullable`; an `id` column never
    has nulls, whatever `nullable` says), its range (if `min`/`max`), its
    domain (if `domain`: a closed categorical). Whether ids repeat is a
    platform check (`trainyard.data.checks.RepeatedIds`), a warning.

    A nullable int column may also be float64: pandas (`to_pandas`,
    `read_parquet`) turns int64 with nulls into float64. Integrality is
    still guaranteed by `to_canonical`, which refuses fractional values.

    Example:
        >>> expectation_configs(spec)[0]  # doctest: +SKIP
        {'type': 'expect_table_row_count_to_be_between', 'kwargs': {'min_value': 10, 'max_value': None}}
    """
    configs: list[dict[str, Any]] = [
        {
            "type": "expect_table_row_count_to_be_between",
            "kwargs": {"min_value": spec.min_rows, "max_value": spec.max_rows},
        },
        {"type": "expect_table_columns_to_match_ordered_list", "kwargs": {"column_list": list(spec.stored_columns)}},
    ]
    for name, column in spec.stored_columns.items():
        types = list(GX_TYPE_NAMES[column.dtype])
        if column.dtype == "int" and column.nullable:
            types.append("float64")
        configs.append({"type": "expect_column_to_exist", "kwargs": {"column": name}})
        configs.append(
            {"type": "expect_column_values_to_be_in_type_list", "kwargs": {"column": name, "type_list": types}}
        )
        if not column.nullable or column.role == "id":
            configs.append({"type": "expect_column_values_to_not_be_null", "kwargs": {"column": name}})
        if column.min is not None or column.max is not None:
            configs.append(
                {
                    "type": "expect_column_values_to_be_between",
                    "kwargs": {"column": name, "min_value": column.min, "max_value": column.max},
                }
            )
        if column.domain is not None:
            configs.append(
                {
                    "type": "expect_column_values_to_be_in_set",
                    "kwargs": {"column": name, "value_set": list(column.domain)},
                }
            )
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
        "finite": {n: c.finite for n, c in spec.stored_columns.items()},
        "duplicates": spec.allow_duplicate_rows,
        "policy": spec.on_bad_data,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:8]
