"""A code location for daemon drills: the drill pipeline with its sweep sensor started and ticking every second.

Loaded by `dagster-daemon run` in tests (see test_sensors.py); configured by
environment: SWEEP_DRILL_HOME (store and data), SWEEP_DRILL_OPTUNA_URL (study
storage), SWEEP_DRILL_TRIALS and SWEEP_DRILL_PARALLELISM. Trials train inside the
barrier `SWEEP_DRILL_HOME/barrier`, which holds each until two train together;
with SWEEP_DRILL_REUSE (seconds) they train without it and a short trial's run
goes on with the sweep (`SearchSpec.reuse_run_under_seconds`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dagster import DefaultSensorStatus, Definitions
from pydantic import Field

from pipelines.factory import build_definitions
from pipelines.sensors import with_sweep_sensors
from resources.launcher import LaunchOutcome, LocalLauncher
from resources.sweeps import SweepStore
from tests.pipelines.sweep_drill import drill_resources, drill_spec
from tests.support.barrier import FileBarrier
from training.spec import PrunerSpec, TrainSpec
from trainyard.spec import PipelineSpec


class BarrierLauncher(LocalLauncher):
    """`LocalLauncher` whose trials train inside a `FileBarrier` (see tests/support/barrier.py).

    Args:
        barrier_dir: The barrier's shared directory.
        barrier_parties: How many trials must train together before any goes on.
    """

    barrier_dir: str
    barrier_parties: int = Field(2, ge=1)

    def launch(self, spec: TrainSpec, context: Any = None) -> LaunchOutcome:
        barrier = FileBarrier(Path(self.barrier_dir), self.barrier_parties, timeout=self.timeout_seconds)
        with barrier.inside(spec.trial_id):
            return super().launch(spec, context)


def daemon_spec(n_trials: int, parallelism: int) -> PipelineSpec:
    """The drill pipeline with real one-epoch trials that report to the study every epoch (median pruner)."""
    spec = drill_spec(n_trials=n_trials, parallelism=parallelism, pruner=PrunerSpec(kind="median", n_startup_trials=1))
    return spec.model_copy(update={"model": spec.model.model_copy(update={"max_epochs": 1})})


def drill_definitions() -> Definitions:
    home = Path(os.environ["SWEEP_DRILL_HOME"])
    spec = daemon_spec(int(os.environ["SWEEP_DRILL_TRIALS"]), int(os.environ["SWEEP_DRILL_PARALLELISM"]))
    sweeps = SweepStore(storage_url=os.environ["SWEEP_DRILL_OPTUNA_URL"], heartbeat_interval=2, grace_period=30)
    launcher: LocalLauncher = BarrierLauncher(timeout_seconds=300, barrier_dir=str(home / "barrier"))
    if os.environ.get("SWEEP_DRILL_REUSE"):  # runs go on with the sweep: real trials, no barrier (a lone last trial would wait forever)
        spec = spec.model_copy(update={"search": spec.search.model_copy(update={"reuse_run_under_seconds": float(os.environ["SWEEP_DRILL_REUSE"])})})
        launcher = LocalLauncher(timeout_seconds=300)
    resources = drill_resources(home, launcher, sweeps)
    full = build_definitions(spec, resources=resources)
    bare = Definitions(assets=list(full.assets or []), jobs=list(full.jobs or []), resources=resources, executor=full.executor)
    return with_sweep_sensors(bare, spec, minimum_interval_seconds=1, default_status=DefaultSensorStatus.RUNNING)


defs = drill_definitions() if "SWEEP_DRILL_HOME" in os.environ else Definitions()
