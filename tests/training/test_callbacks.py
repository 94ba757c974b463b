"""ProgressCallback's non-finite-loss check: no host sync per step, and a NaN still fails the trial, before any
checkpoint."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from training.callbacks import ProgressCallback, UserCodeError

CONVERSIONS = {
    "item",
    "tolist",
    "__float__",
    "__bool__",
    "__int__",
    "__index__",
    "numpy",
    "__array__",
    "__format__",
    "__repr__",
}


class Spy(torch.Tensor):
    """A loss that records every read of its value by the host (what is a device sync on an accelerator)."""

    reads: list[str] = []

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in CONVERSIONS:
            cls.reads.append(name)
        return super().__torch_function__(func, types, args, kwargs or {})


class _Reporter:
    def __init__(self) -> None:
        self.progress_calls: list[dict] = []

    def progress(self, record: dict) -> None:
        self.progress_calls.append(record)


def _trainer(**over: Any) -> Any:
    base = dict(
        world_size=1,
        strategy=SimpleNamespace(),
        log_every_n_steps=50,
        global_step=0,
        current_epoch=0,
        sanity_checking=False,
    )
    return SimpleNamespace(**{**base, **over})


def _step(cb: ProgressCallback, trainer: Any, step: int, loss: float) -> None:
    trainer.global_step = step
    cb.on_train_batch_end(
        trainer, None, {"loss": torch.tensor(loss).as_subclass(Spy)}, (torch.zeros(4, 3), torch.zeros(4)), step - 1
    )


def test_finite_losses_are_never_read_by_the_host() -> None:
    Spy.reads = []
    cb, trainer = ProgressCallback(_Reporter(), check_every=8), _trainer()
    for step in range(1, 41):
        _step(cb, trainer, step, 1.0 / step)
    cb.on_train_epoch_end(trainer, None)
    cb.on_save_checkpoint(trainer, None, {})
    assert Spy.reads == []  # the old check did float(loss) every step
    assert cb.train_samples == 40 * 4


def test_a_nan_loss_fails_at_the_next_check_naming_the_steps() -> None:
    Spy.reads = []
    cb, trainer = ProgressCallback(_Reporter(), check_every=8), _trainer()
    for step in range(1, 11):
        _step(cb, trainer, step, 0.5)
    for step in range(11, 16):
        _step(cb, trainer, step, float("nan"))  # not checked yet: no sync, no error
    assert Spy.reads == []
    with pytest.raises(
        UserCodeError, match=r"training loss is nan at step 16 \(epoch 0\); the first non-finite loss came after step 8"
    ):
        _step(cb, trainer, 16, float("nan"))


def test_an_infinite_loss_that_went_back_to_finite_is_still_caught() -> None:
    cb, trainer = ProgressCallback(_Reporter(), check_every=100), _trainer(log_every_n_steps=4)
    _step(cb, trainer, 1, float("inf"))
    _step(cb, trainer, 2, 0.3)
    _step(cb, trainer, 3, 0.3)
    with pytest.raises(UserCodeError, match="training loss is nan or inf at step 3"):
        cb.on_save_checkpoint(trainer, None, {})


def test_the_default_interval_is_the_trainers_logging_interval() -> None:
    cb, trainer = ProgressCallback(_Reporter()), _trainer(log_every_n_steps=5)
    for step in range(1, 5):
        _step(cb, trainer, step, float("nan"))
    with pytest.raises(UserCodeError, match="checked every 5 steps"):
        _step(cb, trainer, 5, float("nan"))
    with pytest.raises(ValueError, match="check_every must be a positive"):
        ProgressCallback(_Reporter(), check_every=0)


class _Diverging(L.LightningModule):
    """Loss turns NaN from batch `nan_from` on."""

    def __init__(self, nan_from: int) -> None:
        super().__init__()
        self.net = nn.Linear(3, 1)
        self.nan_from = nan_from

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.net(batch[0]).pow(2).mean()
        return loss * float("nan") if batch_idx >= self.nan_from else loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class _SaveAt(L.Callback):
    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def _fit(callbacks: list[Any], tmp_path: Path) -> L.Trainer:
    data = DataLoader(TensorDataset(torch.randn(64, 3), torch.zeros(64)), batch_size=2)
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        log_every_n_steps=10,
    )
    with pytest.raises(UserCodeError, match="training loss is nan"):
        trainer.fit(_Diverging(nan_from=3), data)
    return trainer


def test_a_real_trainer_stops_within_the_interval(tmp_path: Path) -> None:
    trainer = _fit([ProgressCallback(_Reporter())], tmp_path)
    assert trainer.global_step == 10  # NaN from step 4, read at the logging interval, not after all 32 batches


def test_a_diverged_state_is_never_checkpointed(tmp_path: Path) -> None:
    trainer = _fit([ProgressCallback(_Reporter()), _SaveAt(6, tmp_path / "at-6.ckpt")], tmp_path)
    assert trainer.global_step == 6 and not (tmp_path / "at-6.ckpt").exists()
