"""Platform checks: finite floats, duplicate rows and the row hashes behind them."""

from __future__ import annotations

import math
import os

import numpy as np
import pandas as pd
import pyarrow as pa

from resources.storage import ObjectStore
from trainyard import data as dq
from trainyard.data.checks import DuplicateRows
from trainyard.spec import ColumnSpec, SourceSpec


def test_nan_and_inf_fail_the_finite_check(tmp_path, digits, spec, digits_spec, failed):
    table = pa.Table.from_pandas(digits, preserve_index=False).replace_schema_metadata(None)
    values = table.column("pixel_3_4").to_numpy().copy()
    values[[4, 8, 12]] = [np.inf, -np.inf, np.nan]  # a real NaN, as Parquet and Arrow keep it
    bad = table.set_column(1, "pixel_3_4", pa.array(values, from_pandas=False))
    store = ObjectStore(root=str(tmp_path))
    dq.write_parquet_deterministic(bad, store.uri("d.parquet"))
    report = dq.validate_snapshot(store, store.uri("d.parquet"), spec).report
    finite = next(r for r in report.failures() if r["expectation"] == dq.FINITE_EXPECTATION)
    assert finite["column"] == "pixel_3_4"
    assert finite["observed_value"] == {"nan": 1, "+inf": 1, "-inf": 1}
    assert finite["unexpected_count"] == 3 and finite["unexpected_index_list"] == [4, 8, 12]
    assert finite["unexpected_values"] == [math.inf, -math.inf, "nan"]
    assert [r["_row"] for r in finite["sample_rows"]] == [4, 8, 12]
    # +-inf are also outside the declared range; NaN is also missing
    between = next(r for r in report.failures() if r["expectation"] == "expect_column_values_to_be_between")
    assert between["unexpected_index_list"] == [4, 8]
    assert ("expect_column_values_to_not_be_null", "pixel_3_4") in failed(report)
    allowed = digits_spec(
        columns={**digits_spec().columns, "pixel_3_4": ColumnSpec(dtype="float", nullable=True, finite=False)}
    )
    assert dq.validate_snapshot(store, store.uri("d.parquet"), allowed).report.success



def test_duplicate_rows_fail_unless_allowed(digits, digits_spec, failed):
    strict = digits_spec(allow_duplicate_rows=False, source=SourceSpec(prefix="landing/digits", duplicates="reject"))
    unique = digits.drop_duplicates().reset_index(drop=True)
    assert dq.validate(unique, strict).success
    doubled = pd.concat([unique, unique.iloc[[5, 5, 9]]], ignore_index=True)
    report = dq.validate(doubled, strict)
    assert failed(report) == {(dq.UNIQUE_ROWS_EXPECTATION, None)}
    dup = report.failures()[0]
    n = len(unique)
    assert dup["unexpected_count"] == 3 and dup["observed_value"] == {"duplicate_rows": 3}
    assert dup["unexpected_index_list"] == [n, n + 1, n + 2]
    assert dup["unexpected_values"] == [
        f"row {n} repeats row 5",
        f"row {n + 1} repeats row 5",
        f"row {n + 2} repeats row 9",
    ]
    assert dq.validate(doubled, digits_spec(allow_duplicate_rows=True)).success
    assert dq.validate(
        doubled, digits_spec(allow_duplicate_rows=False, source=SourceSpec(prefix="landing/digits", duplicates="allow"))
    ).success


def test_duplicate_rows_are_dropped_with_a_count_by_default(digits, digits_spec):
    default = digits_spec(allow_duplicate_rows=False)
    assert default.source.duplicates == "keep_first"
    unique = digits.drop_duplicates().reset_index(drop=True)
    doubled = pd.concat([unique, unique.iloc[[5, 5, 9]]], ignore_index=True)
    report = dq.validate(doubled, default)
    assert report.success
    [dup] = [r for r in report.results if r["expectation"] == dq.UNIQUE_ROWS_EXPECTATION]
    assert dup["unexpected_count"] == 3 and dup["observed_value"]["duplicate_rows"] == 3
    verdict = dq.decide(report, [], default)
    assert verdict.accepted and verdict.set_aside
    assert verdict.warnings == ["3 repeated row(s) dropped, the first of each kept (source.duplicates='keep_first')"]



def test_row_hashes_treat_equal_values_as_equal():
    batch = pa.RecordBatch.from_pydict(
        {
            "x": pa.array([0.0, -0.0, float("nan"), float("nan"), None, 1.0], type=pa.float64()),
            "s": pa.array(["a", "a", "b", "b", None, None]),
            "n": pa.array([1, 1, None, None, 0, 0], type=pa.int64()),
        }
    )
    h = dq.row_hashes(batch)
    assert h[0] == h[1] and h[2] == h[3]
    assert len({int(v) for v in h[[0, 2, 4, 5]]}) == 4
    swapped = pa.RecordBatch.from_pydict({"a": [1, 2], "b": [2, 1]})
    assert dq.row_hashes(swapped)[0] != dq.row_hashes(swapped)[1]



def test_duplicate_check_spills_to_disk_with_the_same_answer(tmp_path):
    rng = np.random.default_rng(3)
    n = 20_000
    values = rng.integers(0, 5_000, size=(n, 2))  # plenty of repeated pairs
    batches = pa.Table.from_pydict({"a": values[:, 0], "b": values[:, 1]}).to_batches(max_chunksize=3_000)
    expected = np.flatnonzero(pd.DataFrame(values).duplicated().to_numpy())
    answers = []
    for memory in (dq.DEDUP_MEMORY_BYTES, 16 * 1024):
        work = tmp_path / str(memory)
        work.mkdir()
        check = DuplicateRows(n, str(work), memory_bytes=memory)
        offset = 0
        for batch in batches:
            check.update(batch, offset)
            offset += batch.num_rows
        check.finish()
        answers.append((check.bits, check.count, check.positions.tolist(), check.samples))
        assert os.listdir(work) == []  # bucket files are removed
    (bits_mem, *in_memory), (bits_disk, *on_disk) = answers
    assert bits_mem == 0 and bits_disk == 5
    assert in_memory == on_disk
    assert in_memory[1] == expected.tolist()
    first_dup = int(expected[0])
    original = int(np.flatnonzero((values == values[first_dup]).all(axis=1))[0])
    assert in_memory[2][0] == (first_dup, original)
