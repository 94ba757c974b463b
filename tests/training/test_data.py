"""The Parquet data module's loaders: a batch gathered at once is the batch row-by-row indexing would give."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from training.data import BatchedTensorDataset, ParquetDataModule, collate_batched
from training.resumable import ResumableSampler


def test_a_gathered_batch_equals_the_row_by_row_collated_one() -> None:
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(103, 7, generator=gen), torch.randint(0, 5, (103,), generator=gen)
    plain = DataLoader(TensorDataset(x, y), batch_size=16, sampler=ResumableSampler(103, 16, seed=3, shuffle=True))
    batched = DataLoader(BatchedTensorDataset(x, y), batch_size=16, collate_fn=collate_batched,
                         sampler=ResumableSampler(103, 16, seed=3, shuffle=True))
    pairs = list(zip(plain, batched, strict=True))
    assert len(pairs) == 7  # the last batch is short (103 = 6 x 16 + 7)
    for (px, py), (bx, by) in pairs:
        assert torch.equal(px, bx) and torch.equal(py, by) and bx.dtype == px.dtype and by.dtype == py.dtype
    assert pairs[-1][1][0].shape == (7, 7)


def test_the_module_loads_every_split_in_batches_of_its_size(tmp_path: Path) -> None:
    rows = 50
    table = pa.table(
        {"a": np.arange(rows, dtype=np.float64), "b": -np.arange(rows, dtype=np.float64), "label": np.arange(rows) % 3}
    )
    uris = []
    for split in ("train", "val", "test"):
        pq.write_table(table, tmp_path / f"{split}.parquet")
        uris.append(str(tmp_path / f"{split}.parquet"))
    dm = ParquetDataModule(*uris, features=["a", "b"], target="label", batch_size=8)
    dm.setup()
    batches = list(dm.val_dataloader())
    assert [len(b[0]) for b in batches] == [8] * 6 + [2]
    x, y = batches[0]
    assert x.dtype == torch.float32 and y.dtype == torch.int64
    assert (
        x[:, 0].tolist() == list(range(8))
        and x[:, 1].tolist() == [-v for v in range(8)]
        and y.tolist() == [v % 3 for v in range(8)]
    )
    assert not dm.val_dataloader().pin_memory  # off by default (no gain measured on an H200)
    with pytest.raises(ValueError, match="batch_size"):
        ParquetDataModule(*uris, features=["a"], target="label", batch_size=0)
