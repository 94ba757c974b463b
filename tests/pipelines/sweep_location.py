"""A code location for daemon drills: the drill pipeline with its sweep sensor started and ticking at every daemon look.

Loaded by `dagster-daemon run` in tests (see test_sensors.py); configured by
environment: SWEEP_DRILL_HOME (store and data), SWEEP_DRILL_OPTUNA_URL (study
storage), SWEEP_DRILL_TRIALS and SWEEP_DRILL_PARALLELISM. Trials train inside the
barrier `SWEEP_DRILL_HOME/barrier`, which holds each until two train together;
with SWEEP_DRILL_REUSE (seconds) they train without it and a short trial's run
goes on with the sweep (`SearchSpec.reuse_run_under_seconds`). With
SWEEP_DRILL_TRIVIAL the trials train nothing (`TrivialLauncher`, still inside the
barrier, with SWEEP_DRILL_REUSE too); SWEEP_DRILL_SENSOR_SECONDS sets the sweep
sensor's minimum interval (default 1: it ticks at every daemon look); with SWEEP_DRILL_PREPARE_ONCE a sensor requests
one `prepare` run of
`sweep`, so the daemon launches the run that materializes it (from this code
location, as a run started in the UI or by the landing sensor is).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dagster import AssetKey, DefaultSensorStatus, Definitions, RunRequest, SensorDefinition, sensor
from pydantic import Field

from pipelines.factory import build_definitions, job_names
from pipelines.sensors import with_sweep_sensors
from resources.launcher import Launcher, LaunchOutcome, LocalLauncher
from resources.sweeps import SweepStore
from tests.pipelines.sweep_drill import TrivialLauncher, drill_resources, drill_spec
from tests.support.barrier import FileBarrier
from training.spec import PrunerSpec, TrainSpec
from trainyard import naming
from trainyard.spec import PipelineSpec

PREPARE_ONCE_KEY = (
    "drill/prepare-once"  # the run key of the one `prepare` run the SWEEP_DRILL_PREPARE_ONCE sensor requests
)


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


def prepare_once(spec: PipelineSpec, prepare_job: Any) -> SensorDefinition:
    """A sensor that requests one run of `prepare` materializing `sweep` (its run key makes the daemon drop every later
    request)."""

    @sensor(
        name="drill_prepare_once",
        job=prepare_job,
        minimum_interval_seconds=1,
        default_status=DefaultSensorStatus.RUNNING,
    )
    def drill_prepare_once(context: Any) -> RunRequest:
        return RunRequest(run_key=PREPARE_ONCE_KEY, asset_selection=[AssetKey(naming.asset_path(spec, naming.SWEEP))])

    return drill_prepare_once


def drill_definitions() -> Definitions:
    home = Path(os.environ["SWEEP_DRILL_HOME"])
    spec = daemon_spec(int(os.environ["SWEEP_DRILL_TRIALS"]), int(os.environ["SWEEP_DRILL_PARALLELISM"]))
    sweeps = SweepStore(storage_url=os.environ["SWEEP_DRILL_OPTUNA_URL"], heartbeat_interval=2, grace_period=30)
    launcher: Launcher = BarrierLauncher(timeout_seconds=300, barrier_dir=str(home / "barrier"))
    if os.environ.get(
        "SWEEP_DRILL_REUSE"
    ):  # runs go on with the sweep: real trials, no barrier (a lone last trial would wait forever)
        spec = spec.model_copy(
            update={
                "search": spec.search.model_copy(
                    update={"reuse_run_under_seconds": float(os.environ["SWEEP_DRILL_REUSE"])}
                )
            }
        )
        launcher = LocalLauncher(timeout_seconds=300)
    if os.environ.get("SWEEP_DRILL_TRIVIAL"):
        launcher = TrivialLauncher(barrier_dir=str(home / "barrier"), barrier_parties=2, timeout_seconds=120)
    resources = drill_resources(home, launcher, sweeps)
    full = build_definitions(spec, resources=resources)
    bare = Definitions(
        assets=list(full.assets or []), jobs=list(full.jobs or []), resources=resources, executor=full.executor
    )
    interval = int(os.environ.get("SWEEP_DRILL_SENSOR_SECONDS", "1"))
    defs = with_sweep_sensors(bare, spec, minimum_interval_seconds=interval, default_status=DefaultSensorStatus.RUNNING)
    if os.environ.get("SWEEP_DRILL_PREPARE_ONCE"):
        prepare = next(j for j in bare.jobs or [] if j.name == job_names(spec)["prepare"])
        defs = Definitions.merge(defs, Definitions(sensors=[prepare_once(spec, prepare)]))
    return defs


defs = drill_definitions() if "SWEEP_DRILL_HOME" in os.environ else Definitions()
