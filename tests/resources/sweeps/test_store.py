"""Opening the study storage: several processes creating one fresh SQLite database at once."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

from resources.sweeps.store import open_storage


def _open(url: str, start: float, results: "multiprocessing.Queue[str]") -> None:
    while time.time() < start:  # every process creates the schema at the same moment
        pass
    try:
        open_storage(url)
        results.put("ok")
    except Exception as e:
        results.put(f"{type(e).__name__}: {e}"[:300])


def test_runs_that_open_a_fresh_sqlite_storage_at_once_all_succeed(tmp_path: Path) -> None:
    # A landing sensor's prepare run and one started from the UI, on a fresh home: both create
    # Optuna's tables, and without serialising one failed on alembic_version (4 of 5 rounds here).
    ctx = multiprocessing.get_context("fork")
    for round_ in range(3):
        url = f"sqlite:///{tmp_path / f'optuna-{round_}.db'}"
        results = ctx.Queue()
        start = time.time() + 1.0
        procs = [ctx.Process(target=_open, args=(url, start, results)) for _ in range(4)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        assert [results.get(timeout=5) for _ in procs] == ["ok"] * 4



def _open_uncached(url: str, results: "multiprocessing.Queue[str]") -> None:
    from resources.sweeps import store

    store._STORAGES.clear()  # a forked child inherits the parent's open storages: open this one for real
    _open(url, 0.0, results)


def test_a_storage_whose_schema_exists_opens_without_waiting_for_the_creation_lock(tmp_path: Path) -> None:
    """Every trial run opens its study's storage; only the opening that creates the schema takes the lock."""
    from filelock import FileLock

    ctx = multiprocessing.get_context("fork")
    made, fresh = tmp_path / "made.db", tmp_path / "fresh.db"
    open_storage(f"sqlite:///{made}")  # the sweep created it
    results = ctx.Queue()
    with FileLock(f"{made}.create.lock"):  # another run holds the lock, creating nothing here
        opener = ctx.Process(target=_open_uncached, args=(f"sqlite:///{made}", results))
        opener.start()
        opener.join(30)
        assert not opener.is_alive() and results.get(timeout=5) == "ok"
    with FileLock(f"{fresh}.create.lock"):  # a fresh file still waits for the one creating it
        opener = ctx.Process(target=_open_uncached, args=(f"sqlite:///{fresh}", results))
        opener.start()
        opener.join(2)
        assert opener.is_alive()
    opener.join(60)
    assert results.get(timeout=5) == "ok"
