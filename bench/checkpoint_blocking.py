"""Async checkpointing: how long training is blocked per save, vs a synchronous save.

A ~100M-parameter model with Adam state (weights + two moments, fp32: ~1.2 GB) is
saved through `CheckpointStore` synchronously, then through
`AsyncCheckpointWriter`, whose caller waits only for the copy to host memory.
Saves repeat, as in training, so the writer's host buffers are warm. Value:
mean blocking time of an async save; baseline: mean synchronous save time.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time

import torch

from bench.harness import write_result
from training.checkpointing import AsyncCheckpointWriter, CheckpointStore

PARAMS_PER_LAYER = 4096 * 4096
LAYERS = 6  # 6 x 16.8M = 100.7M parameters
REPEATS = 3


def state(step: int) -> dict:
    torch.manual_seed(step)
    weights = {f"layer{i}.weight": torch.randn(4096, 4096) for i in range(LAYERS)}
    return {
        "state_dict": weights,
        "optimizer": {"exp_avg": {k: torch.zeros_like(v) for k, v in weights.items()},
                      "exp_avg_sq": {k: torch.zeros_like(v) for k, v in weights.items()}},
        "global_step": step,
    }


def main() -> dict:
    payload = state(0)
    params = LAYERS * PARAMS_PER_LAYER
    with tempfile.TemporaryDirectory() as tmp:
        sync_store = CheckpointStore(f"{tmp}/sync", keep_last=1)
        sync_times = []
        for step in range(1, REPEATS + 1):
            started = time.perf_counter()
            sync_store.save(step, payload)
            sync_times.append(time.perf_counter() - started)
        async_store = CheckpointStore(f"{tmp}/async", keep_last=1)
        blocking = []
        with AsyncCheckpointWriter(async_store) as writer:
            for step in range(1, REPEATS + 1):
                writer.wait()  # measure the save itself, not waiting for the previous write
                before = writer.blocking_seconds
                writer.submit(step, payload)
                blocking.append(writer.blocking_seconds - before)
                time.sleep(0.05)  # the training steps between saves
            writer.wait()
            write_times = list(writer.save_seconds)
    value, baseline = statistics.mean(blocking), statistics.mean(sync_times)
    return write_result(
        "checkpoint_blocking",
        value,
        "s",
        baseline,
        {
            "parameters": params,
            "checkpoint_bytes": params * 4 * 3,
            "async_blocking_seconds": blocking,
            "sync_save_seconds": sync_times,
            "async_background_write_seconds": write_times,
            "target": "ratio <= 0.1",
            "storage": "local disk (tmp)",
        },
    )


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
