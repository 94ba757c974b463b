"""The model both sides of `bench.overhead` train, with the step clock both carry.

`TimedMLP` is `training.parallel.MLPClassifier` (residual MLP, Adam) plus one
callback, returned by `configure_callbacks`, so the platform run (through the
entrypoint, which knows nothing of it) and the bare Lightning run carry the very
same clock. Lightning appends model callbacks after the Trainer's, so in the
platform run the clock's batch-end stamp comes after the platform's own
callbacks: the interval between two stamps is everything one step costs.
"""

from __future__ import annotations

import gc
import json
import os
import time
from typing import Any, Optional

import lightning as L

from training.parallel import MLPClassifier

# The per-step hooks whose time `StepClock` charges to the other callbacks (the platform's own, in a platform run).
STEP_HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
              "on_before_zero_grad", "on_train_batch_end")


class StepClock(L.Callback):
    """Rank 0 stamps the first batch's start and every batch's end, and writes them at the end of fit.

    File (JSON): `first_step_start_wall` and `last_step_end_wall` (time.time(),
    comparable with the launching process's clock), `batch_end` (perf_counter
    seconds of every batch end), `writing` (per batch end: whether a
    checkpoint write of the platform's async writer was in flight; always false
    in a bare run), `hooks` (per batch end: seconds spent in the step, since the
    previous batch end, in the per-step hooks of the Trainer's other callbacks
    and in its loggers' `log_metrics`, by class: what the platform's own
    per-step code costs, measured directly rather than as the difference of two
    noisy step times), `world_size`; `phases` (per batch: wall `perf_counter` and main-thread CPU `thread_time`
    stamps at batch start, before backward, after backward, before the optimizer step and batch end); and `cpu`
    (per batch end, cumulative: the process's CPU seconds, `time.process_time`, so gloo's, the checkpoint writer's
    and any other thread's too, the seconds its garbage collector ran, `gc.callbacks`, and the machine's busy and
    total jiffies, `/proc/stat`); `rusage` (per batch end, cumulative: the process's minor and major page faults and
    voluntary and involuntary context switches, then the main thread's, `getrusage`: faults say whether memory is
    being mapped afresh, involuntary switches whether another runnable task took the core); and `processes` (every
    process's CPU ticks, `/proc/<pid>/stat`, at the end of batch `snapshot_at` and at the last batch's end, with its
    command line, and the ranks' pids: which processes used the cores in the steady window, the ranks or others).
    """

    def __init__(self, path: str, snapshot_at: int = 20) -> None:
        self.path = path
        self.snapshot_at = snapshot_at
        self.rusage: list[list[int]] = []
        self.processes: dict[str, Any] = {}
        self.rank_pids: list[int] = [os.getpid()]
        self.first_start_wall: Optional[float] = None
        self.last_end_wall = 0.0
        self.ends: list[float] = []
        self.writing: list[bool] = []
        self.hooks: list[dict[str, float]] = []
        self._spent: dict[str, float] = {}
        self.cpu: list[list[float]] = []
        self._gc_seconds = 0.0
        self._gc_started = 0.0
        self.phases: list[list[float]] = []
        self._stamps: list[float] = []

    def _stamp(self) -> None:
        self._stamps += (time.perf_counter(), time.thread_time())

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Any) -> None:
        self._stamp()

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stamp()

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self._stamp()

    def _gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self._gc_seconds += time.perf_counter() - self._gc_started

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for callback in trainer.callbacks:
            if callback is self:
                continue
            for hook in STEP_HOOKS:
                if getattr(type(callback), hook) is not getattr(L.Callback, hook):  # overridden: it does something
                    setattr(callback, hook, self._timed(type(callback).__name__, getattr(callback, hook)))
        for logger in trainer.loggers:
            logger.log_metrics = self._timed(f"logger:{type(logger).__name__}", logger.log_metrics)  # type: ignore[method-assign]
        gc.callbacks.append(self._gc)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            pids: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(pids, os.getpid())  # before the first step, alike on both sides of the benchmark
            self.rank_pids = [int(p) for p in pids]

    def _timed(self, name: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._spent[name] = self._spent.get(name, 0.0) + time.perf_counter() - started
        return timed

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.first_start_wall is None:
            self.first_start_wall = time.time()
        self._stamps = []
        self._stamp()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now, cpu = time.perf_counter(), time.thread_time()
        self.ends.append(now)
        self.last_end_wall = time.time()
        self.writing.append(any(_writing(c) for c in trainer.callbacks))
        self.hooks.append(self._spent)
        self._spent = {}
        self.cpu.append([time.process_time(), self._gc_seconds, *_machine_jiffies()])
        self.phases.append([*self._stamps, now, cpu])
        self.rusage.append(_rusage())
        # After the stamps: a scan's few ms fall in the next period (a warm-up one) or after the last.
        if trainer.global_rank == 0 and len(self.ends) in (self.snapshot_at, trainer.num_training_batches):
            self.processes[str(len(self.ends))] = {"wall": now, "ticks": _process_ticks()}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._gc in gc.callbacks:
            gc.callbacks.remove(self._gc)
        if trainer.global_rank != 0:
            return
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "w") as f:
            json.dump(
                {
                    "first_step_start_wall": self.first_start_wall,
                    "last_step_end_wall": self.last_end_wall,
                    "batch_end": self.ends,
                    "writing": self.writing,
                    "hooks": self.hooks,
                    "cpu": self.cpu,
                    "phases": self.phases,
                    "rusage": self.rusage,
                    "processes": self.processes,
                    "rank_pids": self.rank_pids,
                    "world_size": trainer.world_size,
                },
                f,
            )


def _machine_jiffies() -> tuple[float, float]:
    """The machine's busy and total CPU jiffies so far (`/proc/stat`'s first line; busy = all but idle and iowait)."""
    try:
        with open("/proc/stat") as f:
            fields = [float(v) for v in f.readline().split()[1:]]
    except OSError:
        return float("nan"), float("nan")
    return sum(fields[:8]) - fields[3] - fields[4], sum(fields[:8])


def _rusage() -> list[int]:
    """Cumulative [minor faults, major faults, voluntary switches, involuntary switches] of the process, then of this
    thread."""
    import resource

    out: list[int] = []
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_THREAD):
        r = resource.getrusage(who)
        out += [r.ru_minflt, r.ru_majflt, r.ru_nvcsw, r.ru_nivcsw]
    return out


def _process_ticks() -> dict[str, list[Any]]:
    """Every process's CPU so far: pid -> [user + system clock ticks, command line (first 120 characters)]."""
    out: dict[str, list[Any]] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile
            continue
        out[pid] = [int(fields[11]) + int(fields[12]), cmd[:120]]  # utime, stime: fields 14, 15 of stat
    return out


def _writing(callback: Any) -> bool:
    """Whether `callback` holds a checkpoint writer (the platform's FaultTolerance) with a write in flight."""
    writer = getattr(getattr(callback, "io", None), "writer", None)
    return bool(getattr(writer, "in_flight", False))


class TimedMLP(MLPClassifier):
    """`MLPClassifier` whose runs carry a `StepClock` writing to `clock_path`."""

    def __init__(self, clock_path: str, n_features: int = 64, n_classes: int = 10, width: int = 800, blocks: int = 2,
                 expansion: int = 4, lr: float = 1e-4) -> None:
        super().__init__(
            n_features=n_features, n_classes=n_classes, width=width, blocks=blocks, expansion=expansion, lr=lr
        )
        self.clock_path = clock_path

    def configure_callbacks(self) -> list[L.Callback]:
        return [StepClock(self.clock_path)]
