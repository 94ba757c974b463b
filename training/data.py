"""Data modules the pod can build from a `DataSpec`."""

from __future__ import annotations

from typing import Optional

import fsspec
import lightning as L
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader, TensorDataset


def read_parquet_tensors(uri: str, features: list[str], target: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Read a Parquet split into (float32 features, int64 targets)."""
    with fsspec.open(uri, "rb") as f:
        table = pq.read_table(f, columns=[*features, target])
    x = torch.tensor(table.select(features).to_pandas().to_numpy(dtype="float32"))
    y = torch.tensor(table.column(target).to_numpy().astype("int64"))
    return x, y


class ParquetDataModule(L.LightningDataModule):
    """Train/val/test splits of a tabular dataset stored as Parquet (local or s3://).

    Args:
        train_uri, val_uri, test_uri: split files written by `validated_data`.
        features: feature columns, in the model's input order.
        target: integer class label column.
        batch_size: per-process batch size.
        num_workers: DataLoader workers (0 keeps runs deterministic and cheap).
    """

    def __init__(
        self,
        train_uri: str,
        val_uri: str,
        test_uri: str,
        features: list[str],
        target: str,
        batch_size: int = 64,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.uris = {"train": train_uri, "val": val_uri, "test": test_uri}
        self.features = list(features)
        self.target = target
        self.batch_size = batch_size
        self.num_workers = num_workers
        self._sets: dict[str, TensorDataset] = {}

    def setup(self, stage: Optional[str] = None) -> None:
        for split, uri in self.uris.items():
            if split not in self._sets:
                self._sets[split] = TensorDataset(*read_parquet_tensors(uri, self.features, self.target))

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        return DataLoader(self._sets[split], batch_size=self.batch_size, shuffle=shuffle, num_workers=self.num_workers)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", shuffle=False)

    @property
    def n_features(self) -> int:
        return len(self.features)

    def example_input(self) -> torch.Tensor:
        self.setup()
        return self._sets["train"].tensors[0][:2]

    def classes(self) -> list[int]:
        self.setup()
        return sorted({int(v) for s in self._sets.values() for v in s.tensors[1].tolist()})
