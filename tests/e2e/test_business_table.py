"""A business export, landed exactly as the warehouse wrote it, reaches a champion on both trainers (real Dagster runs).

The export (`tests.business`): three CSV files and a Parquet file; string
categoricals, a text date column, a customer id, 3-8% empty cells, a "yes"/"no"
target with ~5.5% positives. No conversion step: the pipelines below are what a
team writes from the README. Each reaches a champion promoted on a ranking
metric with the trivial baseline beaten; the served model returns probabilities
and the ids; a second delivery retrains and can be decided under every accepted
metric; a drifted delivery is flagged by its own rows.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from tests.business import PLANS, TARGET, churn_export, land_export
from tests.pipelines.pipeline_fixtures import Harness
from training.spec import Distribution
from trainyard.search import FloatParam, IntParam, SearchSpec
from trainyard.spec import ColumnSpec, ModelSpec, PipelineSpec, PromotionSpec, SourceSpec

COLUMNS = {
    "customer_id": ColumnSpec(dtype="str", role="id"),
    "plan": ColumnSpec(dtype="category", domain=PLANS),
    "country": ColumnSpec(dtype="str", nullable=True),
    "signup_date": ColumnSpec(dtype="date"),
    "tenure_months": ColumnSpec(dtype="int", min=0),
    "monthly_charges": ColumnSpec(dtype="float", min=0, nullable=True),
    "support_calls": ColumnSpec(dtype="int", min=0, nullable=True),
    TARGET: ColumnSpec(dtype="str", domain=["no", "yes"]),
}


def gbt_pipeline(**over: Any) -> PipelineSpec:
    base: dict[str, Any] = dict(
        team="crm", name="churn_gbt",
        source=SourceSpec(prefix="landing/crm/churn_gbt", pattern=["*.csv", "*.parquet"], format="auto"),
        columns=COLUMNS, target=TARGET, min_rows=1000,
        model=ModelSpec(task="gbt", max_epochs=150, monitor="val_logloss", monitor_mode="min",
                        hparams={"early_stopping_rounds": 25, "min_data_in_leaf": 10}),
        search=SearchSpec(params={"num_leaves": IntParam(low=4, high=15)}, n_trials=2),
        promotion=PromotionSpec(metric="test_pr_auc", mode="max"),
    )
    base.update(over)
    return PipelineSpec(**base)


def lightning_pipeline(**over: Any) -> PipelineSpec:
    base: dict[str, Any] = dict(
        team="crm", name="churn_nn",
        source=SourceSpec(prefix="landing/crm/churn_nn", pattern=["*.csv", "*.parquet"], format="auto"),
        columns=COLUMNS, target=TARGET, min_rows=1000,
        model=ModelSpec(path="tests.business:OneLogitChurnNet", max_epochs=6, batch_size=128,
                        monitor="val_loss", monitor_mode="min", hparams={"pos_weight": 5.0}),
        search=SearchSpec(params={"lr": FloatParam(low=3e-3, high=2e-2, log=True)}, n_trials=1),
        distribution=Distribution(procs_per_node=1),
        promotion=PromotionSpec(metric="test_roc_auc", mode="max"),
    )
    base.update(over)
    return PipelineSpec(**base)


def _land(home: Path, spec: PipelineSpec, frame: Any, stem: str) -> None:
    land_export(home / "store" / spec.source.prefix, frame, stem=stem)


def _served(harness: Harness, spec: PipelineSpec, frame: Any) -> Any:
    import mlflow.pyfunc

    registry = harness.resources["registry"]
    champion = registry.get_alias(spec.model_name, "champion")
    assert champion is not None
    import mlflow

    mlflow.set_tracking_uri(registry.tracking_uri)
    raw = frame.drop(columns=[TARGET])  # the raw columns as exported: strings, a date, gaps
    return mlflow.pyfunc.load_model(champion.model_uri).predict(raw)


def _check_champion(harness: Harness, spec: PipelineSpec, out: dict[str, Any], metric: str) -> None:
    assert out["registered"]["created"] and out["registered"]["champion"], out["registered"]
    metrics = out["best"]["metrics"]
    assert metrics[metric] > metrics[f"baseline_{metric}"], (metric, metrics)
    assert metrics["test_roc_auc"] > 0.6 and math.isfinite(metrics["test_logloss"])
    import pandas as pd

    # New customers as a user has them: read back from an export CSV (dates as text, gaps as empty cells).
    (exported,) = [p for p in land_export(harness.home / "new", churn_export(300, seed=99, start_id=900_000), csv_parts=1)
                   if p.suffix == ".csv"]
    fresh = pd.read_csv(exported)
    served = _served(harness, spec, fresh)
    assert list(served["customer_id"]) == list(fresh["customer_id"])  # ids come back with every prediction
    assert set(served[TARGET]) <= {"no", "yes"}
    proba = served[["proba_no", "proba_yes"]].to_numpy()
    assert ((proba >= 0) & (proba <= 1)).all() and abs(proba.sum(axis=1) - 1).max() < 1e-5
    assert proba[:, 1].std() > 0  # probabilities rank customers, not one constant


@pytest.mark.slow
@pytest.mark.parametrize("make", [gbt_pipeline, lightning_pipeline], ids=["gbt", "lightning"])
def test_a_business_export_reaches_a_champion_that_serves_probabilities_and_ids(tmp_path: Path, make) -> None:
    spec = make()
    _land(tmp_path, spec, churn_export(4000, seed=1), "export-2026-11")
    harness = Harness(tmp_path, spec)
    out = harness.run_all()
    _check_champion(harness, spec, out, spec.promotion.metric)
