"""The data assets' metadata: cells read as missing, per column (issue 49, item 8)."""

from __future__ import annotations

from types import SimpleNamespace

from assets.data import check_metadata
from trainyard import data as dq
from trainyard.data import ingest
from trainyard.spec import ColumnSpec, ModelSpec, PipelineSpec, SourceSpec


def test_the_check_shows_missing_values_per_column() -> None:
    spec = PipelineSpec(
        team="t",
        name="p",
        source=SourceSpec(prefix="landing"),
        columns={"x": ColumnSpec(dtype="float", nullable=True), "label": ColumnSpec(dtype="int", domain=[0, 1])},
        target="label",
        model=ModelSpec(path="pipelines.vision.models:DigitsMLP"),
    )
    report = dq.ValidationReport(
        success=True, evaluated=1, failed=0, results=[], suite={}, rows=40, missing={"x": 3, "label": 0}
    )
    meta = check_metadata(SimpleNamespace(validation=SimpleNamespace(report=report), drift=[], docs_uri="/docs"), spec)  # type: ignore[arg-type]
    table = meta["missing_values"].value
    assert "| x | 3 | 7.50 % |" in table and "| label | 0 | 0.00 % |" in table
    assert "`x` 3 (7.5 %)" in report.to_markdown()
    assert ingest.missing_markdown({}, 0).startswith("| column | missing | share |")
