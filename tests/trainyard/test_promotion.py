"""The promotion policy as plain functions: every check, the decision record and the champion history, exact values."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pydantic
import pytest

from trainyard.promotion import (
    ChampionScore,
    Check,
    Decision,
    PromotionError,
    ValidationEvidence,
    check_beats_baseline,
    check_beats_champion,
    check_smoke,
    check_threshold,
    comparable_value,
    evaluate_policy,
    evidence_from_check,
    is_quarantined,
    lock_seconds,
    next_history,
    parse_history,
    recorded_metrics,
    recorded_policy,
    rollback_target,
    served_metric,
    served_output,
    summarize,
    validation_now,
)
from trainyard.spec import PromotionSpec
from trainyard.store import Store

MAX = PromotionSpec(metric="test_acc", mode="max", min_improvement=0.01, threshold=0.8)
MIN = PromotionSpec(metric="test_rmse", mode="min", threshold=2.0)
PASSED = ValidationEvidence(True, "expectations check passed: 12 expectations, 0 failed", "md5a", 12, 0, 0.0, "run1")
SPLIT = "md5a-fp1"


def smoke(predictions: dict[str, list], *, run_id: str | None = "r1", error: str | None = None) -> Any:
    """What a serving process reports (the fields of `resources.registry.SmokeResult`)."""
    return SimpleNamespace(model_uri="models:/m@challenger", run_id=run_id, predictions=predictions, load_seconds=1.5,
                           seconds=4.25, blocked_imports=(), error=error, passed=error is None)


# -- threshold -------------------------------------------------------------------


def test_threshold_max_mode() -> None:
    assert check_threshold(MAX, 0.8) == Check("threshold", True, "test_acc=0.8000 meets threshold >= 0.8")
    assert check_threshold(MAX, 0.79) == Check("threshold", False, "test_acc=0.7900 misses threshold >= 0.8")


def test_threshold_min_mode_and_absent() -> None:
    assert check_threshold(MIN, 2.0) == Check("threshold", True, "test_rmse=2.0000 meets threshold <= 2.0")
    assert check_threshold(MIN, 2.5).passed is False
    assert check_threshold(PromotionSpec(), 0.1) == Check(
        "threshold", True, "test_acc=0.1000; no absolute threshold declared"
    )
    assert check_threshold(MAX, None) == Check("threshold", False, "test_acc was not measured for this version")
    assert check_threshold(MAX, float("nan")).passed is False


# -- relative to the champion ----------------------------------------------------------


def test_beats_champion_needs_more_than_min_improvement() -> None:
    champion = ChampionScore("3", 0.90, "recorded on this split")
    ok = check_beats_champion(MAX, 0.92, champion, SPLIT)
    assert ok == Check(
        "beats_champion",
        True,
        "test_acc=0.9200 beats champion v3 (0.9000, recorded on this split) by more than 0.01 (max) on test split "
        "md5a-fp1",
    )
    assert check_beats_champion(MAX, 0.91, champion, SPLIT).passed is False  # exactly the margin is not enough
    assert check_beats_champion(MAX, 0.95, champion, SPLIT).passed is True
    # equal scores never replace the champion, even without a margin
    assert check_beats_champion(PromotionSpec(), 0.90, champion, SPLIT).passed is False


def test_beats_champion_min_mode() -> None:
    champion = ChampionScore("1", 1.5, "re-evaluated on this split")
    assert check_beats_champion(MIN, 1.4, champion, SPLIT).passed is True
    assert check_beats_champion(MIN, 1.5, champion, SPLIT).passed is False


def test_beats_champion_without_champion_or_comparable_score() -> None:
    assert check_beats_champion(MAX, 0.5, None, SPLIT) == Check(
        "beats_champion", True, "no champion yet: the first version that passes becomes champion"
    )
    unusable = ChampionScore("2", None, "it was measured on split x and no test data is available")
    assert check_beats_champion(MAX, 0.99, unusable, SPLIT) == Check(
        "beats_champion",
        False,
        "champion v2 cannot be compared: it was measured on split x and no test data is available",
    )


def test_a_tie_between_float32_training_side_and_float64_served_scores_keeps_the_champion() -> None:
    # Both models get 589 of 600 test rows right. The candidate's training-side test_acc is a float32,
    # the champion's is re-evaluated from served predictions in float64: compared as they come, the tie
    # "beats champion v1 (0.9817) by more than 0.0". Both sides must come from the same code.
    import numpy as np

    policy = PromotionSpec(metric="test_acc", mode="max")
    served_champion = 589 / 600
    champion = ChampionScore("1", served_champion, "re-evaluated on this split", served=True)
    training_side = float(np.float32(589) / np.float32(600))
    assert training_side > served_champion  # the trap: one float32 rounding step above
    assert check_beats_champion(policy, training_side, champion, SPLIT).passed is True
    evidence = {"served_metric": "test_acc", "served_value": 589 / 600, "training_value": training_side}
    compared, how = comparable_value(policy, training_side, champion, evidence)
    assert (compared, how) == (589 / 600, "served")
    checks = evaluate_policy(policy, value=training_side, compared=compared, champion=champion, split_id=SPLIT,
                             validation=PASSED, smoke=Check("serving_smoke_test", True, "ok"))
    beats = next(c for c in checks if c.name == "beats_champion")
    assert beats.passed is False and "does not beat champion v1" in beats.detail


def test_comparable_value_uses_recorded_scores_against_a_recorded_champion() -> None:
    recorded = ChampionScore("1", 0.9, "recorded on this split")
    assert comparable_value(MAX, 0.95, recorded, {"served_metric": "test_acc", "served_value": 0.5}) == (
        0.95,
        "recorded",
    )
    assert comparable_value(MAX, 0.95, None, {}) == (0.95, "recorded")
    served = ChampionScore("1", 0.9, "re-evaluated on this split", served=True)
    assert comparable_value(MAX, 0.95, served, {"passed": False}) == (None, "served")
    checks = evaluate_policy(MAX, value=0.95, compared=None, champion=served, split_id=SPLIT, validation=PASSED,
                             smoke=Check("serving_smoke_test", False, "did not run"))
    beats = next(c for c in checks if c.name == "beats_champion")
    assert (
        not beats.passed
        and beats.detail == "test_acc was not measured from served predictions, as the champion's was for this version"
    )


# -- serving smoke test -----------------------------------------------------------------


def test_smoke_passes_when_serving_reproduces_training() -> None:
    result = smoke({"input_example": [1, 2], "test": [1, 2, 2, 1]})
    check, evidence = check_smoke(
        MAX, result, run_id="r1", test_labels=[1, 2, 2, 2], training_metrics={"test_acc": 0.75}
    )
    assert check == Check(
        "serving_smoke_test",
        True,
        "loaded models:/m@challenger in a serving-only process (4.2s), predicted the input example and 4 test rows "
        "(served test_acc 0.750000, training-side 0.750000)",
    )
    assert evidence == {
        "model_uri": "models:/m@challenger", "seconds": 4.25, "load_seconds": 1.5, "blocked_imports": [],
        "input_example_predictions": [1, 2], "test_rows": 4, "served_metric": "test_acc", "served_value": 0.75,
        "training_value": 0.75, "passed": True,
    }


def test_smoke_fails_when_served_accuracy_differs_from_training() -> None:
    result = smoke({"input_example": [1], "test": [1, 2, 2, 1]})
    check, evidence = check_smoke(
        MAX, result, run_id="r1", test_labels=[1, 2, 2, 2], training_metrics={"test_acc": 0.8}
    )
    assert not check.passed
    assert check.detail == (
        "served test_acc 0.750000 differs from the training-side 0.800000 by more than 1e-06: "
        "serving does not reproduce the evaluated model"
    )
    assert evidence["passed"] is False and evidence["served_value"] == 0.75


def test_smoke_recomputes_rmse_for_regression() -> None:
    result = smoke({"input_example": [0.5], "test": [1.0, 2.0, 4.0]})
    check, evidence = check_smoke(MIN, result, run_id="r1", test_labels=[1.0, 2.0, 2.0],
                                  training_metrics={"test_rmse": 2 / 3 ** 0.5})
    assert check.passed, check.detail
    assert evidence["served_metric"] == "test_rmse" and evidence["served_value"] == pytest.approx(1.1547005383792515)
    check, _ = check_smoke(MIN, result, run_id="r1", test_labels=[1.0, 2.0, 2.0], training_metrics={"test_rmse": 1.0})
    assert not check.passed and check.detail.startswith(
        "served test_rmse 1.154701 differs from the training-side 1.000000"
    )


def test_smoke_fails_on_process_error_wrong_model_or_missing_rows() -> None:
    failed = smoke({}, run_id=None, error="ModuleNotFoundError: No module named 'torch'")
    assert check_smoke(MAX, failed, run_id="r1", test_labels=None, training_metrics={})[0] == Check(
        "serving_smoke_test", False,
        "serving process failed on models:/m@challenger: ModuleNotFoundError: No module named 'torch'",
    )
    other = smoke({"input_example": [1]}, run_id="r9")
    assert check_smoke(MAX, other, run_id="r1", test_labels=None, training_metrics={})[0].detail == (
        "models:/m@challenger resolved to run r9, not this version's run r1"
    )
    short = smoke({"input_example": [1], "test": [1]})
    assert check_smoke(MAX, short, run_id="r1", test_labels=[1, 1], training_metrics={})[0].detail == (
        "served 1 predictions for 2 test rows"
    )
    assert check_smoke(MAX, None, run_id="r1", test_labels=None, training_metrics={})[0].passed is False


# -- the whole policy ----------------------------------------------------------------------


def test_policy_passes_only_when_every_check_passes() -> None:
    good_smoke = Check("serving_smoke_test", True, "ok")
    champion = ChampionScore("1", 0.85, "recorded on this split")
    checks = evaluate_policy(MAX, value=0.9, champion=champion, split_id=SPLIT, validation=PASSED, smoke=good_smoke)
    assert [c.name for c in checks] == [
        "threshold",
        "beats_champion",
        "beats_baseline",
        "data_validation",
        "serving_smoke_test",
    ]
    assert all(c.passed for c in checks)

    failed_validation = ValidationEvidence(False, "data version md5a is quarantined", "md5a")
    checks = evaluate_policy(
        MAX, value=0.9, champion=champion, split_id=SPLIT, validation=failed_validation, smoke=good_smoke
    )
    assert [c.name for c in checks if not c.passed] == ["data_validation"]
    assert (
        summarize(checks, force=False, reason=None)
        == "policy failed: data_validation: data version md5a is quarantined"
    )
    assert summarize(checks, force=True, reason="INC-7") == (
        "OVERRIDE (INC-7) of policy failed: data_validation: data version md5a is quarantined"
    )

    bad_smoke = Check("serving_smoke_test", False, "serving process failed")
    checks = evaluate_policy(MAX, value=0.9, champion=champion, split_id=SPLIT, validation=PASSED, smoke=bad_smoke)
    assert [c.name for c in checks if not c.passed] == ["serving_smoke_test"]


def test_rollback_skips_the_relative_check_but_not_the_others() -> None:
    champion = ChampionScore("2", 0.99, "recorded on this split")
    checks = evaluate_policy(MAX, value=0.85, champion=champion, split_id=SPLIT, validation=PASSED,
                             smoke=Check("serving_smoke_test", True, "ok"), relative=False)
    assert checks[1] == Check("beats_champion", True, "not applied: a rollback restores an earlier version on purpose")
    assert all(c.passed for c in checks)
    checks = evaluate_policy(MAX, value=0.5, champion=None, split_id=SPLIT, validation=PASSED,
                             smoke=Check("serving_smoke_test", True, "ok"), relative=False)
    assert [c.name for c in checks if not c.passed] == ["threshold"]


def test_policy_spec_names_field_value_and_rule() -> None:
    with pytest.raises(
        pydantic.ValidationError,
        match="promotion.metric 'val_acc' must be a metric measured on the held-out test split",
    ):
        PromotionSpec(metric="val_acc")
    with pytest.raises(pydantic.ValidationError, match="smoke_test_timeout_s"):
        PromotionSpec(smoke_test_timeout_s=0)
    with pytest.raises(pydantic.ValidationError, match="min_improvement"):
        PromotionSpec(min_improvement=-0.1)
    with pytest.raises(
        pydantic.ValidationError, match="promotion.mode 'max' with metric 'test_rmse' would promote worse models"
    ):
        PromotionSpec(metric="test_rmse", mode="max")
    assert PromotionSpec(metric="test_rmse").mode == "min"  # named without its mode, the metric's direction


# -- the trivial baseline ------------------------------------------------------------------


def test_a_candidate_must_beat_the_trivial_baseline_on_the_promotion_metric() -> None:
    auc = PromotionSpec(metric="test_pr_auc")
    assert check_beats_baseline(auc, 0.31, 0.055) == Check(
        "beats_baseline",
        True,
        "test_pr_auc=0.3100 beats the trivial baseline's 0.0550 (baseline_test_pr_auc: the train "
        "split's class prior for every row; max)",
    )
    # The majority class scores 0.945 accuracy at 5.5 % positives: a model that always answers "no" only ties it.
    tie = check_beats_baseline(MAX, 0.945, 0.945)
    assert not tie.passed and tie.detail.startswith("test_acc=0.9450 does not beat the trivial baseline's 0.9450")
    assert check_beats_baseline(MIN, 1.5, 2.5).passed and not check_beats_baseline(MIN, 2.5, 2.5).passed
    skipped = check_beats_baseline(MAX, 0.9, None)
    assert (
        skipped.passed
        and skipped.detail
        == "skipped: the trial reported no baseline_test_acc (trained before baselines were reported)"
    )


def test_the_baseline_check_blocks_the_policy_with_its_evidence() -> None:
    checks = evaluate_policy(MAX, value=0.945, champion=None, split_id=SPLIT, validation=PASSED,
                             smoke=Check("serving_smoke_test", True, "ok"), baseline=0.945)
    assert [c.name for c in checks if not c.passed] == ["beats_baseline"]
    assert summarize(checks, force=False, reason=None).startswith(
        "policy failed: beats_baseline: test_acc=0.9450 does not beat"
    )


# -- metrics from served predictions ---------------------------------------------------------


def served_frame() -> Any:
    import pandas as pd

    return pd.DataFrame({"customer_id": ["c1", "c2", "c3", "c4"], "churn": ["no", "yes", "no", "no"],
                         "proba_no": [0.9, 0.2, 0.6, 0.7], "proba_yes": [0.1, 0.8, 0.4, 0.3]})


def test_every_promotion_metric_is_computed_from_the_served_frame() -> None:
    from training.metrics import classification_metrics

    truth = ["no", "yes", "yes", "no"]
    pod = classification_metrics([0, 1, 1, 0], served_frame()[["proba_no", "proba_yes"]].to_numpy(), ["no", "yes"], 1)
    for metric in ("acc", "logloss", "roc_auc", "pr_auc", "f1", "balanced_acc"):
        assert served_metric(f"test_{metric}", served_frame(), truth, target="churn") == pytest.approx(
            pod[metric], abs=1e-12
        ), metric
    assert served_metric("test_pr_auc", served_frame(), truth, target="churn") == pytest.approx(
        1.0
    )  # the positive ranks first
    assert served_metric("test_pr_auc", served_frame(), truth, target="churn", positive_label="no") == pytest.approx(
        1.0
    )  # "no" ranks first too


def test_the_served_frame_as_rows_labels_with_probabilities_or_labels_only() -> None:
    frame = served_frame()
    as_rows = served_output(frame.to_dict(orient="records"), "churn")
    assert as_rows.values == ["no", "yes", "no", "no"] and as_rows.classes == ("no", "yes")
    split = served_output(
        frame["churn"].tolist(),
        "churn",
        {"proba_no": frame["proba_no"].tolist(), "proba_yes": frame["proba_yes"].tolist()},
    )
    assert split.classes == as_rows.classes and (split.proba == as_rows.proba).all()
    truth = ["no", "yes", "yes", "no"]
    assert served_metric("test_roc_auc", frame.to_dict(orient="records"), truth, target="churn") == served_metric(
        "test_roc_auc", frame, truth
    )
    # A version registered before the frame serves labels (a Series): accuracy still, probabilities cannot be invented.
    assert served_metric("test_acc", frame["churn"], truth) == 0.75
    with pytest.raises(ValueError, match="test_roc_auc needs class probabilities, and this version serves labels only"):
        served_metric("test_roc_auc", frame["churn"], truth)
    with pytest.raises(ValueError, match=r"has no class for the true label\(s\) \['maybe'\]"):
        served_metric("test_acc", frame, ["no", "yes", "maybe", "no"], target="churn")


def test_regression_metrics_from_the_served_frame() -> None:
    import pandas as pd

    frame = pd.DataFrame({"id": [1, 2], "progression": [1.0, 4.0]})
    assert served_metric("test_rmse", frame, [1.0, 2.0], target="progression") == pytest.approx(2 ** 0.5)
    assert served_metric("test_mae", frame, [1.0, 2.0], target="progression") == 1.0
    assert served_metric("test_rmse", [1.0, 4.0], [1.0, 2.0]) == pytest.approx(2**0.5)  # a version that served an array


def test_the_smoke_test_compares_the_policy_metric_from_served_probabilities() -> None:
    frame = served_frame()
    probabilities = {"test": {"proba_no": frame["proba_no"].tolist(), "proba_yes": frame["proba_yes"].tolist()}}
    result = SimpleNamespace(
        **vars(smoke({"input_example": ["no"], "test": frame["churn"].tolist()})), probabilities=probabilities
    )
    truth = ["no", "yes", "yes", "no"]
    auc = served_metric("test_roc_auc", frame, truth, target="churn")
    check, evidence = check_smoke(
        PromotionSpec(metric="test_roc_auc"),
        result,
        run_id="r1",
        test_labels=truth,
        target="churn",
        training_metrics={"test_acc": 0.75, "test_roc_auc": auc},
    )
    assert check.passed and (evidence["served_metric"], evidence["served_value"]) == ("test_roc_auc", auc)
    check, _ = check_smoke(PromotionSpec(metric="test_roc_auc"), result, run_id="r1", test_labels=truth, target="churn",
                           training_metrics={"test_roc_auc": auc + 0.01})
    assert not check.passed and "served test_roc_auc" in check.detail
    labels_only = smoke({"input_example": ["no"], "test": frame["churn"].tolist()})
    check, _ = check_smoke(
        PromotionSpec(metric="test_roc_auc"),
        labels_only,
        run_id="r1",
        test_labels=truth,
        target="churn",
        training_metrics={"test_roc_auc": auc},
    )
    assert not check.passed and "test_roc_auc cannot be recomputed from the served predictions" in check.detail


# -- champion history ----------------------------------------------------------------------


def test_history_push_and_rollback_steps_back() -> None:
    h: dict[str, Any] = {}
    h = next_history(h, action="register", version="1", current=None, entry={"version": "1"})
    h = next_history(h, action="register", version="2", current="1", entry={"version": "2"})
    h = next_history(h, action="promote", version="4", current="2", entry={"version": "4"})
    assert h["stack"] == ["1", "2", "4"]
    assert rollback_target(h, "4") == "2"
    h = next_history(h, action="rollback", version="2", current="4", entry={"version": "2"})
    assert h["stack"] == ["1", "2"]
    assert rollback_target(h, "2") == "1"
    h = next_history(h, action="rollback", version="1", current="2", entry={"version": "1"})
    assert h["stack"] == ["1"]
    with pytest.raises(PromotionError, match="v1 is the first champion on record"):
        rollback_target(h, "1")
    # a rollback to a version that was never champion pushes it
    h = next_history(h, action="rollback", version="3", current="1", entry={"version": "3"})
    assert h["stack"] == ["1", "3"]
    assert [e["version"] for e in h["log"]] == ["1", "2", "4", "2", "1", "3"]


def test_history_adopts_a_champion_set_before_it_existed_and_detects_outside_moves() -> None:
    h = next_history({}, action="register", version="5", current="3", entry={})
    assert h["stack"] == ["3", "5"]
    with pytest.raises(PromotionError, match="the alias was moved outside trainyard"):
        rollback_target(h, "4")
    with pytest.raises(PromotionError, match="there is no champion to roll back from"):
        rollback_target(h, None)


def test_validation_evidence_from_tags() -> None:
    assert ValidationEvidence.from_tags({}).passed is False
    recorded = ValidationEvidence.from_tags({"trainyard.validation": "passed", "trainyard.validation.summary": "12 ok",
                                             "trainyard.data_version": "md5a"})
    assert (recorded.passed, recorded.detail, recorded.data_version) == (
        True,
        "recorded at registration: passed (12 ok)",
        "md5a",
    )


def test_decision_tags_record_the_evidence() -> None:
    d = Decision(
        model="m", version="2", action="promote", promoted=True, already_champion=False, reason="OVERRIDE (x) of ...",
        checks=(Check("threshold", False, "misses"),), metric="test_acc", value=0.5, champion_before="1",
        champion_value=0.9, override=True, override_reason="x", decided_by="cli a@b", at="2025-01-01T00:00:00+00:00",
        smoke={"passed": True},
    )
    tags = d.tags()
    assert tags["trainyard.promotion.decision"] == "champion"
    assert tags["trainyard.promotion.override"] == "true"
    assert tags["trainyard.promotion.override_reason"] == "x"
    assert json.loads(tags["trainyard.promotion.checks"]) == [
        {"name": "threshold", "passed": False, "detail": "misses"}
    ]
    assert tags["trainyard.promotion.champion_before"] == "1"
    assert tags["trainyard.smoke.passed"] == "true"
    assert d.outcome == "champion" and d.champion




def test_evidence_from_check_states_the_numbers() -> None:
    evidence = evidence_from_check(
        "expectations", "md5a", "0123456789ab", True, {"expectations": "12", "failed": 0, "max_psi": 0.25}
    )
    assert evidence == ValidationEvidence(
        True,
        "expectations check passed for data version md5a in run 01234567: 12 expectations, 0 failed, max drift PSI "
        "0.2500",
        "md5a",
        12,
        0,
        0.25,
        "0123456789ab",
    )
    unknown = evidence_from_check("expectations", "md5a", "r2", False, {"max_psi": ""})
    assert (
        unknown.detail
        == "expectations check FAILED for data version md5a in run r2: None expectations, None failed, max drift PSI "
           "0.0000"
    )
    assert (unknown.passed, unknown.expectations, unknown.max_psi) == (False, None, None)


def test_recorded_metrics_and_policy_of_a_version() -> None:
    tags = {"trainyard.metric.test_acc": "0.75", "trainyard.metric.note": "n/a", "trainyard.seed": "1",
            "trainyard.promotion_policy": MIN.model_dump_json()}
    assert recorded_metrics(tags) == {"test_acc": 0.75}
    version = SimpleNamespace(name="m", version="3", run_id="r", model_uri="models:/m/3", tags=tags)
    assert recorded_policy(version) == MIN
    assert recorded_policy(SimpleNamespace(**{**version.__dict__, "tags": {}})) == PromotionSpec()
    broken = SimpleNamespace(**{**version.__dict__, "tags": {"trainyard.promotion_policy": '{"metric": "val_acc"}'}})
    with pytest.raises(PromotionError, match="v3: tag trainyard.promotion_policy is not a valid promotion policy"):
        recorded_policy(broken)


def test_quarantine_since_registration_fails_the_recorded_validation(tmp_path: Path) -> None:
    store = Store(root=str(tmp_path))
    tags = {"trainyard.validation": "passed", "trainyard.pipeline": "vision/digits", "trainyard.data_version": "md5a"}
    assert validation_now(store, tags).passed and not is_quarantined(store, "vision/digits", "md5a")
    where = tmp_path / "quarantine" / "vision" / "digits" / "md5a"
    where.mkdir(parents=True)
    assert is_quarantined(store, "vision/digits", "md5a")
    assert validation_now(store, tags) == ValidationEvidence(
        False, f"data version md5a has been quarantined since ({where})", "md5a"
    )
    (where / "release.json").write_text("{}")
    assert validation_now(store, tags).passed
    assert validation_now(None, tags).passed


def test_history_tag_parsing_and_lock_budget() -> None:
    assert parse_history(None, "m", "trainyard.champion.history") == {"stack": [], "log": []}
    assert parse_history('{"stack": ["1"], "log": []}', "m", "t") == {"stack": ["1"], "log": []}
    assert parse_history("[1]", "m", "t") == {"stack": [], "log": []}
    with pytest.raises(PromotionError, match="tag t of 'm' is not valid JSON"):
        parse_history("{", "m", "t")
    assert lock_seconds(60.0) == 900.0 and lock_seconds(1800.0) == 3900.0


def test_policy_module_imports_without_dagster_or_resources() -> None:
    import subprocess
    import sys

    code = (
        "import sys, trainyard.promotion, trainyard.lineage; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'dagster', 'resources', 'assets', 'pipelines', "
        "'mlflow'}))"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_every_metric_a_promotion_accepts_can_be_re_evaluated_from_served_predictions() -> None:
    from trainyard.promotion import SERVED_METRICS
    from trainyard.tasks import TASKS

    accepted = {m for profile in TASKS.values() for metrics in profile.evaluated.values() for m in metrics}
    assert set(SERVED_METRICS) == accepted  # check_task refuses any other promotion metric at import
    frame, truth = served_frame(), ["no", "yes", "yes", "no"]
    for metric in accepted - {"test_rmse", "test_mae", "test_loss", "test_perplexity"}:
        assert 0.0 <= served_metric(metric, frame, truth, target="churn") < 10.0, metric
    # A language model serves each row's mean next-token loss; the "labels" are the tokens each row predicts.
    losses, tokens = [2.0, 1.0, 4.0], [4, 4, 2]
    assert served_metric("test_loss", losses, tokens) == pytest.approx((8 + 4 + 8) / 10)
    assert served_metric("test_perplexity", losses, tokens) == pytest.approx(math.exp(2.0))
    with pytest.raises(ValueError, match="not all finite"):
        served_metric("test_perplexity", [float("nan"), 1.0, 1.0], tokens)
