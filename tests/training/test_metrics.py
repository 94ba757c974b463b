"""The platform's metrics (`training.metrics`) against scikit-learn's, and the trivial baselines."""

from __future__ import annotations

import numpy as np
import pytest

from training import metrics

sk = pytest.importorskip("sklearn.metrics")


def rare_positives(n: int = 600, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = (rng.random(n) < 0.06).astype("int64")
    p1 = np.clip(0.3 * y + rng.random(n) * 0.7, 0, 1).round(2)  # rounded: many tied scores
    return y, np.column_stack([1 - p1, p1])


def test_binary_metrics_equal_sklearn() -> None:
    y, proba = rare_positives()
    got = metrics.classification_metrics(y, proba, ["no", "yes"], positive=1)
    pred = proba.argmax(axis=1)
    assert got["acc"] == pytest.approx(sk.accuracy_score(y, pred))
    assert got["logloss"] == pytest.approx(sk.log_loss(y, proba[:, 1]))
    assert got["roc_auc"] == pytest.approx(sk.roc_auc_score(y, proba[:, 1]))
    assert got["pr_auc"] == pytest.approx(sk.average_precision_score(y, proba[:, 1]))
    assert got["f1"] == pytest.approx(sk.f1_score(y, pred, zero_division=0))
    assert got["balanced_acc"] == pytest.approx(sk.balanced_accuracy_score(y, pred))
    assert got["precision/yes"] == pytest.approx(sk.precision_score(y, pred, zero_division=0))
    assert got["recall/no"] == pytest.approx(sk.recall_score(y, pred, pos_label=0))


def test_the_positive_class_can_be_the_first_label() -> None:
    y, proba = rare_positives()
    got = metrics.classification_metrics(y, proba, ["no", "yes"], positive=0)
    assert got["pr_auc"] == pytest.approx(sk.average_precision_score(y == 0, proba[:, 0]))
    assert got["f1"] == pytest.approx(sk.f1_score(y, proba.argmax(axis=1), pos_label=0))


def test_multiclass_metrics_are_macro_averages() -> None:
    rng = np.random.default_rng(3)
    y = rng.integers(0, 3, size=300)
    logits = rng.normal(size=(300, 3)) + 1.5 * np.eye(3)[y]
    proba = metrics.probabilities(logits, 3)
    got = metrics.classification_metrics(y, proba, [0, 1, 2])
    pred = proba.argmax(axis=1)
    assert got["roc_auc"] == pytest.approx(sk.roc_auc_score(y, proba, multi_class="ovr", average="macro"))
    assert got["f1"] == pytest.approx(sk.f1_score(y, pred, average="macro"))
    assert got["logloss"] == pytest.approx(sk.log_loss(y, proba))
    assert got["balanced_acc"] == pytest.approx(sk.balanced_accuracy_score(y, pred))
    aps = [sk.average_precision_score(y == k, proba[:, k]) for k in range(3)]
    assert got["pr_auc"] == pytest.approx(np.mean(aps))


def test_the_baseline_answers_the_train_prior() -> None:
    y, _ = rare_positives()
    y_train = np.array([0] * 94 + [1] * 6)
    base = metrics.baseline_classification(y, y_train, ["no", "yes"])
    assert base["acc"] == pytest.approx(np.mean(y == 0))  # always the majority label
    assert base["roc_auc"] == 0.5 and base["pr_auc"] == pytest.approx(y.mean())  # a constant score
    assert base["f1"] == 0.0 and base["balanced_acc"] == 0.5 and base["recall/yes"] == 0.0
    assert base["logloss"] == pytest.approx(sk.log_loss(y, np.full(len(y), 0.06)))


def test_undefined_metrics_are_left_out() -> None:
    got = metrics.classification_metrics(np.array([0, 0]), np.array([[0.9, 0.1], [0.8, 0.2]]), ["no", "yes"])
    assert "roc_auc" not in got and "pr_auc" not in got and got["acc"] == 1.0


def test_one_logit_is_a_sigmoid_and_regression_metrics() -> None:
    proba = metrics.probabilities(np.array([0.0, 2.0]), 2)
    np.testing.assert_allclose(proba[:, 1], [0.5, 1 / (1 + np.exp(-2.0))])
    got = metrics.regression_metrics(np.array([1.0, 3.0]), np.array([2.0, 1.0]))
    assert got == {"rmse": pytest.approx(np.sqrt(2.5)), "mae": 1.5}
    assert metrics.baseline_regression(np.array([1.0, 3.0]), np.array([2.0, 2.0, 5.0]))["mae"] == pytest.approx(1.0)
