"""Sweep rules with exact values: stop rules, spec validation, samplers, objectives and the pick."""

from __future__ import annotations

import pytest
from optuna.trial import TrialState
from pydantic import ValidationError

from resources.sweeps import (
    SweepError,
    build_sampler,
    derive_seed,
    inert_pruner,
    objective_values,
    pareto_front,
    pick_trial,
    sweep_status,
)
from tests.pipelines.pipeline_fixtures import small_spec
from tests.resources.sweeps.fakes import LR, MAXMIN, done, running
from training.pruners import build_pruner
from training.spec import PrunerSpec
from trainyard.search import CategoricalParam, IntParam, Objective, PickPolicy, SearchSpec

# -- stop rules -------------------------------------------------------------------------------


def test_status_counts_live_trials_against_the_budget() -> None:
    search = SearchSpec(params=LR, n_trials=5)
    trials = [done(0, 0.5), done(1, 0.7), done(2, state=TrialState.FAIL), running(3)]
    st = sweep_status(trials, search, ["max"], created_at=0.0, now=10.0)
    assert (st.budget, st.complete, st.failed, st.running, st.live, st.remaining, st.best, st.stop_reason) == (
        5,
        2,
        1,
        1,
        3,
        2,
        0.7,
        None,
    )
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
    st = sweep_status(
        trials, SearchSpec(params=LR, n_trials=9, timeout_seconds=60), ["min"], created_at=100.0, now=161.0
    )
    assert st.stop_reason == "time budget spent: 61 s since the sweep started (timeout_seconds 60)"
    assert (
        sweep_status(trials, SearchSpec(params=LR, n_trials=9), ["min"], 0.0, 1.0, stopped="by hand").stop_reason
        == "by hand"
    )


def test_grid_budget_is_the_grid_size() -> None:
    search = SearchSpec(
        params={"h": IntParam(low=16, high=64, step=16), "act": CategoricalParam(choices=["relu", "tanh"])},
        n_trials=8,
        sampler="grid",
    )
    assert search.grid_size == 8
    assert sweep_status([], search, ["max"], None, 0.0).budget == 8


# -- spec validation --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"params": LR, "n_trials": 2, "sampler": "grid"},
            "sampler 'grid' needs discrete parameters; ['lr'] are FloatParam",
        ),
        (
            {"params": {"h": IntParam(low=1, high=3)}, "n_trials": 4, "sampler": "grid"},
            "n_trials=4 exceeds the 3 points of the grid",
        ),
        (
            {"params": LR, "objectives": [Objective(metric="val_acc", mode="max")]},
            "objectives lists two or more metrics",
        ),
        (
            {
                "params": LR,
                "objectives": [Objective(metric="val_acc", mode="max"), Objective(metric="test_acc", mode="max")],
            },
            "objectives ['test_acc'] are measured on the test split",
        ),
        (
            {
                "params": LR,
                "objectives": [Objective(metric="val_acc", mode="max"), Objective(metric="model_bytes", mode="min")],
                "pruner": PrunerSpec(kind="median"),
            },
            "pruner 'median' cannot be used with objectives",
        ),
        (
            {
                "params": LR,
                "objectives": [Objective(metric="val_acc", mode="max"), Objective(metric="model_bytes", mode="min")],
                "pick": PickPolicy(limits={"latency": 3.0}),
            },
            "pick names ['latency'], which are not among the objectives",
        ),
        (
            {"params": LR, "pick": PickPolicy(rule="utopia")},
            "pick chooses among a Pareto front and applies to multi-objective sweeps only",
        ),
        ({"params": LR, "parallelism": 0}, "greater than or equal to 1"),
    ],
)
def test_search_spec_names_what_is_wrong(kwargs, message) -> None:
    with pytest.raises(
        ValidationError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(")", r"\)")
    ):
        SearchSpec(**kwargs)


def test_objective_metrics_must_be_reported() -> None:
    search = SearchSpec(
        params=LR, objectives=[Objective(metric="val_acc", mode="max"), Objective(metric="latency_ms", mode="min")]
    )
    with pytest.raises(ValidationError, match="objective metric 'latency_ms' is not reported by trials"):
        small_spec(search=search)


def test_running_a_sweep_differently_keeps_its_study() -> None:
    base = small_spec(search=SearchSpec(params=LR, n_trials=4))
    paced = small_spec(
        search=SearchSpec(params=LR, n_trials=40, parallelism=4, timeout_seconds=3600, target=0.99, max_failures=9)
    )
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


# -- objectives and the pick ------------------------------------------------------------------


def test_objective_values_come_from_the_result() -> None:
    result = {"best_metric": 0.91, "metrics": {"val_acc": 0.9, "val_loss": 0.3}, "fit_seconds": 12.5}
    objectives = [
        Objective(metric="val_loss", mode="min"),
        Objective(metric="model_bytes", mode="min"),
        Objective(metric="fit_seconds", mode="min"),
    ]
    assert objective_values(result, objectives, "val_loss", model_bytes=4096) == [0.91, 4096.0, 12.5]
    assert objective_values(result, [Objective(metric="val_acc", mode="max")], "val_loss") == [0.9]
    with pytest.raises(
        SweepError, match=r"objective 'val_f1' is not in the trial's result; available: \['device_hours'"
    ):
        objective_values(result, [Objective(metric="val_f1", mode="max")], "val_loss")


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


# -- a pruner that can prune nothing ------------------------------------------------------------


@pytest.mark.parametrize(
    "n_trials, pruner, message",
    [
        (
            4,
            PrunerSpec(kind="median"),
            "pruner 'median' prunes only after 5 completed trial(s) (n_startup_trials=5), and the last of this "
            "sweep's 4 trial(s) sees at most 3: no trial can be pruned; set n_startup_trials to at most 3, raise "
            "n_trials, or drop the pruner",
        ),
        (5, PrunerSpec(kind="median"), "sees at most 4: no trial can be pruned; set n_startup_trials to at most 4"),
        (6, PrunerSpec(kind="median"), None),
        (2, PrunerSpec(kind="median", n_startup_trials=0), None),
        (
            1,
            PrunerSpec(kind="median", n_startup_trials=0),
            "prunes only after 1 completed trial(s) (n_startup_trials=0), and the last of this "
            "sweep's 1 trial(s) sees at most 0: no trial can be pruned; it needs n_trials >= 2, raise n_trials, or "
            "drop the pruner",
        ),
        (1, PrunerSpec(kind="threshold", lower=0.5), None),  # no startup count: it can stop the only trial
        (1, PrunerSpec(), None),
    ],
)
def test_inert_pruner_names_why_no_trial_can_be_pruned(n_trials, pruner, message) -> None:
    text = inert_pruner(SearchSpec(params=LR, n_trials=n_trials, pruner=pruner))
    assert text == message if message is None or message.startswith("pruner") else message in text


@pytest.mark.parametrize("n_startup_trials, inert", [(4, True), (3, False)])
def test_inert_pruner_agrees_with_optunas_median_pruner(n_startup_trials: int, inert: bool) -> None:
    """Optuna's own pruner, as trials use it: 3 trials complete, then the sweep's 4th and last reports far worse
    values."""
    import optuna

    spec = PrunerSpec(kind="median", n_startup_trials=n_startup_trials)
    assert (inert_pruner(SearchSpec(params=LR, n_trials=4, pruner=spec)) is not None) is inert
    study = optuna.create_study(direction="maximize", pruner=build_pruner(spec, max_epochs=3))
    for value in (0.8, 0.9, 0.85):
        trial = study.ask()
        for epoch in range(3):
            trial.report(value, epoch)
            assert (
                not trial.should_prune()
            )  # fewer completed trials than the startup count, or no worse than the median
        study.tell(trial, value)
    last = study.ask()
    last.report(0.1, 0)
    assert last.should_prune() is not inert
