"""The search space of a pipeline's sweep: parameters, objectives, how a pick is made, and how the sweep runs.

Part of the team-facing spec (`from trainyard import SearchSpec, FloatParam, ...`),
validated when the team module is imported.
"""

from __future__ import annotations

import importlib.util
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from training.spec import PrunerSpec


class StrictSpec(BaseModel):
    """Base of every spec model: unknown fields are errors and values are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class FloatParam(StrictSpec):
    kind: Literal["float"] = "float"
    low: float
    high: float
    log: bool = False

    @model_validator(mode="after")
    def _bounds(self) -> "FloatParam":
        if not self.low < self.high:
            raise ValueError(f"low {self.low} must be below high {self.high}")
        if self.log and self.low <= 0:
            raise ValueError(f"log scale needs low > 0, got {self.low}")
        return self


class IntParam(StrictSpec):
    kind: Literal["int"] = "int"
    low: int
    high: int
    step: int = Field(1, ge=1)
    log: bool = False

    @model_validator(mode="after")
    def _bounds(self) -> "IntParam":
        if not self.low < self.high:
            raise ValueError(f"low {self.low} must be below high {self.high}")
        return self


class CategoricalParam(StrictSpec):
    kind: Literal["categorical"] = "categorical"
    choices: list[Union[int, float, str, bool]]

    @field_validator("choices")
    @classmethod
    def _non_empty(cls, v: list) -> list:
        if not v:
            raise ValueError("choices must not be empty")
        return v


Param = Union[FloatParam, IntParam, CategoricalParam]


# Metrics an objective may name besides the model's monitor and other `val_*` metrics:
# fields of the trial's result, and the size of its exported model.
RESULT_OBJECTIVES = ("model_bytes", "fit_seconds", "wall_seconds", "device_hours", "samples_per_second")
# SearchSpec fields that steer a sweep without changing what its trials train; changing
# them resumes the same study (they are not part of the pipeline fingerprint).
SWEEP_CONTROL_FIELDS = (
    "n_trials",
    "parallelism",
    "timeout_seconds",
    "target",
    "max_failures",
    "pick",
    "reuse_run_under_seconds",
)
# Trials in flight when `parallelism` is unset: all of a small sweep, a bounded window of a large one.
DEFAULT_WINDOW = 64


class Objective(StrictSpec):
    """One objective of a multi-objective sweep: a metric of the trial's result and its better direction."""

    metric: str
    mode: Literal["max", "min"]


class PickPolicy(StrictSpec):
    """Which trial of a multi-objective sweep's Pareto front `best_model` promotes.

    First the front is narrowed to trials within `limits` ({metric: bound}; a
    ceiling for "min" objectives, a floor for "max" ones). Then:

    - `primary`: the best trial on `metric` (default: the first objective), ties
      broken by the next objectives in order, then the lower trial number;
    - `utopia`: the trial closest (Euclidean) to the ideal point after scaling
      each objective to [0, 1] over the front; ties go to the lower trial number.

    Example:
        >>> PickPolicy(rule="primary", metric="val_acc", limits={"model_bytes": 60_000})
    """

    rule: Literal["primary", "utopia"] = "primary"
    metric: Optional[str] = None
    limits: dict[str, float] = Field(default_factory=dict)


class SearchSpec(StrictSpec):
    """An Optuna search space over model hyperparameters, and how the sweep runs.

    A pipeline without a search space is a sweep of one trial with the model's
    own hyperparameters, so small and large jobs share one path.

    Attributes:
        params: the search space.
        n_trials: trials that must finish (complete or pruned); failed trials
            are replaced and counted against `max_failures` instead.
        sampler: `tpe` (default; constant liar when trials run in parallel),
            `random`, `grid` (int and categorical params only; n_trials at most
            the grid size) or `cmaes` (needs the `cmaes` package; single objective).
        seed: sampler seed.
        pruner: early stopping of unpromising trials (single objective only).
        parallelism: trials in flight at once; the sweep sensor asks for a new
            trial when one finishes. Unset: all n_trials, at most 64.
        timeout_seconds: time budget from the sweep's start; after it no new
            trial is asked (trials in flight finish).
        target: stop asking once the best value of the first objective reaches it.
        max_failures: stop asking once this many trials failed (default:
            max(3, n_trials / 5)), with the failures named in the reason.
        objectives: two or more metrics for a multi-objective sweep (Pareto
            front); empty: the model's monitor alone. A metric is the model's
            monitor, another `val_*` metric, or one of `RESULT_OBJECTIVES`.
        pick: which Pareto-front trial `best_model` promotes.
        reuse_run_under_seconds: a trial run started by the sweep sensor whose
            trial took less than this goes on with the sweep's next trial in
            the same run (as Ray Tune reuses an actor), for as long as its
            trials stay that short and the sweep has a slot and a trial left,
            instead of ending and leaving the slot to the sensor's next tick
            and a new run (here 3-4 s of queue, process start-up and imports,
            plus up to a tick's 10 s wait, per trial). Each trial stays its own
            partition, with its own materialization and study record. A run
            whose trial took this long or longer ends, and under the daemon
            starts the run of the sweep's next trial itself as it ends, instead
            of leaving the slot to the sensor's next tick. 0: one run per
            trial, every run started by the sensor. Random and TPE sweeps only
            (other samplers' asks stay with the sensor).

    Example:
        >>> SearchSpec(params={"lr": FloatParam(low=1e-4, high=1e-1, log=True)}, n_trials=40,
        ...            parallelism=4, pruner=PrunerSpec(kind="median", n_startup_trials=5))
    """

    params: dict[str, Param] = Field(default_factory=dict)
    n_trials: int = Field(1, ge=1)
    sampler: Literal["tpe", "random", "grid", "cmaes"] = "tpe"
    seed: int = 0
    pruner: PrunerSpec = PrunerSpec()
    parallelism: Optional[int] = Field(None, ge=1)
    timeout_seconds: Optional[float] = Field(None, gt=0)
    target: Optional[float] = None
    max_failures: Optional[int] = Field(None, ge=1)
    objectives: list[Objective] = Field(default_factory=list)
    pick: PickPolicy = PickPolicy()
    reuse_run_under_seconds: float = Field(120.0, ge=0)

    @model_validator(mode="after")
    def _space(self) -> "SearchSpec":
        if self.n_trials > 1 and not self.params:
            raise ValueError(
                f"n_trials={self.n_trials} needs a non-empty search space in 'params' "
                "(e.g. {'lr': FloatParam(low=1e-4, high=1e-1, log=True)})"
            )
        if self.sampler == "grid":
            continuous = [n for n, p in self.params.items() if isinstance(p, FloatParam)]
            if continuous:
                raise ValueError(
                    f"sampler 'grid' needs discrete parameters; {continuous} are FloatParam "
                    "(use IntParam or CategoricalParam with the values to try)"
                )
            if self.n_trials > self.grid_size:
                raise ValueError(
                    f"n_trials={self.n_trials} exceeds the {self.grid_size} points of the grid; set n_trials <= "
                    f"{self.grid_size}"
                )
        if self.sampler == "cmaes":
            if importlib.util.find_spec("cmaes") is None:
                raise ValueError(
                    "sampler 'cmaes' needs the 'cmaes' package, which is not installed here; use 'tpe' or 'random', "
                    "or install cmaes"
                )
            if self.multi_objective:
                raise ValueError(
                    "sampler 'cmaes' optimizes a single objective; use 'tpe' or 'random' for multi-objective sweeps"
                )
        if self.objectives:
            metrics = [o.metric for o in self.objectives]
            if len(metrics) < 2:
                raise ValueError(
                    "objectives lists two or more metrics for a multi-objective sweep; a single objective is the "
                    "model's monitor"
                )
            if len(set(metrics)) != len(metrics):
                raise ValueError(f"objectives name a metric twice: {metrics}")
            leaked = [m for m in metrics if m.startswith("test_")]
            if leaked:
                raise ValueError(
                    f"objectives {leaked} are measured on the test split; choose trials on validation metrics (val_*) "
                    "so the test split stays held out"
                )
            if self.pruner.enabled:
                raise ValueError(
                    f"pruner {self.pruner.kind!r} cannot be used with objectives: Optuna prunes single-objective "
                    "studies only"
                )
            unknown = sorted({m for m in [self.pick.metric, *self.pick.limits] if m is not None} - set(metrics))
            if unknown:
                raise ValueError(f"pick names {unknown}, which are not among the objectives {metrics}")
        elif self.pick != PickPolicy():
            raise ValueError(
                "pick chooses among a Pareto front and applies to multi-objective sweeps only; declare objectives or "
                "drop pick"
            )
        return self

    def check_objectives(self, monitor: str) -> None:
        """Check that every objective is a metric a trial reports (the monitor, a `val_*` metric or a result field)."""
        for o in self.objectives:
            if o.metric != monitor and not o.metric.startswith("val_") and o.metric not in RESULT_OBJECTIVES:
                raise ValueError(
                    f"objective metric {o.metric!r} is not reported by trials; use the monitor {monitor!r}, "
                    f"a val_* metric or one of {list(RESULT_OBJECTIVES)}"
                )

    @property
    def multi_objective(self) -> bool:
        return len(self.objectives) > 1

    @property
    def grid_size(self) -> int:
        """Points of the grid over int and categorical params (float params count as 0)."""
        size = 1
        for p in self.params.values():
            if isinstance(p, IntParam):
                size *= len(range(p.low, p.high + 1, p.step))
            elif isinstance(p, CategoricalParam):
                size *= len(p.choices)
            else:
                return 0
        return size

    @property
    def window(self) -> int:
        """Trials kept in flight: `parallelism`, or all n_trials up to DEFAULT_WINDOW."""
        return self.parallelism if self.parallelism is not None else min(self.n_trials, DEFAULT_WINDOW)

    @property
    def failure_budget(self) -> int:
        """Failed trials after which the sweep stops asking."""
        return self.max_failures if self.max_failures is not None else max(3, -(-self.n_trials // 5))
