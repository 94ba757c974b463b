"""Checkpointing: what a save blocks, what it slows, and how close it writes to the disk's own bandwidth.

Every write here is durable: after `CheckpointStore.save` commits, the
benchmark fsyncs the step directory's files and the directory (the store
itself does not fsync; without it a save would be timed into the page cache).

1. Blocking (a ~100M-parameter MLP with Adam, stepped for real in this process:
   weights and two moments, fp32, ~1.2 GB). A synchronous save
   (`CheckpointStore.save` + fsync) against an asynchronous one as
   FaultTolerance makes it: `AsyncCheckpointWriter.submit(..., defer=...)`
   copies what is not deferred and returns, the writer thread copies the
   weights and optimizer state while the next step's forward and backward run,
   and `fence()` before that step's `opt.step()` waits for the copy; the write
   and fsync run in the writer's thread. Held time = submit + the fence's wait.
   Reported beside it: the same saves copied whole at submit (no deferring, the
   figure before 2026-12-06), and each save's whole cost to training (submit +
   the next step's wall time, minus an idle step: the copy's contention with
   the step's compute included). The first asynchronous save is measured apart:
   its copy lands in freshly allocated host memory (later ones reuse warm
   buffers), and its whole write is what the first save used to block for when
   FaultTolerance waited on it to measure the save time.
2. Slowdown: a CPU training step (an MLP forward/backward and SGD step, this
   process) timed with no write in flight, then while an asynchronous write is
   in flight.
3. Size curve: fp32 weights of 100M, 300M and 1B parameters (0.4, 1.2, 4 GB)
   saved synchronously (+ fsync), against the disk's write bandwidth measured
   the same way a plain `dd` would: the same number of bytes written in 64 MiB
   chunks to one file, then fsync.

Retention (keep_last=1 here, so every save after the first drops one) deletes
the dropped checkpoint behind the save, on a background thread, as it does in
training; the synchronous saves of 1 and 3 wait for that deletion after their
timed window, so neither the next save nor the `dd` write shares the disk with
it, and each deletion's time is reported apart (`retention_s`).

Value: median held time of a warm asynchronous save; baseline: median
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
from typing import Any, Callable, Optional

import torch
from torch import nn

from bench.harness import Target, write_result
from training.checkpointing import AsyncCheckpointWriter, CheckpointStore, deferrable_storages

LAYER = (4096, 4096)
LAYERS = 6  # 6 x 16.8M = 100.7M parameters
BATCH = 16
REPEATS = 3
CURVE = {"100M": 100_000_000, "300M": 300_000_000, "1B": 1_000_000_000}
# this machine's virtual disk writes the same bytes in 0.5 s or 3 s from one write to the next: a median of 2 was a mean
CURVE_REPEATS = 5
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


class Trained:
    """A ~100M-parameter MLP with Adam, stepped for real: the state a checkpoint of training holds."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(*[nn.Linear(*LAYER) for _ in range(LAYERS)])
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(BATCH, LAYER[0])
        self.step()  # Adam's moments exist from the first step

    def step(self, fence: Optional[Callable[[], None]] = None) -> None:
        self.opt.zero_grad()
        self.model(self.x).pow(2).mean().backward()
        if fence is not None:
            fence()  # what FaultTolerance.on_before_optimizer_step does
        self.opt.step()

    def state(self, step: int) -> dict[str, Any]:
        return {"state_dict": self.model.state_dict(), "optimizer": self.opt.state_dict(), "global_step": step}


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
    trained = Trained()
    sync_store = DurableStore(str(tmp / "sync"), keep_last=1)
    sync_times = []
    for step in range(1, REPEATS + 1):
        started = time.perf_counter()
        sync_store.save(step, trained.state(step))
        sync_times.append(time.perf_counter() - started)
        sync_store.flush()  # retention's deletion runs behind the save, during training: untimed, reported apart
    keys = deferrable_storages([trained.model], [trained.opt])

    def timed_step(fence: Optional[Callable[[], None]] = None) -> float:
        started = time.perf_counter()
        trained.step(fence)
        return time.perf_counter() - started

    idle = [timed_step() for _ in range(REPEATS + 1)][1:]
    first: dict[str, float] = {}
    held: list[float] = []
    save_and_step: list[float] = []
    undeferred: list[float] = []
    undeferred_save_and_step: list[float] = []
    with AsyncCheckpointWriter(DurableStore(str(tmp / "async"), keep_last=1)) as writer:
        started = time.perf_counter()
        writer.submit(1, trained.state(1), defer=keys)
        trained.step(writer.fence)
        first["blocking_s"] = writer.blocking_seconds
        writer.wait()
        first["until_written_s"] = time.perf_counter() - started
        for step in range(2, REPEATS + 2):
            before = writer.blocking_seconds
            started = time.perf_counter()
            writer.submit(step, trained.state(step), defer=keys)
            trained.step(writer.fence)  # the next step: its forward and backward overlap the copy
            save_and_step.append(time.perf_counter() - started)
            held.append(writer.blocking_seconds - before)
            writer.wait()  # measure the save itself, not waiting for the previous write
        for step in range(REPEATS + 2, 2 * REPEATS + 2):  # the same saves copied whole before training goes on
            before = writer.blocking_seconds
            started = time.perf_counter()
            writer.submit(step, trained.state(step))
            undeferred.append(writer.blocking_seconds - before)
            trained.step()
            undeferred_save_and_step.append(time.perf_counter() - started)
            writer.wait()
        slowdown = _slowdown(writer, trained.state(0))
        writes = list(writer.save_seconds)
        deferred_saves, dropped = writer.deferred_saves, list(writer.dropped)
    idle_s = statistics.median(idle)
    return {
        "sync": sync_times,
        "sync_retention_s": sync_store.retention_seconds,
        "first": first,
        "warm": held,
        "writes": writes,
        "slowdown": slowdown,
        "undeferred": undeferred,
        "deferred_saves": deferred_saves,
        "dropped": dropped,
        "idle_step_s": idle,
        "save_and_step_s": save_and_step,
        "step_cost_s": [t - idle_s for t in save_and_step],
        "undeferred_step_cost_s": [t - idle_s for t in undeferred_save_and_step],
        "bytes": sum(t.numel() * t.element_size() for t in _tensors(trained.state(0))),
    }


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
    return {
        "idle_step_ms": statistics.median(idle) * 1e3,
        "in_flight_step_ms": statistics.median(during) * 1e3 if during else None,
        "in_flight_steps": len(during),
        "slowdown": statistics.median(during) / statistics.median(idle) if during else None,
    }


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
            store.flush()  # retention's deletion of the previous save runs behind the save: untimed, reported apart
        del weights
        save_s, disk_s = statistics.median(saves), statistics.median(disk)
        out[label] = {"parameters": params, "bytes": nbytes, "save_s": saves, "disk_s": disk,
                      "retention_s": store.retention_seconds,
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
            "what": "training held by an asynchronous save (submit, plus the wait at the next optimizer step for the "
            "weights' and optimizer state's copy, which runs beside that step's forward and backward; warm host "
            "buffers) / "
            "by a synchronous save; a ~100M-parameter MLP with Adam, stepped for real; every save fsynced",
            "parameters": LAYERS * LAYER[0] * LAYER[1],
            "checkpoint_bytes": blocking["bytes"],
            "sync_save_s": blocking["sync"],
            "sync_retention_s": blocking["sync_retention_s"],
            "retention_note": "since 2026-12-06 a save returns once the checkpoint retention drops is uncommitted and "
            "its files are deleted on a background thread while training goes on (`training.checkpointing.removal`); "
            "sync_save_s and size_curve save_s wait for that deletion after timing the save, and retention_s is "
            "what each deletion took (before, it was inside the save)",
            "async_blocking_s": blocking["warm"],
            "async_blocking_undeferred_s": blocking["undeferred"],
            "deferred_saves": blocking["deferred_saves"],
            "dropped_saves": blocking["dropped"],
            "idle_step_s": blocking["idle_step_s"],
            "save_and_next_step_s": blocking["save_and_step_s"],
            "step_cost_s": blocking["step_cost_s"],
            "undeferred_step_cost_s": blocking["undeferred_step_cost_s"],
            "step_cost_note": "submit + the next step's wall time, minus the median idle step: what the save cost "
                              "training "
            "in all: held time, the copy's contention with the step's compute, and the write's (pickling, hashing, "
            "writing) with whatever part of the step it overlaps; undeferred_step_cost_s the same for saves copied "
            "whole",
            "async_write_s": blocking["writes"],
            "first_async_save": {
                **blocking["first"],
                "note": "cold host buffers; until_written_s is what training waited "
                "when the first save blocked in full (FaultTolerance before this change)",
            },
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
