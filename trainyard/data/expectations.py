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
  `trainyard.data.metrics.DISTINCT_LIMIT` distinct values).

Row positions are global: the first row of the first batch is 0. As in GE's
pandas engine, NaN counts as a missing value.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Optional, Sequence

import pyarrow as pa

from trainyard.data.metrics import (
    DISTINCT_METRICS,
    MAP_CONDITIONS,
    MAP_SUFFIXES,
    STATS_METRICS,
    TABLE_METRICS,
    Accumulator,
    ColumnStats,
    DistinctValues,
    MapCondition,
    Masks,
    MissingColumn,
    TableMetrics,
)

if TYPE_CHECKING:
    import pandas as pd

PARTIAL_UNEXPECTED_COUNT = 5
"""Unexpected values and row positions kept per expectation."""


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
    handed over as object columns, whose values GE checks one by one. Nor
    can it name a Python date or a zoned pandas dtype: a date column is
    shown as `datetime64[s]` and a zoned timestamp column as the naive
    `datetime64[<unit>]` of its UTC times (`trainyard.data.suite.GX_TYPE_NAMES`).
    """
    import pandas as pd

    shown = pa.schema(
        [
            pa.field(f.name, pa.timestamp("s"))
            if pa.types.is_date(f.type)
            else pa.field(f.name, pa.timestamp(f.type.unit))
            if pa.types.is_timestamp(f.type) and f.type.tz is not None
            else f
            for f in schema
        ]
    )
    frame = shown.empty_table().to_pandas()
    text = {c: object for c in frame.columns if isinstance(frame[c].dtype, pd.StringDtype)}
    return frame.astype(text) if text else frame


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
        self,
        expectations: Sequence[dict[str, Any]],
        schema: pa.Schema,
        name: str = "suite",
        partial: int = PARTIAL_UNEXPECTED_COUNT,
    ) -> None:
        great_expectations()
        from great_expectations.core.batch_spec import RuntimeDataBatchSpec
        from great_expectations.exceptions import GreatExpectationsError
        from great_expectations.execution_engine import PandasExecutionEngine
        from great_expectations.expectations.expectation_configuration import ExpectationConfiguration

        self.name = name
        self.schema = schema
        self.rows = 0
        self.partial = partial
        self.runtime_configuration = {
            "result_format": {"result_format": "SUMMARY", "partial_unexpected_count": partial}
        }
        frame = pandas_frame_for(schema)
        self._engine = PandasExecutionEngine()
        batch_data, _ = self._engine.get_batch_data_and_markers(RuntimeDataBatchSpec(batch_data=frame))
        self._engine.load_batch_data("trainyard-schema", batch_data)
        self._table = TableMetrics(schema, frame)
        self._accumulators: dict[str, Accumulator] = {"table": self._table}
        self.expectations: list[Any] = []
        # Per expectation: metric id -> (accumulator key, metric name, value kwargs)
        self._plans: list[dict[Any, tuple[str, str, dict[str, Any]]]] = []
        self._map_keys: list[Optional[str]] = []
        for i, config in enumerate(expectations):
            where = f"expectation {i} ({config.get('type')!r})"
            # Unknown types raise GE's own error; bad kwargs raise pydantic (v1) ValidationError, a ValueError.
            try:
                expectation = ExpectationConfiguration(
                    type=config["type"], kwargs=dict(config.get("kwargs") or {})
                ).to_domain_obj()
            except (GreatExpectationsError, ValueError, TypeError, KeyError) as e:
                raise UnsupportedExpectation(f"{where}: not a valid Great Expectations expectation: {e}") from e
            plan = {}
            map_keys = []
            absent = [c for c in _columns_named(config.get("kwargs") or {}) if c not in schema.names]
            if absent and config["type"] != "expect_column_to_exist":
                # GE's pandas engine fails such an expectation with an error; so does this one.
                key = f"missing:{absent[0]}"
                self._accumulators.setdefault(key, MissingColumn(absent[0], schema.names))
                self.expectations.append(expectation)
                self._plans.append({("missing", absent[0]): (key, "missing", {})})
                self._map_keys.append(None)
                continue
            deps = expectation.get_validation_dependencies(
                execution_engine=self._engine, runtime_configuration=self.runtime_configuration
            ).get_metric_configurations()
            for mc in deps:
                key, is_map = self._plan_metric(where, mc)
                plan[mc.id] = (
                    key,
                    mc.metric_name,
                    {k: v for k, v in mc.metric_value_kwargs.items() if k != "result_format"},
                )
                if is_map and key not in map_keys:
                    map_keys.append(key)
            # A map expectation also asks for the nonnull count (to report missing values); its own
            # condition is the other one, unless not-null is the condition itself.
            own = [k for k in map_keys if self._condition(k) != "nonnull"] or map_keys
            self.expectations.append(expectation)
            self._plans.append(plan)
            self._map_keys.append(own[0] if own else None)

    def _condition(self, key: str) -> Optional[str]:
        acc = self._accumulators[key]
        return acc.condition if isinstance(acc, MapCondition) else None

    def _plan_metric(self, where: str, mc: Any) -> tuple[str, bool]:
        name = mc.metric_name
        domain = {k: v for k, v in mc.metric_domain_kwargs.items() if v is not None and k not in ("batch_id", "table")}
        if domain.pop("row_condition", None) is not None or domain.pop("condition_parser", None) is not None:
            raise UnsupportedExpectation(f"{where}: row conditions are not supported")
        column = domain.pop("column", None)
        if domain:
            raise UnsupportedExpectation(
                f"{where}: metric {name!r} over {sorted(domain)} is not supported (single columns only)"
            )
        if name in TABLE_METRICS:
            return "table", False
        if column is None or column not in self.schema.names:
            # GE's pandas engine fails the same way: the expectation raises and is reported as failed.
            key = f"missing:{column}"
            self._accumulators.setdefault(key, MissingColumn(column, self.schema.names))
            return key, False
        if name in STATS_METRICS:
            key = f"stats:{column}"
            self._accumulators.setdefault(key, ColumnStats(column))
            return key, False
        if name in DISTINCT_METRICS:
            key = f"distinct:{column}"
            self._accumulators.setdefault(key, DistinctValues(column))
            return key, False
        if name.startswith("column_values."):
            body, _, suffix = name[len("column_values.") :].rpartition(".")
            if body in MAP_CONDITIONS and suffix in MAP_SUFFIXES:
                kwargs = {k: v for k, v in mc.metric_value_kwargs.items() if k != "result_format"}
                key = f"map:{column}:{body}:{_freeze(kwargs)}"
                if key not in self._accumulators:
                    self._accumulators[key] = MapCondition(
                        column, body, kwargs, self.schema.field(column).type, self.partial
                    )
                return key, True
        raise UnsupportedExpectation(
            f"{where}: needs metric {name!r}, which is not computed over batches; supported are table metrics, "
            f"column map conditions {list(MAP_CONDITIONS)}, {sorted(STATS_METRICS)} and the column.distinct_values "
            "family"
        )

    def update(self, batch: pa.RecordBatch) -> None:
        """Add one batch (its schema must equal the suite's)."""
        if not batch.schema.equals(self.schema):
            raise ValueError(f"batch schema {batch.schema} differs from the suite's schema {self.schema}")
        masks = Masks(batch)
        for acc in self._accumulators.values():
            acc.feed(masks, self.rows)
        self.rows += batch.num_rows

    def results(self) -> list[Any]:
        """One GE `ExpectationValidationResult` per expectation, in suite order."""
        from great_expectations.core.expectation_validation_result import ExpectationValidationResult

        out = []
        for expectation, plan in zip(self.expectations, self._plans):
            errors = sorted({error for key, _, _ in plan.values() if (error := self._accumulators[key].error)})
            if errors:
                out.append(
                    ExpectationValidationResult(
                        success=False,
                        expectation_config=expectation.configuration,
                        # Data Docs show the traceback; the message is all there is (no Python frame raised it).
                        exception_info={
                            "raised_exception": True,
                            "exception_message": "; ".join(errors),
                            "exception_traceback": "; ".join(errors),
                        },
                    )
                )
                continue
            metrics = {mid: self._accumulators[key].value(name, kwargs) for mid, (key, name, kwargs) in plan.items()}
            out.append(
                expectation.metrics_validate(
                    metrics, runtime_configuration=dict(self.runtime_configuration), execution_engine=self._engine
                )
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
            raise ValueError(
                f"expectation {index} ({self.expectations[index].expectation_type}) does not judge single rows"
            )
        return condition.unexpected(Masks(batch))

    def suite_json(self) -> dict[str, Any]:
        """The suite as GE JSON, without GE's random ids."""
        gx = great_expectations()
        import copy

        suite = gx.ExpectationSuite(name=self.name, expectations=[copy.copy(e) for e in self.expectations])
        return _without_ids(suite.to_json_dict())


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


def render_data_docs(
    results: Sequence[Any], suite_name: str, run_name: str, meta: Optional[dict[str, Any]] = None
) -> str:
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
