"""A churn team's customer export as it leaves their warehouse, and the models such a team writes for it.

`churn_export` generates the table; `land_export` writes it as the warehouse
exports it: three CSV files and one Parquet file, with string categoricals
(plan, country), a signup date (text in the CSV files, a date column in the
Parquet file), a customer id, numeric columns with 3-8% empty cells, and a
"yes"/"no" target with about 5.5% positives. Nothing here converts anything:
the platform must take it as it is.

`OneLogitChurnNet` is the Lightning model most people write for a binary target:
one logit per row, `BCEWithLogitsLoss` against the 0/1 label, `val_loss` logged.
It imports without Dagster (training processes import it).
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any, Optional

import lightning as L
import numpy as np
import torch
from torch import nn

PLANS = ["basic", "plus", "pro", "family"]
COUNTRIES = ["DE", "FR", "NL", "PL", "ES", "IT", "SE"]
TARGET = "churned"


def churn_columns() -> dict[str, Any]:
    """The export's columns as a team declares them (README, "A business table")."""
    from trainyard.spec import ColumnSpec

    return {
        "customer_id": ColumnSpec(dtype="str", role="id"),
        "plan": ColumnSpec(dtype="category", domain=PLANS),
        "country": ColumnSpec(dtype="str", nullable=True),
        "signup_date": ColumnSpec(dtype="date"),
        "tenure_months": ColumnSpec(dtype="int", min=0),
        "monthly_charges": ColumnSpec(dtype="float", min=0, nullable=True),
        "support_calls": ColumnSpec(dtype="int", min=0, nullable=True),
        TARGET: ColumnSpec(dtype="str", domain=["no", "yes"]),
    }


def churn_export(rows: int, seed: int = 0, start_id: int = 0, charges_shift: float = 0.0) -> Any:
    """A pandas frame of `rows` customers; churn depends on plan, tenure, charges and support calls (~5.5% "yes")."""
    import pandas as pd

    rng = np.random.default_rng(seed)
    plan = rng.choice(PLANS, size=rows, p=[0.45, 0.25, 0.2, 0.1])
    country = rng.choice(COUNTRIES, size=rows).astype(object)
    tenure = rng.integers(1, 72, size=rows)
    charges = np.round(rng.normal(55, 18, size=rows).clip(5, 150) + charges_shift, 2)
    calls = rng.poisson(1.2, size=rows)
    signup = [dt.date(2019, 1, 1) + dt.timedelta(days=int(d)) for d in rng.integers(0, 5 * 365, size=rows)]
    score = (-4.15 + 1.3 * (plan == "basic") - 0.9 * (plan == "pro") + 0.045 * (charges - charges_shift - 55)
             - 0.035 * (tenure - 36) + 0.55 * (calls - 1.2))
    churned = np.where(rng.random(rows) < 1 / (1 + np.exp(-score)), "yes", "no")
    frame = pd.DataFrame({
        "customer_id": [f"C{start_id + i:07d}" for i in range(rows)],
        "plan": plan,
        "country": country,
        "signup_date": signup,
        "tenure_months": tenure,
        "monthly_charges": charges.astype("float64"),
        "support_calls": calls.astype("float64"),
        TARGET: churned,
    })
    # The gaps of a real export: 3-8% empty cells in the numeric and text columns.
    for column, rate in (("monthly_charges", 0.05), ("support_calls", 0.03), ("country", 0.08)):
        frame.loc[rng.random(rows) < rate, column] = None
    frame["support_calls"] = frame["support_calls"].astype("Int64")  # an integer column with gaps
    return frame


def land_export(landing: Path, frame: Any, stem: str = "export", csv_parts: int = 3) -> list[Path]:
    """Write `frame` as the warehouse does: `csv_parts` CSV files (dates as text) and one Parquet file (a date
    column)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    landing.mkdir(parents=True, exist_ok=True)
    parts = np.array_split(np.arange(len(frame)), csv_parts + 1)
    written = []
    for i, rows in enumerate(parts[:-1]):
        path = landing / f"{stem}-{i}.csv"
        part = frame.iloc[rows].copy()
        part["signup_date"] = [d.isoformat() for d in part["signup_date"]]
        part.to_csv(path, index=False)
        written.append(path)
    path = landing / f"{stem}-{csv_parts}.parquet"
    pq.write_table(pa.Table.from_pandas(frame.iloc[parts[-1]], preserve_index=False), path)
    written.append(path)
    return written


class OneLogitChurnNet(L.LightningModule):
    """One logit per row and `BCEWithLogitsLoss`: the binary classifier most people write.

    `pos_weight` weighs the positives; `class_weights` (what `class_weight="balanced"` hands a model) sets it
    to `class_weights[1] / class_weights[0]`.
    """

    def __init__(self, n_features: int, hidden: int = 32, lr: float = 0.01, pos_weight: Optional[float] = None,
                 class_weights: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["class_weights"])
        self.net = nn.Sequential(nn.Linear(n_features, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        weight = (class_weights[1] / class_weights[0]).reshape(1) if class_weights is not None else (
            None if pos_weight is None else torch.tensor([pos_weight]))
        self.loss = nn.BCEWithLogitsLoss(pos_weight=weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss(self(x), y.float())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", self.loss(self(x), y.float()), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
