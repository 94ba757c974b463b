"""The rules a sweep runs by: what to ask, when to stop, which trial wins. Exact values, no storage.

- `distributions`, `grid_space`, `build_sampler`, `derive_seed`: what a declared
  search space asks Optuna for;
- `sweep_status`: counts by state and why a sweep stops asking (trial budget,
  failure budget, time budget, target reached);
- `objective_values`, `pareto_front`, `pick_trial`: multi-objective results and
  the declared policy that picks the trial to promote.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from trainyard.search import CategoricalParam, FloatParam, IntParam, Objective, PickPolicy, SearchSpec
from trainyard.spec import PipelineSpec

CREATED_AT = "trainyard.created_at"
STOPPED = "trainyard.stopped"
ERROR = "error"
# A trial asked by a trial run that goes on with the sweep (`SweepStore.ask_claimed`) carries the run's id here from
# the moment it exists: the sweep sensor counts it in flight and requests no run of its own for it.
CLAIMED_BY = "trainyard.claimed_by"
FAILURE_BUDGET_SPENT = "failure budget spent"
# A trial that failed with a configuration error (the pod exited 78: `training.errors.ConfigError`) carries True here.
CONFIG_ERROR = "trainyard.config_error"
CONFIG_ERROR_STOP = "configuration error"


class SweepError(Exception):
    """A sweep could not be created, resumed or updated."""


def distributions(search: SearchSpec) -> dict[str, Any]:
    """Optuna distributions for a declared search space."""
    import optuna.distributions as d

    out: dict[str, Any] = {}
    for name, p in search.params.items():
        if isinstance(p, FloatParam):
            out[name] = d.FloatDistribution(p.low, p.high, log=p.log)
        elif isinstance(p, IntParam):
            out[name] = d.IntDistribution(p.low, p.high, step=p.step, log=p.log)
        elif isinstance(p, CategoricalParam):
            out[name] = d.CategoricalDistribution(p.choices)
    return out


def grid_space(search: SearchSpec) -> dict[str, list[Any]]:
    """The values `GridSampler` walks through: every step of an int param, every choice of a categorical one."""
    space: dict[str, list[Any]] = {}
    for name, p in search.params.items():
        if isinstance(p, IntParam):
            space[name] = list(range(p.low, p.high + 1, p.step))
        elif isinstance(p, CategoricalParam):
            space[name] = list(p.choices)
        else:
            raise SweepError(f"param {name!r} is a FloatParam; sampler 'grid' needs IntParam or CategoricalParam")
    return space


def derive_seed(seed: int, n_trials_so_far: int) -> int:
    """Sampler seed for a batch of asks: deterministic, and different each time the study has grown.

    A sampler re-created with the same seed on every sensor tick would repeat
    its random draws; folding in the study's size gives every batch fresh ones.
    """
    return (seed * 1_000_003 + n_trials_so_far) % (2**32)


def build_sampler(search: SearchSpec, seed: int) -> Any:
    """The Optuna sampler a `SearchSpec` declares.

    TPE uses the constant-liar heuristic when trials run in parallel, so trials
    asked while others still train are not drawn next to them.
    """
    import optuna

    if search.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if search.sampler == "grid":
        return optuna.samplers.GridSampler(grid_space(search), seed=seed)
    if search.sampler == "cmaes":
        return optuna.samplers.CmaEsSampler(seed=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(seed=seed, constant_liar=search.window > 1)


def objectives_of(spec: PipelineSpec) -> list[Objective]:
    """The sweep's objectives: the declared ones, or the model's monitor alone."""
    return list(spec.search.objectives) or [Objective(metric=spec.model.monitor, mode=spec.model.monitor_mode)]


def study_directions(spec: PipelineSpec) -> list[str]:
    """`max`/`min` per objective, in order."""
    return [o.mode for o in objectives_of(spec)]


def inert_pruner(search: SearchSpec) -> Optional[str]:
    """Why the declared pruner can stop no trial of this sweep, or None when it can.

    Optuna's median pruner compares a trial with the completed trials (pruned
    ones do not count) and prunes nothing until `n_startup_trials` of them, and
    at least one, have completed. A sweep's last trial sees at most
    `n_trials - 1` completed, so with `n_startup_trials >= n_trials` (or a
    single trial) every trial trains to the end, the pruner's reports and
    queries included. The other pruners have no startup count.
    """
    p = search.pruner
    if p.kind != "median":
        return None
    needed, seen = max(p.n_startup_trials, 1), search.n_trials - 1
    if seen >= needed:
        return None
    fix = f"set n_startup_trials to at most {seen}" if seen >= 1 else "it needs n_trials >= 2"
    return (
        f"pruner 'median' prunes only after {needed} completed trial(s) (n_startup_trials={p.n_startup_trials}), and "
        "the last of this "
        f"sweep's {search.n_trials} trial(s) sees at most {seen}: no trial can be pruned; {fix}, raise n_trials, or "
        "drop the pruner"
    )


MODES = {"MAXIMIZE": "max", "MINIMIZE": "min"}
"""Optuna's `StudyDirection` names -> trainyard's `max`/`min`."""


def optuna_direction(mode: str) -> str:
    """trainyard's `max`/`min` -> Optuna's `maximize`/`minimize`; SweepError for anything else."""
    if mode not in ("max", "min"):
        raise SweepError(f"direction {mode!r} is not 'max' or 'min'")
    return "maximize" if mode == "max" else "minimize"


# -- a study's definition --------------------------------------------------------------------


def redefined(spec: PipelineSpec, study_name: str) -> Optional[str]:
    """Why `study_name` is no longer a study of `spec`'s definition, or None when it is.

    A study is named `<team>.<name>.<data version>.<fingerprint>` (`trainyard.naming.study_name`):
    once the pipeline's definition changes (`PipelineSpec.fingerprint`: columns,
    split, model, search space...) its trials would train something else, so a
    study never gets a trial of another definition; the next `sweep` makes the new one.
    """
    fingerprint = spec.fingerprint()
    recorded = study_name.rsplit(".", 1)[-1]
    if recorded == fingerprint:
        return None
    return (
        f"the pipeline's definition changed since study {study_name} was made (its fingerprint {recorded}, the "
        "pipeline's "
        f"now {fingerprint}): a study never mixes definitions, so it gets no more trials; the sweep asset "
        f"(the prepare job) makes the new definition's study"
    )


# -- status and stop rules -------------------------------------------------------------------


@dataclass(frozen=True)
class SweepStatus:
    """Where a sweep stands, from its trials.

    `live` trials count towards `budget` (finished or in flight); failed trials
    do not, they are replaced until the failure budget is spent.
    """

    budget: int
    complete: int
    pruned: int
    failed: int
    running: int
    waiting: int
    best: Optional[float]
    stop_reason: Optional[str]

    @property
    def live(self) -> int:
        return self.complete + self.pruned + self.running + self.waiting

    @property
    def finished(self) -> int:
        return self.complete + self.pruned

    @property
    def in_flight(self) -> int:
        return self.running + self.waiting

    @property
    def remaining(self) -> int:
        """Trials still to ask; 0 once stopped."""
        return 0 if self.stop_reason else max(0, self.budget - self.live)

    @property
    def done(self) -> bool:
        """Nothing in flight and nothing more to ask."""
        return self.in_flight == 0 and self.remaining == 0

    def summary(self) -> str:
        """One line for logs and run tags, e.g. `2/5 finished (2 complete, 0 pruned), 1 in flight, 0 failed`."""
        text = (
            f"{self.finished}/{self.budget} finished ({self.complete} complete, {self.pruned} pruned), "
            f"{self.in_flight} in flight, {self.failed} failed"
        )
        if self.best is not None:
            text += f", best {self.best:.4g}"
        return text + (f"; stopped: {self.stop_reason}" if self.stop_reason else "")


def sweep_status(
    trials: Sequence[Any],
    search: SearchSpec,
    directions: Sequence[str],
    created_at: Optional[float],
    now: float,
    stopped: Optional[str] = None,
) -> SweepStatus:
    """Counts by state and the reason the sweep stops asking, if any.

    Stop rules, first match wins: an earlier recorded stop (`stopped`), a
    configuration error (a trial failed with one, `CONFIG_ERROR`, and none has
    completed or been pruned: the definition itself cannot train, so asking
    more trials would only spend the failure budget on the same error), the
    failure budget, the target on the first objective, the time budget. The
    trial budget is not a stop: it just leaves nothing to ask. A recorded
    failure-budget stop is restated with the failures counted now (trials in
    flight when it was recorded can fail later), so the reason never names
    fewer failures than `failed`.

    Args:
        trials: the study's trials (FrozenTrial).
        search: budgets and stop rules.
        directions: `max`/`min` per objective.
        created_at: when the sweep started (epoch seconds), for the time budget.
        now: the current time (epoch seconds).
        stopped: a stop reason recorded earlier; a stopped sweep stays stopped.
    """
    names = [t.state.name for t in trials]  # read once: an enum's `.name` is a property call per trial
    counts = {"COMPLETE": 0, "PRUNED": 0, "FAIL": 0, "RUNNING": 0, "WAITING": 0, **Counter(names)}
    complete = [t for t, name in zip(trials, names) if name == "COMPLETE"]
    sign = 1.0 if directions[0] == "max" else -1.0
    best = max((sign * t.values[0] for t in complete), default=None)
    best = None if best is None else sign * best
    budget = min(search.n_trials, search.grid_size) if search.sampler == "grid" else search.n_trials
    reason = stopped
    if reason is None and counts["FAIL"] and not counts["COMPLETE"] and not counts["PRUNED"]:
        broken = next((t for t, name in zip(trials, names) if name == "FAIL" and t.user_attrs.get(CONFIG_ERROR)), None)
        if broken is not None:
            reason = (
                f"{CONFIG_ERROR_STOP}: trial-{broken.number:04d} failed with a configuration error and no trial of "
                "this "
                f"definition has succeeded, so every trial would fail the same way: {failure_reason(broken)}; fix the "
                "pipeline (a changed definition starts a new study)"
            )
    if (reason is None or reason.startswith(FAILURE_BUDGET_SPENT)) and counts["FAIL"] >= search.failure_budget:
        errors = [failure_reason(t) for t in trials if t.state.name == "FAIL"]
        reason = (
            f"{FAILURE_BUDGET_SPENT}: {counts['FAIL']} trials failed (max_failures {search.failure_budget}); last "
            f"error: {errors[-1]}"
        )
    if reason is None and search.target is not None and best is not None and sign * best >= sign * search.target:
        reason = f"target reached: best {best:.6g} {'>=' if sign > 0 else '<='} target {search.target:.6g}"
    if (
        reason is None
        and search.timeout_seconds is not None
        and created_at is not None
        and now - created_at >= search.timeout_seconds
    ):
        reason = (
            f"time budget spent: {now - created_at:.0f} s since the sweep started (timeout_seconds "
            f"{search.timeout_seconds:.0f})"
        )
    return SweepStatus(
        budget=budget,
        complete=counts["COMPLETE"],
        pruned=counts["PRUNED"],
        failed=counts["FAIL"],
        running=counts["RUNNING"],
        waiting=counts["WAITING"],
        best=best,
        stop_reason=reason,
    )


def failure_reason(trial: Any) -> str:
    """Why a failed trial failed: its recorded error, else the heartbeat rule that failed it."""
    error = trial.user_attrs.get(ERROR)
    if error:
        return str(error).splitlines()[0][:200]
    return "stopped without reporting: no heartbeat within the grace period (its run crashed or was killed)"


# -- multi-objective -------------------------------------------------------------------------


def objective_values(
    result: dict[str, Any], objectives: Sequence[Objective], monitor: str, model_bytes: Optional[int] = None
) -> list[float]:
    """The values a finished trial tells its study, one per objective.

    The monitor is the result's `best_metric`; other metrics come from
    `result["metrics"]`, then result fields (`fit_seconds`, ...), then
    `model_bytes` (the size of the exported model).

    Raises:
        SweepError: an objective the result does not carry, naming what it does carry.
    """
    values = []
    for o in objectives:
        if o.metric == monitor:
            v = result.get("best_metric")
        elif o.metric in result.get("metrics", {}):
            v = result["metrics"][o.metric]
        elif o.metric == "model_bytes":
            v = model_bytes
        else:
            v = result.get(o.metric)
        if v is None:
            available = sorted(
                {
                    monitor,
                    *result.get("metrics", {}),
                    "model_bytes",
                    "fit_seconds",
                    "wall_seconds",
                    "device_hours",
                    "samples_per_second",
                }
            )
            raise SweepError(f"objective {o.metric!r} is not in the trial's result; available: {available}")
        values.append(float(v))
    return values


def _dominates(a: Sequence[float], b: Sequence[float], signs: Sequence[float]) -> bool:
    better_somewhere = False
    for x, y, s in zip(a, b, signs):
        if s * x < s * y:
            return False
        if s * x > s * y:
            better_somewhere = True
    return better_somewhere


def pareto_front(trials: Sequence[Any], directions: Sequence[str]) -> list[Any]:
    """Completed trials no other completed trial dominates, in trial-number order."""
    signs = [1.0 if d == "max" else -1.0 for d in directions]
    done = [t for t in trials if t.state.name == "COMPLETE"]
    return sorted(
        (t for t in done if not any(_dominates(o.values, t.values, signs) for o in done if o is not t)),
        key=lambda t: t.number,
    )


def pick_trial(front: Sequence[Any], objectives: Sequence[Objective], pick: PickPolicy) -> tuple[Any, str]:
    """The trial of the Pareto front to promote, and why (see `PickPolicy`).

    Raises:
        SweepError: the front is empty, or no trial is within `pick.limits`.
    """
    if not front:
        raise SweepError("the Pareto front is empty: no trial completed")
    index = {o.metric: i for i, o in enumerate(objectives)}
    signs = [1.0 if o.mode == "max" else -1.0 for o in objectives]
    within = []
    for t in front:
        ok = all(
            (t.values[index[m]] >= bound) if objectives[index[m]].mode == "max" else (t.values[index[m]] <= bound)
            for m, bound in pick.limits.items()
        )
        if ok:
            within.append(t)
    if not within:
        raise SweepError(f"no trial of the Pareto front ({len(front)} trials) is within the pick limits {pick.limits}")
    limits = f" within {pick.limits}" if pick.limits else ""
    if pick.rule == "primary":
        first = index[pick.metric] if pick.metric else 0
        order = [first] + [i for i in range(len(objectives)) if i != first]
        best = min(within, key=lambda t: (*[-signs[i] * t.values[i] for i in order], t.number))
        return (
            best,
            f"best {objectives[first].metric} ({objectives[first].mode}) of {len(within)} Pareto-optimal "
            f"trial(s){limits}",
        )
    lows = [min(t.values[i] for t in within) for i in range(len(objectives))]
    highs = [max(t.values[i] for t in within) for i in range(len(objectives))]

    def distance(t: Any) -> float:
        total = 0.0
        for i, s in enumerate(signs):
            span = highs[i] - lows[i]
            scaled = 0.0 if span == 0 else (t.values[i] - lows[i]) / span
            total += (1.0 - scaled if s > 0 else scaled) ** 2
        return math.sqrt(total)

    best = min(within, key=lambda t: (distance(t), t.number))
    return (
        best,
        f"closest to the ideal point (distance {distance(best):.3f}) of {len(within)} Pareto-optimal trial(s){limits}",
    )
