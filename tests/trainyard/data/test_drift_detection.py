"""PSI, KS and drift between data versions."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from trainyard import data as dq


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



def _profiled(store, frame: pd.DataFrame, name: str):
    dq.write_parquet_deterministic(pa.Table.from_pandas(frame, preserve_index=False), store.uri(f"{name}.parquet"))
    return dq.profile_snapshot(store, store.uri(f"{name}.parquet"))



def test_drift_from_profiles_equals_psi_on_small_data_and_adds_ks(store, digits, spec, digits_spec):
    from scipy.stats import ks_2samp

    moved = digits.assign(pixel_3_4=digits["pixel_3_4"] / 2, source="web")
    prev, cur = _profiled(store, digits, "prev"), _profiled(store, moved, "cur")
    unset = digits_spec(max_drift_psi=None)
    rows = dq.drift(*prev, *cur, unset)
    assert [r["column"] for r in rows] == spec.features
    expected_psi = dq.drift_report(digits, moved, spec)
    for r in rows:
        assert r["psi"] == pytest.approx(expected_psi[r["column"]], abs=1e-12), r["column"]
    by = {r["column"]: r for r in rows}
    assert by["source"]["method"] == "psi-categories" and by["source"]["ks"] is None
    assert by["pixel_3_4"]["method"] == "psi-values+ks"  # 17 distinct values: binned per value
    assert by["pixel_3_4"]["ks"] == pytest.approx(ks_2samp(digits["pixel_3_4"], moved["pixel_3_4"]).statistic)
    assert by["pixel_2_3"]["ks"] == 0.0 and by["checked"]["psi"] == 0.0
    assert not any(r["drifted"] for r in rows)  # thresholds turned off
    assert {r["column"] for r in dq.drift(*prev, *cur, spec) if r["drifted"]} == {
        "pixel_3_4",
        "source",
    }  # on by default

    strict = digits_spec(max_drift_psi=0.25, max_drift_ks=0.2)
    flagged = {r["column"] for r in dq.drift(*prev, *cur, strict) if r["drifted"]}
    assert flagged == {"pixel_3_4", "source"}
    markdown = dq.drift_markdown(dq.drift(*prev, *cur, strict), strict)
    assert markdown.startswith("thresholds: PSI > 0.25, KS > 0.2")
    assert "**verdict**: drifted: ['pixel_3_4', 'source'] beyond the thresholds" in markdown
    assert "| source | psi-categories |" in markdown and "**yes**" in markdown



@pytest.fixture(scope="module")
def all_digits() -> pd.DataFrame:
    from sklearn.datasets import load_digits

    return load_digits(as_frame=True).frame.drop(columns="target").astype("float64")


def _max_psi(prev: pd.DataFrame, cur: pd.DataFrame) -> float:
    return max(dq.psi(prev[c], cur[c]) for c in prev.columns if prev[c].nunique() > 1)


def test_lightly_noised_digits_are_stable_and_scaled_digits_drift(all_digits):
    # Issue 15, item 14: quantile edges fell on the integer pixel values, so light noise
    # scored higher than scaling every value by 1.5. Per-value bins put it the right way round.
    rng = np.random.default_rng(0)
    noised = all_digits.sample(400, random_state=0) + rng.normal(0.0, 0.25, (400, all_digits.shape[1]))
    delivered = pd.concat([all_digits, noised], ignore_index=True)  # the next version: old rows plus 400 noised ones
    assert _max_psi(all_digits, delivered) < dq.PSI_WARN
    assert _max_psi(all_digits, all_digits * 1.5) > dq.PSI_ALERT


def test_continuous_features_use_quantile_bins_with_open_ends():
    rng = np.random.default_rng(1)
    prev = pd.Series(rng.normal(0, 1, 5000))
    edges = dq.numeric_edges(prev.to_numpy(), 10)
    assert len(edges) == 9 and np.all(np.diff(edges) > 0)
    assert (
        dq.psi(prev, pd.Series(rng.normal(0, 1, 5000) * 100)) > dq.PSI_ALERT
    )  # far outside: the open end bins take it
    assert list(dq.numeric_edges(np.array([0.0, 1.0, 1.0, 3.0]), 10)) == [0.5, 2.0]


def test_drift_verdict_levels(digits_spec):
    spec = digits_spec()
    row = {"column": "pixel_2_3", "method": "psi-values+ks", "ks": None, "ks_pvalue": None, "note": ""}
    assert dq.drift_verdict([], spec)["level"] == "none"
    assert dq.drift_verdict([{**row, "psi": 0.02, "drifted": False}], spec)["level"] == "stable"
    moderate = dq.drift_verdict([{**row, "psi": 0.15, "drifted": False}], spec)
    assert moderate["level"] == "moderate" and moderate["columns"] == ["pixel_2_3"]
    assert dq.drift_verdict([{**row, "psi": 0.4, "drifted": True}], spec)["level"] == "drifted"
    verdict = dq.decide(_passing(), [{**row, "psi": 0.15, "drifted": False}], spec)
    assert verdict.accepted and verdict.warnings == [moderate["message"]]


def _passing() -> dq.ValidationReport:
    return dq.ValidationReport(success=True, evaluated=0, failed=0, results=[], suite={})
