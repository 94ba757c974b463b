"""One warm launch in its supervisor process: the worker group's forks, output, restarts and classified exit.

`training.warm`'s server forks a supervisor per launch; the supervisor forks
the launch's `nprocs` workers (ranks 0..nprocs-1 of one node) and keeps
torchrun's agent semantics for them:

- each worker gets the environment torchrun gives local rank i (`RANK`,
  `LOCAL_RANK`, `WORLD_SIZE`, `MASTER_ADDR`/`MASTER_PORT` of this round's free
  loopback port, `TORCHELASTIC_RESTART_COUNT` ...), takes its own session and
  dies with the supervisor;
- its output goes to the launcher's pipe line by line, prefixed `[default<i>]:`
  as `--tee` does;
- the first worker to fail fails the group: the others get SIGTERM, and SIGKILL
  after `STOP_GRACE_SECONDS` (torchrun's agent closes its workers the same
  way); then the whole group starts again, up to `max_restarts` times (a
  restarted trial resumes from its newest committed checkpoint);
- SIGTERM and SIGINT are forwarded to every worker (a preemption still
  checkpoints), those of a server that is stopping included (`training.warm`
  forwards SIGTERM to each supervisor and waits); a launcher that disconnects
  stops the group;
- a failed launch ends with torchrun's failure summary (the first failure as the
  root cause, the workers stopped after it under "Failures:"), and the final
  status is `training.gang.classify` over this launch's failure records;
- the workers are watched for hangs and stragglers as `training.gang` watches
  torchrun's (`training.watchdog.GangWatchdog`): a hung group is killed and restarts.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import json
import os
import re
import select
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Optional

from common.settings import settings
from training.gang import classify, launch_records, output_uri_of, watchdog_policy
from training.spec import EXIT_INFRA, PROGRESS_DIR_ENV, STORE_LISTEN_FD_ENV, WANDB_SERVICE_ENV
from training.warm_preload import disown_server_exit_work
from training.warm_protocol import Request
from training.watchdog import POLL_SECONDS as WATCH_SECONDS
from training.watchdog import GangWatchdog

PR_SET_PDEATHSIG = 1
STOP_GRACE_SECONDS = 30.0  # torchrun's agent waits as long between SIGTERM and SIGKILL of its workers
DRAIN_SECONDS = 2.0  # output a worker's own children still hold after it exited
POLL_SECONDS = 0.2


def rank_prefix(rank: int) -> bytes:
    """torchrun's --tee prefix of local rank `rank` (role "default")."""
    return f"[default{rank}]:".encode()


def say(message: str, out: Optional[int] = None) -> None:
    """A supervisor line, unprefixed like torchrun's agent's, to the server log and to the launch output `out`."""
    line = f"[trainyard.warm] {message}\n"
    sys.stderr.write(line)
    sys.stderr.flush()
    if out is not None:
        try:
            os.write(out, line.encode())
        except OSError:
            pass  # the launcher is gone; the supervisor notices on its socket


def die_with_parent(parent: int, signum: int = signal.SIGKILL) -> None:
    """Send this process `signum` (SIGKILL) when `parent` dies (Linux); exit at once if it already has."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signum)
    if os.getppid() != parent:
        os._exit(EXIT_INFRA)


def store_listener(nprocs: int) -> socket.socket:
    """A loopback socket listening on a free port: the round's `MASTER_PORT`, handed to rank 0's TCPStore.

    torchrun's agent picks a free port and lets rank 0 bind it later; a rank
    that connects before rank 0 listens is refused and retries after a backoff
    of 0.27-0.43 s (measured, torch 2.13), which one warm start in ten paid. A
    socket that already listens queues the early connection instead.
    """
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(max(128, nprocs))
    return listener


# The server's shared W&B service (`training.warm_wandb`): its `WANDB_SERVICE` value, set before any supervisor is
# forked.
SERVICE_VAR = WANDB_SERVICE_ENV
SWITCH_ENV = "TRAINYARD_WARM_WANDB_SERVICE"
UNIX_TOKEN = re.compile(r"\d+-\d+-unix-(.+)")
SERVICE: dict[str, str] = {}


def launch_of(env: dict[str, str], default: str) -> str:
    """The launch id in a launch's environment (`TRAINYARD_LAUNCH_ID`, as given), else `default`."""
    launch = settings(env).launch_id
    return default if launch is None else launch


def service_env(env: dict[str, str]) -> dict[str, str]:
    """`{WANDB_SERVICE: value}` for a worker whose launch environment `env` names no service, while the shared one's
    socket exists."""
    value = SERVICE.get(SERVICE_VAR)
    if not value or SERVICE_VAR in env or not settings(env).warm_wandb_service:
        return {}
    match = UNIX_TOKEN.fullmatch(value)
    return {SERVICE_VAR: value} if match and os.path.exists(match.group(1)) else {}


def worker_env(
    request: Request, restart: int, master_port: int, rank: int = 0, store_fd: Optional[int] = None
) -> dict[str, str]:
    """The environment torchrun's agent gives local rank `rank` of a one-node launch of `request.nprocs`, over the
    request's.

    `store_fd`: rank 0's inherited listening socket for its TCPStore (`store_listener`).
    """
    n = str(request.nprocs)
    return {
        **request.env,
        **service_env(
            request.env
        ),  # the server's shared W&B service, unless the launch names one (training.warm_wandb)
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "WORLD_SIZE": n,
        "LOCAL_WORLD_SIZE": n,
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": n,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RESTART_COUNT": str(restart),
        "TORCHELASTIC_MAX_RESTARTS": str(request.max_restarts),
        "TORCHELASTIC_RUN_ID": request.run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        **({STORE_LISTEN_FD_ENV: str(store_fd)} if store_fd is not None else {}),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": request.env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        # torchrun's default for several workers on one node, unless the launch set it
        "OMP_NUM_THREADS": request.env.get("OMP_NUM_THREADS", "1"),
    }


def worker_path(cwd: str, env: dict[str, str], base: list[str]) -> list[str]:
    """`sys.path` of `python -m training.entrypoint` started in `cwd` with `env`: cwd, PYTHONPATH, the interpreter's
    own."""
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return [cwd, *extra, *(p for p in base if p not in extra and p != cwd)]


# The interpreter's own `sys.path` (site-packages, the standard library), without what the server's own working
# directory and PYTHONPATH added; set by the server before it forks anything.
BASE_PATH: list[str] = []


def run_worker(request: Request, env: dict[str, str], supervisor: int, out: int, close: list[int]) -> None:
    """In the forked worker: become `python -m <request.entry> --spec URI` as torchrun starts it; never returns."""
    code = EXIT_INFRA
    try:
        disown_server_exit_work()
        os.setsid()
        die_with_parent(supervisor)
        for s in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(s, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.dup2(out, 1)
        os.dup2(out, 2)
        for fd in [out, *close]:
            os.close(fd)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(request.cwd)
        sys.path[:] = worker_path(request.cwd, env, BASE_PATH)
        importlib.invalidate_caches()
        import torch

        program = importlib.import_module(request.entry)
        sys.argv = [str(program.__file__), "--spec", request.spec_uri]
        torch.set_num_threads(max(1, int(env.get("OMP_NUM_THREADS", "1"))))
        code = program.main(["--spec", request.spec_uri])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # the worker must reach os._exit: it runs inside the supervisor's stack
        traceback.print_exc()
        code = 1
    finally:
        try:
            atexit._run_exitfuncs()  # what the interpreter runs on a normal exit (W&B, logging, multiprocessing)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


@dataclass
class Worker:
    """One forked rank of the current group: its output pipe, exit descriptor and status once reaped."""

    rank: int
    pid: int
    read_end: int
    exited: Optional[int]  # pidfd: readable once the process exited (None where there is none)
    pending: bytes = b""
    status: Optional[int] = None
    open: bool = True  # its output pipe has not ended


@dataclass
class Supervisor:
    """One launch in a process of its own: the worker group, restarts, signal forwarding and the classified status.

    Attributes:
        conn: the launcher's connection; events go out on it, and its end means the launcher is gone.
        out: the launcher's output pipe.
        request: the launch.
    """

    conn: socket.socket
    out: int
    request: Request
    workers: list[Worker] = field(default_factory=list)
    failures: list[Worker] = field(default_factory=list)  # of the last round, the first observed first
    signalled: Optional[int] = None
    client_gone: bool = False
    started: float = field(default_factory=time.time)
    pid: int = field(default_factory=os.getpid)
    watchdog: Optional[GangWatchdog] = None  # set for the launch by `run`

    def send(self, event: dict[str, Any]) -> None:
        try:
            self.conn.sendall((json.dumps(event) + "\n").encode())
        except OSError:
            self.client_gone = True

    def _forward(self, signum: int, frame: Any) -> None:
        self.signalled = signum
        for w in self.workers:
            if w.status is None:
                try:
                    os.kill(w.pid, signum)
                except ProcessLookupError:
                    pass

    def relay(self, w: Worker, data: bytes) -> None:
        """Write worker `w`'s complete lines to the launch output, each prefixed like torchrun's --tee."""
        w.pending += data
        *lines, w.pending = w.pending.split(b"\n")
        if lines:
            prefix = rank_prefix(w.rank)
            self._write(b"".join(prefix + line + b"\n" for line in lines))

    def _write(self, data: bytes) -> None:
        try:
            _write_all(self.out, data)
        except BrokenPipeError:
            self.client_gone = True

    def run_once(self, restart: int) -> int:
        """Fork round `restart`'s workers and follow them to the end; the group's status (the first failure's, else
        0)."""
        self.workers, self.failures = [], []
        with store_listener(self.request.nprocs) as listener:  # rank 0 keeps it; the others and this process close it
            self._fork_round(restart, listener)
        self._follow()
        return self.failures[0].status if self.failures and self.failures[0].status is not None else 0

    def _fork_round(self, restart: int, listener: socket.socket) -> None:
        port = int(listener.getsockname()[1])
        for rank in range(self.request.nprocs):
            env = worker_env(self.request, restart, port, rank, store_fd=listener.fileno() if rank == 0 else None)
            if self.watchdog is not None:
                env[PROGRESS_DIR_ENV] = self.watchdog.directory
            read_end, write_end = os.pipe()
            others = [x for w in self.workers for x in (w.read_end, *((w.exited,) if w.exited is not None else ()))]
            pid = os.fork()
            if pid == 0:
                run_worker(
                    self.request,
                    env,
                    supervisor=self.pid,
                    out=write_end,
                    close=[read_end, self.out, self.conn.fileno(), *others, *([listener.fileno()] if rank else [])],
                )
            os.close(write_end)
            w = Worker(rank, pid, read_end, _pidfd(pid))
            self.workers.append(w)
            if self.signalled is not None:  # arrived while forking
                os.kill(pid, self.signalled)
            self.send(
                {"event": "worker", "pid": pid, "rank": rank, "restart": restart, "start_ticks": start_ticks(pid)}
            )
            say(f"launch {launch_of(self.request.env, '?')} (spec {self.request.spec_uri}): worker pid {pid} started "
                f"(restart {restart}) by supervisor pid {self.pid} of warm server pid {os.getppid()} "
                f"(rank {rank} of {self.request.nprocs})", self.out)

    def _follow(self) -> None:
        """Relay the workers' output while they run; on the first failure (or the launcher gone) stop the rest."""
        stop_sent: Optional[float] = None
        drain_until: Optional[float] = None
        watched_at = time.monotonic()
        while True:
            if (
                self.watchdog is not None
                and not self.failures
                and self.signalled is None
                and time.monotonic() - watched_at >= WATCH_SECONDS
            ):
                watched_at = time.monotonic()
                try:
                    self.watchdog.poll()  # a hung group is SIGKILLed here, and reaped below as failed
                except Exception as e:  # the watch must never take the launch down with it
                    say(f"watchdog poll failed ({type(e).__name__}: {e}); still watching", self.out)
            pipes = {w.read_end: w for w in self.workers if w.open}
            exits = {w.exited: w for w in self.workers if w.exited is not None and w.status is None}
            watched = [*pipes, *exits, *([] if self.client_gone else [self.conn.fileno()])]
            # A worker's exit wakes the loop: its output ends a moment before it can be reaped.
            ready, _, _ = select.select(watched, [], [], POLL_SECONDS)
            for fd in ready:
                if fd in pipes:
                    data = os.read(fd, 65536)
                    if data:
                        self.relay(pipes[fd], data)
                    else:
                        pipes[fd].open = False
            if self.conn.fileno() in ready and not self.client_gone and not self._client_alive():
                self.client_gone = True
            self._reap()
            running = [w for w in self.workers if w.status is None]
            if running and (self.failures or self.client_gone):
                if stop_sent is None:
                    why = (
                        "the launcher disconnected"
                        if not self.failures
                        else f"rank {self.failures[0].rank} (pid {self.failures[0].pid}) exited with status "
                             f"{self.failures[0].status}"
                    )
                    say(f"{why}; stopping the other workers ({', '.join(f'pid {w.pid}' for w in running)})", self.out)
                stop_sent = self._stop(running, stop_sent)
            if not running:
                drain_until = drain_until or time.monotonic() + DRAIN_SECONDS
                if not any(w.open for w in self.workers) or time.monotonic() > drain_until:
                    break
        for w in self.workers:
            if w.pending:
                self.relay(w, b"\n")
            os.close(w.read_end)

    def _reap(self) -> None:
        for w in self.workers:
            if w.status is not None:
                continue
            done, raw = os.waitpid(w.pid, os.WNOHANG)
            if not done:
                continue
            w.status = os.waitstatus_to_exitcode(raw)
            if w.exited is not None:
                os.close(w.exited)
                w.exited = None
            if w.status != 0:
                self.failures.append(w)

    def _client_alive(self) -> bool:
        """False once the launcher's end of the connection is closed (it sends nothing after its request)."""
        try:
            return bool(self.conn.recv(4096))
        except OSError:
            return False

    def _stop(self, workers: list[Worker], since: Optional[float]) -> float:
        """SIGTERM `workers` once, SIGKILL their process groups after the grace period; when SIGTERM went."""
        now = time.monotonic()
        for w in workers:
            try:
                if since is None:
                    os.kill(w.pid, signal.SIGTERM)
                elif now - since > STOP_GRACE_SECONDS:
                    os.killpg(w.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return since if since is not None else now

    def run(self, early: Optional[list[int]] = None) -> int:
        """The whole launch; the classified status, also sent as the `exit` event.

        `early`: signals that reached this process before the launch began (its server stopping); the first is
        forwarded to the workers as they start.
        """
        previous = {s: signal.signal(s, self._forward) for s in (signal.SIGTERM, signal.SIGINT)}
        if early and self.signalled is None:
            self.signalled = early[0]
        progress = tempfile.mkdtemp(prefix="trainyard-progress-")
        self.watchdog = GangWatchdog(
            progress,
            watchdog_policy(self.request.spec_uri),
            output_uri_of(self.request.spec_uri),
            launch_of(self.request.env, ""),
            lambda m: say(m, self.out),
        )
        try:
            status = 0
            for restart in range(self.request.max_restarts + 1):
                status = self.run_once(restart)
                if status == 0 or self.signalled is not None or self.client_gone:
                    break
                if restart < self.request.max_restarts:
                    say(f"worker group failed (rank {self.failures[0].rank} exited with status {status}); "
                        f"restarting it ({restart + 1} of {self.request.max_restarts})", self.out)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            shutil.rmtree(progress, ignore_errors=True)
        return self.finish(status)

    def finish(self, status: int) -> int:
        """torchrun's failure summary for a failed group, then `training.gang`'s verdict over this launch's records."""
        records: list[dict[str, Any]] = []
        if status != 0:
            self._write(failure_summary(self.failures).encode())
            try:
                records = launch_records(
                    output_uri_of(self.request.spec_uri), launch_of(self.request.env, ""), self.started
                )
            except Exception as e:  # store unreachable, credentials: never the user-error status (as in training.gang)
                say(f"cannot read the failure records ({type(e).__name__}: {e}); classifying without them", self.out)
        verdict = classify(records, status, self.signalled)
        if status != 0:
            say(f"worker exited {status}; {verdict.reason}; exiting {verdict.code}", self.out)
        self.send({"event": "exit", "code": verdict.code, "reason": verdict.reason})
        return verdict.code


def _pidfd(pid: int) -> Optional[int]:
    """A descriptor that becomes readable when child `pid` exits (Linux 5.3+), or None where there is none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def start_ticks(pid: int) -> int:
    """Process `pid`'s start time in clock ticks since boot (`/proc/<pid>/stat` field 22): a pid plus this names one
    process."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


def _entry(w: Worker) -> str:
    status = w.status if w.status is not None else 0
    if status < 0:
        try:
            cause = f"Signal {-status} ({signal.Signals(-status).name}) received by PID {w.pid}"
        except ValueError:
            cause = f"Signal {-status} received by PID {w.pid}"
    else:
        cause = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
    return (f"  time      : {time.strftime('%Y-%m-%d_%H:%M:%S')}\n  host      : {socket.gethostname()}\n"
            f"  rank      : {w.rank} (local_rank: {w.rank})\n  exitcode  : {status} (pid: {w.pid})\n"
            f"  error_file: <N/A>\n  traceback : {cause}\n")


def failure_summary(failures: list[Worker]) -> str:
    """The `ChildFailedError` block torchrun prints for a failed group, for
    `resources.launch_errors.parse_worker_exits`.

    `failures`: the workers that exited non-zero, the first observed first (the root cause); the others, those
    stopped after it among them, are listed under "Failures:".
    """
    first, others = failures[0], failures[1:]
    listed = "".join(f"[{i}]:\n{_entry(w)}" for i, w in enumerate(others, 1)) or "  <NO_OTHER_FAILURES>\n"
    return ("[trainyard.warm] worker group failed:\n"
            f"Failures:\n{listed}"
            f"Root Cause (first observed failure):\n[0]:\n{_entry(first)}")
