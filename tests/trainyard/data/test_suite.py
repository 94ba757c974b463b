"""The expectation suite generated from a pipeline's columns, or read from its suite file."""

from __future__ import annotations

import json

import pytest

from trainyard import data as dq
from trainyard.spec import ColumnSpec


def test_expectation_configs_exact(digits_spec):
    spec = digits_spec(
        columns={
            "x": ColumnSpec(dtype="float", min=0, max=1),
            "n": ColumnSpec(dtype="int", nullable=True),
            "label": ColumnSpec(dtype="str", domain=["a", "b"]),
        },
        min_rows=3,
        max_rows=None,
    )
    assert dq.expectation_configs(spec) == [
        {"type": "expect_table_row_count_to_be_between", "kwargs": {"min_value": 3, "max_value": None}},
        {"type": "expect_table_columns_to_match_ordered_list", "kwargs": {"column_list": ["x", "n", "label"]}},
        {"type": "expect_column_to_exist", "kwargs": {"column": "x"}},
        {
            "type": "expect_column_values_to_be_in_type_list",
            "kwargs": {"column": "x", "type_list": ["float64", "float", "Float64Dtype"]},
        },
        {"type": "expect_column_values_to_not_be_null", "kwargs": {"column": "x"}},
        {"type": "expect_column_values_to_be_between", "kwargs": {"column": "x", "min_value": 0.0, "max_value": 1.0}},
        {"type": "expect_column_to_exist", "kwargs": {"column": "n"}},
        {
            "type": "expect_column_values_to_be_in_type_list",
            "kwargs": {"column": "n", "type_list": ["int64", "int", "Int64Dtype", "float64"]},
        },
        {"type": "expect_column_to_exist", "kwargs": {"column": "label"}},
        {
            "type": "expect_column_values_to_be_in_type_list",
            "kwargs": {"column": "label", "type_list": ["str", "StringDtype"]},
        },
        {"type": "expect_column_values_to_not_be_null", "kwargs": {"column": "label"}},
        {"type": "expect_column_values_to_be_in_set", "kwargs": {"column": "label", "value_set": ["a", "b"]}},
    ]



def test_a_bad_suite_file_fails_at_spec_time(tmp_path, digits_spec):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"suite '.*nope.json': cannot read"):
        digits_spec(suite=str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"expectations": [{"type": "column_values_between"}]}))
    with pytest.raises(
        ValidationError, match=r"expectations\[0\] needs a 'type' like 'expect_column_values_to_be_between'"
    ):
        digits_spec(suite=str(bad))



def test_unsupported_expectation_is_named_before_reading(digits, tmp_path, digits_spec):
    from trainyard.data.expectations import UnsupportedExpectation

    path = tmp_path / "suite.json"
    path.write_text(
        json.dumps(
            {
                "expectations": [
                    {"type": "expect_column_median_to_be_between", "kwargs": {"column": "label", "min_value": 0}}
                ]
            }
        )
    )
    with pytest.raises(
        UnsupportedExpectation,
        match=r"expectation 0 \('expect_column_median_to_be_between'\): needs metric 'column.median'",
    ):
        dq.validate(digits, digits_spec(suite=str(path)))
