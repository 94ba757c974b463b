"""`SweepRDBStorage`'s bulk read of trials against Optuna's own, on SQLite and PostgreSQL."""

from __future__ import annotations

import math
import time
import warnings
from pathlib import Path

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState, create_trial

from resources.sweeps.rdb import SweepRDBStorage
from resources.sweeps.store import open_storage

DISTS = {"lr": FloatDistribution(1e-4, 1e-1, log=True), "hidden": IntDistribution(16, 256, step=16),
         "act": CategoricalDistribution(["relu", "tanh", None, 3]), "p": FloatDistribution(0.0, 1.0, step=0.25)}


def _fill(url: str, directions: list[str]) -> None:
    """Trials of every kind: complete, pruned (with intermediate nan and inf), failed, running, waiting; attrs of every JSON kind."""
    study = optuna.create_study(storage=url, study_name="s", directions=directions)
    rnd = optuna.samplers.RandomSampler(seed=1)
    for i in range(40):
        params = {n: rnd.sample_independent(study, create_trial(state=TrialState.RUNNING), n, d) for n, d in DISTS.items()}
        state = [TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL, TrialState.COMPLETE, TrialState.RUNNING][i % 5]
        values = None
        if state == TrialState.COMPLETE:
            values = [float("inf") if i == 3 else i / 7, -math.inf if i == 8 else 1.5][: len(directions)]
        elif state == TrialState.PRUNED:
            values = None
        used = {k: v for k, v in params.items() if not (i == 10 and k == "p")}  # one trial without a parameter
        study.add_trial(create_trial(
            state=state, params=used, distributions={k: DISTS[k] for k in used}, values=values,
            intermediate_values={0: 0.1, 1: float("nan"), 2: float("inf"), 5: -float("inf")} if i % 5 == 1 else {3: i / 3},
            user_attrs={"error": "x" * 3000, "n": i, "nested": {"a": [1, 2, None]}, "ok": True} if i % 2 else {},
            system_attrs={"fixed": {"lr": 0.01}} if i % 3 == 0 else {},
        ))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            study.ask()  # trials with no parameters yet
        study.enqueue_trial({"lr": 0.02})  # a waiting trial


def _compare(url: str) -> None:
    ours = SweepRDBStorage(url)
    theirs = optuna.storages.RDBStorage(url)
    study_id = theirs.get_study_id_from_name("s")
    reads = [(None, set(), -1), ((TrialState.COMPLETE, TrialState.PRUNED), set(), -1), (None, {3, 5, 9}, 20), (None, set(), 30),
             ((TrialState.RUNNING,), {2, 4}, 10)]
    for states, included, greater in reads:
        mine = ours._get_trials(study_id, states, included, greater)
        optunas = theirs._get_trials(study_id, states, included, greater)
        assert len(mine) == len(optunas) > 0 or states == (TrialState.RUNNING,)
        for a, b in zip(mine, optunas):
            # FrozenTrial equality treats nan != nan: compare intermediate values by repr.
            assert repr(a.intermediate_values) == repr(b.intermediate_values), b.number
            a.intermediate_values, b.intermediate_values = {}, {}
            assert a == b, (a, b)
            assert a.datetime_start == b.datetime_start and a.datetime_complete == b.datetime_complete and a._trial_id == b._trial_id


@pytest.mark.parametrize("directions", [["maximize"], ["minimize", "maximize"]])
def test_the_bulk_read_builds_optunas_trials_on_sqlite(tmp_path: Path, directions: list[str], monkeypatch) -> None:
    monkeypatch.setenv("TZ", "Asia/Kolkata")  # stored times are naive UTC, trials carry local time: not the same here
    time.tzset()
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    _fill(url, directions)
    try:
        _compare(url)
    finally:
        monkeypatch.undo()
        time.tzset()


def test_the_bulk_read_builds_optunas_trials_on_postgresql(pg_databases: list[str]) -> None:
    _fill(pg_databases[0], ["minimize", "maximize"])
    _compare(pg_databases[0])


def test_the_sweep_store_reads_through_it(tmp_path: Path) -> None:
    assert isinstance(open_storage(f"sqlite:///{tmp_path / 'o.db'}"), SweepRDBStorage)
