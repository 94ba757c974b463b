"""The Arrow engine gives the results Great Expectations' own pandas engine gives, batch by batch."""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pytest

from trainyard.data.expectations import (
    ArrowSuite,
    UnsupportedExpectation,
    great_expectations,
    pandas_frame_for,
    render_data_docs,
)

CONFIGS = [
    {"type": "expect_table_row_count_to_be_between", "kwargs": {"min_value": 10, "max_value": 400}},
    {"type": "expect_table_columns_to_match_ordered_list", "kwargs": {"column_list": ["x", "n", "s", "b"]}},
    {"type": "expect_table_columns_to_match_set", "kwargs": {"column_set": ["x", "n", "q"]}},
    {"type": "expect_table_column_count_to_equal", "kwargs": {"value": 4}},
    {"type": "expect_column_to_exist", "kwargs": {"column": "q"}},
    {"type": "expect_column_values_to_not_be_null", "kwargs": {"column": "x"}},
    {"type": "expect_column_values_to_be_null", "kwargs": {"column": "s"}},
    {"type": "expect_column_values_to_be_between", "kwargs": {"column": "x", "min_value": -2, "max_value": 2}},
    {
        "type": "expect_column_values_to_be_between",
        "kwargs": {"column": "n", "min_value": 0, "max_value": 10, "strict_min": True},
    },
    {"type": "expect_column_values_to_be_in_set", "kwargs": {"column": "s", "value_set": ["a", "b", "c"]}},
    {"type": "expect_column_values_to_be_in_set", "kwargs": {"column": "n", "value_set": list(range(11))}},
    {"type": "expect_column_values_to_not_be_in_set", "kwargs": {"column": "n", "value_set": [11]}},
    {"type": "expect_column_values_to_be_in_type_list", "kwargs": {"column": "s", "type_list": ["str"]}},
    {"type": "expect_column_values_to_be_in_type_list", "kwargs": {"column": "s", "type_list": ["int64"]}},
    {"type": "expect_column_values_to_be_in_type_list", "kwargs": {"column": "x", "type_list": ["int64"]}},
    {"type": "expect_column_values_to_be_in_type_list", "kwargs": {"column": "b", "type_list": ["bool"]}},
    {"type": "expect_column_values_to_be_of_type", "kwargs": {"column": "n", "type_": "int64"}},
    {"type": "expect_column_values_to_match_regex", "kwargs": {"column": "s", "regex": "^[ab]"}},
    {"type": "expect_column_values_to_not_match_regex", "kwargs": {"column": "s", "regex": "z"}},
    {"type": "expect_column_value_lengths_to_be_between", "kwargs": {"column": "s", "min_value": 1, "max_value": 1}},
    {"type": "expect_column_min_to_be_between", "kwargs": {"column": "x", "min_value": -3}},
    {"type": "expect_column_max_to_be_between", "kwargs": {"column": "n", "max_value": 11}},
    {"type": "expect_column_mean_to_be_between", "kwargs": {"column": "n", "min_value": 4, "max_value": 7}},
    {"type": "expect_column_sum_to_be_between", "kwargs": {"column": "n", "min_value": 0}},
    {"type": "expect_column_stdev_to_be_between", "kwargs": {"column": "n", "min_value": 0, "max_value": 10}},
    {"type": "expect_column_distinct_values_to_be_in_set", "kwargs": {"column": "s", "value_set": ["a", "b"]}},
    {"type": "expect_column_distinct_values_to_equal_set", "kwargs": {"column": "n", "value_set": list(range(13))}},
    {
        "type": "expect_column_unique_value_count_to_be_between",
        "kwargs": {"column": "s", "min_value": 1, "max_value": 3},
    },
    {"type": "expect_column_values_to_be_between", "kwargs": {"column": "s", "min_value": 0, "max_value": 1}},
]


@pytest.fixture(scope="module")
def table() -> pa.Table:
    rng = np.random.default_rng(1)
    n = 500
    x = rng.normal(0, 1, n)
    x[[3, 50, 400]] = np.nan
    x[7] = np.inf
    x[9] = -5
    s = np.array(["a", "b", "c", "zz"], dtype=object)[rng.integers(0, 4, n)]
    s[[1, 200]] = None
    return pa.table(
        {
            "x": pa.array(x, from_pandas=False),
            "n": pa.array(rng.integers(0, 12, n)),
            "s": pa.array(list(s), type=pa.string()),
            "b": pa.array(rng.integers(0, 2, n).astype(bool)),
        }
    )


def _norm(value):
    """Results compared as JSON; NaN and None are both 'missing' (pandas shows None in text as NaN)."""
    if isinstance(value, float):
        return None if math.isnan(value) else round(value, 9)
    if isinstance(value, dict):
        return {k: _norm(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_norm(v) for v in value]
    if isinstance(value, set):
        return sorted(map(str, value))
    if isinstance(value, np.generic):
        return _norm(value.item())
    return value


def _key(result) -> str:
    kwargs = {k: v for k, v in result.expectation_config.kwargs.items() if k != "batch_id"}
    return json.dumps([result.expectation_config.type, kwargs], sort_keys=True, default=str)


def test_results_equal_great_expectations_pandas_engine(table):
    gx = great_expectations()
    from great_expectations.expectations.expectation_configuration import ExpectationConfiguration

    suite = ArrowSuite(CONFIGS, table.schema, name="t")
    for batch in table.to_batches(max_chunksize=170):  # three batches
        suite.update(batch)
    ours = suite.results()
    assert suite.rows == 500

    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    batch_definition = (
        context.data_sources.add_pandas(name="p")
        .add_dataframe_asset(name="d")
        .add_batch_definition_whole_dataframe(name="all")
    )
    expectations = [ExpectationConfiguration(type=c["type"], kwargs=c["kwargs"]).to_domain_obj() for c in CONFIGS]
    ge_suite = context.suites.add(gx.ExpectationSuite(name="t", expectations=expectations))
    definition = context.validation_definitions.add(
        gx.ValidationDefinition(name="v", data=batch_definition, suite=ge_suite)
    )
    frame = table.to_pandas().astype({"s": object})
    theirs = {
        _key(r): r
        for r in definition.run(
            batch_parameters={"dataframe": frame},
            result_format={"result_format": "SUMMARY", "partial_unexpected_count": 5},
        ).results
    }
    assert len(ours) == len(CONFIGS) == len(theirs)
    for config, mine in zip(CONFIGS, ours):
        other = theirs[_key(mine)]
        assert mine.success == other.success, config
        if config["type"].startswith("expect_column_distinct_values"):  # GE lists a set in hash order
            mine.result["partial_unexpected_list"].sort(key=repr)
            other.result["partial_unexpected_list"].sort(key=repr)
        assert _norm(mine.result) == _norm(other.result), config
        assert bool(mine.exception_info.get("raised_exception")) == bool(_raised(other.exception_info)), config
    failed = [c["type"] for c, r in zip(CONFIGS, ours) if not r.success]
    assert "expect_column_values_to_be_between" in failed and "expect_table_row_count_to_be_between" in failed


def _raised(info) -> bool:
    if "raised_exception" in info:
        return info["raised_exception"]
    return any(v.get("raised_exception") for v in info.values() if isinstance(v, dict))


def test_text_columns_are_object_for_great_expectations(table):
    frame = pandas_frame_for(table.schema)
    assert [str(t) for t in frame.dtypes] == ["float64", "int64", "object", "bool"]
    assert len(frame) == 0


def test_unexpected_mask_judges_rows_like_the_counts(table):
    suite = ArrowSuite(CONFIGS, table.schema)
    between = next(i for i, c in enumerate(CONFIGS) if c["type"] == "expect_column_values_to_be_between")
    batch = table.to_batches()[0]
    mask = suite.unexpected_mask(between, batch).to_numpy(zero_copy_only=False)
    x = batch.column("x").to_numpy(zero_copy_only=False)
    expected = (~np.isnan(x)) & ((x < -2) | (x > 2))
    assert (mask == expected).all()
    assert suite.map_condition(0) is None  # the row count does not judge rows
    with pytest.raises(ValueError, match="does not judge single rows"):
        suite.unexpected_mask(0, batch)
    not_null = ArrowSuite([{"type": "expect_column_values_to_not_be_null", "kwargs": {"column": "x"}}], table.schema)
    assert not_null.unexpected_mask(0, batch).to_pylist() == np.isnan(x).tolist()


@pytest.mark.parametrize(
    "config, message",
    [
        (
            {"type": "expect_nothing_at_all", "kwargs": {}},
            r"expectation 0 \('expect_nothing_at_all'\): not a valid Great Expectations expectation",
        ),
        (
            {"type": "expect_column_values_to_be_between", "kwargs": {"min_value": 1}},
            r"(?s)not a valid Great Expectations expectation: .*column\n  field required",
        ),
        (
            {"type": "expect_column_values_to_be_unique", "kwargs": {"column": "n"}},
            r"needs metric 'column_values.unique.unexpected_count'",
        ),
        (
            {
                "type": "expect_column_quantile_values_to_be_between",
                "kwargs": {"column": "x", "quantile_ranges": {"quantiles": [0.5], "value_ranges": [[0, 1]]}},
            },
            r"needs metric 'column.quantile_values'",
        ),
        (
            {"type": "expect_column_pair_values_a_to_be_greater_than_b", "kwargs": {"column_A": "x", "column_B": "n"}},
            r"single columns only",
        ),
    ],
)
def test_unsupported_expectations_are_named(table, config, message):
    with pytest.raises(UnsupportedExpectation, match=message):
        ArrowSuite([config], table.schema)


def test_expectations_on_missing_columns_fail_with_the_columns_found(table):
    suite = ArrowSuite(
        [
            {"type": "expect_column_values_to_be_in_type_list", "kwargs": {"column": "nope", "type_list": ["int64"]}},
            {"type": "expect_column_to_exist", "kwargs": {"column": "nope"}},
        ],
        table.schema,
    )
    suite.update(table.to_batches()[0])
    missing, exists = suite.results()
    assert (
        not missing.success
        and missing.exception_info["exception_message"]
        == "column 'nope' does not exist; the data has columns ['x', 'n', 's', 'b']"
    )
    assert not exists.success and not exists.exception_info.get("raised_exception")


def test_batches_must_have_the_suite_schema(table):
    suite = ArrowSuite(CONFIGS[:1], table.schema)
    with pytest.raises(ValueError, match="differs from the suite's schema"):
        suite.update(table.select(["x", "n"]).to_batches()[0])


def test_data_docs_render_failures_and_errors(table):
    suite = ArrowSuite(CONFIGS, table.schema, name="team/pipe")
    for batch in table.to_batches():
        suite.update(batch)
    html = render_data_docs(suite.results(), "team/pipe", run_name="abc123", meta={"snapshot": "s3://b/data.parquet"})
    assert html.startswith("<!DOCTYPE html>") or "<html" in html
    assert "team/pipe" in html and "abc123" in html
    assert "expect_column_values_to_be_between" in html or "values must be greater than or equal to" in html
    assert "has no kernel matching input types" in html  # the range check on text raised, and the page says so


def test_suite_json_has_no_ids(table):
    doc = ArrowSuite(CONFIGS[:3], table.schema, name="t").suite_json()
    assert doc["name"] == "t" and "id" not in doc
    assert [e["type"] for e in doc["expectations"]] == [c["type"] for c in CONFIGS[:3]]
    assert all("id" not in e for e in doc["expectations"])
