"""MLflow pyfunc that serves a model exported by a training process.

This file is an MLflow "models from code" definition: `ModelRegistry.register`
passes its *path* to `mlflow.pyfunc.log_model`, MLflow copies it into the model
artifacts, and whoever loads the model executes it. It must therefore stay
self-contained and import only torch, numpy, pandas, mlflow and the standard
library, so a serving image needs none of trainyard or Dagster.

The exported model directory (the `model_dir` artifact) holds:

- `model.pt2`: a `torch.export` ExportedProgram with a dynamic batch dimension,
  taking float32 `[batch, n_features]` and returning logits `[batch, n_classes]`.
- `meta.json`: `{"features": [...], "target": "label", "task": "classification",
  "classes": [...], "input_dtype": "float32"}`.

Example:
    >>> import mlflow.pyfunc
    >>> model = mlflow.pyfunc.load_model("models:/vision-digits@champion")
    >>> labels = model.predict(frame)  # frame holds meta["features"] columns
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import mlflow
import mlflow.models
import mlflow.pyfunc
import numpy as np
import pandas as pd
import torch

MODEL_FILE = "model.pt2"
META_FILE = "meta.json"
SUPPORTED_TASKS = ("classification",)
SUPPORTED_INPUT_DTYPES = {"float32": (np.float32, torch.float32)}


def read_meta(model_dir: str) -> dict[str, Any]:
    """Reads and validates `meta.json` of an exported model directory.

    Args:
        model_dir: Directory holding `model.pt2` and `meta.json`.

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
    task = meta.get("task")
    if task not in SUPPORTED_TASKS:
        raise ValueError(f"{path}: field 'task' is {task!r}; supported: {list(SUPPORTED_TASKS)}")
    classes = meta.get("classes")
    if not isinstance(classes, list) or not classes:
        raise ValueError(f"{path}: field 'classes' must be a non-empty list, got {classes!r}")
    dtype = meta.get("input_dtype", "float32")
    if dtype not in SUPPORTED_INPUT_DTYPES:
        raise ValueError(
            f"{path}: field 'input_dtype' is {dtype!r}; supported: {sorted(SUPPORTED_INPUT_DTYPES)}"
        )
    return meta


class ExportedClassifier(mlflow.pyfunc.PythonModel):
    """Serves a `torch.export` classifier; predicts class labels from a DataFrame."""

    def __init__(self) -> None:
        self._module: Optional[torch.nn.Module] = None
        self._meta: Optional[dict[str, Any]] = None
        self._classes: Optional[np.ndarray] = None

    def load_context(self, context: mlflow.pyfunc.PythonModelContext) -> None:
        """Loads the exported program and its metadata from the `model_dir` artifact.

        Args:
            context: MLflow context; `context.artifacts["model_dir"]` is the local
                copy of the exported model directory.
        """
        model_dir = context.artifacts["model_dir"]
        self._meta = read_meta(model_dir)
        self._classes = np.asarray(self._meta["classes"])
        self._module = torch.export.load(os.path.join(model_dir, MODEL_FILE)).module()

    def predict(
        self,
        context: mlflow.pyfunc.PythonModelContext,
        model_input: pd.DataFrame,
        params: Optional[dict[str, Any]] = None,
    ) -> pd.Series:
        """Predicts class labels.

        Args:
            context: MLflow context (unused; state is set by `load_context`).
            model_input: Rows to classify; must hold every column in
                `meta["features"]`. Other columns are ignored.
            params: Unused; accepted for the pyfunc interface.

        Returns:
            One label per row, taken from `meta["classes"]`, indexed like the input.

        Raises:
            ValueError: Feature columns are missing, or the model returns logits
                whose shape does not match the number of classes.
        """
        if self._module is None or self._meta is None or self._classes is None:
            raise RuntimeError("ExportedClassifier.predict called before load_context")
        features = self._meta["features"]
        if not isinstance(model_input, pd.DataFrame):
            model_input = pd.DataFrame(model_input)
        missing = [c for c in features if c not in model_input.columns]
        if missing:
            raise ValueError(
                f"model input is missing feature columns {missing}; "
                f"expected all of {features}, got {list(model_input.columns)}"
            )
        np_dtype, torch_dtype = SUPPORTED_INPUT_DTYPES[self._meta.get("input_dtype", "float32")]
        values = model_input[features].to_numpy(dtype=np_dtype, copy=True)
        with torch.no_grad():
            logits = self._module(torch.from_numpy(values).to(torch_dtype))
        if logits.ndim != 2 or logits.shape[1] != len(self._classes):
            raise ValueError(
                f"model returned logits of shape {tuple(logits.shape)}; "
                f"expected [batch, {len(self._classes)}] for classes {self._classes.tolist()}"
            )
        labels = self._classes[logits.argmax(dim=1).cpu().numpy()]
        return pd.Series(labels, index=model_input.index, name=self._meta.get("target"))


mlflow.models.set_model(ExportedClassifier())
