"""The sweep report: trials table, best parameters, importance and Pareto plots."""

from __future__ import annotations

from pathlib import Path

from optuna.trial import TrialState

from resources.sweeps import build_report, trials_markdown
from tests.pipelines.pipeline_fixtures import small_spec
from tests.resources.sweeps.fakes import LR, MAXMIN, done, running, store_at
from trainyard.spec import IntParam, Objective, PickPolicy, SearchSpec


def test_trials_markdown_small_and_large() -> None:
    objs = [Objective(metric="val_acc", mode="max")]
    small = trials_markdown([done(1, 0.5), done(0, 0.25, state=TrialState.PRUNED), done(2, state=TrialState.FAIL, error="rank 1 raised X")], objs)
    assert small == (
        "| trial | state | val_acc | params | note |\n|---|---|---|---|---|\n"
        "| trial-0000 | PRUNED |  | {'lr': 0.01} | pruned at epoch 0 |\n"
        "| trial-0001 | COMPLETE | 0.5 | {'lr': 0.01} |  |\n"
        "| trial-0002 | FAIL |  | {'lr': 0.01} | rank 1 raised X |"
    )
    large = trials_markdown([done(i, i / 100) for i in range(30)] + [running(30)], objs, limit=3)
    lines = large.splitlines()
    assert lines[0] == "showing the best 3 of 30 completed trials and up to 3 in flight"
    assert [line.split(" | ")[0] for line in lines[4:]] == ["| trial-0029", "| trial-0028", "| trial-0027", "| trial-0030"]


def test_report_has_best_params_history_and_importance(tmp_path: Path) -> None:
    spec = small_spec(search=SearchSpec(params={**LR, "hidden": IntParam(low=16, high=64, step=16)}, n_trials=6, sampler="random"))
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
    assert r1.importance_note == "parameter importance needs at least 2 completed trials, the study has 1" and "importance" not in r1.plots


def test_multi_objective_report_has_the_pareto_front(tmp_path: Path) -> None:
    search = SearchSpec(params={**LR, "hidden": IntParam(low=16, high=64, step=16)}, n_trials=5, sampler="random", objectives=MAXMIN,
                        pick=PickPolicy(limits={"model_bytes": 48_000}))
    spec = small_spec(search=search)
    sweeps = store_at(tmp_path)
    study = sweeps.load_or_create("mo", ["max", "min"], search)
    for n in sweeps.ensure_trials(study, search):
        p = sweeps.trial("mo", n).params
        sweeps.tell("mo", n, [1.0 - abs(p["lr"] - 0.01), 1000.0 * p["hidden"]], {})
    report = build_report(sweeps, study, spec)
    assert report.pareto_md is not None and report.pareto_md.startswith(f"picked trial-{report.best_trial:04d}: best val_acc (max)")
    assert report.best_values[1] <= 48_000 and "pareto" in report.plots
