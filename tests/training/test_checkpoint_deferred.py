"""Deferred checkpoint copies: weights and optimizer state are copied while the next forward and backward run.

Every test holds the writer thread's copy back (as a big model's copy takes a
while), so a fence that did not wait, or a tensor deferred that changes before
the optimizer step, would put the wrong values in the checkpoint.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from training.checkpointing import AsyncCheckpointWriter, CheckpointStore, deferrable_storages
from training.checkpointing import writer as writer_module


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _step(model, opt)  # Adam's state exists from its first step
    return model, opt


def _step(model: nn.Module, opt: torch.optim.Optimizer, fence: Any = None) -> None:
    loss = model(torch.randn(32, 8)).square().mean()  # BatchNorm's running statistics change here
    loss.backward()
    if fence is not None:
        fence()
    opt.step()
    opt.zero_grad()


def _state(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"global_step": step, "state_dict": model.state_dict(), "optimizer": opt.state_dict()}


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    return obj


def _assert_same(saved: Any, expected: Any, where: str = "") -> None:
    if isinstance(expected, torch.Tensor):
        assert torch.equal(saved, expected), f"{where} differs from the state at submit"
    elif isinstance(expected, dict):
        assert set(saved) == set(expected), where
        for k in expected:
            _assert_same(saved[k], expected[k], f"{where}.{k}")
    elif isinstance(expected, list):
        for i, (a, b) in enumerate(zip(saved, expected)):
            _assert_same(a, b, f"{where}[{i}]")
    else:
        assert saved == expected, where


@pytest.fixture
def slow_copy(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The writer thread's deferred copy starts only when the returned gate opens (or after 5 s)."""
    gate = threading.Event()
    real = writer_module._Deferred.copy_all

    def held(self: Any) -> None:
        gate.wait(5)
        real(self)

    monkeypatch.setattr(writer_module._Deferred, "copy_all", held)
    return gate


def test_the_fence_waits_for_the_deferred_copy_and_the_checkpoint_holds_the_state_at_submit(
    tmp_path: Path, slow_copy: threading.Event
) -> None:
    model, opt = _model()
    store = CheckpointStore(str(tmp_path / "ckpt"))
    expected = _clone(_state(model, opt, 1))
    keys = deferrable_storages([model], [opt])
    # 4 parameter tensors of the Linears, 2 of the BatchNorm; Adam's step, exp_avg and exp_avg_sq of each
    assert len(keys) == 6 + 6 * 3
    with AsyncCheckpointWriter(store) as writer:
        writer.submit(1, _state(model, opt, 1), defer=keys)
        deferred = writer._deferred
        assert deferred is not None and len(deferred.copies) == len(keys) and not deferred.copied.is_set()
        opened: list[float] = []
        fenced: list[float] = []

        def open_gate() -> None:
            opened.append(time.perf_counter())
            slow_copy.set()

        def fence() -> None:
            writer.fence()
            fenced.append(time.perf_counter())

        threading.Timer(0.3, open_gate).start()
        before = writer.blocking_seconds
        _step(model, opt, fence=fence)  # forward changes the running statistics, the step the weights
        # Causal, not a duration: on a loaded machine the forward and backward alone can take most of the 0.3 s.
        assert opened and fenced[0] > opened[0], "the fence returned before the copy was taken"
        assert writer.blocking_seconds - before > 0
        assert not torch.equal(model[0].weight, expected["state_dict"]["0.weight"])
        assert not torch.equal(model[1].running_mean, expected["state_dict"]["1.running_mean"])
        assert writer.wait() == store.uri(1)
    assert writer.deferred_saves == 1 and writer.dropped == []
    latest = store.latest()
    assert latest is not None and latest.step == 1
    _assert_same(latest.state, expected)


def test_a_weight_changed_before_the_fence_drops_that_checkpoint_and_later_saves_copy_at_once(
    tmp_path: Path, slow_copy: threading.Event
) -> None:
    model, opt = _model()
    store = CheckpointStore(str(tmp_path / "ckpt"))
    with AsyncCheckpointWriter(store) as writer:
        writer.submit(1, _state(model, opt, 1), defer=deferrable_storages([model], [opt]))
        assert writer.wait() == store.uri(1)  # untouched: written
        writer.submit(2, _state(model, opt, 2), defer=deferrable_storages([model], [opt]))
        with torch.no_grad():
            model[3].bias.add_(1.0)  # as code that clips or averages weights outside the optimizer step does
        slow_copy.set()
        with pytest.warns(RuntimeWarning, match=r"checkpoint of step 2 dropped: state_dict\.3\.bias changed"):
            writer.fence()
        assert writer.wait() is None
        assert writer.dropped == [2] and not writer.defer_allowed
        expected = _clone(_state(model, opt, 3))
        writer.submit(3, _state(model, opt, 3), defer=deferrable_storages([model], [opt]))
        assert writer._deferred is None  # copied before submit returned
        _step(model, opt)
        assert writer.wait() == store.uri(3)
    assert sorted(m["step"] for m in store.list_committed()) == [1, 3]
    latest = store.latest()
    assert latest is not None
    _assert_same(latest.state, expected)


def test_a_program_that_ends_without_a_fence_still_writes_its_checkpoint(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import torch
        from training.checkpointing import AsyncCheckpointWriter, CheckpointStore, deferrable_storages
        model = torch.nn.Linear(64, 64)
        writer = AsyncCheckpointWriter(CheckpointStore({str(tmp_path / "ckpt")!r}))
        writer.submit(7, {{"state_dict": model.state_dict()}}, defer=deferrable_storages([model], []))
        assert writer.deferred_saves == 1
    """)  # no fence, no close: the interpreter's exit must neither hang nor lose the save
    # A hang is the run's timeout (TimeoutExpired); the bound has room for a loaded machine, where importing torch alone
    # took 40 s.
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2]
    )
    assert done.returncode == 0, done.stderr
    latest = CheckpointStore(str(tmp_path / "ckpt")).latest()
    assert latest is not None and latest.step == 7


class _Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.05)


class _ManualNet(_Net):
    """Manual optimization, as GAN and RL code writes it: the optimizer step is the user's call."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).squeeze(-1), y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()  # Lightning calls on_before_optimizer_step inside, before the torch step
        return loss


class _Recorder(L.Callback):
    """The module's state at each save, read after FaultTolerance submitted it (the callbacks run in order)."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.states: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if (
            trainer.global_step % self.every == 0 and trainer.global_step not in self.states
        ):  # accumulating: the step's first batch
            self.states[trainer.global_step] = _clone(pl_module.state_dict())


@pytest.mark.parametrize("how", ["automatic", "accumulating 3 batches", "manual"])
def test_a_lightning_fit_defers_its_copies_and_every_checkpoint_holds_the_weights_of_its_step(
    how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from training.attempts import AttemptLog, FaultMarkers
    from training.checkpoint_io import StoreCheckpointIO
    from training.fault_tolerance import FaultTolerance
    from training.spec import CheckpointPolicy, FaultInjection

    real = writer_module._Deferred.copy_all

    def held(self: Any) -> None:
        time.sleep(0.2)  # longer than this model's forward and backward: only the fence keeps the step after the copy
        real(self)

    monkeypatch.setattr(writer_module._Deferred, "copy_all", held)
    store = CheckpointStore(str(tmp_path / "ckpt"), keep_last=10)
    io = StoreCheckpointIO(store, async_save=True)
    ft = FaultTolerance(CheckpointPolicy(every_n_steps=4, keep_last=10), io, 1, "val_loss", "min", FaultInjection(),
                        FaultMarkers(str(tmp_path)), AttemptLog(str(tmp_path), "a0", time.time()))
    recorder = _Recorder(every=4)
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(96, 8), torch.randn(96))
    accumulate = 3 if how.startswith("accumulating") else 1
    trainer = L.Trainer(
        max_epochs=2 * accumulate,
        accelerator="cpu",
        devices=1,
        plugins=[io],
        callbacks=[ft, recorder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accumulate_grad_batches=accumulate,
    )
    trainer.fit(_ManualNet() if how == "manual" else _Net(), torch.utils.data.DataLoader(data, batch_size=8))
    assert trainer.global_step == 24
    assert io.writer is not None and io.writer.deferred_saves >= 5 and io.writer.dropped == []
    committed = {m["step"]: m["uri"].rsplit("/", 1)[1] for m in store.list_committed()}
    assert {4, 8, 12, 16, 20} <= set(committed)
    for step in (4, 8, 12, 16, 20):
        _assert_same(store.load(committed[step]).state["state_dict"], recorder.states[step], f"step {step}")
