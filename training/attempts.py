"""Attempt records, goodput accounting and once-per-trial fault markers (torch-free).

Shared by the Lightning path (`training.fault_tolerance`) and the GBT runner
(`training.gbt`), so importing them costs no torch or Lightning start-up.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import fsspec

from common.settings import settings
from training.spec import ATTEMPTS_DIR, WANDB_SERVICE_ENV
from training.storage import join, write_atomic


def attempt_id(started: float) -> str:
    """One id per process incarnation: launch x torchrun restart x this process's start (`started`, epoch seconds).

    The launch id and restart count alone do not tell incarnations apart on a
    cluster: pods that replace preempted or lost ones under the same Job share
    both (the launch id is the Job's name), and would overwrite the record of
    the attempt they replace, so its time would not count as a restart.
    """
    launch = settings().launch_id
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"{'direct' if launch is None else launch}-{restart}-{int(started * 1000):x}"


class FaultMarkers:
    """Once-per-trial fault firing, recorded as files under `<trial>/faults/`."""

    def __init__(self, output_uri: str) -> None:
        self.root = join(output_uri, "faults")

    def fired(self, name: str) -> bool:
        fs, path = fsspec.core.url_to_fs(join(self.root, name))
        return fs.exists(path)

    def mark(self, name: str) -> None:
        with fsspec.open(join(self.root, name), "w", auto_mkdir=True) as f:
            f.write(str(time.time()))


class AttemptLog:
    """Rank 0's record of this attempt, rewritten as a heartbeat (at most every `every` seconds)."""

    def __init__(self, output_uri: str, attempt_id: str, started: float, every: float = 1.0) -> None:
        self.uri = join(output_uri, ATTEMPTS_DIR, f"{attempt_id}.json")
        self.every = every
        self.record: dict[str, Any] = {
            "attempt": attempt_id,
            "started": started,
            "first_step_at": None,
            "last_heartbeat": started,
            "resumed_from_step": 0,
            "resumed_from": None,
            "last_step": 0,
            "productive_seconds": 0.0,
            "steps": 0,
            "checkpoint_blocking_seconds": 0.0,
            "status": "running",
        }
        self._written = 0.0

    def update(self, force: bool = False, **fields: Any) -> None:
        self.record.update(fields)
        now = time.time()
        self.record["last_heartbeat"] = now
        if force or now - self._written >= self.every:
            # Atomic: the SIGTERM handler may write while a write is in progress. No fsync: a
            # heartbeat rewritten every few seconds is not worth a disk flush each time.
            write_atomic(self.uri, json.dumps(self.record, indent=2, sort_keys=True).encode(), fsync=False)
            self._written = now


def read_attempts(output_uri: str) -> list[dict[str, Any]]:
    fs, path = fsspec.core.url_to_fs(join(output_uri, ATTEMPTS_DIR))
    if not fs.exists(path):
        return []
    records = []
    for p in fs.glob(f"{path}/*.json"):
        with fs.open(p, "r") as f:
            records.append(json.load(f))
    return sorted(records, key=lambda r: r["started"])


def goodput(attempts: list[dict[str, Any]], world_size: int, ended: float) -> dict[str, Any]:
    """Where the trial's time went, across every attempt.

    - productive: step time of steps that count toward the final model;
    - lost: step time of steps recomputed after a restart (done, then lost with the
      attempt because they came after its last committed checkpoint);
    - restart: from an attempt's last sign of life to the next attempt's first step
      (failure detection, relaunch, start-up);
    - checkpoint: time training was blocked by checkpoint saves.
    Goodput = productive / wall.
    """
    if not attempts:
        return {}
    wall = ended - attempts[0]["started"]
    step_time = sum(a["productive_seconds"] for a in attempts)
    steps = sum(a["steps"] for a in attempts)
    per_step = step_time / steps if steps else 0.0
    lost_steps = 0
    restart = 0.0
    causes: list[str] = []
    for prev, cur in zip(attempts, attempts[1:]):
        lost_steps += max(0, prev["last_step"] - cur["resumed_from_step"])
        if cur["first_step_at"] is not None:
            restart += max(0.0, cur["first_step_at"] - prev["last_heartbeat"])
        causes.append(prev["status"] if prev["status"] != "running" else "lost (process killed)")
    startup = attempts[0]["first_step_at"] - attempts[0]["started"] if attempts[0]["first_step_at"] else 0.0
    lost = lost_steps * per_step
    productive = max(0.0, step_time - lost)
    return {
        "wall_seconds": wall,
        "productive_seconds": productive,
        "lost_seconds": lost,
        "lost_steps": lost_steps,
        "restart_seconds": restart,
        "startup_seconds": startup,
        "checkpoint_blocking_seconds": sum(a["checkpoint_blocking_seconds"] for a in attempts),
        "goodput": productive / wall if wall > 0 else 0.0,
        "device_hours": wall * world_size / 3600.0,
        "attempts": len(attempts),
        "restarts": len(attempts) - 1,
        "restart_causes": causes,
    }


SHARED_WANDB_MARKER = (
    "wandb-shared-service"  # under <trial>/attempts/: an attempt of this trial used a shared W&B service
)


def private_wandb_unless_first(output_uri: str, mode: str) -> bool:
    """Keep a shared W&B service (`WANDB_SERVICE`, a warm server's) only for an offline trial's first attempt; whether
    it is kept.

    A process that dies in the middle of a W&B run leaves that run open in a
    shared service, and the service refuses the same run id to the attempt that
    resumes it ("run ID ... is in use"); a service of the process's own dies
    with it. So only the first attempt of a trial uses the shared service: it
    leaves a marker first, and any later attempt (a restarted rank, a Dagster
    retry, a retrain) finds the marker and starts its own service. Online runs
    always start their own: an open run in a shared service would keep talking
    to the W&B server beside the attempt that resumes it.
    """
    if not os.environ.get(WANDB_SERVICE_ENV):
        return False
    marker = join(output_uri, ATTEMPTS_DIR, SHARED_WANDB_MARKER)
    fs, path = fsspec.core.url_to_fs(marker)
    if mode != "offline" or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" or fs.exists(path):
        os.environ.pop(WANDB_SERVICE_ENV, None)
        return False
    write_atomic(marker, b"", fsync=False)
    return True

