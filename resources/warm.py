"""Warm workers: the launcher's side of `training.warm`, the fork server that starts one-node trials without a cold
start.

`LocalLauncher` hands a one-node trial to a server on this machine instead
of starting `training.gang` and torchrun: `launch_warm` finds the server for
this interpreter and this `training/` code (starting it when there is none),
sends the launch with the write end of the output pipe, and returns a
`WarmProcess` that the launcher waits for, stops and reads like the
`subprocess.Popen` of the cold path.

Servers live in `${TRAINYARD_WARM_DIR:-${XDG_RUNTIME_DIR:-/tmp}/trainyard-warm-<uid>}`
(a directory only this user may use), one per key: a hash of the interpreter,
its version, its installed distributions (`common.installed.fingerprint` of
site-packages: every `*.dist-info` entry's name, inode and modification time,
which any `pip`/`uv` install, upgrade or removal replaces) and the text of
every `training/**/*.py` and `common/**/*.py` (which includes `training.warm`'s list of modules to
preload), and the launch's variables that only a process's start reads
(`startup_env`: `MALLOC_*`, `LD_*`, `GLIBC_TUNABLES`, `PYTHONHASHSEED`,
`PYTHONMALLOC`) or that the preloaded libraries read when they load (`OMP_*`,
`MKL_*`, `OPENBLAS_*`, `ARROW_*`, torch's logging switches ...; thread counts
aside, which each worker applies after the fork), which a forked worker would
otherwise take from the server. A changed `training/`,
interpreter, set of installed packages or start-time variable gets a new server; the old one exits when idle. A lock
file serializes start-up so
that concurrent launches start one server; each server logs to `<key>.log`
beside its socket and writes its pid to `<key>.pid`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import site
import socket
import stat
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any, Mapping, Optional

import training.spec
from common import installed
from common.atomic import exclusive_lock
from common.settings import settings
from trainyard.project import package_dir

WARM_DIR_ENV = "TRAINYARD_WARM_DIR"
WARM_WORKERS_ENV = "TRAINYARD_WARM_WORKERS"
SUN_PATH_MAX = 107  # sockaddr_un.sun_path on Linux, less the terminating NUL
WORKER_START_SECONDS = (
    30.0  # from the request to the last worker's fork: the server forks the supervisor, it the workers
)
SUPERVISOR_EXIT_SECONDS = 5.0  # from the supervisor's exit event to its exit: it only returns and exits


class WarmUnavailable(Exception):
    """No warm worker could take this launch before it started (no server, a refusal); the cold path can."""


def warm_workers_enabled(env: Mapping[str, str]) -> bool:
    """Whether `TRAINYARD_WARM_WORKERS` in `env` leaves warm workers on (the default when unset).

    Raises:
        common.settings.SettingsError: the variable holds something other than a boolean word (a ValueError naming it).
    """
    return settings(env).warm_workers


def warm_dir(env: Mapping[str, str]) -> Path:
    """Where servers put their sockets, logs and pid files, from `env`."""
    return settings(env).warm_dir or Path(env.get("XDG_RUNTIME_DIR") or "/tmp") / f"trainyard-warm-{os.getuid()}"


def private_dir(path: Path) -> Path:
    """`path`, created with mode 0700 if missing, after checking that no other user owns or can write it.

    Raises:
        WarmUnavailable: it is not a directory, or it belongs to or is open to another user.
    """
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.stat()
    except OSError as e:
        raise WarmUnavailable(f"cannot use {path} for warm worker sockets: {e}") from e
    if not stat.S_ISDIR(info.st_mode):
        raise WarmUnavailable(f"{path} (for warm worker sockets) is not a directory")
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise WarmUnavailable(
            f"{path} (for warm worker sockets) must belong to uid {os.getuid()} with mode 0700, "
            f"found uid {info.st_uid} mode {oct(info.st_mode & 0o777)}"
        )
    return path


def training_root() -> Path:
    """The directory that holds the `training` package this process imports (the server's working directory).

    The checkout for the editable install, site-packages for a wheel: either way, a server started
    there with this interpreter imports the same `training`, and its key hashes those files.
    """
    return package_dir("training").parent


# Variables read only when a process starts (the C library's allocator and loader, Python's hash seed and allocator):
# a worker forked from a server keeps the server's, whatever its launch environment says. So do the variables the
# libraries the server preloads read when they load: the OpenMP runtimes' (torch's, LightGBM's) and the BLAS libraries'
# settings (numpy, scipy), Arrow's (its IO pool's size, memory pool, SIMD level, jemalloc settings), torch's logging and
# JIT switches. Their thread counts (`THREAD_COUNT_ENV`) are the exception: a server started with more than one thread
# would hold thread pools (OpenBLAS starts its threads when it loads) and could not fork, so it starts with one of each
# and each worker gives its runtimes its launch's counts (`training.threads.apply_thread_counts`); they are no part of
# the key.
STARTUP_ENV_PREFIXES = ("MALLOC_", "LD_", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "BLIS_", "NUMEXPR_", "ARROW_")
STARTUP_ENV_NAMES = frozenset({
    "GLIBC_TUNABLES", "PYTHONHASHSEED", "PYTHONMALLOC", "JE_ARROW_MALLOC_CONF",
    "TORCH_CPP_LOG_LEVEL", "TORCH_SHOW_CPP_STACKTRACES", "TORCH_LOGS", "PYTORCH_JIT",
})
SERVER_THREAD_ENV = {name: "1" for name in training.spec.THREAD_COUNT_ENV}
# What a training process gets where its launch sets none: one thread a rank, as torchrun gives each of several ranks
# (local trials share the machine, several at once; `training.threads` sizes torch and LightGBM to it).
LOAD_DEFAULTS = {"OMP_NUM_THREADS": "1"}


def training_env(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` with the platform's defaults for training processes (`TRAINING_MALLOC_ENV`, `LOAD_DEFAULTS`) where it
    sets none.

    Every process that starts a server for trials passes its environment through this (launches, the planner's model
    descriptions, the prestart), so they all key on, and share, the one server.
    """
    return {**training.spec.TRAINING_MALLOC_ENV, **LOAD_DEFAULTS, **environ}


# Set by libraries themselves when imported (scikit-learn's and joblib's `__init__`, with `setdefault`): a launching
# process gains them after its first such import; keyed, they made a launch after that import miss the server a
# prestart had started before it. Workers still get them: a worker takes the launch's environment as given.
IMPORT_SET_ENV = frozenset({"KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK"})


def startup_env(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of `env` read only when a process starts or a preloaded library loads (`STARTUP_ENV_*`), thread
    counts and what libraries set on import (`IMPORT_SET_ENV`) aside; a server is started with, and keyed on, them."""
    return {k: v for k, v in env.items()
            if (k in STARTUP_ENV_NAMES or k.startswith(STARTUP_ENV_PREFIXES))
            and k not in SERVER_THREAD_ENV and k not in IMPORT_SET_ENV}


def server_key(python: str, root: Path, env: Optional[Mapping[str, str]] = None) -> str:
    """The name of the server for interpreter `python` serving `root/training`: a hash of all that makes it stale.

    Args:
        python: the interpreter's path (this process's own, `sys.executable`).
        root: the directory that holds the `training` package.
        env: the launch's environment (default: this process's): its start-time variables (`startup_env`) are part
            of the key, so a launch that sets `MALLOC_ARENA_MAX` or `OMP_PROC_BIND`, say, runs on a server started with
            it.
    """
    h = hashlib.sha256()
    for part in (python, sys.version, str(root), installed.fingerprint(install_dirs())):
        h.update(part.encode() + b"\0")
    for name, value in sorted(startup_env(os.environ if env is None else env).items()):
        h.update(f"{name}={value}".encode() + b"\0")
    # `training/` and `common/`, which the pod side imports (its settings, atomic writes, the thread check)
    for path in sorted(p for package in ("training", "common") for p in (root / package).rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def install_dirs() -> list[str]:
    """Where this interpreter's distributions are installed: site-packages (pure and platform), the user's site."""
    paths = sysconfig.get_paths()
    dirs = [paths[k] for k in ("purelib", "platlib") if k in paths]
    with contextlib.suppress(AttributeError):  # an old virtualenv's `site` has neither
        dirs += [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]
    return list(dict.fromkeys(dirs))


def _connect(path: Path) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(path))
    except OSError:
        conn.close()
        raise
    return conn


def _log_tail(path: Path, lines: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "(no log)"


def connect(directory: Path, *, python: str, root: Path, idle_seconds: float, start_timeout: float,
            env: Optional[Mapping[str, str]] = None) -> socket.socket:
    """A connection to the server for `python`, `root` and `env`'s start-time variables, starting it (once, under a
    lock) when there is none.

    Args:
        directory: where servers live (`warm_dir`).
        python: the interpreter the server runs.
        root: the directory holding the `training` package the server imports.
        env: the launch's environment (default: this process's); a server started here gets its start-time variables.
        idle_seconds: the idle time after which a server started here exits.
        start_timeout: how long a starting server may take to import and listen.

    Raises:
        WarmUnavailable: no server could be started or reached; the message says why and where its log is.
    """
    if not sys.platform.startswith("linux"):
        raise WarmUnavailable(f"warm workers need Linux (process death signals, /proc); this is {sys.platform}")
    directory = private_dir(directory)
    env = os.environ if env is None else env
    key = server_key(python, root, env)
    path = directory / f"{key}.sock"
    if len(os.fsencode(path)) > SUN_PATH_MAX:
        raise WarmUnavailable(
            f"the socket path {path} is longer than {SUN_PATH_MAX} bytes; set {WARM_DIR_ENV} to a shorter directory"
        )
    with contextlib.suppress(FileNotFoundError, ConnectionRefusedError):
        return _connect(path)
    with exclusive_lock(str(directory / f"{key}.lock")):
        with contextlib.suppress(FileNotFoundError, ConnectionRefusedError):
            return _connect(path)  # started by another launch while this one waited for the lock
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a dead server's socket
        log = directory / f"{key}.log"
        _start_server(
            path, log, python=python, root=root, idle_seconds=idle_seconds, start_timeout=start_timeout, env=env
        )
        try:
            return _connect(path)
        except OSError as e:
            raise WarmUnavailable(
                f"the warm worker server at {path} started but refused the connection ({e}); log {log}"
            ) from e


def _start_server(path: Path, log: Path, *, python: str, root: Path, idle_seconds: float, start_timeout: float,
                  env: Mapping[str, str]) -> None:
    """Start `python -m training.warm serve` detached, with `env`'s start-time variables, and wait until its socket is
    in place.

    Raises:
        WarmUnavailable: it exited or took longer than `start_timeout` (then it is killed).
    """
    own = startup_env(os.environ)
    env = {
        **{k: v for k, v in os.environ.items() if k not in own},
        **startup_env(env),
        **SERVER_THREAD_ENV,
        "PYTHONUNBUFFERED": "1",
    }
    cmd = [python, "-m", "training.warm", "serve", "--socket", str(path), "--idle-seconds", f"{idle_seconds:g}"]
    with open(log, "w") as out:
        # Its own session: a signal to the launcher's process group (a run being stopped) leaves it serving others.
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + start_timeout
    while not path.exists():
        if proc.poll() is not None:
            raise WarmUnavailable(
                f"the warm worker server exited {proc.returncode} while starting ({_log_tail(log)}); log {log}"
            )
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise WarmUnavailable(
                f"the warm worker server did not listen within {start_timeout:.0f} s; killed; log {log}"
            )
        time.sleep(0.05)


def start_ticks(pid: int) -> Optional[int]:
    """Process `pid`'s start time since boot in clock ticks; None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


class WarmProcess:
    """One launch running on a warm server, waited for and stopped like the `subprocess.Popen` of `training.gang`.

    Attributes:
        args: what the launch runs, for messages.
        returncode: the classified status (`training.spec.EXIT_*`) once known.
        lost: why the launch ended without a status (its server or supervisor died), else None.
        server_pid, supervisor_pid: from the supervisor's first event.
        workers: (pid, start ticks) of each worker started, in order.
    """

    def __init__(self, conn: socket.socket, args: list[str]) -> None:
        self.conn = conn
        self.args = args
        self.returncode: Optional[int] = None
        self.lost: Optional[str] = None
        self.server_pid: Optional[int] = None
        self.supervisor_pid: Optional[int] = None
        self.supervisor_ticks: Optional[int] = None
        self.workers: list[tuple[int, int]] = []
        self._buffer = b""
        self._ended = False  # the supervisor's end of the connection closed: it has exited

    @property
    def pid(self) -> Optional[int]:
        return self.supervisor_pid

    def _handle(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "supervisor":
            self.supervisor_pid, self.server_pid = int(event["pid"]), int(event["server"])
            self.supervisor_ticks = start_ticks(self.supervisor_pid)
        elif kind == "worker":
            self.workers.append((int(event["pid"]), int(event["start_ticks"])))
        elif kind == "exit":
            self.returncode = int(event["code"])
        elif kind == "refused":
            raise WarmUnavailable(f"the warm worker server refused the launch: {event.get('reason')}")

    def _read(self, timeout: Optional[float]) -> bool:
        """Handle the events that arrive within `timeout` seconds (None: block); False once the connection ended."""
        self.conn.settimeout(timeout)
        try:
            data = self.conn.recv(65536)
        except TimeoutError:
            return True
        except OSError as e:
            data = b""
            self.lost = f"connection to the warm worker supervisor failed: {e}"
        if not data:
            self._ended = True
            return False
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            self._handle(json.loads(line))
        return True

    def wait_for_workers(self, n: int, timeout: float) -> None:
        """Return once the first `n` workers (the first group) are started.

        Raises:
            WarmUnavailable: refused, or the connection ended or stalled first (nothing of the trial ran).
        """
        deadline = time.monotonic() + timeout
        try:
            while len(self.workers) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WarmUnavailable(
                        f"the warm worker server started {len(self.workers)} of {n} workers within {timeout:.0f} s"
                    )
                if not self._read(left):
                    raise WarmUnavailable(f"the warm worker server closed the connection before starting the workers "
                                          f"({self.lost or 'no reason given'})")
        except WarmUnavailable:
            self.kill_workers(wait=0.0)
            self.conn.close()
            raise

    def wait(self, timeout: Optional[float] = None) -> int:
        """The launch's classified status, like `Popen.wait`.

        Raises:
            subprocess.TimeoutExpired: still running after `timeout` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            if not self._read(left):
                who = f"supervisor pid {self.supervisor_pid} (warm server pid {self.server_pid})"
                self.lost = self.lost or f"the warm worker {who} died before the launch ended"
                self.returncode = training.spec.EXIT_INFRA
        # The exit event comes just before the supervisor exits; its end of the connection closes when it has, so
        # a launch that returns leaves no process of its own behind (its worker was reaped before the event).
        until = time.monotonic() + SUPERVISOR_EXIT_SECONDS
        while not self._ended and self.lost is None and time.monotonic() < until:
            self._read(max(0.01, until - time.monotonic()))
        self._ended = True
        self.conn.close()
        return self.returncode

    def poll(self) -> Optional[int]:
        try:
            return self.wait(0.0)
        except subprocess.TimeoutExpired:
            return None

    def send_signal(self, signum: int) -> None:
        """Signal the supervisor (it forwards SIGTERM and SIGINT to every worker, as `training.gang` does)."""
        if self.supervisor_pid is not None and start_ticks(self.supervisor_pid) == self.supervisor_ticks:
            os.kill(self.supervisor_pid, signum)

    def stop(self, grace: float) -> None:
        """SIGTERM the launch; after `grace` seconds SIGKILL the supervisor and the workers' process groups."""
        self.send_signal(signal.SIGTERM)
        try:
            self.wait(grace)
        except subprocess.TimeoutExpired:
            self.send_signal(signal.SIGKILL)
            self.kill_workers(wait=0.0)
            self.wait()

    def kill_workers(self, wait: float = 5.0) -> None:
        """Make sure no worker of this launch still runs: allow `wait` seconds to die with their supervisor, then
        SIGKILL.

        A worker is named by pid and start time, so a pid the kernel gave to a new process is left alone.
        """
        deadline = time.monotonic() + wait
        for pid, ticks in self.workers:
            while start_ticks(pid) == ticks and time.monotonic() < deadline:
                time.sleep(0.05)
            if start_ticks(pid) == ticks:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)


def launch_warm(
    env: Mapping[str, str],
    spec_uri: str,
    max_restarts: int,
    output_fd: int,
    *,
    python: str,
    idle_seconds: float,
    start_timeout: float,
    root: Optional[Path] = None,
    entry: str = "training.entrypoint",
    nprocs: int = 1,
) -> WarmProcess:
    """Start a one-node launch of `spec_uri` on warm workers; its workers are running when this returns.

    Args:
        env: the workers' environment (the launcher's, with `TRAINYARD_LAUNCH_ID`).
        spec_uri: the spec the workers train.
        max_restarts: restarts of the worker group after a failure, as torchrun's `--max-restarts`.
        output_fd: the write end of the pipe the launch's output goes to (passed over the socket).
        python: the interpreter; a server runs this one.
        idle_seconds: idle time after which a server started now exits.
        start_timeout: how long a server may take to start.
        root: the directory holding `training` (default: this process's).
        entry: what the worker runs with `--spec spec_uri`: a trial (`training.entrypoint`), or the planner's
            model description (`training.describe`, see `resources.model_facts`).
        nprocs: the workers (ranks) of the launch, as torchrun's `--nproc-per-node`.

    Raises:
        WarmUnavailable: nothing started; the trial may run cold.
    """
    root = root or training_root()
    conn = connect(
        warm_dir(env), python=python, root=root, idle_seconds=idle_seconds, start_timeout=start_timeout, env=env
    )
    launch = settings(env).launch_id
    run_id = f"warm-{time.time_ns() if launch is None else launch}"
    request = {
        "env": dict(env),
        "cwd": os.getcwd(),
        "spec_uri": spec_uri,
        "max_restarts": max_restarts,
        "run_id": run_id,
        "entry": entry,
        "nprocs": nprocs,
    }
    data = (json.dumps(request) + "\n").encode()
    try:
        sent = socket.send_fds(conn, [data], [output_fd])
        conn.sendall(data[sent:])
    except OSError as e:
        conn.close()
        raise WarmUnavailable(f"cannot send the launch to the warm worker server: {e}") from e
    proc = WarmProcess(conn, ["training.warm", entry, "--spec", spec_uri])
    proc.wait_for_workers(nprocs, WORKER_START_SECONDS)
    return proc


def stop_servers(directory: Path, timeout: float = 10.0) -> list[int]:
    """SIGTERM every server that has a pid file in `directory`, SIGKILL those still there after `timeout`; their pids.

    A pid file whose process is not a `training.warm` server (gone, or the pid reused) is skipped.
    """
    pids = []
    for pid_file in sorted(directory.glob("*.pid")):
        try:
            pid = int(pid_file.read_text().strip())
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"training.warm" not in f.read():
                    continue
        except (OSError, ValueError):
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        pids.append(pid)
    deadline = time.monotonic() + timeout
    for pid in pids:
        while start_ticks(pid) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        if start_ticks(pid) is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return pids


def prestart(env: Mapping[str, str], *, python: str, idle_seconds: float, start_timeout: float) -> bool:
    """Have the server for `python` and this checkout start in the background, unless one listens; the caller does not
    wait.

    For the run that knows trials are coming (the `sweep` asset): the server's
    imports (7-8 s here) then overlap the sweep sensor's tick and the trial
    run's queue and start-up instead of sitting in the first trial's step.
    A detached `python -m resources.warm prestart` starts it exactly as a
    launch does (`connect`, under the start-up lock), so a launch that comes
    before it listens waits for this start rather than making a second server.

    Returns:
        Whether a starter was begun (False: a server already listens, warm
        workers are off in `env`, or this is not Linux). A starter that fails
        leaves the first launch to start the server (or run cold) as it would have.
    """
    if not sys.platform.startswith("linux") or not warm_workers_enabled(env):
        return False
    root = training_root()
    with contextlib.suppress(OSError):
        _connect(warm_dir(env) / f"{server_key(python, root, env)}.sock").close()
        return False
    cmd = [
        python,
        "-m",
        "resources.warm",
        "prestart",
        "--idle-seconds",
        f"{idle_seconds:g}",
        "--start-timeout",
        f"{start_timeout:g}",
    ]
    subprocess.Popen(
        cmd,
        cwd=root,
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    return True


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m resources.warm prestart`: start (or find) this interpreter's server for this checkout, then exit."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m resources.warm")
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser(
        "prestart", help="start the warm worker server for this interpreter and checkout, if none listens"
    )
    start.add_argument("--idle-seconds", type=float, required=True)
    start.add_argument("--start-timeout", type=float, required=True)
    args = parser.parse_args(argv)
    try:
        connect(warm_dir(os.environ), python=sys.executable, root=training_root(), idle_seconds=args.idle_seconds,
                start_timeout=args.start_timeout).close()
    except WarmUnavailable as e:
        print(f"warm worker server not started: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
