"""What a promotion decision is about and what it records: the version, the checks, the decision."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Optional, Protocol

from trainyard.lineage import POLICY_TAG, PROMOTION_PREFIX, SMOKE_EVIDENCE_TAG, SMOKE_PASSED_TAG
from trainyard.promotion.evidence import ValidationEvidence
from trainyard.spec import PromotionSpec

if TYPE_CHECKING:
    import pandas as pd

CHAMPION = "champion"
CHALLENGER = "challenger"
Action = Literal["register", "promote", "rollback"]

LOG_LIMIT = 50
"""Champion changes kept in the model's history tag (MLflow caps a tag's length)."""
CHECK_NAMES = (
    "threshold",
    "beats_champion",
    "beats_baseline",
    "data_validation",
    "serving_smoke_test",
    "clean_lineage",
)
POSITIVE_LABEL_TAG = "trainyard.positive_label"
"""Version tag: the binary target's positive class as JSON (`PipelineSpec.positive_label`); absent: the second sorted
label."""
MAX_SMOKE_TIMEOUT_S = 1800.0
WARNINGS_TAG = f"{PROMOTION_PREFIX}warnings"
"""Version tag: JSON list of the warnings a decision recorded (a check that passed with a warning)."""


def lock_seconds(smoke_timeout_s: float) -> float:
    """How long a promotion may hold the model's lock: two smoke-test deadlines and some registry calls."""
    return max(900.0, 2 * smoke_timeout_s + 300.0)


class PromotionError(Exception):
    """A promotion or rollback request cannot be carried out as asked (terminal)."""


class RegisteredVersion(Protocol):
    """What the policy reads of a registered version (`resources.registry.ModelVersionInfo`, a frozen dataclass:
    read-only members, so a frozen implementation matches)."""

    @property
    def name(self) -> str: ...
    @property
    def version(self) -> str: ...
    @property
    def run_id(self) -> Optional[str]: ...
    @property
    def model_uri(self) -> str: ...
    @property
    def tags(self) -> dict[str, str]: ...


class ServingSmoke(Protocol):
    """What a serving smoke test reports (`resources.registry.SmokeResult`; read-only members)."""

    @property
    def model_uri(self) -> str: ...
    @property
    def run_id(self) -> Optional[str]: ...
    @property
    def predictions(self) -> dict[str, list[Any]]: ...
    @property
    def load_seconds(self) -> Optional[float]: ...
    @property
    def seconds(self) -> float: ...
    @property
    def blocked_imports(self) -> tuple[str, ...]: ...
    @property
    def error(self) -> Optional[str]: ...
    @property
    def passed(self) -> bool: ...


@dataclass(frozen=True)
class Check:
    """One policy check and its outcome, in words a reviewer can verify.

    Attributes:
        warning: The check passed but found something a reviewer should see
            (e.g. unclean lineage where it is not required); recorded with the decision.
    """

    name: str
    passed: bool
    detail: str
    warning: bool = False

    def as_dict(self) -> dict[str, Any]:
        """The check as the JSON object recorded on the version and in the handoff event."""
        out: dict[str, Any] = {"name": self.name, "passed": self.passed, "detail": self.detail}
        if self.warning:
            out["warning"] = True
        return out


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

    @property
    def warnings(self) -> tuple[str, ...]:
        """`check: detail` of every check that passed with a warning."""
        return tuple(f"{c.name}: {c.detail}" for c in self.checks if c.warning)

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
            WARNINGS_TAG: json.dumps(list(self.warnings)),
            f"{p}metric": self.metric,
            f"{p}value": "" if self.value is None else repr(self.value),
            f"{p}champion_before": self.champion_before or "",
            f"{p}champion_value": "" if self.champion_value is None else repr(self.champion_value),
            f"{p}override": "true" if self.override else "false",
            f"{p}override_reason": self.override_reason or "",
            SMOKE_PASSED_TAG: str(self.smoke.get("passed", "")).lower(),
            SMOKE_EVIDENCE_TAG: json.dumps(self.smoke, sort_keys=True),
        }


@dataclass(frozen=True)
class Candidate:
    """What a decision needs to know about the version and its test data.

    Attributes:
        version: The registered version (its tags carry the lineage the `clean_lineage` check reads).
        policy: The promotion policy of its pipeline.
        metrics: Its metrics on the pinned test split (`test_acc`, ...).
        split_id: Id of that split (data version + pipeline fingerprint).
        test_df: The split itself (features and target), or None when unavailable.
        target: Name of the target column.
        validation: Data validation evidence of its training data.
        positive_label: A binary target's positive class (None: the second of the sorted labels).
        params: What the served model is asked with on the test split (`trainyard.promotion.served.LM_PARAMS`
            for a language model, whose `target` column then holds the tokens each row predicts); None: nothing.
        sample_note: Set when `test_df` is a part of the test split (a cap on a large one): the served value
            is then compared with the champion's on the same rows, not with the training-side value.
    """

    version: RegisteredVersion
    policy: PromotionSpec
    metrics: dict[str, float]
    split_id: Optional[str]
    test_df: Optional["pd.DataFrame"]
    target: Optional[str]
    validation: ValidationEvidence
    positive_label: Any = None
    params: Optional[dict[str, Any]] = None
    sample_note: Optional[str] = None


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
