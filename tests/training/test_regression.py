"""Regression trials (`prediction_task="regression"`) through the entrypoint in one process, and models that do not fit
their task."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch

from tests import diabetes, digits
from training import entrypoint
from training.parallel import MLPRegressor
from training.serving_model import ExportedModel, read_meta
from training.spec import EXIT_BAD_CONFIG, DataSpec, ImportTarget, TrainResult, TrainSpec


def regression_spec(tmp: Path, **over: Any) -> TrainSpec:
    """The diabetes splits under `tmp/data` and a regression spec training on them, written to `tmp/spec.json`."""
    paths = diabetes.write_splits(str(tmp / "data"))
    base: dict[str, Any] = dict(
        pipeline="health/diabetes",
        trial_id="trial-0000",
        prediction_task="regression",
        model=ImportTarget(path="tests.diabetes:TinyRegressor"),
        data=DataSpec(
            train_uri=paths["train"],
            val_uri=paths["val"],
            test_uri=paths["test"],
            features=diabetes.features(),
            target=diabetes.TARGET,
            version="0" * 32,
        ),
        output_uri=str(tmp / "run"),
        max_epochs=3,
        batch_size=32,
        monitor="val_rmse",
        monitor_mode="min",
    )
    base.update(over)
    spec = TrainSpec(**base)
    (tmp / "spec.json").write_text(spec.to_json())
    return spec


def failure(tmp: Path) -> dict[str, Any]:
    return json.loads((tmp / "run" / "failures" / "rank-0.json").read_text())


def test_a_lightning_regression_model_trains_evaluates_exports_and_serves(tmp_path: Path) -> None:
    regression_spec(tmp_path)
    assert entrypoint.main(["--spec", str(tmp_path / "spec.json")]) == 0
    result = TrainResult.model_validate_json((tmp_path / "run" / "result.json").read_text())
    assert set(result.metrics) == {
        f"{b}{s}_{n}" for b in ("", "baseline_") for s in ("val", "test") for n in ("rmse", "mae")
    }
    assert result.epochs == 3
    assert 0 < result.metrics["test_rmse"] < 150  # better than predicting a constant 0; the target's std is ~77
    meta = read_meta(str(tmp_path / "run" / "model"))
    assert meta["task"] == "regression" and "classes" not in meta
    model = ExportedModel()
    model.load_context(SimpleNamespace(artifacts={"model_dir": str(tmp_path / "run" / "model")}))
    test = pd.read_parquet(tmp_path / "data" / "test.parquet")
    predicted = model.predict(None, test)[diabetes.TARGET]
    assert predicted.dtype == np.float64 and len(predicted) == len(test) and predicted.name == diabetes.TARGET
    rmse = math.sqrt(float(np.mean((predicted.to_numpy() - test[diabetes.TARGET].to_numpy()) ** 2)))
    assert rmse == pytest.approx(
        result.metrics["test_rmse"], rel=1e-6
    )  # serving reproduces the training-side evaluation


def test_a_classifier_on_a_regression_task_fails_before_the_first_epoch(tmp_path: Path) -> None:
    regression_spec(
        tmp_path, model=ImportTarget(path="training.parallel:MLPClassifier", kwargs={"n_features": 10, "n_classes": 3})
    )
    assert entrypoint.main(["--spec", str(tmp_path / "spec.json")]) == EXIT_BAD_CONFIG
    record = failure(tmp_path)
    assert record["category"] == "config"
    assert (
        "returns shape [2, 3] for a batch of 2 rows; task 'regression' needs one value per row, [2] or [2, 1]"
        in record["error"]
    )
    assert not (tmp_path / "run" / "attempts").exists()  # no training attempt started


def test_a_regressor_on_a_classification_task_fails_before_the_first_epoch(tmp_path: Path) -> None:
    paths = digits.write_splits(str(tmp_path / "data"), n=120)
    spec = TrainSpec(
        pipeline="vision/digits",
        trial_id="trial-0000",
        model=ImportTarget(path="training.parallel:MLPRegressor"),
        data=DataSpec(
            train_uri=paths["train"],
            val_uri=paths["val"],
            test_uri=paths["test"],
            features=digits.features(),
            target="label",
            version="0" * 32,
        ),
        output_uri=str(tmp_path / "run"),
        max_epochs=1,
    )
    (tmp_path / "spec.json").write_text(spec.to_json())
    assert entrypoint.main(["--spec", str(tmp_path / "spec.json")]) == EXIT_BAD_CONFIG
    error = failure(tmp_path)["error"]
    assert (
        "returns shape [2] for a batch of 2 rows; task 'classification' with 10 classes [0, 1, 2, 3, 4, 5, 6, 7, 8, "
        "9] needs n_classes logits [2, 10]"
        in error
    )
    assert (
        "regression" not in error.split("task 'classification'")[1]
    )  # never the advice to make a classifier a regression
    assert not (tmp_path / "run" / "attempts").exists()


def test_a_gbt_objective_that_contradicts_the_task_is_a_config_error(tmp_path: Path) -> None:
    regression_spec(
        tmp_path, task="gbt", model=ImportTarget(path="lightgbm:train", kwargs={"objective": "binary"}), max_epochs=5
    )
    assert entrypoint.main(["--spec", str(tmp_path / "spec.json")]) == EXIT_BAD_CONFIG
    assert (
        "model.kwargs.objective='binary' trains classification, but the task is 'regression'"
        in failure(tmp_path)["error"]
    )


def test_a_gbt_regression_follows_the_declared_task(tmp_path: Path) -> None:
    regression_spec(
        tmp_path, task="gbt", model=ImportTarget(path="lightgbm:train", kwargs={"num_leaves": 4}), max_epochs=5
    )
    assert entrypoint.main(["--spec", str(tmp_path / "spec.json")]) == 0
    result = TrainResult.model_validate_json((tmp_path / "run" / "result.json").read_text())
    assert {"val_rmse", "test_rmse"} <= set(result.metrics)


def test_the_platform_regressor_returns_one_value_per_row_and_logs_rmse() -> None:
    torch.manual_seed(0)
    model = MLPRegressor(n_features=10, width=8, blocks=1, target_scale=100.0)
    x, y = torch.randn(4, 10), torch.randn(4) * 100
    assert model(x).shape == (4,)
    logged: dict[str, float] = {}
    model.log = lambda name, value, **_: logged.__setitem__(name, float(value))  # type: ignore[method-assign]
    loss = model.training_step((x, y), 0)
    assert logged["train_loss"] == pytest.approx(float(loss)) and logged["train_rmse"] == pytest.approx(
        math.sqrt(float(loss))
    )
