"""The data assets' metadata: the drift verdict shows where the data lands (issue 15, item 14)."""

from __future__ import annotations

from types import SimpleNamespace

from assets.data import check_metadata
from trainyard import data as dq
from trainyard.spec import ColumnSpec, ModelSpec, PipelineSpec, SourceSpec


def _spec() -> PipelineSpec:
    return PipelineSpec(
        team="t",
        name="p",
        source=SourceSpec(prefix="landing"),
        columns={"x": ColumnSpec(dtype="float"), "label": ColumnSpec(dtype="int", domain=[0, 1])},
        target="label",
        model=ModelSpec(path="pipelines.vision.models:DigitsMLP"),
    )


def test_the_check_shows_the_drift_verdict_with_thresholds_on_by_default() -> None:
    spec = _spec()
    assert spec.max_drift_psi == dq.PSI_ALERT == 0.25
    report = dq.ValidationReport(success=True, evaluated=1, failed=0, results=[], suite={}, rows=10)
    row = {"column": "x", "method": "psi-quantiles+ks", "ks": 0.1, "ks_pvalue": 0.5, "note": ""}
    outcome = SimpleNamespace(
        validation=SimpleNamespace(report=report), drift=[{**row, "psi": 0.17, "drifted": False}], docs_uri="/docs"
    )
    meta = check_metadata(outcome, spec)  # type: ignore[arg-type]
    assert meta["drift_verdict"] == "moderate" and meta["max_psi"] == 0.17
    assert meta["drift_summary"].startswith("moderate shift (PSI >= 0.1) in ['x']")
    first = check_metadata(SimpleNamespace(validation=SimpleNamespace(report=report), drift=[], docs_uri="/docs"), spec)  # type: ignore[arg-type]
    assert first["drift_verdict"] == "none"
