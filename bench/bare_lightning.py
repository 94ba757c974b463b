"""The reference: the same model and data trained by a bare Lightning script under torchrun.

No platform: a plain `DataLoader` over tensors, Lightning's `DistributedSampler`,
no logger, no checkpointing, no callbacks but the model's own step clock
(`bench.steady_model.StepClock`). Trainer settings the platform also sets are
the same (deterministic, no sanity validation, logging interval).

Usage: torchrun --nproc-per-node N bench/bare_lightning.py DATA_DIR BATCH CLOCK_JSON MODEL_KWARGS_JSON
"""

import json
import os
import sys

import lightning as L
import pandas as pd
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from bench.steady_model import TimedMLP


def load(path: str) -> TensorDataset:
    df = pd.read_parquet(path)
    x = torch.tensor(df.drop(columns=["label"]).to_numpy(dtype="float32"))
    return TensorDataset(x, torch.tensor(df["label"].to_numpy().astype("int64")))


def main() -> None:
    data_dir, batch, clock, model_kwargs = sys.argv[1], int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
    L.seed_everything(0, workers=True, verbose=False)
    train, val = load(f"{data_dir}/train.parquet"), load(f"{data_dir}/val.parquet")
    model = TimedMLP(clock_path=clock, n_features=train.tensors[0].shape[1], **model_kwargs)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=DDPStrategy(process_group_backend="gloo") if world > 1 else "auto",
        max_epochs=1,
        deterministic=True,
        num_sanity_val_steps=0,
        log_every_n_steps=50,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=f"{clock}.dir",
    )
    trainer.fit(model, DataLoader(train, batch_size=batch, shuffle=True), DataLoader(val, batch_size=batch))


if __name__ == "__main__":
    main()
