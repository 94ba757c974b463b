"""A regression pipeline with a Lightning MLP, from landing files to a champion that serves its test RMSE (real Dagster
runs)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from tests import diabetes
from tests.pipelines.pipeline_fixtures import Harness, write_landing
from training.spec import Distribution
from trainyard.search import FloatParam, SearchSpec
from trainyard.spec import ColumnSpec, ModelSpec, PipelineSpec, SourceSpec


def diabetes_pipeline() -> PipelineSpec:
    columns = {c: ColumnSpec(dtype="float") for c in diabetes.features()}
    columns[diabetes.TARGET] = ColumnSpec(dtype="float", min=0)
    return PipelineSpec(
        team="health",
        name="diabetes",
        source=SourceSpec(prefix="landing/health/diabetes"),
        columns=columns,
        target=diabetes.TARGET,
        model=ModelSpec(path="tests.diabetes:TinyRegressor", max_epochs=3, batch_size=32),
        search=SearchSpec(params={"lr": FloatParam(low=0.02, high=0.1, log=True)}, n_trials=1),
        distribution=Distribution(procs_per_node=1),
    )


@pytest.mark.slow
def test_a_lightning_regression_reaches_a_champion_that_serves_its_test_rmse(tmp_path: Path) -> None:
    import mlflow.pyfunc
    import pandas as pd

    spec = diabetes_pipeline()
    assert (spec.task, spec.model.monitor, spec.promotion.metric) == ("regression", "val_rmse", "test_rmse")
    write_landing(tmp_path, diabetes.diabetes_frame(), prefix=spec.source.prefix)
    harness = Harness(tmp_path, spec)
    out = harness.run_all()
    best = out["best"]
    assert {"val_rmse", "test_rmse", "val_mae", "baseline_test_rmse"} <= set(best["metrics"])
    assert json.loads((Path(best["model_uri"]) / "meta.json").read_text())["task"] == "regression"
    assert out["registered"]["created"] and out["registered"]["champion"]
    registry = harness.resources["registry"]
    champion = registry.get_alias("health.diabetes", "champion")
    assert champion is not None and champion.version == out["registered"]["version"]
    split = f"{best['lineage']['data_version']}-{spec.fingerprint()}"
    test_df = pd.read_parquet(
        harness.resources["store"].uri("data", "health", "diabetes", "validated", split, "test.parquet")
    )
    mlflow.set_tracking_uri(registry.tracking_uri)
    served = mlflow.pyfunc.load_model(champion.model_uri).predict(test_df)[
        diabetes.TARGET
    ]  # the served frame's target column
    assert served.dtype == np.float64
    rmse = math.sqrt(float(np.mean((served.to_numpy() - test_df[diabetes.TARGET].to_numpy()) ** 2)))
    assert rmse == pytest.approx(best["metrics"]["test_rmse"], rel=1e-6)
