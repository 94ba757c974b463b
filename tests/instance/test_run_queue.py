"""LocalRunQueue: Dagster's run queue with a fractional look interval, as Dagster itself reads and runs it.

The daemon end to end (a real `dagster-daemon` dequeuing runs submitted by `dagster job launch`
through this queue) is `tests/instance/test_run_launcher.py`, whose instance uses it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from dagster import DagsterInstance
from dagster._core.errors import DagsterInvalidConfigError
from dagster._daemon.controller import create_daemon_of_type
from dagster._daemon.run_coordinator.queued_run_coordinator_daemon import QueuedRunCoordinatorDaemon

from instance.run_queue import MIN_INTERVAL_SECONDS, LocalRunQueue

ROOT = Path(__file__).resolve().parents[2]


def _home(tmp_path: Path, config: dict) -> Path:
    (tmp_path / "dagster.yaml").write_text(yaml.safe_dump({
        "telemetry": {"enabled": False},
        "run_coordinator": {"module": "instance.run_queue", "class": "LocalRunQueue", "config": config},
    }))
    return tmp_path


def test_the_shipped_instance_looks_at_its_queue_every_half_second(tmp_path: Path) -> None:
    (tmp_path / "dagster.yaml").write_text((ROOT / "deploy" / "local" / "dagster.yaml").read_text())
    with DagsterInstance.from_config(str(tmp_path)) as instance:
        coordinator = instance.run_coordinator
        assert isinstance(coordinator, LocalRunQueue)
        assert coordinator.dequeue_interval_seconds == 0.5
        # Everything else is Dagster's queue as `run_queue:` configured it before.
        queue = coordinator.get_run_queue_config()
        assert queue.max_concurrent_runs == 3
        assert [(rule["key"], rule["limit"]) for rule in queue.tag_concurrency_limits] == [("trainyard/team", 2)]
        assert coordinator.dequeue_use_threads and coordinator.dequeue_num_workers == 4
        # The daemon Dagster's controller builds for this instance waits that long between looks.
        daemon = create_daemon_of_type(QueuedRunCoordinatorDaemon.daemon_type(), instance)
        assert isinstance(daemon, QueuedRunCoordinatorDaemon) and daemon.interval_seconds == 0.5


@pytest.mark.parametrize("value", [1, 2.5])
def test_whole_and_fractional_seconds_are_taken(tmp_path: Path, value: float) -> None:
    with DagsterInstance.from_config(str(_home(tmp_path, {"dequeue_interval_seconds": value}))) as instance:
        assert instance.run_coordinator.dequeue_interval_seconds == value


def test_without_an_interval_it_is_dagsters_default(tmp_path: Path) -> None:
    with DagsterInstance.from_config(str(_home(tmp_path, {"max_concurrent_runs": 2}))) as instance:
        assert instance.run_coordinator.dequeue_interval_seconds == 5
        assert instance.run_coordinator.get_run_queue_config().max_concurrent_runs == 2


def test_an_interval_shorter_than_the_daemons_wait_step_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=rf"dequeue_interval_seconds 0.1 is below {MIN_INTERVAL_SECONDS}"):
        assert (
            DagsterInstance.from_config(str(_home(tmp_path, {"dequeue_interval_seconds": 0.1}))).run_coordinator is None
        )


def test_an_interval_that_is_not_a_number_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DagsterInvalidConfigError, match="dequeue_interval_seconds"):
        assert (
            DagsterInstance.from_config(str(_home(tmp_path, {"dequeue_interval_seconds": "soon"}))).run_coordinator
            is None
        )


def test_the_daemons_dequeue_threads_share_one_launcher_registered_to_the_instance(tmp_path: Path, monkeypatch) -> None:
    """`dequeue_use_threads` launches runs dequeued together from a pool of threads, each calling Dagster's lazy
    `instance.run_launcher`, which is not thread-safe: two threads that found none each made one, and one of them
    launched through a launcher never registered to the instance ("Attempted to resolve undefined DagsterInstance
    weakref", seen in CI at 629daac). The queue makes the launcher when the daemon makes the queue, in its main
    thread. The launcher's construction is slowed here to widen the window the race needs."""
    from instance.run_launcher import WarmRunLauncher

    (tmp_path / "dagster.yaml").write_text((ROOT / "deploy" / "local" / "dagster.yaml").read_text())
    made, seen, errors, instance = _launchers_made_by_four_dequeue_threads(tmp_path, WarmRunLauncher, monkeypatch)
    with instance:
        assert errors == []
        assert len(made) == 1 and {id(launcher) for launcher, _ in seen} == {id(made[0])}
        assert all(registered is instance for _, registered in seen)


def _launchers_made_by_four_dequeue_threads(
    home: Path, launcher_class: type, monkeypatch
) -> tuple[list, list, list, DagsterInstance]:
    """The daemon's start on the instance in `home`, then four threads asking for its launcher at once; the launchers
    made (`launcher_class`, its construction slowed to widen the window the race needs), what each thread got (the
    launcher and the instance it is registered to), the errors, and the instance."""
    import threading
    import time

    made: list = []
    original = launcher_class.__init__

    def slow_init(self, *args, **kwargs) -> None:
        time.sleep(0.05)
        original(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(launcher_class, "__init__", slow_init)
    instance = DagsterInstance.from_config(str(home))
    create_daemon_of_type(QueuedRunCoordinatorDaemon.daemon_type(), instance)  # what dagster-daemon does first
    start, seen, errors = threading.Barrier(4), [], []

    def dequeue_thread() -> None:
        start.wait()
        try:
            launcher = instance.run_launcher
            seen.append((launcher, launcher._instance))
        except Exception as e:  # the race's failures are what this test looks for
            errors.append(e)

    threads = [threading.Thread(target=dequeue_thread) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return made, seen, errors, instance


# --- the Kubernetes daemon: the chart's instance, `K8sRunLauncher` ------------------------------------------------


def _k8s_home(tmp_path: Path, coordinator: dict) -> Path:
    """DAGSTER_HOME with the instance the chart writes for the daemon, from deploy/helm/values.yaml.

    The run coordinator is written as the chart's template writes a custom one (module, class, config), or given
    (`coordinator`); the run launcher is the chart's `K8sRunLauncher`, reading a kubeconfig here instead of the
    in-cluster account (making it reads the file; nothing connects).
    """
    (tmp_path / "kubeconfig").write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u", "namespace": "dagster"}}],
    }))
    (tmp_path / "dagster.yaml").write_text(
        yaml.safe_dump(
            {
                "telemetry": {"enabled": False},
                "run_coordinator": coordinator,
                "run_launcher": {
                    "module": "dagster_k8s",
                    "class": "K8sRunLauncher",
                    "config": {
                        "load_incluster_config": False,
                        "kubeconfig_file": str(tmp_path / "kubeconfig"),
                        "job_namespace": "dagster",
                        "instance_config_map": "dagster-instance",
                        "service_account_name": "dagster",
                        "image_pull_policy": "IfNotPresent",
                    },
                },
            }
        )
    )
    return tmp_path


def _chart_coordinator() -> dict:
    custom = yaml.safe_load((ROOT / "deploy" / "helm" / "values.yaml").read_text())["dagsterDaemon"]["runCoordinator"]
    assert custom["type"] == "CustomRunCoordinator"
    c = custom["config"]["customRunCoordinator"]
    return {"module": c["module"], "class": c["class"], "config": c["config"]}  # helm/dagster _run-coordinator.tpl


def test_the_kubernetes_daemons_queue_makes_one_launcher_before_its_threads_ask(tmp_path: Path, monkeypatch) -> None:
    from dagster_k8s import K8sRunLauncher

    from instance.run_queue import RunQueue

    made, seen, errors, instance = _launchers_made_by_four_dequeue_threads(
        _k8s_home(tmp_path, _chart_coordinator()), K8sRunLauncher, monkeypatch)
    with instance:
        assert type(instance.run_coordinator) is RunQueue
        queue = instance.run_coordinator
        assert (queue.dequeue_use_threads, queue.dequeue_num_workers, queue.dequeue_interval_seconds) == (True, 4, 1)
        assert queue.get_run_queue_config().max_concurrent_runs == 50
        assert errors == []
        assert len(made) == 1 and isinstance(made[0], K8sRunLauncher)
        assert {id(launcher) for launcher, _ in seen} == {id(made[0])}
        assert all(registered is instance for _, registered in seen)


def test_dagsters_own_queue_on_the_same_instance_makes_a_launcher_per_thread(tmp_path: Path, monkeypatch) -> None:
    """The control: the chart's default coordinator, everything else the same, races as the note says."""
    from dagster_k8s import K8sRunLauncher

    stock = {
        "module": "dagster.core.run_coordinator",
        "class": "QueuedRunCoordinator",
        "config": _chart_coordinator()["config"],
    }
    made, seen, errors, instance = _launchers_made_by_four_dequeue_threads(
        _k8s_home(tmp_path, stock), K8sRunLauncher, monkeypatch
    )
    with instance:
        assert len(made) > 1
        assert len({id(launcher) for launcher, _ in seen}) + len(errors) > 1


def test_a_process_that_cannot_make_the_launcher_still_makes_the_queue(tmp_path: Path, monkeypatch) -> None:
    """A Kubernetes code server has no API credentials: it makes the queue (to evaluate sensors), never a launcher."""
    home = _k8s_home(tmp_path, _chart_coordinator())
    config = yaml.safe_load((home / "dagster.yaml").read_text())
    launcher = config["run_launcher"]["config"]
    launcher["load_incluster_config"] = True  # the chart's setting; no mounted account token here, as in a code server
    del launcher["kubeconfig_file"]
    (home / "dagster.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with DagsterInstance.from_config(str(home)) as instance:
        assert instance.run_coordinator.get_run_queue_config().max_concurrent_runs == 50
        with pytest.raises(Exception, match="Service host/port is not set"):
            instance.run_launcher  # noqa: B018 - Dagster's lazy path still reports it where one is used


SENSORS_LOCATION = '''
from dagster import DefaultSensorStatus, Definitions, SkipReason, sensor


def make(i):
    @sensor(name=f"idle_{i}", minimum_interval_seconds=1, default_status=DefaultSensorStatus.RUNNING)
    def idle(context):
        return SkipReason("nothing new")

    return idle


defs = Definitions(sensors=[make(i) for i in range(8)])
'''


@pytest.mark.slow
def test_the_kubernetes_daemon_keeps_its_postgresql_connections_while_sensors_tick(
    tmp_path: Path, pg_databases: list[str]
) -> None:
    """A real `dagster-daemon` on the chart's instance (its queue `RunQueue`, `K8sRunLauncher`) and PostgreSQL, eight
    sensors ticking: the sessions PostgreSQL establishes in a window, counted by PostgreSQL itself, stay below one per
    tick. Each tick's records, cursor and state, each look at the queue and every other daemon thread's queries each
    opened a session before the queue pooled the daemon's connections (20 idle pipelines: 63 a second)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import sqlalchemy

    from tests.instance.test_storage_connections import sessions_opened

    url = pg_databases[0]
    database = url.rsplit("/", 1)[1]
    home = _k8s_home(tmp_path, _chart_coordinator())
    config = yaml.safe_load((home / "dagster.yaml").read_text())
    config["storage"] = {"postgres": {"postgres_url": url}}
    (home / "dagster.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "loc.py").write_text(SENSORS_LOCATION)
    with DagsterInstance.from_config(str(home)):
        pass  # the schema is made here, before the daemon and its code server open the storages
    engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool)

    def ticks() -> int:
        with engine.connect() as conn:
            return int(conn.execute(sqlalchemy.text("SELECT count(*) FROM job_ticks")).scalar_one())

    env = {**os.environ, "DAGSTER_HOME": str(home)}
    with open(tmp_path / "daemon.log", "w") as log:
        daemon = subprocess.Popen(
            [str(Path(sys.executable).parent / "dagster-daemon"), "run", "-f", "loc.py"],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 120
        while ticks() < 8:  # every sensor has ticked: the daemon and its code server are up
            assert daemon.poll() is None, (tmp_path / "daemon.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (
                f"no ticks after 120 s:\n{(tmp_path / 'daemon.log').read_text()[-3000:]}"
            )
            time.sleep(0.5)
        ticks_before, sessions_before = ticks(), sessions_opened(database)
        time.sleep(12)
        ticked = ticks() - ticks_before
        opened = sessions_opened(database) - sessions_before - 1  # less the session `ticks()` just opened to count
    finally:
        os.killpg(daemon.pid, signal.SIGTERM)
        daemon.wait(timeout=60)
        engine.dispose()
    assert ticked >= 8, f"{ticked} ticks in 12 s"
    assert opened < ticked, f"{opened} PostgreSQL sessions for {ticked} ticks in 12 s"
