"""Drift per delivery (issue 49, item 6): a new delivery's own rows against the previous accepted version.

Real `raw_data` + `validated_data` runs through Dagster. Six clean files, then
one file whose `monthly_charges` moved by +60: measured on its own rows the
shift is a large PSI; diluted in the cumulative snapshot it would look stable.
A schema change is reported as its own event, not as a PSI.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from tests.pipelines.pipeline_fixtures import Harness, failure_text, small_spec
from trainyard import data as dq
from trainyard.spec import ColumnSpec, SourceSpec

PREFIX = "landing/test/churn"


def churn_spec(**over: Any):
    columns = {
        "customer_id": ColumnSpec(dtype="str", role="id"),
        "plan": ColumnSpec(dtype="str", domain=["basic", "plus", "pro"]),
        "monthly_charges": ColumnSpec(dtype="float", min=0, max=500),
        "tenure": ColumnSpec(dtype="int", min=0, max=100),
        "churn": ColumnSpec(dtype="str", domain=["no", "yes"]),
    }
    columns.update(over.pop("columns", {}))
    source = over.pop("source", SourceSpec(prefix=PREFIX, pattern="*.csv"))
    return small_spec(name="churn", source=source, columns=columns, target="churn", min_rows=50, **over)


def batch(i: int, rows: int = 300, shift: float = 0.0) -> pd.DataFrame:
    rng = np.random.default_rng(i)
    return pd.DataFrame({
        "customer_id": [f"c{i:02d}-{n:05d}" for n in range(rows)],
        "plan": rng.choice(["basic", "plus", "pro"], rows, p=[0.5, 0.3, 0.2]),
        "monthly_charges": np.round(np.clip(rng.normal(70, 20, rows), 5, 200) + shift, 2),
        "tenure": rng.integers(0, 72, rows),
        "churn": rng.choice(["no", "yes"], rows, p=[0.9, 0.1]),
    })


def land(home: Path, name: str, frame: pd.DataFrame) -> None:
    where = home / "store" / PREFIX
    where.mkdir(parents=True, exist_ok=True)
    frame.to_csv(where / name, index=False)


def validate(harness: Harness) -> tuple[dict[str, Any], Any]:
    """Run raw_data + validated_data; the check's metadata (plain values) and the run."""
    spec = harness.spec
    keys = [
        k
        for k in harness.defs.resolve_all_asset_keys()
        if k.path[-1] in ("raw_data", "validated_data") and k.path[:2] == [spec.team, spec.name]
    ]
    job = harness.defs.resolve_job_def(harness.names["prepare"])
    run = job.execute_in_process(instance=harness.instance, asset_selection=keys, raise_on_error=False)
    assert run.success, failure_text(run)
    [check] = [c for c in run.get_asset_check_evaluations() if c.check_name == "expectations"]
    meta = {k: getattr(v, "value", v) for k, v in check.metadata.items()}
    return meta, run


@pytest.mark.slow
def test_a_shifted_delivery_is_flagged_by_its_own_rows(tmp_path: Path) -> None:
    spec = churn_spec()
    harness = Harness(tmp_path, spec)
    store = harness.resources["store"]
    land(tmp_path, "batch-0.csv", batch(0))
    first, _ = validate(harness)
    assert first["drift_verdict"] == "none"

    for i in range(1, 6):
        land(tmp_path, f"batch-{i}.csv", batch(i))
    calm, _ = validate(harness)
    assert calm["drift_verdict"] in ("stable", "moderate"), calm["drift_summary"]  # 300 rows per file: some noise
    # measured on the new files (together, and each alone), never on batch-0 again
    assert calm["drift_scope"].endswith("rows against the previous accepted version") and "batch-0" not in calm["drift"]
    latest = store.read_json(store.uri("data", "test", "churn", "validated", "latest.json"))
    before = (store.read_json(latest["profile_uri"]), dq.profile_snapshot(store, latest["raw_uri"])[1])

    land(tmp_path, "batch-6.csv", batch(6, shift=60.0))
    drifted, _ = validate(harness)
    assert drifted["drift_verdict"] == "drifted", drifted["drift_summary"]
    assert drifted["drift_summary"].startswith("drifted: ['monthly_charges'] beyond the thresholds (PSI > 0.25")
    assert drifted["drift_scope"] == "delivery (batch-6.csv), 300 rows against the previous accepted version"
    assert drifted["max_psi"] > 2.0
    assert "schema_change" not in drifted
    # the same version measured the old way (cumulative snapshot against cumulative snapshot) is diluted
    latest = store.read_json(store.uri("data", "test", "churn", "validated", "latest.json"))
    now = dq.profile_snapshot(store, latest["raw_uri"])
    diluted = dq.drift(*before, *now, spec)
    assert max(r["psi"] for r in diluted if r["psi"] is not None) < drifted["max_psi"] / 4
    rows = store.read_json(latest["drift_uri"])
    assert (
        [r["column"] for r in rows] == spec.features == ["plan", "monthly_charges", "tenure"]
    )  # the id is never measured
    assert {r["column"]: r["drifted"] for r in rows} == {"plan": False, "monthly_charges": True, "tenure": False}


@pytest.mark.slow
def test_one_shifted_file_among_several_is_judged_on_its_own(tmp_path: Path) -> None:
    harness = Harness(tmp_path, churn_spec())
    land(tmp_path, "batch-0.csv", batch(0, rows=600))
    validate(harness)
    for i in range(1, 4):
        land(tmp_path, f"batch-{i}.csv", batch(i))
    land(tmp_path, "batch-4.csv", batch(4, rows=250, shift=60.0))
    land(tmp_path, "batch-5.csv", batch(5, rows=20, shift=60.0))  # too few rows to be judged alone
    meta, _ = validate(harness)
    assert (
        meta["drift_verdict"] == "drifted"
        and meta["drift_scope"] == "batch-4.csv, 250 rows against the previous accepted version"
    )


@pytest.mark.slow
def test_a_schema_change_is_its_own_event_not_a_psi(tmp_path: Path) -> None:
    land(tmp_path, "batch-0.csv", batch(0))
    validate(Harness(tmp_path, churn_spec()))
    # tenure declared a float now: every file is read again, none is new; tenure's type changed
    changed = Harness(tmp_path, churn_spec(columns={"tenure": ColumnSpec(dtype="float", min=0, max=100)}))
    meta, _ = validate(changed)
    assert meta["schema_change"] == "schema changed: 'tenure' type int64 -> double"
    assert meta["drift_verdict"] == "stable" and meta["max_psi"] < 0.01
    assert meta["drift_scope"] == (
        "whole version, 300 rows (no new landing file: files were only removed or read again) against the previous "
        "accepted version"
    )
    assert "tenure" not in meta["drift_summary"].split(";")[0]


def test_schema_rows_name_each_change_and_dates_are_not_measured() -> None:
    import pyarrow as pa

    from trainyard.data.profile import Profiler

    def profiled(table: pa.Table) -> tuple[dict[str, Any], pa.Table]:
        p = Profiler(table.schema, table.num_rows)
        for b in table.to_batches():
            p.update(b)
        return p.profile(), p.sample()

    spec = churn_spec(columns={"signup": ColumnSpec(dtype="date")})
    frame = batch(0).assign(signup=pd.Timestamp("2024-01-01").date())
    prev = profiled(pa.Table.from_pandas(frame.drop(columns=["signup"]), preserve_index=False))
    cur = profiled(pa.Table.from_pandas(frame.assign(tenure=frame["tenure"].astype(float)), preserve_index=False))
    rows = dq.drift(*prev, *cur, spec)
    assert [(r["column"], r["method"], r["note"]) for r in rows[:2]] == [
        ("tenure", "schema", "type int64 -> double"),
        ("signup", "schema", "added (date32[day])"),
    ]
    by = {r["column"]: r for r in rows[2:]}
    assert by["tenure"]["psi"] is None and by["signup"]["psi"] is None and by["plan"]["psi"] == 0.0
    verdict = dq.drift_verdict(rows, spec)
    assert verdict["schema"] == "schema changed: 'tenure' type int64 -> double; 'signup' added (date32[day])"
    assert verdict["level"] == "stable" and verdict["message"].endswith(verdict["schema"])
    same = dq.drift(*cur, *cur, spec)
    assert by_note(same, "signup") == "date column: not measured (every delivery brings new dates)"


def by_note(rows, column: str) -> str:
    return next(r["note"] for r in rows if r["column"] == column)
