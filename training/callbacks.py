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
        # Ranks of one tensor-parallel group share a batch: count data-parallel replicas only.
        replicas = (getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}).get("num_replicas", trainer.world_size)
        self.train_samples += len(batch[0]) * replicas
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
