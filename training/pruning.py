"""Optuna pruning for Lightning runs, safe under DDP.

After every validation, rank 0 reports the monitored metric to the trial in the
Optuna storage and asks the study's pruner; the decision is broadcast from rank
0, so every rank stops at the same epoch (no rank waits in a collective for a
peer that already left the loop). A pruned run stops like a finished one: the
fault-tolerance callback commits its last checkpoint, the entrypoint evaluates
and exports it and writes `result.json` with status `pruned`, and the
orchestrator, which reads that result, ends the trial as PRUNED (one writer of
final trial states). Only rank 0 talks to Optuna.

Example:
    >>> callback = pruning_callback(spec)  # None unless spec.optuna enables a pruner
"""

from __future__ import annotations

import logging
import math
from typing import Any, Optional

import lightning as L
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from training.errors import ConfigError
from training.pruners import build_pruner, open_trial_storage
from training.spec import OptunaSpec, TrainSpec, redact_url

log = logging.getLogger("trainyard.training")


class OptunaPruning(Callback):
    """Reports the monitored metric each epoch and stops all ranks together when the trial is pruned.

    Args:
        optuna: the trial and its pruner settings (the pruner must be enabled).
        monitor: metric to report when `optuna.report_metric` is unset.
        max_epochs: the run's epoch budget (Hyperband's default `max_resource`).

    Raises:
        ValueError: the pruner is `none` or `monitor` is empty.
    """

    def __init__(self, optuna: OptunaSpec, monitor: str, max_epochs: Optional[int] = None) -> None:
        if not optuna.pruner.enabled:
            raise ValueError(f"OptunaPruning needs an enabled pruner; optuna.pruner.kind is {optuna.pruner.kind!r}")
        metric = optuna.report_metric or monitor
        if not metric:
            raise ValueError(f"monitor must name a logged metric, got {metric!r}")
        self.spec = optuna
        self.metric = metric
        self.max_epochs = max_epochs
        self.pruned_at: Optional[int] = None
        self.pruned_value: Optional[float] = None
        self.reported: list[tuple[int, float]] = []
        self._study: Any = None
        self._storage: Any = None
        self._trial_id: Optional[int] = None
        self._pruner: Any = None

    @property
    def pruned(self) -> bool:
        return self.pruned_at is not None

    def _connect(self) -> None:
        """Rank 0: open the storage and check the trial can still take reports (fail before compute)."""
        import optuna  # every Lightning trial imports this module; Optuna loads only for trials of a sweep

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        try:
            url = self.spec.connect_url()  # credentials only by reference: from the environment, never the spec
        except ValueError as e:
            raise ConfigError(str(e)) from e
        where = redact_url(url.split("?")[0])
        self._storage = open_trial_storage(url)
        self._pruner = build_pruner(self.spec.pruner, self.max_epochs)
        try:
            self._study = optuna.load_study(study_name=self.spec.study_name, storage=self._storage, pruner=self._pruner)
        except KeyError as e:
            raise ConfigError(f"optuna study {self.spec.study_name!r} does not exist in {where}") from e
        if len(self._study.directions) > 1:
            raise ConfigError(
                f"study {self.spec.study_name!r} has {len(self._study.directions)} objectives; Optuna prunes "
                "single-objective studies only"
            )
        study_id = self._storage.get_study_id_from_name(self.spec.study_name)
        try:
            self._trial_id = self._storage.get_trial_id_from_study_id_trial_number(study_id, self.spec.trial_number)
        except KeyError as e:
            raise ConfigError(f"study {self.spec.study_name!r} has no trial number {self.spec.trial_number}") from e
        state = self._storage.get_trial(self._trial_id).state
        if state.is_finished():
            raise ConfigError(
                f"trial {self.spec.trial_number} of study {self.spec.study_name!r} is already {state.name}; "
                "a finished trial takes no more reports (the sweep asks a new trial instead)"
            )

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" and trainer.is_global_zero and self._study is None:
            self._connect()

    def decide(self, epoch: int, value: Optional[float]) -> dict[str, Any]:
        """Rank 0: report `value` at `epoch` and ask the pruner; what every rank acts on."""
        if value is None:
            return {
                "prune": False,
                "error": f"metric {self.metric!r} was not logged during validation; pruning reports it every epoch",
            }
        self._storage.set_trial_intermediate_value(self._trial_id, epoch, value)
        self.reported.append((epoch, value))
        frozen = self._storage.get_trial(self._trial_id)
        prune = bool(self._pruner.prune(self._study, frozen)) or math.isnan(value)
        return {"prune": prune, "value": value, "error": None}

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or self.pruned:
            return
        epoch = trainer.current_epoch
        decision: dict[str, Any] = {}
        if trainer.is_global_zero:
            metric = trainer.callback_metrics.get(self.metric)
            decision = self.decide(epoch, None if metric is None else float(metric))
        decision = trainer.strategy.broadcast(decision, src=0)
        if decision["error"]:
            raise ConfigError(decision["error"])
        if decision["prune"]:
            self.pruned_at = epoch
            self.pruned_value = decision["value"]
            trainer.should_stop = True
            if trainer.is_global_zero:
                log.info(
                    "trial %d pruned at epoch %d (%s=%.4g)",
                    self.spec.trial_number,
                    epoch,
                    self.metric,
                    decision["value"],
                )


def pruning_callback(spec: TrainSpec) -> Optional[OptunaPruning]:
    """The pruning callback for this run, or None when `spec.optuna` enables no pruner."""
    if spec.optuna is None or not spec.optuna.pruner.enabled:
        return None
    return OptunaPruning(spec.optuna, spec.monitor, spec.max_epochs)
