"""WarmRunLauncher: run workers forked from a warm process, under a real `dagster-daemon` and real `dagster job launch`.

The code location is a file in the test's directory: its op records, from inside
the run, its process id, its parent's and the location's `VALUE`, so every
assertion below reads what a run itself wrote, against what the launcher tagged.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from instance.run_launcher import WORKER_TAG, WarmRunLauncher
from instance.zygote import _changed, _loaded_files

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]

LOCATION = """
import json, os, sys, time
from pathlib import Path
from dagster import Definitions, in_process_executor, job, op

VALUE = "{value}"


@op
def record(context):
    out = Path(os.environ["WARM_RUN_OUT"])
    out.mkdir(exist_ok=True)
    preloaded = "resources.sweeps.rdb" in sys.modules  # imported by the zygote (RUN_PRELOAD), not by this location
    premade = getattr(context.instance, "_trainyard_premade", False)  # the instance the zygote made before forking
    record = {{"value": VALUE, "pid": os.getpid(), "ppid": os.getppid(), "preloaded": preloaded, "premade": premade}}
    (out / f"{{context.run_id}}.json").write_text(json.dumps(record))
    while (out.parent / "hold").exists():  # a run to terminate
        time.sleep(0.2)


@job(executor_def=in_process_executor)
def hello():
    record()


defs = Definitions(jobs=[hello])
"""

INSTANCE_YAML = """telemetry:
  enabled: false
run_coordinator:  # the shipped local queue (deploy/local/dagster.yaml)
  module: instance.run_queue
  class: LocalRunQueue
  config:
    max_concurrent_runs: 4
    dequeue_interval_seconds: 0.5
run_launcher:
  module: instance.run_launcher
  class: WarmRunLauncher
"""


class Location:
    """A code location file, a DAGSTER_HOME using WarmRunLauncher, and a `dagster-daemon` over them."""

    def __init__(self, tmp_path: Path) -> None:
        self.dir = tmp_path
        self.write("v1")
        (tmp_path / "home").mkdir()
        (tmp_path / "home" / "dagster.yaml").write_text(INSTANCE_YAML)
        (tmp_path / "workspace.yaml").write_text(
            f"load_from:\n  - python_file:\n      relative_path: loc.py\n      working_directory: {tmp_path}\n"
        )
        self.env = {**os.environ, "DAGSTER_HOME": str(tmp_path / "home"), "WARM_RUN_OUT": str(tmp_path / "out")}
        from dagster import DagsterInstance

        # The SQLite storages are created here, before the daemon, its code server and `dagster job launch` open them:
        # processes creating them at once can each stamp the schema's alembic version (CI at e5de245: the code server
        # failed with "Version table 'alembic_version' has more than one head present", and the first launch with it).
        self.instance = DagsterInstance.from_config(str(tmp_path / "home"))
        self.instance.get_runs(limit=1)
        self.daemon = subprocess.Popen(
            [str(BIN / "dagster-daemon"), "run", "-w", "workspace.yaml"],
            cwd=tmp_path,
            env=self.env,
            stdout=open(tmp_path / "daemon.log", "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def write(self, value: str) -> None:
        (self.dir / "loc.py").write_text(LOCATION.format(value=value))

    def launch(self) -> str:
        """`dagster job launch` (the run queue's submit, as the UI's Launch does); returns the run id."""
        before = {r.run_id for r in self.instance.get_runs()}
        done = subprocess.run(
            [str(BIN / "dagster"), "job", "launch", "-w", "workspace.yaml", "-j", "hello"],
            cwd=self.dir,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, f"dagster job launch exited {done.returncode}:\n{done.stderr[-3000:]}"
        (run_id,) = {r.run_id for r in self.instance.get_runs()} - before
        return run_id

    def wait(self, run_id: str, statuses: tuple[str, ...] = ("SUCCESS",), timeout: float = 90) -> Any:
        deadline, last = time.time() + timeout, "unknown"
        while time.time() < deadline:
            run = self.instance.get_run_by_id(run_id)
            assert run is not None
            last = run.status.value
            if last in statuses:
                return run
            if run.is_finished:
                pytest.fail(f"run {run_id} ended {run.status.value}: {self.events(run_id)}\n{self.log()}")
            time.sleep(0.5)
        pytest.fail(f"run {run_id} still {last} after {timeout} s\n{self.log()}")

    def recorded(self, run_id: str) -> dict[str, Any]:
        return json.loads((self.dir / "out" / f"{run_id}.json").read_text())

    def events(self, run_id: str) -> list[str]:
        return [
            e.message
            for e in self.instance.all_logs(run_id)
            if e.dagster_event and e.dagster_event.event_type_value == "ENGINE_EVENT"
        ]

    def log(self) -> str:
        return (self.dir / "daemon.log").read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.daemon.poll() is None:
            os.killpg(self.daemon.pid, signal.SIGTERM)
            self.daemon.wait(timeout=60)


@pytest.fixture
def location(tmp_path: Path) -> Iterator[Location]:
    loc = Location(tmp_path)
    try:
        yield loc
    finally:
        loc.stop()
        loc.instance.dispose()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def forked(run: Any) -> dict[str, Any]:
    assert WORKER_TAG in run.tags, run.tags
    return json.loads(run.tags[WORKER_TAG])


def until(check: Any, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while not check():
        assert time.time() < deadline, "timed out"
        time.sleep(0.2)


@pytest.mark.slow
def test_runs_after_the_first_are_forked_from_the_warm_process_and_edited_code_is_never_run_stale(
    location: Location,
) -> None:
    first = location.wait(location.launch())
    assert WORKER_TAG not in first.tags  # the first run of a location goes the default way while the zygote starts
    assert any("warm run worker process is starting" in m for m in location.events(first.run_id))

    second = location.wait(location.launch())
    worker = forked(second)
    seen = location.recorded(second.run_id)
    assert (seen["pid"], seen["ppid"], seen["value"]) == (
        worker["pid"],
        worker["zygote"],
        "v1",
    )  # the run ran in the forked child
    assert (
        seen["preloaded"] and not location.recorded(first.run_id)["preloaded"]
    )  # the study's storage modules came with the fork
    assert (
        seen["premade"] and not location.recorded(first.run_id)["premade"]
    )  # and the instance, made once by the zygote
    assert any(m == f"Started process for run (pid: {worker['pid']})." for m in location.events(second.run_id))

    location.write("v2")  # a team edits its pipeline: the warm process holds v1
    edited = location.wait(location.launch())
    assert WORKER_TAG not in edited.tags and location.recorded(edited.run_id)["value"] == "v2"
    assert any(
        "loc.py changed since the warm run worker process loaded it" in m for m in location.events(edited.run_id)
    )
    until(lambda: not _alive(worker["zygote"]))  # the stale zygote left

    after = location.wait(location.launch())
    fresh, seen = forked(after), location.recorded(after.run_id)
    assert fresh["zygote"] != worker["zygote"] and (seen["value"], seen["ppid"]) == ("v2", fresh["zygote"])
    location.stop()
    until(lambda: not _alive(fresh["zygote"]))  # the warm process does not outlive the daemon


@pytest.mark.slow
def test_terminating_a_forked_run_from_another_process_cancels_it(location: Location) -> None:
    location.wait(location.launch())  # the default way, while the warm process starts
    (location.dir / "hold").touch()  # the next run waits in its op until terminated
    run_id = location.launch()
    until(lambda: (location.dir / "out" / f"{run_id}.json").exists(), timeout=90)
    worker = forked(location.instance.get_run_by_id(run_id))
    assert location.recorded(run_id)["pid"] == worker["pid"]
    assert location.instance.run_coordinator.cancel_run(
        run_id
    )  # from this test's process, as the UI's Terminate from the webserver
    location.wait(run_id, ("CANCELED",), timeout=60)
    until(lambda: not _alive(worker["pid"]))


def test_a_changed_or_removed_module_file_is_noticed(tmp_path: Path) -> None:
    module = tmp_path / "team_code_for_warm_test.py"
    module.write_text("X = 1\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import team_code_for_warm_test  # noqa: F401

        files = _loaded_files()
        assert str(module.resolve()) in files
        assert not any("site-packages" in f for f in files)  # installed packages are not watched
        assert _changed(files) is None
        module.write_text("X = 22\n")
        assert _changed(files) == str(module.resolve())
        module.unlink()
        assert _changed(files) == str(module.resolve())
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("team_code_for_warm_test", None)


def _run_with_origin(location_origin: Any, executable: str, working_directory: str) -> Any:
    from dagster._core.code_pointer import FileCodePointer
    from dagster._core.origin import JobPythonOrigin, RepositoryPythonOrigin
    from dagster._core.remote_origin import RemoteJobOrigin, RemoteRepositoryOrigin
    from dagster._core.storage.dagster_run import DagsterRun

    pointer = FileCodePointer(str(Path(working_directory) / "loc.py"), "defs", working_directory)
    return DagsterRun(
        job_name="hello",
        run_id="r1",
        remote_job_origin=RemoteJobOrigin(RemoteRepositoryOrigin(location_origin, "__repository__"), "hello"),
        job_code_origin=JobPythonOrigin("hello", RepositoryPythonOrigin(executable, pointer)),
    )


def test_only_locations_whose_code_is_on_this_machine_are_forked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dagster._core.remote_origin import GrpcServerCodeLocationOrigin, ManagedGrpcPythonEnvCodeLocationOrigin
    from dagster._core.types.loadable_target_origin import LoadableTargetOrigin

    launcher = WarmRunLauncher()
    here, there = str(tmp_path), "/nowhere/on/this/machine"
    managed = ManagedGrpcPythonEnvCodeLocationOrigin(LoadableTargetOrigin(python_file="loc.py"), location_name="team")
    assert launcher._key(_run_with_origin(managed, sys.executable, here)) is not None
    dev = GrpcServerCodeLocationOrigin(
        host="localhost", socket="/tmp/dagster-dev.sock", location_name="team"
    )  # how `dagster dev` serves
    assert launcher._key(_run_with_origin(dev, sys.executable, here)) is not None
    remote = GrpcServerCodeLocationOrigin(host="code.team.svc", port=4000, location_name="team")
    assert launcher._key(_run_with_origin(remote, sys.executable, here)) is None
    assert (
        launcher._key(_run_with_origin(dev, sys.executable, there)) is None
    )  # a local port whose code is elsewhere (a container)
    assert launcher._key(_run_with_origin(dev, "/nowhere/bin/python", here)) is None
    monkeypatch.setenv("TRAINYARD_WARM_RUN_WORKERS", "0")
    assert launcher._key(_run_with_origin(managed, sys.executable, here)) is None
