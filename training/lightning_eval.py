"""The evaluation and export of a Lightning trial's model: the output-shape check before training, the platform's
metrics on the full validation and test splits (with the train prior's baselines), and the serving export.

A language model (task `causal_lm`) is evaluated on its data module's token batches (`evaluate_lm`), against a
unigram model of the train split, and exported with a dynamic sequence length and its tokenizer. An image
classifier streamed from shards is evaluated on its data module's batches of the whole splits, against the
prior of the train split's class counts, and exported with the image's shape and value range (`image_meta`).

Split from `training.lightning_task`, which runs the trial; this part needs the model and the splits only.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from typing import Any, Optional

import fsspec
import numpy as np
import torch
from torch.nn import functional as F

from training import metrics as platform_metrics
from training import preprocessing
from training.data import class_labels, read_split
from training.errors import ConfigError
from training.spec import TrainSpec

log = logging.getLogger("trainyard.training")
TOKENIZER_FILE = "tokenizer.json"
"""A language model's tokenizer in its exported directory (the data module's `tokenizer_path`, copied)."""

EVALUATION_METRIC = {"classification": "acc", "regression": "rmse", "causal_lm": "loss"}
"""The metric the platform measures on the full validation and test splits (`val_<m>`, `test_<m>`), per task."""


def prediction_task(spec: TrainSpec) -> str:
    """The trial's task; specs without one are classification, as every Lightning trial was before the field."""
    return spec.prediction_task or "classification"


def check_output_fits_task(model: Any, dm: Any, spec: TrainSpec) -> None:
    """One forward pass on two rows, before training: does the model's output fit the task?

    Classification needs logits `[batch, n_classes]` (at least one per class), or
    for a binary target one logit per row, `[batch]` or `[batch, 1]` (the logit of
    the second class); regression needs one value per row, `[batch]` or `[batch, 1]`. Finding out after the last epoch
    would waste the whole trial.

    Raises:
        ConfigError: the output shape does not fit; the message says which task wants what.
    """
    task = prediction_task(spec)
    x = dm.example_input()
    shape = _output_shape(model, x)
    if task == "causal_lm":
        wanted = (*x.shape, int(dm.vocab_size))
        if shape != wanted:
            raise ConfigError(
                f"model {spec.model.path!r} returns shape {list(shape)} for token ids of shape {list(x.shape)}; task "
                f"'causal_lm' needs next-token logits {list(wanted)} (batch, length, vocab_size={dm.vocab_size} of "
                "the data)"
            )
        return
    batch = x.shape[0]
    where = f"model {spec.model.path!r} returns shape {list(shape)} for a batch of {batch} rows"
    if task == "regression":
        if shape not in ((batch,), (batch, 1)):
            raise ConfigError(
                f"{where}; task 'regression' needs one value per row, [{batch}] or [{batch}, 1] "
                "(a classifier's logits? set the pipeline's task='classification', or give the model one output)"
            )
        return
    classes = dm.classes()
    needed = max(2, len(classes))
    if len(classes) == 2 and shape in ((batch,), (batch, 1)):
        return  # one logit of the second class (sigmoid), e.g. trained with BCEWithLogitsLoss
    if len(shape) != 2 or shape[0] != batch or shape[1] < needed:
        raise ConfigError(
            f"{where}; task 'classification' with {len(classes)} classes {classes} needs n_classes logits "
            f"[{batch}, {needed}]"
            + (
                f", or one logit for a binary target ([{batch}] or [{batch}, 1], the logit of "
                f"{classes[1]!r}, e.g. trained with BCEWithLogitsLoss)"
                if needed == 2
                else ""
            )
        )


def _output_shape(model: Any, x: torch.Tensor) -> tuple[int, ...]:
    """The shape of the model's output for `x`, in eval mode without gradients; the model is left as it was found."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return tuple(model(x).shape)
    finally:
        model.train(was_training)


EVAL_BATCH_ROWS = 8192  # rows per forward pass of the final evaluation (bounds its activation memory)


def model_outputs(model: Any, x: Any, device: Any = None) -> torch.Tensor:
    """`model`'s outputs on features `x`, on the CPU.

    Runs on `device` (default: where `x` is) in batches of `EVAL_BATCH_ROWS`,
    in full float32 (no TF32 on CUDA), and leaves `model` where it found it.
    """
    device = torch.device(device) if device is not None else x.device
    return batch_outputs(
        model, ((x[s : s + EVAL_BATCH_ROWS], None) for s in range(0, len(x), EVAL_BATCH_ROWS)), device
    )[0]


def batch_outputs(model: Any, batches: Any, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """`model`'s outputs on the `(x, y)` `batches` and their targets, concatenated on the CPU (targets empty when
    the batches carry None).

    Runs on `device` in full float32 (no TF32 on CUDA) with `model` in eval mode, and leaves it where it found it.
    """
    device = torch.device(device)
    home = next(model.parameters(), torch.empty(0)).device
    model.eval()
    outs, targets = [], []
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        model.to(device)
        with torch.no_grad():
            for x, y in batches:
                outs.append(model(x.to(device)).cpu())
                if y is not None:
                    targets.append(y.cpu())
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
        model.to(home)
    return (torch.cat(outs) if outs else torch.empty(0)), (
        torch.cat(targets) if targets else torch.empty(0, dtype=torch.int64)
    )


def _task_value(out: torch.Tensor, y: Any, task: str) -> float:
    """Accuracy (arg-max of the logits; one logit per row: above 0) or RMSE (float64) of outputs `out`."""
    if task == "regression":
        err = out.reshape(len(y)).double() - y.double()
        return float(torch.sqrt(torch.mean(err * err)))
    if out.ndim == 1 or out.shape[1] == 1:
        return float(((out.reshape(len(y)) > 0).long() == y).float().mean())
    return float((out.argmax(dim=1) == y).float().mean())


def evaluate(model: Any, x: Any, y: Any, task: str = "classification", device: Any = None) -> float:
    """`model`'s accuracy (classification, arg-max of the logits; a binary model's one logit: above 0) or RMSE
    (regression) on features `x` against targets `y`.

    Runs on `device` (default: where `x` is) in batches of `EVAL_BATCH_ROWS`,
    in full float32 (no TF32 on CUDA), and leaves `model` where it found it.
    RMSE is computed in float64, as the serving smoke test recomputes it from served predictions.
    """
    return _task_value(model_outputs(model, x, device), y, task)


def eval_device(spec: TrainSpec) -> torch.device:
    """Where rank 0 evaluates the trained model: the GPU it trained on, else the CPU (never a CPU pass over a GPU-sized
    model)."""
    if spec.distribution.accelerator == "gpu" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def export_model(model: Any, dm: Any, spec: TrainSpec, dest_uri: str) -> None:
    """Write `model.pt2` (torch.export, dynamic batch), `meta.json` and the data module's preprocessing state
    (`preprocessing.json`, when it has one) for serving; an image model's meta also says how a served image
    is read (`image_meta`)."""
    model.eval()
    example = dm.example_input()
    task = prediction_task(spec)
    if task == "causal_lm":
        return _export_lm(model, dm, spec, dest_uri, example)
    program = torch.export.export(
        model, (example.float().contiguous(),), dynamic_shapes=({0: torch.export.Dim("batch")},)
    )
    meta: dict[str, Any] = {
        "features": spec.data.features,
        "target": spec.data.target,
        "task": task,
        "input_dtype": "float32",
        "keep": spec.data.keep,
        "feature_types": spec.data.feature_types,
    }
    if getattr(dm, "kind", None) == "image":
        meta.update(image_meta(dm))
    if task == "classification":
        classes = [preprocessing.label_key(c) for c in dm.classes()]
        meta["classes"] = classes
        meta["positive_label"] = (
            classes[preprocessing.positive_index(classes, spec.data.positive_label)] if len(classes) == 2 else None
        )
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
        _put(tmp, files, dest_uri)


def image_meta(dm: Any) -> dict[str, Any]:
    """What serving needs to read an image as the model was trained on it (`training/serving_model.py`, `ImageInput`).

    `input_kind: "image"`; `shape` as the data has it, `[H, W]` or `[H, W, C]` (a served row of the one
    feature column, `image` for image shards, is an image's values flattened row-major in that shape);
    `input_shape` as the model gets it, `[C, H, W]`; `scale`, the `[min, max]` that
    `training.streaming.ImageCollate` maps to [0, 1] (the split meta's `min` and `max`, with the data
    module's defaults).
    """
    meta = dm.meta
    return {
        "input_kind": "image",
        "shape": [int(s) for s in meta["shape"]],
        "input_shape": [int(s) for s in dm.input_shape],
        "scale": [meta.get("min", 0), meta.get("max", 255)],
    }


def _put(tmp: str, files: list[str], dest_uri: str) -> None:
    fs, path = fsspec.core.url_to_fs(dest_uri)
    fs.makedirs(path, exist_ok=True)
    for name in files:
        fs.put_file(os.path.join(tmp, name), f"{path}/{name}")


def _export_lm(model: Any, dm: Any, spec: TrainSpec, dest_uri: str, example: torch.Tensor) -> None:
    """A language model's export: `model.pt2` (dynamic batch and length up to `block_size`), `meta.json` and the
    data module's tokenizer as `tokenizer.json` (`training/serving_model.py` serves them)."""
    block_size = int(dm.block_size)
    length = torch.export.Dim("length", max=block_size)
    program = torch.export.export(
        model, (example.long().contiguous(),), dynamic_shapes=({0: torch.export.Dim("batch"), 1: length},)
    )
    tokenizer_path = getattr(dm, "tokenizer_path", None)
    eos = getattr(dm, "eos_id", None)
    meta: dict[str, Any] = {
        "features": spec.data.features,
        "target": spec.data.target,
        "task": "causal_lm",
        "input_dtype": "int64",
        "keep": [],
        "vocab_size": int(dm.vocab_size),
        "block_size": block_size,
        "eos_id": None if eos is None else int(eos),
        "tokenizer": TOKENIZER_FILE if tokenizer_path else None,
    }
    files = ["model.pt2", "meta.json"]
    with tempfile.TemporaryDirectory() as tmp:
        torch.export.save(program, os.path.join(tmp, "model.pt2"))
        if tokenizer_path:
            with fsspec.open(str(tokenizer_path), "rb") as src, open(os.path.join(tmp, TOKENIZER_FILE), "wb") as dst:
                dst.write(src.read())
            files.append(TOKENIZER_FILE)
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=2, sort_keys=True)
        _put(tmp, files, dest_uri)


def final_metrics(spec: TrainSpec, model: Any, dm: Any = None) -> dict[str, float]:
    """The platform's metrics (`training.metrics`) of `model` on the full validation and test splits, with the train
    prior's (`baseline_*`) beside them: `val_acc`, `val_logloss`, `val_roc_auc`, ... or `val_rmse`, `val_mae`, ...

    The splits are read as the data module reads them: with its preprocessing state (`preprocessing_state`) and
    its classes (`classes()`), else the raw features and the sorted labels. A classifier whose data module
    streams its splits (it has `eval_dataloader`, as `training.streaming.StreamingShardDataModule` does) is
    evaluated on the data module's own batches of each whole split (`split_batches`), against the prior of its
    `class_counts()`.
    """
    task = prediction_task(spec)
    device = eval_device(spec)
    if task == "causal_lm":
        return lm_metrics(model, dm, device)
    if task == "classification" and hasattr(dm, "eval_dataloader"):
        return streamed_classification_metrics(spec, model, dm, device)
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
            values[EVALUATION_METRIC[task]] = _task_value(out, y, task)  # exactly as measured before the other metrics
            metrics.update(platform_metrics.split_metrics(split, values, baseline))
        else:
            assert classes is not None
            metrics.update(_classification_split(split, out, y, classes, y_train, spec))
    return metrics


def _classification_split(split: str, out: torch.Tensor, y: torch.Tensor, classes: list[Any], y_train: np.ndarray,
                          spec: TrainSpec) -> dict[str, float]:
    """`<split>_*` classification metrics of outputs `out` against class indices `y`, and the train prior's
    `baseline_<split>_*`."""
    positive = preprocessing.positive_index(classes, spec.data.positive_label) if len(classes) == 2 else 1
    values = platform_metrics.classification_metrics(
        y.numpy(), platform_metrics.probabilities(out.double().numpy(), len(classes)), classes, positive
    )
    baseline = platform_metrics.baseline_classification(y.numpy(), y_train, classes, positive)
    values[EVALUATION_METRIC["classification"]] = _task_value(
        out, y, "classification"
    )  # exactly as measured before the other metrics
    return platform_metrics.split_metrics(split, values, baseline)


def streamed_classification_metrics(spec: TrainSpec, model: Any, dm: Any, device: Any = None) -> dict[str, float]:
    """`final_metrics` of a classifier on a data module that streams its splits: each whole split read by
    `split_batches` on this process (rank 0), the baseline the prior of the train split's `dm.class_counts()`.

    Raises:
        ConfigError: the data module has no classes, or a split holds no sample.
    """
    classes = [preprocessing.label_key(c) for c in dm.classes()]
    if not classes:
        raise ConfigError(
            f"data module {type(dm).__name__} streams its splits but names no classes (classes() is empty)"
        )
    counts = np.asarray(dm.class_counts(), dtype=np.int64)
    if len(counts) != len(classes):
        raise ConfigError(f"class_counts() has {len(counts)} entries for {len(classes)} classes {classes}")
    y_train = np.repeat(np.arange(len(classes)), counts)  # the prior's labels: only their frequencies matter
    metrics: dict[str, float] = {}
    for split in ("val", "test"):
        out, y = batch_outputs(model, split_batches(dm, split), device or torch.device("cpu"))
        if not len(y):
            raise ConfigError(
                f"the {split} split of data module {type(dm).__name__} holds no sample to evaluate the model on"
            )
        metrics.update(_classification_split(split, out, y.long(), classes, y_train, spec))
    return metrics


def split_batches(dm: Any, split: str) -> Any:
    """The whole `split` (`val` or `test`) of a streaming data module (text or images), as `(x, y)` batches, on rank 0
    alone.

    A data module that shards by rank says how to read a split whole with `eval_dataloader(split)`;
    otherwise its `<split>_dataloader()` is read as it is (unsharded outside `trainer.validate`/`test`).
    """
    if hasattr(dm, "eval_dataloader"):
        return dm.eval_dataloader(split)
    return getattr(dm, f"{split}_dataloader")()


def evaluate_lm(model: Any, batches: Any, device: Any = None, counts: Optional[np.ndarray] = None) -> dict[str, float]:
    """A language model's summed next-token loss over `batches` and its number of tokens, in float64.

    Returns `{"nll": summed loss (nats), "tokens": n}` and, with unigram `counts` of the train split,
    `"baseline_nll"`: the summed loss of the add-one smoothed unigram model on the same target tokens.
    The model is left where and how it was found.
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    home = next(model.parameters()).device
    was_training = model.training
    unigram = None
    if counts is not None:
        smoothed = torch.as_tensor(np.asarray(counts, dtype=np.float64) + 1.0)
        unigram = -torch.log(smoothed / smoothed.sum())
    nll, tokens, baseline = 0.0, 0, 0.0
    model.eval()
    try:
        model.to(device)
        with torch.no_grad():
            for x, y in batches:
                logits = model(x.to(device))
                losses = F.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]).float(), y.to(device).reshape(-1).long(), reduction="none"
                )
                nll += float(losses.double().sum())
                tokens += y.numel()
                if unigram is not None:
                    baseline += float(unigram[y.reshape(-1).long().cpu()].sum())
    finally:
        model.to(home)
        model.train(was_training)
    out = {"nll": nll, "tokens": float(tokens)}
    if unigram is not None:
        out["baseline_nll"] = baseline
    return out


def lm_metrics(model: Any, dm: Any, device: Any = None) -> dict[str, float]:
    """`val_loss`, `val_perplexity`, `test_loss`, `test_perplexity` of a language model on the whole splits
    (token-weighted
    mean next-token cross-entropy in nats, and its exp), with `baseline_<split>_loss` / `_perplexity` of the add-one
    smoothed unigram model of the train split's token counts (`dm.train_token_counts()`; left out, with a warning,
    when the data module has none)."""
    counts = dm.train_token_counts() if hasattr(dm, "train_token_counts") else None
    if counts is None:
        log.warning("no baseline_*_perplexity: data module %s gives no train_token_counts()", type(dm).__name__)
    elif len(counts) != int(dm.vocab_size):
        raise ConfigError(f"train_token_counts() has {len(counts)} entries for a vocabulary of {dm.vocab_size}")
    metrics: dict[str, float] = {}
    for split in ("val", "test"):
        sums = evaluate_lm(model, split_batches(dm, split), device, counts)
        if not sums["tokens"]:
            raise ConfigError(
                f"the {split} split of data module {type(dm).__name__} holds no tokens to evaluate the model on"
            )
        loss = sums["nll"] / sums["tokens"]
        values = {"loss": loss, "perplexity": math.exp(loss)}
        baseline = None
        if "baseline_nll" in sums:
            base = sums["baseline_nll"] / sums["tokens"]
            baseline = {"loss": base, "perplexity": math.exp(base)}
        metrics.update(platform_metrics.split_metrics(split, values, baseline))
    return metrics
