"""One Optuna storage (connection pool) per URL and one Study per study name in this process.

Shared by every `SweepStore` with the same settings, so a sensor that keeps
running in one process reuses its connections and Optuna's cache of finished
trials between ticks.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections import OrderedDict
from typing import Any, Iterator, Optional

from common.retry import RetriesExhausted, retry_call
from resources.sweeps.rules import SweepError
from trainyard.redact import redact_url

_LOCK = threading.Lock()
_STUDIES: "OrderedDict[tuple, Any]" = OrderedDict()
_MAX_STUDIES = 64


def _keep(cache_key: tuple, study: Any) -> None:
    """Caches `study` as the most recently used, evicting the oldest past `_MAX_STUDIES` (hold `_LOCK`)."""
    _STUDIES[cache_key] = study
    _STUDIES.move_to_end(cache_key)
    while len(_STUDIES) > _MAX_STUDIES:
        _STUDIES.popitem(last=False)


def remember_study(key: tuple, study: Any) -> None:
    """Makes `study` the one `cached_study` returns for its storage `key` and name."""
    with _LOCK:
        _keep((key, study.study_name), study)


def cached_study(key: tuple, study_name: str, teller: bool = False) -> Any:
    """One Study object per storage and name in this process (and one to tell results with).

    Optuna caches finished trials inside a Study's storage wrapper, so a sensor
    that keeps its Study between ticks reads only new and unfinished trials
    instead of the whole study every tick. Results are told through a second
    Study whose sampler keeps no state: a sampler's `after_trial` may act on
    the study (GridSampler stops it once the grid is covered, which Optuna
    allows only inside `optimize`).
    """
    import optuna

    cache_key = (key, study_name, "tell") if teller else (key, study_name)
    with _LOCK:
        study = _STUDIES.get(cache_key)
    if study is not None:
        return study
    sampler = optuna.samplers.RandomSampler() if teller else None
    try:
        study = optuna.load_study(study_name=study_name, storage=study_storage(open_storage(*key)), sampler=sampler)
    except KeyError as e:
        raise SweepError(
            f"study {study_name!r} does not exist in {redact_url(key[0].split('?')[0])}; materialize the sweep asset "
            "first"
        ) from e
    with _LOCK:
        _keep(cache_key, study)
    return study


_STORAGES: "OrderedDict[tuple, Any]" = OrderedDict()


def study_storage(storage: Any) -> Any:
    """What a Study of the sweeps holds: Optuna's cache of finished trials over `storage` (an `open_storage`), which can
    read once per tick (`resources.sweeps.rdb.SweepCachedStorage`); Optuna would wrap it in the plain cache."""
    from resources.sweeps.rdb import SweepCachedStorage

    return SweepCachedStorage(storage)


def open_storage(url: str, heartbeat_interval: int = 60, grace_period: Optional[int] = None) -> Any:
    """One RDBStorage (one connection pool) per URL and heartbeat setting in this process."""
    import optuna

    key = (url, heartbeat_interval, grace_period)
    with _LOCK:
        if key in _STORAGES:
            _STORAGES.move_to_end(key)
            return _STORAGES[key]
    kwargs: dict[str, Any] = {"heartbeat_interval": heartbeat_interval, "grace_period": grace_period}
    if url.startswith("sqlite"):
        kwargs["engine_kwargs"] = {"connect_args": {"timeout": 60}}
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with _creating(url):
        storage = _create_storage(url, kwargs)
    if url.startswith("sqlite"):
        import sqlalchemy

        # WAL (set once per database file) lets trials write while the sensor reads;
        # synchronous=NORMAL is safe under WAL and cuts each commit's fsync.
        sqlalchemy.event.listen(storage.engine, "connect", lambda conn, _: conn.execute("PRAGMA synchronous=NORMAL"))
        storage.engine.dispose()
    with _LOCK:
        storage = _STORAGES.setdefault(key, storage)
        while len(_STORAGES) > 32:
            # Closes the pool's idle connections; a Study still holding this storage reconnects on use.
            _STORAGES.popitem(last=False)[1].engine.dispose()
        return storage


def _sqlite_path(url: str) -> Optional[str]:
    path = url.split("sqlite:///", 1)[1].split("?")[0] if url.startswith("sqlite:///") else ""
    return None if not path or path == ":memory:" else path


@contextlib.contextmanager
def _creating(url: str) -> Iterator[None]:
    """Serialise creating the schema of one SQLite file across processes (a file lock beside it).

    Two runs that open a fresh database at once (a landing sensor's `prepare`
    beside one started from the UI) would both create Optuna's tables and one
    would fail on `alembic_version`; the second now finds them made. SQLite's
    journal mode is set to WAL under the same lock. A file that has both
    already (`_created`: every trial run's opening) takes no lock.
    """
    path = _sqlite_path(url)
    if path is None or _created(path):
        yield
        return
    import sqlite3

    from filelock import FileLock

    with FileLock(f"{path}.create.lock", timeout=120):
        with contextlib.closing(sqlite3.connect(path, timeout=60)) as conn:
            conn.execute("PRAGMA journal_mode=WAL")
        yield


def _created(path: str) -> bool:
    """Whether the SQLite file at `path` has Optuna's schema and WAL already: nothing to serialise then.

    Every run of a sweep opens the study's storage once; the lock made the second
    of two trial runs starting together wait for the first's whole opening (0.2 s
    in bench.sweep_throughput) when there was nothing left to create.
    """
    import sqlite3

    if not os.path.exists(path):
        return False
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=60)) as conn:
            wal = conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
            # Optuna stamps alembic_version after creating every table: a stamped version means a whole schema.
            return wal and conn.execute("SELECT version_num FROM alembic_version").fetchone() is not None
    except sqlite3.Error:
        return False


def _create_storage(url: str, kwargs: dict[str, Any]) -> Any:
    """An RDBStorage for `url` (with the fast bulk read of `resources.sweeps.rdb`); a server database whose schema
    another process is creating at the same moment is retried."""
    import optuna
    import sqlalchemy.exc

    from resources.sweeps.rdb import SweepRDBStorage

    def create() -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return SweepRDBStorage(url, **kwargs)

    try:
        return retry_call(create, retry_on=(sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError), attempts=3,
                          backoff_s=0.5, describe=f"create the Optuna schema at {redact_url(url)}")
    except RetriesExhausted as e:
        raise SweepError(str(e)) from e.last

