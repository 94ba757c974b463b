"""A business export (strings, a text date, an id, gaps, rare "yes") through real `raw_data` and `validated_data` runs
(issue 49)."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
from dagster import AssetKey

from tests.business import TARGET, churn_columns, churn_export, land_export
from tests.pipelines.pipeline_fixtures import Harness, failure_text
from trainyard.spec import ModelSpec, PipelineSpec, SourceSpec

PREFIX = "landing/crm/churn"


def test_raw_and_validated_data_take_the_export_as_it_is_and_show_missing_values(tmp_path: Path) -> None:
    spec = PipelineSpec(
        team="crm",
        name="churn",
        source=SourceSpec(prefix=PREFIX, pattern=["*.csv", "*.parquet"], format="auto"),
        columns=churn_columns(),
        target=TARGET,
        model=ModelSpec(task="gbt"),
    )
    harness = Harness(tmp_path, spec)
    land_export(tmp_path / "store" / PREFIX, churn_export(1200))
    keys = [AssetKey(["crm", "churn", n]) for n in ("raw_data", "validated_data")]
    job = harness.defs.resolve_job_def(harness.names["prepare"])
    run = job.execute_in_process(instance=harness.instance, asset_selection=keys, raise_on_error=False)
    assert run.success, failure_text(run)
    [raw] = [m.materialization for m in run.get_asset_materialization_events() if m.asset_key == keys[0]]
    missing = raw.metadata["missing_values"].value
    assert "| customer_id | 0 |" in missing and "| country |" in missing and "| country | 0 |" not in missing
    [check] = [
        e.event_specific_data
        for e in run.all_events
        if e.event_type_value == "ASSET_CHECK_EVALUATION" and e.event_specific_data.check_name == "expectations"
    ]
    assert check.passed and "| monthly_charges |" in check.metadata["missing_values"].value
    validated = run.output_for_node(harness.node("validated_data"))
    for part in ("train", "val", "test"):
        table = pq.read_table(validated.model_dump()[part])
        assert table.column_names == list(spec.stored_columns) and "yes" in table.column(TARGET).to_pylist()
        assert str(table.schema.field("signup_date").type) == "date32[day]"
