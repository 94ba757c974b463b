"""A run launcher whose run workers are forked from a warm process: a run starts in ~0.1 s, not 2-4 s.

Dagster's `DefaultRunLauncher` asks the code server to start each run, and the
code server spawns a fresh interpreter that imports Dagster and the code
location again: 1.9 s alone on the 2-core development machine, 2.6-3.7 s for
two at once (bench.sweep_throughput), paid by every trial run of a sweep.
`WarmRunLauncher` keeps one *zygote* per code location: a process that has
imported Dagster, the location's module (its `Definitions` built) and the
instance's storage modules once, and forks a run worker per run. The child runs
what `dagster api execute_run` runs (`_execute_run_command_body`: the
cancellation thread, "Started process for run", the run's events), so a forked
run is the same run as a spawned one, only without the start-up.

When it forks, and when it does what Dagster does instead (`DefaultRunLauncher`):
- only runs of a code location whose code is on this machine: one Dagster
  starts itself (a Python file, module or package in `workspace.yaml`) or a
  gRPC server on this host (how `dagster dev` serves its locations) whose
  executable and working directory exist here; never one served from elsewhere.
  The worker gets the environment of the process that launches it (the
  daemon), as the code server's worker gets the code server's: the same under
  `dagster dev` and `make ui`, which start both; a code server started by hand
  with other variables wants `DefaultRunLauncher` (or `TRAINYARD_WARM_RUN_WORKERS=0`);
- the first run of a location goes the default way while its zygote starts in
  the background (`dagster dev`'s daemon has no run to start one for before);
- before every fork the zygote compares the files of every module it loaded
  from outside the Python installation (the team's code, this project) with
  what it loaded, and the distributions installed on its `sys.path` with those
  it started with (`common.installed`: a `pip`/`uv` install, upgrade or removal
  replaces a distribution's `.dist-info`); if one changed it answers "stale" and
  exits, the run goes the default way (with the new code) and a fresh zygote
  starts for the next run. So an edited pipeline or an upgraded library never
  runs old code, reloaded in the UI or not;
- the zygote starts with one thread in each native pool (`common.proc.SINGLE_THREADED_ENV`:
  OpenMP, OpenBLAS, MKL, numexpr; pyarrow's jemalloc without its purging thread) and
  refuses to serve if loading left any thread but its own, native ones included
  (`/proc/self/task`, the trial server's check); each forked worker gets the
  environment's thread counts back (`common.proc.restore_thread_counts`);
- a zygote that fails to start (an import error in the location) is not tried
  again for `RETRY_AFTER_SECONDS`; its log says why;
- `TRAINYARD_WARM_RUN_WORKERS=0` in the daemon's environment turns forking off.

A forked worker is a child of the zygote in a session of its own; its pid and
host are on the run (`trainyard/run_worker`). `terminate` (the UI's Terminate)
sends it SIGINT, what the code server's cancellation sends to a spawned worker,
from whichever process on this host asks (the webserver or the daemon). The
zygote exits when the process that started it does; forked run workers go on.

A forked worker's temporary files go to a folder of its own
(`run_temp_dir`, its `TMPDIR`), removed when the run ends. Run monitoring
(`run_monitoring:` in the same file) asks `check_run_worker_health` about every
STARTED run: a worker process that is gone (SIGKILL, the out-of-memory killer)
has its run marked failed, saying so, and its temporary folder removed. A run
spawned the default way is also failed by its code server when it notices the
exit.

Configured in `deploy/local/dagster.yaml` (`run_launcher:`). Kubernetes
deployments use dagster-k8s's launcher and are unaffected.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

# Dagster's launcher interface: the launch context and run monitoring's health answer are private in 1.13;
# tests/instance/test_run_monitoring.py names each of them, so an upgrade that moves one fails there by name.
from dagster import DefaultRunLauncher
from dagster._core.launcher.base import CheckRunHealthResult, LaunchRunContext, WorkerStatus
from dagster._serdes import ConfigurableClassData

from common.proc import SINGLE_THREADED_ENV
from common.settings import settings

PREMADE = "_trainyard_premade"  # set on the instance a zygote made for its forked workers
WORKER_TAG = "trainyard/run_worker"  # {"pid": ..., "host": ..., "zygote": ...} on a forked run
RETRY_AFTER_SECONDS = 300.0  # a zygote that failed to start is tried again after this long
START_TIMEOUT_SECONDS = 120.0  # a zygote not serving after this long is given up
REQUEST_TIMEOUT_SECONDS = 30.0
LOCAL_ORIGINS = (
    "ManagedGrpcPythonEnvCodeLocationOrigin",
    "InProcessCodeLocationOrigin",
)  # code servers Dagster starts here
LOCAL_HOSTS = (
    "localhost",
    "127.0.0.1",
    "::1",
)  # and a gRPC server on this host (`dagster dev` serves its locations so)
# What a platform run worker imports only while it runs (the study's SQL storage: Optuna, SQLAlchemy, Alembic;
# the PostgreSQL driver; the object store's paths; Dagster's in-process step execution): 178 modules, 0.22 s of
# every trial run when imported after the fork (bench.sweep_throughput), imported once here instead. Absent
# modules are skipped.
RUN_PRELOAD = (
    "resources.sweeps.rdb",
    "psycopg2",
    "upath",
    "fsspec.implementations.local",
    "dagster._core.execution.plan.active",
    "dagster._core.executor.in_process",
    "dagster._core.system_config.composite_descent",
    "dagster._core.instance.factory",
)


def _host() -> str:
    return socket.gethostname()


def run_temp_dir(run_id: str) -> str:
    """The temporary folder of a forked run worker: its `TMPDIR`, removed when the run ends or its worker is found
    dead."""
    return os.path.join(tempfile.gettempdir(), f"trainyard-run-{run_id}")


def _process_state(pid: int, not_before: Optional[float]) -> str:
    """`alive`, or why process `pid` is not the run's worker any more (`gone`, `zombie`, `reused`).

    A process that started after `not_before` (the run's start, seconds since the epoch) holds a reused pid.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "gone"
    except PermissionError:
        pass  # another user's process: it exists
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "alive"  # no /proc (macOS): the signal said it exists
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):
        return "zombie"
    if not_before is not None:
        with contextlib.suppress(OSError, ValueError, IndexError):
            boot = next(
                float(line.split()[1])
                for line in Path("/proc/stat").read_text().splitlines()
                if line.startswith("btime ")
            )
            started = boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
            if started > not_before + 5.0:
                return "reused"
    return "alive"


def _worker_pid(instance: Any, run: Any) -> tuple[Optional[int], Optional[str]]:
    """The pid and host of a run's worker: the launcher's tag on a forked run, else the worker's "Started process"
    event."""
    if WORKER_TAG in run.tags:
        worker = json.loads(run.tags[WORKER_TAG])
        return int(worker["pid"]), worker.get("host")
    from dagster import DagsterEventType

    for record in reversed(instance.all_logs(run.run_id, of_type=DagsterEventType.ENGINE_EVENT)):
        event = record.dagster_event
        if record.message.startswith("Started process for run") and event is not None:
            pid = getattr(event.engine_event_data, "metadata", {}).get("pid")
            value = getattr(pid, "value", pid)
            if value is not None and str(value).isdigit():
                return int(str(value)), None  # spawned by a code server of this local instance
    return None, None


class _Zygote:
    """The launcher's handle on one zygote process (one per code location origin)."""

    def __init__(self, key: str, repository_origin: Any, instance_ref: Any) -> None:
        from dagster._serdes import serialize_value

        self.key = key
        self.dir = Path(tempfile.mkdtemp(prefix="tyz-"))  # short: a Unix socket path has at most 107 characters
        self.socket = self.dir / "sock"
        (self.dir / "origin.json").write_text(serialize_value(repository_origin))
        (self.dir / "instance.json").write_text(serialize_value(instance_ref))
        working_directory = getattr(repository_origin.code_pointer, "working_directory", None)
        executable = repository_origin.executable_path or sys.executable
        # Started with one thread in each native pool (a fork server must hold none), and its run workers given the
        # environment's own values back (`serve`), which it reads from `environ.json`.
        single = {k: v for k, v in SINGLE_THREADED_ENV.items() if not (k == "JE_ARROW_MALLOC_CONF" and k in os.environ)}
        (self.dir / "environ.json").write_text(json.dumps({k: os.environ.get(k) for k in single}))
        self.process = subprocess.Popen(
            [executable, "-m", "instance.zygote", str(self.dir)],
            cwd=working_directory or None, stdin=subprocess.DEVNULL, env={**os.environ, **single},
        )
        self.started = time.monotonic()
        self.failed: Optional[str] = None

    def ready(self) -> bool:
        """Serving now (never waits); sets `failed` when it died or never came up."""
        if self.failed:
            return False
        code = self.process.poll()
        if code is not None:
            detail = (self.dir / "error.txt").read_text() if (self.dir / "error.txt").exists() else f"exit code {code}"
            self.failed = f"the warm run worker process exited: {detail}"
            return False
        if (self.dir / "ready").exists():
            return True
        if time.monotonic() - self.started > START_TIMEOUT_SECONDS:
            self.failed = f"the warm run worker process did not start serving within {START_TIMEOUT_SECONDS:g} s"
            self.close()
        return False

    def fork(self, run_id: str) -> dict[str, Any]:
        """Ask for a run worker for `run_id` (on the instance the zygote was started for): {"pid": ...} or {"stale":
        file} or {"error": ...}."""
        request = json.dumps({"run_id": run_id}).encode() + b"\n"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(REQUEST_TIMEOUT_SECONDS)
            conn.connect(str(self.socket))
            conn.sendall(request)
            answer = conn.makefile("rb").readline()
        if not answer:
            return {"error": "the warm run worker process closed the connection without an answer"}
        return json.loads(answer)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


class WarmRunLauncher(DefaultRunLauncher):
    """`DefaultRunLauncher` that forks run workers from a warm process per code location (see the module docstring)."""

    def __init__(self, inst_data: Optional[ConfigurableClassData] = None) -> None:
        super().__init__(inst_data=inst_data)
        self._zygotes: dict[str, _Zygote] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_config_value(cls, inst_data: ConfigurableClassData, config_value: Mapping[str, Any]) -> "WarmRunLauncher":
        return cls(inst_data=inst_data)

    def register_instance(self, instance: Any) -> None:
        """Also keep the PostgreSQL connections of the process that launches runs (the daemon's queue; see
        `instance.storage_connections`): its every look at the queue and every launch queried on a new connection."""
        from instance.storage_connections import hold_connections

        super().register_instance(instance)
        hold_connections(instance)

    def launch_run(self, context: LaunchRunContext) -> None:
        run = context.dagster_run
        key = self._key(run)
        if key is not None:
            outcome = self._fork(key, run)
            if outcome is None:
                return
            self._instance.report_engine_event(
                f"Starting a run worker the default way: {outcome}", run, cls=self.__class__
            )
        super().launch_run(context)

    def _key(self, run: Any) -> Optional[str]:
        """The zygote key of a run's code location, or None when its runs are not forked here."""
        from dagster._serdes import serialize_value

        if not settings().warm_run_workers or run.job_code_origin is None or run.remote_job_origin is None:
            return None
        location = run.remote_job_origin.repository_origin.code_location_origin
        if type(location).__name__ not in LOCAL_ORIGINS and not (
            type(location).__name__ == "GrpcServerCodeLocationOrigin"
            and (location.socket or location.host in LOCAL_HOSTS)
        ):
            return None
        origin = run.job_code_origin.repository_origin
        working_directory = getattr(origin.code_pointer, "working_directory", None)
        if not os.path.exists(origin.executable_path or sys.executable) or (
            working_directory and not os.path.isdir(working_directory)
        ):
            return None  # a server on this host whose code is not (a container's port, say)
        return hashlib.sha256(serialize_value(origin).encode()).hexdigest()[:16]

    def _fork(self, key: str, run: Any) -> Optional[str]:
        """Fork a worker for `run` from its location's zygote: None when done, else why not (the default way goes
        on)."""
        with self._lock:
            zygote = self._zygotes.get(key)
            if zygote is not None and zygote.failed and time.monotonic() - zygote.started > RETRY_AFTER_SECONDS:
                zygote = None
            if zygote is None:
                self._zygotes[key] = _Zygote(key, run.job_code_origin.repository_origin, self._instance.get_ref())
                return "this code location's warm run worker process is starting (the next run forks from it)"
            if not zygote.ready():
                return zygote.failed or "this code location's warm run worker process is still starting"
            try:
                answer = zygote.fork(run.run_id)
            except OSError as e:
                answer = {"error": f"{type(e).__name__}: {e}"}
            if "pid" in answer:
                self._instance.add_run_tags(
                    run.run_id,
                    {WORKER_TAG: json.dumps({"pid": answer["pid"], "host": _host(), "zygote": zygote.process.pid})},
                )
                return None
            zygote.close()
            self._zygotes[key] = _Zygote(key, run.job_code_origin.repository_origin, self._instance.get_ref())
            if "stale" in answer:
                return (
                    f"{answer['stale']} changed since the warm run worker process loaded it (a fresh one is starting)"
                )
            return f"the warm run worker process failed: {answer.get('error')} (a fresh one is starting)"

    @property
    def supports_check_run_worker_health(self) -> bool:
        """Run monitoring (`run_monitoring` in deploy/local/dagster.yaml) asks `check_run_worker_health`."""
        return True

    def check_run_worker_health(self, run: Any) -> Any:
        """Whether a STARTED run's worker process still lives (a forked or a spawned one, on this host).

        A worker killed outright (SIGKILL, the out-of-memory killer) never records
        the run's end: the run would stay STARTED for ever. FAILED here has run
        monitoring mark it failed with this message, and removes the worker's
        temporary folder (`run_temp_dir`). A worker on another host, or one not
        known yet, counts as running.
        """
        pid, host = _worker_pid(self._instance, run)
        if pid is None or (host is not None and host != _host()):
            return CheckRunHealthResult(WorkerStatus.RUNNING, "the run worker's process is not known on this host")
        record = self._instance.get_run_record_by_id(run.run_id)
        start = getattr(record, "start_time", None) if record is not None else None
        state = _process_state(pid, start)
        if state == "alive":
            return CheckRunHealthResult(WorkerStatus.RUNNING)
        shutil.rmtree(run_temp_dir(run.run_id), ignore_errors=True)
        why = {"gone": "is gone", "zombie": "has exited", "reused": "is gone (its pid now belongs to another process)"}[
            state
        ]
        return CheckRunHealthResult(
            WorkerStatus.FAILED,
            f"the run worker (pid {pid}) {why} without recording the run's end: killed (SIGKILL, out of memory) or "
            "crashed",
        )

    def terminate(self, run_id: str) -> bool:
        run = self._instance.get_run_by_id(run_id) if self.has_instance else None
        worker = json.loads(run.tags[WORKER_TAG]) if run is not None and WORKER_TAG in run.tags else None
        if run is None or worker is None or worker.get("host") != _host():
            return super().terminate(run_id)
        if run.is_finished:
            return False
        self._instance.report_run_canceling(run)
        try:
            os.kill(int(worker["pid"]), signal.SIGINT)  # what the code server's cancellation sends a spawned worker
        except ProcessLookupError:
            self._instance.report_engine_event(
                f"The run worker (pid {worker['pid']}) is gone; nothing to terminate.", run, cls=self.__class__
            )
            return False
        return True

    def dispose(self) -> None:
        with self._lock:
            for zygote in self._zygotes.values():
                zygote.close()
            self._zygotes.clear()
