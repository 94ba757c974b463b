"""The sweep report: best parameters, a trials table, history, parameter importance and Pareto plots.

Plots are PNGs drawn with matplotlib (Agg backend), embedded in the `sweep`
asset's metadata and also written to the object store.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from resources.sweeps.resource import SweepStore
from resources.sweeps.rules import SweepError, SweepStatus, failure_reason, objectives_of, pareto_front, pick_trial
from trainyard.plots import figure_png, markdown_image, pyplot
from trainyard.search import Objective
from trainyard.spec import PipelineSpec

logger = logging.getLogger(__name__)


def _fmt(values: Optional[Sequence[float]]) -> str:
    return "" if values is None else ", ".join(f"{v:.4g}" for v in values)


def trials_markdown(trials: Sequence[Any], objectives: Sequence[Objective], limit: int = 25) -> str:
    """A trials table: all trials of a small sweep, else the best `limit` completed plus those in flight."""
    names = ", ".join(o.metric for o in objectives)
    header = f"| trial | state | {names} | params | note |\n|---|---|---|---|---|\n"
    signs = [1.0 if o.mode == "max" else -1.0 for o in objectives]

    def row(t: Any) -> str:
        note = failure_reason(t)[:120] if t.state.name == "FAIL" else ""
        if t.state.name == "PRUNED" and t.intermediate_values:
            note = f"pruned at epoch {max(t.intermediate_values)}"
        return f"| trial-{t.number:04d} | {t.state.name} | {_fmt(t.values)} | {t.params} | {note} |"

    if len(trials) <= limit:
        return header + "\n".join(row(t) for t in sorted(trials, key=lambda t: t.number))
    done = sorted(
        (t for t in trials if t.state.name == "COMPLETE"), key=lambda t: tuple(-s * v for s, v in zip(signs, t.values))
    )
    shown = done[:limit] + [t for t in trials if not t.state.is_finished()][:limit]
    return (
        f"showing the best {min(limit, len(done))} of {len(done)} completed trials and up to {limit} in flight\n\n"
        + header
        + "\n".join(row(t) for t in shown)
    )


def history_png(trials: Sequence[Any], objective: Objective) -> bytes:
    """Optimization history of the first objective: every finished trial and the best so far."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    done = sorted((t for t in trials if t.state.name in ("COMPLETE", "PRUNED") and t.values), key=lambda t: t.number)
    complete = [t for t in done if t.state.name == "COMPLETE"]
    pruned = [t for t in done if t.state.name == "PRUNED"]
    ax.scatter([t.number for t in complete], [t.values[0] for t in complete], s=14, label="complete")
    if pruned:
        ax.scatter(
            [t.number for t in pruned],
            [t.values[0] for t in pruned],
            s=14,
            marker="x",
            color="grey",
            label="pruned (last report)",
        )
    best, xs, ys = None, [], []
    for t in complete:
        v = t.values[0]
        best = v if best is None else (max(best, v) if objective.mode == "max" else min(best, v))
        xs.append(t.number)
        ys.append(best)
    if xs:
        ax.step(xs, ys, where="post", color="tab:red", label="best so far")
    ax.set_xlabel("trial")
    ax.set_ylabel(objective.metric)
    ax.set_title("optimization history")
    ax.legend(loc="best", fontsize=8)
    return figure_png(fig)


# fANOVA fits random forests: ~6 s for 500 trials, minutes for 10,000. Larger studies use PED-ANOVA (< 1 s).
FANOVA_MAX_TRIALS = 300


def importance_method(completed: int) -> str:
    return "fANOVA" if completed <= FANOVA_MAX_TRIALS else "PED-ANOVA"


def importance(study: Any, objective: Objective) -> dict[str, float]:
    """Parameter importances for the first objective (fANOVA, seeded; PED-ANOVA past 300 trials); needs 2+ completed
    trials.

    Raises:
        SweepError: fewer than two completed trials, no searched parameter, every
            trial scored the same (importance is undefined: fANOVA raises on zero
            variance), or the evaluator failed on this study; the message says which.
    """
    import optuna

    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    if len(complete) < 2:
        raise SweepError(f"parameter importance needs at least 2 completed trials, the study has {len(complete)}")
    if not complete[0].params:
        raise SweepError("parameter importance needs searched parameters; this sweep has none")
    scores = {t.values[0] for t in complete}
    if len(scores) == 1:
        raise SweepError(
            f"every completed trial scored {objective.metric} = {scores.pop()}: no parameter explains a difference, "
            "so importance is undefined"
        )
    method = importance_method(len(complete))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        evaluator = (
            optuna.importance.FanovaImportanceEvaluator(seed=0)
            if len(complete) <= FANOVA_MAX_TRIALS
            else optuna.importance.PedAnovaImportanceEvaluator()
        )
        try:
            found = optuna.importance.get_param_importances(
                study, evaluator=evaluator, target=lambda t: t.values[0], normalize=True
            )
        except (RuntimeError, ValueError, ZeroDivisionError, FloatingPointError) as e:
            raise SweepError(f"parameter importance could not be computed ({method}): {type(e).__name__}: {e}") from e
    return {k: float(v) for k, v in found.items()}


def importance_png(importances: dict[str, float], objective: Objective, method: str = "fANOVA") -> bytes:
    plt = pyplot()
    names = list(importances)[::-1]
    fig, ax = plt.subplots(figsize=(7, 0.5 + 0.4 * len(names)))
    ax.barh(names, [importances[n] for n in names])
    ax.set_xlabel(f"importance for {objective.metric} ({method})")
    ax.set_title("parameter importance")
    return figure_png(fig)


def pareto_png(
    trials: Sequence[Any], front: Sequence[Any], objectives: Sequence[Objective], picked: Optional[Any] = None
) -> bytes:
    """The first two objectives of every completed trial, the Pareto front highlighted."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    done = [t for t in trials if t.state.name == "COMPLETE"]
    ax.scatter([t.values[0] for t in done], [t.values[1] for t in done], s=14, color="lightgrey", label="trials")
    ordered = sorted(front, key=lambda t: t.values[0])
    ax.plot(
        [t.values[0] for t in ordered], [t.values[1] for t in ordered], "o-", color="tab:blue", label="Pareto front"
    )
    if picked is not None:
        ax.scatter(
            [picked.values[0]],
            [picked.values[1]],
            s=80,
            facecolors="none",
            edgecolors="tab:red",
            label=f"picked trial-{picked.number:04d}",
        )
    ax.set_xlabel(f"{objectives[0].metric} ({objectives[0].mode})")
    ax.set_ylabel(f"{objectives[1].metric} ({objectives[1].mode})")
    ax.legend(loc="best", fontsize=8)
    return figure_png(fig)


@dataclass
class SweepReport:
    """What the `sweep` asset shows: numbers, tables and PNG plots."""

    status: SweepStatus
    best_params: dict[str, Any]
    best_values: Optional[list[float]]
    best_trial: Optional[int]
    trials_md: str
    pareto_md: Optional[str]
    importances: dict[str, float]
    importance_note: str
    plots: dict[str, bytes] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def _plot(plots: dict[str, bytes], problems: list[str], name: str, draw: Callable[[], bytes]) -> None:
    """Draw one plot into `plots`; a plot that cannot be drawn becomes a line in `problems`.

    The report is a view of the study, never a reason to fail the sweep: a
    plotting error (odd values, a matplotlib quirk) is shown beside the report
    and logged, and the trials still start.
    """
    try:
        plots[name] = draw()
    except Exception as e:
        logger.warning("sweep report: the %s plot could not be drawn: %s: %s", name, type(e).__name__, e)
        problems.append(f"{name} plot: {type(e).__name__}: {e}")


def build_report(store: SweepStore, study: Any, spec: PipelineSpec) -> SweepReport:
    """Best parameters, trials table, history, importance and (multi-objective) Pareto plots."""
    trials = study.get_trials(deepcopy=False)
    objectives = objectives_of(spec)
    status = store.status(study, spec.search)
    plots: dict[str, bytes] = {}
    problems: list[str] = []
    best_params: dict[str, Any] = {}
    best_values: Optional[list[float]] = None
    best_trial: Optional[int] = None
    pareto_md: Optional[str] = None
    if any(t.state.name in ("COMPLETE", "PRUNED") for t in trials):
        _plot(plots, problems, "history", lambda: history_png(trials, objectives[0]))
    if spec.search.multi_objective:
        front = pareto_front(trials, [o.mode for o in objectives])
        if front:
            picked, reason = pick_trial(front, objectives, spec.search.pick)
            best_params, best_values, best_trial = dict(picked.params), list(picked.values), picked.number
            pareto_md = f"picked trial-{picked.number:04d}: {reason}\n\n" + trials_markdown(
                front, objectives, limit=len(front)
            )
            _plot(plots, problems, "pareto", lambda: pareto_png(trials, front, objectives, picked))
    elif status.complete:
        sign = 1.0 if objectives[0].mode == "max" else -1.0
        best = max((t for t in trials if t.state.name == "COMPLETE"), key=lambda t: (sign * t.values[0], -t.number))
        best_params, best_values, best_trial = dict(best.params), list(best.values), best.number
    importances: dict[str, float] = {}
    try:
        importances = importance(study, objectives[0])
        note = f"{importance_method(status.complete)} on the {status.complete} completed trials"
    except SweepError as e:
        note = str(e)
    if importances:
        _plot(
            plots,
            problems,
            "importance",
            lambda: importance_png(importances, objectives[0], importance_method(status.complete)),
        )
    return SweepReport(
        status=status,
        best_params=best_params,
        best_values=best_values,
        best_trial=best_trial,
        trials_md=trials_markdown(trials, objectives),
        pareto_md=pareto_md,
        importances=importances,
        importance_note=note,
        plots=plots,
        problems=problems,
    )


def report_metadata(report: SweepReport, store: Any, base_uri: str, objectives: Sequence[Objective]) -> dict[str, Any]:
    """Dagster metadata for a sweep report; the plots are written as PNGs under `base_uri` and embedded.

    Args:
        store: the object store (`resources.storage.ObjectStore`).
    """
    from dagster import MetadataValue

    st = report.status
    names = [o.metric for o in objectives]
    meta: dict[str, Any] = {
        "status": "stopped" if st.stop_reason else ("finished" if st.done else "running"),
        "stop_reason": st.stop_reason or "",
        "finished_trials": st.finished,
        "complete_trials": st.complete,
        "pruned_trials": st.pruned,
        "failed_trials": st.failed,
        "in_flight": st.in_flight,
        "budget": st.budget,
        "objectives": MetadataValue.json([o.model_dump() for o in objectives]),
        "best_trial": "" if report.best_trial is None else f"trial-{report.best_trial:04d}",
        "best_params": MetadataValue.json(report.best_params),
        "table": MetadataValue.md(report.trials_md),
        "param_importance": MetadataValue.json({k: float(v) for k, v in report.importances.items()}),
        "param_importance_note": report.importance_note,
    }
    for name, value in zip(names, report.best_values or []):
        meta[f"best_{name}"] = float(value)
    if report.pareto_md is not None:
        meta["pareto_front"] = MetadataValue.md(report.pareto_md)
    if report.problems:
        meta["report_problems"] = MetadataValue.md("\n".join(f"- {p}" for p in report.problems))
    for name, png in report.plots.items():
        uri = f"{base_uri}/{name}.png"
        store.write_bytes(uri, png)
        meta[f"{name}_plot"] = MetadataValue.md(markdown_image(png, name))
        meta[f"{name}_png"] = MetadataValue.path(uri)
    return meta
