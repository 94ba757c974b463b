"""The promotion policy: when a registered version may become `champion`, and the record of each decision.

One decision, for model M and candidate version V, inside `ModelRegistry.lock(M)`
so that two promotions of one model never interleave:

1. V gets alias `challenger` (a rollback target is checked by its pinned URI instead).
2. Serving smoke test: a fresh process with only the serving dependencies loads
   `models:/M@challenger` and predicts on the input example and the pinned test
   split; its test accuracy must equal the training-side one.
3. The champion is scored on the same test split: its recorded metric when it was
   evaluated on that split, otherwise re-evaluated on it now.
4. The checks of `PromotionSpec` (threshold, beats_champion, data_validation,
   serving_smoke_test) are evaluated by pure functions.
5. `champion` moves to V when all pass, or when forced with a reason (an override).
6. The evidence goes to V's tags before the alias moves; each champion change
   is pushed on the model's champion history and published as a handoff event.

The same code serves the `registered_model` asset (action `register`) and
`trainyard registry promote|rollback` (actions `promote`, `rollback`).
"""

from __future__ import annotations

import getpass
import json
import math
import socket
import uuid
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, Mapping, Optional

from trainyard.spec import PromotionSpec
from resources.handoff import HandoffDeliveryFailed, HandoffEvent, HandoffPublisher, now_iso
from resources.registry import ModelRegistry, ModelVersionInfo, RegistryError, SmokeResult

if TYPE_CHECKING:
    import pandas as pd
    from dagster import DagsterInstance

CHAMPION = "champion"
CHALLENGER = "challenger"
Action = Literal["register", "promote", "rollback"]

P = "trainyard.promotion."
"""Prefix of the version tags that record a decision."""
HISTORY_TAG = "trainyard.champion.history"
"""Registered-model tag: JSON `{"stack": [versions], "log": [changes]}`; rollback pops the stack."""
POLICY_TAG = "trainyard.promotion_policy"
TEST_URI_TAG = "trainyard.test_uri"
TEST_SPLIT_TAG = "trainyard.test_split"
TARGET_TAG = "trainyard.target"
VALIDATION_TAG = "trainyard.validation"
VALIDATION_SUMMARY_TAG = "trainyard.validation.summary"
METRIC_TAG = "trainyard.metric."
HANDOFF_URI_TAG = "trainyard.handoff.event_uri"
HANDOFF_WEBHOOK_TAG = "trainyard.handoff.webhook"
LOG_LIMIT = 50
CHECK_NAMES = ("threshold", "beats_champion", "data_validation", "serving_smoke_test")


MAX_SMOKE_TIMEOUT_S = 1800.0


def lock_seconds(smoke_timeout_s: float) -> float:
    """How long a promotion may hold the model's lock: two smoke-test deadlines and some registry calls."""
    return max(900.0, 2 * smoke_timeout_s + 300.0)


class PromotionError(RegistryError):
    """A promotion or rollback request cannot be carried out as asked (terminal)."""


@dataclass(frozen=True)
class Check:
    """One policy check and its outcome, in words a reviewer can verify."""

    name: str
    passed: bool
    detail: str

    def as_dict(self) -> dict[str, Any]:
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

    def tags(self) -> dict[str, str]:
        return {VALIDATION_TAG: "passed" if self.passed else "failed", VALIDATION_SUMMARY_TAG: self.detail}

    @classmethod
    def from_tags(cls, tags: dict[str, str]) -> "ValidationEvidence":
        """The evidence recorded on a version at registration."""
        state = tags.get(VALIDATION_TAG)
        if state is None:
            return cls(False, "the version carries no data validation record (tag trainyard.validation)")
        summary = tags.get(VALIDATION_SUMMARY_TAG, "")
        return cls(state == "passed", f"recorded at registration: {state}" + (f" ({summary})" if summary else ""),
                   data_version=tags.get("trainyard.data_version"))


@dataclass(frozen=True)
class ChampionScore:
    """The current champion's policy metric on the candidate's test split."""

    version: str
    value: Optional[float]
    detail: str


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
        if self.already_champion:
            return "already_champion"
        if self.promoted:
            return "rolled_back_to" if self.action == "rollback" else "champion"
        return "rejected"

    def tags(self) -> dict[str, str]:
        """Version tags recording this decision (written before the alias moves)."""
        return {
            f"{P}decision": "champion" if self.promoted else "rejected",
            f"{P}action": self.action,
            f"{P}reason": self.reason,
            f"{P}at": self.at,
            f"{P}by": self.decided_by,
            f"{P}checks": json.dumps([c.as_dict() for c in self.checks]),
            f"{P}metric": self.metric,
            f"{P}value": "" if self.value is None else repr(self.value),
            f"{P}champion_before": self.champion_before or "",
            f"{P}champion_value": "" if self.champion_value is None else repr(self.champion_value),
            f"{P}override": "true" if self.override else "false",
            f"{P}override_reason": self.override_reason or "",
            "trainyard.smoke.passed": str(self.smoke.get("passed", "")).lower(),
            "trainyard.smoke.evidence": json.dumps(self.smoke, sort_keys=True),
        }

    def metadata(self) -> dict[str, Any]:
        """Dagster metadata for the asset that made the decision."""
        from dagster import MetadataValue

        rows = "\n".join(f"| {c.name} | {'pass' if c.passed else 'FAIL'} | {c.detail} |" for c in self.checks)
        return {
            "decision": self.outcome,
            "decision_reason": self.reason,
            "champion": self.champion,
            "champion_before": self.champion_before or "",
            "override": self.override,
            "checks": MetadataValue.md("| check | result | evidence |\n|---|---|---|\n" + rows) if rows else "",
            "smoke_test": MetadataValue.json(self.smoke),
            "handoff_event": MetadataValue.path(self.handoff_uri) if self.handoff_uri else "",
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


def check_beats_champion(
    policy: PromotionSpec, value: Optional[float], champion: Optional[ChampionScore], split_id: Optional[str]
) -> Check:
    """The relative bound: better than the champion by more than `min_improvement`, same split."""
    if champion is None:
        return Check("beats_champion", True, "no champion yet: the first version that passes becomes champion")
    if value is None or math.isnan(value):
        return Check("beats_champion", False, f"{policy.metric} was not measured for this version")
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
    return Check("data_validation", evidence.passed, evidence.detail)


SERVED_METRICS = ("test_acc", "test_rmse")
"""Test metrics the smoke test recomputes from served predictions (first one recorded wins)."""


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
    smoke: Optional[SmokeResult],
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
        training_metrics: Metrics the training process measured; the first of
            `SERVED_METRICS` among them is recomputed from the served predictions
            and must match.

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
        name = next((m for m in SERVED_METRICS if m in training_metrics), None)
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
    """
    if relative:
        beats = check_beats_champion(policy, value, champion, split_id)
    else:
        beats = Check("beats_champion", True, "not applied: a rollback restores an earlier version on purpose")
    return (check_threshold(policy, value), beats, check_validation(validation), smoke)


def summarize(checks: tuple[Check, ...], *, force: bool, reason: Optional[str]) -> str:
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


# -- evidence gathering ----------------------------------------------------------


def validation_evidence(
    instance: "DagsterInstance",
    validated_key: Any,
    check_name: str,
    data_version: str,
    quarantined: bool,
) -> ValidationEvidence:
    """Finds the expectations check that passed for `data_version`, in the Dagster event log.

    The evidence is the check evaluated in the run of the latest `validated_data`
    materialization, which must be of `data_version` (a later failed validation of
    other data does not count against it, a quarantine of this data does).
    """
    from dagster import AssetCheckKey

    if quarantined:
        return ValidationEvidence(False, f"data version {data_version} is quarantined", data_version)
    event = instance.get_latest_materialization_event(validated_key)
    if event is None or event.asset_materialization is None:
        return ValidationEvidence(False, f"no materialization of {validated_key.to_user_string()} is recorded", data_version)
    entry = event.asset_materialization.metadata.get("data_version")
    recorded = getattr(entry, "value", entry)
    if recorded != data_version:
        return ValidationEvidence(
            False, f"the latest validated data is version {recorded}, the model was trained on {data_version}", data_version
        )
    check_key = AssetCheckKey(validated_key, check_name)
    records = instance.event_log_storage.get_asset_check_execution_history(check_key, limit=100)
    record = next((r for r in records if r.run_id == event.run_id), None)
    if record is None or record.event is None or record.event.dagster_event is None:
        return ValidationEvidence(False, f"no {check_name} check is recorded in run {event.run_id}", data_version, run_id=event.run_id)
    evaluation = record.event.dagster_event.event_specific_data
    meta = {k: getattr(v, "value", v) for k, v in (getattr(evaluation, "metadata", None) or {}).items()}
    passed = bool(getattr(evaluation, "passed", False))
    expectations = _int_or_none(meta.get("expectations"))
    failed = _int_or_none(meta.get("failed"))
    max_psi = _float_or_none(meta.get("max_psi"))
    detail = (
        f"{check_name} check {'passed' if passed else 'FAILED'} for data version {data_version} in run {event.run_id[:8]}: "
        f"{expectations} expectations, {failed} failed, max drift PSI {0.0 if max_psi is None else max_psi:.4f}"
    )
    return ValidationEvidence(passed, detail, data_version, expectations, failed, max_psi, event.run_id)


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


def recorded_metrics(tags: dict[str, str]) -> dict[str, float]:
    """The metrics recorded on a version as `trainyard.metric.<name>` tags."""
    out = {}
    for key, value in tags.items():
        if key.startswith(METRIC_TAG):
            number = _float_or_none(value)
            if number is not None:
                out[key[len(METRIC_TAG):]] = number
    return out


def score_champion(
    registry: ModelRegistry,
    policy: PromotionSpec,
    champion: ModelVersionInfo,
    split_id: Optional[str],
    test_df: Optional["pd.DataFrame"],
    target: Optional[str],
) -> ChampionScore:
    """The champion's metric on `split_id`: recorded when measured there, else re-evaluated now."""
    recorded = recorded_metrics(champion.tags).get(policy.metric)
    if recorded is not None and split_id is not None and champion.tags.get(TEST_SPLIT_TAG) == split_id:
        return ChampionScore(champion.version, recorded, "recorded on this split")
    if test_df is None or target is None:
        return ChampionScore(champion.version, None, f"it was measured on split {champion.tags.get(TEST_SPLIT_TAG)} and no test data is available")
    if not policy.metric.endswith(("_acc", "_rmse")):
        return ChampionScore(
            champion.version, None,
            f"it was measured on another split and {policy.metric!r} cannot be re-evaluated (only *_acc and *_rmse can)",
        )
    predictions = registry.predict(champion.model_uri, test_df.drop(columns=[target])).tolist()
    value = served_metric(policy.metric, predictions, test_df[target].tolist())
    return ChampionScore(champion.version, value, "re-evaluated on this split")


def load_history(registry: ModelRegistry, model: str) -> dict[str, Any]:
    raw = registry.get_model_tags(model).get(HISTORY_TAG)
    if not raw:
        return {"stack": [], "log": []}
    try:
        history = json.loads(raw)
    except json.JSONDecodeError as e:
        raise PromotionError(f"tag {HISTORY_TAG} of {model!r} is not valid JSON: {e}") from e
    return history if isinstance(history, dict) else {"stack": [], "log": []}


def cli_actor() -> str:
    """`user@host` of whoever runs the CLI."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"cli {user}@{socket.gethostname()}"


# -- the decision ------------------------------------------------------------------


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

    version: ModelVersionInfo
    policy: PromotionSpec
    metrics: dict[str, float]
    split_id: Optional[str]
    test_df: Optional["pd.DataFrame"]
    target: Optional[str]
    validation: ValidationEvidence


def decide(
    registry: ModelRegistry,
    handoff: HandoffPublisher,
    candidate: Candidate,
    *,
    action: Action,
    decided_by: str,
    force: bool = False,
    reason: Optional[str] = None,
) -> Decision:
    """Applies the policy to one candidate and moves `champion` when it passes (or is forced).

    Args:
        registry: The model registry.
        handoff: Publishes the event of a champion change.
        candidate: The version and its evidence.
        action: `register` (the asset), `promote` or `rollback` (the CLI).
        decided_by: Who decides, recorded with the decision.
        force: Move the alias even when checks fail; needs `reason`.
        reason: Why the override is justified (required with `force`).

    Returns:
        The decision; `promoted` tells whether the alias moved.

    Raises:
        ValueError: `force` without a reason.
        RegistryError: The registry failed; the evidence tags may be written but the
            alias moved only if the error came after it (see the module docstring).
        HandoffDeliveryFailed: The champion moved and the event is recorded, but the
            webhook did not accept it; re-running re-delivers it.
    """
    if force and not (reason or "").strip():
        raise ValueError("force=True needs reason=...: an override is recorded with its justification")
    model = candidate.version.name
    ttl = lock_seconds(candidate.policy.smoke_test_timeout_s)
    with registry.lock(model, purpose=f"{action} v{candidate.version.version} by {decided_by}", ttl_s=ttl, wait_s=ttl):
        return _decide_locked(registry, handoff, candidate, action=action, decided_by=decided_by, force=force, reason=reason)


def _decide_locked(
    registry: ModelRegistry,
    handoff: HandoffPublisher,
    candidate: Candidate,
    *,
    action: Action,
    decided_by: str,
    force: bool,
    reason: Optional[str],
) -> Decision:
    version = candidate.version
    model, policy = version.name, candidate.policy
    value = candidate.metrics.get(policy.metric)
    current = registry.get_alias(model, CHAMPION)
    if current is not None and current.version == version.version:
        return _already_champion(registry, handoff, current, action, decided_by, value, policy.metric)

    if action == "rollback":
        smoke_uri = version.model_uri
    else:
        registry.set_alias(model, CHALLENGER, version.version)
        smoke_uri = f"models:/{model}@{CHALLENGER}"
    samples = {}
    labels = None
    if candidate.test_df is not None and candidate.target is not None:
        samples["test"] = candidate.test_df.drop(columns=[candidate.target])
        labels = candidate.test_df[candidate.target].tolist()
    smoke = registry.smoke_test(smoke_uri, samples, timeout_s=policy.smoke_test_timeout_s)
    smoke_chk, smoke_evidence = check_smoke(
        policy, smoke, run_id=version.run_id, test_labels=labels, training_metrics=candidate.metrics
    )

    champion = None
    if current is not None and action != "rollback":
        champion = score_champion(registry, policy, current, candidate.split_id, candidate.test_df, candidate.target)
    checks = evaluate_policy(
        policy, value=value, champion=champion, split_id=candidate.split_id,
        validation=candidate.validation, smoke=smoke_chk, relative=action != "rollback",
    )
    passed = all(c.passed for c in checks)
    override = force and not passed
    decision = Decision(
        model=model, version=version.version, action=action, promoted=passed or force, already_champion=False,
        reason=summarize(checks, force=override, reason=reason), checks=checks, metric=policy.metric, value=value,
        champion_before=current.version if current else None, champion_value=champion.value if champion else None,
        override=override, override_reason=reason if force else None, decided_by=decided_by, at=now_iso(),
        smoke=smoke_evidence,
    )
    # Evidence first: a version never holds the alias without the record of why.
    registry.set_version_tags(model, version.version, decision.tags())
    if not decision.promoted:
        return decision

    history = load_history(registry, model)
    registry.set_alias(model, CHAMPION, version.version)
    entry = {"version": version.version, "action": action, "at": decision.at, "by": decided_by,
             "from": decision.champion_before, "override": override}
    registry.set_model_tags(model, {HISTORY_TAG: json.dumps(next_history(
        history, action=action, version=version.version, current=decision.champion_before, entry=entry))})
    if current is not None:
        key = "trainyard.champion.rolled_back" if action == "rollback" else "trainyard.champion.replaced"
        registry.set_version_tags(model, current.version, {key: f"{decision.at}: by v{version.version} ({decided_by})"})
    event = _event(registry, decision, version)
    return replace(decision, **_publish(registry, handoff, event, model, version.version))


def _already_champion(
    registry: ModelRegistry, handoff: HandoffPublisher, current: ModelVersionInfo, action: Action,
    decided_by: str, value: Optional[float], metric: str,
) -> Decision:
    """Nothing to decide; finish the handoff if an earlier run was interrupted before it."""
    tags = current.tags
    handoff_uri = tags.get(HANDOFF_URI_TAG)
    webhook = tags.get(HANDOFF_WEBHOOK_TAG)
    checks = tuple(Check(**c) for c in json.loads(tags.get(f"{P}checks", "[]")))
    decision = Decision(
        model=current.name, version=current.version, action=action, promoted=False, already_champion=True,
        reason=f"version {current.version} is already {CHAMPION} ({tags.get(f'{P}reason', 'promoted before trainyard recorded evidence')})",
        checks=checks, metric=metric, value=value, decided_by=decided_by, at=now_iso(),
        smoke=json.loads(tags.get("trainyard.smoke.evidence", "{}")), handoff_uri=handoff_uri, webhook=webhook,
    )
    if handoff_uri and webhook and not webhook.startswith("failed"):
        return decision
    if handoff_uri:
        event = handoff.read(handoff_uri)
        return replace(decision, **_deliver(registry, handoff, event, handoff_uri, current.name, current.version))
    event = _event(registry, replace(decision, reason=tags.get(f"{P}reason", decision.reason),
                                      override=tags.get(f"{P}override") == "true"), current)
    return replace(decision, **_publish(registry, handoff, event, current.name, current.version))


def _event(registry: ModelRegistry, decision: Decision, version: ModelVersionInfo) -> HandoffEvent:
    lineage_keys = ("data_version", "code_version", "code_dirty", "lock_hash", "trial", "study",
                    "checkpoint_uri", "tracker_run", "pipeline", "test_split")
    return HandoffEvent(
        event_id=uuid.uuid4().hex,
        model=version.name,
        version=version.version,
        alias=CHAMPION,
        alias_uri=f"models:/{version.name}@{CHAMPION}",
        model_uri=version.model_uri,
        artifact_uri=registry.artifact_uri(version.name, version.version),
        previous_version=decision.champion_before,
        action="rollback" if decision.action == "rollback" else "promote",
        override=decision.override,
        reason=decision.reason,
        decided_by=decision.decided_by,
        at=decision.at,
        run_id=version.run_id,
        lineage={k: version.tags[f"trainyard.{k}"] for k in lineage_keys if f"trainyard.{k}" in version.tags},
        checks=[c.as_dict() for c in decision.checks],
    )


def _publish(registry: ModelRegistry, handoff: HandoffPublisher, event: HandoffEvent, model: str, version: str) -> dict[str, Any]:
    uri = handoff.event_uri(event)
    try:
        receipt = handoff.publish(event)
    except HandoffDeliveryFailed as e:
        registry.set_version_tags(model, version, {HANDOFF_URI_TAG: e.uri, HANDOFF_WEBHOOK_TAG: f"failed: {e}"[:2000]})
        raise
    registry.set_version_tags(model, version, {HANDOFF_URI_TAG: uri, HANDOFF_WEBHOOK_TAG: receipt.webhook})
    return {"handoff_uri": uri, "webhook": receipt.webhook}


def _deliver(registry: ModelRegistry, handoff: HandoffPublisher, event: HandoffEvent, uri: str, model: str, version: str) -> dict[str, Any]:
    try:
        receipt = handoff.deliver(event, uri)
    except HandoffDeliveryFailed as e:
        registry.set_version_tags(model, version, {HANDOFF_WEBHOOK_TAG: f"failed: {e}"[:2000]})
        raise
    registry.set_version_tags(model, version, {HANDOFF_WEBHOOK_TAG: receipt.webhook})
    return {"handoff_uri": uri, "webhook": receipt.webhook}


# -- entry points for the CLI ------------------------------------------------------


def candidate_from_tags(registry: ModelRegistry, store: Any, version: ModelVersionInfo) -> Candidate:
    """Rebuilds a candidate from what was recorded on the version at registration.

    The policy is the one declared when the version was registered
    (`trainyard.promotion_policy`), the test data is the pinned split it was
    evaluated on (`trainyard.test_uri`), read through the environment's object store.
    """
    import pandas as pd

    tags = version.tags
    raw_policy = tags.get(POLICY_TAG)
    try:
        policy = PromotionSpec.model_validate_json(raw_policy) if raw_policy else PromotionSpec()
    except ValueError as e:
        raise PromotionError(f"v{version.version}: tag {POLICY_TAG} is not a valid promotion policy: {e}") from e
    test_df = None
    test_uri = tags.get(TEST_URI_TAG)
    if test_uri and store is not None and store.exists(test_uri):
        with store.open(test_uri, "rb") as f:
            test_df = pd.read_parquet(f)
    return Candidate(
        version=version,
        policy=policy,
        metrics=recorded_metrics(tags),
        split_id=tags.get(TEST_SPLIT_TAG),
        test_df=test_df,
        target=tags.get(TARGET_TAG) if test_df is not None else None,
        validation=_validation_now(store, tags),
    )


def is_quarantined(store: Any, pipeline: str, md5: str) -> bool:
    """Whether a data version sits in quarantine and has not been released (with a recorded reason)."""
    where = store.uri("quarantine", *pipeline.split("/"), md5)
    return store.exists(where) and not store.exists(f"{where}/release.json")


def _validation_now(store: Any, tags: dict[str, str]) -> ValidationEvidence:
    """Recorded validation evidence, failed if the data has been quarantined (and not released) since."""
    evidence = ValidationEvidence.from_tags(tags)
    pipeline, md5 = tags.get("trainyard.pipeline"), tags.get("trainyard.data_version")
    if evidence.passed and store is not None and pipeline and md5 and is_quarantined(store, pipeline, md5):
        where = store.uri("quarantine", *pipeline.split("/"), md5)
        return ValidationEvidence(False, f"data version {md5} has been quarantined since ({where})", md5)
    return evidence


def promote(
    registry: ModelRegistry,
    handoff: HandoffPublisher,
    store: Any,
    model: str,
    *,
    version: Optional[str] = None,
    force: bool = False,
    reason: Optional[str] = None,
    decided_by: Optional[str] = None,
) -> Decision:
    """`trainyard registry promote`: applies the policy to `version` (default: the challenger).

    Raises:
        PromotionError: No version given and no challenger exists.
        ValueError: `force` without a reason.
        RegistryError: As for `decide`.
    """
    if version is None:
        challenger = registry.get_alias(model, CHALLENGER)
        if challenger is None:
            raise PromotionError(f"{model!r} has no {CHALLENGER} alias; name the version with --version")
        version = challenger.version
    info = registry.get_version(model, version)
    return decide(registry, handoff, candidate_from_tags(registry, store, info), action="promote",
                  decided_by=decided_by or cli_actor(), force=force, reason=reason)


def rollback(
    registry: ModelRegistry,
    handoff: HandoffPublisher,
    store: Any,
    model: str,
    *,
    version: Optional[str] = None,
    force: bool = False,
    reason: Optional[str] = None,
    decided_by: Optional[str] = None,
) -> Decision:
    """`trainyard registry rollback`: moves `champion` back (default: to the previous champion).

    The same checks apply except beats_champion (a rollback may go to a weaker
    model on purpose); the target's smoke test loads it by its pinned URI.

    Raises:
        PromotionError: No champion, or no earlier champion on record and no version given.
        ValueError: `force` without a reason.
        RegistryError: As for `decide`.
    """
    if force and not (reason or "").strip():
        raise ValueError("force=True needs reason=...: an override is recorded with its justification")
    actor = decided_by or cli_actor()
    ttl = lock_seconds(MAX_SMOKE_TIMEOUT_S)  # the target, and so its policy, is chosen under the lock
    with registry.lock(model, purpose=f"rollback by {actor}", ttl_s=ttl, wait_s=ttl):
        if version is None:
            current = registry.get_alias(model, CHAMPION)
            version = rollback_target(load_history(registry, model), current.version if current else None)
        info = registry.get_version(model, version)
        candidate = candidate_from_tags(registry, store, info)
        return _decide_locked(registry, handoff, candidate, action="rollback", decided_by=actor, force=force, reason=reason)
