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
from typing import Any, Optional

import fsspec

from training.spec import (
    EXIT_BAD_CONFIG,
    EXIT_USER_ERROR,
    FAILURE_DIR,
    RESULT_FILE,
    ImportTarget,
    TrainResult,
    TrainSpec,
)

log = logging.getLogger("trainyard.training")


class ConfigError(ValueError):
    """The spec names something that cannot be built; retrying cannot help."""


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
    from training.strategies import StrategyConfigError, trainer_kwargs

    try:
        return trainer_kwargs(spec.distribution, int(os.environ.get("WORLD_SIZE", "1")))
    except StrategyConfigError as e:
        raise ConfigError(str(e)) from e


def _logger(spec: TrainSpec) -> Any:
    t = spec.tracker
    if t.kind == "none" or t.mode == "disabled":
        return False
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
    )


def evaluate(model: Any, x: Any, y: Any) -> float:
    import torch

    model.eval()
    with torch.no_grad():
        pred = model(x).argmax(dim=1)
    return float((pred == y).float().mean())


def export_model(model: Any, dm: Any, spec: TrainSpec, dest_uri: str) -> None:
    """Write `model.pt2` (torch.export, dynamic batch) and `meta.json` for serving."""
    import torch

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


def train(spec: TrainSpec) -> Optional[TrainResult]:
    """Fit, evaluate, export; returns the result on rank 0 and None elsewhere."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from training.callbacks import FaultInjectionCallback, ProgressCallback
    from training.data import read_parquet_tensors
    from training.reporting import Reporter

    started = time.perf_counter()
    L.seed_everything(spec.seed, workers=True, verbose=False)
    model, dm = build(spec)
    trainer_kwargs = _trainer_kwargs(spec)
    rank = _rank()
    with Reporter(rank) as reporter:
        progress = ProgressCallback(reporter)
        checkpoint = ModelCheckpoint(
            dirpath=join(spec.output_uri, "checkpoints"),
            monitor=spec.monitor,
            mode=spec.monitor_mode,
            save_top_k=1,
            save_last=True,
            filename="best-{epoch:03d}",
        )
        callbacks: list[Any] = [progress, checkpoint]
        if spec.faults.raise_at_step is not None:
            callbacks.append(FaultInjectionCallback(spec.faults.raise_at_step))
        logger = _logger(spec)
        trainer = L.Trainer(
            **trainer_kwargs,
            max_epochs=spec.max_epochs,
            limit_train_batches=spec.limit_train_batches,
            deterministic=spec.deterministic,
            callbacks=callbacks,
            logger=logger,
            enable_progress_bar=False,
            enable_model_summary=False,
            log_every_n_steps=spec.log_every_n_steps,
        )
        reporter.info(f"trial {spec.trial_id}: training {spec.model.path} on data {spec.data.version[:12]}")
        fit_started = time.perf_counter()
        trainer.fit(model, datamodule=dm)
        fit_seconds = time.perf_counter() - fit_started
        if trainer.global_rank != 0:
            return None

        best_path = checkpoint.best_model_path or checkpoint.last_model_path
        with fsspec.open(best_path, "rb") as f:
            state = torch.load(f, map_location="cpu", weights_only=True)["state_dict"]
        model.load_state_dict(state)
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
        best_score = checkpoint.best_model_score
        result = TrainResult(
            trial_id=spec.trial_id,
            metrics=metrics,
            best_metric=float(best_score) if best_score is not None else metrics["val_acc"],
            epochs=trainer.current_epoch,
            global_step=trainer.global_step,
            train_samples=progress.train_samples,
            fit_seconds=fit_seconds,
            samples_per_second=progress.train_samples / fit_seconds if fit_seconds > 0 else 0.0,
            wall_seconds=wall,
            world_size=world,
            device_hours=wall * world / 3600.0,
            model_uri=model_uri,
            checkpoint_uri=best_path,
            tracker_run=tracker_run,
            lineage=spec.lineage,
        )
        reporter.info(f"trial {spec.trial_id}: done, {metrics}")
        if logger:
            logger.experiment.finish()
        return result


def write_failure(spec_uri: str, output_uri: Optional[str], category: str, exc: BaseException) -> None:
    record = {
        "rank": _rank(),
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
        result = train(spec)
    except ConfigError as e:
        write_failure(args.spec, spec.output_uri if spec else None, "config", e)
        log.error("bad config: %s", e)
        return EXIT_BAD_CONFIG
    except Exception as e:
        write_failure(args.spec, spec.output_uri if spec else None, "user", e)
        traceback.print_exc()
        return EXIT_USER_ERROR
    if result is not None:
        with fsspec.open(join(spec.output_uri, RESULT_FILE), "w", auto_mkdir=True) as f:
            f.write(result.model_dump_json(indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
