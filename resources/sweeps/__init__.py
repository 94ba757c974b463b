"""Optuna sweeps: study storage (SQLite locally, PostgreSQL on clusters) and the rules a sweep runs by.

`SweepStore` (`resource`) is the resource: it creates or resumes a study, asks
trials in bounded batches, tells results, records heartbeats while a trial
trains and fails trials whose heartbeat went stale. `store` keeps one Optuna
storage and Study per process. Around it, pure functions (`rules`) hold the
rules, each tested with exact values: the stop rules (`sweep_status`), the
multi-objective results and the declared pick policy (`objective_values`,
`pareto_front`, `pick_trial`). `report` builds the `sweep` asset's report:
best parameters, a trials table, optimization history, parameter importance
and Pareto plots.

A study's trial numbers are its partition keys (`trial-0007` is trial 7), so a
study resumed after a crash continues with the next free number: no duplicate
partitions and no duplicate trials.
"""

from resources.sweeps.report import (
    FANOVA_MAX_TRIALS,
    SweepReport,
    build_report,
    history_png,
    importance,
    importance_method,
    importance_png,
    pareto_png,
    report_metadata,
    trials_markdown,
)
from resources.sweeps.resource import SweepStore
from resources.sweeps.rules import (
    CLAIMED_BY,
    CONFIG_ERROR,
    CONFIG_ERROR_STOP,
    CREATED_AT,
    ERROR,
    STOPPED,
    SweepError,
    SweepStatus,
    build_sampler,
    derive_seed,
    distributions,
    failure_reason,
    grid_space,
    inert_pruner,
    objective_values,
    objectives_of,
    pareto_front,
    pick_trial,
    redefined,
    study_directions,
    sweep_status,
)

__all__ = [
    "CLAIMED_BY",
    "CONFIG_ERROR",
    "CONFIG_ERROR_STOP",
    "CREATED_AT",
    "ERROR",
    "FANOVA_MAX_TRIALS",
    "STOPPED",
    "SweepError",
    "SweepReport",
    "SweepStatus",
    "SweepStore",
    "build_report",
    "build_sampler",
    "derive_seed",
    "distributions",
    "failure_reason",
    "grid_space",
    "history_png",
    "importance",
    "importance_method",
    "importance_png",
    "inert_pruner",
    "objective_values",
    "objectives_of",
    "pareto_front",
    "pareto_png",
    "pick_trial",
    "redefined",
    "report_metadata",
    "study_directions",
    "sweep_status",
    "trials_markdown",
]
