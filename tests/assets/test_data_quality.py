"""Data quality functions on a few hundred rows of scikit-learn's digits."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainyard.data import quality as dq
from trainyard.spec import ColumnSpec, ModelSpec, PipelineSpec, SourceSpec, SplitSpec
from resources.storage import ObjectStore

PIXELS = ["pixel_2_3", "pixel_3_4", "pixel_4_4", "pixel_5_2"]


def make_spec(**overrides) -> PipelineSpec:
    fields = dict(
        team="vision",
        name="digits",
        source=SourceSpec(prefix="landing/digits"),
        columns={
            **{p: ColumnSpec(dtype="float", min=0, max=16) for p in PIXELS},
            "source": ColumnSpec(dtype="str", domain=["scan", "tablet", "web"]),
            "checked": ColumnSpec(dtype="bool"),
            "label": ColumnSpec(dtype="int", domain=list(range(10))),
        },
        target="label",
        min_rows=50,
        max_rows=1000,
        split=SplitSpec(val_fraction=0.2, test_fraction=0.2, seed=7),
        model=ModelSpec(path="pipelines.vision.models:DigitsMLP"),
        allow_duplicate_rows=True,  # four pixels of 300 digits repeat; the duplicate check has its own tests
    )
    fields.update(overrides)
    return PipelineSpec(**fields)


@pytest.fixture(scope="module")
def digits() -> pd.DataFrame:
    """300 digits rows in canonical form, read back the way the assets read them (Parquet -> pandas)."""
    from sklearn.datasets import load_digits

    frame = load_digits(as_frame=True).frame.iloc[:300].reset_index(drop=True)
    df = pd.DataFrame({p: frame[p].astype("float64") for p in PIXELS})
    df["source"] = np.array(["scan", "tablet", "web"])[np.arange(300) % 3]
    df["checked"] = np.arange(300) % 4 == 0
    df["label"] = frame["target"].astype("int64")
    return pa.Table.from_pandas(df, preserve_index=False).to_pandas()


@pytest.fixture(scope="module")
def spec() -> PipelineSpec:
    return make_spec()


@pytest.fixture
def store(tmp_path) -> ObjectStore:
    return ObjectStore(root=str(tmp_path / "store"))


# --------------------------------------------------------------------------- canonical


def test_to_canonical_selects_orders_and_casts():
    spec = make_spec(
        columns={
            "x": ColumnSpec(dtype="float"),
            "n": ColumnSpec(dtype="str"),
            "ok": ColumnSpec(dtype="bool"),
            "label": ColumnSpec(dtype="int"),
        }
    )
    raw = pa.table({"label": ["1", "0"], "extra": [9, 9], "ok": ["true", "false"], "n": [10, 20], "x": [1, 2]})
    table = dq.to_canonical(raw, spec)
    assert table.schema == pa.schema([("x", pa.float64()), ("n", pa.string()), ("ok", pa.bool_()), ("label", pa.int64())])
    assert table.to_pydict() == {"x": [1.0, 2.0], "n": ["10", "20"], "ok": [True, False], "label": [1, 0]}
    assert table.schema.metadata is None


def test_to_canonical_missing_column_names_it_and_the_columns_found(spec, digits):
    table = pa.Table.from_pandas(digits.drop(columns=["source"]), preserve_index=False)
    with pytest.raises(dq.SchemaMismatch) as info:
        dq.to_canonical(table, spec)
    assert str(info.value).startswith("declared column(s) ['source'] not found; the data has columns ['pixel_2_3',")


def test_to_canonical_uncastable_values_are_named():
    spec = make_spec(columns={"x": ColumnSpec(dtype="float"), "label": ColumnSpec(dtype="int")})
    raw = pa.table({"x": [1.0, 2.0, 3.0, 4.0], "label": ["1", "two", None, "three"]})
    expected = r"column 'label' cannot be cast from string to declared dtype 'int' \(int64\); offending values: \['two', 'three'\]"
    with pytest.raises(dq.SchemaMismatch, match=expected):
        dq.to_canonical(raw, spec)
    fractional = pa.table({"x": [1.0], "label": [1.5]})
    with pytest.raises(dq.SchemaMismatch, match=r"offending values: \[1.5\]"):
        dq.to_canonical(fractional, spec)

    nested = pa.table({"x": [1.0], "label": pa.array([[1, 2]])})
    with pytest.raises(dq.SchemaMismatch, match=r"column 'label' cannot be cast from list<item: int64> .*Arrow has no cast"):
        dq.to_canonical(nested, spec)


# --------------------------------------------------------------------------- parquet


def test_parquet_bytes_depend_only_on_the_data(tmp_path, digits):
    table = pa.Table.from_pandas(digits, preserve_index=False)  # carries pandas metadata
    rechunked = pa.Table.from_batches(table.to_batches(max_chunksize=37)).replace_schema_metadata(None)
    paths = [str(tmp_path / n) for n in ("a.parquet", "b.parquet", "c.parquet")]
    dq.write_parquet_deterministic(table, paths[0])
    dq.write_parquet_deterministic(table, paths[1])
    dq.write_parquet_deterministic(rechunked, paths[2])
    contents = [open(p, "rb").read() for p in paths]
    assert contents[0] == contents[1] == contents[2]
    assert pq.read_table(paths[0]).equals(table.replace_schema_metadata(None))
    assert sorted(os.listdir(tmp_path)) == ["a.parquet", "b.parquet", "c.parquet"]

    dq.write_parquet_deterministic(table.slice(1), str(tmp_path / "d.parquet"))
    assert open(tmp_path / "d.parquet", "rb").read() != contents[0]


# --------------------------------------------------------------------------- validation


def test_expectation_configs_exact():
    spec = make_spec(
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
        {"type": "expect_column_values_to_be_in_type_list", "kwargs": {"column": "x", "type_list": ["float64", "float", "Float64Dtype"]}},
        {"type": "expect_column_values_to_not_be_null", "kwargs": {"column": "x"}},
        {"type": "expect_column_values_to_be_between", "kwargs": {"column": "x", "min_value": 0.0, "max_value": 1.0}},
        {"type": "expect_column_to_exist", "kwargs": {"column": "n"}},
        {
            "type": "expect_column_values_to_be_in_type_list",
            "kwargs": {"column": "n", "type_list": ["int64", "int", "Int64Dtype", "float64"]},
        },
        {"type": "expect_column_to_exist", "kwargs": {"column": "label"}},
        {"type": "expect_column_values_to_be_in_type_list", "kwargs": {"column": "label", "type_list": ["str", "StringDtype"]}},
        {"type": "expect_column_values_to_not_be_null", "kwargs": {"column": "label"}},
        {"type": "expect_column_values_to_be_in_set", "kwargs": {"column": "label", "value_set": ["a", "b"]}},
    ]


def _failed(report: dq.ValidationReport) -> set[tuple[str, str | None]]:
    return {(r["expectation"], r["column"]) for r in report.failures()}


def test_good_data_passes(digits, spec):
    report = dq.validate(digits, spec)
    assert report.success, report.to_markdown()
    assert report.failed == 0
    configs = dq.expectation_configs(spec)
    assert len(configs) == 2 + 4 * 4 + 4 + 3 + 4
    # the suite, then one finite check per float column (duplicates are allowed by this spec)
    assert report.evaluated == len(configs) + 4
    assert [r["expectation"] for r in report.results] == [c["type"] for c in configs] + [dq.FINITE_EXPECTATION] * 4
    assert [r["source"] for r in report.results] == ["suite"] * len(configs) + ["platform"] * 4
    assert report.rows == 300
    row_count = report.results[0]
    assert row_count["observed_value"] == 300 and row_count["column"] is None
    json.dumps(report.model_dump(mode="json"))  # fit for Dagster metadata and the quarantine report
    assert "id" not in report.suite and all("id" not in e for e in report.suite["expectations"])
    assert report.suite["name"] == "vision/digits"


def test_wrong_type_fails_the_type_expectation(digits, spec):
    bad = digits.assign(label=digits["label"] + 0.5, source=np.arange(len(digits)) % 3)
    report = dq.validate(bad, spec)
    assert not report.success
    assert ("expect_column_values_to_be_in_type_list", "label") in _failed(report)
    assert ("expect_column_values_to_be_in_type_list", "source") in _failed(report)
    label_type = next(r for r in report.failures() if r["column"] == "label" and "type" in r["expectation"])
    assert label_type["observed_value"] == "float64"


def test_out_of_range_fails_between_with_samples(digits, spec):
    bad = digits.copy()
    bad.loc[[3, 9], "pixel_4_4"] = [99.0, -1.0]
    report = dq.validate(bad, spec)
    assert _failed(report) == {("expect_column_values_to_be_between", "pixel_4_4")}
    result = report.failures()[0]
    assert result["unexpected_count"] == 2
    assert result["unexpected_values"] == [99.0, -1.0]
    assert result["unexpected_index_list"] == [3, 9]
    assert result["row_level"]
    assert [r["_row"] for r in result["sample_rows"]] == [3, 9]
    assert result["sample_rows"][0]["pixel_4_4"] == 99.0 and result["sample_rows"][0]["label"] == bad.loc[3, "label"]
    markdown = report.failing_rows_markdown()
    assert "**expect_column_values_to_be_between** on `pixel_4_4`: 2 unexpected" in markdown
    assert "| row | pixel_2_3 | pixel_3_4 | pixel_4_4 | pixel_5_2 | source | checked | label |" in markdown


def test_null_fails_not_null(digits, spec):
    bad = digits.copy()
    bad.loc[5, "pixel_2_3"] = np.nan
    report = dq.validate(bad, spec)
    # a pandas NaN is a missing value (Arrow null), as in GE's pandas engine
    assert _failed(report) == {("expect_column_values_to_not_be_null", "pixel_2_3")}
    assert report.failures()[0]["unexpected_count"] == 1


def test_nan_and_inf_fail_the_finite_check(tmp_path, digits, spec):
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
    assert ("expect_column_values_to_not_be_null", "pixel_3_4") in _failed(report)
    allowed = make_spec(columns={**make_spec().columns, "pixel_3_4": ColumnSpec(dtype="float", nullable=True, finite=False)})
    assert dq.validate_snapshot(store, store.uri("d.parquet"), allowed).report.success


def test_duplicate_rows_fail_unless_allowed(digits):
    strict = make_spec(allow_duplicate_rows=False)
    unique = digits.drop_duplicates().reset_index(drop=True)
    assert dq.validate(unique, strict).success
    doubled = pd.concat([unique, unique.iloc[[5, 5, 9]]], ignore_index=True)
    report = dq.validate(doubled, strict)
    assert _failed(report) == {(dq.UNIQUE_ROWS_EXPECTATION, None)}
    dup = report.failures()[0]
    n = len(unique)
    assert dup["unexpected_count"] == 3 and dup["observed_value"] == {"duplicate_rows": 3}
    assert dup["unexpected_index_list"] == [n, n + 1, n + 2]
    assert dup["unexpected_values"] == [f"row {n} repeats row 5", f"row {n + 1} repeats row 5", f"row {n + 2} repeats row 9"]
    assert dq.validate(doubled, make_spec(allow_duplicate_rows=True)).success


def test_unknown_category_fails_in_set(digits, spec):
    bad = digits.copy()
    bad.loc[0, "source"] = "fax"
    bad.loc[1, "label"] = 11
    report = dq.validate(bad, spec)
    assert _failed(report) == {("expect_column_values_to_be_in_set", "source"), ("expect_column_values_to_be_in_set", "label")}
    samples = {r["column"]: r["unexpected_values"] for r in report.failures()}
    assert samples == {"source": ["fax"], "label": [11]}


def test_too_few_rows_fails_row_count(digits, spec):
    report = dq.validate(digits.head(20), spec)
    assert _failed(report) == {("expect_table_row_count_to_be_between", None)}
    assert report.failures()[0]["observed_value"] == 20


def test_missing_and_reordered_columns_fail(digits, spec):
    report = dq.validate(digits.drop(columns=["checked"]), spec)
    failed = _failed(report)
    assert ("expect_table_columns_to_match_ordered_list", None) in failed
    assert ("expect_column_to_exist", "checked") in failed
    reordered = dq.validate(digits[["label", *digits.columns[:-1]]], spec)
    assert _failed(reordered) == {("expect_table_columns_to_match_ordered_list", None)}


def test_int_range_is_checked():
    spec = make_spec(columns={"x": ColumnSpec(dtype="float"), "label": ColumnSpec(dtype="int", min=0, max=9)}, min_rows=1)
    report = dq.validate(pd.DataFrame({"x": [0.5, 0.2, 0.3], "label": np.array([1, 2, 12])}), spec)
    assert _failed(report) == {("expect_column_values_to_be_between", "label")}
    assert report.failures()[0]["unexpected_values"] == [12]


def test_nullable_int_read_back_as_float_passes(tmp_path):
    spec = make_spec(
        columns={"x": ColumnSpec(dtype="float"), "n": ColumnSpec(dtype="int", nullable=True), "label": ColumnSpec(dtype="int")},
        min_rows=1,
    )
    table = dq.to_canonical(pa.table({"x": [1.0, 2.0, 3.0], "n": [1, None, 3], "label": [0, 1, 0]}), spec)
    path = str(tmp_path / "d.parquet")
    dq.write_parquet_deterministic(table, path)
    df = pd.read_parquet(path)
    assert str(df["n"].dtype) == "float64"
    assert dq.validate(df, spec).success


def test_markdown_lists_every_expectation(digits, spec):
    bad = digits.copy()
    bad.loc[0, "source"] = "fax|x"
    markdown = dq.validate(bad, spec).to_markdown()
    lines = markdown.splitlines()
    total = len(dq.expectation_configs(spec)) + 4
    assert lines[0] == f"**FAILED**: {total - 1} of {total} expectations passed"
    assert lines[2] == "| expectation | column | success | observed | unexpected | sample |"
    assert len(lines) == 4 + total
    assert "| expect_column_values_to_be_in_set | source | **no** |  | 1 | 'fax\\|x' |" in lines


# --------------------------------------------------------------------------- split


def test_split_is_deterministic_disjoint_and_stratified(digits, spec):
    train, val, test = dq.split(digits, spec)
    again = dq.split(digits, spec)
    for part, same in zip((train, val, test), again):
        pd.testing.assert_frame_equal(part, same)
    assert (len(train), len(val), len(test)) == (180, 60, 60)
    keys = [tuple(r) for part in (train, val, test) for r in part.itertuples(index=False)]
    assert sorted(keys) == sorted(tuple(r) for r in digits.itertuples(index=False))
    overall = digits["label"].value_counts(normalize=True).sort_index()
    for part in (train, val, test):
        share = part["label"].value_counts(normalize=True).sort_index()
        assert np.allclose(share, overall, atol=0.03)
    other_seed = dq.split(digits, make_spec(split=SplitSpec(val_fraction=0.2, test_fraction=0.2, seed=8)))
    assert not other_seed[2].equals(test)


def test_split_keeps_input_order(digits, spec):
    tagged = digits.assign(pixel_2_3=np.arange(len(digits), dtype="float64"))
    for part in dq.split(tagged, spec):
        assert part["pixel_2_3"].is_monotonic_increasing
        assert list(part.index) == list(range(len(part)))


def test_split_with_a_too_rare_class_names_the_counts(digits, spec):
    rare = pd.concat([digits[digits["label"] != 9], digits[digits["label"] == 9].head(1)], ignore_index=True)
    with pytest.raises(dq.SplitError, match=r"stratified on 'label'.*rows per class: \{0: \d+, .*9: 1\}"):
        dq.split(rare, spec)


def test_split_float_target_is_random(digits):
    spec = make_spec(
        columns={"pixel_2_3": ColumnSpec(dtype="float"), "pixel_3_4": ColumnSpec(dtype="float")}, target="pixel_3_4"
    )
    train, val, test = dq.split(digits[["pixel_2_3", "pixel_3_4"]], spec)
    assert (len(train), len(val), len(test)) == (180, 60, 60)


# --------------------------------------------------------------------------- drift


def test_psi_of_identical_data_is_zero(digits):
    assert dq.psi(digits["pixel_4_4"], digits["pixel_4_4"].copy()) == 0.0
    assert dq.psi(digits["source"], digits["source"]) == 0.0


def test_psi_of_shifted_data_is_large():
    rng = np.random.default_rng(0)
    prev = pd.Series(rng.normal(0, 1, 2000))
    same = pd.Series(rng.normal(0, 1, 2000))
    shifted = pd.Series(rng.normal(1, 1, 2000))
    assert dq.psi(prev, same) < 0.05
    assert dq.psi(prev, shifted) > 0.5


def test_psi_exact_categorical_value():
    prev = pd.Series(["a", "a", "b", "b"])
    cur = pd.Series(["a", "a", "a", "b"])
    assert dq.psi(prev, cur) == pytest.approx(0.25 * math.log(1.5) + 0.25 * math.log(2), abs=1e-12)


def test_psi_counts_nulls_and_values_outside_the_domain():
    prev = pd.Series([0, 1, 0, 1] * 25, dtype="float64")
    with_nulls = pd.Series([0, 1, None, None] * 25, dtype="float64")
    assert dq.psi(prev, with_nulls, categories=[0, 1]) > 1.0
    outside = pd.Series([0, 1, 7, 7] * 25)
    assert dq.psi(prev, outside, categories=[0, 1]) > 1.0


def test_psi_rejects_bad_arguments():
    with pytest.raises(ValueError, match="bins must be >= 1, got 0"):
        dq.psi(pd.Series([1.0]), pd.Series([1.0]), bins=0)
    with pytest.raises(ValueError, match="got 0 previous and 1 current"):
        dq.psi(pd.Series([], dtype=float), pd.Series([1.0]))


def test_drift_report_per_feature(digits, spec):
    assert dq.drift_report(digits, digits, spec) == {name: 0.0 for name in spec.features}
    moved = digits.assign(pixel_3_4=digits["pixel_3_4"] + 8, source="web")
    report = dq.drift_report(digits, moved, spec)
    assert list(report) == spec.features
    assert report["pixel_3_4"] > 1.0 and report["source"] > 1.0
    assert report["pixel_2_3"] == 0.0 and report["checked"] == 0.0
    with pytest.raises(dq.SchemaMismatch, match="feature column 'checked' not found in the current data"):
        dq.drift_report(digits, digits.drop(columns=["checked"]), spec)


# --------------------------------------------------------------------------- canonical writer


def test_canonical_writer_bytes_do_not_depend_on_batch_sizes(tmp_path, digits, monkeypatch):
    monkeypatch.setitem(dq.PARQUET_OPTIONS, "row_group_size", 64)  # several row groups from 300 rows
    table = pa.Table.from_pandas(digits, preserve_index=False).replace_schema_metadata(None)
    paths = []
    for i, size in enumerate((1, 37, 64, 300)):
        path = str(tmp_path / f"{i}.parquet")
        with dq.CanonicalParquetWriter(path, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=size):
                writer.write(batch)
        assert writer.rows == 300
        paths.append(path)
    contents = {open(p, "rb").read() for p in paths}
    assert len(contents) == 1
    meta = pq.ParquetFile(paths[0]).metadata
    assert [meta.row_group(g).num_rows for g in range(meta.num_row_groups)] == [64, 64, 64, 64, 44]
    assert pq.read_table(paths[0]).equals(table)
    # a float column is written without a dictionary, the others with one
    encodings = {meta.schema.column(c).name: meta.row_group(0).column(c).encodings for c in range(meta.num_columns)}
    assert "RLE_DICTIONARY" not in encodings["pixel_2_3"] and "RLE_DICTIONARY" in encodings["source"]


def test_canonical_writer_leaves_nothing_on_error(tmp_path, digits):
    table = pa.Table.from_pandas(digits, preserve_index=False).replace_schema_metadata(None)
    with pytest.raises(ValueError, match="differs from the writer's schema"):
        with dq.CanonicalParquetWriter(str(tmp_path / "x.parquet"), table.schema) as writer:
            writer.write(table.to_batches()[0])
            writer.write(table.drop_columns(["label"]).to_batches()[0])
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------- duplicate rows


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
        check = dq._DuplicateRows(n, str(work), memory_bytes=memory)
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


# --------------------------------------------------------------------------- profile and generated suites


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
            "x": {"type": "double", "nulls": 1, "nan": 0, "posinf": 1, "neginf": 0, "min": -1.5, "max": 2.0, "counts": None, "distinct": None},
            "s": {"type": "string", "nulls": 1, "nan": 0, "posinf": 0, "neginf": 0, "min": "a", "max": "b", "counts": [["a", 3], ["b", 1]], "distinct": ["a", "b"]},
            "n": {"type": "int64", "nulls": 0, "nan": 0, "posinf": 0, "neginf": 0, "min": 1, "max": 3, "counts": [[3, 3], [1, 1], [2, 1]], "distinct": [1, 2, 3]},
            "ok": {"type": "bool", "nulls": 0, "nan": 0, "posinf": 0, "neginf": 0, "min": False, "max": True, "counts": [[True, 4], [False, 1]], "distinct": [False, True]},
        },
    }


def test_suite_generated_from_a_profile_is_exact_and_passes_its_own_data(tmp_path, store, digits):
    table = pa.Table.from_pandas(digits, preserve_index=False).replace_schema_metadata(None)
    dq.write_parquet_deterministic(table, store.uri("snap.parquet"))
    profile, _ = dq.profile_snapshot(store, store.uri("snap.parquet"))
    suite = dq.profile_to_suite(profile, "vision/digits", row_margin=0.5, range_margin=0.1)
    kinds = [(e["type"], e["kwargs"].get("column")) for e in suite["expectations"]]
    assert kinds[:2] == [("expect_table_row_count_to_be_between", None), ("expect_table_columns_to_match_ordered_list", None)]
    assert suite["expectations"][0]["kwargs"] == {"min_value": 150, "max_value": 450}
    by = {(e["type"], e["kwargs"].get("column")): e["kwargs"] for e in suite["expectations"]}
    low, high = digits["pixel_4_4"].min(), digits["pixel_4_4"].max()
    pad = (high - low) * 0.1
    assert by[("expect_column_values_to_be_between", "pixel_4_4")] == {"column": "pixel_4_4", "min_value": low - pad, "max_value": high + pad}
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
    spec = make_spec(suite=str(path))
    assert dq.suite_expectations(spec) == [{"type": e["type"], "kwargs": e["kwargs"]} for e in suite["expectations"]]
    report = dq.validate(digits, spec)
    assert _failed(report) == {("expect_table_row_count_to_be_between", None)}
    assert report.evaluated == len(suite["expectations"]) + 4


def test_a_bad_suite_file_fails_at_spec_time(tmp_path):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"suite '.*nope.json': cannot read"):
        make_spec(suite=str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"expectations": [{"type": "column_values_between"}]}))
    with pytest.raises(ValidationError, match=r"expectations\[0\] needs a 'type' like 'expect_column_values_to_be_between'"):
        make_spec(suite=str(bad))


def test_unsupported_expectation_is_named_before_reading(digits, tmp_path):
    from trainyard.data.expectations import UnsupportedExpectation

    path = tmp_path / "suite.json"
    path.write_text(json.dumps({"expectations": [{"type": "expect_column_median_to_be_between", "kwargs": {"column": "label", "min_value": 0}}]}))
    with pytest.raises(UnsupportedExpectation, match=r"expectation 0 \('expect_column_median_to_be_between'\): needs metric 'column.median'"):
        dq.validate(digits, make_spec(suite=str(path)))


# --------------------------------------------------------------------------- drift from profiles


def _profiled(store, frame: pd.DataFrame, name: str):
    dq.write_parquet_deterministic(pa.Table.from_pandas(frame, preserve_index=False), store.uri(f"{name}.parquet"))
    return dq.profile_snapshot(store, store.uri(f"{name}.parquet"))


def test_drift_from_profiles_equals_psi_on_small_data_and_adds_ks(store, digits, spec):
    from scipy.stats import ks_2samp

    moved = digits.assign(pixel_3_4=digits["pixel_3_4"] / 2, source="web")
    prev, cur = _profiled(store, digits, "prev"), _profiled(store, moved, "cur")
    rows = dq.drift(*prev, *cur, spec)
    assert [r["column"] for r in rows] == spec.features
    expected_psi = dq.drift_report(digits, moved, spec)
    for r in rows:
        assert r["psi"] == pytest.approx(expected_psi[r["column"]], abs=1e-12), r["column"]
    by = {r["column"]: r for r in rows}
    assert by["source"]["method"] == "psi-categories" and by["source"]["ks"] is None
    assert by["pixel_3_4"]["method"] == "psi-quantiles+ks"
    assert by["pixel_3_4"]["ks"] == pytest.approx(ks_2samp(digits["pixel_3_4"], moved["pixel_3_4"]).statistic)
    assert by["pixel_2_3"]["ks"] == 0.0 and by["checked"]["psi"] == 0.0
    assert not any(r["drifted"] for r in rows)  # no thresholds set

    strict = make_spec(max_drift_psi=0.25, max_drift_ks=0.2)
    flagged = {r["column"] for r in dq.drift(*prev, *cur, strict) if r["drifted"]}
    assert flagged == {"pixel_3_4", "source"}
    markdown = dq.drift_markdown(dq.drift(*prev, *cur, strict), strict)
    assert markdown.startswith("thresholds: PSI > 0.25, KS > 0.2")
    assert "| source | psi-categories |" in markdown and "**yes**" in markdown


# --------------------------------------------------------------------------- policy


def _report(*failures: dict) -> dq.ValidationReport:
    results = [
        {"expectation": "expect_a", "column": "x", "kwargs": {}, "success": True, "observed_value": None, "unexpected_count": 0,
         "unexpected_values": [], "unexpected_index_list": [], "exception": None, "source": "suite", "row_level": True, "sample_rows": []},
        *failures,
    ]
    return dq.ValidationReport(success=not failures, evaluated=len(results), failed=len(failures), results=results, suite={})


ROW_FAILURE = {"expectation": "expect_column_values_to_be_between", "column": "x", "kwargs": {}, "success": False, "observed_value": None,
               "unexpected_count": 3, "unexpected_values": [99], "unexpected_index_list": [1], "exception": None, "source": "suite",
               "row_level": True, "sample_rows": []}
TABLE_FAILURE = {**ROW_FAILURE, "expectation": "expect_table_row_count_to_be_between", "column": None, "unexpected_count": None,
                 "observed_value": 3, "row_level": False}
DRIFTED = {"column": "x", "method": "psi-quantiles+ks", "psi": 0.9, "ks": 0.5, "ks_pvalue": 0.0, "drifted": True, "note": ""}


def test_decide_follows_the_policy():
    reject, warn = make_spec(), make_spec(on_bad_data="warn")
    assert dq.decide(_report(), [], reject) == dq.Verdict(accepted=True, set_aside=False, reasons=[], warnings=[])

    rejected = dq.decide(_report(ROW_FAILURE), [DRIFTED], reject)
    assert not rejected.accepted
    assert rejected.reasons == [
        "1 of 2 expectations failed",
        "drift above threshold in ['x']",
        "expect_column_values_to_be_between on 'x': 3 unexpected",
        "drift on 'x': PSI 0.900, KS 0.500",
    ]
    warned = dq.decide(_report(ROW_FAILURE), [DRIFTED], warn)
    assert warned.accepted and warned.set_aside
    assert warned.warnings[0] == "3 failing value(s) set aside in quarantine"
    drift_only = dq.decide(_report(), [DRIFTED], warn)
    assert drift_only.accepted and not drift_only.set_aside and drift_only.warnings == ["drift on 'x': PSI 0.900, KS 0.500"]
    assert not dq.decide(_report(TABLE_FAILURE), [], warn).accepted  # too few rows cannot be fixed by dropping rows

    release = {"released_by": "ada", "released_at": "2026-01-01T00:00:00+00:00", "reason": "checked with the owner"}
    released = dq.decide(_report(TABLE_FAILURE), [], reject, release)
    assert released.accepted and not released.set_aside and released.release == release
    assert released.warnings[0] == "released by ada at 2026-01-01T00:00:00+00:00: checked with the owner"


# --------------------------------------------------------------------------- snapshots: set aside, split


def test_set_aside_rows_moves_exactly_the_failing_rows(store, digits):
    spec = make_spec(on_bad_data="warn", allow_duplicate_rows=False)
    unique = digits.drop_duplicates().reset_index(drop=True)
    bad = pd.concat([unique, unique.iloc[[7]]], ignore_index=True)  # one duplicate at the end
    bad.loc[3, "pixel_4_4"] = 99.0
    bad.loc[10, "source"] = "fax"
    table = pa.Table.from_pandas(bad, preserve_index=False).replace_schema_metadata(None)
    dq.write_parquet_deterministic(table, store.uri("snap.parquet"))
    validation = dq.validate_snapshot(store, store.uri("snap.parquet"), spec)
    assert {(r["expectation"], r["column"]) for r in validation.report.failures()} == {
        ("expect_column_values_to_be_between", "pixel_4_4"),
        ("expect_column_values_to_be_in_set", "source"),
        (dq.UNIQUE_ROWS_EXPECTATION, None),
    }
    good_path, bad_path = str(store.uri("good.parquet")), str(store.uri("bad.parquet"))
    kept, moved = dq.set_aside_rows(store, store.uri("snap.parquet"), validation, spec, good_path, bad_path)
    assert (kept, moved) == (len(bad) - 3, 3)
    rejected = pq.read_table(bad_path).to_pandas()
    assert rejected["_row"].tolist() == [3, 10, len(bad) - 1]
    accepted = pq.read_table(good_path).to_pandas()
    pd.testing.assert_frame_equal(accepted, bad.drop(index=[3, 10, len(bad) - 1]).reset_index(drop=True))
    assert dq.validate(accepted, spec).success


def test_split_snapshot_streams_the_same_split_as_in_memory(store, digits, spec, tmp_path, monkeypatch):
    table = pa.Table.from_pandas(digits, preserve_index=False).replace_schema_metadata(None)
    dq.write_parquet_deterministic(table, store.uri("snap.parquet"))
    counts = dq.split_snapshot(store, store.uri("snap.parquet"), spec, str(tmp_path / "out"), batch_rows=50)
    assert counts == {"train": 180, "val": 60, "test": 60}
    for name, expected in zip(("train", "val", "test"), dq.split(digits, spec)):
        pd.testing.assert_frame_equal(pq.read_table(tmp_path / "out" / f"{name}.parquet").to_pandas(), expected)


# --------------------------------------------------------------------------- validate_version and the quarantine


def _raw(store, frame: pd.DataFrame, md5: str) -> dict:
    uri = store.uri("data", "vision", "digits", "raw", md5, "data.parquet")
    dq.write_parquet_deterministic(pa.Table.from_pandas(frame, preserve_index=False), uri)
    return {"uri": uri, "md5": md5, "rows": len(frame), "dvc_file": ""}


def test_validate_version_rejects_then_a_release_lets_it_through(store, digits, spec):
    good = dq.validate_version(store, spec, _raw(store, digits, "a" * 32))
    assert good.verdict.accepted and good.quarantine is None and good.drift == []
    assert good.value["rows"] == {"train": 180, "val": 60, "test": 60} and good.value["set_aside"] == 0
    latest = store.read_json(store.uri("data", "vision", "digits", "validated", "latest.json"))
    assert latest["md5"] == "a" * 32 and store.exists(latest["profile_uri"]) and store.exists(latest["sample_uri"])
    assert "<html" in open(good.docs_uri).read()

    bad = digits.copy()
    bad.loc[[3, 9], "pixel_4_4"] = [99.0, -1.0]
    outcome = dq.validate_version(store, spec, _raw(store, bad, "b" * 32))
    assert not outcome.verdict.accepted and outcome.value is None
    assert [d["column"] for d in outcome.drift] == spec.features  # against version a
    where = outcome.quarantine
    assert where == store.uri("quarantine", "vision", "digits", "b" * 32)
    report = store.read_json(f"{where}/report.json")
    assert report["kind"] == "snapshot" and report["md5"] == "b" * 32 and report["policy"] == "reject"
    assert report["reasons"][0] == "1 of 33 expectations failed"
    failing = [r for r in report["validation"]["results"] if not r["success"]]
    assert [r["_row"] for r in failing[0]["sample_rows"]] == [3, 9]
    assert open(f"{where}/data.parquet", "rb").read() == open(store.uri("data", "vision", "digits", "raw", "b" * 32, "data.parquet"), "rb").read()
    assert report["data_docs"] == outcome.docs_uri
    assert store.read_json(store.uri("data", "vision", "digits", "validated", "latest.json"))["md5"] == "a" * 32

    [entry] = dq.list_quarantine(store, "vision/digits")
    assert (entry.id, entry.kind, entry.summary, entry.released) == ("b" * 32, "snapshot", "1 of 33 expectations failed", None)
    with pytest.raises(dq.QuarantineError, match="release needs a reason"):
        dq.release_quarantine(store, "vision/digits", "b" * 32, "  ", by="ada")
    with pytest.raises(dq.QuarantineError, match=r"no quarantine entry 'c+' for pipeline 'vision/digits'; entries: \['b+'\]"):
        dq.release_quarantine(store, "vision/digits", "c" * 32, "ok", by="ada")
    record = dq.release_quarantine(store, "vision/digits", "b" * 32, "range checked with the owner", by="ada", at="2026-02-03T04:05:06+00:00")
    assert record == {"pipeline": "vision/digits", "md5": "b" * 32, "released_by": "ada", "released_at": "2026-02-03T04:05:06+00:00", "reason": "range checked with the owner"}
    with pytest.raises(dq.QuarantineError, match="already released by ada at 2026-02-03T04:05:06"):
        dq.release_quarantine(store, "vision/digits", "b" * 32, "again", by="bob")
    assert dq.read_quarantine(store, "vision/digits", "b" * 32)["release"] == record

    released = dq.validate_version(store, spec, _raw(store, bad, "b" * 32))
    assert released.verdict.accepted and released.verdict.release == record
    assert released.value["rows"]["train"] == 180
    assert store.exists(f"{where}/data.parquet")  # released data stays inspectable where it was


def test_validate_version_under_warn_sets_rows_aside(store, digits):
    spec = make_spec(on_bad_data="warn")
    bad = digits.copy()
    bad.loc[[3, 9], "pixel_4_4"] = [99.0, -1.0]
    outcome = dq.validate_version(store, spec, _raw(store, bad, "d" * 32))
    assert outcome.verdict.accepted and outcome.verdict.set_aside
    assert outcome.value["set_aside"] == 2
    assert sum(outcome.value["rows"].values()) == 298
    assert outcome.value["split_id"] == f"{'d' * 32}-{spec.fingerprint()}-{dq.suite_hash(spec)}"
    assert outcome.quarantine == store.uri("quarantine", "vision", "digits", "rows", "d" * 32)
    assert pq.read_table(f"{outcome.quarantine}/rows.parquet").column("_row").to_pylist() == [3, 9]
    [entry] = dq.list_quarantine(store)
    assert (entry.pipeline, entry.kind, entry.id) == ("vision/digits", "rows", "d" * 32)
    assert not store.exists(store.uri("quarantine", "vision", "digits", "d" * 32))  # the version itself is not quarantined
    with pytest.raises(dq.QuarantineError, match="rows set aside from an accepted version"):
        dq.release_quarantine(store, "vision/digits", "d" * 32, "x", by="ada")
