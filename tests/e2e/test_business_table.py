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

from tests.business import TARGET, churn_columns, churn_export, land_export
from tests.pipelines.pipeline_fixtures import Harness
from training.spec import Distribution
from trainyard.search import FloatParam, IntParam, SearchSpec
from trainyard.spec import ModelSpec, PipelineSpec, PromotionSpec, SourceSpec

COLUMNS = churn_columns()


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
    (exported,) = [
        p
        for p in land_export(harness.home / "new", churn_export(300, seed=99, start_id=900_000), csv_parts=1)
        if p.suffix == ".csv"
    ]
    fresh = pd.read_csv(exported)
    served = _served(harness, spec, fresh)
    assert list(served["customer_id"]) == list(fresh["customer_id"])  # ids come back with every prediction
    assert set(served[TARGET]) <= {"no", "yes"}
    proba = served[["proba_no", "proba_yes"]].to_numpy()
    assert ((proba >= 0) & (proba <= 1)).all() and abs(proba.sum(axis=1) - 1).max() < 1e-5
    assert proba[:, 1].std() > 0  # probabilities rank customers, not one constant


@pytest.mark.slow
def test_a_lightning_one_logit_model_reaches_a_champion_that_serves_probabilities_and_ids(tmp_path: Path) -> None:
    """The GBT pipeline reaches its champion in the next test, which goes on with two more deliveries."""
    spec = lightning_pipeline()
    _land(tmp_path, spec, churn_export(4000, seed=1), "export-2026-11")
    harness = Harness(tmp_path, spec)
    out = harness.run_all()
    _check_champion(harness, spec, out, spec.promotion.metric)


def _validate_only(harness: Harness) -> dict[str, Any]:
    """raw_data + validated_data of the prepare job; the expectations check's metadata as plain values."""
    spec = harness.spec
    keys = [
        k
        for k in harness.defs.resolve_all_asset_keys()
        if k.path[-1] in ("raw_data", "validated_data") and k.path[:2] == [spec.team, spec.name]
    ]
    run = harness.defs.resolve_job_def(harness.names["prepare"]).execute_in_process(
        instance=harness.instance, asset_selection=keys, raise_on_error=False)
    assert run.success
    checks = {e.check_name: e for e in run.get_asset_check_evaluations()}
    return {k: getattr(v, "value", v) for k, v in checks["expectations"].metadata.items()}


@pytest.mark.slow
def test_a_gbt_champion_then_a_second_delivery_retrains_under_every_metric_and_a_drifted_one_is_flagged(
    tmp_path: Path,
) -> None:
    import pandas as pd

    from resources.registry.promotion import score_champion
    from trainyard.promotion import SERVED_METRICS
    from trainyard.tasks import KNOWN_METRICS

    spec = gbt_pipeline()
    harness = Harness(tmp_path, spec)
    _land(tmp_path, spec, churn_export(4000, seed=1), "export-2026-11")
    first = harness.run_all()
    _check_champion(
        harness, spec, first, spec.promotion.metric
    )  # promoted on test_pr_auc, the prior beaten, served with ids
    registry = harness.resources["registry"]
    v1 = registry.get_alias(spec.model_name, "champion")

    # A second month: new customers, same behaviour. It retrains, and the champion can be scored on its split under
    # every metric a PromotionSpec accepts (none leaves the champion frozen on the first data).
    _land(tmp_path, spec, churn_export(2500, seed=2, start_id=100_000), "export-2026-12")
    second = harness.run_all()
    assert second["registered"]["created"] and second["registered"]["version"] != v1.version
    split = second["best"]["lineage"]["data_version"] + "-" + spec.fingerprint()
    test_df = pd.read_parquet(
        harness.resources["store"].uri("data", spec.team, spec.name, "validated", split, "test.parquet")
    )
    accepted = [m for m in SERVED_METRICS if KNOWN_METRICS[m][0] == "classification"]
    assert {"test_acc", "test_logloss", "test_roc_auc", "test_pr_auc", "test_f1", "test_balanced_acc"} <= set(accepted)
    for metric in accepted:
        score = score_champion(registry, PromotionSpec(metric=metric), v1, split, test_df, TARGET)
        assert score.value is not None and math.isfinite(score.value), (metric, score)
        assert score.served and second["best"]["metrics"][metric] is not None

    # A third delivery whose charges moved by +60 is flagged on its own rows, not diluted by the first two months.
    _land(tmp_path, spec, churn_export(1200, seed=3, start_id=200_000, charges_shift=60.0), "export-2027-01")
    meta = _validate_only(harness)
    assert meta["drift_verdict"] == "drifted", meta["drift_summary"]
    assert "monthly_charges" in meta["drift_summary"] and "export-2027-01" in meta["drift_scope"]
