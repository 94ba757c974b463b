"""A tiny classifier for streamed image batches that records which samples each rank trained, for the resume drills.

Batches come from `training.streaming.StreamingShardDataModule(return_ids=True)`:
`(x, y, ids)`. After each optimizer step the model appends one JSON line to
`<log_dir>/ids-rank<r>.jsonl`: the rank, the attempt (torchrun's restart
count), the epoch, the global step the batch produced and the batch's sample ids.
It also takes the platform's Parquet rows (`[N, 64]`) in `forward`, so the
platform's final evaluation of a classification trial runs on it.
"""

from __future__ import annotations

import json
import os
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F


class IdRecordingMLP(L.LightningModule):
    """Two layers over the flattened image; `log_dir` receives the trained sample ids (see the module docstring)."""

    def __init__(
        self, n_features: int = 64, n_classes: int = 10, hidden: int = 16, lr: float = 0.02, log_dir: str = ""
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(n_features, hidden), nn.ReLU(), nn.Linear(hidden, n_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits = self(batch[0])
        loss = F.cross_entropy(logits, batch[1])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        logits = self(batch[0])
        self.log("val_loss", F.cross_entropy(logits, batch[1]), sync_dist=True)
        self.log("val_acc", (logits.argmax(dim=1) == batch[1]).float().mean(), sync_dist=True)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.hparams.log_dir:
            return
        record = {
            "rank": self.global_rank,
            "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "epoch": self.current_epoch,
            "step": self.global_step,
            "batch_idx": batch_idx,
            "ids": batch[2].tolist(),
        }
        os.makedirs(self.hparams.log_dir, exist_ok=True)
        with open(os.path.join(self.hparams.log_dir, f"ids-rank{self.global_rank}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
