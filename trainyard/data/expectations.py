"""Great Expectations suites evaluated over Arrow record batches, in bounded memory.

GE's pandas engine needs the whole table as one DataFrame, which neither fits
large snapshots nor runs fast. Here the *metrics* each expectation depends on
(row count, column types, the unexpected count and samples of a map
condition, min/max/mean, distinct values...) are computed with
`pyarrow.compute`, batch by batch, and Great Expectations turns them into
results with `Expectation.metrics_validate` -- the step GE's own `Validator`
runs once an execution engine has computed the metrics. Success rules, result
fields and Data Docs are GE's; only the arithmetic is streamed.

Which metrics an expectation needs is asked of GE
(`get_validation_dependencies`) against a zero-row pandas frame with the
dtypes GE's pandas engine would see for the Arrow schema, so results match
GE's pandas engine on the same data (tests compare the two).

Supported metrics (everything else raises `UnsupportedExpectation` before any
data is read, naming the expectation and metric):

- table: `table.row_count`, `table.columns`, `table.column_count`, `table.column_types`;
- column map conditions, with counts and the first `partial_unexpected_count`
  values and row positions: `nonnull`, `null`, `between`, `in_set`,
  `not_in_set`, `in_type_list` (text columns), `match_regex`,
  `not_match_regex`, `value_length.between`;
- column aggregates: `column.min`, `column.max`, `column.sum`, `column.mean`,
  `column.standard_deviation`, and the `column.distinct_values` family (up to
  `DISTINCT_LIMIT` distinct values).

Row positions are global: the first row of the first batch is 0. As in GE's
pandas engine, NaN counts as a missing value.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Iterable, Optional, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

PARTIAL_UNEXPECTED_COUNT = 5
DISTINCT_LIMIT = 100_000
"""Most distinct values a `column.distinct_values` metric may collect before it refuses."""

_MAP_SUFFIXES = ("unexpected_count", "unexpected_values", "unexpected_index_list", "unexpected_index_query")
_MAP_CONDITIONS = (
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
# Conditions judged on every row; the others only on present (non-null, non-NaN) values, as in GE.
_UNFILTERED = frozenset({"nonnull", "null"})
_ARROW_ERRORS = (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError)


class UnsupportedExpectation(ValueError):
    """An expectation needs a metric this engine cannot compute over batches (or its kwargs are invalid)."""


def great_expectations() -> Any:
    """The `great_expectations` module, imported with usage statistics off."""
    os.environ["GX_ANALYTICS_ENABLED"] = "False"  # read when GE is first imported
    import great_expectations as gx

    return gx


def pandas_frame_for(schema: pa.Schema) -> pd.DataFrame:
    """A zero-row frame with the dtypes GE's pandas engine sees for `schema`; text columns are `object`.

    GE 1.x cannot name pandas' string dtypes in a type list, so text is
    handed over as object columns, whose values GE checks one by one.
    """
    frame = schema.empty_table().to_pandas()
    text = {c: object for c in frame.columns if isinstance(frame[c].dtype, pd.StringDtype)}
    return frame.astype(text) if text else frame


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_float(t: pa.DataType) -> bool:
    return pa.types.is_floating(t)


def _value_array(values: Iterable[Any], t: pa.DataType) -> pa.Array:
    """The values of a GE `value_set` that can equal a value of type `t`, as an Arrow array of `t`.

    Mirrors pandas' `isin`: `1 == 1.0 == True`, but `"1" != 1`.
    """
    values = [v for v in values if v is not None]
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


class _Masks:
    """Per-batch cache of each column's missing-value mask (null, or NaN for floats)."""

    def __init__(self, batch: pa.RecordBatch) -> None:
        self.batch = batch
        self._missing: dict[str, pa.Array] = {}

    def column(self, name: str) -> pa.Array:
        return self.batch.column(name)

    def missing(self, name: str) -> pa.Array:
        if name not in self._missing:
            col = self.batch.column(name)
            self._missing[name] = pc.is_null(col, nan_is_null=True) if _is_float(col.type) else pc.is_null(col)
        return self._missing[name]


class _Accumulator:
    """Computes one or more metrics over the batches; `error` holds why it could not."""

    error: Optional[str] = None

    def update(self, masks: _Masks, offset: int) -> None:
        raise NotImplementedError

    def value(self, metric_name: str, value_kwargs: dict[str, Any]) -> Any:
        raise NotImplementedError

    def feed(self, masks: _Masks, offset: int) -> None:
        if self.error is not None:
            return
        try:
            self.update(masks, offset)
        except _ARROW_ERRORS + (KeyError, ValueError, TypeError) as e:
            self.error = f"{type(e).__name__}: {e}"


class _TableMetrics(_Accumulator):
    def __init__(self, schema: pa.Schema, frame: pd.DataFrame) -> None:
        self.rows = 0
        self.schema = schema
        self.frame = frame

    def update(self, masks: _Masks, offset: int) -> None:
        self.rows += masks.batch.num_rows

    def value(self, metric_name: str, value_kwargs: dict[str, Any]) -> Any:
        if metric_name == "table.row_count":
            return self.rows
        if metric_name == "table.columns":
            return list(self.schema.names)
        if metric_name == "table.column_count":
            return len(self.schema.names)
        return [{"name": c, "type": self.frame[c].dtype} for c in self.frame.columns]


class MapCondition(_Accumulator):
    """A column map condition: which rows are unexpected, how many, and the first few of them.

    Attributes:
        column: The column judged.
        condition: One of the supported conditions (e.g. `between`).
        kwargs: The condition's value kwargs (e.g. `min_value`).
    """

    def __init__(self, column: str, condition: str, kwargs: dict[str, Any], column_type: pa.DataType, partial: int) -> None:
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

    def unexpected(self, masks: _Masks) -> pa.Array:
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

    def update(self, masks: _Masks, offset: int) -> None:
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


class _ColumnStats(_Accumulator):
    """min, max, sum, mean and sample standard deviation of the present values (Chan's parallel update)."""

    def __init__(self, column: str) -> None:
        self.column = column
        self.min: Any = None
        self.max: Any = None
        self.n = 0
        self.sum: Any = 0
        self.mean = 0.0
        self.m2 = 0.0

    def update(self, masks: _Masks, offset: int) -> None:
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


class _Distinct(_Accumulator):
    """The set of distinct present values of a column, up to `DISTINCT_LIMIT`."""

    def __init__(self, column: str) -> None:
        self.column = column
        self.values: set[Any] = set()

    def update(self, masks: _Masks, offset: int) -> None:
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


_STATS_METRICS = frozenset({"column.min", "column.max", "column.sum", "column.mean", "column.standard_deviation"})
_DISTINCT_METRICS = frozenset(
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
_TABLE_METRICS = frozenset({"table.row_count", "table.columns", "table.column_count", "table.column_types"})


def _freeze(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


class ArrowSuite:
    """One GE expectation suite, fed Arrow record batches, producing GE validation results.

    Example:
        >>> suite = ArrowSuite([{"type": "expect_column_values_to_be_between",
        ...                      "kwargs": {"column": "x", "min_value": 0, "max_value": 1}}], schema)  # doctest: +SKIP
        >>> for batch in batches:  # doctest: +SKIP
        ...     suite.update(batch)
        >>> [r.success for r in suite.results()]  # doctest: +SKIP
        [True]

    Args:
        expectations: The suite as GE `type`/`kwargs` dicts.
        schema: Schema of every batch that will be fed.
        name: Suite name (shown in Data Docs).
        partial: How many unexpected values and row positions to keep per expectation.

    Raises:
        UnsupportedExpectation: An expectation is unknown to GE, has invalid
            kwargs, uses a row condition, or needs a metric listed as
            unsupported in the module docstring.
    """

    def __init__(
        self, expectations: Sequence[dict[str, Any]], schema: pa.Schema, name: str = "suite", partial: int = PARTIAL_UNEXPECTED_COUNT
    ) -> None:
        great_expectations()
        from great_expectations.core.batch_spec import RuntimeDataBatchSpec
        from great_expectations.exceptions import GreatExpectationsError
        from great_expectations.execution_engine import PandasExecutionEngine
        from great_expectations.expectations.expectation_configuration import ExpectationConfiguration

        self.name = name
        self.schema = schema
        self.rows = 0
        self.runtime_configuration = {"result_format": {"result_format": "SUMMARY", "partial_unexpected_count": partial}}
        frame = pandas_frame_for(schema)
        self._engine = PandasExecutionEngine()
        batch_data, _ = self._engine.get_batch_data_and_markers(RuntimeDataBatchSpec(batch_data=frame))
        self._engine.load_batch_data("trainyard-schema", batch_data)
        self._table = _TableMetrics(schema, frame)
        self._accumulators: dict[str, _Accumulator] = {"table": self._table}
        self.expectations: list[Any] = []
        # Per expectation: metric id -> (accumulator key, metric name, value kwargs)
        self._plans: list[dict[Any, tuple[str, str, dict[str, Any]]]] = []
        self._map_keys: list[Optional[str]] = []
        for i, config in enumerate(expectations):
            where = f"expectation {i} ({config.get('type')!r})"
            # Unknown types raise GE's own error; bad kwargs raise pydantic (v1) ValidationError, a ValueError.
            try:
                expectation = ExpectationConfiguration(type=config["type"], kwargs=dict(config.get("kwargs") or {})).to_domain_obj()
            except (GreatExpectationsError, ValueError, TypeError, KeyError) as e:
                raise UnsupportedExpectation(f"{where}: not a valid Great Expectations expectation: {e}") from e
            plan = {}
            map_keys = []
            absent = [c for c in _columns_named(config.get("kwargs") or {}) if c not in schema.names]
            if absent and config["type"] != "expect_column_to_exist":
                # GE's pandas engine fails such an expectation with an error; so does this one.
                key = f"missing:{absent[0]}"
                self._accumulators.setdefault(key, _Missing(absent[0], schema.names))
                self.expectations.append(expectation)
                self._plans.append({("missing", absent[0]): (key, "missing", {})})
                self._map_keys.append(None)
                continue
            deps = expectation.get_validation_dependencies(
                execution_engine=self._engine, runtime_configuration=self.runtime_configuration
            ).get_metric_configurations()
            for mc in deps:
                key, is_map = self._plan_metric(where, mc)
                plan[mc.id] = (key, mc.metric_name, {k: v for k, v in mc.metric_value_kwargs.items() if k != "result_format"})
                if is_map and key not in map_keys:
                    map_keys.append(key)
            # A map expectation also asks for the nonnull count (to report missing values); its own
            # condition is the other one, unless not-null is the condition itself.
            own = [k for k in map_keys if self._accumulators[k].condition != "nonnull"] or map_keys
            self.expectations.append(expectation)
            self._plans.append(plan)
            self._map_keys.append(own[0] if own else None)

    def _plan_metric(self, where: str, mc: Any) -> tuple[str, bool]:
        name = mc.metric_name
        domain = {k: v for k, v in mc.metric_domain_kwargs.items() if v is not None and k not in ("batch_id", "table")}
        if domain.pop("row_condition", None) is not None or domain.pop("condition_parser", None) is not None:
            raise UnsupportedExpectation(f"{where}: row conditions are not supported")
        column = domain.pop("column", None)
        if domain:
            raise UnsupportedExpectation(f"{where}: metric {name!r} over {sorted(domain)} is not supported (single columns only)")
        if name in _TABLE_METRICS:
            return "table", False
        if column is None or column not in self.schema.names:
            # GE's pandas engine fails the same way: the expectation raises and is reported as failed.
            key = f"missing:{column}"
            self._accumulators.setdefault(key, _Missing(column, self.schema.names))
            return key, False
        if name in _STATS_METRICS:
            key = f"stats:{column}"
            self._accumulators.setdefault(key, _ColumnStats(column))
            return key, False
        if name in _DISTINCT_METRICS:
            key = f"distinct:{column}"
            self._accumulators.setdefault(key, _Distinct(column))
            return key, False
        if name.startswith("column_values."):
            body, _, suffix = name[len("column_values.") :].rpartition(".")
            if body in _MAP_CONDITIONS and suffix in _MAP_SUFFIXES:
                kwargs = {k: v for k, v in mc.metric_value_kwargs.items() if k != "result_format"}
                key = f"map:{column}:{body}:{_freeze(kwargs)}"
                if key not in self._accumulators:
                    partial = self.runtime_configuration["result_format"]["partial_unexpected_count"]
                    self._accumulators[key] = MapCondition(column, body, kwargs, self.schema.field(column).type, partial)
                return key, True
        raise UnsupportedExpectation(
            f"{where}: needs metric {name!r}, which is not computed over batches; supported are table metrics, "
            f"column map conditions {list(_MAP_CONDITIONS)}, {sorted(_STATS_METRICS)} and the column.distinct_values family"
        )

    def update(self, batch: pa.RecordBatch) -> None:
        """Add one batch (its schema must equal the suite's)."""
        if not batch.schema.equals(self.schema):
            raise ValueError(f"batch schema {batch.schema} differs from the suite's schema {self.schema}")
        masks = _Masks(batch)
        for acc in self._accumulators.values():
            acc.feed(masks, self.rows)
        self.rows += batch.num_rows

    def results(self) -> list[Any]:
        """One GE `ExpectationValidationResult` per expectation, in suite order."""
        from great_expectations.core.expectation_validation_result import ExpectationValidationResult

        out = []
        for expectation, plan in zip(self.expectations, self._plans):
            errors = sorted({self._accumulators[key].error for key, _, _ in plan.values() if self._accumulators[key].error})
            if errors:
                out.append(
                    ExpectationValidationResult(
                        success=False,
                        expectation_config=expectation.configuration,
                        # Data Docs show the traceback; the message is all there is (no Python frame raised it).
                        exception_info={"raised_exception": True, "exception_message": "; ".join(errors), "exception_traceback": "; ".join(errors)},
                    )
                )
                continue
            metrics = {mid: self._accumulators[key].value(name, kwargs) for mid, (key, name, kwargs) in plan.items()}
            out.append(
                expectation.metrics_validate(metrics, runtime_configuration=dict(self.runtime_configuration), execution_engine=self._engine)
            )
        return out

    def map_condition(self, index: int) -> Optional[MapCondition]:
        """The row condition of expectation `index` when it judges rows one by one, else None."""
        key = self._map_keys[index]
        acc = self._accumulators.get(key) if key else None
        return acc if isinstance(acc, MapCondition) else None

    def unexpected_mask(self, index: int, batch: pa.RecordBatch) -> pa.Array:
        """Which rows of `batch` expectation `index` finds unexpected (it must have a `map_condition`)."""
        condition = self.map_condition(index)
        if condition is None:
            raise ValueError(f"expectation {index} ({self.expectations[index].expectation_type}) does not judge single rows")
        return condition.unexpected(_Masks(batch))

    def suite_json(self) -> dict[str, Any]:
        """The suite as GE JSON, without GE's random ids."""
        gx = great_expectations()
        import copy

        suite = gx.ExpectationSuite(name=self.name, expectations=[copy.copy(e) for e in self.expectations])
        return _without_ids(suite.to_json_dict())


class _Missing(_Accumulator):
    """Stands for a metric over a column the data does not have: every expectation on it fails with this message."""

    def __init__(self, column: Optional[str], found: Sequence[str]) -> None:
        self.error = f"column {column!r} does not exist; the data has columns {list(found)}"

    def update(self, masks: _Masks, offset: int) -> None:
        return None

    def value(self, metric_name: str, value_kwargs: dict[str, Any]) -> Any:
        return None


def _columns_named(kwargs: dict[str, Any]) -> list[str]:
    """The columns an expectation's kwargs name as its domain."""
    return [n for n in (kwargs.get(k) for k in ("column", "column_A", "column_B")) if isinstance(n, str)]


def _without_ids(value: Any) -> Any:
    """GE gives every suite and expectation a random id; drop them so equal suites give equal JSON."""
    if isinstance(value, dict):
        return {k: _without_ids(v) for k, v in value.items() if k != "id"}
    if isinstance(value, list):
        return [_without_ids(v) for v in value]
    return value


def render_data_docs(results: Sequence[Any], suite_name: str, run_name: str, meta: Optional[dict[str, Any]] = None) -> str:
    """GE's Data Docs validation page for `results`, as standalone HTML.

    Args:
        results: GE `ExpectationValidationResult`s (e.g. `ArrowSuite.results()`).
        suite_name: Shown as the suite's name.
        run_name: Shown as the run's name (e.g. the data version).
        meta: Extra facts shown with the run (e.g. the snapshot URI).
    """
    great_expectations()
    from great_expectations.core import ExpectationSuiteValidationResult
    from great_expectations.core.run_identifier import RunIdentifier
    from great_expectations.render.renderer import ValidationResultsPageRenderer
    from great_expectations.render.view import DefaultJinjaPageView

    passed = sum(1 for r in results if r.success)
    suite_result = ExpectationSuiteValidationResult(
        success=passed == len(results),
        results=list(results),
        suite_name=suite_name,
        statistics={
            "evaluated_expectations": len(results),
            "successful_expectations": passed,
            "unsuccessful_expectations": len(results) - passed,
            "success_percent": 100.0 * passed / len(results) if results else 100.0,
        },
        meta={"active_batch_definition": None, "run_id": RunIdentifier(run_name=run_name), **(meta or {})},
    )
    return DefaultJinjaPageView().render(ValidationResultsPageRenderer().render(suite_result))
