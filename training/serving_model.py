"""MLflow pyfunc that serves a model exported by a training process.

This file is an MLflow "models from code" definition: `ModelRegistry.register`
passes its *path* to `mlflow.pyfunc.log_model`, MLflow copies it into the model
artifacts, and whoever loads the model executes it. It must therefore stay
self-contained and import only mlflow, numpy, pandas, the model's runtime
(torch or lightgbm, imported only for the format being served) and the
standard library, so a serving image needs none of trainyard or Dagster.

Preprocessing travels with the model: the pyfunc selects `meta["features"]`
by name from whatever table it gets (extra columns are ignored, order does not
matter), casts them to the dtype the model was exported with, and maps the
model's class indices back to the original labels.

The exported model directory (the `model_dir` artifact) holds `meta.json`:
`{"format": ..., "features": [...], "target": "label", "task": ..., "classes": [...]}`
and one model file per format:

- `torch_export` (the default when `format` is absent): `model.pt2`, a
  `torch.export` ExportedProgram with a dynamic batch dimension, taking
  `input_dtype` (float32) `[batch, n_features]` and returning logits
  `[batch, n_classes]` (task `classification`) or one value per row,
  `[batch]` or `[batch, 1]` (task `regression`).
- `lightgbm`: `model.txt`, a LightGBM model holding the best iteration; task
  `classification` (binary: probability of `classes[1]`; multiclass: one
  probability per class) or `regression`.

Example:
    >>> import mlflow.pyfunc
    >>> model = mlflow.pyfunc.load_model("models:/vision.digits@champion")
    >>> labels = model.predict(frame)  # frame holds meta["features"] columns
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Optional

import mlflow
import mlflow.models
import numpy as np
import pandas as pd

# By name, not as `mlflow.pyfunc.X`: type checkers see that attribute as mlflow's lazy loader.
from mlflow.pyfunc import PythonModel, PythonModelContext

META_FILE = "meta.json"
DEFAULT_FORMAT = "torch_export"
MODEL_FILES = {"torch_export": "model.pt2", "lightgbm": "model.txt"}
"""The model file of each serving format."""
SUPPORTED_TASKS = {"torch_export": ("classification", "regression"), "lightgbm": ("classification", "regression")}
"""Serving signature per task: `classification` predicts one label of `classes` per row, `regression` one float per row."""
SUPPORTED_INPUT_DTYPES = ("float32", "float64")
MODEL_FILE = MODEL_FILES[DEFAULT_FORMAT]
LIGHTGBM_FORMAT = "lightgbm"
LIGHTGBM_MODEL_FILE = MODEL_FILES[LIGHTGBM_FORMAT]
LIGHTGBM_TASKS = SUPPORTED_TASKS[LIGHTGBM_FORMAT]


def read_meta(model_dir: str) -> dict[str, Any]:
    """Reads and validates `meta.json` of an exported model directory.

    Args:
        model_dir: Directory holding `meta.json` and the model file of its format.

    Returns:
        The parsed metadata.

    Raises:
        ValueError: A field is missing or holds a value this pyfunc cannot serve.
    """
    path = os.path.join(model_dir, META_FILE)
    with open(path, encoding="utf-8") as f:
        meta = json.load(f)
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(meta).__name__}")
    features = meta.get("features")
    if (
        not isinstance(features, list)
        or not features
        or not all(isinstance(c, str) for c in features)
    ):
        raise ValueError(
            f"{path}: field 'features' must be a non-empty list of column names, got {features!r}"
        )
    if len(set(features)) != len(features):
        raise ValueError(f"{path}: field 'features' has duplicate names: {features!r}")
    fmt = meta.get("format", DEFAULT_FORMAT)
    if fmt not in MODEL_FILES:
        raise ValueError(f"{path}: field 'format' is {fmt!r}; supported: {sorted(MODEL_FILES)}")
    task = meta.get("task")
    if task not in SUPPORTED_TASKS[fmt]:
        raise ValueError(f"{path}: field 'task' is {task!r}; format {fmt!r} supports {list(SUPPORTED_TASKS[fmt])}")
    classes = meta.get("classes")
    if task == "classification" and (not isinstance(classes, list) or len(classes) < 2):
        raise ValueError(f"{path}: field 'classes' must list at least two labels for classification, got {classes!r}")
    dtype = meta.get("input_dtype", "float32" if fmt == "torch_export" else "float64")
    if dtype not in SUPPORTED_INPUT_DTYPES:
        raise ValueError(f"{path}: field 'input_dtype' is {dtype!r}; supported: {list(SUPPORTED_INPUT_DTYPES)}")
    if not os.path.isfile(os.path.join(model_dir, MODEL_FILES[fmt])):
        raise ValueError(f"{model_dir}: format {fmt!r} needs {MODEL_FILES[fmt]!r}, which is missing")
    return meta


class ExportedModel(PythonModel):
    """Serves an exported torch or LightGBM model; predicts labels (or values) from a DataFrame."""

    def __init__(self) -> None:
        self._meta: Optional[dict[str, Any]] = None
        self._classes: Optional[np.ndarray] = None
        self._dtype: Any = np.float32
        self._predict_raw: Optional[Callable[[np.ndarray], np.ndarray]] = None

    def load_context(self, context: PythonModelContext) -> None:
        """Loads the model and its metadata from the `model_dir` artifact.

        Args:
            context: MLflow context; `context.artifacts["model_dir"]` is the local
                copy of the exported model directory.
        """
        model_dir = context.artifacts["model_dir"]
        meta = read_meta(model_dir)
        fmt = meta.get("format", DEFAULT_FORMAT)
        self._meta = meta
        self._classes = np.asarray(meta["classes"]) if meta["task"] == "classification" else None
        self._dtype = np.dtype(meta.get("input_dtype", "float32" if fmt == "torch_export" else "float64"))
        path = os.path.join(model_dir, MODEL_FILES[fmt])
        self._predict_raw = _load_torch_export(path) if fmt == "torch_export" else _load_lightgbm(path, meta)

    def predict(
        self,
        context: PythonModelContext,
        model_input: pd.DataFrame,
        params: Optional[dict[str, Any]] = None,
    ) -> pd.Series:
        """Predicts one label (classification) or value (regression) per row.

        Args:
            context: MLflow context (unused; state is set by `load_context`).
            model_input: Rows to predict; must hold every column in
                `meta["features"]`. Other columns are ignored.
            params: Unused; accepted for the pyfunc interface.

        Returns:
            One prediction per row, indexed like the input; labels come from
            `meta["classes"]`.

        Raises:
            ValueError: Feature columns are missing, or the model's output does not
                match the number of classes.
        """
        if self._meta is None or self._predict_raw is None:
            raise RuntimeError("ExportedModel.predict called before load_context")
        features = self._meta["features"]
        if not isinstance(model_input, pd.DataFrame):
            model_input = pd.DataFrame(model_input)
        missing = [c for c in features if c not in model_input.columns]
        if missing:
            raise ValueError(
                f"model input is missing feature columns {missing}; "
                f"expected all of {features}, got {list(model_input.columns)}"
            )
        values = model_input[features].to_numpy(dtype=self._dtype, copy=True)
        raw = self._predict_raw(values)
        name = self._meta.get("target")
        if self._classes is None:
            return pd.Series(np.asarray(raw, dtype="float64").reshape(len(values)), index=model_input.index, name=name)
        n_classes = len(self._classes)
        if raw.ndim == 1 and n_classes == 2:
            index = (raw > 0.5).astype("int64")  # a binary model's probability of classes[1]
        elif raw.ndim == 2 and raw.shape[1] == n_classes:
            index = raw.argmax(axis=1)
        else:
            raise ValueError(
                f"model returned output of shape {tuple(raw.shape)}; "
                f"expected [batch, {n_classes}] for classes {self._classes.tolist()}"
            )
        return pd.Series(self._classes[index], index=model_input.index, name=name)


def _load_torch_export(path: str) -> Callable[[np.ndarray], np.ndarray]:
    import torch  # each runtime loads only for its own flavour: a LightGBM server needs no torch

    module = torch.export.load(path).module()

    def run(values: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return module(torch.from_numpy(values)).cpu().numpy()

    return run


def _load_lightgbm(path: str, meta: dict[str, Any]) -> Callable[[np.ndarray], np.ndarray]:
    import lightgbm  # each runtime loads only for its own flavour: a torch server needs no LightGBM

    booster = lightgbm.Booster(model_file=path)
    best = meta.get("best_iteration")

    def run(values: np.ndarray) -> np.ndarray:
        return np.asarray(booster.predict(values, num_iteration=best if best else None))

    return run


# Kept for versions logged before LightGBM support; the class is looked up by name only here.
ExportedClassifier = ExportedModel

mlflow.models.set_model(ExportedModel())
