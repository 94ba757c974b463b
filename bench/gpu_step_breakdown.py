"""Where a GPU training step's time goes between a bare PyTorch loop and Lightning: one process, one device.

A diagnostic beside `gpu_smoke` (no target, writes no result file): the same
residual MLP and per-device batch as `gpu_smoke` (width 4096, 8 blocks, ~1.1B
parameters, 256 rows, bf16 autocast, Adam), trained in turn as

- `bare_resident`: a bare loop on one batch that stays on the device (gpu_smoke's baseline);
- `bare_loader`: a bare loop fed by a DataLoader over a CPU `TensorDataset` (default collate,
  pageable memory, `.to(device, non_blocking=True)` as Lightning moves batches);
- `bare_loader_pinned`: the same with `pin_memory=True`;
- `lightning_pageable` and `lightning`: a Lightning `Trainer` (one device, bf16-mixed, no
  logger, no checkpointing, no progress bar) on the platform's `training.data.ParquetDataModule`
  (batched gather) with pinned memory off (as the platform runs it) and on; none of the
  platform's callbacks;

each timed from its `WARMUP`-th step to its last with a device synchronization at both
ends (the host may run ahead in between, as in training). Prints ms per step and
each variant's excess over `bare_resident`. `--dry-run` runs it on CPU with tiny sizes.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from training.parallel import MLPClassifier

WARMUP = 30


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(steps: int, device: str, step_iter: Iterator[None]) -> float:
    """ms per step over steps WARMUP..steps of `step_iter` (each next() runs one step)."""
    start = 0.0
    for i in range(steps):
        next(step_iter)
        if i == WARMUP - 1:
            _sync(device)
            start = time.perf_counter()
    _sync(device)
    return 1000 * (time.perf_counter() - start) / (steps - WARMUP)


def _bare(
    model: torch.nn.Module, batches: Callable[[], Iterator[tuple[torch.Tensor, torch.Tensor]]], device: str
) -> Iterator[None]:
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    while True:
        for x, y in batches():
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            yield None


def main(dry_run: bool, steps: int) -> dict[str, Any]:
    import lightning as L
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from torch.utils.data import DataLoader, TensorDataset

    from training.data import ParquetDataModule

    device = "cpu" if dry_run else "cuda"
    width, blocks, features, classes, batch = (32, 1, 16, 4, 8) if dry_run else (4096, 8, 1024, 16, 256)
    rows = steps * batch
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, features, generator=gen)
    y = x[:, :classes].argmax(dim=1)
    out: dict[str, Any] = {
        "device": device if dry_run else torch.cuda.get_device_name(0),
        "steps": steps,
        "warmup": WARMUP,
    }

    def build() -> torch.nn.Module:
        with torch.device(device):
            return MLPClassifier(n_features=features, n_classes=classes, width=width, blocks=blocks)

    xb, yb = x[:batch].to(device), y[:batch].to(device)
    variants: dict[str, Callable[[], Iterator[tuple[torch.Tensor, torch.Tensor]]]] = {
        "bare_resident": lambda: iter([(xb, yb)] * steps),
        "bare_loader": lambda: iter(DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True)),
        "bare_loader_pinned": lambda: iter(
            DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True, pin_memory=not dry_run)
        ),
    }
    for name, batches in variants.items():
        model = build()
        out[name] = _timed(steps, device, _bare(model, batches, device))
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
        print(name, f"{out[name]:.2f} ms/step", flush=True)

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.n, self.start, self.end = 0, 0.0, 0.0

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.n += 1
            if self.n == WARMUP:
                _sync(device)
                self.start = time.perf_counter()
            elif self.n == steps:
                _sync(device)
                self.end = time.perf_counter()

    with tempfile.TemporaryDirectory() as tmp:
        names = [f"f{i}" for i in range(features)]
        table = pa.table({**{n: x[:, i].numpy() for i, n in enumerate(names)}, "label": y.numpy().astype(np.int64)})
        for split in ("train", "val", "test"):
            pq.write_table(table if split == "train" else table.slice(0, 512), Path(tmp) / f"{split}.parquet")
        for name, pin in (("lightning_pageable", False), ("lightning_pinned", not dry_run)):
            dm = ParquetDataModule(*(str(Path(tmp) / f"{s}.parquet") for s in ("train", "val", "test")), features=names,
                                   target="label", batch_size=batch, pin_memory=pin)
            clock = Clock()
            trainer = L.Trainer(
                accelerator="cpu" if dry_run else "gpu",
                devices=1,
                precision="32-true" if dry_run else "bf16-mixed",
                max_steps=steps,
                limit_val_batches=0,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                callbacks=[clock],
                use_distributed_sampler=False,
                num_sanity_val_steps=0,
            )
            model = build()
            trainer.fit(model, datamodule=dm)
            out[name] = 1000 * (clock.end - clock.start) / (steps - WARMUP)
            del model, trainer
            if device == "cuda":
                torch.cuda.empty_cache()
            print(name, f"{out[name]:.2f} ms/step", flush=True)
    out["excess_ms_over_bare_resident"] = {
        k: out[k] - out["bare_resident"]
        for k in ("bare_loader", "bare_loader_pinned", "lightning_pageable", "lightning_pinned")
    }
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    print(json.dumps(main(args.dry_run, args.steps if not args.dry_run else 60), indent=2))
