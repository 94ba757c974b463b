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
from resources.sweeps.rules import derive_seed
from tests.resources.sweeps.fakes import store_at
from trainyard.search import CategoricalParam, FloatParam, IntParam, Objective, SearchSpec

SPACE = {"lr": FloatParam(low=1e-4, high=1e-1, log=True), "hidden": IntParam(low=16, high=256, log=True),
         "act": CategoricalParam(choices=["relu", "tanh"]), "width": IntParam(low=2, high=40, step=2)}


def _value(p: dict) -> float:
    """A smooth score with its best at lr 1e-2, hidden 64, tanh, width 20."""
    return (
        -((math.log10(p["lr"]) + 2) ** 2)
        - (math.log2(p["hidden"]) - 6) ** 2
        - (p["act"] != "tanh")
        - ((p["width"] - 20) / 10) ** 2
    )


def _seeded(tmp_path: Path, search: SearchSpec, finished: int, running: int, direction="max"):
    sweeps = store_at(tmp_path)
    study = sweeps.load_or_create("b", direction, search)
    rnd = optuna.samplers.RandomSampler(seed=3)  # the seeded trials' parameters: random, not TPE
    dists = distributions(search)
    for i in range(finished + running):
        params = {
            n: rnd.sample_independent(study, optuna.trial.create_trial(state=optuna.trial.TrialState.RUNNING), n, d)
            for n, d in dists.items()
        }
        value = _value(params) if i < finished else None
        state = optuna.trial.TrialState.COMPLETE if value is not None else optuna.trial.TrialState.RUNNING
        values = (
            None if value is None else ([value] if isinstance(direction, str) else [value, float(params["hidden"])])
        )
        study.add_trial(optuna.trial.create_trial(state=state, params=params, distributions=dists, values=values))
    return sweeps, study, dists


@pytest.mark.parametrize("running,parallelism,direction", [(0, 8, "max"), (5, 8, "max"), (0, 1, "max"), (5, 8, "min")])
def test_a_batch_of_one_is_exactly_optunas_ask(tmp_path: Path, running: int, parallelism: int, direction: str) -> None:
    """Same study, same seed: the batch path draws the parameters `Study.ask` draws (with and without constant liar; a
    loss to minimize too)."""
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
    """`SweepStore.ask` with TPE never calls `Study.ask` after the startup trials, and its trials tell and report as
    any."""
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
    search = SearchSpec(
        params=SPACE,
        n_trials=100,
        parallelism=4,
        objectives=[Objective(metric="val_acc", mode="max"), Objective(metric="model_bytes", mode="min")],
    )
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


@pytest.mark.slow
def test_batched_tpe_finds_the_optimum_as_well_as_sequential_tpe(tmp_path: Path) -> None:
    """120 trials in ticks of 8 from one fit each, against 120 asked one by one with constant liar over 8 in flight.

    Both start from the same 10 random trials; the batch path must do about as
    well as Optuna's own parallel TPE, and far better than random search.
    """
    def sweep(kind: str, root: Path) -> list[float]:
        search = SearchSpec(
            params=SPACE, n_trials=120, parallelism=8, seed=4, sampler="random" if kind == "random" else "tpe"
        )
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


def _memory_study(n_done: int, n_running: int, space: dict, seed: int, directions=("maximize",)):
    """An in-memory study of `n_done` finished (some pruned) and `n_running` running trials with random parameters."""
    import random

    from optuna.trial import TrialState, create_trial

    search = SearchSpec(params=space, n_trials=n_done + n_running + 100, parallelism=8, seed=seed)
    dists = distributions(search)
    study = optuna.create_study(directions=list(directions))
    rnd = optuna.samplers.RandomSampler(seed=seed)
    noise = random.Random(seed)
    trials = []
    for i in range(n_done + n_running):
        params = {
            n: rnd.sample_independent(study, create_trial(state=TrialState.RUNNING), n, d) for n, d in dists.items()
        }
        if i >= n_done:
            trials.append(create_trial(state=TrialState.RUNNING, params=params, distributions=dists))
            continue
        value = _value({**{"lr": 1e-2, "hidden": 64, "act": "tanh", "width": 20}, **params}) + noise.gauss(0, 0.1)
        values = [value] if len(directions) == 1 else [value, noise.random()]
        trials.append(create_trial(state=TrialState.COMPLETE, params=params, distributions=dists, values=values))
    study.add_trials(trials)
    return search, dists, study


class _OptunasOwnLogPdf:
    """FastMixture's interface over Optuna's own `_MixtureOfProductDistribution.log_pdf`."""

    def __init__(self, mixture) -> None:
        self.mixture = mixture

    def log_pdf(self, x):
        return self.mixture.log_pdf(x)


def _optunas_own_draws(mixtures, rng, draws, size):
    """`sample_draws` as Optuna's own calls: per draw, `mixture.sample(rng, size)` of each space in turn."""
    import numpy as np

    out: list[list] = [[] for _ in mixtures]
    for _ in range(draws):
        for i, mixture in enumerate(mixtures):
            out[i].append(mixture.sample(rng, size))
    return [np.concatenate(o) for o in out]


MIXED = {"lr": FloatParam(low=1e-4, high=1e-1, log=True), "drop": FloatParam(low=0.0, high=0.5),
         "hidden": IntParam(low=16, high=256, log=True), "width": IntParam(low=2, high=40, step=2),
         "act": CategoricalParam(choices=["relu", "tanh", "gelu"])}
DIGITS = {"lr": FloatParam(low=1e-3, high=5e-2, log=True), "hidden": IntParam(low=16, high=128, step=16)}


@pytest.mark.parametrize("space,n_done,n_running,directions", [
    (DIGITS, 3000, 64, ("maximize",)),  # the benchmark's space, most components far from any candidate
    (MIXED, 400, 8, ("maximize",)),
    (MIXED, 200, 0, ("minimize",)),
    (SPACE, 120, 4, ("maximize", "minimize")),  # multi-objective: one space per parameter
])
def test_a_tick_draws_what_optunas_own_acquisition_draws(monkeypatch, space, n_done, n_running, directions) -> None:
    """A tick's 64 draws are the ones Optuna's own code draws from the same fit and seed, one draw after another.

    The reference: each draw's candidates from `mixture.sample` and their
    acquisition from Optuna's `log_pdf`, call by call (the batch path before
    candidates and acquisition were vectorised across draws). Same parameter
    sets, bit for bit, in the same order.
    """
    import resources.sweeps.batch as batch

    for seed in (1, 2, 3):
        search, dists, study = _memory_study(n_done, n_running, space, seed, directions)
        fast = tpe_batch(study, build_sampler(search, seed), dists, 64)
        with monkeypatch.context() as m:
            m.setattr(batch, "FastMixture", _OptunasOwnLogPdf)
            m.setattr(batch, "sample_draws", _optunas_own_draws)
            own = tpe_batch(study, build_sampler(search, seed), dists, 64)
        assert fast == own
        assert len(fast) == 64 and len({tuple(sorted(p.items())) for p in fast}) > 1


@pytest.mark.parametrize("space", [DIGITS, MIXED, SPACE])
def test_fast_log_densities_are_optunas(space) -> None:
    """`FastMixture.log_pdf` against Optuna's on both estimators, candidates from the better one and at the bounds."""
    import numpy as np
    from optuna.samplers._tpe.sampler import _split_trials, default_gamma
    from optuna.trial import TrialState

    from resources.sweeps.acquisition import FastMixture

    search, dists, study = _memory_study(500, 8, space, 5)
    sampler = build_sampler(search, 5)
    trials = study._get_trials(
        deepcopy=False, states=[TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING], use_cache=False
    )
    below, above = _split_trials(study, trials, default_gamma(500))
    names = dict(sorted(dists.items()))
    for part, handle_below in ((below, True), (above, False)):
        mpe = sampler._build_parzen_estimator(study, names, part, handle_below=handle_below)
        fast = FastMixture(mpe._mixture_distribution)
        x = mpe._transform(mpe.sample(np.random.RandomState(0), 500))
        np.testing.assert_allclose(fast.log_pdf(x), mpe._mixture_distribution.log_pdf(x), rtol=1e-11, atol=1e-11)
        edges = x[:4].copy()  # each continuous parameter at its low and high end: Optuna's own path answers those
        for i, d in enumerate(mpe._mixture_distribution.distributions):
            if getattr(d, "step", None) == 0.0:
                edges[0, i], edges[1, i] = d.low, d.high
        np.testing.assert_allclose(
            fast.log_pdf(edges), mpe._mixture_distribution.log_pdf(edges), rtol=1e-11, atol=1e-11
        )


@pytest.mark.parametrize("space,n_done", [(DIGITS, 3000), (MIXED, 300), (SPACE, 60)])
def test_candidates_drawn_at_once_are_optunas_one_call_at_a_time(space, n_done) -> None:
    """`sample_draws` returns bit for bit what `mixture.sample` calls return in turn, and leaves the random stream where
    they leave it."""
    import numpy as np
    from optuna.samplers._tpe.sampler import _split_trials, default_gamma
    from optuna.trial import TrialState

    from resources.sweeps.acquisition import sample_draws

    search, dists, study = _memory_study(n_done, 8, space, 4)
    sampler = build_sampler(search, 4)
    trials = study._get_trials(
        deepcopy=False, states=[TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING], use_cache=False
    )
    below, above = _split_trials(study, trials, default_gamma(n_done))
    names = dict(sorted(dists.items()))
    mixtures = [
        sampler._build_parzen_estimator(study, names, part, handle_below=h)._mixture_distribution
        for part, h in ((below, True), (above, False))
    ]
    for seed in range(6):
        one, batch = np.random.RandomState(seed), np.random.RandomState(seed)
        expected = _optunas_own_draws(mixtures, one, 64, 24)
        got = sample_draws(mixtures, batch, 64, 24)
        for e, g in zip(expected, got):
            np.testing.assert_array_equal(g, e)
        assert one.random_sample() == batch.random_sample()


@pytest.mark.parametrize("parallelism", [1, 8])
def test_a_study_kept_between_ticks_draws_from_the_trials_stored_now(tmp_path: Path, parallelism: int) -> None:
    """The sweep store keeps one Study per process between ticks; a tick after others told results draws what a fresh
    Study draws.

    Without constant liar (parallelism 1) TPE reads the finished trials through
    the Study's snapshot; with it, the search space is inferred through it. A
    snapshot left from an earlier tick must not stand in for the study.
    """
    search = SearchSpec(params=SPACE, n_trials=200, parallelism=parallelism, seed=6)
    sweeps, study, dists = _seeded(tmp_path, search, finished=20, running=0)
    kept = sweeps.load("b", search)
    assert sweeps.ask(kept, search, 4)  # a first tick on the kept Study
    other = optuna.load_study(study_name="b", storage=sweeps.storage())  # another process tells and adds results
    for t in other.get_trials():
        if t.state.name == "RUNNING":
            other.tell(t.number, _value(t.params))
    rnd = optuna.samplers.RandomSampler(seed=9)
    for _ in range(30):
        params = {
            n: rnd.sample_independent(other, optuna.trial.create_trial(state=optuna.trial.TrialState.RUNNING), n, d)
            for n, d in dists.items()
        }
        other.add_trial(
            optuna.trial.create_trial(
                state=optuna.trial.TrialState.COMPLETE, params=params, distributions=dists, values=[_value(params)]
            )
        )
    fresh = optuna.load_study(study_name="b", storage=sweeps.storage())
    assert tpe_batch(kept, build_sampler(search, 3), dists, 8) == tpe_batch(fresh, build_sampler(search, 3), dists, 8)
    assert kept._thread_local.cached_all_trials is None


def test_the_sampler_of_each_tick_takes_over_the_search_space_and_still_sees_new_trials(tmp_path: Path) -> None:
    """`SweepStore.load` builds a sampler per tick that keeps the last one's incremental search space, and infers what a
    fresh one infers.

    Both after ordinary new results (the space stands) and after another
    process stored a trial with another range for `lr` (the space loses it,
    the tick asks one trial at a time as before).
    """
    from resources.sweeps.batch import _spaces

    search = SearchSpec(params=SPACE, n_trials=200, parallelism=8, seed=6)
    sweeps, study, dists = _seeded(tmp_path, search, finished=20, running=0)
    first = sweeps.load("b", search)
    assert sweeps.ask(first, search, 8)
    space = first.sampler._search_space
    other = optuna.load_study(study_name="b", storage=sweeps.storage())
    for t in other.get_trials():
        if t.state.name == "RUNNING":
            other.tell(t.number, _value(t.params))

    def fresh_spaces():
        fresh = optuna.load_study(study_name="b", storage=sweeps.storage(), sampler=build_sampler(search, 1))
        return _spaces(fresh.sampler, fresh, dists)

    second = sweeps.load("b", search)
    assert second.sampler._search_space is space
    assert _spaces(second.sampler, second, dists) == fresh_spaces() is not None
    seed = derive_seed(search.seed, len(second.get_trials()))  # the seed `load` gave this tick's sampler
    fresh = optuna.load_study(study_name="b", storage=sweeps.storage())
    assert tpe_batch(second, second.sampler, dists, 8) == tpe_batch(fresh, build_sampler(search, seed), dists, 8)
    wider = {**dists, "lr": optuna.distributions.FloatDistribution(1e-5, 1.0, log=True)}
    other.add_trial(
        optuna.trial.create_trial(
            state=optuna.trial.TrialState.COMPLETE,
            params={"lr": 0.5, "hidden": 32, "act": "relu", "width": 10},
            distributions=wider,
            values=[0.0],
        )
    )
    third = sweeps.load("b", search)
    assert third.sampler._search_space is space
    assert _spaces(third.sampler, third, dists) is None and fresh_spaces() is None
