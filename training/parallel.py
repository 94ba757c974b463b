"""Models that FSDP2 and tensor parallelism can shard: the `ParallelizableModule` convention.

A LightningModule runs under `distribution.strategy` `fsdp` or `tp` when it
inherits `ParallelizableModule` and, for `tp`, says which layers to split:

- `tensor_parallel_plan()`: module FQN (fnmatch wildcards per dotted atom, as
  `parallelize_module` takes them) -> `ColwiseParallel()` / `RowwiseParallel()`.
  The usual pattern is Megatron's: the first Linear of a pair colwise (its
  output stays sharded, so an elementwise activation needs no communication),
  the second rowwise (partial sums all-reduced into a replicated output).
- `fsdp_units()`: submodules that FSDP2 shards as separate units (one
  all-gather each, so only one unit's full weights live at a time, plus one
  prefetched); the root module is always sharded too, holding whatever is
  left. For a transformer: its blocks.

The mixin's `configure_model` applies both on the device mesh that Lightning's
`ModelParallelStrategy` creates (dimensions `data_parallel` and
`tensor_parallel`): tensor parallel first, then FSDP2 over the data-parallel
dimension. Without a mesh (single process, DDP) it does nothing, so the same
class trains, evaluates and exports unsharded.

Because FSDP2 hooks the root module's `__call__`, step methods must run the
model as `self(x)`, not `self.net(x)`.

Example:
    >>> class Net(ParallelizableModule):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)
    ...     def tensor_parallel_plan(self):
    ...         return {"up": ColwiseParallel(), "down": RowwiseParallel()}
"""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module
from torch.nn import functional as F
from typing_extensions import override

from training.errors import StrategyConfigError

__all__ = [
    "ClassifierSteps",
    "RegressorSteps",
    "MLPClassifier",
    "MLPRegressor",
    "ParallelizableModule",
    "ColwiseParallel",
    "RowwiseParallel",
]


class ParallelizableModule(L.LightningModule):
    """A LightningModule that `fsdp` and `tp` distributions can shard; see the module docstring."""

    def tensor_parallel_plan(self) -> dict[str, ParallelStyle]:
        """Module FQN -> parallel style for tensor parallelism; empty means `tp` is not supported."""
        return {}

    def fsdp_units(self) -> list[nn.Module]:
        """Submodules FSDP2 shards as their own units, innermost first; the root is always one."""
        return []

    @override
    def configure_model(self) -> None:
        mesh = self.device_mesh
        # Lightning calls this hook for every fit/validate/test; apply once.
        if mesh is None or getattr(self, "_trainyard_parallelized", False):
            return
        tp_mesh, dp_mesh = mesh["tensor_parallel"], mesh["data_parallel"]
        if tp_mesh.size() > 1:
            plan = self.tensor_parallel_plan()
            if not plan:
                raise StrategyConfigError(
                    f"model {type(self).__name__}: tensor_parallel_plan() is empty; "
                    f"tensor_parallel_size={tp_mesh.size()} needs a plan"
                )
            parallelize_module(self, tp_mesh, plan)
        if dp_mesh.size() > 1:
            for unit in self.fsdp_units():
                fully_shard(unit, mesh=dp_mesh)
            fully_shard(self, mesh=dp_mesh)
        self._trainyard_parallelized = True


class _Block(nn.Module):
    """Residual feed-forward block: x + down(relu(up(x))), the MLP half of a transformer layer."""

    def __init__(self, width: int, expansion: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, width * expansion)
        self.down = nn.Linear(width * expansion, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.relu(self.up(x)))


class _StageSteps(L.LightningModule):
    """train/val/test steps that all run `_step(batch, stage)`; subclasses say what a step computes and logs."""

    def _step(self, batch: Any, stage: str) -> torch.Tensor:
        raise NotImplementedError

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._step(batch, "val")

    @override
    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._step(batch, "test")


class ClassifierSteps(_StageSteps):
    """Cross-entropy train/val/test steps logging `<stage>_loss` and `<stage>_acc` (synced across ranks off train)."""

    def _step(self, batch: Any, stage: str) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y, weight=getattr(self, "class_weights", None))
        acc = (logits.argmax(dim=1) == y).float().mean()
        self.log(f"{stage}_loss", loss, sync_dist=stage != "train")
        self.log(f"{stage}_acc", acc, prog_bar=True, sync_dist=stage != "train")
        return loss


class RegressorSteps(_StageSteps):
    """Mean-squared-error train/val/test steps logging `<stage>_loss` (MSE) and `<stage>_rmse` (synced across ranks off
    train).

    The model returns one value per row, `[batch]` or `[batch, 1]`; targets are
    float (the platform's data module reads them so for task `regression`).
    """

    def _step(self, batch: Any, stage: str) -> torch.Tensor:
        x, y = batch
        pred = self(x).reshape(y.shape)
        loss = F.mse_loss(pred, y.to(pred.dtype))
        self.log(f"{stage}_loss", loss, sync_dist=stage != "train")
        self.log(f"{stage}_rmse", loss.sqrt(), prog_bar=True, sync_dist=stage != "train")
        return loss


class _ResidualMLP(ParallelizableModule):
    """Residual feed-forward blocks between an input and an output projection (shared by the classifier and the
    regressor).

    Each block's `up` projection is split colwise and `down` rowwise, so a block
    costs one all-reduce under tensor parallelism; each block is an FSDP unit.
    """

    def _layers(self, n_features: int, n_outputs: int, width: int, blocks: int, expansion: int) -> None:
        self.inp = nn.Linear(n_features, width)
        self.blocks = nn.ModuleList([_Block(width, expansion) for _ in range(blocks)])
        self.head = nn.Linear(width, n_outputs)

    @override
    def tensor_parallel_plan(self) -> dict[str, ParallelStyle]:
        return {"blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()}

    @override
    def fsdp_units(self) -> list[nn.Module]:
        return list(self.blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x / self.hparams["input_scale"])
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams["lr"])


class MLPClassifier(ClassifierSteps, _ResidualMLP):
    """Tabular classifier of residual feed-forward blocks, shardable by FSDP2 and tensor parallel.

    `tensor_parallel_size` must divide `width * expansion`.

    Args:
        n_features: input width (the platform passes the number of feature columns).
        n_classes: number of classes.
        width: residual stream width.
        blocks: number of feed-forward blocks.
        expansion: hidden width of a block as a multiple of `width`.
        lr: Adam learning rate.
        input_scale: inputs are divided by this (16 for 4-bit digit pixels).
        class_weights: one loss weight per class (the platform passes them for `class_weight="balanced"`).
    """

    def __init__(
        self,
        n_features: int = 64,
        n_classes: int = 10,
        width: int = 64,
        blocks: int = 2,
        expansion: int = 4,
        lr: float = 1e-3,
        input_scale: float = 1.0,
        class_weights: Optional[torch.Tensor] = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["class_weights"])
        self._layers(n_features, n_classes, width, blocks, expansion)
        self.class_weights: Optional[torch.Tensor] = None
        if class_weights is not None:
            self.register_buffer("class_weights", torch.as_tensor(class_weights, dtype=torch.float32), persistent=False)


class MLPRegressor(RegressorSteps, _ResidualMLP):
    """Tabular regressor of residual feed-forward blocks: `MLPClassifier`'s body with one output, trained on MSE.

    Args:
        n_features: input width (the platform passes the number of feature columns).
        width: residual stream width.
        blocks: number of feed-forward blocks.
        expansion: hidden width of a block as a multiple of `width`.
        lr: Adam learning rate.
        input_scale: inputs are divided by this.
        target_scale: the output is multiplied by this, so a target of large
            magnitude (hundreds) needs no rescaling in the data.
    """

    def __init__(
        self,
        n_features: int = 8,
        width: int = 64,
        blocks: int = 2,
        expansion: int = 4,
        lr: float = 1e-3,
        input_scale: float = 1.0,
        target_scale: float = 1.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self._layers(n_features, 1, width, blocks, expansion)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).squeeze(-1) * self.hparams["target_scale"]
