"""A small business table as a warehouse exports it, split into Parquet files, and the one-logit model a team writes for
it.

Importable without Dagster (training processes import the model by path).
`write_business_splits` writes train/val/test Parquet files holding string
categoricals (one with a level seen only outside train), a date column (a
pandas date column in the Parquet files), an id, ~5% empty numeric and text
cells and a "yes"/"no" target with ~6% positives.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd
import torch

from tests.business import OneLogitChurnNet

FEATURES = ["plan", "country", "signup_date", "tenure", "charges", "calls"]
FEATURE_TYPES = {
    "plan": "category",
    "country": "str",
    "signup_date": "date",
    "tenure": "int",
    "charges": "float",
    "calls": "float",
}
TARGET = "churned"
KEEP = ["customer_id"]


def business_table(rows: int, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    plan = rng.choice(["basic", "plus", "pro"], size=rows, p=[0.5, 0.3, 0.2]).astype(object)
    country = rng.choice(["DE", "FR", "NL", "PL"], size=rows).astype(object)
    tenure = rng.integers(1, 72, size=rows)
    charges = rng.normal(55, 18, size=rows).clip(5, 150)
    calls = rng.poisson(1.2, size=rows).astype("float64")
    signup = [dt.date(2019, 1, 1) + dt.timedelta(days=int(d)) for d in rng.integers(0, 4 * 365, size=rows)]
    score = -4.3 + 1.8 * (plan == "basic") + 0.05 * (charges - 55) - 0.04 * (tenure - 36) + 0.6 * (calls - 1.2)
    churned = np.where(rng.random(rows) < 1 / (1 + np.exp(-score)), "yes", "no")
    frame = pd.DataFrame({"customer_id": [f"C{i:06d}" for i in range(rows)], "plan": plan, "country": country,
                          "signup_date": signup, "tenure": tenure, "charges": charges, "calls": calls, TARGET: churned})
    for column, rate in (("charges", 0.05), ("calls", 0.05), ("country", 0.05)):
        frame.loc[rng.random(rows) < rate, column] = None
    return frame


def write_business_splits(directory: Path, rows: int = 1500, seed: int = 0) -> dict[str, str]:
    """train/val/test Parquet files (70/15/15); the val and test splits also hold a plan ("enterprise") train never
    saw."""
    frame = business_table(rows, seed)
    cut = [int(rows * 0.7), int(rows * 0.85)]
    parts = {
        "train": frame.iloc[: cut[0]].copy(),
        "val": frame.iloc[cut[0] : cut[1]].copy(),
        "test": frame.iloc[cut[1] :].copy(),
    }
    for split in ("val", "test"):
        parts[split].iloc[:5, parts[split].columns.get_loc("plan")] = "enterprise"
    directory.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, part in parts.items():
        path = directory / f"{split}.parquet"
        part.reset_index(drop=True).to_parquet(path, index=False)
        paths[split] = str(path)
    return paths


class OneLogitNet(OneLogitChurnNet):
    """The one-logit `BCEWithLogitsLoss` model of `tests.business`, smaller (16 hidden units)."""

    def __init__(
        self, n_features: int, hidden: int = 16, lr: float = 0.01, class_weights: Optional[torch.Tensor] = None
    ) -> None:
        super().__init__(n_features, hidden, lr, class_weights=class_weights)


class NoWeightsNet(OneLogitNet):
    """A one-logit model whose constructor takes no class weights."""

    def __init__(self, n_features: int, hidden: int = 16, lr: float = 0.01) -> None:
        super().__init__(n_features, hidden, lr)
