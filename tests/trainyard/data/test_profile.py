"""Profiles of snapshots and the suites drafted from them."""

from __future__ import annotations

import json

import pyarrow as pa

from trainyard import data as dq


def test_profile_of_a_small_snapshot_is_exact(store):
    table = pa.table(
        {
            "x": pa.array([0.5, 2.0, None, float("inf"), -1.5], type=pa.float64()),
            "s": ["a", "b", "a", "a", None],
            "n": pa.array([3, 1, 3, 2, 3], type=pa.int64()),
            "ok": [True, False, True, True, True],
        }
    )
    dq.write_parquet_deterministic(table, store.uri("snap.parquet"))
    profile, sample = dq.profile_snapshot(store, store.uri("snap.parquet"))
    assert sample.equals(table)  # small data: the sample is every row
    assert profile == {
        "rows": 5,
        "columns": {
            "x": {
                "type": "double",
                "nulls": 1,
                "nan": 0,
                "posinf": 1,
                "neginf": 0,
                "min": -1.5,
                "max": 2.0,
                "counts": None,
                "distinct": None,
            },
            "s": {
                "type": "string",
                "nulls": 1,
                "nan": 0,
                "posinf": 0,
                "neginf": 0,
                "min": "a",
                "max": "b",
                "counts": [["a", 3], ["b", 1]],
                "distinct": ["a", "b"],
            },
            "n": {
                "type": "int64",
                "nulls": 0,
                "nan": 0,
                "posinf": 0,
                "neginf": 0,
                "min": 1,
                "max": 3,
                "counts": [[3, 3], [1, 1], [2, 1]],
                "distinct": [1, 2, 3],
            },
            "ok": {
                "type": "bool",
                "nulls": 0,
                "nan": 0,
                "posinf": 0,
                "neginf": 0,
                "min": False,
                "max": True,
                "counts": [[True, 4], [False, 1]],
                "distinct": [False, True],
            },
        },
    }



def test_suite_generated_from_a_profile_is_exact_and_passes_its_own_data(tmp_path, store, digits, digits_spec, failed):
    table = pa.Table.from_pandas(digits, preserve_index=False).replace_schema_metadata(None)
    dq.write_parquet_deterministic(table, store.uri("snap.parquet"))
    profile, _ = dq.profile_snapshot(store, store.uri("snap.parquet"))
    suite = dq.profile_to_suite(profile, "vision/digits", row_margin=0.5, range_margin=0.1)
    kinds = [(e["type"], e["kwargs"].get("column")) for e in suite["expectations"]]
    assert kinds[:2] == [
        ("expect_table_row_count_to_be_between", None),
        ("expect_table_columns_to_match_ordered_list", None),
    ]
    assert suite["expectations"][0]["kwargs"] == {"min_value": 150, "max_value": 450}
    by = {(e["type"], e["kwargs"].get("column")): e["kwargs"] for e in suite["expectations"]}
    low, high = digits["pixel_4_4"].min(), digits["pixel_4_4"].max()
    pad = (high - low) * 0.1
    assert by[("expect_column_values_to_be_between", "pixel_4_4")] == {
        "column": "pixel_4_4",
        "min_value": low - pad,
        "max_value": high + pad,
    }
    assert by[("expect_column_values_to_be_in_set", "source")]["value_set"] == ["scan", "tablet", "web"]
    assert by[("expect_column_values_to_be_in_set", "label")]["value_set"] == list(range(10))
    # int ranges widen to whole numbers: 0..9 plus 10% of 9 on each side
    assert by[("expect_column_values_to_be_between", "label")] == {"column": "label", "min_value": -1, "max_value": 10}
    assert ("expect_column_values_to_be_in_set", "pixel_4_4") not in by  # floats get ranges, not sets
    assert all(e["meta"] == {"generated_from": "profile"} for e in suite["expectations"])

    # edited, named in the spec, and run in place of the column-built suite
    suite["expectations"][0]["kwargs"]["min_value"] = 400  # the edit: at least 400 rows
    path = tmp_path / "suite.json"
    path.write_text(json.dumps(suite))
    spec = digits_spec(suite=str(path))
    assert dq.suite_expectations(spec) == [{"type": e["type"], "kwargs": e["kwargs"]} for e in suite["expectations"]]
    report = dq.validate(digits, spec)
    assert failed(report) == {("expect_table_row_count_to_be_between", None)}
    assert report.evaluated == len(suite["expectations"]) + 4
