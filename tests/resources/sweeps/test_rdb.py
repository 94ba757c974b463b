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
    """Trials of every kind: complete, pruned (with intermediate nan and inf), failed, running, waiting; attrs of every
    JSON kind."""
    study = optuna.create_study(storage=url, study_name="s", directions=directions)
    rnd = optuna.samplers.RandomSampler(seed=1)
    for i in range(40):
        params = {
            n: rnd.sample_independent(study, create_trial(state=TrialState.RUNNING), n, d) for n, d in DISTS.items()
        }
        state = [TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL, TrialState.COMPLETE, TrialState.RUNNING][
            i % 5
        ]
        values = None
        if state == TrialState.COMPLETE:
            values = [float("inf") if i == 3 else i / 7, -math.inf if i == 8 else 1.5][: len(directions)]
        elif state == TrialState.PRUNED:
            values = None
        used = {k: v for k, v in params.items() if not (i == 10 and k == "p")}  # one trial without a parameter
        study.add_trial(
            create_trial(
                state=state,
                params=used,
                distributions={k: DISTS[k] for k in used},
                values=values,
                intermediate_values={0: 0.1, 1: float("nan"), 2: float("inf"), 5: -float("inf")}
                if i % 5 == 1
                else {3: i / 3},
                user_attrs={"error": "x" * 3000, "n": i, "nested": {"a": [1, 2, None]}, "ok": True} if i % 2 else {},
                system_attrs={"fixed": {"lr": 0.01}} if i % 3 == 0 else {},
            )
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            study.ask()  # trials with no parameters yet
        study.enqueue_trial({"lr": 0.02})  # a waiting trial


def _compare(url: str) -> None:
    ours = SweepRDBStorage(url)
    theirs = optuna.storages.RDBStorage(url)
    study_id = theirs.get_study_id_from_name("s")
    reads = [
        (None, set(), -1),
        ((TrialState.COMPLETE, TrialState.PRUNED), set(), -1),
        (None, {3, 5, 9}, 20),
        (None, set(), 30),
        ((TrialState.RUNNING,), {2, 4}, 10),
    ]
    for states, included, greater in reads:
        mine = ours._get_trials(study_id, states, included, greater)
        optunas = theirs._get_trials(study_id, states, included, greater)
        assert len(mine) == len(optunas) > 0 or states == (TrialState.RUNNING,)
        for a, b in zip(mine, optunas):
            # FrozenTrial equality treats nan != nan: compare intermediate values by repr.
            assert repr(a.intermediate_values) == repr(b.intermediate_values), b.number
            a.intermediate_values, b.intermediate_values = {}, {}
            assert a == b, (a, b)
            assert (
                a.datetime_start == b.datetime_start
                and a.datetime_complete == b.datetime_complete
                and a._trial_id == b._trial_id
            )


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


BATCH = [{"lr": 0.01, "hidden": 64, "act": "tanh", "p": 0.5}, {"lr": 0.003, "hidden": 16, "act": None, "p": 0.0},
         {"lr": 0.05, "hidden": 256, "act": 3, "p": 1.0}]


def _batch_against_optunas_create(url: str) -> None:
    """A batch written in one transaction reads back (through Optuna's own read) as `create_new_trial` of the same
    trials does."""
    ours = SweepRDBStorage(url)
    theirs = optuna.storages.RDBStorage(url)
    made = {}
    for name, create in (
        ("ours", lambda sid: ours.create_running_trials(sid, BATCH, DISTS)),
        (
            "theirs",
            lambda sid: [
                theirs.create_new_trial(sid, create_trial(state=TrialState.RUNNING, params=p, distributions=DISTS))
                for p in BATCH
            ],
        ),
    ):
        study_id = theirs.create_new_study([optuna.study.StudyDirection.MAXIMIZE], name)
        theirs.create_new_trial(study_id)  # a trial before the batch: numbers count on from it
        returned = create(study_id)
        made[name] = (returned, theirs.get_all_trials(study_id))
    (returned, mine), (_, optunas) = made["ours"], made["theirs"]
    assert [t.number for t in mine] == [t.number for t in optunas] == [0, 1, 2, 3]
    assert [t.number for t in returned] == [1, 2, 3]
    for read, got in zip(mine[1:], returned):
        assert (read.number, read._trial_id, read.params, read.distributions, read.state) == (
            got.number,
            got._trial_id,
            got.params,
            got.distributions,
            got.state,
        )
        assert read.datetime_start == got.datetime_start
    for a, b in zip(mine, optunas):
        assert (a.state, a.params, a.distributions, a.user_attrs, a.system_attrs, a.values) == (
            b.state,
            b.params,
            b.distributions,
            b.user_attrs,
            b.system_attrs,
            b.values,
        )
        assert a.datetime_start is not None and abs((a.datetime_start - b.datetime_start).total_seconds()) < 60
    # Optuna's own writes on the batch's trials work as on its own: a told trial completes.
    theirs.set_trial_state_values(mine[2]._trial_id, TrialState.COMPLETE, [0.5])
    assert theirs.get_trial(mine[2]._trial_id).value == 0.5


def test_a_batch_of_running_trials_is_what_optunas_create_writes_on_sqlite(tmp_path: Path) -> None:
    _batch_against_optunas_create(f"sqlite:///{tmp_path / 'optuna.db'}")


def test_a_batch_of_running_trials_is_what_optunas_create_writes_on_postgresql(pg_databases: list[str]) -> None:
    _batch_against_optunas_create(pg_databases[0])


def test_an_incompatible_distribution_writes_nothing_and_releases_the_study(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    ours = SweepRDBStorage(url)
    study_id = ours.create_new_study([optuna.study.StudyDirection.MAXIMIZE], "s")
    ours.create_running_trials(study_id, BATCH[:1], DISTS)
    wrong = {**DISTS, "hidden": CategoricalDistribution(["a", "b"])}
    with pytest.raises(ValueError, match="hidden|compatib"):
        ours.create_running_trials(study_id, [{**BATCH[0], "hidden": "a"}], wrong)
    assert len(ours.get_all_trials(study_id)) == 1
    # The failed batch holds no lock: another storage on the file writes at once.
    other = optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 2}})
    other.create_new_trial(study_id)
    assert [t.number for t in ours.get_all_trials(study_id)] == [0, 1]


def _create_batches(url: str, rounds: int) -> None:
    storage = SweepRDBStorage(
        url, engine_kwargs={"connect_args": {"timeout": 60}} if url.startswith("sqlite") else None
    )
    plain = optuna.storages.RDBStorage(
        url, engine_kwargs={"connect_args": {"timeout": 60}} if url.startswith("sqlite") else None
    )
    study_id = storage.get_study_id_from_name("s")
    for i in range(rounds):
        storage.create_running_trials(study_id, BATCH, DISTS)
        plain.create_new_trial(
            study_id, create_trial(state=TrialState.RUNNING, params=BATCH[i % 3], distributions=DISTS)
        )


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_concurrent_batches_and_optunas_creates_number_trials_without_gaps_or_repeats(
    tmp_path: Path, backend: str, request
) -> None:
    """Three processes, each alternating batches and Optuna's own create: every trial gets its own number, 0..n-1."""
    import multiprocessing

    url = f"sqlite:///{tmp_path / 'optuna.db'}" if backend == "sqlite" else request.getfixturevalue("pg_databases")[0]
    optuna.storages.RDBStorage(url).create_new_study([optuna.study.StudyDirection.MAXIMIZE], "s")
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_create_batches, args=(url, 10)) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert [w.exitcode for w in workers] == [0, 0, 0]
    trials = optuna.storages.RDBStorage(url).get_all_trials(optuna.storages.RDBStorage(url).get_study_id_from_name("s"))
    assert sorted(t.number for t in trials) == list(range(3 * 10 * 4))
