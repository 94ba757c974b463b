"""The policy's checks as plain functions: each returns a `Check` with evidence a reviewer can verify."""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

from trainyard.promotion.evidence import ValidationEvidence
from trainyard.promotion.records import ChampionScore, Check, ServingSmoke
from trainyard.promotion.served import SERVED_METRICS, served_metric
from trainyard.spec import PromotionSpec


def _better(policy: PromotionSpec, value: float, than: float, margin: float) -> bool:
    return value > than + margin if policy.mode == "max" else value < than - margin


def check_threshold(policy: PromotionSpec, value: Optional[float]) -> Check:
    """The absolute bound: `value >= threshold` (mode max) or `value <= threshold` (mode min)."""
    if value is None or math.isnan(value):
        return Check("threshold", False, f"{policy.metric} was not measured for this version")
    if policy.threshold is None:
        return Check("threshold", True, f"{policy.metric}={value:.4f}; no absolute threshold declared")
    ok = value >= policy.threshold if policy.mode == "max" else value <= policy.threshold
    sign = ">=" if policy.mode == "max" else "<="
    verdict = "meets" if ok else "misses"
    return Check("threshold", ok, f"{policy.metric}={value:.4f} {verdict} threshold {sign} {policy.threshold}")


def comparable_value(
    policy: PromotionSpec, value: Optional[float], champion: Optional[ChampionScore], smoke_evidence: Mapping[str, Any]
) -> tuple[Optional[float], str]:
    """The candidate's metric measured the way the champion's was, and how it was measured.

    A champion recorded on this split is compared with the candidate's recorded
    (training-side) value: the same evaluation code produced both. A champion
    re-evaluated from its served predictions is compared with the candidate's
    served value from the smoke test on the same rows: a float32 training-side
    accuracy against a float64 re-evaluation would otherwise turn a tie
    (589/600 both) into an "improvement" of one float32 rounding step.

    Returns:
        (value, "recorded" | "served"); the value is None when the candidate's
        served value is needed but the smoke test did not measure this metric.
    """
    if champion is None or not champion.served:
        return value, "recorded"
    if smoke_evidence.get("served_metric") != policy.metric or smoke_evidence.get("served_value") is None:
        return None, "served"
    return float(smoke_evidence["served_value"]), "served"


def check_beats_champion(
    policy: PromotionSpec, value: Optional[float], champion: Optional[ChampionScore], split_id: Optional[str]
) -> Check:
    """The relative bound: better than the champion by more than `min_improvement`, same split."""
    if champion is None:
        return Check("beats_champion", True, "no champion yet: the first version that passes becomes champion")
    if value is None or math.isnan(value):
        how = " from served predictions, as the champion's was" if champion.served else ""
        return Check("beats_champion", False, f"{policy.metric} was not measured{how} for this version")
    if champion.value is None:
        return Check("beats_champion", False, f"champion v{champion.version} cannot be compared: {champion.detail}")
    ok = _better(policy, value, champion.value, policy.min_improvement)
    verdict = "beats" if ok else "does not beat"
    return Check(
        "beats_champion",
        ok,
        f"{policy.metric}={value:.4f} {verdict} champion v{champion.version} ({champion.value:.4f}, {champion.detail}) "
        f"by more than {policy.min_improvement} ({policy.mode}) on test split {split_id}",
    )


def check_beats_baseline(policy: PromotionSpec, value: Optional[float], baseline: Optional[float]) -> Check:
    """The trivial-baseline bound: `metric` strictly better than `baseline_<metric>`, the same metric of always
    answering the train split's class prior (majority class), mean, or unigram token frequencies, on the same test
    split.

    A model whose test accuracy equals answering "no" for every customer passes a
    threshold and beats a champion as weak as itself; it is no model. Versions
    registered before trials reported baselines have none: the check is skipped,
    with a note in its evidence.
    """
    name = f"baseline_{policy.metric}"
    if baseline is None or math.isnan(baseline):
        return Check(
            "beats_baseline", True, f"skipped: the trial reported no {name} (trained before baselines were reported)"
        )
    if value is None or math.isnan(value):
        return Check("beats_baseline", False, f"{policy.metric} was not measured for this version")
    ok = _better(policy, value, baseline, 0.0)
    verdict = "beats" if ok else "does not beat"
    return Check(
        "beats_baseline",
        ok,
        f"{policy.metric}={value:.4f} {verdict} the trivial baseline's {baseline:.4f} ({name}: "
        f"{_baseline_kind(policy.metric)}; {policy.mode})",
    )


def _baseline_kind(metric: str) -> str:
    """What the trivial baseline of `metric` answers."""
    if metric in ("test_loss", "test_perplexity"):
        return "the train split's unigram token frequencies (add-one smoothed) for every token"
    if metric in ("test_rmse", "test_mae"):
        return "the train split's mean for every row"
    return "the train split's class prior for every row"


def check_validation(evidence: ValidationEvidence) -> Check:
    """The data validation check: passes when the evidence does."""
    return Check("data_validation", evidence.passed, evidence.detail)


def check_smoke(
    policy: PromotionSpec,
    smoke: Optional[ServingSmoke],
    *,
    run_id: Optional[str],
    test_labels: Optional[list[Any]],
    training_metrics: Mapping[str, float],
    target: Optional[str] = None,
    positive_label: Any = None,
    sample_note: Optional[str] = None,
) -> tuple[Check, dict[str, Any]]:
    """Judges a smoke test: it loaded this version, predicted everything, and agrees with training.

    Args:
        policy: Gives the tolerance (`served_metric_tolerance`, relative above 1).
        smoke: What the serving process did (None when it could not run).
        run_id: MLflow run of the candidate; the process must have loaded this one.
        test_labels: True labels of the test sample, in order (None: no test data).
        training_metrics: Metrics the training process measured; `policy.metric`
            when it is in `SERVED_METRICS`, else the first of those among them, is
            recomputed from the served predictions and must match.
        target: The target column of the served DataFrame (`served_output`).
        positive_label: A binary target's positive class (None: the second of the sorted labels).
        sample_note: Set when the test sample is a part of the test split (`Candidate.sample_note`): the
            served metric is recorded (for the champion comparison) but not held to the training-side value,
            which was measured on the whole split.

    Returns:
        The check and its evidence (JSON-serialisable, recorded on the version).
    """
    if smoke is None:
        return Check("serving_smoke_test", False, "the serving smoke test did not run"), {"passed": False}
    evidence: dict[str, Any] = {
        "model_uri": smoke.model_uri,
        "seconds": round(smoke.seconds, 3),
        "load_seconds": None if smoke.load_seconds is None else round(smoke.load_seconds, 3),
        "blocked_imports": list(smoke.blocked_imports),
        "input_example_predictions": smoke.predictions.get("input_example", [])[:10],
    }

    def fail(why: str) -> tuple[Check, dict[str, Any]]:
        evidence.update(passed=False, error=why)
        return Check("serving_smoke_test", False, why), evidence

    if not smoke.passed:
        return fail(f"serving process failed on {smoke.model_uri}: {smoke.error}")
    if run_id is not None and smoke.run_id != run_id:
        return fail(f"{smoke.model_uri} resolved to run {smoke.run_id}, not this version's run {run_id}")
    if not smoke.predictions.get("input_example"):
        return fail("no predictions on the logged input example")
    detail = f"loaded {smoke.model_uri} in a serving-only process ({smoke.seconds:.1f}s), predicted the input example"
    generated = getattr(smoke, "generated", None)
    if generated:  # a language model continued a prompt there
        evidence["generated"] = generated
        detail += f", continued a {len(generated['prompt_tokens'])}-token prompt with {str(generated['text'])[:80]!r}"
    if test_labels is not None:
        served = smoke.predictions.get("test", [])
        if len(served) != len(test_labels):
            return fail(f"served {len(served)} predictions for {len(test_labels)} test rows")
        evidence["test_rows"] = len(test_labels)
        detail += f" and {len(test_labels)} test rows"
        name = next(
            (m for m in (policy.metric, *SERVED_METRICS) if m in SERVED_METRICS and m in training_metrics), None
        )
        if name is not None and test_labels:
            try:
                value = served_metric(name, served, test_labels, target=target, positive_label=positive_label,
                                      probabilities=(getattr(smoke, "probabilities", None) or {}).get("test"))
            except ValueError as e:
                return fail(f"{name} cannot be recomputed from the served predictions: {e}")
            trained = float(training_metrics[name])
            evidence.update(served_metric=name, served_value=value, training_value=trained)
            if sample_note:
                evidence.update(passed=True, sample=sample_note)
                return Check(
                    "serving_smoke_test", True, detail + f" (served {name} {value:.6f} on {sample_note})"
                ), evidence
            tolerance = policy.served_metric_tolerance * max(1.0, abs(trained))
            if abs(value - trained) > tolerance:
                return fail(
                    f"served {name} {value:.6f} differs from the training-side {trained:.6f} by more than "
                    f"{tolerance:g}: serving does not reproduce the evaluated model"
                )
            detail += f" (served {name} {value:.6f}, training-side {trained:.6f})"
    evidence["passed"] = True
    return Check("serving_smoke_test", True, detail), evidence


def evaluate_policy(
    policy: PromotionSpec,
    *,
    value: Optional[float],
    champion: Optional[ChampionScore],
    split_id: Optional[str],
    validation: ValidationEvidence,
    smoke: Check,
    relative: bool = True,
    compared: Optional[float] = None,
    lineage: Optional[Check] = None,
    baseline: Optional[float] = None,
) -> tuple[Check, ...]:
    """All checks of the policy, in `CHECK_NAMES` order.

    Args:
        policy: The pipeline's promotion policy.
        value: The candidate's `policy.metric` on the pinned test split.
        champion: The champion's score on the same split (None when there is none).
        split_id: The pinned test split both were evaluated on.
        validation: Data validation evidence of the candidate's training data.
        smoke: The judged serving smoke test (`check_smoke`).
        relative: False for a rollback, which by design may go to a weaker model.
        compared: The candidate's served value (`comparable_value`), used instead
            of `value` when the champion was re-evaluated from served predictions.
        lineage: The judged `clean_lineage` check (`check_lineage`), last; None leaves it out.
        baseline: The trial's `baseline_<metric>` on the same split (None: not reported, the check is skipped).
    """
    if relative:
        against = compared if champion is not None and champion.served else value
        beats = check_beats_champion(policy, against, champion, split_id)
    else:
        beats = Check("beats_champion", True, "not applied: a rollback restores an earlier version on purpose")
    checks = (
        check_threshold(policy, value),
        beats,
        check_beats_baseline(policy, value, baseline),
        check_validation(validation),
        smoke,
    )
    return checks if lineage is None else (*checks, lineage)


def summarize(checks: tuple[Check, ...], *, force: bool, reason: Optional[str]) -> str:
    """The decision's reason in one line: every check's evidence when all passed, else the failures (and the override).

    A check that passed with a warning is named when the policy passed, so the warning travels with the reason.
    """
    failed = [c for c in checks if not c.passed]
    if not failed:
        warned = [c.name for c in checks if c.warning]
        head = f"policy passed with warnings ({', '.join(warned)})" if warned else "policy passed"
        return f"{head}: " + "; ".join(c.detail for c in checks)
    text = "policy failed: " + "; ".join(f"{c.name}: {c.detail}" for c in failed)
    return f"OVERRIDE ({reason}) of {text}" if force else text
