"""FaultTolerance's rank agreement, on two real gloo processes: collectives only at agreed steps, never per step, never
waited on.

Each rank drives the callback as Lightning would (batch start, a step's work,
batch end) around a stand-in Trainer whose `save_checkpoint` does what DDP's
does: rank 0 writes through the real store-backed checkpoint IO, every rank
runs the callbacks' `on_save_checkpoint` (a collective: ranks that disagree on
when to save would hang here).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

STEP_SECONDS = 0.02


class _Trainer:
    def __init__(self, rank: int, world: int, ft: Any) -> None:
        self.world_size, self.global_rank, self.is_global_zero = world, rank, rank == 0
        self.global_step, self.current_epoch, self.sanity_checking = 0, 0, False
        self.callback_metrics: dict[str, Any] = {}
        self.train_dataloader = None
        self.lightning_module, self.optimizers = torch.nn.Linear(4, 4), []
        self.saved_at: list[int] = []
        self._ft = ft

    def save_checkpoint(self, path: str, storage_options: Any = None) -> None:
        checkpoint = {
            "global_step": self.global_step,
            "epoch": 0,
            "state_dict": {"w": torch.full((1024,), float(self.global_step))},
        }
        self._ft.on_save_checkpoint(self, None, checkpoint)
        if self.is_global_zero:
            self._ft.io.save_checkpoint(checkpoint, path, storage_options)
        self.saved_at.append(self.global_step)


def _worker(rank: int, world: int, port: int, out: str, sigterm: dict[int, int], steps: int) -> None:
    from training.attempts import AttemptLog, FaultMarkers
    from training.checkpoint_io import StoreCheckpointIO
    from training.checkpointing import CheckpointStore
    from training.errors import Preempted
    from training.fault_tolerance import FaultTolerance, control_group
    from training.spec import CheckpointPolicy, FaultInjection

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    assert control_group(world) is None  # gloo already carries CPU tensors: no second group
    io = StoreCheckpointIO(CheckpointStore(f"{out}/checkpoints", keep_last=2), async_save=True)
    ft = FaultTolerance(
        CheckpointPolicy(),
        io,
        1,
        "val_acc",
        "max",
        FaultInjection(),
        FaultMarkers(out),
        AttemptLog(out, f"a{rank}", time.time()),
    )
    trainer = _Trainer(rank, world, ft)
    collectives: list[int] = []
    real = dist.all_reduce

    blocking: list[int] = []

    def counting(*args: Any, **kwargs: Any) -> Any:
        collectives.append(trainer.global_step)
        if not kwargs.get("async_op"):
            blocking.append(trainer.global_step)
        return real(*args, **kwargs)

    dist.all_reduce = counting  # type: ignore[assignment]
    preempted_at = None
    ft.on_train_start(trainer, None)  # type: ignore[arg-type]
    try:
        for step in range(1, steps + 1):
            trainer.global_step = step
            ft.on_train_batch_start(trainer, None, None, step - 1)  # type: ignore[arg-type]
            time.sleep(STEP_SECONDS)
            if sigterm.get(rank) == step:
                os.kill(os.getpid(), signal.SIGTERM)  # this rank only, as when pods get the signal at different steps
            ft.on_train_batch_end(trainer, None, None, None, step - 1)  # type: ignore[arg-type]
    except Preempted:
        preempted_at = trainer.global_step
    if preempted_at is None:
        ft.on_train_end(trainer, None)  # type: ignore[arg-type]
    io.teardown()
    Path(out, f"rank-{rank}.json").write_text(
        json.dumps(
            {
                "collectives": collectives,
                "blocking": blocking,
                "sync_every": ft.sync_every,
                "preempted_at": preempted_at,
                "saved_at": trainer.saved_at,
                "interval": ft.interval_seconds,
                "writes": len(io.writer.save_seconds) if io.writer else 0,
            }
        )
    )
    dist.destroy_process_group()


def _run(tmp_path: Path, sigterm: dict[int, int], steps: int) -> list[dict[str, Any]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, 2, port, str(tmp_path), sigterm, steps)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0], "a rank failed or hung (ranks disagreed on a collective?)"
    return [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]


def _after_calibration(rank: dict[str, Any]) -> list[int]:
    return [s for s in rank["collectives"] if s > 10]


@pytest.mark.slow
def test_a_signal_on_one_rank_preempts_both_at_the_same_agreed_step(tmp_path: Path) -> None:
    # rank 1: not the rank that writes, so rank 0 learns of it only through the agreement
    ranks = _run(tmp_path, {1: 40}, steps=200)
    every = ranks[0]["sync_every"]
    assert every == ranks[1]["sync_every"] and every >= 5  # ~0.5 s of 20 ms steps, agreed by both
    at = ranks[0]["preempted_at"]
    # the agreement started at the first agreement step after the signal is read at the next one
    assert at == ranks[1]["preempted_at"] and at % every == 0 and 40 + every <= at < 40 + 2 * every
    for rank in ranks:
        # every step until sync_every is agreed at step 10, then only at its multiples; none is started at the step
        # that reads the preemption (it ends the fit), so none is left unmatched
        assert rank["collectives"][:10] == list(range(1, 11))
        assert _after_calibration(rank) == [s for s in range(11, at) if s % every == 0]
        assert rank["blocking"] == [10], "a step waited on an agreement (only the one-off calibration may)"
        assert rank["saved_at"] == [1, at]  # the first save (Young/Daly measures it), then the preemption save
    # the first save was written in the background (DDP: by rank 0) and its time agreed by both ranks
    assert ranks[0]["writes"] == 1 and ranks[1]["writes"] == 0  # the preemption save is synchronous
    assert ranks[0]["interval"] is not None and ranks[0]["interval"] == ranks[1]["interval"]
