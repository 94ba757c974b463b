"""The metrics Great Expectations asks for, computed over Arrow record batches with `pyarrow.compute`.

Each accumulator is fed every batch (`Accumulator.feed`) and then answers
for one or more GE metrics (`Accumulator.value`); `trainyard.data.expectations.ArrowSuite`
decides which accumulator serves which metric. An accumulator that cannot
compute its metric keeps the reason in `error` instead of raising, so the
expectations that depend on it fail with that message, as in GE's pandas engine.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

if TYPE_CHECKING:
    import pandas as pd

DISTINCT_LIMIT = 100_000
"""Most distinct values a `column.distinct_values` metric may collect before it refuses."""

MAP_SUFFIXES = ("unexpected_count", "unexpected_values", "unexpected_index_list", "unexpected_index_query")
MAP_CONDITIONS = (
    "nonnull",
    "null",
    "between",
    "in_set",
    "not_in_set",
    "in_type_list",
    "match_regex",
    "not_match_regex",
    "value_length.between",
)
_ARROW_ERRORS = (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError)


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_float(t: pa.DataType) -> bool:
    return pa.types.is_floating(t)


def _value_array(values: Iterable[Any], t: pa.DataType) -> pa.Array:
    """The values of a GE `value_set` that can equal a value of type `t`, as an Arrow array of `t`.

    Mirrors pandas' `isin`: `1 == 1.0 == True`, but `"1" != 1`.
    """
    values = [v for v in values if v is not None]
    keep: list[Any]
    if _is_text(t):
        keep = [v for v in values if isinstance(v, str)]
    elif pa.types.is_boolean(t):
        keep = [bool(v) for v in values if isinstance(v, (bool, int, float, np.number)) and v in (0, 1)]
    elif pa.types.is_integer(t):
        keep = [int(v) for v in values if isinstance(v, (int, float, np.number)) and float(v).is_integer()]
    elif _is_float(t):
        keep = [float(v) for v in values if isinstance(v, (int, float, np.number))]
    else:
        return pa.array(values).cast(t)
    return pa.array(keep, type=t)


def _accepts_text(type_list: Sequence[str]) -> bool:
    """Whether GE's pandas `column_values.in_type_list` accepts a Python `str` for `type_list`.

    Follows `ColumnValuesInTypeList._pandas`: each name is tried as a numpy
    dtype, a pandas type and a native type name.
    """
    import pandas as pd
    from great_expectations.expectations.type_comparison import native_type_type_map

    types: list[type] = []
    for name in type_list:
        try:
            types.append(np.dtype(name).type)
        except TypeError:
            for owner in (pd, pd.core.dtypes.dtypes):
                found = getattr(owner, name, None)
                if isinstance(found, type):
                    types.append(found)
        native = native_type_type_map(name)
        if native is not None:
            types.extend(native)
    return isinstance("text", tuple(types)) if types else False


class Masks:
    """Per-batch cache of each column's missing-value mask (null, or NaN for floats)."""

    def __init__(self, batch: pa.RecordBatch) -> None:
        self.batch = batch
        self._missing: dict[str, pa.Array] = {}

    def column(self, name: str) -> pa.Array:
        """The batch's column `name`."""
        return self.batch.column(name)

    def missing(self, name: str) -> pa.Array:
        """Which values of column `name` are missing (null, or NaN in a float column)."""
        if name not in self._missing:
            col = self.batch.column(name)
            self._missing[name] = pc.is_null(col, nan_is_null=True) if _is_float(col.type) else pc.is_null(col)
        return self._missing[name]


class Accumulator:
    """Computes one or more metrics over the batches; `error` holds why it could not."""

    error: Optional[str] = None

    def update(self, masks: Masks, offset: int) -> None:
        """Take in one batch; `offset` is the global position of its first row."""
        raise NotImplementedError

    def value(self, metric_name: str, value_kwargs: dict[str, Any]) -> Any:
        """The value of metric `metric_name` (with GE's value kwargs) over every batch fed."""
        raise NotImplementedError

    def feed(self, masks: Masks, offset: int) -> None:
        """`update`, keeping the reason in `error` (and ignoring later batches) when it fails."""
        if self.error is not None:
            return
        try:
            self.update(masks, offset)
        except _ARROW_ERRORS + (KeyError, ValueError, TypeError) as e:
            self.error = f"{type(e).__name__}: {e}"


class TableMetrics(Accumulator):
    """Row count, column names and column types, as GE's pandas engine reports them for `frame`."""

    def __init__(self, schema: pa.Schema, frame: pd.DataFrame) -> None:
        self.rows = 0
        self.schema = schema
        self.frame = frame

    def update(self, masks: Masks, offset: int) -> None:
        self.rows += masks.batch.num_rows

    def value(self, metric_name: str, value_kwargs: dict[str, Any]) -> Any:
        if metric_name == "table.row_count":
            return self.rows
        if metric_name == "table.columns":
            return list(self.schema.names)
        if metric_name == "table.column_count":
            return len(self.schema.names)
        return [{"name": c, "type": self.frame[c].dtype} for c in self.frame.columns]


class MapCondition(Accumulator):
    """A column map condition: which rows are unexpected, how many, and the first few of them.

    Attributes:
        column: The column judged.
        condition: One of the supported conditions (e.g. `between`).
        kwargs: The condition's value kwargs (e.g. `min_value`).
    """

    def __init__(
        self, column: str, condition: str, kwargs: dict[str, Any], column_type: pa.DataType, partial: int
    ) -> None:
        self.column = column
        self.condition = condition
        self.kwargs = kwargs
        self.partial = partial
        self.count = 0
        self.values: list[Any] = []
        self.indices: list[int] = []
        self._type = column_type
        self._set: Optional[pa.Array] = None
        if condition in ("in_set", "not_in_set"):
            self._set = _value_array(kwargs.get("value_set") or [], column_type)

    def unexpected(self, masks: Masks) -> pa.Array:
        """Boolean mask of this batch's unexpected rows (never null)."""
        col = masks.column(self.column)
        missing = masks.missing(self.column)
        if self.condition == "nonnull":
            return missing
        if self.condition == "null":
            return pc.invert(missing)
        bad = self._bad_present(col)
        return pc.and_(pc.fill_null(bad, False), pc.invert(missing))

    def _bad_present(self, col: pa.Array) -> pa.Array:
        kw = self.kwargs
        c = self.condition
        if c == "between":
            return self._outside(col, kw)
        if c == "value_length.between":
            return self._outside(pc.utf8_length(col), kw)
        if c == "in_set":
            return pc.invert(pc.is_in(col, value_set=self._set))
        if c == "not_in_set":
            return pc.is_in(col, value_set=self._set)
        if c == "match_regex":
            return pc.invert(pc.match_substring_regex(col, kw["regex"]))
        if c == "not_match_regex":
            return pc.match_substring_regex(col, kw["regex"])
        # in_type_list: GE checks each value's Python type only for object (text) columns.
        if not _is_text(col.type):
            raise TypeError(f"in_type_list per value applies to text columns, not {col.type}")
        accepted = _accepts_text(kw.get("type_list") or [])
        return pa.array(np.full(len(col), not accepted))

    @staticmethod
    def _outside(values: pa.Array, kw: dict[str, Any]) -> pa.Array:
        low, high = kw.get("min_value"), kw.get("max_value")
        if low is None and high is None:
            raise ValueError("min_value and max_value cannot both be None")
        below = above = None
        if low is not None:
            below = (pc.less_equal if kw.get("strict_min") else pc.less)(values, pa.scalar(low))
        if high is not None:
            above = (pc.greater_equal if kw.get("strict_max") else pc.greater)(values, pa.scalar(high))
        if below is None:
            return above
        if above is None:
            return below
        return pc.or_(below, above)

    def update(self, masks: Masks, offset: int) -> None:
        mask = self.unexpected(masks)
        n = pc.sum(mask).as_py() or 0
        self.count += n
        if n and len(self.indices) < self.partial:
            where = pc.indices_nonzero(mask).slice(0, self.partial - len(self.indices))
            self.values.extend(pc.take(masks.column(self.column), where).to_pylist())
            self.indices.extend(offset + i for i in where.to_pylist())

    def value(self, metric_name: str, value_kwargs: dict[str, Any]) -> Any:
        suffix = metric_name.rsplit(".", 1)[1]
        if suffix == "unexpected_count":
            return self.count
        if suffix == "unexpected_values":
            return list(self.values)
        if suffix == "unexpected_index_list":
            return list(self.indices)
        return f"df.filter(items={self.indices}, axis=0)"


class ColumnStats(Accumulator):
    """min, max, sum, mean and sample standard deviation of the present values (Chan's parallel update)."""

    def __init__(self, column: str) -> None:
        self.column = column
        self.min: Any = None
        self.max: Any = None
        self.n = 0
        self.sum: Any = 0
        self.mean = 0.0
        self.m2 = 0.0

    def update(self, masks: Masks, offset: int) -> None:
        col = masks.column(self.column)
        present = pc.filter(col, pc.invert(masks.missing(self.column)))
        if len(present) == 0:
            return
        bounds = pc.min_max(present)
        lo, hi = bounds["min"].as_py(), bounds["max"].as_py()
        self.min = lo if self.min is None else min(self.min, lo)
        self.max = hi if self.max is None else max(self.max, hi)
        if _is_text(col.type):
            return
        n = len(present)
        batch_sum = pc.sum(present).as_py()  # an int for int columns, as pandas gives
        values = present if _is_float(col.type) else present.cast(pa.float64())
        batch_mean = pc.mean(values).as_py()
        batch_m2 = pc.variance(values, ddof=0).as_py() * n
        delta = batch_mean - self.mean
        total = self.n + n
        self.mean += delta * n / total
        self.m2 += batch_m2 + (delta * delta * self.n * n / total if self.n else 0.0)
        self.sum += batch_sum
        self.n = total

    def value(self, metric_name: str, value_kwargs: dict[str, Any]) -> Any:
        if metric_name == "column.min":
            return self.min
        if metric_name == "column.max":
            return self.max
        if metric_name == "column.sum":
            return self.sum
        if metric_name == "column.mean":
            return self.mean if self.n else None
        return math.sqrt(self.m2 / (self.n - 1)) if self.n > 1 else None


class DistinctValues(Accumulator):
    """The set of distinct present values of a column, up to `DISTINCT_LIMIT`."""

    def __init__(self, column: str) -> None:
        self.column = column
        self.values: set[Any] = set()

    def update(self, masks: Masks, offset: int) -> None:
        present = pc.filter(masks.column(self.column), pc.invert(masks.missing(self.column)))
        self.values.update(pc.unique(present).to_pylist())
        if len(self.values) > DISTINCT_LIMIT:
            raise ValueError(
                f"column {self.column!r} has more than {DISTINCT_LIMIT} distinct values; "
                "distinct-value expectations are not streamed past that"
            )

    def value(self, metric_name: str, value_kwargs: dict[str, Any]) -> Any:
        expected = set(value_kwargs.get("value_set") or [])
        limit = value_kwargs.get("limit")
        if metric_name == "column.distinct_values":
            return set(self.values)
        if metric_name == "column.distinct_values.count":
            return len(self.values)
        if metric_name == "column.distinct_values.count.under_threshold":
            return len(self.values) < value_kwargs["threshold"]
        # Sorted (GE lists a set in hash order, which changes from run to run for text).
        if metric_name.startswith("column.distinct_values.not_in_set"):
            extra = sorted(self.values - expected, key=repr)
            return len(extra) if metric_name.endswith(".count") else extra[:limit]
        missing = sorted(expected - self.values, key=repr)
        return len(missing) if metric_name.endswith(".count") else missing[:limit]


STATS_METRICS = frozenset({"column.min", "column.max", "column.sum", "column.mean", "column.standard_deviation"})
DISTINCT_METRICS = frozenset(
    {
        "column.distinct_values",
        "column.distinct_values.count",
        "column.distinct_values.count.under_threshold",
        "column.distinct_values.not_in_set",
        "column.distinct_values.not_in_set.count",
        "column.distinct_values.missing_from_column",
        "column.distinct_values.missing_from_column.count",
    }
)
TABLE_METRICS = frozenset({"table.row_count", "table.columns", "table.column_count", "table.column_types"})


class MissingColumn(Accumulator):
    """Stands for a metric over a column the data does not have: every expectation on it fails with this message."""

    def __init__(self, column: Optional[str], found: Sequence[str]) -> None:
        self.error = f"column {column!r} does not exist; the data has columns {list(found)}"

    def update(self, masks: Masks, offset: int) -> None:
        return None

    def value(self, metric_name: str, value_kwargs: dict[str, Any]) -> Any:
        return None

