"""`python -m training.gang <torchrun args> -m training.entrypoint --spec URI`: torchrun with an exit-code contract.

torchrun (2.13) exits 1 whenever a worker fails, whatever the worker's own exit
status, so neither a Kubernetes podFailurePolicy nor a local launcher could tell
a bug in model code from a lost node by the status of the process they started.
This wrapper is the process they start instead, on this machine and as the
container command of every pod (`resources.launcher.torchrun_command` builds
both). It takes torchrun's arguments unchanged, runs torchrun's agent as a
child process (`python -m torch.distributed.run ...`), forwards SIGTERM and
SIGINT to it (a preemption still reaches every worker and checkpoints), and
when the agent ends exits with the classified status of the launch:

- `EXIT_OK` (0): torchrun succeeded.
- The status of the first failing worker of this launch, from the failure
  records the entrypoint writes under `<output_uri>/failures/` (`classify`):
  `EXIT_USER_ERROR` (1), `EXIT_BAD_CONFIG` (78), `EXIT_PREEMPTED` (143) or
  `EXIT_INFRA` (75).
- `EXIT_INFRA` when torchrun failed and no worker of this launch recorded a
  cause: a worker died without a word (SIGKILL, the kernel's OOM killer, its
  node lost; its peers then record only that they lost it), or the agent itself
  failed (no rendezvous, a peer node that never came). The process or node was
  lost; a new launch on fresh infrastructure may succeed.
- `EXIT_PREEMPTED` when this process was told to stop (SIGTERM, SIGINT) and no
  worker recorded another cause: stopped before a worker could say so.

The agent also watches its ranks for hangs and stragglers
(`training.watchdog.GangWatchdog`, with the spec's `checkpoint.watchdog`
policy): it names a local directory to its workers (`PROGRESS_DIR_ENV`),
where each rank keeps its progress record and dumps its stack on request,
and polls it while torchrun runs. A hung rank's stack is dumped, a failure
record names it (category `infra`, so a launch that runs out of restarts on a
hang exits `EXIT_INFRA`), and the workers are killed for torchrun to restart.
NCCL's asynchronous error handling is on (`TORCH_NCCL_ASYNC_ERROR_HANDLING=1`,
unless set): a collective past the process group's timeout, which is longer
than any hang timeout, aborts its process instead of blocking forever.

"This launch" is the records carrying this launch's id (`LAUNCH_ID_ENV`, set
here when the launcher did not) written since this process started (less
`CLOCK_SKEW_SECONDS` for the clocks of other nodes): a pod replaced under the
same Job name, which shares the id, does not read its predecessor's records.
The agent runs in its own process group, so a signal sent to this process's
group (a kubelet or a launcher stopping the pod) reaches the agent once,
through this process; on Linux the agent is killed if this process dies.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import fsspec

from common.settings import settings
from training.spec import (
    EXIT_BAD_CONFIG,
    EXIT_INFRA,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_USER_ERROR,
    FAILURE_DIR,
    LAUNCH_ID_ENV,
    PROGRESS_DIR_ENV,
    WatchdogPolicy,
)
from training.watchdog import POLL_SECONDS, GangWatchdog

EXIT_CODES = {"config": EXIT_BAD_CONFIG, "user": EXIT_USER_ERROR, "preempted": EXIT_PREEMPTED, "infra": EXIT_INFRA}
TERMINAL = ("config", "user")  # the entrypoint never trains again in a launch that recorded one of these
CLOCK_SKEW_SECONDS = 2.0  # how far another node's clock may lag this one's
FORWARDED = (signal.SIGTERM, signal.SIGINT)
PR_SET_PDEATHSIG = 1


def say(message: str) -> None:
    print(f"[trainyard.gang] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Verdict:
    """The status this process exits with and why, in one sentence."""

    code: int
    reason: str


def classify(records: Sequence[dict[str, Any]], returncode: int, signalled: Optional[int] = None) -> Verdict:
    """The exit status of a launch from torchrun's status and this launch's failure records.

    The first failing worker is the earliest record that is a cause, not a
    consequence (a rank that only lost a peer, or was stopped while blocked in
    a collective, records `consequence: true`). A config or user error outranks
    an earlier retryable cause: the launch ended on it, since a worker group
    restarted after it stops at once (`training.entrypoint.earlier_terminal_failure`).

    Args:
        records: the failure records of this launch (`launch_records`).
        returncode: torchrun's exit status (negative: killed by that signal).
        signalled: the signal this process received and forwarded, if any.
    """
    if returncode == 0:
        return Verdict(EXIT_OK, "torchrun succeeded")
    causes = [r for r in records if not r.get("consequence")]
    terminal = [r for r in causes if r.get("category") in TERMINAL]
    candidates = terminal or causes
    if candidates:
        first = min(candidates, key=lambda r: float(r.get("time", 0.0)))
        category = str(first.get("category"))
        code = EXIT_CODES.get(category, EXIT_INFRA)
        return Verdict(code, f"rank {first.get('rank')} failed first ({category}: {str(first.get('error', ''))[:300]})")
    if signalled is not None:
        return Verdict(
            EXIT_PREEMPTED, f"stopped by {signal.Signals(signalled).name} before any worker recorded a cause"
        )
    lost = f"; {len(records)} worker(s) recorded only that they lost a peer" if records else ""
    return Verdict(
        EXIT_INFRA,
        "no worker recorded a cause: a worker died without a word (SIGKILL, out of memory, a lost node) or the "
        f"rendezvous failed{lost}",
    )


def spec_uri_of(args: Sequence[str]) -> str:
    """The `--spec` URI that follows `-m training.entrypoint` in torchrun's arguments.

    Raises:
        ValueError: the arguments do not run `training.entrypoint` with `--spec`.
    """
    for i in range(1, len(args)):
        if args[i] == "training.entrypoint" and args[i - 1] == "-m":
            parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
            parser.add_argument("--spec")
            known, _ = parser.parse_known_args(list(args[i + 1:]))
            if known.spec:
                return str(known.spec)
            break
    raise ValueError(
        f"the arguments {list(args)} do not end in '-m training.entrypoint --spec URI'; accepted: torchrun's "
        "arguments for that command"
    )


def nodes_of(args: Sequence[str]) -> int:
    """The node count torchrun's `--nnodes` names (the larger bound of a range `min:max`; 1 when absent or
    unreadable)."""
    for i, a in enumerate(args):
        if a in ("-m", "--module"):
            break  # torchrun's own options end where the training module starts
        value = (
            a.split("=", 1)[1]
            if a.startswith("--nnodes=")
            else (args[i + 1] if a == "--nnodes" and i + 1 < len(args) else None)
        )
        if value is not None:
            try:
                return max(1, int(value.rsplit(":", 1)[-1]))
            except ValueError:
                return 1
    return 1


def output_uri_of(spec_uri: str) -> str:
    """Where the entrypoint writes its failure records: the spec's `output_uri`, else the spec file's directory (as it
    does)."""
    try:
        with fsspec.open(spec_uri, "r") as f:
            return str(json.load(f)["output_uri"])
    except (OSError, ValueError, KeyError, TypeError):
        return spec_uri.rsplit("/", 1)[0]


def watchdog_policy(spec_uri: str) -> WatchdogPolicy:
    """The spec's `checkpoint.watchdog` policy; the defaults when the spec cannot be read (the entrypoint then fails on
    it)."""
    try:
        with fsspec.open(spec_uri, "r") as f:
            return WatchdogPolicy.model_validate((json.load(f).get("checkpoint") or {}).get("watchdog") or {})
    except (OSError, ValueError, AttributeError) as e:
        say(f"cannot read the watchdog policy from {spec_uri} ({e}); using the defaults")
        return WatchdogPolicy()


def watch(watchdog: GangWatchdog, agent: "Agent", stop: threading.Event) -> None:
    """Poll `watchdog` every `POLL_SECONDS` until `stop`; not while the agent is being stopped (a preemption saves)."""
    while not stop.wait(POLL_SECONDS):
        if agent.signalled is not None:
            continue
        try:
            watchdog.poll()
        except Exception as e:  # the watch must never take the launch down with it
            say(f"watchdog poll failed ({type(e).__name__}: {e}); still watching")


def launch_records(output_uri: str, launch: str, since: float) -> list[dict[str, Any]]:
    """The failure records under `output_uri` of launch `launch` written at or after `since` (epoch seconds).

    A record that cannot be read (half written by a node still failing) is skipped with a message.
    """
    fs, path = fsspec.core.url_to_fs("/".join([output_uri.rstrip("/"), FAILURE_DIR]))
    if not fs.exists(path):
        return []
    records = []
    for p in sorted(fs.glob(f"{path}/rank-*.json")):
        try:
            with fs.open(p, "r") as f:
                record = json.load(f)
        except (OSError, ValueError) as e:
            say(f"skipping unreadable failure record {p}: {e}")
            continue
        if (
            isinstance(record, dict)
            and record.get("launch") == launch
            and float(record.get("time", 0.0)) >= since - CLOCK_SKEW_SECONDS
        ):
            records.append(record)
    return records


def _die_with_parent(parent: int) -> None:
    """In the agent before it starts: its own process group, and SIGKILL when `parent` (this process) dies (Linux)."""
    os.setpgid(0, 0)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # died before the request took effect
            os._exit(EXIT_INFRA)


class Agent:
    """torchrun's agent as a child process, with SIGTERM and SIGINT forwarded to it."""

    def __init__(self, args: Sequence[str], env: dict[str, str], on_start: Optional[Callable[[], None]] = None) -> None:
        self.args = [sys.executable, "-m", "torch.distributed.run", *args]
        self.env = env
        self.on_start = (
            on_start  # called once the agent runs (a thread started before the fork could hold a lock in it)
        )
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.signalled: Optional[int] = None

    def _forward(self, signum: int, frame: Any) -> None:
        self.signalled = signum
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)

    def run(self) -> int:
        """torchrun's exit status (negative: killed by that signal)."""
        previous = {s: signal.signal(s, self._forward) for s in FORWARDED}
        try:
            self.proc = subprocess.Popen(
                self.args, env=self.env, preexec_fn=functools.partial(_die_with_parent, os.getpid())
            )
            if self.signalled is not None:  # arrived while the agent was starting
                self.proc.send_signal(self.signalled)
            if self.on_start is not None:
                self.on_start()
            return self.proc.wait()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run torchrun with `argv` (default: this process's arguments); the status to exit with.

    The wrapper's own troubles never surface as 1 (a user error): a command
    without the entrypoint is `EXIT_BAD_CONFIG`, an agent that cannot start
    or records that cannot be read `EXIT_INFRA`.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    started = time.time()
    try:
        spec_uri = spec_uri_of(args)
    except ValueError as e:
        say(f"cannot launch: {e}")
        return EXIT_BAD_CONFIG
    env = dict(os.environ)
    launch = settings(env).launch_id
    if launch is None:  # started by hand: this launch gets an id of its own
        launch = env[LAUNCH_ID_ENV] = f"{time.time_ns():x}-{os.getpid()}"
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    progress_dir = env[PROGRESS_DIR_ENV] = tempfile.mkdtemp(prefix="trainyard-progress-")
    watchdog = GangWatchdog(
        progress_dir, watchdog_policy(spec_uri), output_uri_of(spec_uri), launch, say, nodes=nodes_of(args)
    )
    stop = threading.Event()
    agent = Agent(args, env, on_start=lambda: watcher.start())
    watcher = threading.Thread(target=watch, args=(watchdog, agent, stop), name="trainyard-watchdog", daemon=True)
    try:
        returncode = agent.run()
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        say(f"cannot start torchrun ({e}); exiting {EXIT_INFRA}")
        return EXIT_INFRA
    finally:
        stop.set()
        if watcher.is_alive():
            watcher.join(timeout=10)
        shutil.rmtree(progress_dir, ignore_errors=True)
    records: list[dict[str, Any]] = []
    if returncode != 0:
        try:
            records = launch_records(output_uri_of(spec_uri), launch, started)
        except (
            Exception
        ) as e:  # any failure here (store unreachable, credentials) must not exit 1, the user-error status
            say(f"cannot read the failure records ({type(e).__name__}: {e}); classifying without them")
    verdict = classify(records, returncode, agent.signalled)
    if returncode != 0:
        say(f"torchrun exited {returncode}; {verdict.reason}; exiting {verdict.code}")
    return verdict.code


if __name__ == "__main__":
    sys.exit(main())
