"""The Optuna pruner a trial's `PrunerSpec` declares, for both trainers (no torch or Lightning here).

`training.pruning` (Lightning) and `training.gbt` (LightGBM) load the study with
this pruner, so a trial is judged by the pruner its pipeline declared, and a
pipeline that declares none is never pruned.
"""

from __future__ import annotations

from typing import Any, Optional

from training.errors import ConfigError
from training.spec import PrunerSpec


def build_pruner(spec: PrunerSpec, max_epochs: Optional[int] = None) -> Any:
    """The Optuna pruner a `PrunerSpec` declares.

    Args:
        spec: the pruner settings.
        max_epochs: the trial's epoch budget; Hyperband's `max_resource` when unset.
    """
    import optuna  # loaded only for trials of a sweep

    if spec.kind == "none":
        return optuna.pruners.NopPruner()
    if spec.kind == "median":
        return optuna.pruners.MedianPruner(
            n_startup_trials=spec.n_startup_trials, n_warmup_steps=spec.n_warmup_steps, interval_steps=spec.interval_steps
        )
    if spec.kind == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=spec.min_resource, reduction_factor=spec.reduction_factor)
    if spec.kind == "hyperband":
        max_resource = spec.max_resource or max_epochs
        if max_resource is None:
            raise ConfigError("pruner 'hyperband' needs max_resource (or the trial's max_epochs)")
        return optuna.pruners.HyperbandPruner(
            min_resource=spec.min_resource, max_resource=max_resource, reduction_factor=spec.reduction_factor
        )
    return optuna.pruners.ThresholdPruner(lower=spec.lower, upper=spec.upper, n_warmup_steps=spec.n_warmup_steps)
