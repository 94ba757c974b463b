"""The inputs of a GBT trial, read and checked before any boosting: the Parquet splits and the LightGBM parameters.

See `training.gbt` for the rules (objective inference, the parameter layers, the
monitored metrics). Everything here is pure apart from reading the splits, so a
bad spec fails before compute is spent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import fsspec
import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pyarrow.types as pat

from training import preprocessing
from training.errors import ConfigError
from training.spec import CLASSIFICATION_OBJECTIVES, REGRESSION_OBJECTIVES, TrainSpec

DEFAULT_EARLY_STOPPING_ROUNDS = 20
# monitor -> (task it needs, the direction that is better)
MONITORS = {
    "val_acc": ("classification", "max"),
    "val_logloss": ("classification", "min"),
    "val_roc_auc": ("classification", "max"),
    "val_pr_auc": ("classification", "max"),
    "val_f1": ("classification", "max"),
    "val_balanced_acc": ("classification", "max"),
    "val_rmse": ("regression", "min"),
    "val_mae": ("regression", "min"),
}
# Round counts are `spec.max_epochs`; LightGBM would silently let these override it.
_ROUND_KEYS = ("num_iterations", "num_iteration", "n_iter", "num_tree", "num_trees", "num_round", "num_rounds",
               "nrounds", "num_boost_round", "n_estimators", "max_iter")
_PLATFORM_KEYS = ("seed", "deterministic", "num_class", "verbosity", "verbose", "metric")
_THREAD_KEYS = frozenset(
    {"num_threads", "num_thread", "nthread", "nthreads", "n_jobs"}
)  # LightGBM's names for its thread count


# -- data -----------------------------------------------------------------------------


@dataclass
class Splits:
    """Feature matrices (float64, after the platform's preprocessing) and encoded targets of the three splits."""

    x: dict[str, np.ndarray]
    y: dict[str, np.ndarray]
    task: str  # classification | regression
    classes: list[Any]  # original labels in index order; empty for regression
    preprocessing: dict[str, Any] = field(default_factory=dict)  # the fitted state (`training.preprocessing.fit`)
    positive: int = 1  # index of a binary target's positive class
    weights: Optional[np.ndarray] = None  # per-row training weights (`class_weight="balanced"`)

    @property
    def feature_names(self) -> list[str]:
        """The model's input columns (the raw features when nothing needed preprocessing)."""
        return preprocessing.output_names(self.preprocessing)

    @property
    def categorical(self) -> list[int]:
        """Indices of the inputs LightGBM treats as native categorical features."""
        return preprocessing.categorical_outputs(self.preprocessing)


def _read_split(uri: str, features: list[str], target: str) -> tuple[pd.DataFrame, np.ndarray, str]:

    try:
        with fsspec.open(uri, "rb") as f:
            table = pq.read_table(f, columns=[*features, target])
    except FileNotFoundError as e:
        raise ConfigError(f"data split {uri!r} does not exist") from e
    except (KeyError, ValueError) as e:
        raise ConfigError(f"data split {uri!r} lacks a column of features {features} / target {target!r}: {e}") from e
    column = table.column(target)
    kind = "regression" if pat.is_floating(column.type) else "classification"
    return table.select(features).to_pandas(), column.to_numpy(zero_copy_only=False), kind


def objective_task(objective: str) -> str:
    """`classification` or `regression`: what a LightGBM objective predicts."""
    return "classification" if objective in CLASSIFICATION_OBJECTIVES else "regression"


def balanced_weights(y: np.ndarray, n_classes: int) -> np.ndarray:
    """Per-class weights n_rows / (n_classes * rows of the class) (`class_weight="balanced"`); 0 for an absent class."""
    counts = np.bincount(y, minlength=n_classes).astype("float64")
    return np.where(counts > 0, len(y) / (n_classes * np.maximum(counts, 1.0)), 0.0)


def encode_targets(spec: TrainSpec, targets: dict[str, np.ndarray]) -> tuple[list[Any], dict[str, np.ndarray], int]:
    """Class labels (sorted over the splits), each split's class indices, and the positive class's index.

    Raises:
        ConfigError: a missing label, one class only, or a `positive_label` that is no label.
    """
    for split, values in targets.items():
        missing = int(pd.isna(pd.Series(values, dtype=object)).sum())
        if missing:
            raise ConfigError(
                f"target {spec.data.target!r} has {missing} missing label(s) in the {split} split; every row needs a "
                "label"
            )
    classes = preprocessing.class_list(*targets.values())
    if len(classes) < 2:
        raise ConfigError(
            f"target {spec.data.target!r} has a single class {classes}; classification needs at least two"
        )
    y = {s: preprocessing.encode_labels(v, classes) for s, v in targets.items()}
    try:
        positive = preprocessing.positive_index(classes, spec.data.positive_label) if len(classes) == 2 else 1
    except ValueError as e:
        raise ConfigError(
            f"{e} of target {spec.data.target!r}; set the pipeline's positive_label to one of them or leave it unset"
        ) from e
    return classes, y, positive


def fit_features(
    spec: TrainSpec, frames: dict[str, pd.DataFrame], trainer: str
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The preprocessing state fitted on the train split, and every split transformed with it.

    Raises:
        ConfigError: preprocessing is off and a feature holds text, dates or gaps (naming it),
            or a numeric feature holds text.
    """
    features = spec.data.features
    elsewhere = [c for c in features if any(frames[s][c].isna().any() for s in frames if s != "train")]
    state = preprocessing.fit(frames["train"], dict(spec.data.feature_types), dict(spec.data.domains),
                              spec.preprocessing.model_dump(), trainer, features=features, missing_elsewhere=elsewhere)
    xs = {}
    for split, frame in frames.items():
        try:
            xs[split] = preprocessing.transform(frame, state)[0]
        except preprocessing.PreprocessingError as e:
            raise ConfigError(f"the {split} split: {e}") from e
        except ValueError as e:
            raise ConfigError(f"the {split} split cannot be preprocessed: {e}") from e
    return state, xs


def load_splits(spec: TrainSpec, objective: Optional[str]) -> Splits:
    """Read train/val/test, preprocess the features (fitted on train) and encode class labels as 0..K-1 (sorted over all
    splits).

    The task is the spec's `prediction_task`, else the declared objective's,
    else the target column's type (float: regression).

    Raises:
        ConfigError: a split is missing, the objective contradicts the spec's task,
            a regression target is not numeric, a classification target has one class,
            or a feature cannot be preprocessed.
    """
    raw = {s: _read_split(u, spec.data.features, spec.data.target) for s, u in
           (("train", spec.data.train_uri), ("val", spec.data.val_uri), ("test", spec.data.test_uri))}
    task = spec.prediction_task or (objective_task(objective) if objective is not None else raw["train"][2])
    if objective is not None and objective_task(objective) != task:
        raise ConfigError(
            f"model.kwargs.objective={objective!r} trains {objective_task(objective)}, but the task is {task!r}; "
            f"use one of {list(CLASSIFICATION_OBJECTIVES if task == 'classification' else REGRESSION_OBJECTIVES)} or "
            "leave it unset"
        )
    state, x = fit_features(spec, {s: r[0] for s, r in raw.items()}, "gbt")
    if task == "regression":
        if spec.class_weight is not None:
            raise ConfigError(
                f"class_weight={spec.class_weight!r} weighs classes, but this is a regression task; leave it unset"
            )
        try:
            return Splits(x, {s: r[1].astype("float64") for s, r in raw.items()}, task, [], state)
        except (TypeError, ValueError) as e:
            raise ConfigError(
                f"target {spec.data.target!r} is not numeric, so it cannot be a regression target: {e}"
            ) from e
    classes, y, positive = encode_targets(spec, {s: r[1] for s, r in raw.items()})
    weights = balanced_weights(y["train"], len(classes))[y["train"]] if spec.class_weight == "balanced" else None
    return Splits(x, y, task, classes, state, positive, weights)


# -- parameters -----------------------------------------------------------------------


def resolve_objective(kwargs: dict[str, Any]) -> Optional[str]:
    """The declared objective, validated; None means infer it from the data."""
    objective = kwargs.get("objective")
    if objective is None:
        return None
    if objective not in CLASSIFICATION_OBJECTIVES + REGRESSION_OBJECTIVES:
        raise ConfigError(
            f"model.kwargs.objective={objective!r} is not supported; use one of "
            f"{list(CLASSIFICATION_OBJECTIVES + REGRESSION_OBJECTIVES)} or leave it unset to infer it from the target"
        )
    return objective


def lightgbm_params(spec: TrainSpec, splits: Splits, objective: Optional[str],
                    threads: Optional[int] = None) -> tuple[dict[str, Any], int]:
    """LightGBM parameters and early-stopping patience from the spec (pure).

    Layers, later wins: platform defaults (`verbosity=-1`, column-wise histograms
    when deterministic, `num_threads=threads`, the rank's CPU share from
    `training.threads`, unless the kwargs name a thread count) < `spec.model.kwargs` < values the platform owns
    (objective, `num_class`, `seed`, `deterministic`, `metric`).

    Raises:
        ConfigError: a round-count key (use `max_epochs`), a platform-owned key,
            a monitor that does not fit the task, or a bad `early_stopping_rounds`.
    """
    kwargs = dict(spec.model.kwargs)
    rounds_keys = sorted(k for k in kwargs if k in _ROUND_KEYS)
    if rounds_keys:
        raise ConfigError(
            f"model.kwargs sets {rounds_keys}; the number of boosting rounds is max_epochs (now {spec.max_epochs})"
        )
    owned = sorted(k for k in kwargs if k in _PLATFORM_KEYS)
    if owned:
        raise ConfigError(
            f"model.kwargs sets {owned}, which the platform owns (seed and determinism come from the spec, "
            f"the metric from monitor={spec.monitor!r})"
        )
    patience = kwargs.pop("early_stopping_rounds", DEFAULT_EARLY_STOPPING_ROUNDS)
    if not isinstance(patience, int) or isinstance(patience, bool) or patience < 1:
        raise ConfigError(f"model.kwargs.early_stopping_rounds={patience!r} must be an integer >= 1")
    if objective is None:
        objective = (
            "regression" if splits.task == "regression" else ("binary" if len(splits.classes) == 2 else "multiclass")
        )
    if objective == "binary" and len(splits.classes) != 2:
        raise ConfigError(
            f"objective 'binary' needs two classes; target {spec.data.target!r} has {len(splits.classes)}: "
            f"{splits.classes}"
        )
    check_monitor(spec.monitor, spec.monitor_mode, splits.task)
    if spec.monitor in ("val_roc_auc", "val_pr_auc") and splits.task == "classification":
        present = sorted(set(np.unique(splits.y["val"]).tolist()))
        if len(present) < len(splits.classes):
            missing = [c for i, c in enumerate(splits.classes) if i not in present]
            raise ConfigError(
                f"monitor={spec.monitor!r} is undefined on the validation split, which holds no rows of class(es) "
                f"{missing}; "
                f"monitor 'val_logloss' or 'val_acc', or give the validation split rows of every class"
            )
    params: dict[str, Any] = {"verbosity": -1}
    if threads is not None and not (_THREAD_KEYS & set(kwargs)):
        params["num_threads"] = threads
    if spec.deterministic and not ({"force_row_wise", "force_col_wise"} & set(kwargs)):
        params["force_col_wise"] = True
    params.update(kwargs)
    params.update(objective=objective, seed=spec.seed, deterministic=spec.deterministic, metric="None")
    if objective in ("multiclass", "multiclassova"):
        params["num_class"] = len(splits.classes)
    return params, patience


def check_monitor(monitor: str, mode: str, task: str) -> None:
    """Raise ConfigError unless `monitor` is a GBT metric of `task` with its natural direction."""
    if monitor not in MONITORS:
        raise ConfigError(f"monitor={monitor!r} is not a GBT metric; use one of {sorted(MONITORS)}")
    needs, direction = MONITORS[monitor]
    if needs != task:
        fits = sorted(m for m, (t, _) in MONITORS.items() if t == task)
        raise ConfigError(f"monitor={monitor!r} measures {needs}, but this is a {task} task; use one of {fits}")
    if mode != direction:
        raise ConfigError(
            f"monitor_mode={mode!r} does not fit monitor={monitor!r}; it is better when "
            f"{'higher' if direction == 'max' else 'lower'} (use {direction!r})"
        )
