"""Tiny deterministic regression data and model for tests: scikit-learn's bundled diabetes table, split and written as
Parquet."""

from __future__ import annotations

import os

import lightning as L
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn
from torch.nn import functional as F

TARGET = "progression"


def diabetes_frame():
    """442 rows: ten standardised float features and a float target (disease progression, 25 to 346)."""
    from sklearn.datasets import load_diabetes

    df = load_diabetes(as_frame=True).frame.rename(columns={"target": TARGET})
    return df


def features() -> list[str]:
    return [c for c in diabetes_frame().columns if c != TARGET]


def write_splits(directory: str) -> dict[str, str]:
    """Write train/val/test Parquet files (70/15/15) under `directory`; returns their paths."""
    df = diabetes_frame()
    n = len(df)
    os.makedirs(directory, exist_ok=True)
    parts = {
        "train": df.iloc[: int(n * 0.7)],
        "val": df.iloc[int(n * 0.7) : int(n * 0.85)],
        "test": df.iloc[int(n * 0.85) :],
    }
    paths = {}
    for name, part in parts.items():
        paths[name] = os.path.join(directory, f"{name}.parquet")
        pq.write_table(pa.Table.from_pandas(part, preserve_index=False), paths[name])
    return paths


class TinyRegressor(L.LightningModule):
    """A user's regression model as the README's "Write your own pipeline" shows it: one output, MSE loss, logs
    `val_rmse`."""

    def __init__(self, n_features: int = 10, hidden: int = 16, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(n_features, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        with torch.no_grad():
            self.net[2].bias.fill_(150.0)  # the target's scale, so a few epochs learn something

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)

    def _step(self, batch, stage: str) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log(f"{stage}_loss", loss, sync_dist=stage != "train")
        self.log(f"{stage}_rmse", loss.sqrt(), sync_dist=stage != "train")
        return loss

    def training_step(self, batch, batch_idx):
        return self._step(batch, "train")

    def validation_step(self, batch, batch_idx):
        self._step(batch, "val")

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
