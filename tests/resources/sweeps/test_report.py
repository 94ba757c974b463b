"""The sweep report: trials table, best parameters, importance and Pareto plots."""

from __future__ import annotations

import importlib
from pathlib import Path

from optuna.trial import TrialState

from resources.sweeps import build_report, trials_markdown
from tests.pipelines.pipeline_fixtures import small_spec
from tests.resources.sweeps.fakes import LR, MAXMIN, done, running, store_at
from trainyard.search import IntParam, Objective, PickPolicy, SearchSpec


def test_trials_markdown_small_and_large() -> None:
    objs = [Objective(metric="val_acc", mode="max")]
    small = trials_markdown(
        [done(1, 0.5), done(0, 0.25, state=TrialState.PRUNED), done(2, state=TrialState.FAIL, error="rank 1 raised X")],
        objs,
    )
    assert small == (
        "| trial | state | val_acc | params | note |\n|---|---|---|---|---|\n"
        "| trial-0000 | PRUNED |  | {'lr': 0.01} | pruned at epoch 0 |\n"
        "| trial-0001 | COMPLETE | 0.5 | {'lr': 0.01} |  |\n"
        "| trial-0002 | FAIL |  | {'lr': 0.01} | rank 1 raised X |"
    )
    large = trials_markdown([done(i, i / 100) for i in range(30)] + [running(30)], objs, limit=3)
    lines = large.splitlines()
    assert lines[0] == "showing the best 3 of 30 completed trials and up to 3 in flight"
    assert [line.split(" | ")[0] for line in lines[4:]] == [
        "| trial-0029",
        "| trial-0028",
        "| trial-0027",
        "| trial-0030",
    ]


def test_report_has_best_params_history_and_importance(tmp_path: Path) -> None:
    spec = small_spec(
        search=SearchSpec(params={**LR, "hidden": IntParam(low=16, high=64, step=16)}, n_trials=6, sampler="random")
    )
    sweeps = store_at(tmp_path)
    study = sweeps.load_or_create("r", "max", spec.search)
    for n in sweeps.ensure_trials(study, spec.search):
        params = sweeps.trial("r", n).params
        sweeps.tell("r", n, 1.0 - abs(params["lr"] - 0.01), {})
    report = build_report(sweeps, study, spec)
    assert report.status.complete == 6 and report.best_trial is not None
    assert report.best_values == [max(t.value for t in study.get_trials())]
    assert set(report.importances) == {"lr", "hidden"} and abs(sum(report.importances.values()) - 1.0) < 1e-9
    assert set(report.plots) == {"history", "importance"}
    assert all(png.startswith(b"\x89PNG") for png in report.plots.values())
    one = store_at(tmp_path)
    s1 = one.load_or_create("one", "max", spec.search)
    one.ensure_trials(s1, spec.search)
    one.tell("one", 0, 0.5, {})
    r1 = build_report(one, s1, spec)
    assert (
        r1.importance_note == "parameter importance needs at least 2 completed trials, the study has 1"
        and "importance" not in r1.plots
    )


def test_multi_objective_report_has_the_pareto_front(tmp_path: Path) -> None:
    search = SearchSpec(
        params={**LR, "hidden": IntParam(low=16, high=64, step=16)},
        n_trials=5,
        sampler="random",
        objectives=MAXMIN,
        pick=PickPolicy(limits={"model_bytes": 48_000}),
    )
    spec = small_spec(search=search)
    sweeps = store_at(tmp_path)
    study = sweeps.load_or_create("mo", ["max", "min"], search)
    for n in sweeps.ensure_trials(study, search):
        p = sweeps.trial("mo", n).params
        sweeps.tell("mo", n, [1.0 - abs(p["lr"] - 0.01), 1000.0 * p["hidden"]], {})
    report = build_report(sweeps, study, spec)
    assert report.pareto_md is not None and report.pareto_md.startswith(
        f"picked trial-{report.best_trial:04d}: best val_acc (max)"
    )
    assert report.best_values[1] <= 48_000 and "pareto" in report.plots


def test_a_sweep_where_every_trial_ties_still_reports(tmp_path: Path) -> None:
    # A new team's easy data: every trial reaches val_acc 1.0. fANOVA raises "zero total variance"
    # on such a study; the report must say why there is no importance and never fail the sweep.
    spec = small_spec(
        search=SearchSpec(params={**LR, "hidden": IntParam(low=16, high=64, step=16)}, n_trials=5, sampler="random")
    )
    sweeps = store_at(tmp_path)
    study = sweeps.load_or_create("ties", "max", spec.search)
    for n in sweeps.ensure_trials(study, spec.search):
        sweeps.tell("ties", n, 1.0, {})
    report = build_report(sweeps, study, spec)
    assert report.status.complete == 5 and report.best_values == [1.0] and report.best_trial == 0
    assert report.importances == {} and "importance" not in report.plots and "history" in report.plots
    assert (
        report.importance_note
        == "every completed trial scored val_acc = 1.0: no parameter explains a difference, so importance is undefined"
    )


def test_an_importance_evaluator_failure_is_a_note_not_a_failed_sweep(tmp_path: Path, monkeypatch) -> None:

    spec = small_spec(
        search=SearchSpec(params={**LR, "hidden": IntParam(low=16, high=64, step=16)}, n_trials=4, sampler="random")
    )
    sweeps = store_at(tmp_path)
    study = sweeps.load_or_create("odd", "max", spec.search)
    for n in sweeps.ensure_trials(study, spec.search):
        sweeps.tell("odd", n, n / 10, {})

    def broken(*args, **kwargs):
        raise RuntimeError("Encountered zero total variance in all trees.")

    # The module itself: `optuna.importance` may still be optuna's lazy proxy, which a later import replaces.
    monkeypatch.setattr(importlib.import_module("optuna.importance"), "get_param_importances", broken)
    report = build_report(sweeps, study, spec)
    assert report.importances == {} and report.best_trial == 3
    assert (
        report.importance_note
        == "parameter importance could not be computed (fANOVA): RuntimeError: Encountered zero total variance in all "
           "trees."
    )


def test_a_plot_that_cannot_be_drawn_is_a_note_not_a_failed_sweep(tmp_path: Path, monkeypatch) -> None:
    from resources.sweeps import report as report_module

    spec = small_spec(search=SearchSpec(params=LR, n_trials=3, sampler="random"))
    sweeps = store_at(tmp_path)
    study = sweeps.load_or_create("plots", "max", spec.search)
    for n in sweeps.ensure_trials(study, spec.search):
        sweeps.tell("plots", n, n / 10, {})

    def broken(*args, **kwargs):
        raise ValueError("Axis limits cannot be NaN or Inf")

    monkeypatch.setattr(report_module, "history_png", broken)
    report = build_report(sweeps, study, spec)
    assert "history" not in report.plots and report.best_trial == 2
    assert report.problems == ["history plot: ValueError: Axis limits cannot be NaN or Inf"]
