"""Data modules the pod can build from a `DataSpec`."""

from __future__ import annotations

from typing import Any, Optional

import fsspec
import lightning as L
import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader, TensorDataset

from training import preprocessing
from training.errors import ConfigError
from training.resumable import ResumableDataLoader, ResumableSampler


def read_parquet_tensors(
    uri: str, features: list[str], target: str, task: str = "classification"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read a Parquet split into float32 features and targets: int64 class indices, or float32 values for `regression`.

    The raw feature columns as numbers, and integer (or bool) labels as they are; `read_split`
    preprocesses the features and encodes any labels.
    """
    with fsspec.open(uri, "rb") as f:
        table = pq.read_table(f, columns=[*features, target])
    # Row-major: pandas hands a multi-column frame over column-major, and torch.export
    # specialises the batch size of a strided view (an embedding lookup on x[:2] guards batch != N).
    x = torch.tensor(np.ascontiguousarray(table.select(features).to_pandas().to_numpy(dtype="float32")))
    y = torch.tensor(table.column(target).to_numpy().astype("float32" if task == "regression" else "int64"))
    return x, y


def read_frame(uri: str, columns: list[str]) -> pd.DataFrame:
    """Columns of a Parquet split as pandas (text stays text, dates dates)."""
    try:
        with fsspec.open(uri, "rb") as f:
            return pq.read_table(f, columns=columns).to_pandas()
    except FileNotFoundError as e:
        raise ConfigError(f"data split {uri!r} does not exist") from e
    except (KeyError, ValueError) as e:
        raise ConfigError(f"data split {uri!r} lacks a column of {columns}: {e}") from e


def fit_preprocessing(
    uris: dict[str, str],
    features: list[str],
    feature_types: dict[str, str],
    domains: dict[str, list[Any]],
    config: dict[str, Any],
) -> dict[str, Any]:
    """The platform's preprocessing state for a Lightning model, fitted on the train split (`training.preprocessing`).

    Numeric features with gaps in the validation or test split only get a missing-value indicator too.

    Raises:
        ConfigError: preprocessing is off and a feature holds text, dates or gaps (naming it).
    """
    frames = {s: read_frame(u, features) for s, u in uris.items()}
    elsewhere = [c for c in features if any(frames[s][c].isna().any() for s in frames if s != "train")]
    try:
        return preprocessing.fit(
            frames["train"], feature_types, domains, config, "lightning", features=features, missing_elsewhere=elsewhere
        )
    except preprocessing.PreprocessingError:
        raise
    except ValueError as e:
        raise ConfigError(f"the train split {uris['train']!r} cannot be preprocessed: {e}") from e


def read_split(
    uri: str,
    features: list[str],
    target: str,
    task: str = "classification",
    state: Optional[dict[str, Any]] = None,
    classes: Optional[list[Any]] = None,
) -> tuple[torch.Tensor, Any]:
    """A split's float32 model input (preprocessed with `state` when given) and its targets.

    Targets: float32 values (regression), int64 indices into `classes`, or (`classes` None)
    the raw labels as a numpy array, for the caller to encode.

    Raises:
        ConfigError: a feature cannot be preprocessed, or a label is not one of `classes`.
    """
    frame = read_frame(uri, [*features, target])
    if state is not None:
        try:
            values = preprocessing.transform(frame, state, np.float32)[0]
        except ValueError as e:
            raise ConfigError(f"data split {uri!r}: {e}") from e
    else:
        values = frame[features].to_numpy(dtype="float32")
    x = torch.tensor(np.ascontiguousarray(values, dtype="float32"))
    labels = frame[target].to_numpy()
    if task == "regression":
        try:
            return x, torch.tensor(labels.astype("float32"))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"target {target!r} is not numeric, so it cannot be a regression target: {e}") from e
    if classes is None:
        return x, labels
    try:
        return x, torch.tensor(preprocessing.encode_labels(labels, classes))
    except ValueError as e:
        raise ConfigError(f"data split {uri!r}, target {target!r}: {e}") from e


def class_labels(target: str, labels: list[np.ndarray]) -> list[Any]:
    """The sorted distinct labels of a classification target over the splits.

    Raises:
        ConfigError: a label is missing, or there is only one class.
    """
    for values in labels:
        missing = int(pd.isna(pd.Series(values, dtype="object")).sum())
        if missing:
            raise ConfigError(f"target {target!r} has {missing} missing label(s); every row needs a label")
    classes = preprocessing.class_list(*labels)
    if len(classes) < 2:
        raise ConfigError(f"target {target!r} has a single class {classes}; classification needs at least two")
    return classes


class BatchedTensorDataset(TensorDataset):
    """A `TensorDataset` that gathers a whole batch with one index per tensor.

    The DataLoader calls `__getitems__` with a batch's indices when a dataset has
    it; `TensorDataset` alone indexes row by row in Python and then stacks the
    rows (about 1.3 ms for 256 rows of 1,024 floats on this machine's CPU, 0.45
    ms this way). The batch holds the same rows in the same order; the loader
    must pass it through (`collate_batched`).
    """

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        index = torch.as_tensor(indices, dtype=torch.long)
        return [t[index] for t in self.tensors]


def collate_batched(batch: Any) -> Any:
    """The collate function for `BatchedTensorDataset`: its batches arrive stacked already."""
    return batch


class ParquetDataModule(L.LightningDataModule):
    """Train/val/test splits of a tabular dataset stored as Parquet (local or s3://).

    Training batches come from a `ResumableSampler` (sharded over ranks, resumable
    mid-epoch); validation and test run over the full split on every rank, so
    their metrics are exact. Loaders carry their own generator, so creating an
    iterator never draws from the global RNG a resumed run restores.

    Args:
        train_uri, val_uri, test_uri: split files written by `validated_data`.
        features: feature columns, in the model's input order.
        target: class label column (classification: any labels, encoded as indices into the
            sorted labels of all splits, `classes()`) or numeric value column (regression).
        batch_size: per-process batch size.
        num_workers: DataLoader workers (0 keeps runs deterministic and cheap).
        seed: seed of the loaders' generators and the training sampler.
        task: `classification` (int64 targets) or `regression` (float32 targets).
        preprocessing: the platform's fitted preprocessing state (`fit_preprocessing`): the
            model then gets its output columns (`n_features` of them); None: the raw
            feature columns as numbers.
        pin_memory: put batches in page-locked memory before they go to a CUDA device. Off by
            default: on one H200 (`bench/gpu_step_breakdown.py`, 1.1B-parameter MLP, 256 rows of
            1,024 floats a step) neither a bare loop (29.09 vs 29.11 ms a step) nor Lightning
            (36.78 vs 37.68 ms) ran faster pinned; Lightning already copies with `non_blocking`.
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
        seed: int = 0,
        task: str = "classification",
        pin_memory: bool = False,
        preprocessing: Optional[dict[str, Any]] = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.uris = {"train": train_uri, "val": val_uri, "test": test_uri}
        self.features = list(features)
        self.target = target
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.task = task
        self.pin_memory = pin_memory
        self.preprocessing_state = preprocessing
        self._sets: dict[str, TensorDataset] = {}
        self._classes: list[Any] = []

    def setup(self, stage: Optional[str] = None) -> None:
        if len(self._sets) == len(self.uris):
            return
        read = {
            s: read_split(u, self.features, self.target, self.task, self.preprocessing_state)
            for s, u in self.uris.items()
        }
        if self.task != "regression":
            self._classes = class_labels(self.target, [y for _, y in read.values()])
            read = {s: (x, torch.tensor(preprocessing.encode_labels(y, self._classes))) for s, (x, y) in read.items()}
        for split, (x, y) in read.items():
            self._sets[split] = BatchedTensorDataset(x, y)

    # The entrypoint turns off Lightning's sampler replacement for data modules that shard themselves.
    handles_distributed_sampling = True

    def _loader(self, split: str, sampler: Optional[ResumableSampler] = None) -> DataLoader:
        cls = ResumableDataLoader if sampler is not None else DataLoader
        return cls(
            self._sets[split],
            batch_size=self.batch_size,
            sampler=sampler,
            shuffle=False,
            num_workers=self.num_workers,
            generator=torch.Generator().manual_seed(self.seed),
            collate_fn=collate_batched,
            pin_memory=self.pin_memory,
        )

    def train_dataloader(self) -> DataLoader:
        # Shard by the strategy's data-parallel rank: under tensor parallelism the
        # ranks of one group must see the same batch.
        shard = (
            (getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {})
            if self.trainer is not None
            else {}
        )
        sampler = ResumableSampler(
            len(self._sets["train"]), self.batch_size, seed=self.seed, shuffle=True,
            rank=shard.get("rank"), world=shard.get("num_replicas"),
        )
        return self._loader("train", sampler)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    @property
    def n_features(self) -> int:
        """The width of the model's input: the preprocessed columns, else the raw features."""
        if self.preprocessing_state is not None:
            return len(preprocessing.output_names(self.preprocessing_state))
        return len(self.features)

    def example_input(self) -> torch.Tensor:
        self.setup()
        return self._sets["train"].tensors[0][:2]

    def classes(self) -> list[Any]:
        """The labels over all splits, sorted; a label's index is its class index (empty for regression)."""
        if self.task == "regression":
            return []
        self.setup()
        return list(self._classes)

    def class_counts(self) -> list[int]:
        """Rows of each class in the train split (by class index)."""
        self.setup()
        return np.bincount(self._sets["train"].tensors[1].numpy(), minlength=len(self._classes)).tolist()
