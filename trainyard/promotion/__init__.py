"""The promotion policy: when a registered version may become `champion`, and the record of each decision.

Plain functions over plain data, so a reviewer can check the policy without a
registry, Dagster or a serving process. `resources.registry.promotion` applies it: for
model M and candidate version V, inside the registry's lock on M,

1. V gets alias `challenger` (a rollback target is checked by its pinned URI instead).
2. Serving smoke test: a fresh process with only the serving dependencies loads
   `models:/M@challenger` and predicts on the input example and the pinned test
   split; the policy metric (or test accuracy / RMSE) computed from its served
   labels and probabilities must equal the training-side one (`check_smoke`).
3. The champion is scored on the same test split: its recorded metric when it was
   evaluated on that split, otherwise re-evaluated on it now from its served
   predictions, for every metric a policy accepts (`served_metric`).
4. The checks of `PromotionSpec` (threshold, beats_champion, beats_baseline,
   data_validation, serving_smoke_test, clean_lineage) are evaluated (`evaluate_policy`);
   clean_lineage (`check_lineage`) reads the code and dependency lock recorded
   on V and blocks, or only warns, as `require_clean_lineage` and the
   environment say (blocking by default in `cluster`, a warning in `local`).
5. `champion` moves to V when all pass, or when forced with a reason (an override).
6. The evidence goes to V's tags (`Decision.tags`) before the alias moves; each
   champion change is pushed on the model's champion history (`next_history`)
   and published as a handoff event.

The same policy serves the `registered_model` asset (action `register`) and
`trainyard registry promote|rollback` (actions `promote`, `rollback`).

Modules: `records` (the decision and what it is about), `evidence` (data
validation and recorded metrics), `checks` (the policy's checks),
`lineage_gate` (the clean-lineage check), `served` (metrics from a served
model's predictions), `history` (the champion stack),
`card` (the model card). Every public name is importable from here.
"""

from trainyard.promotion.card import model_card
from trainyard.promotion.checks import (
    check_beats_baseline,
    check_beats_champion,
    check_smoke,
    check_threshold,
    check_validation,
    comparable_value,
    evaluate_policy,
    summarize,
)
from trainyard.promotion.evidence import (
    ValidationEvidence,
    evidence_from_check,
    is_quarantined,
    recorded_metrics,
    validation_now,
)
from trainyard.promotion.history import next_history, parse_history, rollback_target
from trainyard.promotion.lineage_gate import (
    CLEAN_LINEAGE_DEFAULTS,
    check_lineage,
    clean_lineage_required,
    lineage_findings,
)
from trainyard.promotion.records import (
    CHALLENGER,
    CHAMPION,
    CHECK_NAMES,
    LOG_LIMIT,
    MAX_SMOKE_TIMEOUT_S,
    POSITIVE_LABEL_TAG,
    WARNINGS_TAG,
    Action,
    Candidate,
    ChampionScore,
    Check,
    Decision,
    PromotionError,
    RegisteredVersion,
    ServingSmoke,
    lock_seconds,
    recorded_policy,
)
from trainyard.promotion.served import SERVED_METRICS, ServedOutput, served_metric, served_output

__all__ = [
    "CHALLENGER",
    "CHAMPION",
    "CHECK_NAMES",
    "CLEAN_LINEAGE_DEFAULTS",
    "LOG_LIMIT",
    "MAX_SMOKE_TIMEOUT_S",
    "POSITIVE_LABEL_TAG",
    "SERVED_METRICS",
    "WARNINGS_TAG",
    "Action",
    "Candidate",
    "ChampionScore",
    "Check",
    "Decision",
    "PromotionError",
    "RegisteredVersion",
    "ServedOutput",
    "ServingSmoke",
    "ValidationEvidence",
    "check_beats_baseline",
    "check_beats_champion",
    "check_lineage",
    "check_smoke",
    "check_threshold",
    "check_validation",
    "clean_lineage_required",
    "comparable_value",
    "evaluate_policy",
    "evidence_from_check",
    "is_quarantined",
    "lineage_findings",
    "lock_seconds",
    "model_card",
    "next_history",
    "parse_history",
    "recorded_metrics",
    "recorded_policy",
    "rollback_target",
    "served_metric",
    "served_output",
    "summarize",
    "validation_now",
]
