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

