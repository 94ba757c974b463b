"""Hung and slow ranks: each rank's step progress, and the agent's watch over it (docs/operations.md, "Hung and slow
ranks").

Two halves, one per side of torchrun:

- In every worker, `training.callbacks.ProgressRecorder` keeps the rank's
  progress in a small memory-mapped file, `<dir>/rank-<r>.progress`, where
  `dir` is what `training.gang` names in `PROGRESS_DIR_ENV`: which step and
  which part of it (data and forward, backward, optimizer, validation), when
  it last moved, and cumulative step and "local" times. An update is a store
  into shared memory (about a microsecond, no system call), so every hook
  writes it and the record always holds the last place the rank reached,
  which is what names a hung rank: a rank blocked before a collective is
  behind the ranks blocked inside it. `arm_stack_dump` (called by the
  entrypoint) makes SIGUSR1 write every thread's Python stack to
  `<dir>/rank-<r>.stack` (`faulthandler`, which dumps from the signal handler,
  so a rank blocked in C code still answers).
- In the agent, `GangWatchdog.poll` (every `POLL_SECONDS`) reads the records.
  A rank silent for longer than its timeout (`WatchdogPolicy.hang_timeout` of
  its recent mean step time) means the gang is hung: the agent dumps the stacks
  of its ranks, names the rank furthest behind (`culprit`), writes a failure
  record (`<output>/failures/rank-<r>-hang-<ms>.json`, category `infra`) and a
  watchdog event (`<output>/watchdog/`) naming the rank, pod, node and the
  innermost frames, marks the attempt's record hung, and SIGKILLs the workers
  (each leads its own session under torchrun), so torchrun restarts the group
  from the newest committed checkpoint, or, out of restarts, fails and the agent
  exits `EXIT_INFRA`. Stragglers (`stragglers`) are compared by their local
  time, data loading plus forward: the part of a step in which a DDP rank does
  not wait for the others (every rank's whole step lasts as long as the
  slowest's, since they meet in the gradient all-reduce). A straggler is
  reported once, and again when it clears, as a watchdog event with its node.
  In a gang of several nodes an agent sees only its own ranks, so the ranks
  share their window means in an all-gather and rank 0 writes them with every
  rank's pod and node to `<dir>/gang.json` (`write_gang_window`): the agent of
  node 0 judges the whole gang from it, and the other nodes' agents judge no
  stragglers (each rank is judged once, against every other rank).

Stdlib and fsspec only: the agent imports this module without torch.
"""

from __future__ import annotations

import faulthandler
import json
import mmap
import os
import re
import signal
import socket
import statistics
import struct
import time
from collections import deque
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Optional

import fsspec

from common.atomic import atomic_write_bytes
from common.settings import settings
from training.spec import ATTEMPTS_DIR, FAILURE_DIR, WATCHDOG_DIR, WatchdogPolicy
from training.storage import join, write_atomic

POLL_SECONDS = 0.5
STACK_SIGNAL = signal.SIGUSR1
STACK_WAIT_SECONDS = 3.0  # how long the agent waits for the stacks it asked for
INNERMOST_FRAMES = 6  # frames of the hung rank's stack carried in the record and the run log
STRAGGLER_MIN_SHARE = 0.05  # a straggler's excess local time is at least this share of a step
# Where a rank is, in order within one global step (the count of optimizer steps done): a step's end, then
# validation, the next batch's data and forward, backward (DDP's gradient all-reduce), the optimizer step. At the
# same global step, a rank in an earlier phase than another has not reached the collective the other waits in.
PHASES = ("starting", "step end, loading data", "validation", "forward", "backward", "optimizer", "done")
STARTING, STEP_END, VALIDATION, FORWARD, BACKWARD, OPTIMIZER, DONE = range(len(PHASES))

# pid, restart, global_step, phase, steps (batches done), timed_steps (in sum_step), progress_time, sum_step, sum_local,
# started
_FORMAT = struct.Struct("<6q4d")


def pod_name() -> str:
    """The pod (Kubernetes sets HOSTNAME to the pod's name), else this host's name."""
    return os.environ.get("HOSTNAME") or socket.gethostname()


def node_name() -> str:
    """The node: `NODE_NAME` (the pod manifest's downward API), else this host's name."""
    return os.environ.get("NODE_NAME") or socket.gethostname()


@dataclass(frozen=True)
class Progress:
    """One rank's progress record as the agent reads it."""

    rank: int
    pid: int
    restart: int
    global_step: int
    phase: int
    steps: int
    timed_steps: int
    progress_time: float
    sum_step: float
    sum_local: float
    started: float

    @property
    def position(self) -> tuple[int, int]:
        """How far the rank got: (global step, phase); the lowest is furthest behind."""
        return self.global_step, self.phase

    def where(self) -> str:
        return f"step {self.global_step} ({PHASES[self.phase] if 0 <= self.phase < len(PHASES) else self.phase})"


def read_progress(path: str, rank: int) -> Optional[Progress]:
    """The record at `path`; None when it is missing or not yet written whole."""
    try:
        with open(path, "rb") as f:
            data = f.read(_FORMAT.size)
    except OSError:
        return None
    if len(data) != _FORMAT.size:
        return None
    values = _FORMAT.unpack(data)
    if values[0] <= 0:
        return None
    return Progress(rank, *values)


# -- rules (pure) --------------------------------------------------------------------------------------------------


def culprit(stalled: dict[int, Progress]) -> int:
    """The rank to blame for a hang: the one furthest behind (step, then phase), then the one silent longest."""
    return min(stalled, key=lambda r: (stalled[r].position, stalled[r].progress_time, r))


def stragglers(local_means: dict[int, float], step_seconds: float, factor: float) -> dict[int, float]:
    """Ranks whose mean local time exceeds `factor` x the median of the other ranks' (by at least
    `STRAGGLER_MIN_SHARE` of `step_seconds`), each with that median.

    Example:
        >>> stragglers({0: 0.010, 1: 0.011, 2: 0.300}, step_seconds=0.31, factor=1.5)
        {2: 0.0105}
    """
    slow: dict[int, float] = {}
    for rank, mean in local_means.items():
        others = [m for r, m in local_means.items() if r != rank]
        if not others:
            continue
        median = statistics.median(others)
        if mean > factor * median and mean - median >= STRAGGLER_MIN_SHARE * step_seconds:
            slow[rank] = median
    return slow


_MAIN_FRAMES = ("<module>", "_run_module_as_main")
_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+", re.MULTILINE)


def innermost_frames(dump: str, n: int = INNERMOST_FRAMES) -> list[str]:
    """The `n` innermost frames of the main thread in a `faulthandler` dump (most recent call first), as
    "file:line in function"; the main thread is the one that runs a module (`python -m`, a script)."""
    starts = [m.start() for m in _THREAD.finditer(dump)]
    blocks = [dump[a:b] for a, b in zip(starts, starts[1:] + [len(dump)])] or [dump]
    frames_of = [re.findall(r'File "([^"]+)", line (\d+) in (\S+)', b) for b in blocks]
    main = next(
        (f for f in frames_of if any(fn in _MAIN_FRAMES for _, _, fn in f)), next((f for f in frames_of if f), [])
    )
    return [f"{path}:{line} in {fn}" for path, line, fn in main[:n]]


# -- the worker's side ---------------------------------------------------------------------------------------------

_STACK_FILE: Optional[IO[str]] = None  # kept open for faulthandler


def arm_stack_dump(directory: Optional[str] = None, rank: Optional[int] = None) -> Optional[str]:
    """Make `STACK_SIGNAL` dump every thread's stack to `<directory>/rank-<rank>.stack` (default: `PROGRESS_DIR_ENV`
    and `RANK`); the file's path, or None when no agent named a directory."""
    global _STACK_FILE
    directory = directory or settings().progress_dir
    if not directory:
        return None
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    path = os.path.join(directory, f"rank-{rank}.stack")
    _STACK_FILE = open(path, "w")  # open for the life of the process
    faulthandler.register(STACK_SIGNAL, file=_STACK_FILE, all_threads=True, chain=False)
    return path


class ProgressRecord:
    """A rank's progress record in a memory-mapped file (written by `training.callbacks.ProgressRecorder`).

    `values` follow the record's layout; `write` copies them into the mapping.
    """

    PID, RESTART, GLOBAL_STEP, PHASE, STEPS, TIMED_STEPS, PROGRESS_TIME, SUM_STEP, SUM_LOCAL, STARTED = range(10)

    def __init__(self, directory: str, rank: int) -> None:
        path = os.path.join(directory, f"rank-{rank}.progress")
        with open(path + ".tmp", "wb") as f:
            f.write(b"\0" * _FORMAT.size)
        os.replace(path + ".tmp", path)  # the agent never reads a file shorter than a record
        self._file = open(path, "r+b")  # open for the life of the record
        self._map = mmap.mmap(self._file.fileno(), _FORMAT.size)
        now = time.time()
        self.values: list[Any] = [
            os.getpid(),
            int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            0,
            STARTING,
            0,
            0,
            now,
            0.0,
            0.0,
            now,
        ]
        self.write()

    def write(self) -> None:
        _FORMAT.pack_into(self._map, 0, *self.values)

    def set(self, phase: int, now: float) -> None:
        self.values[self.PHASE], self.values[self.PROGRESS_TIME] = phase, now
        self.write()


GANG_FILE = "gang.json"  # rank 0's copy of the gang-wide window in a gang of several nodes


def write_gang_window(directory: str, window: dict[str, Any]) -> None:
    """Write the gang's last window (every rank's mean local and step seconds, pod and node) for the agent; atomic."""
    atomic_write_bytes(os.path.join(directory, GANG_FILE), json.dumps(window).encode(), fsync=False)


def read_gang_window(directory: str) -> Optional[dict[str, Any]]:
    """The last window rank 0 wrote, or None."""
    try:
        with open(os.path.join(directory, GANG_FILE)) as f:
            window = json.load(f)
    except (OSError, ValueError):
        return None
    return window if isinstance(window, dict) and isinstance(window.get("ranks"), list) else None


# -- the agent's side ----------------------------------------------------------------------------------------------


@dataclass
class _Rank:
    """What the agent keeps of one rank: its samples (steps, timed steps, sum_step, sum_local, steps in sum_local) for
    window means."""

    pid: int
    samples: deque[tuple[int, int, float, float, int]] = field(default_factory=lambda: deque(maxlen=4096))
    straggling: bool = False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class GangWatchdog:
    """The agent's watch over its ranks' progress (see the module docstring).

    Args:
        directory: the progress directory the agent named to its workers.
        policy: the trial's `WatchdogPolicy`.
        output_uri: the trial directory (failure records, watchdog events, attempt records).
        launch: this launch's id (the failure records carry it).
        say: where the agent's messages go (its stderr, which the pod's log keeps).
        clock, kill: injected for tests; `time.time` and `os.kill`.
        nodes: the gang's node count; above 1, stragglers are judged from rank 0's gang-wide window.
    """

    def __init__(
        self,
        directory: str,
        policy: WatchdogPolicy,
        output_uri: str,
        launch: str,
        say: Callable[[str], None],
        clock: Callable[[], float] = time.time,
        kill: Callable[[int, int], None] = os.kill,
        nodes: int = 1,
    ) -> None:
        self.directory = directory
        self.nodes = nodes
        self._gang_seen: Optional[tuple[Any, Any]] = None  # (restart, steps) of the gang window last judged
        self._gang_straggling: set[int] = set()
        self.policy = policy
        self.output_uri = output_uri
        self.launch = launch
        self.say = say
        self.clock = clock
        self.kill = kill
        self.ranks: dict[int, _Rank] = {}
        self.hangs: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []

    def _watched(self) -> dict[int, Progress]:
        """This group's live ranks that are not done."""
        found: dict[int, Progress] = {}
        for name in os.listdir(self.directory):
            m = re.fullmatch(r"rank-(\d+)\.progress", name)
            if m is None:
                continue
            p = read_progress(os.path.join(self.directory, name), int(m.group(1)))
            if p is None or p.phase == DONE or not _alive(p.pid):
                continue
            found[p.rank] = p
        return found

    def _window(self, p: Progress) -> tuple[Optional[float], Optional[float]]:
        """(mean step seconds, mean local seconds) over at least `straggler_window_steps` recent steps; None: too
        few."""
        state = self.ranks.get(p.rank)
        if state is None or state.pid != p.pid:
            state = self.ranks[p.rank] = _Rank(p.pid)
        # Between a step's backward and its end the record holds that step's local time but not yet its count.
        local_steps = p.steps + (1 if p.phase in (BACKWARD, OPTIMIZER) else 0)
        state.samples.append((p.steps, p.timed_steps, p.sum_step, p.sum_local, local_steps))
        n = self.policy.straggler_window_steps
        old = next((s for s in reversed(state.samples) if s[0] <= p.steps - n), None)
        if old is None or local_steps <= old[4]:
            return (p.sum_step / p.timed_steps if p.timed_steps else None), None
        timed = p.timed_steps - old[1]
        step = (p.sum_step - old[2]) / timed if timed > 0 else (p.sum_step / p.timed_steps if p.timed_steps else None)
        return step, (p.sum_local - old[3]) / (local_steps - old[4])

    def poll(self) -> Optional[dict[str, Any]]:
        """Check every rank once: report stragglers, act on a hang; the hang's record when it acted."""
        if not self.policy.enabled:
            return None
        now = self.clock()
        ranks = self._watched()
        means = {r: self._window(p) for r, p in ranks.items()}
        stalled = {}
        for r, p in ranks.items():
            mean = means[r][0]
            limit = self.policy.hang_timeout(
                (mean if mean is not None else 0.0) if p.steps else None
            )  # one step done: the floor
            if limit is not None and now - p.progress_time > limit:
                stalled[r] = limit
        if stalled:
            return self._hang(ranks, stalled, now)
        if self.nodes > 1:
            self._gang_stragglers(ranks)
        else:
            self._stragglers(ranks, means)
        return None

    def _gang_stragglers(self, ranks: dict[int, Progress]) -> None:
        """Stragglers of a gang of several nodes, from the window rank 0 wrote (only node 0's agent has one)."""
        window = read_gang_window(self.directory)
        if window is None or 0 not in ranks or (window.get("restart"), window.get("steps")) == self._gang_seen:
            return
        self._gang_seen = (window.get("restart"), window.get("steps"))
        rows = {r: row for r, row in enumerate(window["ranks"]) if isinstance(row, dict)}
        local = {r: float(row["local"]) for r, row in rows.items()}
        step = statistics.median(float(row["step"]) for row in rows.values())
        slow = stragglers(local, step, self.policy.straggler_factor)
        n = window.get("window", self.policy.straggler_window_steps)
        for r, row in rows.items():
            if (r in slow) == (r in self._gang_straggling):
                continue
            (self._gang_straggling.add if r in slow else self._gang_straggling.discard)(r)
            message = self._straggler_message(
                f"rank {r} on pod {row.get('pod')} (node {row.get('node')})", local[r], slow.get(r), step, f"gang's {n}"
            )
            self._event(
                "straggler" if r in slow else "straggler_cleared",
                r,
                ranks[0],
                message,
                pod=row.get("pod"),
                node=row.get("node"),
                step=window.get("global_step"),
                local_seconds=local[r],
                step_seconds=step,
                others_median_seconds=slow.get(r),
                factor=self.policy.straggler_factor,
            )

    def _stragglers(
        self, ranks: dict[int, Progress], means: dict[int, tuple[Optional[float], Optional[float]]]
    ) -> None:
        local = {r: m[1] for r, m in means.items() if m[1] is not None}
        steps = [m[0] for r, m in means.items() if r in local and m[0] is not None]
        if len(local) < 2 or not steps:
            return
        step = statistics.median(steps)
        slow = stragglers(local, step, self.policy.straggler_factor)
        for r in local:
            state = self.ranks[r]
            if (r in slow) == state.straggling:
                continue
            state.straggling = r in slow
            kind = "straggler" if r in slow else "straggler_cleared"
            message = self._straggler_message(
                f"rank {r} on pod {pod_name()} (node {node_name()})",
                local[r],
                slow.get(r),
                step,
                f"{self.policy.straggler_window_steps}+",
            )
            self._event(kind, r, ranks[r], message, local_seconds=local[r], step_seconds=step,
                        others_median_seconds=slow.get(r), factor=self.policy.straggler_factor)

    def _straggler_message(self, where: str, local: float, median: Optional[float], step: float, window: str) -> str:
        """What the run log says when a rank becomes a straggler (`median`: the others' median) or stops being one
        (None)."""
        if median is None:
            return f"{where} is no longer a straggler (data+forward {local:.3f} s a step)"
        return (
            f"{where} is a straggler: data+forward {local:.3f} s a step over the last {window} steps, "
            f"{local / median:.1f}x the other "
            f"ranks' median {median:.3f} s (threshold {self.policy.straggler_factor:g}x); every step waits for it "
            f"(step {step:.3f} s)"
        )

    def _hang(self, ranks: dict[int, Progress], stalled: dict[int, float], now: float) -> dict[str, Any]:
        blamed = culprit(ranks)
        p = ranks[blamed]
        detected = self.clock()
        stacks = self._dump_stacks(ranks)
        dumped = self.clock()
        frames = innermost_frames(stacks.get(blamed, ""))
        silent = now - p.progress_time
        limit = stalled.get(blamed, min(stalled.values()))
        others = ", ".join(f"rank {r} at {q.where()}" for r, q in sorted(ranks.items()) if r != blamed)
        # Every rank of this pod in the same collective: none is behind, the one they wait for may be on another node.
        alike = len({q.position for q in ranks.values()}) == 1 and p.phase in (BACKWARD, OPTIMIZER)
        message = (
            f"rank {blamed} on pod {pod_name()} (node {node_name()}) hung at {p.where()}: no progress for "
            f"{silent:.1f} s "
            f"(timeout {limit:.1f} s); stuck in "
            + (" <- ".join(frames) if frames else "(no stack dumped)")
            + (f"; the others waited: {others}" if others else "")
            + (
                "; every rank of this pod waits in the same collective: the rank they wait for may be on another node"
                if alike
                else ""
            )
        )
        for q in ranks.values():
            self._kill_worker(q.pid)
        killed = self.clock()
        record = {
            "rank": blamed,
            "launch": self.launch,
            "time": now,
            "category": "infra",
            "consequence": alike,
            "kind": "hang",
            "error": f"Hang: {message}",
            "traceback": stacks.get(blamed, ""),
            "pod": pod_name(),
            "node": node_name(),
            "stack": frames,
            "step": p.global_step,
            "phase": PHASES[p.phase],
            "restart": p.restart,
            "silent_seconds": silent,
            "timeout_seconds": limit,
            "positions": {str(r): q.where() for r, q in ranks.items()},
            "stacks": {str(r): innermost_frames(s) for r, s in stacks.items()},
            "seconds": {"stack_dump": dumped - detected, "kill": killed - dumped},
        }
        write_atomic(join(self.output_uri, FAILURE_DIR, f"rank-{blamed}-hang-{int(now * 1000)}.json"),
                     json.dumps(record, indent=2).encode(), fsync=False)
        self._event("hang", blamed, p, message, stack=frames, positions=record["positions"], timeout_seconds=limit,
                    silent_seconds=silent, seconds=record["seconds"])
        self._mark_attempt(p.restart, f"hung: {message}")
        for name in [f"rank-{r}.progress" for r in ranks] + [GANG_FILE]:
            try:
                os.remove(os.path.join(self.directory, name))
            except OSError:
                pass
        self._gang_straggling.clear()
        self.ranks.clear()
        self.hangs.append(record)
        return record

    def _dump_stacks(self, ranks: dict[int, Progress]) -> dict[int, str]:
        """Every rank's stack dump, asked for with `STACK_SIGNAL` and read once it stopped growing (up to
        `STACK_WAIT_SECONDS`)."""
        paths = {r: os.path.join(self.directory, f"rank-{r}.stack") for r in ranks}
        before = {r: os.path.getsize(p) if os.path.exists(p) else 0 for r, p in paths.items()}
        for p in ranks.values():
            try:
                self.kill(p.pid, STACK_SIGNAL)
            except OSError:
                pass
        deadline = time.monotonic() + STACK_WAIT_SECONDS
        sizes: dict[int, int] = {}
        while time.monotonic() < deadline:
            time.sleep(0.1)
            now_sizes = {r: os.path.getsize(p) if os.path.exists(p) else 0 for r, p in paths.items()}
            if all(now_sizes[r] > before[r] for r in paths) and now_sizes == sizes:
                break
            sizes = now_sizes
        stacks = {}
        for r, path in paths.items():
            try:
                with open(path, errors="replace") as f:
                    f.seek(before[r])
                    stacks[r] = f.read()
            except OSError:
                stacks[r] = ""
        return stacks

    def _kill_worker(self, pid: int) -> None:
        """SIGKILL a worker and what it started: torchrun starts each in a session of its own."""
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                self.kill(pid, signal.SIGKILL)
        except OSError:
            pass

    def _event(self, kind: str, rank: int, p: Progress, message: str, **extra: Any) -> None:
        """Say `message` and write the event; `p` is the reporting rank's record (its restart; its step, pod and node
        unless `extra` names the rank's own)."""
        self.say(message)
        event = {"kind": kind, "time": self.clock(), "launch": self.launch, "restart": p.restart, "rank": rank,
                 "pod": pod_name(), "node": node_name(), "step": p.global_step, "message": message, **extra}
        self.events.append(event)
        try:
            write_atomic(join(self.output_uri, WATCHDOG_DIR, f"{time.time_ns()}-{kind}-rank-{rank}.json"),
                         json.dumps(event, indent=2).encode(), fsync=False)
        except OSError as e:  # the report matters less than the watch
            self.say(f"cannot write the watchdog event ({e})")

    def _mark_attempt(self, restart: int, status: str) -> None:
        """Set the hung attempt's status in rank 0's attempt record (its cause in goodput's `restart_causes`)."""
        try:
            fs, path = fsspec.core.url_to_fs(join(self.output_uri, ATTEMPTS_DIR))
            found = sorted(fs.glob(f"{path}/{self.launch}-{restart}-*.json"))
            if not found:
                return
            with fs.open(found[-1], "r") as f:
                record = json.load(f)
            record["status"] = status[:500]
            write_atomic(
                join(self.output_uri, ATTEMPTS_DIR, found[-1].rsplit("/", 1)[-1]),
                json.dumps(record, indent=2, sort_keys=True).encode(),
                fsync=False,
            )
        except (OSError, ValueError) as e:
            self.say(f"cannot mark the hung attempt's record ({e})")
