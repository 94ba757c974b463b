"""A run worker keeps its PostgreSQL connections open instead of connecting for every query.

Dagster's PostgreSQL storages (runs, event log, schedules) default to
SQLAlchemy's `NullPool`: every query opens a connection, authenticates and
closes it. Only the webserver holds connections (`optimize_for_webserver`,
one per storage plus overflow). A run worker pays the connection for each of
the hundreds of queries of a run: each event it writes, each run record it
reads. Measured on the development machine's loopback PostgreSQL
(trust auth, the cheapest case): an engine event 4.1-4.4 ms with a connection
per query against 0.9-1.1 ms pooled, an asset materialization 8.8-8.9 against
1.9-2.0 ms, a run record read 11.0-11.3 against 1.6 ms. A trial run writes
about 40 events before its trial's result is recorded
(bench.sweep_throughput).

`hold_connections(instance)` switches an instance's PostgreSQL storages to
what the webserver uses: a pool of one connection per storage (plus unbounded
overflow for the process's other threads, discarded when returned), recycled after
`POOL_RECYCLE_SECONDS`. The statement timeout stays what the database gives
the role (read once; Dagster's pooled engine sets one on every connection, and
a run worker's long queries must not start failing because it pooled). A
held connection is tested before each use (SQLAlchemy's pre-ping, 0.03 ms a
query here), so one that a PostgreSQL restart or failover ended is replaced
instead of failing the query, as a connection per query never failed. A
storage that is not PostgreSQL is left as it is.

Called in every run worker: the warm run launcher's forked worker
(`instance.run_launcher`) as soon as it has its instance, and, for runs
started any other way (Dagster's default launcher, a Kubernetes run pod),
by the platform's executor (`trainyard_executor`) before the first step.
The run queue (`instance.run_queue.RunQueue`, the local and the Kubernetes
deployments' both) pools the instance it is registered with: the daemon's,
whose sensors, schedules and queue query it several times a second
(`WarmRunLauncher` does too, for a daemon on Dagster's own queue). An instance
pooled already (the webserver's) is left as it is.
Sensors and schedules whose ticks query the instance take theirs from
`evaluation_instance(context)`: one pooled instance per instance ref in the
code server, instead of the one Dagster makes from the ref for every tick.
The platform's sensors declare no resource parameters, which would make Dagster
build that per-tick instance anyway (to build the resources on it), and take
their resources from `evaluation_resources(context, ...)`, built on the pooled one.
A run worker holds at most three idle connections (one per storage) while it
runs; the local run queue runs three at once.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import warnings
from typing import Any, Iterator

import sqlalchemy
from dagster import InitExecutorContext, executor, in_process_executor

POOL_RECYCLE_SECONDS = 3600  # the webserver's default (`--db-pool-recycle`)
# Connections beyond the pooled one while several threads query at once, closed when returned: no limit (-1), so a
# process with more threads querying at once than any bound (the daemon's queue, sensor and backfill threads) never
# waits for a connection, which a connection per query never did either.
POOL_MAX_OVERFLOW = -1


def postgres_storages(instance: Any) -> list[Any]:
    """The instance's PostgreSQL storages (of runs, events, schedules), in that order."""
    storages = (instance.run_storage, instance.event_log_storage, instance.schedule_storage)
    return [s for s in storages if s is not None and type(s).__module__.startswith("dagster_postgres.")]


def postgres_storage(instance: Any) -> Any:
    """The instance's first PostgreSQL storage (runs, events, schedules), or None if none is PostgreSQL."""
    storages = postgres_storages(instance)
    return storages[0] if storages else None


def statement_timeout_ms(storage: Any) -> int:
    """The statement timeout the database gives the storage's role and database, in milliseconds (0: none).

    Read through the storage's own engine (its URL, connection arguments and token provider).
    """
    with storage._engine.connect() as conn:
        return int(
            conn.execute(
                sqlalchemy.text("SELECT setting FROM pg_settings WHERE name = 'statement_timeout'")
            ).scalar_one()
        )


def hold_connections(instance: Any) -> bool:
    """Pool the instance's PostgreSQL storages' connections (once: a pooled engine is left as it is); whether they are
    pooled now.

    Never fails a run: if the timeout cannot be read or the pool not made, the
    storages stay as they were (a connection per query) and a warning says why.
    """
    storage = postgres_storage(instance)
    if storage is None:
        return False
    engine = getattr(storage, "_engine", None)
    if engine is not None and not isinstance(engine.pool, sqlalchemy.pool.NullPool):
        return True  # pooled already (by an earlier call, or the webserver's with its own timeout): left as it is
    try:
        timeout = statement_timeout_ms(storage)
        instance.optimize_for_webserver(
            statement_timeout=timeout, pool_recycle=POOL_RECYCLE_SECONDS, max_overflow=POOL_MAX_OVERFLOW
        )
        for pooled in postgres_storages(instance):
            # Test a held connection before each use, as `create_engine(pool_pre_ping=True)` would (Dagster's engine
            # takes no such option): after a PostgreSQL restart or failover a held connection is dead, and the first
            # query on it failed (a sensor's tick, a run's event write) where a connection per query reconnects.
            pooled._engine.pool._pre_ping = True
    except Exception as e:  # a run goes on without the pool
        warnings.warn(
            f"trainyard: this process's PostgreSQL storages stay at one connection per query ({type(e).__name__}: {e})",
            stacklevel=2,
        )
        return False
    return True


_SHARED: dict[tuple[int, str], Any] = {}  # (pid, serialized instance ref) -> the process's instance for evaluations
_SHARED_LOCK = threading.Lock()


def evaluation_instance(context: Any) -> Any:
    """The instance a sensor's or schedule's evaluation queries: one per instance ref in this process, its connections
    pooled.

    The code server evaluates every tick in a context made from the daemon's instance ref, and the context makes a
    `DagsterInstance` from it on first use: its storages' engines, each PostgreSQL storage checking its tables
    (6 connections, about 45 ms here), then a connection per query, every tick of every sensor. This keeps one
    instance per ref (and process: a forked child makes its own, never sharing a parent's connections), pooled as
    `hold_connections` pools a run worker's, as the webserver keeps one for its life. Its lazily made parts a tick
    may ask for (the run queue, the launcher) are made here, under a lock, before any thread shares it. The context
    gets it too, so that its own uses (`context.log`, which keeps the tick's log in the instance's compute logs)
    make none from the ref. A context with no ref (one a test built around an instance) gets its own instance.
    """
    ref = getattr(context, "instance_ref", None)
    if ref is None:
        return context.instance
    from dagster import DagsterInstance
    from dagster._serdes import serialize_value

    key = (os.getpid(), serialize_value(ref))
    with _SHARED_LOCK:
        instance = _SHARED.get(key)
        if instance is None:
            instance = DagsterInstance.from_ref(ref)
            hold_connections(instance)
            if ref.run_coordinator_data is not None:
                instance.run_coordinator  # noqa: B018 - Dagster makes it lazily, which is not thread-safe
            _SHARED[key] = instance
            atexit.register(instance.dispose)
    if getattr(context, "_instance", False) is None:
        # Dagster 1.13's context makes its own from the ref on first use of `context.instance` (its logger uses the
        # instance's compute log manager to keep the tick's log for the UI): it gets this one instead.
        context._instance = instance
    return instance


@contextlib.contextmanager
def evaluation_resources(context: Any, *keys: str) -> Iterator[Any]:
    """The code location's resources `keys` for one sensor tick, built on `evaluation_instance(context)`.

    A sensor that declares resources (as parameters of its function) has Dagster build them on `context.instance`,
    which the code server makes from the daemon's instance ref for every tick, whether or not the tick queries it:
    its storages' engines and each PostgreSQL storage checking its tables, about 60 ms and 8 connections a tick
    here, a third of a 64-trial sweep tick (`bench.sweep_10k`). The platform's sensors declare none and build
    theirs here from the same definitions (the code location's `Definitions(resources=...)`, with the
    resources they depend on), on the pooled instance. A context given resources (a test's
    `build_sensor_context(resources=...)`) yields those. The assets that use the same resources keep Dagster
    checking at load time that the code location defines them.

    Raises:
        DagsterInvalidDefinitionError: the code location defines no resource named in `keys`.
    """
    from dagster import DagsterInvalidDefinitionError, build_resources
    from dagster._core.execution.resources_init import get_transitive_required_resource_keys

    if context.resource_defs:
        yield context.resources
        return
    name = getattr(context, "_sensor_name", None) or "this sensor"
    repository = context.repository_def
    if repository is None:
        raise DagsterInvalidDefinitionError(
            f"{name} needs the resources {sorted(keys)}: evaluate it in its code location "
            "or give its context resources (build_sensor_context(resources=...))"
        )
    defined = repository.get_top_level_resources()
    missing = sorted(set(keys) - set(defined))
    if missing:
        raise DagsterInvalidDefinitionError(
            f"{name} needs the resources {missing}, which the code location does not define "
            f"(it defines {sorted(defined)}): add them to Definitions(resources=...)"
        )
    needed = get_transitive_required_resource_keys(set(keys), defined)
    instance = evaluation_instance(context) if context.instance_ref is not None else None
    with build_resources({k: v for k, v in defined.items() if k in needed}, instance=instance) as resources:
        yield resources


@executor(name="in_process", config_schema=in_process_executor.config_schema)  # type: ignore[call-overload]  # the same schema as Dagster's
def trainyard_executor(init_context: InitExecutorContext) -> Any:
    """Dagster's in-process executor, in a run worker whose PostgreSQL storages hold their connections
    (`hold_connections`)."""
    hold_connections(init_context.instance)
    return in_process_executor.executor_creation_fn(init_context)  # type: ignore[misc]
