"""`python -m training.warm serve --socket PATH`: a fork server that starts one-node trials without a cold start.

A trial launched through `training.gang` costs a cold interpreter for the
wrapper, one for torchrun's agent and one per worker, each worker importing
torch, Lightning, pandas ...: seconds before its first step and more than the
whole fit of a small trial. This server imports the heavy modules once, runs no
torch op and starts no thread (forking is safe only from a single-threaded
process), and listens on a unix socket. Each connection is one launch:

- the server forks a *supervisor* at once and goes back to listening; the
  supervisor dies with the server (`PR_SET_PDEATHSIG`);
- the supervisor reads the request (one JSON line: the environment, working
  directory, spec URI, number of processes, restart budget and run id) with the
  write end of the launcher's output pipe attached (`SCM_RIGHTS`), and runs the
  launch with the semantics of `training.gang` around torchrun on one node
  (`training.warm_supervisor`): each worker gets torchrun's environment for its
  rank, the first failure stops the group and the group starts again up to
  `max_restarts` times, SIGTERM and SIGINT are forwarded to the workers (a
  preemption still checkpoints), and the final status is
  `training.gang.classify` over this launch's failure records;
- each *worker* is a fork of the supervisor, so the supervisor is its parent
  as torchrun's agent is (fault drills signal `os.getppid()`, and only a
  parent can wait for a child's status); it takes its own session, dies with
  the supervisor, restores default signal handlers, replaces its environment,
  working directory and `sys.path` with the request's and runs
  `training.entrypoint.main` (or, for a request whose `entry` says so, the
  planner's `training.describe.main`: the capacity planner's model
  description, which needs the same imports). Team model code is imported
  only there, after the fork, so an edit to it is always picked up.

The workers' output reaches the launcher through the supervisor, each line
prefixed `[default<rank>]:` as torchrun's `--tee` does; the supervisor's own
lines are unprefixed, and a failed launch ends with torchrun's failure summary,
so `resources.launcher.LaunchOutput` and `outcome_error` read both paths alike.
Over the socket the supervisor reports JSON lines: `{"event": "supervisor"}`,
`{"event": "worker", "pid": ..., "rank": ...}` per worker start, `{"event":
"exit", "code": ...}` last. A launcher that disconnects stops the launch
(SIGTERM to the workers, then SIGKILL after a grace period). The server exits
after `--idle-seconds` with no launch in flight and removes its socket.

A server told to stop (SIGTERM, SIGINT) fails safe: it removes its socket (a
launch that comes now starts a new server), forwards SIGTERM to every
supervisor, which forwards it to its workers (each checkpoints, records a
preemption and exits `EXIT_PREEMPTED`, so the launch ends preempted and is
retried from that checkpoint), and waits for them up to `--stop-grace-seconds`
(30 s, as torchrun's agent waits for its workers) before it exits; what still
runs then dies with it. A supervisor signalled before its workers started
passes the signal on to them as they start. A server that dies without that
(SIGKILL, a crash) takes its supervisors and their workers with it
(`PR_SET_PDEATHSIG`): the launcher sees the connection end with no exit event,
an infrastructure failure, and the next launch finds the socket refusing and
starts a fresh server.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Optional

from training.spec import EXIT_INFRA, EXIT_OK
from training.warm_preload import preload, run_server_exit_work
from training.warm_protocol import receive_request
from training.warm_supervisor import BASE_PATH, SERVICE, Supervisor, die_with_parent, say
from training.warm_wandb import start_keeper

STOP_GRACE_SECONDS = 30.0  # a stopped server waits this long for its launches' workers to checkpoint and exit


def supervise(conn: socket.socket, server: int) -> None:
    """In the forked supervisor: read the request, run the launch, exit; never returns."""
    code = EXIT_INFRA
    early: list[int] = []  # a stop the server forwarded before the launch's own handlers were in place
    try:
        die_with_parent(server)
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, lambda signum, frame: early.append(signum))
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
        code = supervisor.run(early)
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
    stop_grace_seconds: float = STOP_GRACE_SECONDS
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
                _unlink_if(self.path, inode)  # a launch that comes now starts a new server
                listener.close()
                self.drain(signal.Signals(self.stop[0]).name)
        finally:
            _unlink_if(self.path, inode)
            with open(pid_file(self.path)) as f:
                ours = f.read().strip() == str(os.getpid())
            if ours:
                os.unlink(pid_file(self.path))
            listener.close()

    def drain(self, why: str) -> None:
        """Forward SIGTERM to every supervisor (each forwards it to its workers, which checkpoint) and wait for them.

        Returns after `stop_grace_seconds` at most; a supervisor still running then dies with this process.
        """
        self.reap()
        if not self.children:
            say(f"server pid {os.getpid()}: {why}; exiting")
            return
        say(
            f"server pid {os.getpid()}: {why}; forwarding SIGTERM to {len(self.children)} launch(es) in flight "
            f"(supervisor pid {', '.join(map(str, sorted(self.children)))}) and waiting up to "
            f"{self.stop_grace_seconds:g} s"
        )
        for pid in self.children:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + self.stop_grace_seconds
        while self.children and time.monotonic() < deadline:
            time.sleep(0.05)
            self.reap()
        left = f"; {len(self.children)} still running die with it" if self.children else ""
        say(f"server pid {os.getpid()}: exiting after its launches stopped{left}")

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


def serve(path: str, idle_seconds: float, stop_grace_seconds: float = STOP_GRACE_SECONDS) -> int:
    """Preload, then serve at `path`; the exit status (`EXIT_INFRA` when the server cannot start)."""
    started = time.monotonic()
    BASE_PATH[:] = base_path()
    try:
        loaded = preload()
    except (ImportError, RuntimeError) as e:
        say(f"server pid {os.getpid()} cannot serve: {e}")
        return EXIT_INFRA
    keeper, service = start_keeper()
    shared = f"W&B service {service} (keeper pid {keeper})" if SERVICE else f"no shared W&B service: {service}"
    say(
        f"server pid {os.getpid()}: imported {', '.join(loaded)} in {time.monotonic() - started:.1f} s; {shared}; "
        f"listening on {path}"
    )
    Server(path, idle_seconds, stop_grace_seconds).serve()
    return EXIT_OK


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.warm", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve_cmd = commands.add_parser("serve", help="preload the trial's modules and fork a worker per launch")
    serve_cmd.add_argument(
        "--socket", required=True, help="unix socket path to listen on (created; must not be in use)"
    )
    serve_cmd.add_argument(
        "--idle-seconds", type=float, default=300.0, help="exit after this long without a launch (default 300)"
    )
    serve_cmd.add_argument(
        "--stop-grace-seconds",
        type=float,
        default=STOP_GRACE_SECONDS,
        help=f"on SIGTERM, wait this long for the launches in flight to checkpoint (default {STOP_GRACE_SECONDS:g})",
    )
    args = parser.parse_args(argv)
    if args.idle_seconds <= 0:
        parser.error(f"--idle-seconds must be > 0, got {args.idle_seconds:g}")
    if args.stop_grace_seconds < 0:
        parser.error(f"--stop-grace-seconds must be >= 0, got {args.stop_grace_seconds:g}")
    return serve(args.socket, args.idle_seconds, args.stop_grace_seconds)


if __name__ == "__main__":
    status = main()
    try:
        run_server_exit_work()  # its temporary directories; the workers leave them to it
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # Skips tearing down the preloaded modules, which the server never used: seconds of work on every stop.
        os._exit(status)
