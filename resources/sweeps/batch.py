"""Asking a tick's trials of a TPE sweep from one fit of the sampler.

`Study.ask` with TPE re-reads every trial of the study, splits them into the
better and the worse fraction and builds both Parzen estimators, per ask. That
is O(trials) Python work per ask, so a tick of 64 asks at 10k trials took 21 s
here and a 10k sweep O(n^2) in all (issue 16). `tpe_batch` does that work
once per tick and draws each of the tick's trials from the one fit, with
Optuna's own TPE estimators: the trials of one tick are drawn as workers
asking at the same moment would draw them, each from its own
`n_ei_candidates` candidates. Trials in flight from earlier ticks count as the
constant liar's worst values, as in `Study.ask`. A batch of one is exactly
`Study.ask`'s draw (same seed, same parameters; tests/resources/sweeps/test_batch_ask.py).

The draws themselves are vectorised across the tick (`resources.sweeps.acquisition`):
every draw's candidates come from one pass over the sampler's random stream
(bit for bit what `mixture.sample` calls draw one after another), and every
candidate's acquisition from one evaluation that computes each component's
constant terms once, not once per draw; each draw then takes its best
candidate. Calling Optuna's sampling and `log_pdf` per draw cost 0.55 s of
a 64-ask tick at 10,000 trials, most of it recomputing per-component terms and
`exp` of underflowing terms (issue 16); now about 0.06 s. The same 64
parameter sets as per-draw calls of Optuna's code, on every seed the tests try.

It relies on `TPESampler` internals of the pinned Optuna (constraints.txt);
the equality test above fails if they change. Where its conditions do not hold
(fewer finished trials than `n_startup_trials`, a multivariate search space
the study's trials do not all share, grouped TPE) it answers None and the caller asks
one trial at a time.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import numpy as np

from resources.sweeps.acquisition import FastMixture, sample_draws

BatchParams = list[dict[str, Any]]


def _spaces(sampler: Any, study: Any, dists: dict[str, Any]) -> Optional[list[dict[str, Any]]]:
    """The search spaces TPE samples `dists` in, in `Study.ask`'s order; None where a batch cannot follow it.

    Multivariate TPE (single objective, Optuna's default) samples every
    varying parameter jointly: one space, which must be all of them (a study
    whose trials do not share them samples the rest independently). Otherwise
    (multi-objective) each parameter is its own space, in `dists` order.
    """
    from optuna.trial import TrialState, create_trial

    varying = {name: d for name, d in dists.items() if not d.single()}
    if sampler._group:
        return None
    if not sampler._is_multivariate(study):
        return [{name: d} for name, d in varying.items()]
    space = sampler.infer_relative_search_space(study, create_trial(state=TrialState.RUNNING))
    if set(space) != set(varying) or any(space[name] != d for name, d in varying.items()):
        return None
    return [dict(sorted(space.items()))]


def tpe_batch(
    study: Any, sampler: Any, dists: dict[str, Any], n: int, deadline: Optional[float] = None
) -> Optional[BatchParams]:
    """Up to `n` parameter sets drawn by `sampler` (a `TPESampler`) from one fit on `study`; None: ask one at a time.

    The sets come in draw order. The draws are computed together (tens of
    milliseconds at 10,000 trials); when `deadline` (time.monotonic()) has
    already passed, only one is drawn.
    """
    from optuna.distributions import _get_single_value
    from optuna.samplers import TPESampler
    from optuna.samplers._tpe.sampler import _split_trials, default_gamma, default_gamma_multiobjective
    from optuna.trial import TrialState

    if not isinstance(sampler, TPESampler) or n <= 0:
        return None
    # `Study.ask` starts each ask from the storage ("sync storage once every trial") by dropping the study's snapshot
    # of its trials, which TPE's search-space inference (and its trial read without constant liar) reads through
    # `use_cache`. The sweep store keeps one Study across ticks and never asks or tells through it on this path, so
    # without this a snapshot from an earlier tick would stand in for the study: new results unseen, and the trial
    # asked last without its parameters, which made the search space empty and sent a tick to `Study.ask`.
    study._thread_local.cached_all_trials = None
    states = [TrialState.COMPLETE, TrialState.PRUNED] + ([TrialState.RUNNING] if sampler._constant_liar else [])
    trials = study._get_trials(deepcopy=False, states=states, use_cache=not sampler._constant_liar)
    n_done = sum(t.state != TrialState.RUNNING for t in trials)
    if n_done < sampler._n_startup_trials:
        return None
    spaces = _spaces(sampler, study, dists)
    if spaces is None:
        return None
    if sampler._gamma is None:
        sampler._gamma = default_gamma if len(study.directions) <= 1 else default_gamma_multiobjective
    below, above = _split_trials(study, trials, sampler._gamma(n_done))
    fits = []
    for space in spaces:
        below_mpe = sampler._build_parzen_estimator(study, space, below, handle_below=True)
        above_mpe = sampler._build_parzen_estimator(study, space, above, handle_below=False)
        fits.append((space, below_mpe._mixture_distribution, FastMixture(below_mpe._mixture_distribution),
                     FastMixture(above_mpe._mixture_distribution)))
    fixed = {name: _get_single_value(d) for name, d in dists.items() if d.single()}
    draws = n if deadline is None or time.monotonic() < deadline else 1
    size = sampler._n_ei_candidates
    # Every draw's candidates at once, from the sampler's random stream as draws one after another take them; then
    # every candidate's acquisition in one evaluation (it does not depend on the other candidates) and each draw's pick.
    candidates = sample_draws([below for _, below, _, _ in fits], sampler._rng.rng, draws, size)
    batch: BatchParams = [dict(fixed) for _ in range(draws)]
    for (space, _, fast_below, fast_above), x in zip(fits, candidates):
        if not space:
            continue
        acquisition = (fast_below.log_pdf(x) - fast_above.log_pdf(x)).reshape(draws, size)
        best = np.argmax(acquisition, axis=1)  # the first of equal values, as TPESampler._compare
        for params, row in zip(batch, x.reshape(draws, size, -1)[np.arange(draws), best]):
            params.update({name: space[name].to_external_repr(value.item()) for name, value in zip(space, row)})
    study._thread_local.cached_all_trials = None  # the trials this batch creates are not in it
    return [{name: params[name] for name in dists} for params in batch]


def one_write(study: Any) -> bool:
    """Whether `study` is on the sweeps' own storage (`SweepRDBStorage` behind Optuna's cache), which creates a batch in
    one write."""
    from optuna.storages._cached_storage import _CachedStorage

    from resources.sweeps.rdb import SweepRDBStorage

    storage = study._storage
    return isinstance(storage, _CachedStorage) and isinstance(storage._backend, SweepRDBStorage)


def create_running(study: Any, params: BatchParams, dists: dict[str, Any], **guarded: Any) -> list[int]:
    """Create one RUNNING trial per parameter set; returns their numbers in order.

    On the sweeps' own storage (`one_write`) all in one write, and the cache
    learns them as `create_new_trial` would teach it; on any other storage one
    `create_new_trial` each.

    Args:
        guarded: `SweepRDBStorage.create_running_trials`'s `user_attrs`, `max_running` and `max_live`,
            which only the one write can honour (ValueError on any other storage).
    """
    from optuna.storages._cached_storage import _StudyInfo
    from optuna.trial import TrialState, create_trial

    storage = study._storage
    study_id = study._study_id
    if one_write(study):
        created = storage._backend.create_running_trials(study_id, params, dists, **guarded)
        with storage._lock:
            storage._studies.setdefault(study_id, _StudyInfo())
            storage._add_trials_to_cache(study_id, created)
        return [t.number for t in created]
    if guarded:
        raise ValueError(
            f"{sorted(guarded)} need the sweeps' own storage (SweepRDBStorage), which creates trials in one write"
        )
    numbers = []
    for p in params:
        trial_id = storage.create_new_trial(
            study_id, template_trial=create_trial(state=TrialState.RUNNING, params=p, distributions=dists)
        )
        numbers.append(storage.get_trial_number_from_id(trial_id))
    return numbers
