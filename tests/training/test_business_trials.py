"""A business table (string categoricals, a date column, an id, gaps, a rare "yes"/"no" target) trained on both trainers
through the entrypoint in one process, exported and served from raw rows with probabilities and ids."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pandas as pd
import pytest

from tests.training.business_models import FEATURE_TYPES, FEATURES, KEEP, TARGET, write_business_splits
from training import entrypoint
from training.serving_model import ExportedModel
from training.spec import EXIT_BAD_CONFIG, DataSpec, ImportTarget, Preprocessing, TrainResult, TrainSpec

sk = pytest.importorskip("sklearn.metrics")


def business_spec(tmp: Path, task: str, **fields: Any) -> TrainSpec:
    paths = write_business_splits(tmp / "data")
    if task == "gbt":
        defaults: dict[str, Any] = dict(
            model=ImportTarget(path="lightgbm:train", kwargs={"num_leaves": 7, "min_data_in_leaf": 10}),
            max_epochs=60,
            monitor="val_pr_auc",
            monitor_mode="max",
        )
    else:
        defaults = dict(
            model=ImportTarget(path="tests.training.business_models:OneLogitNet"),
            max_epochs=4,
            batch_size=64,
            monitor="val_loss",
            monitor_mode="min",
        )
    spec = TrainSpec(
        pipeline="churn/customers",
        trial_id="trial-0000",
        task=task,
        prediction_task="classification",
        data=DataSpec(
            train_uri=paths["train"],
            val_uri=paths["val"],
            test_uri=paths["test"],
            features=FEATURES,
            target=TARGET,
            version="0" * 32,
            feature_types=FEATURE_TYPES,
            keep=KEEP,
        ),
        output_uri=str(tmp / "run"),
        **{**defaults, **fields},
    )
    (tmp / "spec.json").write_text(spec.to_json())
    return spec


def train(tmp: Path) -> int:
    return entrypoint.main(["--spec", str(tmp / "spec.json")])


def served(tmp: Path, frame: pd.DataFrame) -> pd.DataFrame:
    model = ExportedModel()
    model.load_context(SimpleNamespace(artifacts={"model_dir": str(tmp / "run" / "model")}))
    return model.predict(None, frame)


def check_trial(tmp: Path, spec: TrainSpec) -> TrainResult:
    result = TrainResult.model_validate_json((tmp / "run" / "result.json").read_text())
    m = result.metrics
    for split in ("val", "test"):
        for name in (
            "acc",
            "logloss",
            "roc_auc",
            "pr_auc",
            "f1",
            "balanced_acc",
            "precision/yes",
            "recall/yes",
            "precision/no",
            "recall/no",
        ):
            assert f"{split}_{name}" in m and f"baseline_{split}_{name}" in m
        assert m[f"baseline_{split}_roc_auc"] == 0.5
    assert (
        m["test_roc_auc"] > 0.7 and m["test_pr_auc"] > m["baseline_test_pr_auc"]
    )  # ranks customers better than the prior
    model_dir = tmp / "run" / "model"
    meta = json.loads((model_dir / "meta.json").read_text())
    assert meta["classes"] == ["no", "yes"] and meta["positive_label"] == "yes" and meta["keep"] == KEEP
    assert meta["preprocessing"] == "preprocessing.json" and (model_dir / "preprocessing.json").is_file()
    # serving takes the raw test rows (strings, dates, gaps, a plan train never saw) and returns ids, labels,
    # probabilities
    test = pd.read_parquet(spec.data.test_uri)
    assert (test["plan"] == "enterprise").sum() == 5 and test[["charges", "calls", "country"]].isna().any().all()
    out = served(tmp, test.drop(columns=[TARGET]))
    assert list(out.columns) == ["customer_id", TARGET, "proba_no", "proba_yes"]
    assert out["customer_id"].tolist() == test["customer_id"].tolist()
    np.testing.assert_allclose(out["proba_no"] + out["proba_yes"], 1.0, rtol=1e-6)
    assert set(out[TARGET]) <= {"no", "yes"}
    y = (test[TARGET] == "yes").to_numpy()
    assert sk.roc_auc_score(y, out["proba_yes"]) == pytest.approx(
        m["test_roc_auc"], abs=1e-6
    )  # serving reproduces training's evaluation
    assert float((out[TARGET] == test[TARGET]).mean()) == pytest.approx(
        m["test_acc"], abs=1e-6
    )  # lightning: a float32 mean
    # rows as a client posts them: ISO text dates, an unseen country and plan, empty cells
    rows = pd.DataFrame(
        {
            "customer_id": ["X1", "X2"],
            "plan": ["platinum", "basic"],
            "country": ["ZZ", None],
            "signup_date": ["2024-02-29", None],
            "tenure": [3, 40],
            "charges": [None, 80.5],
            "calls": [2.0, None],
        }
    )
    out = served(tmp, rows)
    assert out["customer_id"].tolist() == ["X1", "X2"] and np.isfinite(out["proba_yes"]).all()
    return result


def test_gbt_trial_on_a_business_table_serves_probabilities_and_ids(tmp_path: Path) -> None:
    spec = business_spec(tmp_path, "gbt")
    assert train(tmp_path) == 0
    result = check_trial(tmp_path, spec)
    assert result.best_metric == pytest.approx(max(result.metrics["val_pr_auc"], result.best_metric))
    state = json.loads((tmp_path / "run" / "model" / "preprocessing.json").read_text())
    assert (
        state["trainer"] == "gbt" and state["categorical_outputs"]
    )  # plan and country as LightGBM categorical features


def test_lightning_one_logit_trial_on_a_business_table_serves_probabilities_and_ids(tmp_path: Path) -> None:
    spec = business_spec(tmp_path, "lightning", class_weight="balanced")
    assert train(tmp_path) == 0
    result = check_trial(tmp_path, spec)
    # balanced class weights: the rare "yes" is predicted, so its recall is above the majority baseline's 0
    assert result.metrics["test_recall/yes"] > 0


@pytest.mark.parametrize("task", ["gbt", "lightning"])
def test_preprocessing_off_fails_before_compute_naming_the_columns(tmp_path: Path, task: str) -> None:
    business_spec(tmp_path, task, preprocessing=Preprocessing(enabled=False))
    assert train(tmp_path) == EXIT_BAD_CONFIG
    error = json.loads((tmp_path / "run" / "failures" / "rank-0.json").read_text())["error"]
    assert "'plan' holds text" in error and "'signup_date' holds dates" in error and "'charges' has" in error
    assert "PipelineSpec.preprocessing" in error
    assert not (tmp_path / "run" / "attempts").exists() or task == "gbt"  # lightning: no training attempt started


def test_class_weights_for_a_model_that_takes_none_is_a_config_error_naming_it(tmp_path: Path) -> None:
    business_spec(
        tmp_path,
        "lightning",
        class_weight="balanced",
        model=ImportTarget(path="tests.training.business_models:NoWeightsNet"),
    )
    assert train(tmp_path) == EXIT_BAD_CONFIG
    error = json.loads((tmp_path / "run" / "failures" / "rank-0.json").read_text())["error"]
    assert "model 'tests.training.business_models:NoWeightsNet' takes no `class_weights` argument" in error


def test_the_mlflow_model_ships_the_preprocessing_and_serves_raw_rows(tmp_path: Path) -> None:
    import mlflow.pyfunc

    from resources.registry.registration import CODE_PATHS, SERVING_MODEL_PATH, input_example_of

    spec = business_spec(tmp_path, "gbt", max_epochs=20)
    assert train(tmp_path) == 0
    test = pd.read_parquet(spec.data.test_uri)
    example = input_example_of(test, FEATURES, KEEP)
    assert list(example.columns) == ["customer_id", *FEATURES] and not pd.api.types.is_numeric_dtype(
        example["plan"]
    )  # raw text
    mlflow.pyfunc.save_model(
        str(tmp_path / "pyfunc"),
        python_model=str(SERVING_MODEL_PATH),
        artifacts={"model_dir": str(tmp_path / "run" / "model")},
        code_paths=[str(path) for path in CODE_PATHS],
        input_example=example,
    )
    sys.modules.pop("preprocessing", None)
    loaded = mlflow.pyfunc.load_model(str(tmp_path / "pyfunc"))
    assert str(tmp_path / "pyfunc") in sys.modules["preprocessing"].__file__  # the copy shipped with the model
    out = loaded.predict(test.drop(columns=[TARGET]))
    assert out["customer_id"].tolist() == test["customer_id"].tolist()
    direct = served(tmp_path, test.drop(columns=[TARGET]))
    np.testing.assert_allclose(out["proba_yes"].to_numpy(), direct["proba_yes"].to_numpy())
