"""A tiny shardable classifier that records every trained batch (sample ids and loss), for the resume-at-another-size
drills
(`tests/training/test_elastic_resume.py`).

`ElasticRecordingMLP` trains under `ddp`, `fsdp` and `tp` (`training.parallel.ParallelizableModule`; tensor
parallel splits the hidden layer)
on batches `(x, y, ids)`: streamed images (`StreamingShardDataModule(return_ids=True)`) or
Parquet rows with their row index (`IdParquetDataModule`). Each `training_step` appends one
JSON line to `<log_dir>/ids-rank<r>.jsonl` before the step's optimizer update: the world size,
the rank, the epoch, the optimizer steps done before this batch (`step`: the batch's gradient
goes into step `step + 1`), the batch index, the batch's mean loss and its sample ids. Written
in the step, not after it, so a batch whose step a preemption ends (the checkpoint of that
step holds it) is recorded too.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import torch
from torch import nn
from torch.nn import functional as F

from training.data import BatchedTensorDataset, ParquetDataModule
from training.parallel import ColwiseParallel, ParallelizableModule, RowwiseParallel


class ElasticRecordingMLP(ParallelizableModule):
    """Two layers over the flattened input, Adam; `log_dir` receives every trained batch (see the module docstring)."""

    def __init__(
        self, n_features: int = 64, n_classes: int = 10, hidden: int = 16, lr: float = 0.02, log_dir: str = ""
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(n_features, hidden), nn.ReLU(), nn.Linear(hidden, n_classes))

    def tensor_parallel_plan(self) -> dict[str, Any]:
        return {"net.0": ColwiseParallel(), "net.2": RowwiseParallel()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1).float())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = F.cross_entropy(self(batch[0]), batch[1])
        self.log("train_loss", loss)
        if self.hparams.log_dir:
            record = {
                "world": self.trainer.world_size,
                "rank": self.global_rank,
                "epoch": self.current_epoch,
                "step": self.global_step,
                "batch_idx": batch_idx,
                "loss": float(loss.detach()),
                "ids": batch[2].tolist(),
            }
            os.makedirs(self.hparams.log_dir, exist_ok=True)
            with open(os.path.join(self.hparams.log_dir, f"ids-rank{self.global_rank}.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        logits = self(batch[0])
        self.log("val_loss", F.cross_entropy(logits, batch[1]), sync_dist=True)
        self.log("val_acc", (logits.argmax(dim=1) == batch[1]).float().mean(), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class IdParquetDataModule(ParquetDataModule):
    """`ParquetDataModule` whose training batches also carry each row's index in the train split: `(x, y, ids)`."""

    def setup(self, stage: Optional[str] = None) -> None:
        super().setup(stage)
        train = self._sets["train"]
        if len(train.tensors) == 2:
            x, y = train.tensors
            self._sets["train"] = BatchedTensorDataset(x, y, torch.arange(len(y)))
