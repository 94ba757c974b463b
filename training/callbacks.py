"""Lightning callbacks the entrypoint installs on every run."""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from common.settings import settings
from training.attempts import FaultMarkers
from training.reporting import Reporter
from training.spec import PROGRESS_DIR_ENV
from training.watchdog import (
    BACKWARD,
    DONE,
    FORWARD,
    OPTIMIZER,
    STARTING,
    STEP_END,
    VALIDATION,
    ProgressRecord,
    node_name,
    pod_name,
    write_gang_window,
)

log = logging.getLogger("trainyard.training")

DEFAULT_CHECK_EVERY = 50  # batches between non-finite-loss checks when the Trainer logs nothing


class UserCodeError(RuntimeError):
    """Training diverged or model code misbehaved; retrying will not help."""


class ProgressCallback(Callback):
    """Reports epoch metrics to the orchestrator and times the fit loop.

    Also fails fast on a non-finite training loss: a NaN never heals, and every
    further step spends compute on a run that cannot be used. The check costs no
    host-device synchronisation per step: each step ORs "this loss is not
    finite" into a flag on the loss's device (no host sync), and the host reads
    the flag only every `check_every` batches (default: the Trainer's
    `log_every_n_steps`, where Lightning logs anyway), before validation, at the
    end of each training epoch and before any checkpoint is written. So a NaN
    loss fails the trial with `UserCodeError` at most `check_every` batches
    after it appeared (or sooner, at one of those boundaries), and a diverged
    state is never checkpointed. Every rank checks at the same batches.

    Args:
        reporter: where epoch metrics go (rank 0 reports).
        check_every: batches between reads of the non-finite flag; None: `trainer.log_every_n_steps`.
    """

    def __init__(self, reporter: Reporter, check_every: Optional[int] = None) -> None:
        if check_every is not None and check_every < 1:
            raise ValueError(f"check_every must be a positive number of batches, got {check_every}")
        self.reporter = reporter
        self.check_every = check_every
        self.train_samples = 0
        self.train_seconds = 0.0
        self._epoch_start = 0.0
        self._batches = 0
        self._nonfinite: Optional[torch.Tensor] = None  # on the loss's device; read by the host only in check_finite
        self._last_loss: Optional[torch.Tensor] = None
        self._checked_step = 0  # global step of the last check that passed

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._epoch_start = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Ranks of one tensor-parallel group share a batch: count data-parallel replicas only.
        replicas = (getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}).get(
            "num_replicas", trainer.world_size
        )
        self.train_samples += len(batch[0]) * replicas
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            loss = loss.detach()
            if self._nonfinite is None:
                self._nonfinite = torch.zeros((), dtype=torch.bool, device=loss.device)
            self._nonfinite.logical_or_(torch.isfinite(loss).logical_not().any())  # queued on the device: no sync
            self._last_loss = loss
        self._batches += 1
        if self._batches % self._every(trainer) == 0:
            self.check_finite(trainer)

    def _every(self, trainer: L.Trainer) -> int:
        # Lightning sets `log_every_n_steps` on the Trainer at run time (0 when logging is off).
        return self.check_every or int(getattr(trainer, "log_every_n_steps", 0) or DEFAULT_CHECK_EVERY)

    def check_finite(self, trainer: L.Trainer) -> None:
        """Raise `UserCodeError` if any training loss since the last check was NaN or infinite (one host sync).

        Raises:
            UserCodeError: a loss was not finite; says between which steps and the latest loss.
        """
        if self._nonfinite is None or not bool(self._nonfinite):
            self._checked_step = trainer.global_step
            return
        latest = (
            float(self._last_loss) if self._last_loss is not None and self._last_loss.numel() == 1 else float("nan")
        )
        value = latest if not math.isfinite(latest) else "nan or inf"
        raise UserCodeError(
            f"training loss is {value} at step {trainer.global_step} (epoch {trainer.current_epoch}); the first "
            f"non-finite loss came after step {self._checked_step} (checked every {self._every(trainer)} "
            "steps, before validation and before each checkpoint)"
        )

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.train_seconds += time.perf_counter() - self._epoch_start
        self.check_finite(trainer)

    @override
    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.check_finite(trainer)

    @override
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self.check_finite(trainer)  # every rank dumps the checkpoint, so every rank checks before anything is written

    @override
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        self.reporter.progress(
            {
                "epoch": trainer.current_epoch,
                "max_epochs": trainer.max_epochs,
                "step": trainer.global_step,
                "metrics": metrics,
            }
        )


class ProgressRecorder(Callback):
    """Where this rank is in its step, for the agent's watchdog (`training.watchdog`; installed when the agent names
    a directory in `PROGRESS_DIR_ENV`).

    Every hook stores its phase and the time into the rank's memory-mapped
    record (no system call). Local time runs from the end of the previous step
    (or the start of the first step after a validation) to the start of
    backward: data loading and forward. Step time runs from step end to step
    end, validation excluded. From the end of training on (the final save,
    evaluation, export) the rank is no longer watched.

    A gang of several nodes (more ranks than this node's `LOCAL_WORLD_SIZE`)
    also shares its times across nodes, since each node's agent sees only its
    own ranks: every `window` batches each rank's mean local and step time over
    those batches go into one all-gather of the whole gang (a 16-byte tensor a
    rank), and rank 0 writes the gang's window with every rank's pod and node
    (gathered once at the start) to `<directory>/gang.json`
    (`training.watchdog.write_gang_window`), which its agent judges.

    Args:
        directory: the agent's progress directory.
        rank: this process's global rank.
        window: batches between two gang-wide exchanges (`WatchdogPolicy.straggler_window_steps`).
    """

    def __init__(self, directory: str, rank: int, window: int = 20) -> None:
        if not os.path.isdir(directory):
            raise ValueError(
                f"{PROGRESS_DIR_ENV}={directory!r} is not a directory; the agent (training.gang) names an existing one"
            )
        self.directory = directory
        self.rank = rank
        self.window = window
        self.record: Optional[ProgressRecord] = None
        self._local_from: Optional[float] = None
        self._step_from: Optional[float] = None
        self._where: Optional[list[Any]] = None  # every rank's (pod, node) in a gang of several nodes; None: one node
        self._shared = (0, 0.0, 0.0)  # (timed steps, sum step, sum local) at the last exchange

    @classmethod
    def from_env(cls, rank: int, window: int = 20) -> Optional["ProgressRecorder"]:
        """The recorder for this worker, or None when no agent named a progress directory."""
        directory = settings().progress_dir
        return cls(directory, rank, window) if directory else None

    def _set(self, phase: int, now: float) -> ProgressRecord:
        if self.record is None:
            self.record = ProgressRecord(self.directory, self.rank)
        self.record.set(phase, now)
        return self.record

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._set(STARTING, time.time())
        local = int(os.environ.get("LOCAL_WORLD_SIZE", trainer.world_size))
        if trainer.world_size > local and torch.distributed.is_available() and torch.distributed.is_initialized():
            where: list[Any] = [None] * trainer.world_size
            torch.distributed.all_gather_object(where, (pod_name(), node_name()))
            self._where = where

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        now = time.time()
        if self._local_from is None:
            self._local_from = now
        record = self._set(FORWARD, now)
        record.values[ProgressRecord.GLOBAL_STEP] = trainer.global_step
        record.write()

    @override
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        now = time.time()
        if self._local_from is not None and self.record is not None:
            self.record.values[ProgressRecord.SUM_LOCAL] += now - self._local_from
            self._local_from = None
        self._set(BACKWARD, now)

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self._set(OPTIMIZER, time.time())

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.time()
        record = self._set(STEP_END, now)
        v = record.values
        v[ProgressRecord.GLOBAL_STEP], v[ProgressRecord.STEPS] = trainer.global_step, v[ProgressRecord.STEPS] + 1
        if self._step_from is not None:
            v[ProgressRecord.TIMED_STEPS] += 1
            v[ProgressRecord.SUM_STEP] += now - self._step_from
        record.write()
        self._step_from = self._local_from = now
        if self._where is not None and v[ProgressRecord.STEPS] % self.window == 0:
            self._share(trainer, pl_module, v)

    def _share(self, trainer: L.Trainer, pl_module: L.LightningModule, v: list[Any]) -> None:
        """The gang-wide exchange of the last window's mean times; rank 0 writes what it gathered for its agent."""
        timed, step, local = v[ProgressRecord.TIMED_STEPS], v[ProgressRecord.SUM_STEP], v[ProgressRecord.SUM_LOCAL]
        last = self._shared
        self._shared = (timed, step, local)
        mine = torch.tensor(
            [(local - last[2]) / self.window, (step - last[1]) / max(timed - last[0], 1)],
            dtype=torch.float64,
            device=pl_module.device,
        )
        gathered = trainer.strategy.all_gather(mine)
        if self.rank == 0 and self._where is not None:
            rows = gathered.reshape(-1, 2).cpu().tolist()
            write_gang_window(
                self.directory,
                {
                    "steps": v[ProgressRecord.STEPS],
                    "global_step": trainer.global_step,
                    "time": time.time(),
                    "restart": v[ProgressRecord.RESTART],
                    "window": self.window,
                    "ranks": [
                        {"local": r[0], "step": r[1], "pod": w[0], "node": w[1]} for r, w in zip(rows, self._where)
                    ],
                },
            )

    @override
    def on_validation_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if not trainer.sanity_checking:
            self._set(VALIDATION, time.time())

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._step_from = self._local_from = None  # the next step's times start at the next step
        self._set(VALIDATION, time.time())

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._set(DONE, time.time())

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._set(DONE, time.time())


def _drill_hang_blocks_forever() -> None:
    """The `hang` drill: this rank never reaches its step's gradient all-reduce; the others wait in it."""
    threading.Event().wait()


class FaultInjectionCallback(Callback):
    """Faults in model code at a given step (tests and drills only).

    The hang and slow drills fire once per training directory (`FaultMarkers`):
    the attempt that resumes after them runs clean.

    Args:
        raise_at_step: raise an exception on every rank, as a bug in training_step would.
        nan_at_step: poison the weights with NaN, as a diverging run would.
        hang_rank, hang_at_step: that rank blocks forever at the start of the step after `hang_at_step` steps,
            before its forward, so it never joins the step's gradient all-reduce (as a rank stuck in its data
            loader or I/O would); the marker records the moment.
        slow_rank, slow_seconds: that rank sleeps `slow_seconds` before every step's forward (a slow node).
        markers: the trial's fault markers (needed by the hang and slow drills).
    """

    def __init__(
        self,
        raise_at_step: Optional[int] = None,
        nan_at_step: Optional[int] = None,
        *,
        hang_rank: Optional[int] = None,
        hang_at_step: Optional[int] = None,
        slow_rank: Optional[int] = None,
        slow_seconds: float = 0.0,
        markers: Optional[FaultMarkers] = None,
    ) -> None:
        if (hang_rank is not None or slow_rank is not None) and markers is None:
            raise ValueError(
                "the hang and slow drills fire once per training directory: pass the trial's FaultMarkers as markers"
            )
        self.raise_at_step = raise_at_step
        self.nan_at_step = nan_at_step
        self.hang_rank = hang_rank
        self.hang_at_step = hang_at_step
        self.slow_rank = slow_rank
        self.slow_seconds = slow_seconds
        self.markers = markers
        self._slow: Optional[bool] = None  # decided at this process's first step

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        rank = trainer.global_rank
        if self.slow_rank == rank and self.markers is not None:
            if self._slow is None:
                self._slow = not self.markers.fired("slow")
                if self._slow:
                    self.markers.mark("slow")
                    log.warning(
                        "fault injection: rank %d sleeps %.3f s in every step of this attempt", rank, self.slow_seconds
                    )
            if self._slow:
                time.sleep(self.slow_seconds)
        if (
            self.hang_rank == rank
            and trainer.global_step == self.hang_at_step
            and self.markers is not None
            and not self.markers.fired("hang")
        ):
            self.markers.mark("hang")
            log.warning(
                "fault injection: rank %d blocks forever at step %d, before its gradient all-reduce",
                rank,
                trainer.global_step,
            )
            _drill_hang_blocks_forever()
        if trainer.global_step == self.raise_at_step:
            raise RuntimeError(f"injected fault at step {trainer.global_step} on rank {trainer.global_rank}")
        if trainer.global_step == self.nan_at_step:
            with torch.no_grad():
                for p in pl_module.parameters():
                    p.fill_(float("nan"))
