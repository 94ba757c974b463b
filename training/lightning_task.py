"""The `lightning` task: a LightningModule trial, run by `training.entrypoint` under torchrun.

It builds the LightningModule and LightningDataModule named by import path,
resumes from the newest committed checkpoint, trains, evaluates the best
weights on the full validation and test splits and exports a serving model.

Every run checkpoints through the committed store with exact resume
(`training.fault_tolerance`; the store and the resume are opened by
`training.lightning_resume`): DDP and single-process runs as one payload
written by rank 0, fsdp/tp runs as one shard per rank committed by rank 0
(`training.strategies.CheckedModelParallelStrategy`).

The platform's preprocessing (`training.preprocessing`) is fitted on the train
split before the data module is built and handed to a data module that takes
`preprocessing` (`training.data.ParquetDataModule` does): the model's
`n_features` is then the width after it, and the export ships its state. Class
labels may be any values (sorted; a label's index is its class). A binary model
may return one logit per row (the second class's; sigmoid) or one per class
(softmax). The final metrics (`training.metrics`) come with the train prior's
beside them (`baseline_*`).

A language model (`prediction_task == "causal_lm"`) trains on its data module's
token batches: no preprocessing, no classes; it is evaluated on the whole
validation and test splits (`val_loss`, `val_perplexity`, `test_*`, the train
split's unigram model beside them) and reports `tokens_per_second`
(`training.lightning_eval.lm_metrics`).

This module loads torch and Lightning; `training.entrypoint` imports it only
for Lightning trials, so a GBT trial never does.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import time
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.loggers import WandbLogger

from training import determinism, preprocessing
from training.attempts import FaultMarkers, goodput, private_wandb_unless_first, read_attempts
from training.callbacks import FaultInjectionCallback, ProgressCallback, ProgressRecorder
from training.checkpointing import CheckpointError, CheckpointStore
from training.data import fit_preprocessing
from training.distributed import init_process_group
from training.errors import ConfigError, StrategyConfigError
from training.lightning_eval import (
    EVALUATION_METRIC,
    check_output_fits_task,
    export_model,
    final_metrics,
    prediction_task,
)
from training.lightning_resume import open_checkpointing
from training.pruning import OptunaPruning, pruning_callback
from training.reporting import Reporter
from training.spec import WANDB_SERVICE_ENV, ImportTarget, TrainResult, TrainSpec
from training.storage import join
from training.strategies import is_sharded, trainer_kwargs

log = logging.getLogger("trainyard.training")

def import_target(target: ImportTarget, what: str) -> type[Any]:
    """The class named by `target.path` (`module:attribute`); `what` names it in errors.

    Raises:
        ConfigError: the module cannot be imported or lacks the attribute.
    """
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
    the data unless the pipeline set them explicitly (`n_classes` only for
    classification; `n_features` is the width after the platform's
    preprocessing), likewise `vocab_size` / `block_size` (the data module's
    attributes; a language model's) and `in_channels` / `height` / `width` (an
    image data module's `input_shape`, `[C, H, W]`); a data module that accepts
    `task` gets the trial's, one
    that accepts `preprocessing` the state fitted on the train split
    (`training.data.fit_preprocessing`). With `class_weight="balanced"` the model
    gets `class_weights`, one float per class.

    Raises:
        ConfigError: a class cannot be imported or rejects its arguments, a feature
            cannot be preprocessed, or class weights are asked for a model that takes none.
    """
    task = prediction_task(spec)
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
    dm_params = inspect.signature(dm_cls.__init__).parameters
    if "seed" in dm_params:
        dm_kwargs.setdefault("seed", spec.seed)
    if "task" in dm_params:
        dm_kwargs.setdefault("task", task)
    if "preprocessing" in dm_params and "preprocessing" not in dm_kwargs and task != "causal_lm":
        dm_kwargs["preprocessing"] = fit_preprocessing(
            {"train": spec.data.train_uri, "val": spec.data.val_uri, "test": spec.data.test_uri},
            list(spec.data.features),
            dict(spec.data.feature_types),
            dict(spec.data.domains),
            spec.preprocessing.model_dump(),
        )
    try:
        dm = dm_cls(**dm_kwargs)
    except TypeError as e:
        raise ConfigError(f"datamodule {spec.datamodule.path!r} rejected its arguments {sorted(dm_kwargs)}: {e}") from e
    kwargs = dict(spec.model.kwargs)
    params = inspect.signature(model_cls.__init__).parameters
    if "n_features" in params and "n_features" not in kwargs and task != "causal_lm":
        kwargs["n_features"] = int(getattr(dm, "n_features", len(spec.data.features)))
    for name in ("vocab_size", "block_size"):
        if name in params and name not in kwargs and getattr(dm, name, None) is not None:
            kwargs[name] = int(getattr(dm, name))
    shape = getattr(dm, "input_shape", None) if getattr(dm, "kind", None) == "image" else None
    for name, size in zip(("in_channels", "height", "width"), shape or ()):
        if name in params and name not in kwargs:
            kwargs[name] = int(size)
    if task == "classification" and "n_classes" in params and "n_classes" not in kwargs:
        kwargs["n_classes"] = len(dm.classes())
    if (
        task == "classification"
        and spec.data.positive_label is not None
        and hasattr(dm, "classes")
        and len(dm.classes()) == 2
    ):
        try:
            preprocessing.positive_index(list(dm.classes()), spec.data.positive_label)
        except ValueError as e:
            raise ConfigError(
                f"{e} of target {spec.data.target!r}; set the pipeline's positive_label to one of them or leave it "
                "unset"
            ) from e
    if spec.class_weight == "balanced":
        kwargs["class_weights"] = _class_weights(spec, dm, params, kwargs)
    try:
        model = model_cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"model {spec.model.path!r} rejected hyperparameters {kwargs}: {e}") from e
    return model, dm


def _class_weights(spec: TrainSpec, dm: Any, params: Any, kwargs: dict[str, Any]) -> torch.Tensor:
    """`class_weight="balanced"`: n_rows / (n_classes * rows of the class) per class of the train split, as a float
    tensor."""
    if prediction_task(spec) != "classification":
        raise ConfigError(
            f"class_weight={spec.class_weight!r} weighs classes, but this is a {prediction_task(spec)} task; leave it "
            "unset"
        )
    if "class_weights" not in params and not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values()):
        raise ConfigError(
            f"class_weight='balanced' needs a model that weighs its loss by class, but model {spec.model.path!r} "
            "takes no "
            "`class_weights` argument; add `class_weights: Optional[torch.Tensor] = None` to its constructor "
            "(e.g. `nn.CrossEntropyLoss(weight=class_weights)`, or `pos_weight` from it for one logit) or unset "
            "class_weight"
        )
    if "class_weights" in kwargs:
        raise ConfigError(
            "model.kwargs sets class_weights, and class_weight='balanced' computes them; use one or the other"
        )
    if not hasattr(dm, "class_counts"):
        raise ConfigError(
            f"class_weight='balanced' needs the train split's class counts, which datamodule {spec.datamodule.path!r} "
            "does not give (a `class_counts()` method); use training.data:ParquetDataModule or unset class_weight"
        )
    counts = torch.tensor(dm.class_counts(), dtype=torch.float64)
    weights = torch.where(counts > 0, counts.sum() / (len(counts) * counts.clamp(min=1)), torch.zeros_like(counts))
    return weights.float()


def _trainer_kwargs(spec: TrainSpec) -> dict[str, Any]:
    try:
        return trainer_kwargs(spec.distribution, int(os.environ.get("WORLD_SIZE", "1")))
    except StrategyConfigError as e:
        raise ConfigError(str(e)) from e


def _logger(spec: TrainSpec) -> Any:
    t = spec.tracker
    if t.kind == "none" or t.mode == "disabled":
        return False
    os.environ.setdefault("WANDB_SILENT", "true")
    private_wandb_unless_first(spec.output_uri, t.mode)
    if t.dir:
        os.makedirs(t.dir, exist_ok=True)
    return WandbLogger(
        project=t.project,
        entity=t.entity,
        group=t.group,
        name=t.name,
        id=t.name and f"{t.group or t.project}-{t.name}".replace("/", "-")[:64],
        save_dir=t.dir,  # type: ignore[arg-type]  # Lightning's annotation is narrower than its code: None leaves the directory to W&B
        offline=t.mode == "offline",
        config={**t.config, "trial_id": spec.trial_id},
        log_model=False,
        resume="allow",  # a resumed trial continues the same run
    )


def _open_run(logger: WandbLogger, trial_id: str) -> None:
    """Start the trial's W&B run now (rank 0), on a service of this process's own if the shared one refuses its id.

    A warm server's shared service (`training.warm_wandb`) keeps a run open
    when the process that wrote it died without finishing it (SIGKILL, or an
    earlier worker that left through `os._exit`), and refuses that run id to
    anyone else: "run ID ... is in use". `private_wandb_unless_first` avoids
    it for a trial's own later attempts; this covers what it cannot see (the
    same tracker run id written from another output directory, or a trial
    re-materialized after its attempt log was wiped): the trial goes on with a
    service of its own instead of failing on its experiment tracker.
    """
    try:
        logger.experiment  # noqa: B018  # the property starts the run
    except Exception as e:
        if "is in use" not in str(e) or not os.environ.get(WANDB_SERVICE_ENV):
            raise
        import wandb

        log.warning("trial %s: the shared W&B service refused run %s (%s); using a W&B service of this process's own",
                    trial_id, logger.version, e)
        os.environ.pop(WANDB_SERVICE_ENV, None)
        wandb.teardown()  # closes this process's connection; the shared service is the warm server's and stays
        logger.experiment  # noqa: B018


def _finish_failed_run(logger: WandbLogger) -> None:
    """Mark the trial's W&B run failed when training raises (W&B's exit hook would; a warm worker leaves by `os._exit`).

    A run left open also stays open in a warm server's shared service, which
    then refuses its id to the trial's next attempt.
    """
    experiment = getattr(logger, "_experiment", None)
    if experiment is None:
        return
    try:
        experiment.finish(exit_code=1)
    except Exception as e:  # the training error matters more than the tracker's
        log.warning("could not mark W&B run %s failed: %s", logger.version, e)


def run_lightning(spec: TrainSpec, rank: int) -> Optional[TrainResult]:
    """Fit, evaluate, export; returns the result on rank 0 and None elsewhere (see the module docstring).

    Args:
        spec: The trial; `spec.task` is `lightning`.
        rank: This process's global rank (torchrun's `RANK`).
    """
    started_wall = time.time()
    started = time.perf_counter()
    L.seed_everything(spec.seed, workers=True, verbose=False)
    model, dm = build(spec)
    check_output_fits_task(model, dm, spec)
    built = time.perf_counter() - started
    strategy_kwargs = _trainer_kwargs(spec)
    # Longer than any hang timeout, so the agent's watchdog names a hung rank before a collective fails
    # (WatchdogPolicy).
    init_process_group(
        "gloo" if spec.distribution.accelerator == "cpu" else "nccl",
        spec.checkpoint.watchdog.collective_timeout_seconds,
    )
    caveats = determinism.apply(
        spec.deterministic, spec.distribution.accelerator, getattr(dm, "num_workers", 0), spec.distribution.world_size
    )
    if caveats and rank == 0:
        log.warning("determinism: %s", "; ".join(caveats))
    markers = FaultMarkers(spec.output_uri)
    with Reporter(rank) as reporter:
        progress = ProgressCallback(reporter)
        pruning = pruning_callback(spec)  # None unless spec.optuna enables a pruner
        callbacks = _callbacks(spec, progress, pruning, markers, rank)
        ckpt = open_checkpointing(spec, strategy_kwargs, markers, rank, started_wall, reporter)
        callbacks.append(ckpt.ft)
        logger = _logger(spec)
        if logger and rank == 0:
            _open_run(logger, spec.trial_id)
        trainer = _trainer(spec, dm, strategy_kwargs, callbacks, ckpt.plugins, logger, ckpt.accumulate_grad_batches)
        reporter.info(
            f"trial {spec.trial_id}: training {spec.model.path} on data {spec.data.version[:12]} (start-up: model "
            f"{built:.2f}s, process group, checkpoints and trainer {time.perf_counter() - started - built:.2f}s)"
        )
        fit_started = time.perf_counter()
        try:
            trainer.fit(model, datamodule=dm, ckpt_path=ckpt.resume_path)
        except Exception:
            if logger and rank == 0:
                _finish_failed_run(logger)
            raise
        fit_seconds = time.perf_counter() - fit_started
        if trainer.global_rank != 0:
            return None

        ckpt.ft.attempt.update(force=True, status="completed", last_step=trainer.global_step)
        best_uri, metrics, model_uri, finish = _evaluate_and_export(spec, model, dm, ckpt.store, trainer.global_step,
                                                                    progress.train_samples, fit_seconds, reporter)
        tracker_run = None
        if logger:
            logger.experiment.summary.update(metrics)
            tracker_run = f"{logger.experiment.project}/{logger.experiment.id}"
        wall = time.perf_counter() - started
        world = trainer.world_size
        accounting = goodput(read_attempts(spec.output_uri), world, time.time())
        best_score = ckpt.ft.best_score
        result = TrainResult(
            trial_id=spec.trial_id,
            status="pruned" if pruning is not None and pruning.pruned else "completed",
            metrics=metrics,
            best_metric=best_score
            if best_score is not None
            else metrics[f"val_{EVALUATION_METRIC[prediction_task(spec)]}"],
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
            resumed_from=ckpt.resume_path,
            checkpoint_interval_seconds=ckpt.ft.interval_seconds,
            checkpoint_interval_source=ckpt.ft.interval_source,
            goodput=accounting,
            finish_seconds=finish,
        )
        reporter.info(f"trial {spec.trial_id}: done, {metrics}")
        if logger:
            logger.experiment.finish()
        return result


def _evaluate_and_export(spec: TrainSpec, model: Any, dm: Any, store: CheckpointStore, step: int, train_samples: int,
                         fit_seconds: float, reporter: Reporter) -> tuple[str, dict[str, float], str, dict[str, float]]:
    """Rank 0 after the fit: the best weights evaluated on the full splits and exported as the serving model.

    Returns the best checkpoint's URI, the final metrics, the exported model's URI and the seconds each part took.
    """
    finish: dict[str, float] = {}
    mark = time.perf_counter()
    model, best_uri = _load_best(spec, model, store, step)
    finish["load_best"], mark = time.perf_counter() - mark, time.perf_counter()
    metrics = final_metrics(spec, model, dm)
    if prediction_task(spec) == "causal_lm":  # every rank's tokens, trained per second of fit time
        tokens = train_samples * int(getattr(dm, "block_size", 0) or model.hparams.get("block_size", 0))
        metrics["tokens_per_second"] = tokens / fit_seconds if fit_seconds > 0 else 0.0
    finish["evaluate"], mark = time.perf_counter() - mark, time.perf_counter()
    model_uri = join(spec.output_uri, "model")
    export_model(model, dm, spec, model_uri)
    finish["export"] = time.perf_counter() - mark
    reporter.info(f"trial {spec.trial_id}: after training " + ", ".join(f"{k} {v:.2f}s" for k, v in finish.items()))
    return best_uri, metrics, model_uri, finish


def _callbacks(
    spec: TrainSpec, progress: ProgressCallback, pruning: Optional[OptunaPruning], markers: FaultMarkers, rank: int
) -> list[Any]:
    """Progress first (the agent's progress record, when it watches), then pruning and the step-fault drills the spec
    asks
    for (checkpointing is added last)."""
    recorder = ProgressRecorder.from_env(rank, spec.checkpoint.watchdog.straggler_window_steps)
    callbacks: list[Any] = [progress, *([recorder] if recorder is not None else [])]
    if pruning is not None:
        callbacks.append(pruning)
    faults = spec.faults
    if (
        faults.raise_at_step is not None
        or faults.nan_at_step is not None
        or faults.hang_rank is not None
        or faults.slow_rank is not None
    ):
        callbacks.append(
            FaultInjectionCallback(
                faults.raise_at_step,
                faults.nan_at_step,
                hang_rank=faults.hang_rank,
                hang_at_step=faults.hang_at_step,
                slow_rank=faults.slow_rank,
                slow_seconds=faults.slow_seconds,
                markers=markers,
            )
        )
    return callbacks


def _trainer(
    spec: TrainSpec,
    dm: Any,
    strategy_kwargs: dict[str, Any],
    callbacks: list[Any],
    plugins: list[Any],
    logger: Any,
    accumulate_grad_batches: int = 1,
) -> L.Trainer:
    """The Trainer: Lightning's own checkpointing is off, the committed store (a plugin or the strategy) does it.

    `accumulate_grad_batches` is 1 except in a run resuming a checkpoint
    trained at another world size, where it keeps that run's global batch.
    """
    return L.Trainer(
        accumulate_grad_batches=accumulate_grad_batches,
        **strategy_kwargs,
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


def _load_best(spec: TrainSpec, model: Any, store: CheckpointStore, step: int) -> tuple[Any, str]:
    """The model with the best (else the newest) committed weights, and that checkpoint's URI.

    When the newest best checkpoint was saved at `step` (the last training step)
    from an unsharded model, `model` holds those very weights: it is kept as it
    is and nothing is read (for a 1B-parameter model the checkpoint with its
    optimizer state is ~13 GB). Otherwise the checkpoint is read and verified;
    sharded checkpoints are read whole (every rank's shard merged) into a
    freshly built, unsharded model; rank 0 alone, no collectives.

    Raises:
        CheckpointError: no committed checkpoint is readable.
    """
    sharded = is_sharded(model)
    if not sharded:
        newest = store.newest_best()
        if newest is not None and newest[1] == step:
            return model, newest[0]
    best = store.best() or store.latest()
    if best is None:
        raise CheckpointError(f"training finished but no committed checkpoint is readable under {store.root_uri}")
    if sharded:
        model = build(spec)[0]
    model.load_state_dict(best.state["state_dict"])
    return model, best.uri
