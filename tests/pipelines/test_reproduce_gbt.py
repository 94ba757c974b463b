"""`trainyard reproduce` of a LightGBM champion trained on a business table: strings, a date, an id, a "yes"/"no"
target."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines.reproduce import reproduce
from tests.business import TARGET, churn_columns, churn_export, land_export
from tests.pipelines.pipeline_fixtures import Harness
from trainyard.search import IntParam, SearchSpec
from trainyard.spec import ModelSpec, PipelineSpec, PromotionSpec, SourceSpec


def churn_gbt() -> PipelineSpec:
    return PipelineSpec(
        team="crm",
        name="churn_repro",
        source=SourceSpec(prefix="landing/crm/churn_repro", pattern=["*.csv", "*.parquet"], format="auto"),
        columns=churn_columns(),
        target=TARGET,
        min_rows=500,
        model=ModelSpec(
            task="gbt", max_epochs=40, monitor="val_logloss", monitor_mode="min", hparams={"min_data_in_leaf": 10}
        ),
        search=SearchSpec(params={"num_leaves": IntParam(low=4, high=8)}, n_trials=1),
        promotion=PromotionSpec(metric="test_pr_auc"),
    )


@pytest.mark.slow
def test_a_gbt_champion_with_a_string_target_is_reproduced(tmp_path: Path) -> None:
    spec = churn_gbt()
    land_export(tmp_path / "store" / spec.source.prefix, churn_export(2000, seed=3), stem="export")
    harness = Harness(tmp_path, spec)
    out = harness.run_all()
    report = reproduce(f"{spec.model_name}@{out['registered']['version']}", harness.resources, pipeline=spec)
    checks = {c.name: c for c in report.checks}
    assert checks["training data"].ok, checks[
        "training data"
    ].detail  # the "yes"/"no" target and the date re-split byte for byte
    assert checks["model file"].ok and checks["model file"].detail.startswith(
        "byte-identical LightGBM model (model.txt, preprocessing.json)"
    )
    assert "weights" not in checks  # no Lightning checkpoint is looked for
    assert checks["metric test_pr_auc"].ok and checks["metric test_acc"].ok
    assert report.reproduced, report.to_markdown()
    assert out["registered"]["decision"] in ("champion", "rejected")  # reproduction does not depend on the decision
    assert "REPRODUCED" in report.to_markdown().splitlines()[0] and "NOT" not in report.to_markdown().splitlines()[0]
