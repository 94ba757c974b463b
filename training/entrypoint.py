"""The one program every training process runs: `python -m training.entrypoint --spec URI`.

Launched by torchrun (one process per device) on this machine or in a pod. It
reads the `TrainSpec`, builds the LightningModule and LightningDataModule named
by import path, trains, evaluates the best weights on the full validation and
test splits, exports a serving model and writes `result.json` last, so a
present `result.json` means the trial finished.

Failures are written to `<output>/failures/rank-<r>.json` with the rank's
traceback and the process exits with a status from `training.spec`:
`EXIT_BAD_CONFIG` when the spec cannot work, `EXIT_USER_ERROR` when model or
data code raised.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import logging
import os
import sys
import tempfile
import time
import traceback
import uuid
import warnings
from typing import Any, Optional

import fsspec

from training.attempts import AttemptLog, FaultMarkers, attempt_id, goodput, read_attempts
from training.errors import ConfigError, Preempted, StrategyConfigError
from training.reporting import Reporter
from training.spec import (
    CHECKPOINT_DIR,
    EXIT_BAD_CONFIG,
    EXIT_INFRA,
    EXIT_PREEMPTED,
    EXIT_USER_ERROR,
    FAILURE_DIR,
    LAUNCH_ID_ENV,
    RESULT_FILE,
    ImportTarget,
    TrainResult,
    TrainSpec,
)

log = logging.getLogger("trainyard.training")


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *parts])


def load_spec(uri: str) -> TrainSpec:
    try:
        with fsspec.open(uri, "r") as f:
            return TrainSpec.from_json(f.read())
    except FileNotFoundError as e:
        raise ConfigError(f"spec file {uri!r} does not exist") from e
    except ValueError as e:
        raise ConfigError(f"spec file {uri!r} is invalid: {e}") from e


def import_target(target: ImportTarget, what: str) -> type:
    module, _, attr = target.path.partition(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"{what} {target.path!r}: cannot import module {module!r}: {e}") from e
    try:
        return getattr(mod, attr)
    except AttributeError as e:
        raise ConfigError(f"{what} {target.path!r}: module {module!r} has no attribute {attr!r}") from e


def build(spec: TrainSpec) -> tuple[Any, Any]:
    """Instantiate the data module, then the model with platform-provided shapes.

    A model whose constructor accepts `n_features` / `n_classes` gets them from
    the data unless the pipeline set them explicitly.
    """
    dm_cls = import_target(spec.datamodule, "datamodule")
    model_cls = import_target(spec.model, "model")
    dm_kwargs = {
        "train_uri": spec.data.train_uri,
        "val_uri": spec.data.val_uri,
        "test_uri": spec.data.test_uri,
        "features": spec.data.features,
        "target": spec.data.target,
        "batch_size": spec.batch_size,
        **spec.datamodule.kwargs,
    }
    if "seed" in inspect.signature(dm_cls.__init__).parameters:
        dm_kwargs.setdefault("seed", spec.seed)
    try:
        dm = dm_cls(**dm_kwargs)
    except TypeError as e:
        raise ConfigError(f"datamodule {spec.datamodule.path!r} rejected its arguments {sorted(dm_kwargs)}: {e}") from e
    kwargs = dict(spec.model.kwargs)
    params = inspect.signature(model_cls.__init__).parameters
    if "n_features" in params and "n_features" not in kwargs:
        kwargs["n_features"] = len(spec.data.features)
    if "n_classes" in params and "n_classes" not in kwargs:
        kwargs["n_classes"] = len(dm.classes())
    try:
        model = model_cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"model {spec.model.path!r} rejected hyperparameters {kwargs}: {e}") from e
    return model, dm


def _trainer_kwargs(spec: TrainSpec) -> dict[str, Any]:
    # Lightning (and torch) load only for trials that train with it, never for GBT trials.
    from training.strategies import trainer_kwargs

    try:
        return trainer_kwargs(spec.distribution, int(os.environ.get("WORLD_SIZE", "1")))
    except StrategyConfigError as e:
        raise ConfigError(str(e)) from e


def _logger(spec: TrainSpec) -> Any:
    t = spec.tracker
    if t.kind == "none" or t.mode == "disabled":
        return False
    # Lightning (and torch) load only for trials that train with it, never for GBT trials.
    from lightning.pytorch.loggers import WandbLogger

    os.environ.setdefault("WANDB_SILENT", "true")
    if t.dir:
        os.makedirs(t.dir, exist_ok=True)
    return WandbLogger(
        project=t.project,
        entity=t.entity,
        group=t.group,
        name=t.name,
        id=t.name and f"{t.group or t.project}-{t.name}".replace("/", "-")[:64],
        save_dir=t.dir,
        offline=t.mode == "offline",
        config={**t.config, "trial_id": spec.trial_id},
        log_model=False,
        resume="allow",  # a resumed trial continues the same run
    )


def evaluate(model: Any, x: Any, y: Any) -> float:
    import torch  # only Lightning trials get here; GBT trials never load torch

    model.eval()
    with torch.no_grad():
        pred = model(x).argmax(dim=1)
    return float((pred == y).float().mean())


def export_model(model: Any, dm: Any, spec: TrainSpec, dest_uri: str) -> None:
    """Write `model.pt2` (torch.export, dynamic batch) and `meta.json` for serving."""
    import torch  # only Lightning trials get here; GBT trials never load torch

    model.eval()
    example = dm.example_input()
    program = torch.export.export(model, (example,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    meta = {
        "features": spec.data.features,
        "target": spec.data.target,
        "task": "classification",
        "classes": dm.classes(),
        "input_dtype": "float32",
    }
    with tempfile.TemporaryDirectory() as tmp:
        torch.export.save(program, os.path.join(tmp, "model.pt2"))
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=2, sort_keys=True)
        fs, path = fsspec.core.url_to_fs(dest_uri)
        fs.makedirs(path, exist_ok=True)
        for name in ("model.pt2", "meta.json"):
            fs.put_file(os.path.join(tmp, name), f"{path}/{name}")


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

    Raises:
        CheckpointLayoutError: the checkpoint was sharded over another world size.
    """
    # torch loads only for Lightning trials, never for GBT trials.
    import torch.distributed as dist

    from training.checkpointing import CheckpointUnusable, SkippedCheckpointWarning

    shared: list[Any] = [(store.committed(), uuid.uuid4().hex[:12])] if rank == 0 else [None]
    dist.broadcast_object_list(shared, src=0)
    candidates, token = shared[0]
    chosen = None
    for name, _ in candidates:
        try:
            loaded, why = store.load(name, rank=rank, world_size=world), ""
        except CheckpointUnusable as e:
            loaded, why = None, str(e)
        verdicts: list[Any] = [None] * world
        dist.all_gather_object(verdicts, why)
        bad = {r: w for r, w in enumerate(verdicts) if w}
        if not bad:
            chosen = loaded
            break
        if rank == 0:
            msg = f"skipping checkpoint {store.root_uri}/{name}: " + "; ".join(f"rank {r}: {w}" for r, w in bad.items()) + "; trying the previous one"
            log.warning(msg)
            warnings.warn(msg, SkippedCheckpointWarning, stacklevel=2)
    if rank == 0:
        store.discard_after(chosen.step if chosen is not None else -1)
    dist.barrier()
    return chosen, token


def train(spec: TrainSpec) -> Optional[TrainResult]:
    """Fit, evaluate, export; returns the result on rank 0 and None elsewhere.

    Every run checkpoints through the committed store with exact resume
    (`training.fault_tolerance`): DDP and single-process runs as one payload
    written by rank 0, fsdp/tp runs as one shard per rank committed by rank 0
    (`training.strategies.CheckedModelParallelStrategy`).
    """
    if spec.task == "gbt":
        # LightGBM loads only for GBT trials, never beside torch in a Lightning trial.
        from training.gbt import run_gbt

        return run_gbt(spec)
    # Imported after the GBT branch: these load torch and Lightning, which a GBT trial never needs.
    import lightning as L

    from training import determinism
    from training.callbacks import FaultInjectionCallback, ProgressCallback
    from training.checkpointing import CheckpointError, CheckpointStore
    from training.data import read_parquet_tensors
    from training.distributed import init_process_group
    from training.fault_tolerance import FaultTolerance, StoreCheckpointIO
    from training.pruning import pruning_callback
    from training.strategies import is_sharded

    started_wall = time.time()
    started = time.perf_counter()
    L.seed_everything(spec.seed, workers=True, verbose=False)
    model, dm = build(spec)
    trainer_kwargs = _trainer_kwargs(spec)
    init_process_group("gloo" if spec.distribution.accelerator == "cpu" else "nccl")
    caveats = determinism.apply(
        spec.deterministic, spec.distribution.accelerator, getattr(dm, "num_workers", 0), spec.distribution.world_size
    )
    if caveats and _rank() == 0:
        log.warning("determinism: %s", "; ".join(caveats))
    rank = _rank()
    world = spec.distribution.world_size
    sharded = spec.distribution.strategy != "ddp" and world > 1
    markers = FaultMarkers(spec.output_uri)
    faults = spec.faults
    with Reporter(rank) as reporter:
        progress = ProgressCallback(reporter)
        callbacks: list[Any] = [progress]
        pruning = pruning_callback(spec)  # None unless spec.optuna enables a pruner
        if pruning is not None:
            callbacks.append(pruning)
        if faults.raise_at_step is not None or faults.nan_at_step is not None:
            callbacks.append(FaultInjectionCallback(faults.raise_at_step, faults.nan_at_step))
        plugins: list[Any] = []
        resume_path: Optional[str] = None
        fail_writes = 0
        if rank == 0 and faults.fail_storage_writes and not markers.fired("storage"):
            markers.mark("storage")
            fail_writes = faults.fail_storage_writes
        store = CheckpointStore(
            join(spec.output_uri, CHECKPOINT_DIR),
            keep_last=spec.checkpoint.keep_last,
            max_write_attempts=spec.checkpoint.write_attempts,
            fail_next_writes=fail_writes,
            weights_only=False,
        )
        loaded = select_resume(store, spec, markers, rank, sharded)
        io = StoreCheckpointIO(store, async_save=spec.checkpoint.async_save)
        if sharded:
            loaded, token = select_sharded_resume(store, rank, world)
            strategy = trainer_kwargs["strategy"]
            strategy.committed_io, strategy.shard_token = io, token
        else:
            plugins.append(io)
        attempt = AttemptLog(spec.output_uri, attempt_id(), started_wall)
        if loaded is not None:
            resume_path = io.remember(loaded)
            attempt.record.update(resumed_from=loaded.uri, resumed_from_step=loaded.step)
            reporter.info(f"trial {spec.trial_id}: resuming from committed checkpoint {loaded.uri} (step {loaded.step})")
        ft = FaultTolerance(spec.checkpoint, io, spec.distribution.nodes, spec.monitor, spec.monitor_mode, faults, markers, attempt)
        callbacks.append(ft)
        logger = _logger(spec)
        trainer = L.Trainer(
            **trainer_kwargs,
            max_epochs=spec.max_epochs,
            limit_train_batches=spec.limit_train_batches,
            deterministic=spec.deterministic,
            precision=spec.precision,
            callbacks=callbacks,
            plugins=plugins or None,
            enable_checkpointing=False,
            num_sanity_val_steps=0,
            use_distributed_sampler=not getattr(dm, "handles_distributed_sampling", False),
            logger=logger,
            enable_progress_bar=False,
            enable_model_summary=False,
            log_every_n_steps=spec.log_every_n_steps,
        )
        reporter.info(f"trial {spec.trial_id}: training {spec.model.path} on data {spec.data.version[:12]}")
        fit_started = time.perf_counter()
        trainer.fit(model, datamodule=dm, ckpt_path=resume_path)
        fit_seconds = time.perf_counter() - fit_started
        if trainer.global_rank != 0:
            return None

        ft.attempt.update(force=True, status="completed", last_step=trainer.global_step)
        # Sharded checkpoints are read whole here (every rank's shard merged); rank 0 alone, no collectives.
        best = store.best() or store.latest()
        if best is None:
            raise CheckpointError(f"training finished but no committed checkpoint is readable under {store.root_uri}")
        if is_sharded(model):
            model = build(spec)[0]
        model.load_state_dict(best.state["state_dict"])
        best_uri, best_score = best.uri, ft.best_score
        metrics = {}
        for split, uri in (("val", spec.data.val_uri), ("test", spec.data.test_uri)):
            x, y = read_parquet_tensors(uri, spec.data.features, spec.data.target)
            metrics[f"{split}_acc"] = evaluate(model, x, y)
        model_uri = join(spec.output_uri, "model")
        export_model(model, dm, spec, model_uri)
        tracker_run = None
        if logger:
            logger.experiment.summary.update(metrics)
            tracker_run = f"{logger.experiment.project}/{logger.experiment.id}"
        wall = time.perf_counter() - started
        world = trainer.world_size
        accounting = goodput(read_attempts(spec.output_uri), world, time.time())
        result = TrainResult(
            trial_id=spec.trial_id,
            status="pruned" if pruning is not None and pruning.pruned else "completed",
            metrics=metrics,
            best_metric=best_score if best_score is not None else metrics["val_acc"],
            epochs=trainer.current_epoch,
            global_step=trainer.global_step,
            train_samples=progress.train_samples,
            fit_seconds=fit_seconds,
            samples_per_second=progress.train_samples / fit_seconds if fit_seconds > 0 else 0.0,
            wall_seconds=wall,
            world_size=world,
            device_hours=accounting.get("device_hours", wall * world / 3600.0),
            model_uri=model_uri,
            checkpoint_uri=best_uri,
            tracker_run=tracker_run,
            lineage={**spec.lineage, "determinism_caveats": caveats},
            resumed_from=resume_path,
            checkpoint_interval_seconds=ft.interval_seconds,
            checkpoint_interval_source=ft.interval_source,
            goodput=accounting,
        )
        reporter.info(f"trial {spec.trial_id}: done, {metrics}")
        if logger:
            logger.experiment.finish()
        return result


def failure_category(exc: BaseException) -> str:
    """config | user | preempted | infra: what the launcher maps to terminal or retryable."""
    # The SIGTERM flag lives in training.fault_tolerance; not imported (GBT, early failures) means never set.
    fault_tolerance = sys.modules.get("training.fault_tolerance")
    # The checkpoint store loads torch, which a GBT trial that failed never needs.
    from training.checkpointing import CheckpointError

    if isinstance(exc, ConfigError):
        return "config"
    if isinstance(exc, Preempted):
        return "preempted"
    if isinstance(exc, CheckpointError):
        return "infra"
    text = str(exc).lower()
    comm = type(exc).__name__ in ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError")
    comm = comm or any(s in text for s in ("connection closed by peer", "connection reset by peer", "gloo", "nccl"))
    # A rank that lost a peer, or was told to stop while blocked in a collective, is an infrastructure casualty.
    if comm or (fault_tolerance is not None and fault_tolerance.SIGTERM_RECEIVED):
        return "infra"
    return "user"


EXIT_CODES = {"config": EXIT_BAD_CONFIG, "user": EXIT_USER_ERROR, "preempted": EXIT_PREEMPTED, "infra": EXIT_INFRA}


def earlier_terminal_failure(output_uri: str) -> Optional[dict[str, Any]]:
    """A config or user failure recorded by an earlier worker group of this same launch.

    torchrun restarts the worker group after any failure; a bug in model code
    would fail the same way again, so a restarted group stops at once instead.
    """
    launch = os.environ.get(LAUNCH_ID_ENV)
    if launch is None or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        return None
    fs, path = fsspec.core.url_to_fs(join(output_uri, FAILURE_DIR))
    if not fs.exists(path):
        return None
    for p in sorted(fs.glob(f"{path}/rank-*.json")):
        with fs.open(p, "r") as f:
            record = json.load(f)
        if record.get("launch") == launch and record["category"] in ("config", "user"):
            return record
    return None


def write_failure(spec_uri: str, output_uri: Optional[str], category: str, exc: BaseException) -> None:
    record = {
        "rank": _rank(),
        "launch": os.environ.get(LAUNCH_ID_ENV),
        "time": time.time(),
        "category": category,
        "error": f"{type(exc).__name__}: {exc}",
        "traceback": "".join(traceback.format_exception(exc)),
        "spec": spec_uri,
    }
    if output_uri is None:
        output_uri = spec_uri.rsplit("/", 1)[0]
    with fsspec.open(join(output_uri, FAILURE_DIR, f"rank-{record['rank']}.json"), "w", auto_mkdir=True) as f:
        json.dump(record, f, indent=2)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.entrypoint", description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="URI of the TrainSpec JSON")
    args = parser.parse_args(argv)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[rank {_rank()}] %(asctime)s %(levelname)s: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    spec: Optional[TrainSpec] = None
    try:
        spec = load_spec(args.spec)
        earlier = earlier_terminal_failure(spec.output_uri)
        if earlier is not None:
            log.error("an earlier worker group of this launch failed on rank %s (%s); not training again", earlier["rank"], earlier["error"])
            return EXIT_CODES[earlier["category"]]
        result = train(spec)
    except Exception as e:
        category = failure_category(e)
        write_failure(args.spec, spec.output_uri if spec else None, category, e)
        if category == "config":
            log.error("bad config: %s", e)
        elif category == "preempted":
            log.warning("preempted: %s", e)
        else:
            traceback.print_exc()
        return EXIT_CODES[category]
    if result is not None:
        with fsspec.open(join(spec.output_uri, RESULT_FILE), "w", auto_mkdir=True) as f:
            f.write(result.model_dump_json(indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
