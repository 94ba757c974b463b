"""Tasks as a pipeline field: inference from the target, per-task defaults, and mistakes that fail at import."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from tests.pipelines.pipeline_fixtures import small_spec
from training.spec import Distribution, TrackerSpec
from trainyard.promotion import check_smoke
from trainyard.spec import ColumnSpec, ModelSpec, PipelineSpec, PromotionSpec, SourceSpec
from trainyard.tasks import TASKS
from trainyard.trainspec import TrialInputs, build_train_spec
from trainyard.values import ValidatedData

FEATURES = ["age", "bmi", "bp"]


def regression_spec(**over: Any) -> PipelineSpec:
    """A diabetes-like pipeline: float features and a float target, a Lightning regressor."""
    columns = {c: ColumnSpec(dtype="float") for c in FEATURES}
    columns["progression"] = ColumnSpec(dtype="float", min=0)
    base: dict[str, Any] = dict(
        team="health",
        name="diabetes",
        source=SourceSpec(prefix="landing/health/diabetes"),
        columns=columns,
        target="progression",
        model=ModelSpec(path="tests.diabetes:TinyRegressor"),
    )
    base.update(over)
    return PipelineSpec(**base)


def test_a_float_target_is_a_regression_with_its_defaults() -> None:
    spec = regression_spec()
    assert spec.task == "regression"
    assert (spec.model.monitor, spec.model.monitor_mode) == TASKS["regression"].monitor == ("val_rmse", "min")
    assert (spec.promotion.metric, spec.promotion.mode) == TASKS["regression"].promotion == ("test_rmse", "min")


def test_an_int_target_is_a_classification_with_the_platform_defaults_unchanged() -> None:
    spec = small_spec()
    assert spec.task == "classification"
    assert (spec.model.monitor, spec.model.monitor_mode, spec.promotion) == ("val_acc", "max", PromotionSpec())
    assert spec.fingerprint() == small_spec(task="classification").fingerprint()


def test_the_pipeline_spec_wins_over_the_task_defaults() -> None:
    spec = regression_spec(model=ModelSpec(path="tests.diabetes:TinyRegressor", monitor="val_loss"),
                           promotion=PromotionSpec(metric="test_rmse", mode="min", threshold=60.0))
    assert (spec.model.monitor, spec.model.monitor_mode) == (
        "val_loss",
        "min",
    )  # a known metric's direction, since the mode was not set
    assert spec.promotion.threshold == 60.0
    assert (
        regression_spec(promotion=PromotionSpec(threshold=60.0)).promotion.metric == "test_rmse"
    )  # unset fields take the task's


def test_from_a_dict_too() -> None:
    spec = PipelineSpec.model_validate(
        regression_spec().model_dump(exclude={"task", "promotion"})
        | {"model": {"path": "tests.diabetes:TinyRegressor"}}
    )
    assert (spec.task, spec.model.monitor, spec.promotion.metric) == ("regression", "val_rmse", "test_rmse")


def test_a_declared_task_overrides_the_target_dtype_and_changes_the_fingerprint() -> None:
    spec = small_spec(task="regression", model=ModelSpec(path="tests.diabetes:TinyRegressor"))
    assert (spec.task, spec.model.monitor) == ("regression", "val_rmse")
    model = ModelSpec(path="tests.diabetes:TinyRegressor", monitor="val_loss")  # the same model under either task
    assert small_spec(task="regression", model=model).fingerprint() != small_spec(model=model).fingerprint()


@pytest.mark.parametrize(
    ("over", "message"),
    [
        (
            {"model": ModelSpec(path="tests.diabetes:TinyRegressor", monitor="val_acc")},
            "model.monitor 'val_acc' is a classification metric, but the task is 'regression'; use one of "
            "['val_rmse', 'val_loss'] (or another val_* metric the model logs)",
        ),
        (
            {"model": ModelSpec(path="tests.diabetes:TinyRegressor", monitor="val_rmse", monitor_mode="max")},
            "model.monitor_mode 'max' does not fit monitor 'val_rmse', which is better when lower; use 'min'",
        ),
        (
            {"promotion": PromotionSpec(metric="test_acc")},
            "promotion.metric 'test_acc' is not measured for task 'regression' (trainer 'lightning'); use one of "
            "['test_rmse', 'test_mae']",
        ),
        (
            {"model": ModelSpec(task="gbt", hparams={"objective": "binary"})},
            "model.hparams.objective 'binary' contradicts task 'regression'; use one of ['regression', 'regression_l1'",
        ),
        (
            {"task": "regression", "columns": {"x": ColumnSpec(dtype="float"), "progression": ColumnSpec(dtype="str")}},
            "task 'regression' needs a numeric target; column 'progression' is declared 'str'",
        ),
    ],
)
def test_a_mismatch_between_model_and_task_fails_at_import(over: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as info:
        regression_spec(**over)
    assert message in str(info.value)


def test_a_classification_pipeline_rejects_regression_settings() -> None:
    with pytest.raises(
        ValidationError, match="model.monitor 'val_rmse' is a regression metric, but the task is 'classification'"
    ):
        small_spec(model=ModelSpec(path="pipelines.vision.models:DigitsMLP", monitor="val_rmse", monitor_mode="min"))
    with pytest.raises(ValidationError, match="promotion.metric 'test_loss' is not measured for task 'classification'"):
        small_spec(promotion=PromotionSpec(metric="test_loss", mode="min"))


def test_gbt_regression_takes_the_task_defaults() -> None:
    spec = regression_spec(model=ModelSpec(task="gbt"))
    assert (spec.model.monitor, spec.model.monitor_mode, spec.promotion.metric) == ("val_rmse", "min", "test_rmse")
    assert spec.model.gbt_metrics == ("val_rmse", "val_mae", "test_rmse", "test_mae")


@pytest.mark.parametrize("trainer", ["lightning", "gbt"])
@pytest.mark.parametrize(
    ("metric", "mode"),
    [
        ("test_roc_auc", "max"),
        ("test_pr_auc", "max"),
        ("test_f1", "max"),
        ("test_balanced_acc", "max"),
        ("test_logloss", "min"),
        ("test_acc", "max"),
    ],
)
def test_every_classification_metric_is_a_promotion_metric_of_both_trainers(
    trainer: str, metric: str, mode: str
) -> None:
    model = ModelSpec(task="gbt") if trainer == "gbt" else ModelSpec(path="pipelines.vision.models:DigitsMLP")
    spec = small_spec(model=model, promotion={"metric": metric})  # the mode follows the metric's direction
    assert (spec.promotion.metric, spec.promotion.mode) == (metric, mode)
    assert metric in TASKS["classification"].evaluated[trainer]


def test_a_promotion_mode_against_the_metric_s_direction_is_refused() -> None:
    with pytest.raises(
        ValidationError,
        match="promotion.mode 'min' with metric 'test_roc_auc' would promote worse models; use mode='max'",
    ):
        PromotionSpec(metric="test_roc_auc", mode="min")
    assert PromotionSpec(metric="test_mae").mode == "min"  # named without its mode, a metric takes its direction


def test_a_gbt_model_monitors_any_validation_metric_of_its_task() -> None:
    spec = small_spec(model=ModelSpec(task="gbt", monitor="val_pr_auc"))
    assert (spec.model.monitor, spec.model.monitor_mode) == ("val_pr_auc", "max")
    assert (
        regression_spec(model=ModelSpec(task="gbt", monitor="val_mae", monitor_mode="min")).model.monitor == "val_mae"
    )


def test_the_train_spec_carries_the_task() -> None:
    data = ValidatedData(
        md5="a" * 32,
        split_id="a" * 32 + "-f",
        train="/d/t",
        val="/d/v",
        test="/d/s",
        rows={"train": 7, "val": 2, "test": 2},
    )
    args = dict(
        output_uri="/runs/t",
        distribution=Distribution(),
        tracker=TrackerSpec(kind="none"),
        optuna_storage_url="sqlite:///o.db",
        lineage={},
    )
    ts = build_train_spec(regression_spec(), TrialInputs("trial-0000", 0, "s"), data, **args)
    assert (ts.prediction_task, ts.task, ts.monitor, ts.monitor_mode) == ("regression", "lightning", "val_rmse", "min")
    assert (
        build_train_spec(small_spec(), TrialInputs("trial-0000", 0, "s"), data, **args).prediction_task
        == "classification"
    )


class _Smoke:
    model_uri, run_id, load_seconds, seconds, blocked_imports, error, passed = (
        "models:/m@challenger",
        "r1",
        0.1,
        0.2,
        (),
        None,
        True,
    )
    predictions = {"input_example": [1.0], "test": [1.0, 3.0]}


def test_the_smoke_test_recomputes_the_task_s_promotion_metric() -> None:
    check, evidence = check_smoke(
        PromotionSpec(metric="test_rmse", mode="min"),
        _Smoke(),
        run_id="r1",
        test_labels=[1.0, 2.0],
        training_metrics={"test_acc": 0.0, "test_rmse": 0.5**0.5},
    )
    assert check.passed and evidence["served_metric"] == "test_rmse"
