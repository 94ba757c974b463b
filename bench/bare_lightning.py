"""The baseline: the same model and data trained by a bare Lightning script under torchrun.

Usage: torchrun --nproc-per-node 2 bench/bare_lightning.py DATA_DIR EPOCHS BATCH OUT_JSON
"""

import json
import sys
import time

import lightning as L
import pandas as pd
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from pipelines.vision.models import DigitsMLP


def load(path):
    df = pd.read_parquet(path)
    x = torch.tensor(df.drop(columns=["label"]).to_numpy(dtype="float32"))
    return TensorDataset(x, torch.tensor(df["label"].to_numpy().astype("int64")))


def main() -> None:
    data_dir, epochs, batch, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    L.seed_everything(0, workers=True, verbose=False)
    train, val = load(f"{data_dir}/train.parquet"), load(f"{data_dir}/val.parquet")
    model = DigitsMLP(n_features=train.tensors[0].shape[1], n_classes=10, hidden=64, lr=0.01)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend="gloo"), max_epochs=epochs,
        deterministic=True, enable_progress_bar=False, enable_model_summary=False, default_root_dir=f"{out}.dir",
    )
    start = time.perf_counter()
    trainer.fit(model, DataLoader(train, batch_size=batch, shuffle=True), DataLoader(val, batch_size=batch))
    seconds = time.perf_counter() - start
    if trainer.global_rank == 0:
        samples = len(train) * epochs
        with open(out, "w") as f:
            json.dump({"samples": samples, "seconds": seconds, "samples_per_second": samples / seconds}, f)


if __name__ == "__main__":
    main()
