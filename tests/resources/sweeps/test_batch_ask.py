"""TPE trials asked a tick at a time from one fit (`resources.sweeps.batch`), against Optuna's own `Study.ask`."""

from __future__ import annotations

import math
import time
import warnings
from pathlib import Path

import optuna
import pytest

from resources.sweeps import build_sampler, distributions
from resources.sweeps.batch import tpe_batch
from tests.resources.sweeps.fakes import store_at
from trainyard.search import CategoricalParam, FloatParam, IntParam, Objective, SearchSpec

SPACE = {"lr": FloatParam(low=1e-4, high=1e-1, log=True), "hidden": IntParam(low=16, high=256, log=True),
         "act": CategoricalParam(choices=["relu", "tanh"]), "width": IntParam(low=2, high=40, step=2)}


def _value(p: dict) -> float:
    """A smooth score with its best at lr 1e-2, hidden 64, tanh, width 20."""
    return -((math.log10(p["lr"]) + 2) ** 2) - (math.log2(p["hidden"]) - 6) ** 2 - (p["act"] != "tanh") - ((p["width"] - 20) / 10) ** 2


def _seeded(tmp_path: Path, search: SearchSpec, finished: int, running: int, direction="max"):
    sweeps = store_at(tmp_path)
    study = sweeps.load_or_create("b", direction, search)
    rnd = optuna.samplers.RandomSampler(seed=3)  # the seeded trials' parameters: random, not TPE
    dists = distributions(search)
    for i in range(finished + running):
        params = {n: rnd.sample_independent(study, optuna.trial.create_trial(state=optuna.trial.TrialState.RUNNING), n, d) for n, d in dists.items()}
        value = _value(params) if i < finished else None
        state = optuna.trial.TrialState.COMPLETE if value is not None else optuna.trial.TrialState.RUNNING
        values = None if value is None else ([value] if isinstance(direction, str) else [value, float(params["hidden"])])
        study.add_trial(optuna.trial.create_trial(state=state, params=params, distributions=dists, values=values))
    return sweeps, study, dists


@pytest.mark.parametrize("running,parallelism,direction", [(0, 8, "max"), (5, 8, "max"), (0, 1, "max"), (5, 8, "min")])
def test_a_batch_of_one_is_exactly_optunas_ask(tmp_path: Path, running: int, parallelism: int, direction: str) -> None:
    """Same study, same seed: the batch path draws the parameters `Study.ask` draws (with and without constant liar; a loss to minimize too)."""
    search = SearchSpec(params=SPACE, n_trials=100, parallelism=parallelism, seed=11)
    sweeps, study, dists = _seeded(tmp_path, search, finished=30, running=running, direction=direction)
    (batch,) = tpe_batch(study, build_sampler(search, 5), dists, 1)
    study.sampler = build_sampler(search, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        asked = study.ask(dists).params
    assert batch == asked
    assert build_sampler(search, 5)._constant_liar == (parallelism > 1)


def test_the_store_asks_tpe_in_one_batch_and_the_trials_are_ordinary(tmp_path: Path, monkeypatch) -> None:
    """`SweepStore.ask` with TPE never calls `Study.ask` after the startup trials, and its trials tell and report as any."""
    search = SearchSpec(params=SPACE, n_trials=100, parallelism=16, seed=2)
    sweeps, study, dists = _seeded(tmp_path, search, finished=20, running=0)
    study = sweeps.load("b", search)
    monkeypatch.setattr(optuna.Study, "ask", lambda *a, **k: pytest.fail("Study.ask called on the batch path"))
    numbers = sweeps.ask(study, search, 16)
    assert numbers == list(range(20, 36))
    trials = sweeps.load("b").get_trials()
    assert [t.state.name for t in trials[20:]] == ["RUNNING"] * 16
    for t in trials[20:]:
        assert set(t.params) == set(SPACE) and t.distributions == dists
        for name, d in dists.items():
            assert d._contains(d.to_internal_repr(t.params[name])), (name, t.params[name])
    assert len({(t.params["lr"], t.params["hidden"]) for t in trials[20:]}) == 16  # one fit, sixteen different draws
    assert sweeps.tell("b", numbers[0], 0.5, {}) == "COMPLETE"


def test_before_the_startup_trials_the_store_asks_one_at_a_time(tmp_path: Path) -> None:
    search = SearchSpec(params=SPACE, n_trials=100, parallelism=4)
    sweeps, study, dists = _seeded(tmp_path, search, finished=3, running=0)
    assert tpe_batch(study, build_sampler(search, 1), dists, 4) is None
    assert sweeps.ask(sweeps.load("b", search), search, 4) == [3, 4, 5, 6]


def test_a_multi_objective_batch_is_drawn_too(tmp_path: Path) -> None:
    search = SearchSpec(params=SPACE, n_trials=100, parallelism=4, objectives=[Objective(metric="val_acc", mode="max"), Objective(metric="model_bytes", mode="min")])
    sweeps, study, dists = _seeded(tmp_path, search, finished=25, running=2, direction=["max", "min"])
    (one,) = tpe_batch(study, build_sampler(search, 9), dists, 1)
    study.sampler = build_sampler(search, 9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert study.ask(dists).params == one
    assert len(tpe_batch(study, build_sampler(search, 9), dists, 4)) == 4


def test_a_deadline_cuts_the_batch_but_never_to_nothing(tmp_path: Path) -> None:
    search = SearchSpec(params=SPACE, n_trials=100, parallelism=8)
    sweeps, study, dists = _seeded(tmp_path, search, finished=15, running=0)
    assert len(tpe_batch(study, build_sampler(search, 1), dists, 8, deadline=time.monotonic() - 1)) == 1


def test_batched_tpe_finds_the_optimum_as_well_as_sequential_tpe(tmp_path: Path) -> None:
    """120 trials in ticks of 8 from one fit each, against 120 asked one by one with constant liar over 8 in flight.

    Both start from the same 10 random trials; the batch path must do about as
    well as Optuna's own parallel TPE, and far better than random search.
    """
    def sweep(kind: str, root: Path) -> list[float]:
        search = SearchSpec(params=SPACE, n_trials=120, parallelism=8, seed=4, sampler="random" if kind == "random" else "tpe")
        sweeps = store_at(root)
        sweeps.load_or_create("q", "max", search)
        values: list[float] = []
        while len(values) < 120:
            study = sweeps.load("q", search)
            if kind == "sequential":
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    numbers = [study.ask(distributions(search)).number for _ in range(8)]
            else:
                numbers = sweeps.ask(study, search, 8)
            for n in numbers:
                values.append(_value(sweeps.trial("q", n).params))
                sweeps.tell("q", n, values[-1], {})
        return values

    results = {kind: sweep(kind, tmp_path / kind) for kind in ("batch", "sequential", "random")}
    best_late = {kind: sorted(v[60:])[-10:] for kind, v in results.items()}  # the 10 best of the last 60 trials
    mean = {kind: sum(v) / len(v) for kind, v in best_late.items()}
    assert mean["batch"] > mean["random"] + 0.5, mean
    assert mean["batch"] > mean["sequential"] - 0.25, mean
