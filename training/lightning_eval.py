"""The evaluation and export of a Lightning trial's model: the output-shape check before training, the platform's
metrics on the full validation and test splits (with the train prior's baselines), and the serving export.

Split from `training.lightning_task`, which runs the trial; this part needs the model and the splits only.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Optional

import fsspec
import torch

from training import metrics as platform_metrics
from training import preprocessing
from training.data import class_labels, read_split
from training.errors import ConfigError
from training.spec import TrainSpec

EVALUATION_METRIC = {"classification": "acc", "regression": "rmse"}
"""The metric the platform measures on the full validation and test splits (`val_<m>`, `test_<m>`), per task."""


def prediction_task(spec: TrainSpec) -> str:
    """The trial's task; specs without one are classification, as every Lightning trial was before the field."""
    return spec.prediction_task or "classification"


def check_output_fits_task(model: Any, dm: Any, spec: TrainSpec) -> None:
    """One forward pass on two rows, before training: does the model's output fit the task?

    Classification needs logits `[batch, n_classes]` (at least one per class), or
    for a binary target one logit per row, `[batch]` or `[batch, 1]` (the logit of
    the second class); regression needs one value per row, `[batch]` or `[batch, 1]`. Finding out after the last epoch would waste the whole trial.

    Raises:
        ConfigError: the output shape does not fit; the message says which task wants what.
    """
    task = prediction_task(spec)
    x = dm.example_input()
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            shape = tuple(model(x).shape)
    finally:
        model.train(was_training)
    batch = x.shape[0]
    where = f"model {spec.model.path!r} returns shape {list(shape)} for a batch of {batch} rows"
    if task == "regression":
        if shape not in ((batch,), (batch, 1)):
            raise ConfigError(f"{where}; task 'regression' needs one value per row, [{batch}] or [{batch}, 1] "
                              "(a classifier's logits? set the pipeline's task='classification', or give the model one output)")
        return
    classes = dm.classes()
    needed = max(2, len(classes))
    if len(classes) == 2 and shape in ((batch,), (batch, 1)):
        return  # one logit of the second class (sigmoid), e.g. trained with BCEWithLogitsLoss
    if len(shape) != 2 or shape[0] != batch or shape[1] < needed:
        raise ConfigError(f"{where}; task 'classification' with {len(classes)} classes {classes} needs n_classes logits "
                          f"[{batch}, {needed}]" + (f", or one logit for a binary target ([{batch}] or [{batch}, 1], the logit of "
                                                    f"{classes[1]!r}, e.g. trained with BCEWithLogitsLoss)" if needed == 2 else ""))


EVAL_BATCH_ROWS = 8192  # rows per forward pass of the final evaluation (bounds its activation memory)


def model_outputs(model: Any, x: Any, device: Any = None) -> torch.Tensor:
    """`model`'s outputs on features `x`, on the CPU.

    Runs on `device` (default: where `x` is) in batches of `EVAL_BATCH_ROWS`,
    in full float32 (no TF32 on CUDA), and leaves `model` where it found it.
    """
    device = torch.device(device) if device is not None else x.device
    home = next(model.parameters(), x).device
    model.eval()
    outs = []
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        model.to(device)
        with torch.no_grad():
            for start in range(0, len(x), EVAL_BATCH_ROWS):
                outs.append(model(x[start:start + EVAL_BATCH_ROWS].to(device)).cpu())
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
        model.to(home)
    return torch.cat(outs) if outs else torch.empty(0)


def _task_value(out: torch.Tensor, y: Any, task: str) -> float:
    """Accuracy (arg-max of the logits; one logit per row: above 0) or RMSE (float64) of outputs `out`."""
    if task == "regression":
        err = out.reshape(len(y)).double() - y.double()
        return float(torch.sqrt(torch.mean(err * err)))
    if out.ndim == 1 or out.shape[1] == 1:
        return float(((out.reshape(len(y)) > 0).long() == y).float().mean())
    return float((out.argmax(dim=1) == y).float().mean())


def evaluate(model: Any, x: Any, y: Any, task: str = "classification", device: Any = None) -> float:
    """`model`'s accuracy (classification, arg-max of the logits; a binary model's one logit: above 0) or RMSE (regression) on features `x` against targets `y`.

    Runs on `device` (default: where `x` is) in batches of `EVAL_BATCH_ROWS`,
    in full float32 (no TF32 on CUDA), and leaves `model` where it found it.
    RMSE is computed in float64, as the serving smoke test recomputes it from served predictions.
    """
    return _task_value(model_outputs(model, x, device), y, task)


def eval_device(spec: TrainSpec) -> torch.device:
    """Where rank 0 evaluates the trained model: the GPU it trained on, else the CPU (never a CPU pass over a GPU-sized model)."""
    if spec.distribution.accelerator == "gpu" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def export_model(model: Any, dm: Any, spec: TrainSpec, dest_uri: str) -> None:
    """Write `model.pt2` (torch.export, dynamic batch), `meta.json` and the data module's preprocessing state
    (`preprocessing.json`, when it has one) for serving."""
    model.eval()
    example = dm.example_input()
    program = torch.export.export(model, (example,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    task = prediction_task(spec)
    meta: dict[str, Any] = {"features": spec.data.features, "target": spec.data.target, "task": task, "input_dtype": "float32",
                            "keep": spec.data.keep, "feature_types": spec.data.feature_types}
    if task == "classification":
        classes = [preprocessing.label_key(c) for c in dm.classes()]
        meta["classes"] = classes
        meta["positive_label"] = classes[preprocessing.positive_index(classes, spec.data.positive_label)] if len(classes) == 2 else None
    state = getattr(dm, "preprocessing_state", None)
    files = ["model.pt2", "meta.json"]
    with tempfile.TemporaryDirectory() as tmp:
        torch.export.save(program, os.path.join(tmp, "model.pt2"))
        if state is not None:
            meta["preprocessing"] = preprocessing.STATE_FILE
            meta["inputs"] = preprocessing.output_names(state)
            with open(os.path.join(tmp, preprocessing.STATE_FILE), "w") as f:
                json.dump(state, f, indent=2, sort_keys=True)
            files.append(preprocessing.STATE_FILE)
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=2, sort_keys=True)
        fs, path = fsspec.core.url_to_fs(dest_uri)
        fs.makedirs(path, exist_ok=True)
        for name in files:
            fs.put_file(os.path.join(tmp, name), f"{path}/{name}")


def final_metrics(spec: TrainSpec, model: Any, dm: Any = None) -> dict[str, float]:
    """The platform's metrics (`training.metrics`) of `model` on the full validation and test splits, with the train
    prior's (`baseline_*`) beside them: `val_acc`, `val_logloss`, `val_roc_auc`, ... or `val_rmse`, `val_mae`, ...

    The splits are read as the data module reads them: with its preprocessing state (`preprocessing_state`) and
    its classes (`classes()`), else the raw features and the sorted labels.
    """
    task = prediction_task(spec)
    device = eval_device(spec)
    state = getattr(dm, "preprocessing_state", None)
    classes: Optional[list[Any]] = None
    if task == "classification":
        classes = list(dm.classes()) if dm is not None and hasattr(dm, "classes") else None
        if not classes:
            labels = [read_split(u, spec.data.features, spec.data.target, task, state)[1]
                      for u in (spec.data.train_uri, spec.data.val_uri, spec.data.test_uri)]
            classes = class_labels(spec.data.target, labels)
    y_train = read_split(spec.data.train_uri, spec.data.features, spec.data.target, task, state, classes)[1].numpy()
    metrics: dict[str, float] = {}
    for split, uri in (("val", spec.data.val_uri), ("test", spec.data.test_uri)):
        x, y = read_split(uri, spec.data.features, spec.data.target, task, state, classes)
        out = model_outputs(model, x, device)
        if task == "regression":
            values = platform_metrics.regression_metrics(y.numpy(), out.double().numpy().reshape(len(y)))
            baseline = platform_metrics.baseline_regression(y.numpy(), y_train)
        else:
            assert classes is not None
            positive = preprocessing.positive_index(classes, spec.data.positive_label) if len(classes) == 2 else 1
            values = platform_metrics.classification_metrics(y.numpy(), platform_metrics.probabilities(out.double().numpy(), len(classes)),
                                                             classes, positive)
            baseline = platform_metrics.baseline_classification(y.numpy(), y_train, classes, positive)
        values[EVALUATION_METRIC[task]] = _task_value(out, y, task)  # exactly as measured before the other metrics
        metrics.update(platform_metrics.split_metrics(split, values, baseline))
    return metrics
