"""Metrics from a served model's predictions: the smoke test's and the champion's re-evaluation.

A served model's `predict` (`training/serving_model.py`) returns a DataFrame:
the kept id/timestamp columns present in the input, `<target>` (the label or
value), and for a classification one `proba_<label>` column per class, in the
model's class order. Versions registered before return one label or value per
row (a Series or an array); the smoke test's process sends a DataFrame back as
one `{column: value}` dict per row (`resources/registry/smoke.py`).

A language model (task `causal_lm`) is asked with `params={"output": "token_nll"}`
(`LM_PARAMS`): it serves each row's mean next-token negative log-likelihood, and
the "labels" of its rows are the number of tokens each row predicts, so
`test_loss` is their token-weighted mean and `test_perplexity` its exp, as the
pod computes them.

`served_output` reads any of these forms; `served_metric` computes a test
metric from it with the pod's own code (`training.metrics`, numpy only), so a
served value equals the training-side one and the champion's re-evaluation is
measured exactly as the candidate was. Every `test_*` metric of
`trainyard.tasks.TASKS` can be computed this way (`SERVED_METRICS`); the
probability metrics need a version that serves probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from training import metrics as pod_metrics
from trainyard.tasks import TASKS

PROBA_PREFIX = "proba_"
"""A served class probability column: `proba_<label>`."""

SERVED_METRICS: tuple[str, ...] = tuple(
    dict.fromkeys(m for p in TASKS.values() for ms in p.evaluated.values() for m in ms)
)
"""Test metrics computed from served predictions: every promotion metric a task accepts (`test_acc` first)."""

LM_PARAMS: dict[str, str] = {"output": "token_nll"}
"""The predict params under which a served language model answers each row's mean next-token loss."""
LM_METRICS = ("loss", "perplexity")
"""Language-model metrics computed from served per-row losses weighted by each row's predicted tokens."""

LABEL_METRICS = ("acc", "rmse", "mae")
"""Metrics that need only the served labels or values (computable for versions that serve no probabilities)."""


@dataclass(frozen=True)
class ServedOutput:
    """What a served model answered for a set of rows.

    Attributes:
        values: The label (classification) or value (regression) of each row.
        classes: The probability columns' labels, in the model's class order (empty: no probabilities served).
        proba: Probabilities `[n, len(classes)]`, or None.
    """

    values: list[Any]
    classes: tuple[str, ...] = ()
    proba: Optional[np.ndarray] = None


def served_output(
    output: Any, target: Optional[str] = None, probabilities: Optional[Mapping[str, Sequence[float]]] = None
) -> ServedOutput:
    """The labels (or values) and class probabilities of a served `predict` output.

    Args:
        output: A pandas DataFrame (the current serving output), a list of
            `{column: value}` dicts (the same, as the smoke test's process sends
            it), or one label or value per row (a Series, an array or a list:
            versions registered before the DataFrame output).
        target: The target column's name; when absent from the output, the last
            column that is not a probability is taken.
        probabilities: The `proba_<label>` columns served beside labels given
            as a list (`SmokeResult.probabilities`), `{column: [p, ...]}`.

    Raises:
        ValueError: A row dict or DataFrame without a label column.
    """
    columns = getattr(output, "columns", None)
    if columns is not None:  # a DataFrame
        names = [str(c) for c in columns]
        rows_by_column = {str(c): output[c].tolist() for c in columns}
        return _from_columns(names, rows_by_column, target)
    rows = list(output.tolist() if hasattr(output, "tolist") else output)
    if rows and isinstance(rows[0], dict):
        names = list(rows[0])
        return _from_columns(names, {c: [r.get(c) for r in rows] for c in names}, target)
    if probabilities:
        label = target or "label"
        return _from_columns(
            [label, *probabilities], {label: rows, **{str(c): list(v) for c, v in probabilities.items()}}, label
        )
    return ServedOutput(values=rows)


def _from_columns(names: list[str], by_column: dict[str, list[Any]], target: Optional[str]) -> ServedOutput:
    probas = [c for c in names if c.startswith(PROBA_PREFIX)]
    label = (
        target if target in by_column else next((c for c in reversed(names) if not c.startswith(PROBA_PREFIX)), None)
    )
    if label is None:
        raise ValueError(f"the served output has no label column (columns {names})")
    proba = np.column_stack([np.asarray(by_column[c], dtype="float64") for c in probas]) if probas else None
    return ServedOutput(
        values=list(by_column[label]), classes=tuple(c[len(PROBA_PREFIX) :] for c in probas), proba=proba
    )


def lm_metric(metric: str, losses: Any, tokens: Sequence[Any]) -> float:
    """`loss` (token-weighted mean of served per-row losses, nats) or `perplexity` (its exp).

    Raises:
        ValueError: no rows, a count mismatch, a row that predicts no token, or a loss that is not finite.
    """
    nll = np.asarray(losses, dtype="float64").reshape(-1)
    weights = np.asarray(tokens, dtype="float64").reshape(-1)
    if not len(weights) or len(nll) != len(weights):
        raise ValueError(f"{len(nll)} served losses for {len(weights)} rows")
    if (weights <= 0).any():
        raise ValueError("a row predicts no token (each needs at least 2 tokens)")
    if not np.isfinite(nll).all():
        raise ValueError("the served losses are not all finite")
    loss = float((nll * weights).sum() / weights.sum())
    return loss if metric == "loss" else float(np.exp(loss))


def served_metric(name: str, predictions: Any, labels: Sequence[Any], *, target: Optional[str] = None,
                  positive_label: Any = None, probabilities: Optional[Mapping[str, Sequence[float]]] = None) -> float:
    """A `test_*` (or `val_*`) metric of served predictions against the true labels.

    Args:
        name: E.g. `test_acc`, `test_pr_auc`, `test_rmse`.
        predictions: The served output, in any form `served_output` reads.
        labels: The true labels or values, in row order.
        target: The target column of the served DataFrame.
        positive_label: A binary target's positive class (`PipelineSpec.positive_label`);
            None: the second of the model's classes (the second of the sorted labels).
        probabilities: The served probability columns when `predictions` holds labels only (the smoke test's).

    Raises:
        ValueError: Another metric, no rows, a count mismatch, a probability
            metric of a version that serves no probabilities, a true label the
            model has no class for, or a metric undefined on these rows (an AUC
            with one class present).
    """
    metric = name.split("_", 1)[1] if name.startswith(("test_", "val_")) else name
    if metric in LM_METRICS:
        return lm_metric(metric, predictions, labels)
    served = served_output(predictions, target, probabilities)
    values = served.values
    if not labels or len(values) != len(labels):
        raise ValueError(f"{len(values)} predictions for {len(labels)} labels")
    if metric in pod_metrics.REGRESSION:
        return float(
            pod_metrics.regression_metrics(np.asarray(labels, dtype="float64"), np.asarray(values, dtype="float64"))[
                metric
            ]
        )
    if metric not in pod_metrics.CLASSIFICATION:
        raise ValueError(f"metric {name!r} cannot be recomputed from predictions; use one of {list(SERVED_METRICS)}")
    if served.proba is None:
        if metric == "acc":
            return sum(1 for p, y in zip(values, labels) if p == y) / len(labels)
        raise ValueError(f"{name} needs class probabilities, and this version serves labels only (registered before "
                         f"the served model returned proba_<label> columns)")
    index = {c: i for i, c in enumerate(served.classes)}
    unknown = sorted({str(y) for y in labels} - set(index))
    if unknown:
        raise ValueError(
            f"the served model has no class for the true label(s) {unknown[:5]} (its classes: {list(served.classes)})"
        )
    served_unknown = sorted({str(p) for p in values} - set(index))
    if served_unknown:
        raise ValueError(
            f"the served labels {served_unknown[:5]} are not among its probability columns {list(served.classes)}"
        )
    y = np.asarray([index[str(v)] for v in labels], dtype="int64")
    predicted = np.asarray([index[str(v)] for v in values], dtype="int64")
    positive = index.get(str(positive_label), 1) if positive_label is not None else 1
    computed = pod_metrics.classification_metrics(y, served.proba, list(served.classes), positive, labels=predicted)
    if metric not in computed:
        raise ValueError(f"{name} is undefined on these {len(labels)} rows (one class present)")
    return float(computed[metric])
