"""`SweepStore.reads_once`: a sweep-sensor tick reads the study's trials once per write, and sees every write of its
own.

Reads are counted at `SweepRDBStorage._get_trials` (every database read of a
study's trials, Optuna's cache included); "another process" is a second
storage object on the same SQLite file, whose writes this process's counter
never sees.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Iterator

import optuna
import pytest
from optuna.trial import TrialState

from resources.sweeps.rdb import SweepRDBStorage
from resources.sweeps.store import open_storage
from tests.resources.sweeps.fakes import LR, store_at
from trainyard.search import SearchSpec

SEARCH = SearchSpec(params=LR, n_trials=20, sampler="tpe", parallelism=4, seed=3)


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Appends the study id of every database read of a study's trials (any SweepRDBStorage in this process)."""
    seen: list[int] = []
    real = SweepRDBStorage._get_trials

    def counted(self: SweepRDBStorage, study_id: int, *args: Any, **kwargs: Any) -> Any:
        seen.append(study_id)
        return real(self, study_id, *args, **kwargs)

    monkeypatch.setattr(SweepRDBStorage, "_get_trials", counted)
    yield seen


def _finished(sweeps: Any, study: Any, first: int, count: int) -> None:
    for n in range(first, first + count):
        assert sweeps.ask(study, SEARCH, 1) == [n]
        sweeps.tell(study.study_name, n, n / 10, {})


def test_inside_a_tick_the_trials_are_read_once_and_again_after_each_write_of_this_process(
    tmp_path: Path, reads: list[int]
) -> None:
    sweeps = store_at(tmp_path)
    study = sweeps.load_or_create("s", "max", SEARCH)
    _finished(sweeps, study, 0, 12)  # past TPE's startup trials: its batch fit reads the study too
    outside = len(reads)
    study.get_trials(deepcopy=False)
    study.get_trials(deepcopy=False)
    assert len(reads) == outside + 2  # outside, every look reads

    with sweeps.reads_once("s"):
        reads.clear()
        first = study.get_trials(deepcopy=False)
        status = sweeps.status(study, SEARCH)
        assert sweeps.fail_stale(study) == []
        assert [t.number for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))] == list(range(12))
        assert len(reads) == 1 and status.finished == 12
        asked = sweeps.ask(study, SEARCH, 3)  # a write: TPE's fit read before it, the next look reads again
        assert asked == [12, 13, 14]
        after = study.get_trials(deepcopy=False)
        assert [t.number for t in after] == list(range(15)) and [t.state for t in after[12:]] == [
            TrialState.RUNNING
        ] * 3
        sweeps.tell("s", 12, 0.5, {})  # told through the store's other Study object: the same storage counts it
        assert study.get_trials(deepcopy=False)[12].state == TrialState.COMPLETE
        assert sweeps.status(study, SEARCH).finished == 13
        reads_inside = len(reads)
    assert reads_inside <= 4, reads  # the first look, TPE's fit, after the ask, after the tell
    assert [t.number for t in first] == list(range(12))

    # What the tick saw equals a plain read; deep copies are still copies.
    plain = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 'optuna.db'}").get_trials()
    with sweeps.reads_once("s"):
        held = study.get_trials()
        held[0].user_attrs["mutated"] = True
        again = study.get_trials()
    assert [(t.number, t.state, t.params, t.values) for t in held] == [
        (t.number, t.state, t.params, t.values) for t in plain
    ]
    assert "mutated" not in again[0].user_attrs


def test_another_process_write_is_seen_on_the_next_tick_and_other_threads_read_as_always(
    tmp_path: Path, reads: list[int]
) -> None:
    sweeps = store_at(tmp_path)
    study = sweeps.load_or_create("s", "max", SEARCH)
    _finished(sweeps, study, 0, 2)
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    elsewhere = SweepRDBStorage(url)  # a run's process: its own storage object, its own count of writes
    assert elsewhere is not open_storage(url)
    with sweeps.reads_once("s"):
        assert len(study.get_trials(deepcopy=False)) == 2
        other = optuna.load_study(study_name="s", storage=elsewhere)
        other.add_trial(
            optuna.trial.create_trial(params={"lr": 0.01}, distributions=study.get_trials()[0].distributions, value=0.3)
        )
        assert len(study.get_trials(deepcopy=False)) == 2  # this tick's read stands
        seen_by: dict[str, int] = {}
        before = len(reads)
        thread = threading.Thread(target=lambda: seen_by.setdefault("thread", len(study.get_trials(deepcopy=False))))
        thread.start()
        thread.join()
        assert seen_by["thread"] == 3 and len(reads) == before + 1  # another thread is outside this tick
    assert len(study.get_trials(deepcopy=False)) == 3  # the next tick sees it


def test_a_sweep_sensor_tick_reads_its_trials_at_most_twice(tmp_path: Path, reads: list[int]) -> None:
    """The tick that asks (fail_stale, status, the sampler's seed, TPE's space and fit, status after): 8 reads
    before."""
    from pipelines.factory import job_names
    from pipelines.sensors import run_tick
    from tests.pipelines.sweep_drill import TrivialLauncher, drill_resources, drill_spec, open_instance, prepared_home
    from trainyard import naming

    spec = drill_spec(n_trials=16, parallelism=2)
    resources = drill_resources(tmp_path, TrivialLauncher())
    instance = open_instance(tmp_path)
    study = prepared_home(tmp_path, spec, resources, instance)["study"]
    names = job_names(spec)
    cursor = None
    counts = []
    for _ in range(7):
        reads.clear()
        t = run_tick(
            spec, instance, resources["sweeps"], cursor, train_job=names["train"], prepare_job=names["prepare"]
        )
        counts.append((len(reads), len(t.asked)))
        cursor = t.cursor.dump()
        for (
            key
        ) in t.partitions:  # each requested trial trains and tells its result before the next tick, as its run would
            resources["sweeps"].tell(study, naming.trial_number(key), 0.5, {"val_acc": 0.5})
    asking = [n for n, asked in counts if asked]
    assert len(asking) >= 4 and max(asking) <= 2, counts  # one look, one after its own write (the ask)
