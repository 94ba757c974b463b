"""Checkpointing: what a save blocks, what it slows, and how close it writes to the disk's own bandwidth.

Every write here is durable: after `CheckpointStore.save` commits, the
benchmark fsyncs the step directory's files and the directory (the store
itself does not fsync; without it a save would be timed into the page cache).

1. Blocking (a ~100M-parameter model with Adam state: weights and two moments,
   fp32, ~1.2 GB). A synchronous save (`CheckpointStore.save` + fsync) against an
   asynchronous one (`AsyncCheckpointWriter.submit`, which copies to host memory
   and returns; the write and fsync run in the writer's thread). The first
   asynchronous save is measured apart: its copy lands in freshly allocated host
   memory (later ones reuse warm buffers), and its whole write is what the first
   save used to block for when FaultTolerance waited on it to measure the save
   time (it no longer does: the time is agreed once the write is done).
2. Slowdown: a CPU training step (an MLP forward/backward and SGD step, this
   process) timed with no write in flight, then while an asynchronous write is
   in flight.
3. Size curve: fp32 weights of 100M, 300M and 1B parameters (0.4, 1.2, 4 GB)
   saved synchronously (+ fsync), against the disk's write bandwidth measured
   the same way a plain `dd` would: the same number of bytes written in 64 MiB
   chunks to one file, then fsync.

Value: median blocking time of a warm asynchronous save; baseline: median
synchronous save time; ratio = async / sync (lower is better, target <= 0.05).
Targets also: each size's write rate >= 0.7 of the disk's measured bandwidth.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.harness import Target, write_result
from training.checkpointing import AsyncCheckpointWriter, CheckpointStore

LAYER = (4096, 4096)
LAYERS = 6  # 6 x 16.8M = 100.7M parameters
REPEATS = 3
CURVE = {"100M": 100_000_000, "300M": 300_000_000, "1B": 1_000_000_000}
CURVE_REPEATS = 2
CHUNK = 64 * 2**20
STEPS_IDLE = 30


class DurableStore(CheckpointStore):
    """The store, plus fsync of what it committed, so a save's time is the time to durable bytes."""

    def save(self, step: int, state: dict[str, Any], **kwargs: Any) -> str:
        uri = super().save(step, state, **kwargs)
        fsync_tree(Path(uri))
        return uri


def fsync_tree(directory: Path) -> None:
    for p in directory.iterdir():
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def adam_state(step: int) -> dict[str, Any]:
    torch.manual_seed(step)
    weights = {f"layer{i}.weight": torch.randn(*LAYER) for i in range(LAYERS)}
    return {
        "state_dict": weights,
        "optimizer": {"exp_avg": {k: torch.randn_like(v) for k, v in weights.items()},
                      "exp_avg_sq": {k: torch.rand_like(v) for k, v in weights.items()}},
        "global_step": step,
    }


def disk_write_seconds(path: Path, nbytes: int) -> float:
    """Seconds to write `nbytes` to a new file in 64 MiB chunks and fsync it (what `dd ... conv=fsync` does)."""
    chunk = os.urandom(CHUNK)
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, memoryview(chunk)[: min(CHUNK, left)])
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - started
    path.unlink()
    return seconds


def _blocking(tmp: Path) -> dict[str, Any]:
    payload = adam_state(0)
    sync_store = DurableStore(str(tmp / "sync"), keep_last=1)
    sync_times = []
    for step in range(1, REPEATS + 1):
        started = time.perf_counter()
        sync_store.save(step, payload)
        sync_times.append(time.perf_counter() - started)
    first: dict[str, float] = {}
    warm: list[float] = []
    writes: list[float] = []
    with AsyncCheckpointWriter(DurableStore(str(tmp / "async"), keep_last=1)) as writer:
        started = time.perf_counter()
        writer.submit(1, payload)
        first["blocking_s"] = writer.blocking_seconds
        writer.wait()
        first["until_written_s"] = time.perf_counter() - started
        for step in range(2, REPEATS + 2):
            before = writer.blocking_seconds
            writer.submit(step, payload)
            warm.append(writer.blocking_seconds - before)
            writer.wait()  # measure the save itself, not waiting for the previous write
        slowdown = _slowdown(writer, payload)
        writes = list(writer.save_seconds)
    return {"sync": sync_times, "first": first, "warm": warm, "writes": writes, "slowdown": slowdown,
            "bytes": sum(t.numel() * t.element_size() for t in _tensors(payload))}


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    return []


def _slowdown(writer: AsyncCheckpointWriter, payload: dict[str, Any]) -> dict[str, Any]:
    """Step time of a CPU training step idle, and while an asynchronous write of `payload` is in flight."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, 512)

    def step() -> float:
        started = time.perf_counter()
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        return time.perf_counter() - started

    for _ in range(5):
        step()
    idle = [step() for _ in range(STEPS_IDLE)]
    writer.submit(10_000, payload)
    during = []
    while writer.in_flight:
        during.append(step())
    writer.wait()
    return {"idle_step_ms": statistics.median(idle) * 1e3, "in_flight_step_ms": statistics.median(during) * 1e3 if during else None,
            "in_flight_steps": len(during), "slowdown": statistics.median(during) / statistics.median(idle) if during else None}


def _curve(tmp: Path) -> dict[str, Any]:
    out = {}
    for label, params in CURVE.items():
        weights = {f"w{i}": torch.ones(params // 4) for i in range(4)}  # 4 tensors, fp32
        nbytes = params // 4 * 4 * 4
        store = DurableStore(str(tmp / f"curve-{label}"), keep_last=1)
        saves, disk = [], []
        for r in range(CURVE_REPEATS):
            disk.append(disk_write_seconds(tmp / "dd.bin", nbytes))
            started = time.perf_counter()
            store.save(r + 1, {"state_dict": weights})
            saves.append(time.perf_counter() - started)
        del weights
        save_s, disk_s = statistics.median(saves), statistics.median(disk)
        out[label] = {"parameters": params, "bytes": nbytes, "save_s": saves, "disk_s": disk,
                      "save_mb_per_s": nbytes / save_s / 1e6, "disk_mb_per_s": nbytes / disk_s / 1e6,
                      "fraction_of_disk": disk_s / save_s}
    return out


def main() -> dict:
    with tempfile.TemporaryDirectory(dir=os.environ.get("TRAINYARD_BENCH_DISK")) as tmp:
        blocking = _blocking(Path(tmp))
        curve = _curve(Path(tmp))
    value, baseline = statistics.median(blocking["warm"]), statistics.median(blocking["sync"])
    return write_result(
        "checkpoint_blocking",
        value,
        "s blocked per save",
        baseline,
        {
            "what": "training blocked by an asynchronous save (warm host buffers) / by a synchronous save, ~100M parameters "
            "with Adam state; every save fsynced",
            "parameters": LAYERS * LAYER[0] * LAYER[1],
            "checkpoint_bytes": blocking["bytes"],
            "sync_save_s": blocking["sync"],
            "async_blocking_s": blocking["warm"],
            "async_write_s": blocking["writes"],
            "first_async_save": {**blocking["first"], "note": "cold host buffers; until_written_s is what training waited "
                                 "when the first save blocked in full (FaultTolerance before this change)"},
            "step_slowdown_while_writing": blocking["slowdown"],
            "size_curve": curve,
            "storage": f"local disk ({tmp}), fsync after every save and after the dd-like write",
        },
        targets=[Target("ratio", "<=", 0.05)]
        + [Target(f"details.size_curve.{label}.fraction_of_disk", ">=", 0.7, unit="of disk bw") for label in CURVE],
        better="lower",
        runs=blocking["warm"],
        baseline_runs=blocking["sync"],
    )


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
