"""`python -m training.warm serve --socket PATH`: a fork server that starts one-process trials without a cold start.

A one-process trial launched through `training.gang` costs three cold
interpreters (the wrapper, torchrun's agent, the worker importing torch,
Lightning, pandas ...), seconds before its first step and more than the whole
fit of a small trial. This server imports the heavy modules once, runs no torch
op and starts no thread (forking is safe only from a single-threaded process),
and listens on a unix socket. Each connection is one launch:

- the server forks a *supervisor* at once and goes back to listening; the
  supervisor dies with the server (`PR_SET_PDEATHSIG`);
- the supervisor reads the request (one JSON line: the environment, working
  directory, spec URI, restart budget and run id) with the write end of the
  launcher's output pipe attached (`SCM_RIGHTS`), and runs the launch with the
  semantics of `training.gang` around torchrun for one process: the worker gets
  torchrun's environment (`RANK=0`, `TORCHELASTIC_RESTART_COUNT=<i>` ...), a
  failed worker is started again up to `max_restarts` times, SIGTERM and SIGINT
  are forwarded to the worker (a preemption still checkpoints), and the final
  status is `training.gang.classify` over this launch's failure records;
- each *worker* is a fork of the supervisor, so the supervisor is its parent
  as torchrun's agent is (fault drills signal `os.getppid()`, and only a
  parent can wait for a child's status); it takes its own session, dies with
  the supervisor, restores default signal handlers, replaces its environment,
  working directory and `sys.path` with the request's and runs
  `training.entrypoint.main` (or, for a request whose `entry` says so, the
  planner's `training.describe.main`: the capacity planner's model
  description, which needs the same imports). Team model code is imported
  only there, after the fork, so an edit to it is always picked up.

The worker's output reaches the launcher through the supervisor, each line
prefixed `[default0]:` as torchrun's `--tee` does; the supervisor's own lines
are unprefixed, and a failed launch ends with torchrun's failure summary, so
`resources.launcher.LaunchOutput` and `outcome_error` read both paths alike.
Over the socket the supervisor reports JSON lines: `{"event": "supervisor"}`,
`{"event": "worker", "pid": ...}` per worker start, `{"event": "exit",
"code": ...}` last. A launcher that disconnects stops the launch (SIGTERM to the
worker, then SIGKILL after a grace period). The server exits after
`--idle-seconds` with no launch in flight and removes its socket.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import importlib
import json
import os
import select
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Optional

from training.gang import classify, launch_records, output_uri_of
from training.spec import EXIT_INFRA, EXIT_OK, LAUNCH_ID_ENV
from training.warm_preload import disown_server_exit_work, preload, run_server_exit_work
from training.warm_protocol import Request, receive_request

PR_SET_PDEATHSIG = 1
STOP_GRACE_SECONDS = 30.0  # torchrun's agent waits as long between SIGTERM and SIGKILL of its workers
DRAIN_SECONDS = 2.0  # output a worker's own children still hold after it exited
RANK_PREFIX = "[default0]:"  # torchrun's --tee prefix of local rank 0 (role "default")


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


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when `parent` dies (Linux); exit at once if it already has."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(EXIT_INFRA)


def free_port() -> int:
    """A TCP port free on loopback now (torchrun's agent picks `MASTER_PORT` the same way)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_env(request: Request, restart: int, master_port: int) -> dict[str, str]:
    """The environment torchrun's agent gives local rank 0 of a one-process launch, over the request's."""
    return {
        **request.env,
        "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "ROLE_RANK": "0", "ROLE_NAME": "default",
        "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RESTART_COUNT": str(restart),
        "TORCHELASTIC_MAX_RESTARTS": str(request.max_restarts),
        "TORCHELASTIC_RUN_ID": request.run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": request.env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }


def worker_path(cwd: str, env: dict[str, str], base: list[str]) -> list[str]:
    """`sys.path` of `python -m training.entrypoint` started in `cwd` with `env`: cwd, PYTHONPATH, the interpreter's own."""
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return [cwd, *extra, *(p for p in base if p not in extra and p != cwd)]


# The interpreter's own `sys.path` (site-packages, the standard library), without what the server's own working
# directory and PYTHONPATH added; set by `serve`.
BASE_PATH: list[str] = []


def run_worker(request: Request, env: dict[str, str], supervisor: int, out: int, close: list[int]) -> None:
    """In the forked worker: become `python -m <request.entry> --spec URI` as torchrun starts it; never returns."""
    code = EXIT_INFRA
    try:
        disown_server_exit_work()
        os.setsid()
        _die_with_parent(supervisor)
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
class Supervisor:
    """One launch in a process of its own: restarts, signal forwarding and the classified exit status.

    Attributes:
        conn: the launcher's connection; events go out on it, and its end means the launcher is gone.
        out: the launcher's output pipe.
        request: the launch.
    """

    conn: socket.socket
    out: int
    request: Request
    worker: Optional[int] = None
    last_worker: int = 0
    signalled: Optional[int] = None
    client_gone: bool = False
    started: float = field(default_factory=time.time)
    pending: bytes = b""
    pid: int = field(default_factory=os.getpid)

    def send(self, event: dict[str, Any]) -> None:
        try:
            self.conn.sendall((json.dumps(event) + "\n").encode())
        except OSError:
            self.client_gone = True

    def _forward(self, signum: int, frame: Any) -> None:
        self.signalled = signum
        if self.worker is not None:
            try:
                os.kill(self.worker, signum)
            except ProcessLookupError:
                pass

    def relay(self, data: bytes) -> None:
        """Write the worker's complete lines to the launch output, each prefixed like torchrun's --tee."""
        self.pending += data
        *lines, self.pending = self.pending.split(b"\n")
        if lines:
            self._write(b"".join(RANK_PREFIX.encode() + line + b"\n" for line in lines))

    def _write(self, data: bytes) -> None:
        try:
            _write_all(self.out, data)
        except BrokenPipeError:
            self.client_gone = True

    def run_once(self, restart: int) -> int:
        """Fork worker `restart`, relay its output until it ends; its status (negative: killed by that signal)."""
        env = worker_env(self.request, restart, free_port())
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            run_worker(self.request, env, supervisor=self.pid, out=write_end, close=[read_end, self.out, self.conn.fileno()])
        os.close(write_end)
        self.worker = self.last_worker = pid
        if self.signalled is not None:  # arrived while forking
            os.kill(pid, self.signalled)
        self.send({"event": "worker", "pid": pid, "restart": restart, "start_ticks": start_ticks(pid)})
        say(f"launch {self.request.env.get(LAUNCH_ID_ENV, '?')} (spec {self.request.spec_uri}): "
            f"worker pid {pid} started (restart {restart}) by supervisor pid {self.pid} of warm server pid {os.getppid()}", self.out)
        status = self._follow(pid, read_end)
        self.worker = None
        return status

    def _follow(self, pid: int, read_end: int) -> int:
        """Relay `read_end` while worker `pid` runs; stop it when the launcher goes; its exit status."""
        status: Optional[int] = None
        stop_sent: Optional[float] = None
        drain_until: Optional[float] = None
        watched = [read_end, self.conn.fileno()]
        # The worker's exit wakes the loop: its output ends a moment before it can be reaped, and waiting out the
        # poll interval then cost every launch 0.2 s.
        exited = _pidfd(pid)
        if exited is not None:
            watched.append(exited)
        while True:
            ready, _, _ = select.select(watched, [], [], 0.2)
            if read_end in ready:
                data = os.read(read_end, 65536)
                if data:
                    self.relay(data)
                else:
                    watched.remove(read_end)
            if self.conn.fileno() in ready and not self._client_alive():
                self.client_gone = True
                watched.remove(self.conn.fileno())
            if status is None:
                done, raw = os.waitpid(pid, os.WNOHANG)
                if done:
                    status = os.waitstatus_to_exitcode(raw)
                    drain_until = time.monotonic() + DRAIN_SECONDS
                    if exited is not None:
                        watched.remove(exited)
                        os.close(exited)
                        exited = None
                elif self.client_gone:
                    stop_sent = self._stop(pid, stop_sent)
            if status is not None and (read_end not in watched or time.monotonic() > (drain_until or 0)):
                break
        if self.pending:
            self.relay(b"\n")
        os.close(read_end)
        if exited is not None:
            os.close(exited)
        assert status is not None
        return status

    def _client_alive(self) -> bool:
        """False once the launcher's end of the connection is closed (it sends nothing after its request)."""
        try:
            return bool(self.conn.recv(4096))
        except OSError:
            return False

    def _stop(self, pid: int, since: Optional[float]) -> float:
        """SIGTERM worker `pid` once, SIGKILL its process group after the grace period; when SIGTERM went."""
        now = time.monotonic()
        try:
            if since is None:
                say(f"the launcher disconnected; stopping worker pid {pid}")
                os.kill(pid, signal.SIGTERM)
                return now
            if now - since > STOP_GRACE_SECONDS:
                os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return since if since is not None else now

    def run(self) -> int:
        """The whole launch; the classified status, also sent as the `exit` event."""
        previous = {s: signal.signal(s, self._forward) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            status = 0
            for restart in range(self.request.max_restarts + 1):
                status = self.run_once(restart)
                if status == 0 or self.signalled is not None or self.client_gone:
                    break
                if restart < self.request.max_restarts:
                    say(f"worker exited with status {status}; restarting it ({restart + 1} of {self.request.max_restarts})", self.out)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        return self.finish(status)

    def finish(self, status: int) -> int:
        """torchrun's failure summary for a failed worker, then `training.gang`'s verdict over this launch's records."""
        records: list[dict[str, Any]] = []
        if status != 0:
            self._write(failure_summary(status, self.last_worker).encode())
            try:
                records = launch_records(output_uri_of(self.request.spec_uri), self.request.env.get(LAUNCH_ID_ENV, ""), self.started)
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
    """Process `pid`'s start time in clock ticks since boot (`/proc/<pid>/stat` field 22): a pid plus this names one process."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


def failure_summary(status: int, pid: int) -> str:
    """The `ChildFailedError` block torchrun prints when its worker `pid` failed, for `resources.launcher.parse_worker_exits`."""
    if status < 0:
        try:
            cause = f"Signal {-status} ({signal.Signals(-status).name}) received by PID {pid}"
        except ValueError:
            cause = f"Signal {-status} received by PID {pid}"
    else:
        cause = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
    return (
        "[trainyard.warm] worker group failed:\n"
        "Failures:\n  <NO_OTHER_FAILURES>\n"
        "Root Cause (first observed failure):\n[0]:\n"
        f"  time      : {time.strftime('%Y-%m-%d_%H:%M:%S')}\n  host      : {socket.gethostname()}\n"
        f"  rank      : 0 (local_rank: 0)\n  exitcode  : {status} (pid: {pid})\n"
        f"  error_file: <N/A>\n  traceback : {cause}\n"
    )


def supervise(conn: socket.socket, server: int) -> None:
    """In the forked supervisor: read the request, run the launch, exit; never returns."""
    code = EXIT_INFRA
    try:
        _die_with_parent(server)
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, signal.SIG_DFL)
        try:
            request, out = receive_request(conn)
            if not os.path.isdir(request.cwd):
                os.close(out)
                raise ValueError(f"request field 'cwd' is not a directory: {request.cwd!r}")
        except (ValueError, OSError) as e:
            say(f"refused a launch: {e}")
            with_refusal = json.dumps({"event": "refused", "reason": str(e)}) + "\n"
            try:
                conn.sendall(with_refusal.encode())
            except OSError:
                pass
            return
        supervisor = Supervisor(conn, out, request)
        supervisor.send({"event": "supervisor", "pid": supervisor.pid, "server": server})
        code = supervisor.run()
    except BaseException:  # the supervisor must reach os._exit: it runs inside the server's stack
        traceback.print_exc()
    finally:
        sys.stderr.flush()
        os._exit(code)


def base_path() -> list[str]:
    """This interpreter's `sys.path` without the server's working directory and PYTHONPATH entries."""
    own = {p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    return [p for p in sys.path[1:] if p not in own]


def pid_file(socket_path: str) -> str:
    """Where the server at `socket_path` writes its pid: beside it, `.sock` replaced by `.pid`."""
    return socket_path.removesuffix(".sock") + ".pid"


@dataclass
class Server:
    """The accept loop: a supervisor per connection, children reaped, idle exit.

    Attributes:
        path: the socket's path; it appears (renamed into place) only once the server accepts.
        idle_seconds: exit after this long with no launch in flight.
    """

    path: str
    idle_seconds: float
    children: set[int] = field(default_factory=set)
    stop: list[int] = field(default_factory=list)

    def reap(self) -> None:
        while self.children:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                self.children.clear()
                return
            if pid == 0:
                return
            self.children.discard(pid)

    def serve(self) -> None:
        """Listen and fork supervisors until told to stop or idle."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        staging = f"{self.path}.{os.getpid()}.tmp"
        listener.bind(staging)
        os.chmod(staging, 0o600)
        listener.listen(64)
        os.rename(staging, self.path)  # atomically: a launcher that sees the path finds a server accepting
        inode = os.stat(self.path).st_ino
        with open(pid_file(self.path) + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(pid_file(self.path) + ".tmp", pid_file(self.path))
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, lambda signum, frame: self.stop.append(signum))
        closing = False
        idle_since = time.monotonic()
        try:
            while not self.stop:
                self.reap()
                if self.children:
                    idle_since = time.monotonic()
                elif closing:
                    break
                elif time.monotonic() - idle_since > self.idle_seconds:
                    # Unlinked first, so no launcher connects any more; those already queued are still served.
                    say(f"server pid {os.getpid()}: idle for {self.idle_seconds:g} s; exiting")
                    _unlink_if(self.path, inode)
                    closing = True
                ready, _, _ = select.select([listener], [], [], 0.1 if closing else 1.0)
                if ready:
                    self.accept(listener)
            if self.stop:
                say(f"server pid {os.getpid()}: {signal.Signals(self.stop[0]).name}; exiting")
        finally:
            _unlink_if(self.path, inode)
            with open(pid_file(self.path)) as f:
                ours = f.read().strip() == str(os.getpid())
            if ours:
                os.unlink(pid_file(self.path))
            listener.close()

    def accept(self, listener: socket.socket) -> None:
        conn, _ = listener.accept()
        server = os.getpid()
        pid = os.fork()
        if pid == 0:
            listener.close()
            supervise(conn, server)
        conn.close()
        self.children.add(pid)


def _unlink_if(path: str, inode: int) -> None:
    """Remove `path` if it is still the socket this server bound (a newer server may have replaced it)."""
    try:
        if os.stat(path).st_ino == inode:
            os.unlink(path)
    except FileNotFoundError:
        pass


def serve(path: str, idle_seconds: float) -> int:
    """Preload, then serve at `path`; the exit status (`EXIT_INFRA` when the server cannot start)."""
    started = time.monotonic()
    BASE_PATH[:] = base_path()
    try:
        loaded = preload()
    except (ImportError, RuntimeError) as e:
        say(f"server pid {os.getpid()} cannot serve: {e}")
        return EXIT_INFRA
    say(f"server pid {os.getpid()}: imported {', '.join(loaded)} in {time.monotonic() - started:.1f} s; listening on {path}")
    Server(path, idle_seconds).serve()
    return EXIT_OK


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.warm", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve_cmd = commands.add_parser("serve", help="preload the trial's modules and fork a worker per launch")
    serve_cmd.add_argument("--socket", required=True, help="unix socket path to listen on (created; must not be in use)")
    serve_cmd.add_argument("--idle-seconds", type=float, default=300.0, help="exit after this long without a launch (default 300)")
    args = parser.parse_args(argv)
    if args.idle_seconds <= 0:
        parser.error(f"--idle-seconds must be > 0, got {args.idle_seconds:g}")
    return serve(args.socket, args.idle_seconds)


if __name__ == "__main__":
    status = main()
    try:
        run_server_exit_work()  # its temporary directories; the workers leave them to it
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # Skips tearing down the preloaded modules, which the server never used: seconds of work on every stop.
        os._exit(status)
