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

from assets import data_quality as dq
from pipelines.spec import ColumnSpec, ModelSpec, PipelineSpec, SourceSpec, SplitSpec
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


# --------------------------------------------------------------------------- landing


def _write_csv(path, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


@pytest.fixture
def store(tmp_path) -> ObjectStore:
    return ObjectStore(root=str(tmp_path / "store"))


def test_read_landing_concatenates_files_in_sorted_order(store):
    _write_csv(store.uri("landing", "2024-02.csv"), "x,label\n3.5,1\n")
    _write_csv(store.uri("landing", "2024-01.csv"), "label,x\n0,1\n1,2\n")  # column order may differ
    _write_csv(store.uri("landing", "notes.txt"), "ignored")
    table = dq.read_landing(store, SourceSpec(prefix="landing", pattern="*.csv"))
    assert table.column_names == ["label", "x"]
    assert table.to_pydict() == {"label": [0, 1, 1], "x": [1.0, 2.0, 3.5]}


def test_read_landing_parquet_and_jsonl(store, tmp_path):
    dq.write_parquet_deterministic(pa.table({"a": [1, 2]}), store.uri("pq", "p1.parquet"))
    dq.write_parquet_deterministic(pa.table({"a": [3]}), store.uri("pq", "p2.parquet"))
    assert dq.read_landing(store, SourceSpec(prefix="pq", pattern="*.parquet", format="parquet")).to_pydict() == {"a": [1, 2, 3]}
    _write_csv(store.uri("js", "a.jsonl"), '{"a": 1, "b": "x"}\n{"a": 2, "b": "y"}\n')
    assert dq.read_landing(store, SourceSpec(prefix="js", pattern="*.jsonl", format="jsonl")).to_pydict() == {
        "a": [1, 2],
        "b": ["x", "y"],
    }


def test_read_landing_accepts_an_absolute_prefix(store, tmp_path):
    _write_csv(str(tmp_path / "elsewhere" / "a.csv"), "x\n1\n")
    table = dq.read_landing(store, SourceSpec(prefix=str(tmp_path / "elsewhere")))
    assert table.to_pydict() == {"x": [1]}


def test_read_landing_from_s3(s3_endpoint):
    store = ObjectStore(root=s3_endpoint.root("dq"), endpoint_url=s3_endpoint.url)
    store.write_bytes(store.uri("landing", "b.csv"), b"x\n2\n")
    store.write_bytes(store.uri("landing", "a.csv"), b"x\n1\n")
    assert dq.read_landing(store, SourceSpec(prefix="landing")).to_pydict() == {"x": [1, 2]}
    absolute = SourceSpec(prefix=s3_endpoint.root("dq", "landing"), pattern="a.csv")
    assert dq.read_landing(store, absolute).to_pydict() == {"x": [1]}


def test_missing_landing_data_names_prefix_and_pattern(store):
    with pytest.raises(dq.MissingLandingData, match=r"no landing files match prefix 'landing/none' with pattern '\*.csv'"):
        dq.read_landing(store, SourceSpec(prefix="landing/none"))


def test_schema_mismatch_between_files_names_file_and_columns(store):
    _write_csv(store.uri("landing", "a.csv"), "x,y,label\n1,2,0\n")
    _write_csv(store.uri("landing", "b.csv"), "x,z,label\n1,2,0\n")
    with pytest.raises(dq.SchemaMismatch) as info:
        dq.read_landing(store, SourceSpec(prefix="landing"))
    message = str(info.value)
    assert "b.csv has different columns from" in message and "a.csv" in message
    assert "missing ['y'], extra ['z']" in message


def test_type_conflict_between_files_names_the_column(store):
    _write_csv(store.uri("landing", "a.csv"), "x,label\n1,0\n")
    _write_csv(store.uri("landing", "b.csv"), "x,label\nabc,0\n")
    with pytest.raises(dq.SchemaMismatch, match=r"column 'x' is int64 in .*a.csv, string in .*b.csv"):
        dq.read_landing(store, SourceSpec(prefix="landing"))


def test_unparseable_file_is_named(store):
    _write_csv(store.uri("landing", "a.jsonl"), "{not json\n")
    with pytest.raises(dq.MalformedLandingFile, match=r"cannot parse .*a.jsonl as jsonl"):
        dq.read_landing(store, SourceSpec(prefix="landing", pattern="*.jsonl", format="jsonl"))


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
    assert report.evaluated == len(dq.expectation_configs(spec)) == 2 + 4 * 4 + 4 + 3 + 4
    assert [r["expectation"] for r in report.results] == [c["type"] for c in dq.expectation_configs(spec)]
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


def test_null_fails_not_null(digits, spec):
    bad = digits.copy()
    bad.loc[5, "pixel_2_3"] = np.nan
    report = dq.validate(bad, spec)
    assert _failed(report) == {("expect_column_values_to_not_be_null", "pixel_2_3")}
    assert report.failures()[0]["unexpected_count"] == 1


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
    assert lines[0] == f"**FAILED**: {len(dq.expectation_configs(spec)) - 1} of {len(dq.expectation_configs(spec))} expectations passed"
    assert lines[2] == "| expectation | column | success | observed | unexpected | sample |"
    assert len(lines) == 4 + len(dq.expectation_configs(spec))
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
