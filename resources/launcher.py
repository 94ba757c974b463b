"""Launchers: run `training.entrypoint` somewhere and bring back its result.

`LocalLauncher` (the embedded default) runs torchrun's elastic agent on this
machine with N CPU processes over gloo, through `training.gang`, which exits
with the classified status of the first failing worker. The command line comes from the pure
function `torchrun_command`, which the Kubernetes launcher shares, so a trial runs
the same program in both places. A trial's processes start on warm workers
instead (`resources.warm`, `training.warm`): forked from a server that has
imported torch already, with torchrun's environment per rank and the same
group restarts, signals, exit statuses and log format, and torchrun again
whenever no warm worker can take it.

Outcomes map to a small error hierarchy: `retryable` errors (lost workers,
preemption, infrastructure) may be retried by Dagster's RetryPolicy; terminal
ones (bad config, an exception in model code) fail at once with the failing
rank's traceback. A rank that died without a word (SIGKILL, out of memory) is
found in torchrun's failure summary and blamed first, with its own last log
lines; the peers that then lost it come after.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from contextvars import ContextVar
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import IO, Any, Callable, Iterator, Mapping, Optional, Sequence

import fsspec
from dagster import (
    AssetKey,
    AssetObservation,
    ConfigurableResource,
    PipesTempFileContextInjector,
    PipesTempFileMessageReader,
    open_pipes_session,
)
from pydantic import Field

from resources.launch_errors import (  # noqa: F401 (their home was here)
    InfrastructureError,
    LaunchError,
    TrainingCodeError,
    TrainingConfigError,
    TrainingPreempted,
    WorkerExit,
    _tail_text,
    outcome_error,
    parse_worker_exits,
    read_failures,
)
from resources.warm import WarmProcess, WarmUnavailable, launch_warm, prestart, training_env, warm_workers_enabled
from training.spec import FAILURE_DIR, LAUNCH_ID_ENV, RESULT_FILE, SPEC_FILE, TrainResult, TrainSpec
from trainyard.curves import epoch_point


def join(uri: str, *parts: str) -> str:
    """`uri` with `parts` appended, one '/' between each (works for local paths and URLs)."""
    return "/".join([uri.rstrip("/"), *parts])


def torchrun_command(
    spec: TrainSpec,
    spec_uri: str,
    *,
    python: str = "python",
    node_rank: Optional[str] = None,
    master_addr: Optional[str] = None,
    master_port: int = 29500,
    log_dir: Optional[str] = None,
) -> list[str]:
    """The command every node runs, locally and as a pod's container command: torchrun's agent around
    `training.entrypoint`.

    It runs `training.gang` with torchrun's arguments: the wrapper runs the
    agent and exits with the classified status of the first failing worker
    (`training.spec.EXIT_*`), where torchrun itself would exit 1. One node uses
    `--standalone` (a private rendezvous on a free port); several nodes use a
    static rendezvous at `master_addr:master_port` with the given node rank (on
    Kubernetes, `$(JOB_COMPLETION_INDEX)`).
    """
    dist = spec.distribution
    cmd = [python, "-m", "training.gang", f"--nnodes={dist.nodes}", f"--nproc-per-node={dist.procs_per_node}"]
    cmd.append(f"--max-restarts={dist.max_restarts}")
    if dist.nodes == 1 and master_addr is None:
        cmd.append("--standalone")
    else:
        if master_addr is None or node_rank is None:
            raise ValueError(f"a {dist.nodes}-node launch needs master_addr and node_rank")
        cmd += [f"--node-rank={node_rank}", f"--master-addr={master_addr}", f"--master-port={master_port}"]
    if log_dir is not None:
        cmd += [f"--log-dir={log_dir}", "--redirects=3", "--tee=3"]
    return [*cmd, "-m", "training.entrypoint", "--spec", spec_uri]


@dataclass
class LaunchOutcome:
    result: TrainResult
    log_uri: str
    seconds: float
    progress: list[dict[str, Any]] = field(default_factory=list)


def prepare_output(spec: TrainSpec, spec_uri: str) -> None:
    """Get `spec.output_uri` ready for a fresh launch: drop a stale result and failure records, write the spec.

    A result or failure record left by an earlier launch would otherwise be read
    as this launch's outcome.
    """
    fs, out = fsspec.core.url_to_fs(spec.output_uri)
    fs.makedirs(out, exist_ok=True)
    if fs.exists(f"{out}/{FAILURE_DIR}"):
        fs.rm(f"{out}/{FAILURE_DIR}", recursive=True)
    if fs.exists(f"{out}/{RESULT_FILE}"):
        fs.rm(f"{out}/{RESULT_FILE}")
    with fsspec.open(spec_uri, "w") as f:
        f.write(spec.to_json())


def read_result(output_uri: str) -> Optional[TrainResult]:
    """The `result.json` the entrypoint wrote under `output_uri`; None when there is none."""
    fs, path = fsspec.core.url_to_fs(join(output_uri, RESULT_FILE))
    if not fs.exists(path):
        return None
    with fs.open(path, "r") as f:
        return TrainResult.model_validate_json(f.read())


class ProgressRelay:
    """Emits each progress record of a running trial as an `AssetObservation` of the asset being materialized.

    Dagster plots the numeric metadata of an asset's observations over time
    (the asset page's Plots tab), so each epoch's metrics appear there while the
    trial still trains, on the trial's own partition. Records are read from the
    Pipes session's custom messages, which its reader thread appends as the pod
    writes them; `poll` emits those not yet emitted, from the calling thread,
    since a Dagster context is not meant to be used from other threads.

    Args:
        context: the asset's execution context; without one asset to observe
            (an op, a multi-asset) nothing is emitted.
        messages: the session's custom messages so far (`session.get_custom_messages`).
    """

    def __init__(self, context: Any, messages: Callable[[], Sequence[Any]]) -> None:
        self.context = context
        self.messages = messages
        self.asset_key = observed_asset(context)
        self.partition = context.partition_key if self.asset_key is not None and context.has_partition_key else None
        self.seen = 0
        self.emitted = 0

    def poll(self) -> None:
        """Emit an observation for each progress record that arrived since the last poll."""
        messages = self.messages()
        for message in messages[self.seen:]:
            point = epoch_point(message)
            if point is not None and self.asset_key is not None:
                self.context.log_event(
                    AssetObservation(asset_key=self.asset_key, partition=self.partition, metadata=point)
                )
                self.emitted += 1
        self.seen = len(messages)


def observed_asset(context: Any) -> Optional[AssetKey]:
    """The one asset `context` materializes; None for an op or a multi-asset."""
    if not context.has_assets_def or len(context.assets_def.keys) != 1:
        return None
    return context.asset_key


_POD_ENVIRONMENT: ContextVar[Mapping[str, str]] = ContextVar("trainyard_pod_environment", default=MappingProxyType({}))


@contextlib.contextmanager
def pod_environment(env: Mapping[str, str]) -> Iterator[None]:
    """Secrets the orchestrator holds, handed to the training processes launched inside this block.

    Credentials reach a training process by reference only: the spec names an
    environment variable (e.g. `OptunaSpec.storage_url_env`), and the value
    comes from the process's environment. `LocalLauncher` sets `env` in the
    environment of the processes it starts, so a credential configured on a
    resource (not in this process's environment) reaches them too; it is never
    written to a file or a log. On Kubernetes pods get them from the Secrets
    of the team's `env_from_secrets` instead, and this is ignored.
    """
    token = _POD_ENVIRONMENT.set(MappingProxyType({**_POD_ENVIRONMENT.get(), **env}))
    try:
        yield
    finally:
        _POD_ENVIRONMENT.reset(token)


class Launcher(ConfigurableResource):
    """Runs a `TrainSpec` to completion and returns its `TrainResult`."""

    def launch(self, spec: TrainSpec, context: Any = None) -> LaunchOutcome:
        raise NotImplementedError

    def prestart_warm(self) -> bool:
        """Get ready for trials that are coming (the `sweep` asset calls it); whether a start was begun. Nothing
        here."""
        return False


class LocalLauncher(Launcher):
    """torchrun on this machine: N CPU processes with gloo, logs captured; on warm workers where a server takes them.

    With a Dagster context the launch runs in a Pipes session: the pod's log
    lines reach the run log, and each epoch's metrics become an observation of
    the asset being materialized while the trial trains (`ProgressRelay`).

    Args:
        timeout_seconds: the whole launch is stopped (SIGTERM, then SIGKILL) past this.
        log_tail_lines: lines of output carried in error messages.
        progress_poll_seconds: how often new progress records are turned into observations.
        warm_workers: start a trial's processes on warm workers (`resources.warm`: a fork server that has
            imported torch and Lightning already) instead of torchrun; a `python` other than this
            interpreter, or `TRAINYARD_WARM_WORKERS=0`, uses torchrun.
        warm_idle_seconds: a warm server started by this launcher exits after this long without a launch.
        warm_start_timeout_seconds: how long a warm server may take to start before the trial runs cold.
        warm_multi_gpu: start a trial of several GPU ranks on warm workers too. Off: until a GPU run proves NCCL
            from ranks forked off one server (`bench/gpu_forked_nccl.py`, run by `bench/gpu_smoke.sh`), such
            trials start cold with torchrun; one-GPU and CPU trials start warm.
    """

    # `default=` by name: a type checker reads a Dagster resource's defaults from it (PEP 681), not from a positional
    # one.
    timeout_seconds: float = Field(default=3600.0, gt=0)
    log_tail_lines: int = Field(default=40, ge=1)
    python: str = Field(default_factory=lambda: sys.executable)
    progress_poll_seconds: float = Field(default=1.0, gt=0)
    warm_workers: bool = True
    warm_idle_seconds: float = Field(default=300.0, gt=0)
    warm_start_timeout_seconds: float = Field(default=180.0, gt=0)
    warm_multi_gpu: bool = False

    def launch(self, spec: TrainSpec, context: Any = None) -> LaunchOutcome:
        spec_uri = join(spec.output_uri, SPEC_FILE)
        prepare_output(spec, spec_uri)

        if context is None:
            return self._run(spec, spec_uri, extra_env={})
        relay: Optional[ProgressRelay] = None
        try:
            with open_pipes_session(
                context=context,
                context_injector=PipesTempFileContextInjector(),
                message_reader=PipesTempFileMessageReader(),
                extras={"trial_id": spec.trial_id},
            ) as session:
                relay = ProgressRelay(context, session.get_custom_messages)
                outcome = self._run(spec, spec_uri, extra_env=session.get_bootstrap_env_vars(), tick=relay.poll)
        finally:
            # Closing the session reads the records the pod wrote last, of a failed launch too.
            if relay is not None:
                relay.poll()
        outcome.progress = [m for m in session.get_custom_messages() if isinstance(m, dict)]
        return outcome

    def _run(
        self, spec: TrainSpec, spec_uri: str, extra_env: Mapping[str, str], tick: Callable[[], None] = lambda: None
    ) -> LaunchOutcome:
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="trainyard-launch-") as tmp:
            log_path = os.path.join(tmp, "launcher.log")
            env = {
                **training_env(os.environ),
                **_POD_ENVIRONMENT.get(),
                **extra_env,
                "PYTHONUNBUFFERED": "1",
                LAUNCH_ID_ENV: f"{time.time_ns():x}",
            }
            output = LaunchOutput(self.log_tail_lines)
            with open(log_path, "w", buffering=1) as log_file:  # line-buffered: a tail of the log follows the run
                proc, stream = self._start(spec, spec_uri, env, os.path.join(tmp, "ranks"), log_file, output)
                pump = threading.Thread(target=output.pump, args=(stream, log_file), daemon=True)
                pump.start()
                timed_out = False
                try:
                    returncode = wait_ticking(proc, self.timeout_seconds, tick, self.progress_poll_seconds)
                except subprocess.TimeoutExpired:
                    timed_out = True
                    _stop(proc)
                    returncode = proc.wait()
                finally:
                    if proc.poll() is None:
                        _stop(proc)
                    if isinstance(proc, WarmProcess) and proc.lost is not None:
                        proc.kill_workers()  # they die with their supervisor; this makes sure before reporting
                # The launch has exited; its pipe ends once the last buffered lines are read.
                pump.join(timeout=10)
                stream.close()
            log_uri = join(spec.output_uri, "logs", "launcher.log")
            fs, path = fsspec.core.url_to_fs(log_uri)
            fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            fs.put_file(log_path, path)
        seconds = time.monotonic() - started
        log_tail = "\n".join(output.tail)
        if timed_out:
            raise InfrastructureError(
                f"trial {spec.trial_id}: no result after {self.timeout_seconds:.0f} s; "
                f"stopped.\n{_tail_text(list(output.tail), None)}",
                log_tail=log_tail,
            )
        if isinstance(proc, WarmProcess) and proc.lost is not None:
            raise InfrastructureError(
                f"trial {spec.trial_id}: {proc.lost}; its worker was stopped (a lost node, for the retry policy)\n"
                f"{_tail_text(list(output.tail), None)}",
                log_tail=log_tail,
            )
        result = read_result(spec.output_uri) if returncode == 0 else None
        if result is not None:
            return LaunchOutcome(result=result, log_uri=log_uri, seconds=seconds)
        raise outcome_error(
            returncode, read_failures(spec.output_uri), log_tail, spec.trial_id,
            torchrun_output="\n".join(output.agent), rank_tails={r: list(t) for r, t in output.ranks.items()},
        )

    def prestart_warm(self) -> bool:
        """Start this launcher's warm server in the background when trials are coming (`resources.warm.prestart`).

        The planner describes every trial's model on it and one-process trials
        train on it, so the first trial no longer waits for its imports. Returns
        whether a start was begun (False: warm workers are off, a server already
        listens, or this launcher runs another interpreter, which it would not use).
        """
        if not self.warm_workers or not same_interpreter(self.python, sys.executable):
            return False
        return prestart(training_env(os.environ), python=sys.executable, idle_seconds=self.warm_idle_seconds,
                        start_timeout=self.warm_start_timeout_seconds)

    def _warm(self, spec: TrainSpec) -> bool:
        """Whether `spec` runs on warm workers: one node, warm workers on (field and environment), this interpreter, and
        not several GPU ranks unless `warm_multi_gpu` (NCCL from forked ranks has not run on a GPU yet:
        `bench.gpu_forked_nccl`)."""
        d = spec.distribution
        return (
            self.warm_workers
            and warm_workers_enabled(os.environ)
            and d.nodes == 1
            and (d.accelerator != "gpu" or d.procs_per_node == 1 or self.warm_multi_gpu)
            and same_interpreter(
                self.python, sys.executable
            )  # a server is keyed on, and runs, this process's interpreter
        )

    def _start(
        self, spec: TrainSpec, spec_uri: str, env: dict[str, str], ranks_dir: str, log_file: Any, output: LaunchOutput
    ) -> tuple[subprocess.Popen | WarmProcess, IO[str]]:
        """Start the launch, warm when `_warm` allows and a server takes it, else torchrun; (process, its output
        stream).

        A warm start that fails before the worker started leaves one warning line in the launch output and falls
        back to torchrun.
        """
        if self._warm(spec):
            read_end, write_end = os.pipe()
            try:
                proc = launch_warm(
                    env,
                    spec_uri,
                    spec.distribution.max_restarts,
                    write_end,
                    nprocs=spec.distribution.procs_per_node,
                    python=self.python,
                    idle_seconds=self.warm_idle_seconds,
                    start_timeout=self.warm_start_timeout_seconds,
                )
            except WarmUnavailable as e:
                os.close(read_end)
                line = (
                    "[trainyard.launcher] WARNING: warm workers unavailable, starting this trial cold with torchrun: "
                    f"{e}\n"
                )
                log_file.write(line)
                output.add(line)
            else:
                return proc, open(read_end, errors="replace")
            finally:
                os.close(write_end)  # the supervisor holds its own copy; the pipe ends when it exits
        cmd = torchrun_command(spec, spec_uri, python=self.python, log_dir=ranks_dir)
        popen = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        assert popen.stdout is not None
        return popen, popen.stdout


# torchrun's --tee prefixes each worker line with "[<role><local rank>]:"; a local launch
# is one node, so the local rank is the rank.
_RANK_PREFIX = re.compile(r"^\[[A-Za-z_]\w*?(\d+)\]:(.*)$")


class LaunchOutput:
    """What a local launch printed, kept for error messages while it is written to the log file.

    Attributes:
        tail: the last lines of the whole output.
        ranks: each rank's own last lines (prefix removed), by rank.
        agent: torchrun's own last lines, where its failure summary is.
    """

    AGENT_LINES = 400  # a failure summary with a traceback per failed rank fits

    def __init__(self, lines: int) -> None:
        self.lines = lines
        self.tail: deque[str] = deque(maxlen=lines)
        self.ranks: dict[int, deque[str]] = {}
        self.agent: deque[str] = deque(maxlen=self.AGENT_LINES)

    def add(self, line: str) -> None:
        line = line.rstrip("\n")
        self.tail.append(line)
        m = _RANK_PREFIX.match(line)
        if m is None:
            self.agent.append(line)
        else:
            self.ranks.setdefault(int(m.group(1)), deque(maxlen=self.lines)).append(m.group(2))

    def pump(self, stream: Any, log_file: Any) -> None:
        """Copy `stream` to `log_file` line by line, keeping the tails."""
        for line in stream:
            log_file.write(line)
            self.add(line)


def same_interpreter(a: str, b: str) -> bool:
    """Whether `a` and `b` name one interpreter of one environment: `.venv/bin/python` and `.venv/bin/python3` do.

    The launcher's `python` is set where the resource is built (a code server)
    and compared in the run worker, whose `sys.executable` may be another name
    of the same interpreter; the same binary in another virtualenv's `bin` is
    another environment.
    """
    if a == b:
        return True
    da, db = os.path.dirname(os.path.abspath(a)), os.path.dirname(os.path.abspath(b))
    return da == db and os.path.realpath(a) == os.path.realpath(b)


def wait_ticking(proc: subprocess.Popen | WarmProcess, timeout: float, tick: Callable[[], None], every: float) -> int:
    """`proc.wait(timeout)`, calling `tick` about every `every` seconds while the process runs.

    Raises:
        subprocess.TimeoutExpired: the process still runs after `timeout` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        tick()
        left = deadline - time.monotonic()
        if left <= 0:
            raise subprocess.TimeoutExpired(proc.args, timeout)
        try:
            return proc.wait(timeout=min(every, left))
        except subprocess.TimeoutExpired:
            continue


def _stop(proc: subprocess.Popen | WarmProcess, grace: float = 30.0) -> None:
    """SIGTERM the launch (`training.gang` or a warm supervisor forwards it to the workers), then SIGKILL what is
    left."""
    if isinstance(proc, WarmProcess):
        proc.stop(grace)
        return
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
