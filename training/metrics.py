"""The platform's evaluation metrics, numpy only, and the trivial baseline beside each.

Classification (`classification_metrics`), from class probabilities `[n, K]`:
`acc`, `logloss`, `roc_auc`, `pr_auc` (average precision), `f1`, `balanced_acc`,
and per class `precision/<label>`, `recall/<label>`. A binary target's `roc_auc`,
`pr_auc` and `f1` are those of the positive class (`DataSpec.positive_label`,
else the second of the sorted labels); with more classes they are macro averages
(one-vs-rest). A metric undefined on the split (AUC with one class present) is
left out. The baseline (`baseline_metrics`) answers the train split's class
prior for every row: majority label, prior probabilities (its AUC is 0.5, its
PR-AUC the split's positive rate).

Regression (`regression_metrics`): `rmse`, `mae`; the baseline predicts the
train mean.

Keys carry no split; callers prefix them (`val_roc_auc`, `baseline_test_pr_auc`).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

CLASSIFICATION = ("acc", "logloss", "roc_auc", "pr_auc", "f1", "balanced_acc")
REGRESSION = ("rmse", "mae")
HIGHER_IS_BETTER = {"acc": True, "logloss": False, "roc_auc": True, "pr_auc": True, "f1": True, "balanced_acc": True,
                    "rmse": False, "mae": False}
EPS = 1e-15


def _rank(scores: np.ndarray) -> np.ndarray:
    """1-based ranks, ties averaged."""
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores), dtype="float64")
    sorted_scores = scores[order]
    boundaries = np.flatnonzero(np.diff(sorted_scores)) + 1
    starts = np.concatenate([[0], boundaries])
    ends = np.concatenate([boundaries, [len(scores)]])
    for s, e in zip(starts, ends):
        ranks[order[s:e]] = (s + e + 1) / 2.0
    return ranks


def roc_auc(positive: np.ndarray, scores: np.ndarray) -> Optional[float]:
    """Area under the ROC curve (Mann-Whitney, ties counted half); None with one class present."""
    positive = np.asarray(positive, dtype=bool)
    n_pos = int(positive.sum())
    n_neg = len(positive) - n_pos
    if n_pos == 0 or n_neg == 0:
        return None
    ranks = _rank(np.asarray(scores, dtype="float64"))
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def average_precision(positive: np.ndarray, scores: np.ndarray) -> Optional[float]:
    """Average precision (sklearn's step-wise PR-AUC, tied scores one threshold); None without positives."""
    positive = np.asarray(positive, dtype=bool)
    n_pos = int(positive.sum())
    if n_pos == 0:
        return None
    scores = np.asarray(scores, dtype="float64")
    order = np.argsort(-scores, kind="mergesort")
    s, p = scores[order], positive[order]
    last = np.concatenate([np.flatnonzero(np.diff(s)), [len(s) - 1]])  # the last row of each distinct threshold
    tp = np.cumsum(p)[last]
    fp = (last + 1) - tp
    precision = tp / (tp + fp)
    recall = tp / n_pos
    recall_prev = np.concatenate([[0.0], recall[:-1]])
    return float(np.sum((recall - recall_prev) * precision))


def _precision_recall(y: np.ndarray, pred: np.ndarray, k: int) -> tuple[float, float]:
    predicted = pred == k
    actual = y == k
    tp = float(np.sum(predicted & actual))
    precision = tp / predicted.sum() if predicted.sum() else 0.0
    recall = tp / actual.sum() if actual.sum() else 0.0
    return float(precision), float(recall)


def _f1(precision: float, recall: float) -> float:
    return 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0


def predicted_labels(proba: np.ndarray) -> np.ndarray:
    """The arg-max class of each row (binary: class 1 when its probability is above 0.5)."""
    return proba.argmax(axis=1)


def logloss(y: np.ndarray, proba: np.ndarray) -> float:
    """Mean negative log-probability of the true class (probabilities clipped at 1e-15)."""
    p = proba[np.arange(len(y)), y]
    return float(-np.log(np.clip(p, EPS, 1.0)).mean())


def classification_metrics(y: np.ndarray, proba: np.ndarray, classes: list[Any], positive: int = 1,
                           labels: Optional[np.ndarray] = None) -> dict[str, float]:
    """The classification metrics of probabilities `proba` `[n, K]` against class indices `y`.

    `labels`: the predicted classes when the caller decides them (default: arg-max of `proba`).
    """
    y = np.asarray(y, dtype="int64")
    proba = np.asarray(proba, dtype="float64")
    k = len(classes)
    if proba.ndim != 2 or proba.shape[1] != k:
        raise ValueError(f"probabilities of shape {proba.shape} for {k} classes; expected [n, {k}]")
    if len(y) == 0:
        return {}
    pred = predicted_labels(proba) if labels is None else np.asarray(labels, dtype="int64")
    out: dict[str, float] = {"acc": float((pred == y).mean()), "logloss": logloss(y, proba)}
    per_class = [_precision_recall(y, pred, c) for c in range(k)]
    recalls_present = [per_class[c][1] for c in range(k) if np.any(y == c)]
    out["balanced_acc"] = float(np.mean(recalls_present)) if recalls_present else 0.0
    if k == 2:
        out["f1"] = _f1(*per_class[positive])
        auc = roc_auc(y == positive, proba[:, positive])
        ap = average_precision(y == positive, proba[:, positive])
    else:
        out["f1"] = float(np.mean([_f1(*pr) for pr in per_class]))
        aucs = [roc_auc(y == c, proba[:, c]) for c in range(k)]
        aps = [average_precision(y == c, proba[:, c]) for c in range(k)]
        auc = float(np.mean([a for a in aucs if a is not None])) if any(a is not None for a in aucs) else None
        ap = float(np.mean([a for a in aps if a is not None])) if any(a is not None for a in aps) else None
    if auc is not None:
        out["roc_auc"] = auc
    if ap is not None:
        out["pr_auc"] = ap
    for c, label in enumerate(classes):
        out[f"precision/{label}"], out[f"recall/{label}"] = per_class[c]
    return out


def class_prior(y_train: np.ndarray, n_classes: int) -> np.ndarray:
    """The train split's class frequencies."""
    counts = np.bincount(np.asarray(y_train, dtype="int64"), minlength=n_classes).astype("float64")
    return counts / counts.sum() if counts.sum() else np.full(n_classes, 1.0 / n_classes)


def baseline_classification(
    y: np.ndarray, y_train: np.ndarray, classes: list[Any], positive: int = 1
) -> dict[str, float]:
    """The metrics of answering the train prior for every row (the majority label, prior probabilities)."""
    prior = class_prior(y_train, len(classes))
    proba = np.tile(prior, (len(y), 1))
    labels = np.full(len(y), int(np.argmax(prior)), dtype="int64")
    return classification_metrics(y, proba, classes, positive, labels=labels)


def regression_metrics(y: np.ndarray, pred: np.ndarray) -> dict[str, float]:
    """`rmse` and `mae` (float64)."""
    err = np.asarray(pred, dtype="float64").reshape(len(y)) - np.asarray(y, dtype="float64")
    if len(err) == 0:
        return {}
    return {"rmse": float(math.sqrt(np.mean(err ** 2))), "mae": float(np.mean(np.abs(err)))}


def baseline_regression(y: np.ndarray, y_train: np.ndarray) -> dict[str, float]:
    """The metrics of predicting the train mean for every row."""
    return regression_metrics(y, np.full(len(y), float(np.mean(np.asarray(y_train, dtype="float64")))))


def split_metrics(
    split: str, values: dict[str, float], baseline: Optional[dict[str, float]] = None
) -> dict[str, float]:
    """`values` (and `baseline`) keyed `{split}_<name>` and `baseline_{split}_<name>`."""
    out = {f"{split}_{k}": v for k, v in values.items()}
    out.update({f"baseline_{split}_{k}": v for k, v in (baseline or {}).items()})
    return out


def probabilities(output: np.ndarray, n_classes: int) -> np.ndarray:
    """Class probabilities `[n, K]` from a model's output: one value per row for two classes is the
    logit of class 1 (sigmoid); `[n, K]` are logits (softmax)."""
    out = np.asarray(output, dtype="float64")
    if n_classes == 2 and (out.ndim == 1 or (out.ndim == 2 and out.shape[1] == 1)):
        p1 = 1.0 / (1.0 + np.exp(-out.reshape(-1)))
        return np.column_stack([1.0 - p1, p1])
    out = out - out.max(axis=1, keepdims=True)
    e = np.exp(out)
    return e / e.sum(axis=1, keepdims=True)
