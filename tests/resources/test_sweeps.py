"""Sweep rules with exact values, and SweepStore against SQLite (and PostgreSQL in test_sensors)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState, create_trial
from pydantic import ValidationError

from trainyard.spec import CategoricalParam, FloatParam, IntParam, Objective, PickPolicy, SearchSpec
from resources.sweeps import (
    SweepError,
    SweepStore,
    build_report,
    build_sampler,
    derive_seed,
    objective_values,
    pareto_front,
    pick_trial,
    sweep_status,
    trials_markdown,
)
from tests.pipelines.pipeline_fixtures import small_spec
from training.spec import PrunerSpec

LR = {"lr": FloatParam(low=1e-3, high=1e-1, log=True)}
DIST = {"lr": FloatDistribution(1e-3, 1e-1, log=True)}


def done(number: int, *values: float, state: TrialState = TrialState.COMPLETE, **attrs):
    t = create_trial(state=state, values=list(values) if values and state == TrialState.COMPLETE else None,
                     params={"lr": 0.01}, distributions=DIST, user_attrs=attrs,
                     intermediate_values={0: values[0]} if state == TrialState.PRUNED and values else None)
    t.number = number
    return t


def running(number: int):
    t = create_trial(state=TrialState.RUNNING, params={"lr": 0.01}, distributions=DIST)
    t.number = number
    return t


# -- stop rules -------------------------------------------------------------------------------


def test_status_counts_live_trials_against_the_budget() -> None:
    search = SearchSpec(params=LR, n_trials=5)
    trials = [done(0, 0.5), done(1, 0.7), done(2, state=TrialState.FAIL), running(3)]
    st = sweep_status(trials, search, ["max"], created_at=0.0, now=10.0)
    assert (st.budget, st.complete, st.failed, st.running, st.live, st.remaining, st.best, st.stop_reason) == (5, 2, 1, 1, 3, 2, 0.7, None)
    assert not st.done
    assert st.summary() == "2/5 finished (2 complete, 0 pruned), 1 in flight, 1 failed, best 0.7"


def test_failure_budget_stops_asking_with_the_last_error() -> None:
    search = SearchSpec(params=LR, n_trials=10, max_failures=2)
    trials = [done(0, state=TrialState.FAIL, error="rank 0 raised ValueError: bad"), done(1, state=TrialState.FAIL)]
    st = sweep_status(trials, search, ["max"], created_at=0.0, now=1.0)
    assert st.stop_reason == (
        "failure budget spent: 2 trials failed (max_failures 2); last error: stopped without reporting: "
        "no heartbeat within the grace period (its run crashed or was killed)"
    )
    assert st.remaining == 0 and st.done
    assert SearchSpec(params=LR, n_trials=40).failure_budget == 8
    assert SearchSpec(params=LR, n_trials=4).failure_budget == 3


def test_target_and_time_budget() -> None:
    trials = [done(0, 0.3), done(1, 0.2)]
    st = sweep_status(trials, SearchSpec(params=LR, n_trials=9, target=0.25), ["min"], created_at=0.0, now=1.0)
    assert st.stop_reason == "target reached: best 0.2 <= target 0.25"
    assert sweep_status(trials, SearchSpec(params=LR, n_trials=9, target=0.1), ["min"], 0.0, 1.0).stop_reason is None
    st = sweep_status(trials, SearchSpec(params=LR, n_trials=9, timeout_seconds=60), ["min"], created_at=100.0, now=161.0)
    assert st.stop_reason == "time budget spent: 61 s since the sweep started (timeout_seconds 60)"
    assert sweep_status(trials, SearchSpec(params=LR, n_trials=9), ["min"], 0.0, 1.0, stopped="by hand").stop_reason == "by hand"


def test_grid_budget_is_the_grid_size() -> None:
    search = SearchSpec(params={"h": IntParam(low=16, high=64, step=16), "act": CategoricalParam(choices=["relu", "tanh"])}, n_trials=8, sampler="grid")
    assert search.grid_size == 8
    assert sweep_status([], search, ["max"], None, 0.0).budget == 8


# -- spec validation --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"params": LR, "n_trials": 2, "sampler": "grid"}, "sampler 'grid' needs discrete parameters; ['lr'] are FloatParam"),
        ({"params": {"h": IntParam(low=1, high=3)}, "n_trials": 4, "sampler": "grid"}, "n_trials=4 exceeds the 3 points of the grid"),
        ({"params": LR, "objectives": [Objective(metric="val_acc", mode="max")]}, "objectives lists two or more metrics"),
        ({"params": LR, "objectives": [Objective(metric="val_acc", mode="max"), Objective(metric="test_acc", mode="max")]},
         "objectives ['test_acc'] are measured on the test split"),
        ({"params": LR, "objectives": [Objective(metric="val_acc", mode="max"), Objective(metric="model_bytes", mode="min")],
          "pruner": PrunerSpec(kind="median")}, "pruner 'median' cannot be used with objectives"),
        ({"params": LR, "objectives": [Objective(metric="val_acc", mode="max"), Objective(metric="model_bytes", mode="min")],
          "pick": PickPolicy(limits={"latency": 3.0})}, "pick names ['latency'], which are not among the objectives"),
        ({"params": LR, "pick": PickPolicy(rule="utopia")}, "pick chooses among a Pareto front and applies to multi-objective sweeps only"),
        ({"params": LR, "parallelism": 0}, "greater than or equal to 1"),
    ],
)
def test_search_spec_names_what_is_wrong(kwargs, message) -> None:
    with pytest.raises(ValidationError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(")", r"\)")):
        SearchSpec(**kwargs)


def test_objective_metrics_must_be_reported() -> None:
    search = SearchSpec(params=LR, objectives=[Objective(metric="val_acc", mode="max"), Objective(metric="latency_ms", mode="min")])
    with pytest.raises(ValidationError, match="objective metric 'latency_ms' is not reported by trials"):
        small_spec(search=search)


def test_running_a_sweep_differently_keeps_its_study() -> None:
    base = small_spec(search=SearchSpec(params=LR, n_trials=4))
    paced = small_spec(search=SearchSpec(params=LR, n_trials=40, parallelism=4, timeout_seconds=3600, target=0.99, max_failures=9))
    other = small_spec(search=SearchSpec(params=LR, n_trials=4, sampler="random"))
    assert base.fingerprint() == paced.fingerprint() != other.fingerprint()


def test_window_defaults_to_all_trials_up_to_64() -> None:
    assert SearchSpec(params=LR, n_trials=4).window == 4
    assert SearchSpec(params=LR, n_trials=1000).window == 64
    assert SearchSpec(params=LR, n_trials=1000, parallelism=8).window == 8


# -- samplers ---------------------------------------------------------------------------------


def test_samplers() -> None:
    assert type(build_sampler(SearchSpec(params=LR, n_trials=8, parallelism=4), 1)).__name__ == "TPESampler"
    assert type(build_sampler(SearchSpec(params=LR, n_trials=8, sampler="random"), 1)).__name__ == "RandomSampler"
    grid = SearchSpec(params={"h": IntParam(low=16, high=48, step=16)}, n_trials=3, sampler="grid")
    assert type(build_sampler(grid, 1)).__name__ == "GridSampler"
    assert derive_seed(0, 0) == 0 and derive_seed(0, 5) == 5 and derive_seed(3, 5) == 3_000_014


def store_at(tmp_path: Path, **kw) -> SweepStore:
    return SweepStore(storage_url=f"sqlite:///{tmp_path / 'optuna.db'}", **kw)


def test_resumed_batches_draw_fresh_parameters(tmp_path: Path) -> None:
    search = SearchSpec(params=LR, n_trials=6, sampler="random", parallelism=2)
    sweeps = store_at(tmp_path)
    study = sweeps.load_or_create("s", "max", search)
    assert sweeps.ensure_trials(study, search) == [0, 1]
    for n in (0, 1):
        sweeps.tell("s", n, 0.5, {})
    again = store_at(tmp_path).load_or_create("s", "max", search)  # a restarted process resumes
    assert sweeps.ensure_trials(again, search) == [0, 1, 2, 3]
    lrs = [t.params["lr"] for t in again.get_trials()]
    assert len(set(lrs)) == 4


def test_grid_sweep_visits_every_point_once(tmp_path: Path) -> None:
    search = SearchSpec(params={"h": IntParam(low=16, high=64, step=16), "act": CategoricalParam(choices=["relu", "tanh"])}, n_trials=8, sampler="grid", parallelism=3)
    sweeps = store_at(tmp_path)
    study = sweeps.load_or_create("g", "max", search)
    while sweeps.status(study, search).remaining:
        for n in sweeps.ensure_trials(study, search):
            if sweeps.trial("g", n).state.name == "RUNNING":
                sweeps.tell("g", n, 0.1, {})
    points = sorted((t.params["h"], t.params["act"]) for t in study.get_trials())
    assert points == sorted((h, a) for h in (16, 32, 48, 64) for a in ("relu", "tanh"))


# -- the store ----------------------------------------------------------------------------------


def test_window_refills_and_failed_trials_are_replaced_until_the_budget(tmp_path: Path) -> None:
    search = SearchSpec(params=LR, n_trials=4, parallelism=2, max_failures=2, sampler="random")
    sweeps = store_at(tmp_path)
    study = sweeps.load_or_create("s", "max", search)
    assert sweeps.ensure_trials(study, search) == [0, 1]
    assert sweeps.tell("s", 0, None, {"error": "boom"}, failed=True) == "FAIL"
    assert sweeps.ensure_trials(study, search) == [1, 2]
    assert sweeps.tell("s", 1, None, {"error": "boom again"}, failed=True) == "FAIL"
    assert sweeps.ensure_trials(study, search) == [2]  # failure budget spent: no replacement
    st = sweeps.status(study, search)
    assert st.stop_reason == "failure budget spent: 2 trials failed (max_failures 2); last error: boom again"
    assert sweeps.tell("s", 1, 0.9, {"late": True}) == "FAIL"  # a finished trial keeps its state
    assert "late" not in sweeps.trial("s", 1).user_attrs


def test_directions_must_match_an_existing_study(tmp_path: Path) -> None:
    search = SearchSpec(params=LR)
    sweeps = store_at(tmp_path)
    sweeps.load_or_create("s", "max", search)
    with pytest.raises(SweepError, match=r"study 's' exists with directions \['maximize'\]; this sweep declares \['minimize'\]"):
        sweeps.load_or_create("s", "min", search)
    with pytest.raises(SweepError, match="study 'nope' does not exist"):
        sweeps.trial("nope", 0)


def test_pruned_and_multi_objective_tells(tmp_path: Path) -> None:
    sweeps = store_at(tmp_path)
    search = SearchSpec(params=LR, n_trials=2)
    study = sweeps.load_or_create("p", "max", search)
    sweeps.ensure_trials(study, search)
    sweeps.storage().set_trial_intermediate_value(sweeps.storage().get_trial_id_from_study_id_trial_number(
        sweeps.storage().get_study_id_from_name("p"), 0), 3, 0.42)
    assert sweeps.tell("p", 0, None, {"result_uri": "r"}, pruned=True) == "PRUNED"
    assert sweeps.trial("p", 0).values == [0.42]
    multi = SearchSpec(params=LR, objectives=[Objective(metric="val_acc", mode="max"), Objective(metric="model_bytes", mode="min")])
    m = sweeps.load_or_create("m", ["max", "min"], multi)
    sweeps.ensure_trials(m, multi)
    assert sweeps.tell("m", 0, [0.9, 1200.0], {}) == "COMPLETE"
    assert sweeps.trial("m", 0).values == [0.9, 1200.0]


def test_stale_heartbeat_fails_the_trial(tmp_path: Path) -> None:
    sweeps = store_at(tmp_path, heartbeat_interval=1, grace_period=1)
    search = SearchSpec(params=LR, n_trials=3, parallelism=2)
    study = sweeps.load_or_create("h", "max", search)
    sweeps.ensure_trials(study, search)
    with sweeps.heartbeat("h", 0):
        time.sleep(1.5)
        assert sweeps.fail_stale(study) == []  # beating: alive
    time.sleep(2.5)
    assert sweeps.fail_stale(study) == [0]  # stopped beating: its run is gone
    assert sweeps.fail_stale(study) == []  # trial 1 never beat (its run has not started): not stale
    assert sweeps.trial("h", 0).state.name == "FAIL"


# -- objectives and the pick ------------------------------------------------------------------


def test_objective_values_come_from_the_result() -> None:
    result = {"best_metric": 0.91, "metrics": {"val_acc": 0.9, "val_loss": 0.3}, "fit_seconds": 12.5}
    objectives = [Objective(metric="val_loss", mode="min"), Objective(metric="model_bytes", mode="min"), Objective(metric="fit_seconds", mode="min")]
    assert objective_values(result, objectives, "val_loss", model_bytes=4096) == [0.91, 4096.0, 12.5]
    assert objective_values(result, [Objective(metric="val_acc", mode="max")], "val_loss") == [0.9]
    with pytest.raises(SweepError, match=r"objective 'val_f1' is not in the trial's result; available: \['device_hours'"):
        objective_values(result, [Objective(metric="val_f1", mode="max")], "val_loss")


MAXMIN = [Objective(metric="val_acc", mode="max"), Objective(metric="model_bytes", mode="min")]


def test_pareto_front_and_pick_policies() -> None:
    trials = [done(0, 0.90, 500.0), done(1, 0.95, 2000.0), done(2, 0.85, 600.0), done(3, 0.97, 9000.0),
              done(4, 0.93, 1000.0), done(5, state=TrialState.FAIL)]
    front = pareto_front(trials, ["max", "min"])
    assert [t.number for t in front] == [0, 1, 3, 4]
    best, why = pick_trial(front, MAXMIN, PickPolicy())
    assert best.number == 3 and why == "best val_acc (max) of 4 Pareto-optimal trial(s)"
    best, why = pick_trial(front, MAXMIN, PickPolicy(limits={"model_bytes": 1500}))
    assert best.number == 4 and why == "best val_acc (max) of 2 Pareto-optimal trial(s) within {'model_bytes': 1500.0}"
    best, _ = pick_trial(front, MAXMIN, PickPolicy(metric="model_bytes"))
    assert best.number == 0
    # utopia: scaled over the front (val_acc 0.90..0.97, bytes 500..9000) trial 1 sits at (0.714, 0.176):
    # distance sqrt(0.286**2 + 0.176**2) = 0.336 to the ideal (1, 0); trial 4 at (0.429, 0.059) is 0.574 away
    best, why = pick_trial(front, MAXMIN, PickPolicy(rule="utopia"))
    assert best.number == 1 and why == "closest to the ideal point (distance 0.336) of 4 Pareto-optimal trial(s)"
    with pytest.raises(SweepError, match="no trial of the Pareto front \\(4 trials\\) is within the pick limits"):
        pick_trial(front, MAXMIN, PickPolicy(limits={"val_acc": 0.99}))
    with pytest.raises(SweepError, match="the Pareto front is empty"):
        pick_trial([], MAXMIN, PickPolicy())


# -- reports ----------------------------------------------------------------------------------


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


def test_cmaes_sweep_adapts_across_fresh_samplers(tmp_path: Path) -> None:
    """Every ask builds a fresh sampler (as a sensor tick does); CMA-ES keeps its state in the study and converges."""
    search = SearchSpec(params={"x": FloatParam(low=-5, high=5), "y": FloatParam(low=-5, high=5)}, n_trials=40, sampler="cmaes", parallelism=1)
    assert type(build_sampler(search, 1)).__name__ == "CmaEsSampler"
    sweeps = store_at(tmp_path)
    sweeps.load_or_create("c", "min", search)
    values = []
    for _ in range(40):
        (number,) = sweeps.ask(sweeps.load("c", search), search, 1)
        p = sweeps.trial("c", number).params
        values.append((p["x"] - 1) ** 2 + (p["y"] + 2) ** 2)
        sweeps.tell("c", number, values[-1], {})
    assert any(k.startswith("cma:") for t in sweeps.load("c").get_trials() for k in t.system_attrs)
    assert sum(values[-10:]) < 0.25 * sum(values[:10]), values  # the search distribution moved to the optimum and narrowed
