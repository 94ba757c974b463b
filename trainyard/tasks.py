"""Prediction tasks: what a pipeline's model predicts, what its trials report, how it is served and promoted.

| task | target column | metrics (`{val,test}_<name>`) | defaults: monitor; promotion |
|---|---|---|---|
| `classification` | int/str/bool/category | acc, logloss, roc_auc, pr_auc, f1, balanced_acc | `val_acc`; `test_acc` |
| `regression` | float (or int) | rmse, mae | `val_rmse`; `test_rmse` |

Serving (the pyfunc's `predict`) returns a DataFrame: the kept id/timestamp columns and `<target>` (the label or
the value), and for classification `proba_<label>` per class.

Both trainers report every metric of the table (`CLASSIFICATION_METRICS`,
`REGRESSION_METRICS`; `logloss`, `rmse` and `mae` are better lower, the others
higher), per class precision and recall (`test_precision/<label>`), and the
trivial baseline of each, fitted on the train split (class prior / majority
class, or the train mean): `baseline_test_<name>`. For a binary target the
positive class (`roc_auc`, `pr_auc`, `f1`) is `PipelineSpec.positive_label`,
else the second of the sorted labels; a multiclass target gets macro averages.
Every `test_*` metric of the table can be a promotion metric: the promotion
re-evaluates the champion on the candidate's test split from its served
predictions (`trainyard.promotion.served`), so each can decide a retrain.

Both tasks run on both trainers (`ModelSpec.task`: `lightning` or `gbt`). A
Lightning model returns logits `[batch, n_classes]` (classification) or one
value per row, `[batch]` or `[batch, 1]` (regression); the pod checks this with
one forward pass before the first epoch. Other tasks (ranking, multi-label,
forecasting) are not supported: their evaluation and serving differ.

`PipelineSpec.task` unset means inferred from the target column's declared
dtype: `float` is regression; `int`, `str` and `bool` are classification.

Defaults merge in one order, later wins: the platform's field defaults
(`ModelSpec.monitor="val_acc"`, `PromotionSpec.metric="test_acc"`, both for
classification) < the task's defaults in `TASKS` (filled by
`fill_task_defaults` for each field the pipeline spec leaves unset) < what the
pipeline spec sets. `check_task` then rejects a monitor, promotion metric or
LightGBM objective that the task does not have, naming the field, the value
and what would be accepted.

Example:
    >>> TASKS["regression"].promotion
    ('test_rmse', 'min')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from pydantic import BaseModel

from training.spec import CLASSIFICATION_OBJECTIVES, REGRESSION_OBJECTIVES


@dataclass(frozen=True)
class TaskProfile:
    """One task's metrics, defaults and serving signature (see the module docstring).

    Attributes:
        monitor: The default `(ModelSpec.monitor, monitor_mode)`.
        promotion: The default `(PromotionSpec.metric, mode)`.
        evaluated: Per trainer, the test metrics the platform measures on the
            pinned test split: the promotion metrics it can compare.
        logged: Per trainer, the validation metrics a trial reports every epoch
            (for Lightning: those the platform's `ClassifierSteps` /
            `RegressorSteps` log; a module may log more).
        serving: What the served model's `predict` returns.
    """

    monitor: tuple[str, str]
    promotion: tuple[str, str]
    evaluated: dict[str, tuple[str, ...]]
    logged: dict[str, tuple[str, ...]]
    serving: str


CLASSIFICATION_METRICS: dict[str, str] = {
    "acc": "max", "logloss": "min", "roc_auc": "max", "pr_auc": "max", "f1": "max", "balanced_acc": "max",
}
"""Classification metrics both trainers report on val and test (`val_<name>`, `test_<name>`), with the better
direction."""
REGRESSION_METRICS: dict[str, str] = {"rmse": "min", "mae": "min"}
"""Regression metrics both trainers report on val and test, with the better direction."""
CAUSAL_LM_METRICS: dict[str, str] = {"loss": "min", "perplexity": "min"}
"""Causal language-model metrics a Lightning trial reports on val and test: mean next-token cross-entropy (nats) and its
exp."""


def _split(split: str, names: dict[str, str]) -> tuple[str, ...]:
    return tuple(f"{split}_{n}" for n in names)


TASKS = {
    "classification": TaskProfile(
        monitor=("val_acc", "max"),
        promotion=("test_acc", "max"),
        evaluated={t: _split("test", CLASSIFICATION_METRICS) for t in ("lightning", "gbt")},
        logged={"lightning": ("val_acc", "val_loss"), "gbt": _split("val", CLASSIFICATION_METRICS)},
        serving="a DataFrame: the kept id/timestamp columns, the label in the target column, proba_<label> per class",
    ),
    "regression": TaskProfile(
        monitor=("val_rmse", "min"),
        promotion=("test_rmse", "min"),
        evaluated={t: _split("test", REGRESSION_METRICS) for t in ("lightning", "gbt")},
        logged={"lightning": ("val_rmse", "val_loss"), "gbt": _split("val", REGRESSION_METRICS)},
        serving="a DataFrame: the kept id/timestamp columns, the value in the target column",
    ),
    "causal_lm": TaskProfile(
        monitor=("val_loss", "min"),
        promotion=("test_perplexity", "min"),
        evaluated={"lightning": _split("test", CAUSAL_LM_METRICS), "gbt": ()},
        logged={"lightning": _split("val", CAUSAL_LM_METRICS), "gbt": ()},
        serving="token ids [batch, length] in, the next token's logits [batch, vocabulary] out (or each row's mean "
        "next-token loss with params={'output': 'token_nll'})",
    ),
}

# Metrics whose task and direction the platform knows: (task or None for both, the better direction).
KNOWN_METRICS: dict[str, tuple[Optional[str], str]] = {
    **{
        f"{split}_{n}": ("classification", mode)
        for split in ("val", "test")
        for n, mode in CLASSIFICATION_METRICS.items()
    },
    **{f"{split}_{n}": ("regression", mode) for split in ("val", "test") for n, mode in REGRESSION_METRICS.items()},
    **{
        f"{split}_{n}": ("causal_lm", mode)
        for split in ("val", "test")
        for n, mode in CAUSAL_LM_METRICS.items()
        if n != "loss"
    },
    "val_loss": (None, "min"),
    "test_loss": (None, "min"),
}

# Metrics a gbt trial can monitor and the direction each is better in (training/gbt.py reports them).
GBT_MONITORS = {m: KNOWN_METRICS[m][1] for p in TASKS.values() for m in p.logged["gbt"]}
GBT_METRICS = {task: (*p.logged["gbt"], *p.evaluated["gbt"]) for task, p in TASKS.items()}


def metric_direction(name: str) -> Optional[str]:
    """The better direction (`max` or `min`) of a metric the platform knows, its `baseline_` form included (None:
    unknown).

    Example:
        >>> metric_direction("test_pr_auc"), metric_direction("baseline_test_logloss"), metric_direction("test_custom")
        ('max', 'min', None)
    """
    known = KNOWN_METRICS.get(name.removeprefix("baseline_"))
    return None if known is None else known[1]


def infer_task(target_dtype: Optional[str]) -> Optional[str]:
    """The task of a target column's declared dtype: `float` is regression, any other classification (None: unknown
    column)."""
    if target_dtype is None:
        return None
    return "regression" if target_dtype == "float" else "classification"


def _field(value: Any, name: str) -> Any:
    return (
        getattr(value, name, None)
        if isinstance(value, BaseModel)
        else value.get(name)
        if isinstance(value, dict)
        else None
    )


def _fill(value: Any, defaults: dict[str, Any], cls: type[BaseModel]) -> Any:
    """`value` (a dict of fields or a built `cls`) with `defaults` for the fields it does not set itself."""
    if value is None:
        value = cls.model_validate({})
    if isinstance(value, dict):
        return {**defaults, **value}
    if isinstance(value, BaseModel):
        update = {k: v for k, v in defaults.items() if k not in value.model_fields_set and getattr(value, k) != v}
        return value.model_copy(update=update) if update else value
    return value


def fill_task_defaults(
    data: dict[str, Any], model_cls: type[BaseModel], promotion_cls: type[BaseModel]
) -> dict[str, Any]:
    """The raw `PipelineSpec` fields with `task` resolved and its defaults in unset fields (order in the module
    docstring).

    A monitor the pipeline names without its mode gets that metric's direction
    (`val_rmse` -> `min`), a promotion metric without its mode likewise
    (`test_logloss` -> `min`). Anything malformed is left for validation to report.

    Args:
        data: The fields `PipelineSpec` was called with.
        model_cls: `ModelSpec`, to fill a `model` given as a dict.
        promotion_cls: `PromotionSpec`, built when `promotion` is unset.
    """
    columns = data.get("columns")
    target_column = (
        columns.get(data.get("target")) if isinstance(columns, dict) and isinstance(data.get("target"), str) else None
    )
    task = data.get("task") or infer_task(_field(target_column, "dtype"))
    if task not in TASKS:
        return data
    profile = TASKS[task]
    out = {**data, "task": task}
    model = data.get("model")
    if model is not None:
        monitor = _field(model, "monitor") if _set(model, "monitor") else profile.monitor[0]
        defaults = {"monitor": monitor}
        known = KNOWN_METRICS.get(monitor)
        mode = known[1] if known is not None else profile.monitor[1]
        defaults["monitor_mode"] = mode
        out["model"] = _fill(model, defaults, model_cls)
    promotion = data.get("promotion")
    if promotion is None and profile.promotion == _default_promotion(promotion_cls):
        return out
    metric = (
        _field(promotion, "metric") if promotion is not None and _set(promotion, "metric") else profile.promotion[0]
    )
    direction = metric_direction(metric) if isinstance(metric, str) else None
    out["promotion"] = _fill(promotion, {"metric": metric, "mode": direction or profile.promotion[1]}, promotion_cls)
    return out


def _set(value: Any, name: str) -> bool:
    """Whether the pipeline set field `name` itself."""
    if isinstance(value, BaseModel):
        return name in value.model_fields_set
    return isinstance(value, dict) and name in value


def _default_promotion(cls: type[BaseModel]) -> tuple[Any, Any]:
    fields = cls.model_fields
    return fields["metric"].default, fields["mode"].default


def check_task(task: str, target: str, target_dtype: str, trainer: str, monitor: str, monitor_mode: str,
               promotion_metric: str, hparams: dict[str, Any]) -> None:
    """Reject a pipeline whose model settings do not fit its task; see the module docstring.

    Raises:
        ValueError: naming the field, the value and what the task accepts.
    """
    profile = TASKS[task]
    if task == "regression" and target_dtype in ("str", "bool", "category"):
        raise ValueError(
            f"task 'regression' needs a numeric target; column {target!r} is declared {target_dtype!r} (use "
            "task='classification')"
        )
    known = KNOWN_METRICS.get(monitor)
    accepted = list(profile.logged[trainer])
    if known is not None and known[0] not in (None, task):
        more = "" if trainer == "gbt" else " (or another val_* metric the model logs)"
        raise ValueError(
            f"model.monitor {monitor!r} is a {known[0]} metric, but the task is {task!r}; use one of {accepted}{more}"
        )
    if known is not None and monitor_mode != known[1]:
        raise ValueError(f"model.monitor_mode {monitor_mode!r} does not fit monitor {monitor!r}, which is better when "
                         f"{'higher' if known[1] == 'max' else 'lower'}; use {known[1]!r}")
    if promotion_metric not in profile.evaluated[trainer]:
        raise ValueError(
            f"promotion.metric {promotion_metric!r} is not measured for task {task!r} (trainer {trainer!r}); "
            f"use one of {list(profile.evaluated[trainer])}"
        )
    objective = hparams.get("objective") if trainer == "gbt" else None
    fits = CLASSIFICATION_OBJECTIVES if task == "classification" else REGRESSION_OBJECTIVES
    if (
        objective is not None
        and objective in CLASSIFICATION_OBJECTIVES + REGRESSION_OBJECTIVES
        and objective not in fits
    ):
        raise ValueError(
            f"model.hparams.objective {objective!r} contradicts task {task!r}; use one of {list(fits)} or leave it "
            "unset"
        )
