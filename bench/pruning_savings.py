"""Pruning savings on digits: epochs a median-pruned sweep spends to reach the unpruned sweep's best val_acc.

Two sweeps draw the same trials (random sampler, same seed: trial k has the same
parameters in both) over DigitsMLP's `lr` and `hidden` on all 1797 digits. The
unpruned sweep trains every trial for `MAX_EPOCHS`; its best validation
accuracy B is the bar. The pruned sweep trains the same trials in the same
order with the platform's `OptunaPruning` callback (median pruner, Optuna study
on SQLite) and stops at the first epoch any trial reaches B. Training is
deterministic, so a trial that is not pruned follows the same curve in both.

Value: epochs the pruned sweep spent to reach B / epochs the unpruned sweep
spent to reach B (target <= 0.5), summed over `SEEDS` sweeps so one lucky
early best does not decide it. Trials run in-process in one process (a
Lightning Trainer each, not torchrun) to keep the benchmark within 3 minutes;
the callback and the pruner are the ones the pod uses.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from bench.harness import write_result

ROOT = Path(__file__).resolve().parent.parent
N_TRIALS = 12
MAX_EPOCHS = 8
SEEDS = (0, 1)
BATCH = 64


def _loaders() -> tuple[Any, Any]:
    import torch
    from sklearn.datasets import load_digits
    from torch.utils.data import DataLoader, TensorDataset

    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(y), generator=g)
    cut = int(0.8 * len(y))
    train, val = order[:cut], order[cut:]
    return (DataLoader(TensorDataset(x[train], y[train]), batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(0)),
            DataLoader(TensorDataset(x[val], y[val]), batch_size=512))


def _fit(params: dict[str, Any], loaders: tuple[Any, Any], pruning: Optional[Any]) -> list[float]:
    """Train one trial; returns val_acc per epoch run."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from pipelines.vision.models import DigitsMLP

    curve: list[float] = []

    class Record(Callback):
        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            curve.append(float(trainer.callback_metrics["val_acc"]))

    L.seed_everything(0, verbose=False)
    model = DigitsMLP(hidden=params["hidden"], lr=params["lr"])
    callbacks: list[Any] = [Record()] + ([pruning] if pruning is not None else [])
    trainer = L.Trainer(max_epochs=MAX_EPOCHS, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, deterministic=True,
                        callbacks=callbacks)
    trainer.fit(model, *loaders)
    return curve


def _sweep(home: Path, seed: int, pruned: bool, loaders: tuple[Any, Any], bar: Optional[float]) -> dict[str, Any]:
    from pipelines.spec import FloatParam, IntParam, SearchSpec
    from resources.sweeps import SweepStore
    from training.pruning import OptunaPruning
    from training.spec import OptunaSpec, PrunerSpec

    pruner = PrunerSpec(kind="median", n_startup_trials=3, n_warmup_steps=2)
    search = SearchSpec(params={"lr": FloatParam(low=1e-4, high=0.3, log=True), "hidden": IntParam(low=8, high=128, step=8)},
                        n_trials=N_TRIALS, sampler="random", seed=seed, parallelism=1, pruner=pruner if pruned else PrunerSpec())
    url = f"sqlite:///{home / 'optuna.db'}"
    name = f"digits-{seed}-{'pruned' if pruned else 'full'}"
    sweeps = SweepStore(storage_url=url)
    study = sweeps.load_or_create(name, "max", search)
    epochs, reached_at, curves = 0, None, []
    for _ in range(N_TRIALS):
        (number,) = sweeps.ask(sweeps.load(name, search), search, 1)
        params = sweeps.trial(name, number).params
        callback = OptunaPruning(OptunaSpec(storage_url=url, study_name=name, trial_number=number, pruner=pruner), "val_acc") if pruned else None
        curve = _fit(params, loaders, callback)
        curves.append(curve)
        if bar is not None and reached_at is None and max(curve) >= bar:
            reached_at = epochs + next(i for i, v in enumerate(curve) if v >= bar) + 1
        epochs += len(curve)
        if callback is not None and callback.pruned:
            sweeps.tell(name, number, None, {}, pruned=True)
        else:
            sweeps.tell(name, number, max(curve), {})
        if pruned and reached_at is not None:
            break
    best = max(max(c) for c in curves)
    if bar is None:  # the unpruned sweep sets the bar: its best, and the epochs it took to first reach it
        epochs_to_best = 0
        for c in curves:
            if max(c) >= best:
                epochs_to_best += next(i for i, v in enumerate(c) if v >= best) + 1
                break
            epochs_to_best += len(c)
        reached_at = epochs_to_best
    states = [t.state.name for t in study.get_trials(deepcopy=False)]
    return {"best": best, "epochs": epochs, "epochs_to_bar": reached_at, "trials": len(curves), "pruned": states.count("PRUNED")}


def main() -> dict:
    sys.path.insert(0, str(ROOT))
    import warnings

    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    loaders = _loaders()
    started = time.perf_counter()
    runs = []
    with tempfile.TemporaryDirectory(prefix="pruning-") as tmp:
        for seed in SEEDS:
            full = _sweep(Path(tmp), seed, False, loaders, None)
            cut = _sweep(Path(tmp), seed, True, loaders, full["best"])
            runs.append({"seed": seed, "unpruned": full, "pruned": cut})
    spent = sum(r["pruned"]["epochs_to_bar"] or r["pruned"]["epochs"] for r in runs)
    needed = sum(r["unpruned"]["epochs_to_bar"] for r in runs)
    ratio = spent / needed
    return write_result(
        "pruning_savings",
        round(ratio, 3),
        "pruned/unpruned epochs to the unpruned best val_acc",
        0.5,
        {
            "what": "epochs the median-pruned sweep spent until a trial reached the unpruned sweep's best val_acc, divided "
            "by the epochs the unpruned sweep spent to reach it, summed over sweeps with different seeds; target <= 0.5",
            "pruner": "median, n_startup_trials=3, n_warmup_steps=2, reported every epoch",
            "sweeps": runs,
            "all_reached": all(r["pruned"]["epochs_to_bar"] is not None for r in runs),
            "trials_per_sweep": N_TRIALS,
            "max_epochs": MAX_EPOCHS,
            "execution": "trials in-process, one process each (Lightning Trainer, CPU), not torchrun, to stay within 3 minutes",
            "seconds": round(time.perf_counter() - started, 1),
            "meets_target": ratio <= 0.5,
        },
    )


if __name__ == "__main__":
    import json

    print(json.dumps(main(), indent=2))
