"""The clean-lineage check: a champion is trained from committed code with the deployed dependency lock.

Every registered version records the code it was trained from (`trainyard.code_version`,
`trainyard.code_dirty`) and the hash of the dependency lock of the environment that
trained it (`trainyard.lock_hash`, see `trainyard.lineage`). This check reads those tags
and compares the lock with the *deployed* one: the lock hash of the orchestrator making
the decision (`trainyard.lineage.lock_hash()`), which is the environment the champion
will be reproduced and served next to.

Whether a finding blocks is a field of the policy,
`PromotionSpec.require_clean_lineage`: True blocks, False only warns, None (the
default) takes the environment's default (`CLEAN_LINEAGE_DEFAULTS`): required in
`cluster`, a warning in `local`. A blocked version still becomes champion with
`trainyard registry promote <model> --version <v> --force --reason "..."`, which is
recorded as an override.
"""

from __future__ import annotations

from typing import Mapping, Optional

from trainyard.lineage import CODE_VERSION_TAG, LOCK_HASH_TAG, LineageRecord
from trainyard.promotion.records import Check
from trainyard.spec import PromotionSpec

CLEAN_LINEAGE_DEFAULTS: dict[str, bool] = {"local": False, "cluster": True}
"""Whether an environment requires clean lineage when the policy leaves it to the environment (None)."""

CODE_DIRTY_TAG = LineageRecord.tag("code_dirty")
UNKNOWN = ("", "None", "unknown")
"""Recorded values that say nothing: the tag was written without a value, or outside a git checkout / without a lock."""


def clean_lineage_required(policy: PromotionSpec, environment: str) -> tuple[bool, str]:
    """Whether `policy` blocks unclean lineage in `environment`, and why, in words for the decision.

    Raises:
        ValueError: `environment` is not one of `CLEAN_LINEAGE_DEFAULTS` (only consulted when the policy says None).
    """
    if policy.require_clean_lineage is not None:
        return policy.require_clean_lineage, f"PromotionSpec.require_clean_lineage={policy.require_clean_lineage}"
    if environment not in CLEAN_LINEAGE_DEFAULTS:
        raise ValueError(
            f"environment {environment!r} has no clean-lineage default; use one of {sorted(CLEAN_LINEAGE_DEFAULTS)} "
            "(TRAINYARD_ENV) or set PromotionSpec(require_clean_lineage=True|False)"
        )
    required = CLEAN_LINEAGE_DEFAULTS[environment]
    return required, f"the {environment} environment's default (PromotionSpec.require_clean_lineage=None)"


def lineage_findings(tags: Mapping[str, str], deployed_lock: str) -> list[str]:
    """What keeps a version's recorded lineage from being clean, one sentence each (empty: clean).

    Args:
        tags: The version's tags (`LineageRecord.to_tags` wrote the lineage ones).
        deployed_lock: The orchestrator's own dependency lock hash (`trainyard.lineage.lock_hash()`).
    """
    findings = []
    commit = tags.get(CODE_VERSION_TAG, "")
    dirty = tags.get(CODE_DIRTY_TAG)
    if commit in UNKNOWN:
        findings.append(
            f"the code it was trained from is unknown ({CODE_VERSION_TAG}={commit or 'missing'}: not trained from a "
            "git checkout)"
        )
    elif dirty == "True":
        findings.append(
            f"it was trained from uncommitted (dirty) code on top of commit {commit} ({CODE_DIRTY_TAG}=True)"
        )
    elif dirty != "False":
        findings.append(f"it records no code state ({CODE_DIRTY_TAG}={dirty or 'missing'})")
    lock = tags.get(LOCK_HASH_TAG, "")
    if lock in UNKNOWN:
        findings.append(f"it records no dependency lock ({LOCK_HASH_TAG}={lock or 'missing'})")
    elif deployed_lock in UNKNOWN:
        findings.append(
            f"its dependency lock {lock} cannot be compared: the deploying orchestrator has no lock file "
            "(constraints.txt)"
        )
    elif lock != deployed_lock:
        findings.append(
            f"its dependency lock {lock} ({LOCK_HASH_TAG}) differs from the deployed lock {deployed_lock} (the "
            "orchestrator's constraints.txt)"
        )
    return findings


def check_lineage(
    policy: PromotionSpec,
    tags: Mapping[str, str],
    *,
    environment: str,
    deployed_lock: str,
    model: Optional[str] = None,
    version: Optional[str] = None,
    command: str = "promote",
) -> Check:
    """The `clean_lineage` check: passes on clean lineage, passes with a warning or fails on anything else.

    Args:
        policy: Decides whether a finding blocks (`clean_lineage_required`).
        tags: The candidate version's tags.
        environment: The deciding environment (`TRAINYARD_ENV`: `local` or `cluster`).
        deployed_lock: The orchestrator's own dependency lock hash.
        model, version: Named in the override command of a blocking decision.
        command: That command: `promote`, or `rollback` for a rollback.

    Returns:
        The check; a warning is a passed check with `warning=True`, recorded with the decision.
    """
    findings = lineage_findings(tags, deployed_lock)
    if not findings:
        commit = tags.get(CODE_VERSION_TAG)
        return Check(
            "clean_lineage",
            True,
            f"trained from committed code {commit} with the deployed dependency lock {deployed_lock}",
        )
    required, why = clean_lineage_required(policy, environment)
    found = "; ".join(findings)
    if not required:
        return Check(
            "clean_lineage",
            True,
            f"WARNING: {found}; not blocking: clean lineage is not required by {why}",
            warning=True,
        )
    override = (
        f'trainyard registry {command} {model or "<model>"} --version {version or "<version>"} --force --reason "..."'
    )
    relax = (
        ""
        if policy.require_clean_lineage is not None
        else "; a team relaxes it per pipeline with PromotionSpec(require_clean_lineage=False)"
    )
    return Check(
        "clean_lineage",
        False,
        f"{found}; clean lineage is required by {why}. Retrain from a clean commit with the deployed lock, "
        f"or override (recorded with its reason): {override}{relax}",
    )
