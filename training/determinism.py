"""Determinism settings applied from the spec, and what they cannot guarantee.

`apply(deterministic, accelerator, num_workers)` seeds nothing itself (the entrypoint
calls `seed_everything(seed, workers=True)`, which also seeds DataLoader
workers); it sets the flags that make kernels deterministic and returns the
caveats that remain, which the entrypoint logs as one warning and records in
the result's lineage.
"""

from __future__ import annotations

import os

import torch


def apply(deterministic: bool, accelerator: str, num_workers: int = 0, world_size: int = 1) -> list[str]:
    if not deterministic:
        return ["deterministic=False: kernels may choose non-deterministic algorithms; reruns can differ"]
    caveats: list[str] = []
    # Must be set before the first cuBLAS call for deterministic GEMMs on CUDA >= 10.2.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=False)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    if accelerator == "gpu":
        caveats.append(
            "GPU results are reproducible on the same GPU model, driver and CUDA/cuDNN versions only; compare across "
            "machines with a tolerance"
        )
        if world_size > 1:
            caveats.append(
                "NCCL reductions are deterministic for a fixed world size and topology only; a different node count "
                "changes the reduction order"
            )
    if num_workers > 0:
        caveats.append(
            f"{num_workers} DataLoader workers: seeded per worker, but a custom IterableDataset must shard "
            "deterministically itself"
        )
    return caveats
