"""Promotion against the registry: applies `trainyard.promotion`'s policy and records the decision.

One decision, for model M and candidate version V, runs inside
`ModelRegistry.lock(M)` so that two promotions of one model never interleave;
the steps and their order are those of `trainyard.promotion`. The evidence goes
to V's tags before `champion` moves, so a version never holds the alias without
the record of why; each champion change is pushed on M's champion history and
published through the `HandoffPublisher`.

The `registered_model` asset calls `decide` (action `register`);
`trainyard registry promote|rollback` call `promote` and `rollback`.

The clean-lineage check compares the version's recorded lineage with this
process: the environment is `TRAINYARD_ENV` (default `local`; the orchestrator
image sets `cluster`), the deployed dependency lock is this orchestrator's
(`trainyard.lineage.lock_hash()`).
"""

from __future__ import annotations

import getpass
import json
import socket
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Optional

from dagster import AssetCheckKey, AssetKey, DagsterInstance, MetadataValue

from common.settings import settings
from resources.handoff import HandoffDeliveryFailed, HandoffEvent, HandoffPublisher, now_iso
from resources.registry import ModelRegistry, ModelVersionInfo
from trainyard.lineage import (
    CHAMPION_REPLACED_TAG,
    CHAMPION_ROLLED_BACK_TAG,
    HANDOFF_URI_TAG,
    HANDOFF_WEBHOOK_TAG,
    HISTORY_TAG,
    PROMOTION_PREFIX,
    PROMOTION_REASON_TAG,
    SMOKE_EVIDENCE_TAG,
    TARGET_TAG,
    TEST_SPLIT_TAG,
    TEST_URI_TAG,
    LineageRecord,
    lock_hash,
)
from trainyard.promotion import (
    CHALLENGER,
    CHAMPION,
    CLEAN_LINEAGE_DEFAULTS,
    MAX_SMOKE_TIMEOUT_S,
    POSITIVE_LABEL_TAG,
    SERVED_METRICS,
    Action,
    Candidate,
    ChampionScore,
    Check,
    Decision,
    PromotionError,
    RegisteredVersion,
    ValidationEvidence,
    check_lineage,
    check_smoke,
    comparable_value,
    evaluate_policy,
    evidence_from_check,
    lock_seconds,
    next_history,
    parse_history,
    recorded_metrics,
    recorded_policy,
    rollback_target,
    served_metric,
    summarize,
    validation_now,
)
from trainyard.promotion.served import LM_PARAMS
from trainyard.spec import PromotionSpec
from trainyard.store import FileStore

if TYPE_CHECKING:
    import pandas as pd


# -- evidence from Dagster and the registry ------------------------------------------


def validation_evidence(
    instance: DagsterInstance,
    validated_key: AssetKey,
    check_name: str,
    data_version: str,
    quarantined: bool,
) -> ValidationEvidence:
    """Finds the expectations check that passed for `data_version`, in the Dagster event log.

    The evidence is the check evaluated in the run of the latest `validated_data`
    materialization, which must be of `data_version` (a later failed validation of
    other data does not count against it, a quarantine of this data does).
    """
    if quarantined:
        return ValidationEvidence(False, f"data version {data_version} is quarantined", data_version)
    event = instance.get_latest_materialization_event(validated_key)
    if event is None or event.asset_materialization is None:
        return ValidationEvidence(
            False, f"no materialization of {validated_key.to_user_string()} is recorded", data_version
        )
    entry = event.asset_materialization.metadata.get("data_version")
    recorded = getattr(entry, "value", entry)
    if recorded != data_version:
        return ValidationEvidence(
            False,
            f"the latest validated data is version {recorded}, the model was trained on {data_version}",
            data_version,
        )
    check_key = AssetCheckKey(validated_key, check_name)
    records = instance.event_log_storage.get_asset_check_execution_history(check_key, limit=100)
    record = next((r for r in records if r.run_id == event.run_id), None)
    if record is None or record.event is None or record.event.dagster_event is None:
        return ValidationEvidence(
            False, f"no {check_name} check is recorded in run {event.run_id}", data_version, run_id=event.run_id
        )
    evaluation = record.event.dagster_event.event_specific_data
    meta = {k: getattr(v, "value", v) for k, v in (getattr(evaluation, "metadata", None) or {}).items()}
    return evidence_from_check(check_name, data_version, event.run_id, bool(getattr(evaluation, "passed", False)), meta)


def decision_metadata(decision: Decision) -> dict[str, Any]:
    """Dagster metadata for the asset that made the decision."""
    rows = "\n".join(f"| {c.name} | {_result(c)} | {c.detail} |" for c in decision.checks)
    return {
        "decision": decision.outcome,
        "decision_reason": decision.reason,
        "champion": decision.champion,
        "champion_before": decision.champion_before or "",
        "override": decision.override,
        "warnings": "\n".join(decision.warnings),
        "checks": MetadataValue.md("| check | result | evidence |\n|---|---|---|\n" + rows) if rows else "",
        "smoke_test": MetadataValue.json(decision.smoke),
        "handoff_event": MetadataValue.path(decision.handoff_uri) if decision.handoff_uri else "",
    }


def _result(check: Check) -> str:
    return "FAIL" if not check.passed else "WARN" if check.warning else "pass"


def deciding_environment(environment: Optional[str] = None) -> str:
    """The environment whose clean-lineage default applies: `environment`, else `TRAINYARD_ENV` (default `local`).

    Raises:
        ValueError: Not an environment with a clean-lineage default.
    """
    name = environment or settings().env
    if name not in CLEAN_LINEAGE_DEFAULTS:
        raise ValueError(f"TRAINYARD_ENV={name!r} is not an environment; use one of {sorted(CLEAN_LINEAGE_DEFAULTS)}")
    return name


def score_champion(
    registry: ModelRegistry,
    policy: PromotionSpec,
    champion: ModelVersionInfo,
    split_id: Optional[str],
    test_df: Optional["pd.DataFrame"],
    target: Optional[str],
    positive_label: Any = None,
    params: Optional[dict[str, Any]] = None,
) -> ChampionScore:
    """The champion's metric on `split_id`: recorded when measured there, else re-evaluated now.

    The re-evaluation predicts with the champion as it is served and computes
    `policy.metric` from its served labels and probabilities (`served_metric`,
    the pod's own metric code), for every metric a `PromotionSpec` accepts.
    A champion that cannot be scored (a probability metric of a version that
    serves labels only) is reported with the reason; it blocks beats_champion.
    """
    recorded = recorded_metrics(champion.tags).get(policy.metric)
    if recorded is not None and split_id is not None and champion.tags.get(TEST_SPLIT_TAG) == split_id:
        return ChampionScore(champion.version, recorded, "recorded on this split")
    measured = champion.tags.get(TEST_SPLIT_TAG)
    if test_df is None or target is None:
        return ChampionScore(
            champion.version, None, f"it was measured on split {measured} and no test data is available"
        )
    if policy.metric not in SERVED_METRICS:
        return ChampionScore(
            champion.version,
            None,
            f"it was measured on another split and {policy.metric!r} cannot be re-evaluated (one of "
            f"{list(SERVED_METRICS)} can)",
        )
    output = registry.predict_output(champion.model_uri, test_df.drop(columns=[target]), params=params)
    try:
        value = served_metric(
            policy.metric, output, test_df[target].tolist(), target=target, positive_label=positive_label
        )
    except ValueError as e:
        return ChampionScore(
            champion.version, None, f"it was measured on split {measured} and cannot be re-evaluated on this one: {e}"
        )
    return ChampionScore(champion.version, value, "re-evaluated on this split", served=True)


def load_history(registry: ModelRegistry, model: str) -> dict[str, Any]:
    """The model's champion history (`trainyard.promotion.next_history` writes it)."""
    return parse_history(registry.get_model_tags(model).get(HISTORY_TAG), model, HISTORY_TAG)


def cli_actor() -> str:
    """`user@host` of whoever runs the CLI."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"cli {user}@{socket.gethostname()}"


PROMPT_TOKENS = 8
"""A language model's smoke test continues the first test row's first tokens."""
GENERATED_TOKENS = 16


def _prompt(test_df: Optional["pd.DataFrame"]) -> Optional[dict[str, Any]]:
    """The prompt a language model's smoke test continues: the first `PROMPT_TOKENS` ids of the test sample's first
    row."""
    if test_df is None or "tokens" not in test_df.columns or test_df.empty:
        return None
    return {
        "prompt_tokens": [int(t) for t in list(test_df["tokens"].iloc[0])[:PROMPT_TOKENS]],
        "max_new_tokens": GENERATED_TOKENS,
    }


# -- the decision ------------------------------------------------------------------


def decide(
    registry: ModelRegistry,
    handoff: HandoffPublisher,
    candidate: Candidate,
    *,
    action: Action,
    decided_by: str,
    force: bool = False,
    reason: Optional[str] = None,
    environment: Optional[str] = None,
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
        environment: Whose clean-lineage default applies (default `deciding_environment()`).

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
    environment = deciding_environment(environment)
    model = candidate.version.name
    ttl = lock_seconds(candidate.policy.smoke_test_timeout_s)
    with registry.lock(model, purpose=f"{action} v{candidate.version.version} by {decided_by}", ttl_s=ttl, wait_s=ttl):
        return _decide_locked(
            registry,
            handoff,
            candidate,
            action=action,
            decided_by=decided_by,
            force=force,
            reason=reason,
            environment=environment,
        )


def _decide_locked(
    registry: ModelRegistry,
    handoff: HandoffPublisher,
    candidate: Candidate,
    *,
    action: Action,
    decided_by: str,
    force: bool,
    reason: Optional[str],
    environment: Optional[str] = None,
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
    smoke = registry.smoke_test(smoke_uri, samples, timeout_s=policy.smoke_test_timeout_s,
                                **({"params": {"test": candidate.params}} if candidate.params else {}),
                                **({"generate": _prompt(candidate.test_df)} if candidate.params == LM_PARAMS else {}))
    smoke_chk, smoke_evidence = check_smoke(
        policy, smoke, run_id=version.run_id, test_labels=labels, training_metrics=candidate.metrics,
        target=candidate.target, positive_label=candidate.positive_label, sample_note=candidate.sample_note,
    )

    champion = None
    if current is not None and action != "rollback":
        champion = score_champion(registry, policy, current, candidate.split_id, candidate.test_df, candidate.target,
                                  candidate.positive_label, candidate.params)
    compared, _ = comparable_value(policy, value, champion, smoke_evidence)
    lineage = check_lineage(
        policy,
        version.tags,
        environment=deciding_environment(environment),
        deployed_lock=lock_hash(),
        model=model,
        version=version.version,
        command="rollback" if action == "rollback" else "promote",
    )
    checks = evaluate_policy(
        policy, value=value, compared=compared, champion=champion, split_id=candidate.split_id,
        validation=candidate.validation, smoke=smoke_chk, relative=action != "rollback", lineage=lineage,
        baseline=candidate.metrics.get(f"baseline_{policy.metric}"),
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
        key = CHAMPION_ROLLED_BACK_TAG if action == "rollback" else CHAMPION_REPLACED_TAG
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
    checks = tuple(Check(**c) for c in json.loads(tags.get(f"{PROMOTION_PREFIX}checks", "[]")))
    decision = Decision(
        model=current.name,
        version=current.version,
        action=action,
        promoted=False,
        already_champion=True,
        reason=f"version {current.version} is already {CHAMPION} "
               f"({tags.get(PROMOTION_REASON_TAG, 'promoted before trainyard recorded evidence')})",
        checks=checks,
        metric=metric,
        value=value,
        decided_by=decided_by,
        at=now_iso(),
        smoke=json.loads(tags.get(SMOKE_EVIDENCE_TAG, "{}")),
        handoff_uri=handoff_uri,
        webhook=webhook,
    )
    if handoff_uri and webhook and not webhook.startswith("failed"):
        return decision
    if handoff_uri:
        event = handoff.read(handoff_uri)
        return replace(decision, **_deliver(registry, handoff, event, handoff_uri, current.name, current.version))
    event = _event(registry, replace(decision, reason=tags.get(PROMOTION_REASON_TAG, decision.reason),
                                      override=tags.get(f"{PROMOTION_PREFIX}override") == "true"), current)
    return replace(decision, **_publish(registry, handoff, event, current.name, current.version))


def _event(registry: ModelRegistry, decision: Decision, version: RegisteredVersion) -> HandoffEvent:
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
        lineage={k: version.tags[LineageRecord.tag(k)] for k in lineage_keys if LineageRecord.tag(k) in version.tags},
        checks=[c.as_dict() for c in decision.checks],
    )


def _publish(
    registry: ModelRegistry, handoff: HandoffPublisher, event: HandoffEvent, model: str, version: str
) -> dict[str, Any]:
    uri = handoff.event_uri(event)
    try:
        receipt = handoff.publish(event)
    except HandoffDeliveryFailed as e:
        registry.set_version_tags(model, version, {HANDOFF_URI_TAG: e.uri, HANDOFF_WEBHOOK_TAG: f"failed: {e}"[:2000]})
        raise
    registry.set_version_tags(model, version, {HANDOFF_URI_TAG: uri, HANDOFF_WEBHOOK_TAG: receipt.webhook})
    return {"handoff_uri": uri, "webhook": receipt.webhook}


def _deliver(
    registry: ModelRegistry, handoff: HandoffPublisher, event: HandoffEvent, uri: str, model: str, version: str
) -> dict[str, Any]:
    try:
        receipt = handoff.deliver(event, uri)
    except HandoffDeliveryFailed as e:
        registry.set_version_tags(model, version, {HANDOFF_WEBHOOK_TAG: f"failed: {e}"[:2000]})
        raise
    registry.set_version_tags(model, version, {HANDOFF_WEBHOOK_TAG: receipt.webhook})
    return {"handoff_uri": uri, "webhook": receipt.webhook}


# -- entry points for the CLI ------------------------------------------------------


def candidate_from_tags(registry: ModelRegistry, store: Optional[FileStore], version: ModelVersionInfo) -> Candidate:
    """Rebuilds a candidate from what was recorded on the version at registration.

    The policy is the one declared when the version was registered
    (`trainyard.promotion_policy`), the test data is the pinned split it was
    evaluated on (`trainyard.test_uri`), read through the environment's object store.
    """
    import pandas as pd  # the data stack loads only when a CLI decision needs the test split

    tags = version.tags
    policy = recorded_policy(version)
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
        validation=validation_now(store, tags),
        positive_label=json.loads(tags[POSITIVE_LABEL_TAG]) if tags.get(POSITIVE_LABEL_TAG) else None,
    )


def promote(
    registry: ModelRegistry,
    handoff: HandoffPublisher,
    store: Optional[FileStore],
    model: str,
    *,
    version: Optional[str] = None,
    force: bool = False,
    reason: Optional[str] = None,
    decided_by: Optional[str] = None,
    environment: Optional[str] = None,
) -> Decision:
    """`trainyard registry promote`: applies the policy to `version` (default: the challenger).

    `force` with `reason` makes the version champion past failing checks (an
    unclean lineage where it is required included), recorded as an override.

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
                  decided_by=decided_by or cli_actor(), force=force, reason=reason, environment=environment)


def rollback(
    registry: ModelRegistry,
    handoff: HandoffPublisher,
    store: Optional[FileStore],
    model: str,
    *,
    version: Optional[str] = None,
    force: bool = False,
    reason: Optional[str] = None,
    decided_by: Optional[str] = None,
    environment: Optional[str] = None,
) -> Decision:
    """`trainyard registry rollback`: moves `champion` back (default: to the previous champion).

    The same checks apply except beats_champion (a rollback may go to a weaker
    model on purpose); the target's smoke test loads it by its pinned URI.
    clean_lineage applies too: after the deployed lock changed, rolling back to a
    version trained with the old one needs `force` where clean lineage is required.

    Raises:
        PromotionError: No champion, or no earlier champion on record and no version given.
        ValueError: `force` without a reason.
        RegistryError: As for `decide`.
    """
    if force and not (reason or "").strip():
        raise ValueError("force=True needs reason=...: an override is recorded with its justification")
    actor = decided_by or cli_actor()
    environment = deciding_environment(environment)
    ttl = lock_seconds(MAX_SMOKE_TIMEOUT_S)  # the target, and so its policy, is chosen under the lock
    with registry.lock(model, purpose=f"rollback by {actor}", ttl_s=ttl, wait_s=ttl):
        if version is None:
            current = registry.get_alias(model, CHAMPION)
            version = rollback_target(load_history(registry, model), current.version if current else None)
        info = registry.get_version(model, version)
        candidate = candidate_from_tags(registry, store, info)
        return _decide_locked(
            registry,
            handoff,
            candidate,
            action="rollback",
            decided_by=actor,
            force=force,
            reason=reason,
            environment=environment,
        )
