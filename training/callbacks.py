"""Lightning callbacks the entrypoint installs on every run."""

from __future__ import annotations

import math
import time
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from training.reporting import Reporter

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
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        # Ranks of one tensor-parallel group share a batch: count data-parallel replicas only.
        replicas = (getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}).get("num_replicas", trainer.world_size)
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
        latest = float(self._last_loss) if self._last_loss is not None and self._last_loss.numel() == 1 else float("nan")
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
            {"epoch": trainer.current_epoch, "max_epochs": trainer.max_epochs, "step": trainer.global_step, "metrics": metrics}
        )


class FaultInjectionCallback(Callback):
    """Faults in model code at a given step (tests and drills only).

    Args:
        raise_at_step: raise an exception on every rank, as a bug in training_step would.
        nan_at_step: poison the weights with NaN, as a diverging run would.
    """

    def __init__(self, raise_at_step: Optional[int] = None, nan_at_step: Optional[int] = None) -> None:
        self.raise_at_step = raise_at_step
        self.nan_at_step = nan_at_step

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.raise_at_step:
            raise RuntimeError(f"injected fault at step {trainer.global_step} on rank {trainer.global_rank}")
        if trainer.global_step == self.nan_at_step:
            with torch.no_grad():
                for p in pl_module.parameters():
                    p.fill_(float("nan"))
