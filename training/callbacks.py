"""Lightning callbacks the entrypoint installs on every run."""

from __future__ import annotations

import math
import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from training.reporting import Reporter


class UserCodeError(RuntimeError):
    """Training diverged or model code misbehaved; retrying will not help."""


class ProgressCallback(Callback):
    """Reports epoch metrics to the orchestrator and times the fit loop.

    Also fails fast on a non-finite training loss: a NaN never heals, and every
    further step spends compute on a run that cannot be used.
    """

    def __init__(self, reporter: Reporter) -> None:
        self.reporter = reporter
        self.train_samples = 0
        self.train_seconds = 0.0
        self._epoch_start = 0.0

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._epoch_start = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.train_samples += len(batch[0]) * trainer.world_size
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is not None and not math.isfinite(float(loss)):
            raise UserCodeError(f"training loss is {float(loss)} at step {trainer.global_step} (epoch {trainer.current_epoch})")

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.train_seconds += time.perf_counter() - self._epoch_start

    @override
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        self.reporter.progress(
            {"epoch": trainer.current_epoch, "max_epochs": trainer.max_epochs, "step": trainer.global_step, "metrics": metrics}
        )


class FaultInjectionCallback(Callback):
    """Raises inside `training_step`'s hook at a given step (tests and drills only)."""

    def __init__(self, raise_at_step: int) -> None:
        self.raise_at_step = raise_at_step

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.raise_at_step:
            raise RuntimeError(f"injected fault at step {trainer.global_step} on rank {trainer.global_rank}")
