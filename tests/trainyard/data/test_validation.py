"""Validation of frames and snapshots, the on_bad_data policy, and validate_version."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainyard import data as dq
from trainyard.spec import ColumnSpec, SourceSpec


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



def test_wrong_type_fails_the_type_expectation(digits, spec, failed):
    bad = digits.assign(label=digits["label"] + 0.5, source=np.arange(len(digits)) % 3)
    report = dq.validate(bad, spec)
    assert not report.success
    assert ("expect_column_values_to_be_in_type_list", "label") in failed(report)
    assert ("expect_column_values_to_be_in_type_list", "source") in failed(report)
    label_type = next(r for r in report.failures() if r["column"] == "label" and "type" in r["expectation"])
    assert label_type["observed_value"] == "float64"



def test_out_of_range_fails_between_with_samples(digits, spec, failed):
    bad = digits.copy()
    bad.loc[[3, 9], "pixel_4_4"] = [99.0, -1.0]
    report = dq.validate(bad, spec)
    assert failed(report) == {("expect_column_values_to_be_between", "pixel_4_4")}
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



def test_null_fails_not_null(digits, spec, failed):
    bad = digits.copy()
    bad.loc[5, "pixel_2_3"] = np.nan
    report = dq.validate(bad, spec)
    # a pandas NaN is a missing value (Arrow null), as in GE's pandas engine
    assert failed(report) == {("expect_column_values_to_not_be_null", "pixel_2_3")}
    assert report.failures()[0]["unexpected_count"] == 1



def test_unknown_category_fails_in_set(digits, spec, failed):
    bad = digits.copy()
    bad.loc[0, "source"] = "fax"
    bad.loc[1, "label"] = 11
    report = dq.validate(bad, spec)
    assert failed(report) == {
        ("expect_column_values_to_be_in_set", "source"),
        ("expect_column_values_to_be_in_set", "label"),
    }
    samples = {r["column"]: r["unexpected_values"] for r in report.failures()}
    assert samples == {"source": ["fax"], "label": [11]}



def test_too_few_rows_fails_row_count(digits, spec, failed):
    report = dq.validate(digits.head(20), spec)
    assert failed(report) == {("expect_table_row_count_to_be_between", None)}
    assert report.failures()[0]["observed_value"] == 20



def test_missing_and_reordered_columns_fail(digits, spec, failed):
    report = dq.validate(digits.drop(columns=["checked"]), spec)
    missing = failed(report)
    assert ("expect_table_columns_to_match_ordered_list", None) in missing
    assert ("expect_column_to_exist", "checked") in missing
    reordered = dq.validate(digits[["label", *digits.columns[:-1]]], spec)
    assert failed(reordered) == {("expect_table_columns_to_match_ordered_list", None)}



def test_int_range_is_checked(digits_spec, failed):
    spec = digits_spec(
        columns={"x": ColumnSpec(dtype="float"), "label": ColumnSpec(dtype="int", min=0, max=9)}, min_rows=1
    )
    report = dq.validate(pd.DataFrame({"x": [0.5, 0.2, 0.3], "label": np.array([1, 2, 12])}), spec)
    assert failed(report) == {("expect_column_values_to_be_between", "label")}
    assert report.failures()[0]["unexpected_values"] == [12]



def test_nullable_int_read_back_as_float_passes(tmp_path, digits_spec):
    spec = digits_spec(
        columns={
            "x": ColumnSpec(dtype="float"),
            "n": ColumnSpec(dtype="int", nullable=True),
            "label": ColumnSpec(dtype="int"),
        },
        min_rows=1,
    )
    table = dq.to_canonical(pa.table({"x": [1.0, 2.0, 3.0], "n": [1, None, 3], "label": [0, 1, 0]}), spec)
    path = str(tmp_path / "d.parquet")
    dq.write_parquet_deterministic(table, path)
    df = pd.read_parquet(path)
    assert str(df["n"].dtype) == "float64"
    assert dq.validate(df, spec).success



def _report(*failures: dict) -> dq.ValidationReport:
    results = [
        {
            "expectation": "expect_a",
            "column": "x",
            "kwargs": {},
            "success": True,
            "observed_value": None,
            "unexpected_count": 0,
            "unexpected_values": [],
            "unexpected_index_list": [],
            "exception": None,
            "source": "suite",
            "row_level": True,
            "sample_rows": [],
        },
        *failures,
    ]
    return dq.ValidationReport(
        success=not failures, evaluated=len(results), failed=len(failures), results=results, suite={}
    )


ROW_FAILURE = {
    "expectation": "expect_column_values_to_be_between",
    "column": "x",
    "kwargs": {},
    "success": False,
    "observed_value": None,
    "unexpected_count": 3,
    "unexpected_values": [99],
    "unexpected_index_list": [1],
    "exception": None,
    "source": "suite",
    "row_level": True,
    "sample_rows": [],
}


TABLE_FAILURE = {
    **ROW_FAILURE,
    "expectation": "expect_table_row_count_to_be_between",
    "column": None,
    "unexpected_count": None,
    "observed_value": 3,
    "row_level": False,
}


DRIFTED = {
    "column": "x",
    "method": "psi-quantiles+ks",
    "psi": 0.9,
    "ks": 0.5,
    "ks_pvalue": 0.0,
    "drifted": True,
    "note": "",
}


def test_decide_follows_the_policy(digits_spec):
    reject, warn = digits_spec(on_drift="reject"), digits_spec(on_bad_data="warn", on_drift="reject")
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
    assert (
        drift_only.accepted
        and not drift_only.set_aside
        and drift_only.warnings == ["drift on 'x': PSI 0.900, KS 0.500"]
    )
    assert not dq.decide(_report(TABLE_FAILURE), [], warn).accepted  # too few rows cannot be fixed by dropping rows

    # By default a drift beyond the threshold is said, not refused: drift is a reason to retrain.
    default = dq.decide(_report(), [DRIFTED], digits_spec())
    assert default.accepted and not default.set_aside and default.reasons == []
    assert (
        default.warnings[0].endswith("(on_drift='warn': accepted)")
        and default.warnings[1] == "drift on 'x': PSI 0.900, KS 0.500"
    )

    release = {"released_by": "ada", "released_at": "2026-01-01T00:00:00+00:00", "reason": "checked with the owner"}
    released = dq.decide(_report(TABLE_FAILURE), [], reject, release)
    assert released.accepted and not released.set_aside and released.release == release
    assert released.warnings[0] == "released by ada at 2026-01-01T00:00:00+00:00: checked with the owner"



def test_set_aside_rows_moves_exactly_the_failing_rows(store, digits, digits_spec):
    spec = digits_spec(
        on_bad_data="warn", allow_duplicate_rows=False, source=SourceSpec(prefix="landing/digits", duplicates="reject")
    )
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



def _raw(store, frame: pd.DataFrame, md5: str) -> dict:
    uri = store.uri("data", "vision", "digits", "raw", md5, "data.parquet")
    dq.write_parquet_deterministic(pa.Table.from_pandas(frame, preserve_index=False), uri)
    return {"uri": uri, "md5": md5, "rows": len(frame), "dvc_file": ""}



def test_validate_version_rejects_then_a_release_lets_it_through(store, digits, spec):
    good = dq.validate_version(store, spec, _raw(store, digits, "a" * 32))
    assert good.verdict.accepted and good.quarantine is None and good.drift == []
    sizes = {name: len(part) for name, part in zip(("train", "val", "test"), dq.split(digits, spec))}
    assert good.value["rows"] == sizes and sum(sizes.values()) == 300 and good.value["set_aside"] == 0
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
    assert (
        open(f"{where}/data.parquet", "rb").read()
        == open(store.uri("data", "vision", "digits", "raw", "b" * 32, "data.parquet"), "rb").read()
    )
    assert report["data_docs"] == outcome.docs_uri
    assert store.read_json(store.uri("data", "vision", "digits", "validated", "latest.json"))["md5"] == "a" * 32

    [entry] = dq.list_quarantine(store, "vision/digits")
    assert (entry.id, entry.kind, entry.summary, entry.released) == (
        "b" * 32,
        "snapshot",
        "1 of 33 expectations failed",
        None,
    )
    with pytest.raises(dq.QuarantineError, match="release needs a reason"):
        dq.release_quarantine(store, "vision/digits", "b" * 32, "  ", by="ada")
    with pytest.raises(
        dq.QuarantineError, match=r"no quarantine entry 'c+' for pipeline 'vision/digits'; entries: \['b+'\]"
    ):
        dq.release_quarantine(store, "vision/digits", "c" * 32, "ok", by="ada")
    record = dq.release_quarantine(
        store, "vision/digits", "b" * 32, "range checked with the owner", by="ada", at="2026-02-03T04:05:06+00:00"
    )
    assert record == {
        "pipeline": "vision/digits",
        "md5": "b" * 32,
        "released_by": "ada",
        "released_at": "2026-02-03T04:05:06+00:00",
        "reason": "range checked with the owner",
    }
    with pytest.raises(dq.QuarantineError, match="already released by ada at 2026-02-03T04:05:06"):
        dq.release_quarantine(store, "vision/digits", "b" * 32, "again", by="bob")
    assert dq.read_quarantine(store, "vision/digits", "b" * 32)["release"] == record

    released = dq.validate_version(store, spec, _raw(store, bad, "b" * 32))
    assert released.verdict.accepted and released.verdict.release == record
    assert released.value["rows"]["train"] == len(dq.split(bad, spec)[0])  # rows 3 and 9 changed: hashed anew
    assert store.exists(f"{where}/data.parquet")  # released data stays inspectable where it was



def test_validate_version_under_warn_sets_rows_aside(store, digits, digits_spec):
    spec = digits_spec(on_bad_data="warn")
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
    assert not store.exists(
        store.uri("quarantine", "vision", "digits", "d" * 32)
    )  # the version itself is not quarantined
    with pytest.raises(dq.QuarantineError, match="rows set aside from an accepted version"):
        dq.release_quarantine(store, "vision/digits", "d" * 32, "x", by="ada")
