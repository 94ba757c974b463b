"""The promotion policy: when a registered version may become `champion`, and the record of each decision.

Plain functions over plain data, so a reviewer can check the policy without a
registry, Dagster or a serving process. `resources.promotion` applies it: for
model M and candidate version V, inside the registry's lock on M,

1. V gets alias `challenger` (a rollback target is checked by its pinned URI instead).
2. Serving smoke test: a fresh process with only the serving dependencies loads
   `models:/M@challenger` and predicts on the input example and the pinned test
   split; its test accuracy must equal the training-side one (`check_smoke`).
3. The champion is scored on the same test split: its recorded metric when it was
   evaluated on that split, otherwise re-evaluated on it now.
4. The checks of `PromotionSpec` (threshold, beats_champion, data_validation,
   serving_smoke_test) are evaluated (`evaluate_policy`).
5. `champion` moves to V when all pass, or when forced with a reason (an override).
6. The evidence goes to V's tags (`Decision.tags`) before the alias moves; each
   champion change is pushed on the model's champion history (`next_history`)
   and published as a handoff event.

The same policy serves the `registered_model` asset (action `register`) and
`trainyard registry promote|rollback` (actions `promote`, `rollback`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Mapping, Optional, Protocol

from trainyard import naming
from trainyard.lineage import (
    DATA_VERSION_TAG,
    METRIC_PREFIX,
    PIPELINE_TAG,
    POLICY_TAG,
    PROMOTION_PREFIX,
    SMOKE_EVIDENCE_TAG,
    SMOKE_PASSED_TAG,
    VALIDATION_SUMMARY_TAG,
    VALIDATION_TAG,
)
from trainyard.spec import PromotionSpec

if TYPE_CHECKING:
    import pandas as pd

    from trainyard.store import FileStore

CHAMPION = "champion"
CHALLENGER = "challenger"
Action = Literal["register", "promote", "rollback"]

LOG_LIMIT = 50
"""Champion changes kept in the model's history tag (MLflow caps a tag's length)."""
CHECK_NAMES = ("threshold", "beats_champion", "data_validation", "serving_smoke_test")
MAX_SMOKE_TIMEOUT_S = 1800.0


def lock_seconds(smoke_timeout_s: float) -> float:
    """How long a promotion may hold the model's lock: two smoke-test deadlines and some registry calls."""
    return max(900.0, 2 * smoke_timeout_s + 300.0)


class PromotionError(Exception):
    """A promotion or rollback request cannot be carried out as asked (terminal)."""


class RegisteredVersion(Protocol):
    """What the policy reads of a registered version (`resources.registry.ModelVersionInfo`)."""

    name: str
    version: str
    run_id: Optional[str]
    model_uri: str
    tags: dict[str, str]


class ServingSmoke(Protocol):
    """What a serving smoke test reports (`resources.registry.SmokeResult`)."""

    model_uri: str
    run_id: Optional[str]
    predictions: dict[str, list[Any]]
    load_seconds: Optional[float]
    seconds: float
    blocked_imports: tuple[str, ...]
    error: Optional[str]

    @property
    def passed(self) -> bool: ...


@dataclass(frozen=True)
class Check:
    """One policy check and its outcome, in words a reviewer can verify."""

    name: str
    passed: bool
    detail: str

    def as_dict(self) -> dict[str, Any]:
        """The check as the JSON object recorded on the version and in the handoff event."""
        return {"name": self.name, "passed": self.passed, "detail": self.detail}


@dataclass(frozen=True)
class ValidationEvidence:
    """What the data validation of the candidate's training data found.

    Attributes:
        passed: The expectations check passed for this data version and it is not quarantined.
        detail: One line saying why, with the numbers.
        data_version: DVC md5 of the raw data the model was trained on.
        expectations: Expectations evaluated (None when unknown).
        failed: Expectations that failed (None when unknown).
        max_psi: Largest drift PSI against the previous data version.
        run_id: Dagster run whose check is the evidence.
    """

    passed: bool
    detail: str
    data_version: Optional[str] = None
    expectations: Optional[int] = None
    failed: Optional[int] = None
    max_psi: Optional[float] = None
    run_id: Optional[str] = None

    def lineage_fields(self) -> dict[str, str]:
        """The `LineageRecord` fields recorded at registration (`validation`, `validation_summary`)."""
        return {"validation": "passed" if self.passed else "failed", "validation_summary": self.detail}

    @classmethod
    def from_tags(cls, tags: Mapping[str, str]) -> "ValidationEvidence":
        """The evidence recorded on a version at registration."""
        state = tags.get(VALIDATION_TAG)
        if state is None:
            return cls(False, f"the version carries no data validation record (tag {VALIDATION_TAG})")
        summary = tags.get(VALIDATION_SUMMARY_TAG, "")
        return cls(state == "passed", f"recorded at registration: {state}" + (f" ({summary})" if summary else ""),
                   data_version=tags.get(DATA_VERSION_TAG))


@dataclass(frozen=True)
class ChampionScore:
    """The current champion's policy metric on the candidate's test split.

    Attributes:
        served: True when `value` was re-evaluated from the champion's served
            predictions (`served_metric`); the candidate is then compared by its
            own served value, so both sides come from the same code at the same
            precision (`comparable_value`).
    """

    version: str
    value: Optional[float]
    detail: str
    served: bool = False


@dataclass(frozen=True)
class Decision:
    """The outcome of one promotion or rollback request, with its evidence."""

    model: str
    version: str
    action: Action
    promoted: bool
    already_champion: bool
    reason: str
    checks: tuple[Check, ...] = ()
    metric: str = ""
    value: Optional[float] = None
    champion_before: Optional[str] = None
    champion_value: Optional[float] = None
    override: bool = False
    override_reason: Optional[str] = None
    decided_by: str = ""
    at: str = ""
    smoke: dict[str, Any] = field(default_factory=dict)
    handoff_uri: Optional[str] = None
    webhook: Optional[str] = None

    @property
    def champion(self) -> bool:
        """Whether the version holds `champion` after this decision."""
        return self.promoted or self.already_champion

    @property
    def outcome(self) -> str:
        """`champion`, `rolled_back_to`, `already_champion` or `rejected`."""
        if self.already_champion:
            return "already_champion"
        if self.promoted:
            return "rolled_back_to" if self.action == "rollback" else "champion"
        return "rejected"

    def tags(self) -> dict[str, str]:
        """Version tags recording this decision (written before the alias moves)."""
        p = PROMOTION_PREFIX
        return {
            f"{p}decision": "champion" if self.promoted else "rejected",
            f"{p}action": self.action,
            f"{p}reason": self.reason,
            f"{p}at": self.at,
            f"{p}by": self.decided_by,
            f"{p}checks": json.dumps([c.as_dict() for c in self.checks]),
            f"{p}metric": self.metric,
            f"{p}value": "" if self.value is None else repr(self.value),
            f"{p}champion_before": self.champion_before or "",
            f"{p}champion_value": "" if self.champion_value is None else repr(self.champion_value),
            f"{p}override": "true" if self.override else "false",
            f"{p}override_reason": self.override_reason or "",
            SMOKE_PASSED_TAG: str(self.smoke.get("passed", "")).lower(),
            SMOKE_EVIDENCE_TAG: json.dumps(self.smoke, sort_keys=True),
        }


# -- pure policy ---------------------------------------------------------------


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


def check_validation(evidence: ValidationEvidence) -> Check:
    """The data validation check: passes when the evidence does."""
    return Check("data_validation", evidence.passed, evidence.detail)


SERVED_METRICS = ("test_acc", "test_rmse")
"""Test metrics the smoke test recomputes from served predictions (the policy's first, see `check_smoke`)."""


def served_metric(name: str, predictions: list[Any], labels: list[Any]) -> float:
    """`*_acc` (share of exact matches) or `*_rmse` of predictions against labels.

    Raises:
        ValueError: Another metric, or no rows.
    """
    if not labels or len(predictions) != len(labels):
        raise ValueError(f"{len(predictions)} predictions for {len(labels)} labels")
    if name.endswith("_acc"):
        return sum(1 for p, y in zip(predictions, labels) if p == y) / len(labels)
    if name.endswith("_rmse"):
        return math.sqrt(sum((float(p) - float(y)) ** 2 for p, y in zip(predictions, labels)) / len(labels))
    raise ValueError(f"metric {name!r} cannot be recomputed from predictions; only *_acc and *_rmse can")


def check_smoke(
    policy: PromotionSpec,
    smoke: Optional[ServingSmoke],
    *,
    run_id: Optional[str],
    test_labels: Optional[list[Any]],
    training_metrics: Mapping[str, float],
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
    if test_labels is not None:
        served = smoke.predictions.get("test", [])
        if len(served) != len(test_labels):
            return fail(f"served {len(served)} predictions for {len(test_labels)} test rows")
        evidence["test_rows"] = len(test_labels)
        detail += f" and {len(test_labels)} test rows"
        name = next((m for m in (policy.metric, *SERVED_METRICS) if m in SERVED_METRICS and m in training_metrics), None)
        if name is not None and test_labels:
            value, trained = served_metric(name, served, test_labels), float(training_metrics[name])
            evidence.update(served_metric=name, served_value=value, training_value=trained)
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
    """
    if relative:
        against = compared if champion is not None and champion.served else value
        beats = check_beats_champion(policy, against, champion, split_id)
    else:
        beats = Check("beats_champion", True, "not applied: a rollback restores an earlier version on purpose")
    return (check_threshold(policy, value), beats, check_validation(validation), smoke)


def summarize(checks: tuple[Check, ...], *, force: bool, reason: Optional[str]) -> str:
    """The decision's reason in one line: every check's evidence when all passed, else the failures (and the override)."""
    failed = [c for c in checks if not c.passed]
    if not failed:
        return "policy passed: " + "; ".join(c.detail for c in checks)
    text = "policy failed: " + "; ".join(f"{c.name}: {c.detail}" for c in failed)
    return f"OVERRIDE ({reason}) of {text}" if force else text


def next_history(history: dict[str, Any], *, action: Action, version: str, current: Optional[str], entry: dict[str, Any]) -> dict[str, Any]:
    """The champion history after `version` becomes champion.

    The stack holds champions in order; a promotion pushes, a rollback to a
    version on the stack drops everything after it (so rolling back twice goes
    two steps back), a rollback to a version never champion pushes it.
    """
    stack = [str(v) for v in history.get("stack", [])]
    if not stack and current is not None:
        stack = [current]
    if action == "rollback" and version in stack:
        stack = stack[: len(stack) - stack[::-1].index(version)]
    else:
        stack.append(version)
    log = [*history.get("log", []), entry][-LOG_LIMIT:]
    return {"stack": stack[-LOG_LIMIT:], "log": log}


def rollback_target(history: dict[str, Any], current: Optional[str]) -> str:
    """The version a rollback without `--version` returns to: the champion before the current one.

    Raises:
        PromotionError: There is no champion, or no earlier one on record.
    """
    if current is None:
        raise PromotionError("there is no champion to roll back from")
    stack = [str(v) for v in history.get("stack", [])]
    if not stack or stack[-1] != current:
        raise PromotionError(
            f"the champion history does not end at the current champion v{current} (stack {stack}); "
            "the alias was moved outside trainyard: name the version with --version"
        )
    if len(stack) < 2:
        raise PromotionError(f"v{current} is the first champion on record; there is nothing to roll back to")
    return stack[-2]


def model_card(spec: Any, best: dict[str, Any], validated: dict[str, Any], validation: ValidationEvidence) -> str:
    """The version description: what it is for, how it did, what data and code made it, how it was validated.

    Args:
        spec: The `PipelineSpec`.
        best: The `best_model` value (trial, study, params, metrics, lineage).
        validated: The `validated_data` value (split id, row counts).
        validation: Data validation evidence of the training data.
    """
    rec = best["lineage"]
    policy = spec.promotion
    metrics = "\n".join(f"- {k}: {v:.4f}" for k, v in sorted(best["metrics"].items()))
    rows = validated.get("rows", {})
    features = spec.features
    shown = ", ".join(features[:4]) + (f", ... ({len(features)} in all)" if len(features) > 4 else "")
    threshold = "none" if policy.threshold is None else f"{'>=' if policy.mode == 'max' else '<='} {policy.threshold}"
    return (
        f"# {spec.model_name}\n\n{spec.description or 'Trained by trainyard.'}\n\n"
        f"## Intended use\n"
        f"Predicts `{spec.target}` from {len(features)} numeric features ({shown}) of pipeline `{spec.key}`. "
        f"Input: a table with those columns (any other columns are ignored); output: one `{spec.target}` label per row. "
        f"Load the promoted version with `mlflow.pyfunc.load_model(\"models:/{spec.model_name}@{CHAMPION}\")`; "
        f"it needs mlflow, torch, numpy and pandas only. Inputs outside the validated ranges of the training data "
        f"are out of scope.\n\n"
        f"## Metrics (held-out test split {validated['split_id']})\n{metrics}\n\n"
        f"## Data\n- data version (DVC md5): {rec['data_version']}\n"
        f"- rows: train {rows.get('train')}, val {rows.get('val')}, test {rows.get('test')}\n\n"
        f"## Validation\n- result: {'passed' if validation.passed else 'FAILED'}\n- {validation.detail}\n\n"
        f"## Training\n- trial: {best['trial']} of study {best['study']}\n- params: {best['params']}\n"
        f"- code: {rec['code_version']}{' (dirty)' if rec['code_dirty'] else ''}\n- dependency lock: {rec['lock_hash']}\n"
        f"- seed {rec.get('seed')}, world size {rec.get('world_size')}, strategy {rec.get('strategy')}\n\n"
        f"## Promotion policy\n- metric: {policy.metric} ({policy.mode}), threshold: {threshold}, "
        f"must beat the champion by more than {policy.min_improvement} on the same test split\n"
        f"- data validation must pass; a serving-only process must load it and reproduce test accuracy "
        f"within {policy.served_metric_tolerance}\n"
    )


# -- evidence ------------------------------------------------------------------


def evidence_from_check(
    check_name: str, data_version: str, run_id: str, passed: bool, metadata: Mapping[str, Any]
) -> ValidationEvidence:
    """The evidence of the expectations check that ran for `data_version` in run `run_id`.

    Args:
        check_name: The asset check's name (`expectations`).
        data_version: The data version the candidate was trained on (and the check ran for).
        run_id: The Dagster run of the check.
        passed: Whether the check passed.
        metadata: The check's metadata as plain values (`expectations`, `failed`, `max_psi`).
    """
    expectations = _int_or_none(metadata.get("expectations"))
    failed = _int_or_none(metadata.get("failed"))
    max_psi = _float_or_none(metadata.get("max_psi"))
    detail = (
        f"{check_name} check {'passed' if passed else 'FAILED'} for data version {data_version} in run {run_id[:8]}: "
        f"{expectations} expectations, {failed} failed, max drift PSI {0.0 if max_psi is None else max_psi:.4f}"
    )
    return ValidationEvidence(passed, detail, data_version, expectations, failed, max_psi, run_id)


def _int_or_none(value: Any) -> Optional[int]:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _float_or_none(value: Any) -> Optional[float]:
    try:
        return float(value) if value not in (None, "") else None
    except (TypeError, ValueError):
        return None


def recorded_metrics(tags: Mapping[str, str]) -> dict[str, float]:
    """The metrics recorded on a version as `trainyard.metric.<name>` tags."""
    out = {}
    for key, value in tags.items():
        if key.startswith(METRIC_PREFIX):
            number = _float_or_none(value)
            if number is not None:
                out[key[len(METRIC_PREFIX):]] = number
    return out


def is_quarantined(store: "FileStore", pipeline: str, md5: str) -> bool:
    """Whether a data version sits in quarantine and has not been released (with a recorded reason)."""
    where = naming.quarantine_dir(store, *pipeline.split("/"), md5)
    return store.exists(where) and not store.exists(f"{where}/release.json")


def validation_now(store: Optional["FileStore"], tags: Mapping[str, str]) -> ValidationEvidence:
    """Recorded validation evidence, failed if the data has been quarantined (and not released) since."""
    evidence = ValidationEvidence.from_tags(tags)
    pipeline, md5 = tags.get(PIPELINE_TAG), tags.get(DATA_VERSION_TAG)
    if evidence.passed and store is not None and pipeline and md5 and is_quarantined(store, pipeline, md5):
        where = naming.quarantine_dir(store, *pipeline.split("/"), md5)
        return ValidationEvidence(False, f"data version {md5} has been quarantined since ({where})", md5)
    return evidence


def recorded_policy(version: RegisteredVersion) -> PromotionSpec:
    """The policy declared when `version` was registered (the default policy when none was recorded).

    Raises:
        PromotionError: The recorded policy is not a valid `PromotionSpec`.
    """
    raw = version.tags.get(POLICY_TAG)
    try:
        return PromotionSpec.model_validate_json(raw) if raw else PromotionSpec()
    except ValueError as e:
        raise PromotionError(f"v{version.version}: tag {POLICY_TAG} is not a valid promotion policy: {e}") from e


def parse_history(raw: Optional[str], model: str, tag: str) -> dict[str, Any]:
    """The champion history from the model's history tag (empty when there is none).

    Raises:
        PromotionError: The tag is not valid JSON.
    """
    if not raw:
        return {"stack": [], "log": []}
    try:
        history = json.loads(raw)
    except json.JSONDecodeError as e:
        raise PromotionError(f"tag {tag} of {model!r} is not valid JSON: {e}") from e
    return history if isinstance(history, dict) else {"stack": [], "log": []}


@dataclass(frozen=True)
class Candidate:
    """What a decision needs to know about the version and its test data.

    Attributes:
        version: The registered version.
        policy: The promotion policy of its pipeline.
        metrics: Its metrics on the pinned test split (`test_acc`, ...).
        split_id: Id of that split (data version + pipeline fingerprint).
        test_df: The split itself (features and target), or None when unavailable.
        target: Name of the target column.
        validation: Data validation evidence of its training data.
    """

    version: RegisteredVersion
    policy: PromotionSpec
    metrics: dict[str, float]
    split_id: Optional[str]
    test_df: Optional["pd.DataFrame"]
    target: Optional[str]
    validation: ValidationEvidence
