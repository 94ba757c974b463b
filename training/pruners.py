"""The Optuna pruner a trial's `PrunerSpec` declares, and the study storage it reports to, for both trainers (no torch
or Lightning here).

`training.pruning` (Lightning) and `training.gbt` (LightGBM) load the study with
this pruner, so a trial is judged by the pruner its pipeline declared, and a
pipeline that declares none is never pruned. They open the study's storage with
`open_trial_storage`.
"""

from __future__ import annotations

from typing import Any, Optional

from training.errors import ConfigError
from training.spec import PrunerSpec, redact_url

# Optuna's schema version (its Alembic head) per Optuna version, read once per process (`schema_head`).
_SCHEMA_HEADS: dict[str, str] = {}


def schema_head(storage: Any = None) -> str:
    """The storage schema version this process's Optuna writes: the head of its Alembic migrations.

    Optuna reads it from its migration scripts on every `RDBStorage` open, to check the database's schema: 14-20 ms
    warm and most of a forked warm worker's first open of a study (67-97 ms, in each pruned trial's fit). Read once
    per process here; the warm server reads it before it forks (`training.warm_preload.preload`).

    Args:
        storage: an `RDBStorage` to read it with (None: one on an in-memory SQLite database).
    """
    import optuna  # loaded only for trials of a sweep

    head = _SCHEMA_HEADS.get(optuna.__version__)
    if head is None:
        reader = storage or optuna.storages.RDBStorage("sqlite://", skip_compatibility_check=True)
        head = _SCHEMA_HEADS[optuna.__version__] = reader.get_head_version()
        if storage is None:
            reader.engine.dispose()
    return head


def open_trial_storage(url: str) -> Any:
    """Optuna's `RDBStorage` of the study a trial reports to, with Optuna's schema check at the cost of one query.

    The sweep made the study and its tables before any trial started, so tables are not created here and the
    database's schema version is compared with `schema_head()`. Anything else (another schema, no Optuna tables,
    no database) opens the storage the way Optuna does by default, which says what is wrong. SQLite waits up to
    60 s for a lock (parallel trials write).

    Raises:
        ConfigError: the database's schema is not the one this Optuna writes (Optuna's message: which versions, and
            `optuna storage upgrade` or `pip install -U optuna`).
    """
    import optuna  # loaded only for trials of a sweep

    kwargs: dict[str, Any] = {"engine_kwargs": {"connect_args": {"timeout": 60}}} if url.startswith("sqlite") else {}
    try:
        storage = optuna.storages.RDBStorage(url, skip_compatibility_check=True, skip_table_creation=True, **kwargs)
        if storage.get_current_version() == schema_head(storage):
            return storage
        storage.engine.dispose()
    except (
        optuna.exceptions.StorageInternalError
    ):  # no Optuna tables there, or no database: the default open says which
        pass
    try:
        return optuna.storages.RDBStorage(url, **kwargs)
    except RuntimeError as e:  # Optuna's schema check
        raise ConfigError(f"{redact_url(url.split('?')[0])}: {e}") from e


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
            n_startup_trials=spec.n_startup_trials,
            n_warmup_steps=spec.n_warmup_steps,
            interval_steps=spec.interval_steps,
        )
    if spec.kind == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=spec.min_resource, reduction_factor=spec.reduction_factor
        )
    if spec.kind == "hyperband":
        max_resource = spec.max_resource or max_epochs
        if max_resource is None:
            raise ConfigError("pruner 'hyperband' needs max_resource (or the trial's max_epochs)")
        return optuna.pruners.HyperbandPruner(
            min_resource=spec.min_resource, max_resource=max_resource, reduction_factor=spec.reduction_factor
        )
    return optuna.pruners.ThresholdPruner(lower=spec.lower, upper=spec.upper, n_warmup_steps=spec.n_warmup_steps)
