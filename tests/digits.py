"""Tiny deterministic data for tests: scikit-learn's bundled digits, split and written as Parquet."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq


def digits_frame(n: int | None = None):
    from sklearn.datasets import load_digits

    bunch = load_digits(as_frame=True)
    df = bunch.frame.rename(columns={"target": "label"})
    df.columns = [c.replace("pixel_", "px") for c in df.columns]
    return df if n is None else df.iloc[:n].reset_index(drop=True)


def write_splits(directory: str, n: int = 600) -> dict[str, str]:
    """Write train/val/test Parquet files; returns their paths and the feature list."""
    df = digits_frame(n)
    os.makedirs(directory, exist_ok=True)
    parts = {
        "train": df.iloc[: int(n * 0.7)],
        "val": df.iloc[int(n * 0.7) : int(n * 0.85)],
        "test": df.iloc[int(n * 0.85) :],
    }
    paths = {}
    for name, part in parts.items():
        path = os.path.join(directory, f"{name}.parquet")
        pq.write_table(pa.Table.from_pandas(part, preserve_index=False), path)
        paths[name] = path
    return paths


def features() -> list[str]:
    return [c for c in digits_frame(1).columns if c != "label"]
