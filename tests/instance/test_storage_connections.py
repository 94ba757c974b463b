"""Run workers keep their PostgreSQL connections open (instance.storage_connections), on a real PostgreSQL.

The runs here go through `execute_job`, which creates the job's own executor
with the instance, as a run worker does (`execute_in_process` would swap the
executor out). What is asserted is read from PostgreSQL itself
(`pg_stat_activity`, `SHOW statement_timeout`), not from the module's state.
"""

from pathlib import Path
from typing import Any, Iterator

import pytest
import sqlalchemy
from dagster import DagsterInstance, OpExecutionContext, execute_job, in_process_executor, job, op, reconstructable

from instance import storage_connections
from instance.storage_connections import hold_connections, trainyard_executor
from pipelines.factory import build_definitions
from tests.conftest import POSTGRES_URL


def idle_sessions(database: str) -> int:
    """Connections to `database` that sit idle (held by a pool), counted from a connection of its own."""
    engine = sqlalchemy.create_engine(POSTGRES_URL, poolclass=sqlalchemy.pool.NullPool)
    with engine.connect() as conn:
        return int(
            conn.execute(
                sqlalchemy.text("SELECT count(*) FROM pg_stat_activity WHERE datname = :d AND state = 'idle'"),
                {"d": database},
            ).scalar_one()
        )


@op
def query_storages(context: OpExecutionContext) -> None:
    """Queries each storage, then records how many connections to the run's database are left open."""
    instance = context.instance
    instance.get_run_record_by_id(context.run_id)
    instance.report_engine_event("a query of the event log", context.dagster_run)
    instance.get_runs_count()
    database = instance.run_storage.postgres_url.rsplit("/", 1)[1]
    context.log.info(f"idle sessions: {idle_sessions(database)}")


@job(executor_def=trainyard_executor)
def platform_job() -> None:
    query_storages()


@job(executor_def=in_process_executor)
def stock_job() -> None:
    query_storages()


def logged_idle_sessions(instance: DagsterInstance, run_id: str) -> int:
    messages = [e.user_message for e in instance.all_logs(run_id) if e.user_message.startswith("idle sessions: ")]
    assert len(messages) == 1, messages
    return int(messages[0].split(": ")[1])


@pytest.fixture
def pg_home(tmp_path: Path, pg_databases: list[str]) -> Iterator[tuple[Path, str]]:
    (tmp_path / "dagster.yaml").write_text(
        f"telemetry:\n  enabled: false\nstorage:\n  postgres:\n    postgres_url: {pg_databases[0]}\n"
    )
    yield tmp_path, pg_databases[0]


def test_a_run_under_the_platform_executor_keeps_its_connections_and_dagsters_own_does_not(
    pg_home: tuple[Path, str],
) -> None:
    home, _ = pg_home
    with DagsterInstance.from_config(str(home)) as instance:
        stock = execute_job(reconstructable(stock_job), instance=instance)
        assert stock.success
        assert (
            logged_idle_sessions(instance, stock.run_id) == 0
        )  # Dagster's default: a connection per query, none left open
    with DagsterInstance.from_config(str(home)) as instance:
        platform = execute_job(reconstructable(platform_job), instance=instance)
        assert platform.success
        held = logged_idle_sessions(instance, platform.run_id)
    assert 1 <= held <= 3  # one per storage that was queried (runs, events; schedules share the database)


def test_the_pipelines_jobs_run_under_the_platform_executor() -> None:
    from pipelines.vision.digits import digits

    definitions = build_definitions(digits)
    jobs = [j for j in definitions.resolve_all_job_defs() if not j.name.startswith("__")]
    assert jobs and {j.executor_def.name for j in jobs} == {"in_process"}
    assert all(j.executor_def is trainyard_executor for j in jobs)


def test_the_pooled_connections_keep_the_statement_timeout_the_database_gives(pg_home: tuple[Path, str]) -> None:
    """Dagster's pooled engine sets a timeout on every connection: it must be the database's, not a new one."""
    home, url = pg_home
    database = url.rsplit("/", 1)[1]
    admin = sqlalchemy.create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT", poolclass=sqlalchemy.pool.NullPool)
    for setting, shown in ((None, "0"), ("4321", "4321ms")):
        if setting is not None:
            with admin.connect() as conn:
                conn.execute(sqlalchemy.text(f"ALTER DATABASE {database} SET statement_timeout = {setting}"))
        with DagsterInstance.from_config(str(home)) as instance:
            assert hold_connections(instance)
            for storage in (instance.run_storage, instance.event_log_storage, instance.schedule_storage):
                assert type(storage._engine.pool).__name__ == "QueuePool"
                with storage._engine.connect() as conn:
                    assert conn.execute(sqlalchemy.text("SHOW statement_timeout")).scalar_one() == shown


def test_a_sqlite_instance_is_left_alone(tmp_path: Path) -> None:
    (tmp_path / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    with DagsterInstance.from_config(str(tmp_path)) as instance:
        engine = instance.run_storage._engine if hasattr(instance.run_storage, "_engine") else None
        assert hold_connections(instance) is False
        assert (instance.run_storage._engine if engine is not None else None) is engine
        assert instance.get_runs_count() == 0


def test_a_pool_that_cannot_be_made_leaves_the_run_on_a_connection_per_query(
    pg_home: tuple[Path, str], monkeypatch: Any
) -> None:
    home, _ = pg_home

    def refuse(storage: Any) -> int:
        raise sqlalchemy.exc.OperationalError("SELECT setting", {}, Exception("permission denied for pg_settings"))

    monkeypatch.setattr(storage_connections, "statement_timeout_ms", refuse)
    with DagsterInstance.from_config(str(home)) as instance:
        with pytest.warns(UserWarning, match="one connection per query .*permission denied"):
            assert hold_connections(instance) is False
        assert type(instance.event_log_storage._engine.pool).__name__ == "NullPool"
        assert instance.get_runs_count() == 0


def test_the_webservers_pool_is_left_as_dagster_made_it(pg_home: tuple[Path, str]) -> None:
    """An instance pooled already (the webserver's, with its statement timeout) keeps its engines and its timeout."""
    home, _ = pg_home
    with DagsterInstance.from_config(str(home)) as instance:
        instance.optimize_for_webserver(statement_timeout=15000, pool_recycle=3600, max_overflow=20)
        engine = instance.event_log_storage._engine
        assert hold_connections(instance)
        assert instance.event_log_storage._engine is engine
        with engine.connect() as conn:
            assert conn.execute(sqlalchemy.text("SHOW statement_timeout")).scalar_one() == "15s"


def test_the_process_that_launches_runs_with_the_warm_run_launcher_keeps_its_connections(
    pg_home: tuple[Path, str],
) -> None:
    """The daemon makes its run launcher when it first launches a run; from then on its queue's looks share a
    connection."""
    home, url = pg_home
    (home / "dagster.yaml").write_text(
        f"telemetry:\n  enabled: false\nstorage:\n  postgres:\n    postgres_url: {url}\n"
        "run_launcher:\n  module: instance.run_launcher\n  class: WarmRunLauncher\n"
    )
    with DagsterInstance.from_config(str(home)) as instance:
        assert type(instance.run_storage._engine.pool).__name__ == "NullPool"
        assert type(instance.run_launcher).__name__ == "WarmRunLauncher"
        assert {
            type(s._engine.pool).__name__
            for s in (instance.run_storage, instance.event_log_storage, instance.schedule_storage)
        } == {"QueuePool"}
        instance.get_runs_count()
        assert idle_sessions(url.rsplit("/", 1)[1]) >= 1


def test_threads_querying_at_once_never_wait_for_a_pooled_connection(pg_home: tuple[Path, str]) -> None:
    """The daemon's threads query at once: each gets a connection at once, as with a connection per query.

    16 threads each hold a connection for 3 s; a bounded overflow (ours was 10 at first) would make
    some of them wait for another's. PostgreSQL's own `pg_stat_activity`, polled meanwhile, must show all 16
    sleeping at one moment (not a wall-clock bound, which a loaded machine can miss).
    """
    import threading
    import time

    home, _ = pg_home
    with DagsterInstance.from_config(str(home)) as instance:
        assert hold_connections(instance)
        engine = instance.run_storage._engine
        start = threading.Barrier(16)

        def hold() -> None:
            start.wait()
            with engine.connect() as conn:
                conn.execute(sqlalchemy.text("SELECT pg_sleep(3) /* trainyard-pool-probe */"))

        probe = sqlalchemy.create_engine(POSTGRES_URL, poolclass=sqlalchemy.pool.NullPool)
        count = sqlalchemy.text(
            "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND query LIKE '%trainyard-pool-probe%' "
            "AND query NOT LIKE '%pg_stat_activity%'"
        )
        threads = [threading.Thread(target=hold) for _ in range(16)]
        for t in threads:
            t.start()
        most = 0
        with probe.connect() as conn:
            while any(t.is_alive() for t in threads):
                conn.execute(sqlalchemy.text("SELECT pg_stat_clear_snapshot()"))
                most = max(most, int(conn.execute(count).scalar_one()))
                time.sleep(0.05)
        for t in threads:
            t.join(30)
        assert most == 16


def sessions_opened(database: str) -> int:
    """Sessions PostgreSQL has established to `database` so far (pg_stat_database), read on a connection of its own."""
    engine = sqlalchemy.create_engine(POSTGRES_URL, poolclass=sqlalchemy.pool.NullPool)
    with engine.connect() as conn:
        conn.execute(sqlalchemy.text("SELECT pg_stat_clear_snapshot()"))
        return int(
            conn.execute(
                sqlalchemy.text("SELECT sessions FROM pg_stat_database WHERE datname = :d"), {"d": database}
            ).scalar_one()
        )


def _tick(instance: DagsterInstance) -> None:
    """What a sweep sensor's tick asks of the instance: its runs, the latest materialization, the queue's limits."""
    from dagster import AssetKey, RunsFilter

    instance.get_runs(RunsFilter(tags={"trainyard/team": "t"}), limit=100)
    instance.fetch_materializations(AssetKey("sweep"), limit=1)
    instance.get_runs_count()


@pytest.mark.parametrize("pooled", [True, False])
def test_sensor_ticks_share_one_pooled_instance_per_ref(
    pg_home: tuple[Path, str], pooled: bool, monkeypatch: Any
) -> None:
    """Each tick's context makes a DagsterInstance from the daemon's ref (as the code server's does): its storages
    check their tables and open a connection per query, every tick. `evaluation_instance` keeps one instance per
    ref, pooled: ticks after the first establish no session at all. Dagster's own (`context.instance`) is the
    control: it establishes sessions on every tick, which is what this test would see if the cache did nothing."""
    from dagster import build_sensor_context

    home, url = pg_home
    database = url.rsplit("/", 1)[1]
    shared: dict = {}
    monkeypatch.setattr(storage_connections, "_SHARED", shared)  # this test's instances only, disposed at its end
    with DagsterInstance.from_config(str(home)) as daemon:
        ref = daemon.get_ref()
        opened = []
        for _ in range(3):
            before = sessions_opened(database)
            with build_sensor_context(instance_ref=ref) as context:
                _tick(storage_connections.evaluation_instance(context) if pooled else context.instance)
            opened.append(sessions_opened(database) - before)
        if pooled:
            assert opened[0] >= 1 and opened[1:] == [0, 0], opened
            with build_sensor_context(instance_ref=ref) as a, build_sensor_context(instance_ref=ref) as b:
                assert storage_connections.evaluation_instance(a) is storage_connections.evaluation_instance(b)
        else:
            assert all(n >= 4 for n in opened), opened
    for instance in shared.values():
        instance.dispose()


def test_an_evaluation_instance_is_one_per_ref_and_process_and_made_once_under_threads(
    pg_home: tuple[Path, str], monkeypatch: Any
) -> None:
    """Threads ticking at once get one instance, its run queue made before any shares it; another ref (another
    DAGSTER_HOME's instance) gets its own; a forked child (another pid) never shares its parent's connections;
    a context built around an instance (no ref) keeps it."""
    import os
    import threading

    from dagster import build_sensor_context

    home, url = pg_home
    other = home / "other"
    other.mkdir()
    (other / "dagster.yaml").write_text((home / "dagster.yaml").read_text() + "run_queue:\n  max_concurrent_runs: 3\n")
    monkeypatch.setattr(storage_connections, "_SHARED", {})
    with DagsterInstance.from_config(str(home)) as first, DagsterInstance.from_config(str(other)) as second:
        start, seen = threading.Barrier(4), []

        def tick() -> None:
            start.wait()
            with build_sensor_context(instance_ref=second.get_ref()) as context:
                seen.append(storage_connections.evaluation_instance(context))

        threads = [threading.Thread(target=tick) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len({id(i) for i in seen}) == 1
        shared = seen[0]
        assert shared._run_coordinator is not None  # made under the lock, not lazily by whichever thread asks first
        assert type(shared.run_storage._engine.pool).__name__ == "QueuePool"
        with build_sensor_context(instance_ref=first.get_ref()) as context:
            assert storage_connections.evaluation_instance(context) is not shared
        monkeypatch.setattr(os, "getpid", lambda: -1)
        with build_sensor_context(instance_ref=second.get_ref()) as context:
            assert storage_connections.evaluation_instance(context) is not shared
        with build_sensor_context(instance=first) as context:
            assert storage_connections.evaluation_instance(context) is first
    for instance in storage_connections._SHARED.values():
        instance.dispose()


def terminate_sessions(database: str) -> int:
    """What a PostgreSQL restart or failover does to held connections: every session to `database` ended by the
    server."""
    engine = sqlalchemy.create_engine(POSTGRES_URL, poolclass=sqlalchemy.pool.NullPool)
    with engine.connect() as conn:
        sql = (
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = :d AND pid <> "
            "pg_backend_pid()"
        )
        return int(conn.execute(sqlalchemy.text(sql), {"d": database}).scalar_one())


def test_held_connections_ended_by_the_server_are_replaced_before_a_query_uses_them(pg_home: tuple[Path, str]) -> None:
    """A PostgreSQL restart ends every held connection; a connection per query never noticed, and a pooled one must
    not either: the next run event, run read and sensor tick go through. Shown to fail (OperationalError: server
    closed the connection) with the pool's check before use turned off."""
    home, url = pg_home
    database = url.rsplit("/", 1)[1]
    with DagsterInstance.from_config(str(home)) as instance:
        assert hold_connections(instance)
        run = instance.create_run_for_job(stock_job)
        instance.report_engine_event("before the restart", run)
        assert terminate_sessions(database) >= 1
        instance.report_engine_event("after the restart", run)
        assert instance.get_run_by_id(run.run_id) is not None and instance.get_runs_count() == 1
        assert [e.message for e in instance.all_logs(run.run_id)][-2:] == ["before the restart", "after the restart"]
        for storage in storage_connections.postgres_storages(instance):
            storage._engine.pool._pre_ping = False  # the control: without the check, the first query after fails
        assert terminate_sessions(database) >= 1
        with pytest.raises(sqlalchemy.exc.OperationalError, match="server closed the connection"):
            instance.get_runs_count()
