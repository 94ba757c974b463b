"""A Lightning trial's committed checkpoints: the store, where to resume, and how Lightning reaches them.

`open_checkpointing` opens the trial's `CheckpointStore`, chooses the checkpoint
to resume from (`select_resume`; under fsdp/tp `select_sharded_resume`, which the
ranks agree on), wires the store into Lightning (the `StoreCheckpointIO` plugin,
or the sharded strategy) and makes the `FaultTolerance` callback that decides
saves. A checkpoint trained at another world size keeps its global batch through
gradient accumulation. `training.lightning_task` runs the trial.
"""

from __future__ import annotations

import logging
import time
import uuid
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist

from training.attempts import AttemptLog, FaultMarkers, attempt_id
from training.checkpoint_io import StoreCheckpointIO
from training.checkpointing import CheckpointStore, CheckpointUnusable, SkippedCheckpointWarning, UnsafeCheckpointError
from training.fault_tolerance import FaultTolerance, keep_global_batch
from training.reporting import Reporter
from training.spec import CHECKPOINT_DIR, TrainSpec
from training.storage import join

log = logging.getLogger("trainyard.training")


def select_resume(store: Any, spec: TrainSpec, markers: Any, rank: int, sharded: bool = False) -> Any:
    """The newest committed checkpoint to resume from (None for a fresh start, and for sharded runs,
    which choose with `select_sharded_resume` once the drill has run).

    The `corrupt_latest_checkpoint` drill corrupts the newest checkpoint here, on
    rank 0, before any rank loads; the others wait for it, so all ranks resume
    from the same (previous) checkpoint.
    """
    if spec.faults.corrupt_latest_checkpoint and not markers.fired("corrupt") and store.list_committed():
        if rank == 0:
            uri = store.corrupt_latest()
            log.warning("fault injection: corrupted the newest checkpoint %s", uri)
            markers.mark("corrupt")
        else:
            deadline = time.monotonic() + 120
            while not markers.fired("corrupt"):
                if time.monotonic() > deadline:
                    raise TimeoutError("rank 0 did not finish the checkpoint-corruption drill within 120 s")
                time.sleep(0.1)
    return None if sharded else store.latest()


def select_sharded_resume(store: Any, rank: int, world: int) -> tuple[Any, str]:
    """For fsdp/tp: the newest committed checkpoint whose shard every rank verified, and this run's save token.

    Rank 0 lists the committed checkpoints and broadcasts the list, with a fresh
    token that tags this attempt's shard files; then, newest first, each rank
    verifies its own shard and all ranks exchange the verdicts, so they resume
    from the same checkpoint (a corrupt shard on any rank skips it for all,
    with a warning naming the rank and why). Rank 0 then discards checkpoints
    above the chosen one (an abandoned timeline) before anyone writes.

    At another world size each rank verifies its share of the saved shards
    (`CheckpointStore.load`), so the ranks together verify every shard before
    they agree; the strategy reshards when it loads (`training.strategies.restore_sharded`).

    Raises:
        UnsafeCheckpointError: a rank's shard holds pickled code; raised on every rank.
    """
    shared: list[Any] = [(store.committed(), uuid.uuid4().hex[:12])] if rank == 0 else [None]
    dist.broadcast_object_list(shared, src=0)
    candidates, token = shared[0]
    chosen = None
    for name, _ in candidates:
        refused: Optional[tuple[str, str]] = None
        try:
            loaded, why = store.load(name, rank=rank, world_size=world), ""
        except CheckpointUnusable as e:
            loaded, why = None, str(e)
        except UnsafeCheckpointError as e:
            loaded, why, refused = None, str(e), (e.source, e.detail)
        verdicts: list[Any] = [None] * world
        dist.all_gather_object(verdicts, (why, refused))
        for _, refusal in verdicts:
            if refusal is not None:  # every rank stops, none resumes: a tampered shard is not a storage fault
                raise UnsafeCheckpointError(*refusal)
        bad = {r: w for r, (w, _) in enumerate(verdicts) if w}
        if not bad:
            chosen = loaded
            break
        if rank == 0:
            msg = (
                f"skipping checkpoint {store.root_uri}/{name}: "
                + "; ".join(f"rank {r}: {w}" for r, w in bad.items())
                + "; trying the previous one"
            )
            log.warning(msg)
            warnings.warn(msg, SkippedCheckpointWarning, stacklevel=2)
    if rank == 0:
        store.discard_after(chosen.step if chosen is not None else -1)
    dist.barrier()
    return chosen, token


@dataclass
class Checkpointing:
    """The committed store, how Lightning reaches it, where to resume, and the callback that decides saves."""

    store: CheckpointStore
    plugins: list[Any]  # the store's IO plugin, unless the sharded strategy holds it
    resume_path: Optional[str]
    ft: FaultTolerance
    accumulate_grad_batches: int = 1  # keeps the global batch of a checkpoint written at another world size


def open_checkpointing(
    spec: TrainSpec,
    strategy_kwargs: dict[str, Any],
    markers: FaultMarkers,
    rank: int,
    started_wall: float,
    reporter: Reporter,
) -> Checkpointing:
    """Open the trial's checkpoint store, choose the checkpoint to resume from and wire the store into Lightning.

    The `fail_storage_writes` drill arms rank 0's store once per trial. Under
    fsdp/tp the strategy in `strategy_kwargs` gets the IO and this run's shard token.
    """
    world = spec.distribution.world_size
    sharded = spec.distribution.strategy != "ddp" and world > 1
    fail_writes = 0
    if rank == 0 and spec.faults.fail_storage_writes and not markers.fired("storage"):
        markers.mark("storage")
        fail_writes = spec.faults.fail_storage_writes
    store = CheckpointStore(
        join(spec.output_uri, CHECKPOINT_DIR),
        keep_last=spec.checkpoint.keep_last,
        max_write_attempts=spec.checkpoint.write_attempts,
        fail_next_writes=fail_writes,
    )
    loaded = select_resume(store, spec, markers, rank, sharded)
    io = StoreCheckpointIO(store, async_save=spec.checkpoint.async_save)
    plugins: list[Any] = []
    if sharded:
        loaded, token = select_sharded_resume(store, rank, world)
        strategy = strategy_kwargs["strategy"]
        strategy.committed_io, strategy.shard_token = io, token
    else:
        plugins.append(io)
    attempt = AttemptLog(spec.output_uri, attempt_id(started_wall), started_wall)
    resume_path: Optional[str] = None
    if loaded is not None:
        resume_path = io.remember(loaded)
        attempt.record.update(resumed_from=loaded.uri, resumed_from_step=loaded.step)
        reporter.info(f"trial {spec.trial_id}: resuming from committed checkpoint {loaded.uri} (step {loaded.step})")
    ft = FaultTolerance(
        spec.checkpoint, io, spec.distribution.nodes, spec.monitor, spec.monitor_mode, spec.faults, markers, attempt
    )
    accumulate = _resumed_global_batch(spec, loaded, attempt, reporter)
    return Checkpointing(store, plugins, resume_path, ft, accumulate)


def _resumed_global_batch(spec: TrainSpec, loaded: Any, attempt: AttemptLog, reporter: Reporter) -> int:
    """Gradient accumulation that keeps the global batch of the checkpoint resumed (1 for a fresh start).

    A checkpoint written at another data-parallel size with the same per-rank
    batch keeps its global batch (ranks x batch x accumulation) when it divides
    (`keep_global_batch`); otherwise the run trains with its own, and the log
    and the attempt record name the old and new global batch.
    """
    if loaded is None:
        return 1
    saved = (loaded.state.get("trainyard") or {}).get("global_batch")
    dp = spec.distribution.data_parallel_size
    batch = int(spec.datamodule.kwargs.get("batch_size", spec.batch_size))
    accumulate, change = keep_global_batch(saved, dp, batch)
    if saved:
        before = saved["data_parallel"] * saved["batch_size"] * saved.get("accumulate", 1)
        attempt.record["global_batch"] = {
            "checkpoint": {**saved, "global": before},
            "run": {
                "data_parallel": dp,
                "batch_size": batch,
                "accumulate": accumulate,
                "global": dp * batch * accumulate,
            },
            "kept": change is None,
        }
    if change is not None:
        reporter.info(f"trial {spec.trial_id}: the checkpoint was trained at another size; {change}")
    elif saved and (saved["data_parallel"], saved.get("accumulate", 1)) != (dp, accumulate):
        reporter.info(
            f"trial {spec.trial_id}: the checkpoint was trained on {saved['data_parallel']} data-parallel rank(s) "
            f"x batch {saved['batch_size']} x accumulation {saved.get('accumulate', 1)}; this run on {dp} keeps the "
            f"global batch {dp * batch * accumulate} with gradient accumulation {accumulate}"
        )
    return accumulate
