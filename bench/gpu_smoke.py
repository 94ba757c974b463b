"""GPU smoke benchmark: the platform's entrypoint with NCCL and bf16 vs a bare PyTorch loop.

Run on a machine with NVIDIA GPUs: `bash bench/gpu_smoke.sh`. For every local GPU it
launches `training.entrypoint` through the local launcher (torchrun, one process
per GPU) with DDP and with FSDP2, bf16 mixed precision, on a synthetic
classification set and a residual MLP (`training.parallel.MLPClassifier`), and a
bare PyTorch DDP-free loop on one GPU on the same model and batch. Reports
samples/s and model FLOPs utilization (6 x parameters FLOPs per sample, against the
device's dense bf16 peak). `--dry-run` runs the same code path on CPU with tiny
sizes (used by the tests; never needs a GPU).

Value: platform DDP samples/s per device; baseline: the bare loop on one
device; ratio = platform / bare (higher is better), target >= 0.98, the
steady-state target of `platform_overhead`. Caveat: the platform figure is the
trial's samples / fit seconds, which still includes checkpointing and
validation inside the fit (issue 16 asks for a steady-state window), and DDP
communication the one-device loop does not pay.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import Target, write_result

# Dense bf16 peak FLOP/s by device name fragment (vendor data sheets).
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10": 125e12}


def peak_flops(name: str) -> float:
    for key, value in PEAK_BF16.items():
        if key in name:
            return value
    return float(os.environ.get("TRAINYARD_PEAK_FLOPS", "0")) or 1e12


def write_data(directory: Path, rows: int, features: int, classes: int) -> list[str]:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, features), dtype=np.float32)
    y = (x[:, :classes].argmax(axis=1)).astype(np.int64)
    names = [f"f{i}" for i in range(features)]
    table = pa.table({**{n: x[:, i] for i, n in enumerate(names)}, "label": y})
    for split in ("train", "val", "test"):
        pq.write_table(table, directory / f"{split}.parquet")
    return names


def bare_loop(width: int, blocks: int, features: int, classes: int, batch: int, steps: int, device: str) -> float:
    import torch

    from training.parallel import MLPClassifier

    model = MLPClassifier(n_features=features, n_classes=classes, width=width, blocks=blocks).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(batch, features, device=device)
    y = torch.randint(0, classes, (batch,), device=device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    for i in range(steps + 3):
        if i == 3:
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
        with torch.autocast(device_type=device, dtype=dtype, enabled=device == "cuda"):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    if device == "cuda":
        torch.cuda.synchronize()
    return steps * batch / (time.perf_counter() - start)


def main(dry_run: bool = False) -> dict[str, Any]:
    import torch

    from resources.launcher import LocalLauncher
    from training.spec import DataSpec, Distribution, ImportTarget, TrainSpec

    gpus = 0 if dry_run else torch.cuda.device_count()
    if not dry_run and gpus == 0:
        raise SystemExit("gpu_smoke needs NVIDIA GPUs (torch.cuda.device_count() == 0); use --dry-run on CPU")
    width, blocks, features, classes, batch, rows = (32, 1, 16, 4, 32, 256) if dry_run else (4096, 8, 1024, 16, 256, 65536)
    procs = 2 if dry_run else gpus
    results: dict[str, Any] = {"gpus": gpus, "device": "cpu" if dry_run else torch.cuda.get_device_name(0)}
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        names = write_data(tmp_path, rows, features, classes)
        kwargs = {"width": width, "blocks": blocks}
        params = None
        for strategy in ("ddp", "fsdp"):
            spec = TrainSpec(
                pipeline="bench/gpu-smoke",
                trial_id=f"trial-{strategy}",
                model=ImportTarget(path="training.parallel:MLPClassifier", kwargs=kwargs),
                data=DataSpec(train_uri=str(tmp_path / "train.parquet"), val_uri=str(tmp_path / "val.parquet"),
                              test_uri=str(tmp_path / "test.parquet"), features=names, target="label", version="synthetic"),
                output_uri=str(tmp_path / strategy),
                max_epochs=1,
                batch_size=batch,
                deterministic=False,
                precision="32-true" if dry_run else "bf16-mixed",
                distribution=Distribution(procs_per_node=procs, strategy=strategy, accelerator="cpu" if dry_run else "gpu"),
            )
            result = LocalLauncher(timeout_seconds=1800).launch(spec).result
            results[strategy] = {"samples_per_second": result.samples_per_second, "fit_seconds": result.fit_seconds}
        from training.parallel import MLPClassifier

        params = sum(p.numel() for p in MLPClassifier(n_features=features, n_classes=classes, **kwargs).parameters())
        bare = bare_loop(width, blocks, features, classes, batch, 5 if dry_run else 50, "cpu" if dry_run else "cuda")
    peak = peak_flops(results["device"]) * max(procs, 1)
    for strategy in ("ddp", "fsdp"):
        results[strategy]["mfu"] = 6 * params * results[strategy]["samples_per_second"] / peak
    results["bare_single_device"] = {"samples_per_second": bare, "mfu": 6 * params * bare / (peak / max(procs, 1))}
    results["parameters"] = params
    value = results["ddp"]["samples_per_second"] / max(procs, 1)
    return write_result(
        "gpu_smoke" if not dry_run else "gpu_smoke_dry_run",
        value,
        "samples/s per device",
        bare,
        {**results, "note": "value: platform DDP per device; baseline: bare PyTorch loop on one device"},
        targets=[Target("ratio", ">=", 0.98)],
        better="higher",
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--dry-run", action="store_true")
    print(json.dumps(main(parser.parse_args().dry_run), indent=2))
