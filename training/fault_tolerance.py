"""Checkpoint, resume and preemption for the Lightning Trainer, plus goodput accounting.

Pieces:
- `FaultTolerance`: a callback that decides *when* to checkpoint (every N steps,
  every T seconds, or the Young/Daly optimum from the measured save time), keeps
  the best checkpoint, captures every rank's RNG state and the sampler position
  for exact resume, and turns SIGTERM on any rank into an agreed checkpoint and a
  `Preempted` exit. Decisions are all-reduced so ranks never disagree, but not
  every step: at steps that are multiples of an agreed `sync_every` (about
  every `SYNC_PERIOD` seconds), on CPU tensors through gloo, and without
  waiting: each agreement is started asynchronously and its result read at the
  next agreement step, when it is long done, so no step waits on a collective
  or a host-device synchronisation for them (the blocking version cost about
  1.2 ms a step on the 10M-parameter benchmark, see `bench/overhead.py`).
- `AttemptLog`: one record per attempt (launch x torchrun restart), from which
  `goodput` derives productive, lost, restart and checkpoint time.
- Fault injection (tests and drills), each firing once per trial.

Checkpoints are written and read through `training.checkpoint_io.StoreCheckpointIO`.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from training.attempts import AttemptLog, FaultMarkers, goodput, read_attempts  # noqa: F401  (re-exported)
from training.checkpoint_io import StoreCheckpointIO
from training.checkpointing import deferrable_storages, rng_state, set_rng_state, young_daly_interval
from training.distributed import lost_peer
from training.errors import Preempted
from training.resize import keep_global_batch, rank_range  # noqa: F401  (keep_global_batch: imported from here too)
from training.resumable import ResumableSampler, align_loop_to_loader
from training.spec import CheckpointPolicy, FaultInjection

log = logging.getLogger("trainyard.training")


SYNC_PERIOD = 0.5  # seconds between rank agreements (preemption, time-based saves)
# How long a rank whose training raised (a lost peer, a bug) lets its checkpoint write in flight finish before it
# exits; inside the 30 s torchrun's agent and the warm supervisor give a worker between SIGTERM and SIGKILL.
EXCEPTION_WRITE_GRACE_SECONDS = 20.0
CALIBRATION_STEPS = 10
SIGTERM_RECEIVED = False  # set by the handler; the entrypoint reads it to classify a failure during shutdown


def _train_sampler(trainer: L.Trainer) -> Optional[Any]:
    """What records the train loader's trained position (`mark_consumed`): its `ResumableSampler`, or a loader that
    keeps the position itself (`training.streaming.ShardLoader`); None for a loader that does not resume."""
    loader = trainer.train_dataloader
    sampler = getattr(loader, "sampler", None)
    if isinstance(sampler, ResumableSampler):
        return sampler
    return loader if callable(getattr(loader, "mark_consumed", None)) else None


def _stepped_batches(trainer: L.Trainer, batch_idx: int) -> int:
    """Batches of the epoch trained into an optimizer step after batch `batch_idx`: a save between the micro-batches
    of an accumulation resumes at its first (their gradients are not in the checkpoint)."""
    done = batch_idx + 1
    accumulate = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
    if accumulate == 1 or done >= trainer.num_training_batches:
        return done
    return done - done % accumulate


def _global_batch(trainer: L.Trainer) -> Optional[dict[str, int]]:
    """The data-parallel ranks, per-rank batch and accumulation this run trains with, when its loader says (a resume
    keeps their product)."""
    loader = _train_sampler(trainer)
    world, batch = getattr(loader, "world", None), getattr(loader, "batch_size", None)
    if world is None or batch is None:
        return None
    return {"data_parallel": int(world), "batch_size": int(batch), "accumulate": int(trainer.accumulate_grad_batches)}


def control_group(world_size: int) -> Any:
    """The process group for the flags ranks agree on: CPU tensors through gloo, never touching the accelerator.

    None (the default group) when it is gloo already or there is no group; under
    NCCL a new gloo group over every rank (NCCL has no CPU backend, and a device
    tensor would need a host-device synchronisation to read). Every rank must
    call this at the same point: creating a group is a collective.
    """
    if world_size == 1 or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return None
    if "gloo" in str(torch.distributed.get_backend()).lower():
        return None
    return torch.distributed.new_group(backend="gloo")


class _Agreement:
    """An element-wise max over ranks, started without waiting; `result()` waits (by then it is usually done).

    With one rank there is nothing to agree with: the values are the result, and no tensor is made.
    """

    def __init__(self, values: list[float], trainer: L.Trainer, group: Any, measuring: bool) -> None:
        self.step = trainer.global_step
        self.measuring = measuring  # whether the values carry the first save's time (third element)
        self._values: list[float] = values
        self._tensor: Optional[torch.Tensor] = None
        self._work: Any = None
        if trainer.world_size > 1:
            self._tensor = torch.tensor(values, dtype=torch.float64)
            self._work = torch.distributed.all_reduce(
                self._tensor, op=torch.distributed.ReduceOp.MAX, group=group, async_op=True
            )

    def result(self) -> list[float]:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._tensor is not None:
            self._values, self._tensor = self._tensor.tolist(), None
        return self._values


def _all_reduce_max(values: list[float], trainer: L.Trainer, group: Any = None) -> list[float]:
    """The element-wise max over ranks, blocking (the one-off calibration and the end of a fit)."""
    if trainer.world_size == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
    return t.tolist()


class FaultTolerance(Callback):
    """When to checkpoint, exact-resume state, and agreed preemption.

    Args:
        policy: interval, retention and preemption settings.
        io: the store-backed checkpoint IO installed in the Trainer.
        nodes: job node count, for the Young/Daly interval.
        monitor, mode: metric that marks the best checkpoint.
        faults: fault injection for tests and drills.
        attempt: this attempt's log (rank 0 writes it).
    """

    def __init__(
        self,
        policy: CheckpointPolicy,
        io: StoreCheckpointIO,
        nodes: int,
        monitor: str,
        mode: str,
        faults: FaultInjection,
        markers: FaultMarkers,
        attempt: AttemptLog,
    ) -> None:
        if mode not in ("max", "min"):
            raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")
        self.policy = policy
        self.io = io
        self.nodes = nodes
        self.monitor = monitor
        self.mode = mode
        self.faults = faults
        self.markers = markers
        self.attempt = attempt
        self.interval_seconds: Optional[float] = policy.every_seconds
        self.interval_source = (
            "steps" if policy.every_n_steps else ("seconds" if policy.every_seconds else "young_daly")
        )
        self.save_seconds: Optional[float] = None  # the measured save time the Young/Daly interval was chosen from
        self.best_score: Optional[float] = None
        self.last_save_step = 0
        self.last_save_time = time.monotonic()
        self.preempt_requested = False
        self.preempt_save_seconds: Optional[float] = None
        self._batch_started = 0.0
        self._previous_handler: Any = None
        # Ranks agree (one all-reduce) every `sync_every` steps: every step at first,
        # then about every SYNC_PERIOD seconds once the step time is known, so the
        # collective costs well under 1% of a step.
        self.sync_every = 1
        self._rank = 0
        self._group: Any = None
        # Young/Daly: the first save is written in the background like any other; its
        # duration is agreed at a later agreement step, once every rank's write is done.
        self._first_save_submitted = False
        self._measuring = False
        self._pending: Optional[_Agreement] = None  # the agreement started at the last agreement step
        self._resumed = False  # set when a checkpoint is loaded: the epoch loop is aligned to the loader's position

    # -- signals -----------------------------------------------------------------

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        # Only set a flag: collectives inside a signal handler can deadlock.
        global SIGTERM_RECEIVED
        SIGTERM_RECEIVED = True
        self.preempt_requested = True
        if self._rank == 0:
            # torchrun also sends SIGTERM when it tears down a group that lost a rank:
            # record how far this attempt got, so lost work is counted.
            self.attempt.update(force=True)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Installed after Lightning's own handler, which broadcasts from rank 0 only.
        self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        self.last_save_time = time.monotonic()
        self.last_save_step = trainer.global_step
        self._rank = trainer.global_rank
        self._group = control_group(trainer.world_size)
        self._align_resumed_epoch(trainer)
        if trainer.is_global_zero:
            # The attempt exists from its start: one killed before its first step's
            # record (a drill at step 1, an early OOM) still counts as a restart.
            self.attempt.update(force=True)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None

    # -- steps -------------------------------------------------------------------

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_started = time.perf_counter()
        if self.attempt.record["first_step_at"] is None:
            self.attempt.record["first_step_at"] = time.time()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        rec = self.attempt.record
        rec["productive_seconds"] += time.perf_counter() - self._batch_started
        rec["steps"] += 1
        step = trainer.global_step
        sampler = _train_sampler(trainer)
        if sampler is not None:
            sampler.mark_consumed(trainer.current_epoch, _stepped_batches(trainer, batch_idx))
        self._inject(trainer, step)
        if rec["steps"] == CALIBRATION_STEPS and trainer.world_size > 1:
            (mean_step,) = _all_reduce_max([rec["productive_seconds"] / rec["steps"]], trainer, self._group)
            self.sync_every = max(1, int(SYNC_PERIOD / max(mean_step, 1e-6)))
        preempt, due = self._agreed(trainer, step)
        if preempt:
            started = time.perf_counter()
            self.save(trainer, sync=True)
            self.preempt_save_seconds = time.perf_counter() - started
            if trainer.is_global_zero:
                self.attempt.update(
                    force=True, last_step=step, status="preempted", preempt_save_seconds=self.preempt_save_seconds
                )
            raise Preempted(
                f"SIGTERM: checkpoint at step {step} committed in {self.preempt_save_seconds:.2f} s "
                f"(deadline {self.policy.preemption_deadline_seconds:.0f} s)"
            )
        if due:
            if self.interval_seconds is None and self.policy.every_n_steps is None:
                self._first_save_submitted = self._measuring = True
            self.save(trainer)
        if step % self.sync_every == 0:
            self._start_agreement(trainer, step)  # after this step's save: its flags say what is due from here on
        if trainer.is_global_zero:
            self.attempt.record["last_step"] = step
            self.attempt.update()

    def _agreed(self, trainer: L.Trainer, step: int) -> tuple[bool, bool]:
        """(preempt, save due) as every rank sees them at this step.

        Agreements happen only at steps that are multiples of `sync_every`,
        which every rank shares (the step number and the agreed `sync_every`),
        so every rank takes part at the same steps. Each agreement step reads
        the result of the agreement started at the previous one (a collective
        that ran in the background meanwhile) and then starts the next one
        (`_start_agreement`, after any save): a SIGTERM or a due time-based
        save is acted on at the second agreement step after it, about
        `SYNC_PERIOD` to 2 x `SYNC_PERIOD` seconds later, on every rank at
        the same step. In between, only step-based saves, which every rank
        decides alike, can be due (and the first Young/Daly save, after step 1,
        which is not timed either). While the first Young/Daly save is being
        written, the agreement also carries every rank's save time (inf while
        its write is in flight) and sets the interval once all are done.
        """
        local = not self._timed()  # step-based saves and the first Young/Daly save: every rank decides alike
        agreed = self._collect_agreement() if step % self.sync_every == 0 else None
        if agreed is None:
            return False, local and self._due(step)
        reduced, started_at = agreed
        if local:
            return bool(reduced[0]), self._due(step)
        # a save every rank made since (the best one after validation) already answered a save due then
        return bool(reduced[0]), bool(reduced[1]) and self.last_save_step <= started_at

    def _timed(self) -> bool:
        """Whether a save is due by each rank's clock (an interval in seconds), so ranks must agree on it."""
        return self.policy.every_n_steps is None and self.interval_seconds is not None

    def _start_agreement(self, trainer: L.Trainer, step: int) -> None:
        measuring = self._measuring
        values = [float(self.preempt_requested), float(self._timed() and self._due(step))]
        self._pending = _Agreement(
            values + ([self._save_seconds()] if measuring else []), trainer, self._group, measuring
        )

    def _collect_agreement(self) -> Optional[tuple[list[float], int]]:
        """The result of the agreement in flight and the step it was started at (None: none is); applies the first
        save's agreed time."""
        if self._pending is None:
            return None
        pending, self._pending = self._pending, None
        reduced = pending.result()
        if pending.measuring and self._measuring and math.isfinite(reduced[2]):
            self._choose_interval(reduced[2])
        return reduced, pending.step

    def _due(self, step: int) -> bool:
        if self.policy.every_n_steps is not None:
            return step - self.last_save_step >= self.policy.every_n_steps
        if self.interval_seconds is None:
            return step >= 1 and not self._first_save_submitted  # the first save measures the save time
        return time.monotonic() - self.last_save_time >= self.interval_seconds

    def _save_seconds(self) -> float:
        """This rank's part of the first save's duration: inf while its write is in flight; ranks that wrote nothing
        (DDP) say 1 ms."""
        writer = self.io.writer
        if writer is not None and writer.in_flight:
            return math.inf
        return self.io.last_save_seconds() or self.io.blocking_seconds or 1e-3

    def _choose_interval(self, measured: float, why: str = "") -> None:
        self._measuring = False
        self.save_seconds = measured
        self.interval_seconds = young_daly_interval(measured, self.policy.node_mtbf_hours, self.nodes)
        log.info(
            "checkpoint interval %.1f s (Young/Daly: save %.3f s, node MTBF %.0f h, %d node(s))%s",
            self.interval_seconds, measured, self.policy.node_mtbf_hours, self.nodes, why,
        )
        if self._rank == 0:
            self.attempt.update(
                force=True,
                checkpoint_interval={
                    "seconds": self.interval_seconds,
                    "save_seconds": measured,
                    "node_mtbf_hours": self.policy.node_mtbf_hours,
                    "nodes": self.nodes,
                },
            )

    def save(self, trainer: L.Trainer, sync: bool = False, best: bool = False) -> None:
        if trainer.global_step == self.last_save_step and trainer.world_size > 1:
            # This step again (a periodic save, then the best one after validation at the same step): the previous
            # save of this directory must be committed on every rank first. Otherwise a rank other than 0, which
            # does not wait for the commit, can replace its sidecar with the new save's token before rank 0 read
            # the old one, and rank 0 waits for a token that never comes (a sharded save hung this way). Every
            # rank decides this alike (saves are collective), so the barrier is reached by all.
            if self.io.writer is not None:
                self.io.writer.wait()
            trainer.strategy.barrier("trainyard-save-again")
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        before = self.io.blocking_seconds
        options: dict[str, Any] = {"sync": sync, "best": best, "metrics": metrics}
        if not sync and self.io.writer is not None:
            # Weights and optimizer state change only in the optimizer step: the writer copies them while the
            # next forward and backward run, and on_before_optimizer_step fences.
            options["defer"] = deferrable_storages([trainer.lightning_module], trainer.optimizers)
        trainer.save_checkpoint(self.io.store.uri(trainer.global_step), storage_options=options)
        self.attempt.record["checkpoint_blocking_seconds"] += self.io.blocking_seconds - before
        self.last_save_step = trainer.global_step
        self.last_save_time = time.monotonic()
        if trainer.is_global_zero:
            self.attempt.update(force=True, last_step=trainer.global_step)

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self.io.writer is not None:
            before = self.io.writer.blocking_seconds
            self.io.writer.fence()  # a deferred copy of the weights is taken before the step changes them
            waited = self.io.writer.blocking_seconds - before
            self.io.blocking_seconds += waited
            self.attempt.record["checkpoint_blocking_seconds"] += waited

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or self.monitor not in trainer.callback_metrics:
            return
        score = float(trainer.callback_metrics[self.monitor])
        better = self.best_score is None or (score > self.best_score if self.mode == "max" else score < self.best_score)
        if better:
            self.best_score = score
            self.save(trainer, best=True)

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._finish_write_in_flight()
        if trainer.is_global_zero and self.attempt.record["status"] == "running":
            # A lost peer is the restart's cause as goodput reports it, not the gloo error it surfaced as.
            status = (
                "lost (a peer rank died)"
                if lost_peer(exception)
                else f"failed: {type(exception).__name__}: {str(exception)[:200]}"
            )
            self.attempt.update(force=True, status=status)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # The final state is always committed, so the newest checkpoint is the trained model.
        self._collect_agreement()  # every rank started it at the same step and ends here: no collective left unmatched
        if self._measuring and self.io.writer is not None:
            self.io.writer.wait()
        if self._measuring:
            # A fit shorter than the first write: agree on its time now (every rank ends here).
            (measured,) = _all_reduce_max([self._save_seconds()], trainer, self._group)
            self._choose_interval(measured)
        if self.last_save_step != trainer.global_step:
            self.save(trainer, sync=True)
        elif self.io.writer is not None:
            self.io.writer.wait()

    def _finish_write_in_flight(self) -> None:
        """Let a checkpoint write in flight commit before the process leaves, for up to `EXCEPTION_WRITE_GRACE_SECONDS`.

        A save whose every part is written is worth keeping: without this, rank
        0 of a sharded save could leave (its training raised when a peer died)
        while its writer thread waited for the peer's shard that the peer had
        written, and the retry resumed from the checkpoint before. A DDP save is
        also waited for by the checkpoint IO's teardown, but a sharded one
        belongs to the strategy, which has none; and the wait is bounded, since
        a shard of a rank that died before writing it never comes.
        """
        writer = self.io.writer
        if writer is None or not writer.in_flight:
            return
        started = time.monotonic()
        try:
            uri = writer.wait(timeout=EXCEPTION_WRITE_GRACE_SECONDS)
            log.info(
                "the checkpoint write in flight finished (%s) %.2f s after training raised",
                uri,
                time.monotonic() - started,
            )
        except TimeoutError:
            log.warning(
                "the checkpoint write in flight did not finish within %.0f s after training raised; left uncommitted "
                "(the store skips it)",
                EXCEPTION_WRITE_GRACE_SECONDS,
            )
        except Exception as e:  # the training error is the one to report
            log.warning("the checkpoint write in flight failed after training raised: %s", e)

    # -- exact resume state --------------------------------------------------------

    @override
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        states: list[Any] = [rng_state()]
        if trainer.world_size > 1:
            gathered: list[Any] = [None] * trainer.world_size
            torch.distributed.all_gather_object(gathered, states[0])
            states = gathered
        checkpoint["trainyard"] = {
            "rng": states, "best_score": self.best_score, "interval_seconds": self.interval_seconds,
            "save_seconds": self.save_seconds, "nodes": self.nodes, "global_batch": _global_batch(trainer),
        }

    @override
    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("trainyard")
        if not saved:
            return
        self._resumed = True
        states = saved["rng"]
        rank, world = trainer.global_rank, trainer.world_size
        if rank < len(states):
            set_rng_state(states[rank])
        if len(states) != world and rank == 0:
            # Another world size: no rank's generators of the saving run continue this run's, whichever it takes.
            kept = f"{rank_range(len(states), world)} keep their seeded generators" if world > len(states) else \
                f"the states of {rank_range(world, len(states))} are not used"
            log.info(
                "checkpoint holds the RNG states of %d ranks, this run has %d: %s restored theirs, %s (random draws "
                "such "
                "as dropout masks differ from a run at %d ranks; the sample order does not depend on them)",
                len(states),
                world,
                rank_range(0, min(world, len(states))),
                kept,
                len(states),
            )
        self.best_score = saved.get("best_score")
        if saved.get("interval_seconds") and self.interval_source == "young_daly":
            saved_nodes, save_seconds = saved.get("nodes"), saved.get("save_seconds")
            if save_seconds and saved_nodes is not None and saved_nodes != self.nodes:
                # The job fails when any of its nodes does: another gang size has another job MTBF.
                self._rank = rank
                self._choose_interval(
                    float(save_seconds),
                    f", recomputed for {self.nodes} node(s) (was {saved['interval_seconds']:.1f} s at {saved_nodes})",
                )
            else:
                self.interval_seconds = saved["interval_seconds"]
                self.save_seconds = save_seconds

    def _align_resumed_epoch(self, trainer: L.Trainer) -> None:
        """A resumed run: the epoch loop continues at the batch the train loader resumed at, in this run's units.

        At another world size, batch size or accumulation the loader's resumed
        position (`consumed`, in batches of this run) differs from the loop
        counters Lightning restored (batches of the saving run).
        """
        sampler = _train_sampler(trainer)
        if not self._resumed or sampler is None:
            return
        epoch, done = sampler.consumed
        if epoch != trainer.current_epoch:
            return
        shift = align_loop_to_loader(trainer, done)
        if shift and trainer.is_global_zero:
            log.info("resumed epoch %d at batch %d of %d per rank (the checkpoint's run counted %d)", epoch, done,
                     trainer.num_training_batches, done - shift)

    # -- faults ------------------------------------------------------------------

    def _inject(self, trainer: L.Trainer, step: int) -> None:
        f = self.faults
        if f.kill_at_step == step and trainer.global_rank == f.kill_rank and not self.markers.fired("kill"):
            self.markers.mark("kill")
            if self.io.writer is not None:
                # The drill kills at a known point: after this rank's last write finished, so the
                # checkpoint it resumes from does not depend on machine load. (A death during a
                # write leaves an uncommitted directory, which the store skips; tested there.)
                self.io.writer.wait()
            log.warning("fault injection: SIGKILL rank %d at step %d", trainer.global_rank, step)
            os.kill(os.getpid(), signal.SIGKILL)
        if f.sigterm_at_step == step and trainer.is_global_zero and not self.markers.fired("sigterm"):
            self.markers.mark("sigterm")
            log.warning("fault injection: SIGTERM the launcher agent at step %d", step)
            agent = os.getppid() if os.environ.get("TORCHELASTIC_RUN_ID") else os.getpid()
            os.kill(agent, signal.SIGTERM)
            if agent != os.getpid():
                time.sleep(0.5)  # let the agent forward SIGTERM to every rank before the agreement below
