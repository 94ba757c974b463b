"""Model code of the vision team: plain Lightning, plus a variant that opts into sharding."""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.nn import functional as F
from typing_extensions import override

from training.parallel import ParallelizableModule


class _DigitsClassifier(L.LightningModule):
    """The steps (cross-entropy, `<stage>_loss` and `<stage>_acc`) and the Adam optimizer (`hparams.lr`) of the digit
    models.

    A subclass calls `super().__init__()` then `self.save_hyperparameters()` in its own
    `__init__`: Lightning collects the arguments of the `__init__` frames that use `super()`.
    """

    def _step(self, batch, stage: str) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        acc = (logits.argmax(dim=1) == y).float().mean()
        self.log(f"{stage}_loss", loss, prog_bar=False, sync_dist=stage != "train")
        self.log(f"{stage}_acc", acc, prog_bar=True, sync_dist=stage != "train")
        return loss

    def training_step(self, batch, batch_idx):
        return self._step(batch, "train")

    def validation_step(self, batch, batch_idx):
        self._step(batch, "val")

    def test_step(self, batch, batch_idx):
        self._step(batch, "test")

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams["lr"])


class DigitsMLP(_DigitsClassifier):
    """A two-layer classifier for 8x8 digit images flattened to 64 features.

    Args:
        n_features: input width (the platform passes the number of feature columns).
        n_classes: number of classes.
        hidden: width of the hidden layer.
        lr: Adam learning rate.
    """

    def __init__(self, n_features: int = 64, n_classes: int = 10, hidden: int = 64, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(n_features, hidden), nn.ReLU(), nn.Linear(hidden, n_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x / 16.0)


class DigitsParallelMLP(ParallelizableModule, DigitsMLP):
    """`DigitsMLP` that also trains under `fsdp` and `tp` distributions.

    Same layers, parameter names and initialisation as `DigitsMLP`, so its
    checkpoints load into either class. Tensor parallel splits the hidden layer:
    the first Linear colwise, the second rowwise (`hidden` must be divisible by
    `tensor_parallel_size`).
    """

    @override
    def tensor_parallel_plan(self) -> dict[str, ParallelStyle]:
        return {"net.0": ColwiseParallel(), "net.2": RowwiseParallel()}


class DigitsCNN(_DigitsClassifier):
    """A small convolutional classifier of images `[batch, channels, height, width]` with values in [0, 1].

    The platform's streaming data module (`training.streaming`) yields image shards
    that way, scaled from the declared pixel range; `in_channels`, `height` and
    `width` come from the pipeline's `ImageShards` and `n_classes` from its labels.
    Two 3x3 convolutions, a 2x2 max-pool, then a head like `DigitsMLP`'s, with the same steps.

    Args:
        n_classes: number of classes.
        in_channels, height, width: the image's shape.
        channels: feature maps of the first convolution (the second has twice as many).
        hidden: width of the hidden layer of the head.
        lr: Adam learning rate.

    Example:
        >>> DigitsCNN(n_classes=10, height=8, width=8)(torch.zeros(2, 1, 8, 8)).shape
        torch.Size([2, 10])
    """

    def __init__(self, n_classes: int = 10, in_channels: int = 1, height: int = 8, width: int = 8, channels: int = 16,
                 hidden: int = 64, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, channels, 3, padding=1), nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        flat = 2 * channels * (height // 2) * (width // 2)
        self.net = nn.Sequential(nn.Linear(flat, hidden), nn.ReLU(), nn.Linear(hidden, n_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.features(x).flatten(1))
