"""Sweep drills: a trivial trial, a pipeline home without the data steps, and a daemon-like driver.

`TrivialLauncher` trains nothing: it writes a result whose `val_acc` is a fixed
function of the trial's `lr`, optionally after a wait, failing, or killing its
own process (a crashed run). `prepared_home` writes the `validated_data` value
the sweep reads (real digits splits) and materializes `sweep` alone, so sweep
tests skip ingest and validation. `drive` evaluates the sweep sensor and runs
what it requests in-process, keeping the cursor in a file like the daemon
keeps it in its tick storage; run as a script it is the process a crash drill
kills and restarts (a restart moves recorded heartbeats past the grace period
rather than waiting it out).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Optional

from dagster import AssetKey, DagsterInstance, RunsFilter
from pydantic import Field

from pipelines.environments import local_resources
from pipelines.factory import build_definitions, job_names
from pipelines.sensors import run_tick
from resources.launcher import Launcher, LaunchOutcome, TrainingCodeError, TrainingConfigError
from resources.sweeps import SweepStore
from tests.digits import write_splits
from tests.pipelines.pipeline_fixtures import small_spec
from tests.support.barrier import FileBarrier
from tests.support.heartbeats import age_heartbeats
from training.spec import RESULT_FILE, TrainResult, TrainSpec
from trainyard.search import FloatParam, SearchSpec
from trainyard.spec import PipelineSpec

RUN_KEY_TAG = "dagster/run_key"


def score(params: dict[str, Any]) -> float:
    """The trivial trial's validation accuracy: best at lr = 0.01."""
    return round(1.0 - abs(math.log10(params["lr"]) + 2.0) / 4.0, 6)


class TrivialLauncher(Launcher):
    """A launcher whose trial trains nothing (see the module docstring).

    Args:
        fail: raise a terminal `TrainingCodeError` (the asset fails the trial).
        config_error: raise `TrainingConfigError`, as a pod that exited 78 (the spec cannot work).
        crash: raise RuntimeError, which is no launch error: the run fails
            without telling the study.
        kill_once_file: when this file exists, SIGKILL this process mid-trial
            once (removing the file), leaving a run and a trial that never end.
        gate_dir: wait until `<gate_dir>/<trial id>` exists before finishing.
        started_dir: write `<started_dir>/<trial id>` when the trial starts.
        barrier_dir: train inside the `FileBarrier` there, which holds each trial
            until `barrier_parties` trials are inside together and counts the most
            that ever were.
        timeout_seconds: bound on every wait (gate, barrier).
    """

    fail: bool = False
    config_error: bool = False
    crash: bool = False
    kill_once_file: Optional[str] = None
    gate_dir: Optional[str] = None
    started_dir: Optional[str] = None
    barrier_dir: Optional[str] = None
    barrier_parties: int = Field(2, ge=1)
    timeout_seconds: float = Field(120.0, gt=0)

    def launch(self, spec: TrainSpec, context: Any = None) -> LaunchOutcome:
        started = time.time()
        if self.started_dir:
            Path(self.started_dir).mkdir(parents=True, exist_ok=True)
            (Path(self.started_dir) / spec.trial_id).write_text(str(started))
        if self.kill_once_file and os.path.exists(self.kill_once_file):
            os.remove(self.kill_once_file)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.config_error:
            raise TrainingConfigError(
                f"trial {spec.trial_id}: bad config (rank 0): ConfigError: the model returns 1 logit; "
                "a classification of 10 classes needs 10"
            )
        if self.fail:
            raise TrainingCodeError(f"trial {spec.trial_id}: rank 0 raised RuntimeError: injected failure")
        if self.crash:
            raise RuntimeError(f"trial {spec.trial_id}: the run worker crashed")
        with contextlib.ExitStack() as held:
            if self.barrier_dir:
                held.enter_context(
                    FileBarrier(Path(self.barrier_dir), self.barrier_parties, self.timeout_seconds).inside(
                        spec.trial_id
                    )
                )
            if self.gate_dir:
                wait_for_file(Path(self.gate_dir) / spec.trial_id, self.timeout_seconds)
            return self._finish(spec, started)

    def _finish(self, spec: TrainSpec, started: float) -> LaunchOutcome:
        out = Path(spec.output_uri)
        (out / "model").mkdir(parents=True, exist_ok=True)
        (out / "model" / "model.bin").write_bytes(b"\0" * (1000 * int(spec.model.kwargs.get("hidden", 1))))
        value = score(spec.model.kwargs)
        wall = time.time() - started
        result = TrainResult(
            trial_id=spec.trial_id,
            metrics={"val_acc": value, "test_acc": value},
            best_metric=value,
            epochs=1,
            global_step=1,
            train_samples=1,
            fit_seconds=wall,
            samples_per_second=1.0,
            wall_seconds=wall,
            world_size=1,
            device_hours=wall / 3600,
            model_uri=str(out / "model"),
            lineage={"started": started, "ended": time.time()},
        )
        (out / RESULT_FILE).write_text(result.model_dump_json())
        return LaunchOutcome(result=result, log_uri="", seconds=wall)


def wait_for_file(path: Path, timeout: float) -> None:
    """Wait until `path` exists (another process creates it).

    Raises:
        TimeoutError: It did not appear within `timeout` seconds.
    """
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gate {path} never opened")
        time.sleep(0.05)


def drill_spec(**search: Any) -> PipelineSpec:
    # One run per trial unless a test asks for run reuse: these drills test the sensor's own requests.
    base: dict[str, Any] = {
        "params": {"lr": FloatParam(low=1e-4, high=1.0, log=True)},
        "n_trials": 4,
        "sampler": "random",
        "seed": 7,
        "reuse_run_under_seconds": 0,
    }
    base.update(search)
    return small_spec(search=SearchSpec(**base))


def drill_resources(home: Path, launcher: Launcher, sweeps: Optional[SweepStore] = None) -> dict[str, Any]:
    res = local_resources(home)
    res["launcher"] = launcher
    res["sweeps"] = sweeps or SweepStore(
        storage_url=f"sqlite:///{home / 'optuna.db'}", heartbeat_interval=1, grace_period=3
    )
    return res


def open_instance(home: Path, **overrides: Any) -> DagsterInstance:
    (home / "dagster").mkdir(parents=True, exist_ok=True)
    return DagsterInstance.local_temp(str(home / "dagster"), overrides={"telemetry": {"enabled": False}, **overrides})


def prepared_data(home: Path, spec: PipelineSpec, resources: dict[str, Any]) -> None:
    """Write digits splits and the `validated_data` value that the `sweep` asset reads."""
    paths = write_splits(str(home / "splits"), n=300)
    store = resources["store"]
    store.write_json(
        store.uri("io", spec.team, spec.name, "validated_data", "value.json"),
        {"md5": "d" * 32, "split_id": "d" * 32 + "-drill", **paths, "rows": {"train": 210, "val": 45, "test": 45}},
    )


def prepared_home(home: Path, spec: PipelineSpec, resources: dict[str, Any], instance: DagsterInstance) -> dict:
    """Write digits splits and the `validated_data` value, then materialize `sweep` alone; returns its value."""
    prepared_data(home, spec, resources)
    return run_sweep_asset(spec, resources, instance)


def run_sweep_asset(spec: PipelineSpec, resources: dict[str, Any], instance: DagsterInstance) -> dict:
    defs = build_definitions(spec, resources=resources)
    key = AssetKey([spec.team, spec.name, "sweep"])
    result = defs.resolve_job_def(job_names(spec)["prepare"]).execute_in_process(
        instance=instance, asset_selection=[key]
    )
    assert result.success
    return result.output_for_node(f"{spec.team}__{spec.name}__sweep").model_dump()


def submit(defs: Any, instance: DagsterInstance, request: Any) -> Optional[Any]:
    """Run a sensor's request in-process unless a run with its run key exists (the daemon's deduplication)."""
    if request.run_key and instance.get_runs_count(RunsFilter(tags={RUN_KEY_TAG: request.run_key})):
        return None
    job = defs.resolve_job_def(request.job_name)
    return job.execute_in_process(
        instance=instance,
        partition_key=request.partition_key,
        asset_selection=request.asset_selection,
        tags={**request.tags, RUN_KEY_TAG: request.run_key},
        raise_on_error=False,
    )


def drive(home: Path, spec: PipelineSpec, resources: dict[str, Any], instance: DagsterInstance, *,
          kill_after_tick: Optional[int] = None, max_seconds: float = 120.0, idle_sleep: float = 0.3) -> list[Any]:
    """Tick the sweep sensor and run its requests until the sweep is done; returns the ticks.

    The cursor lives in `<home>/sweep_cursor.json` and is written after a tick's
    runs were submitted, as the daemon does. `kill_after_tick` SIGKILLs this
    process after that tick's evaluation, before its runs or its cursor.
    """
    defs = build_definitions(spec, resources=resources)
    names = job_names(spec)
    cursor_file = home / "sweep_cursor.json"
    ticks = []
    started = time.monotonic()
    while time.monotonic() - started < max_seconds:
        cursor = cursor_file.read_text() if cursor_file.exists() else None
        tick = run_tick(
            spec, instance, resources["sweeps"], cursor, train_job=names["train"], prepare_job=names["prepare"]
        )
        ticks.append(tick)
        if kill_after_tick is not None and len(ticks) == kill_after_tick:
            os.kill(os.getpid(), signal.SIGKILL)
        for request in tick.run_requests:
            submit(defs, instance, request)
        cursor_file.write_text(tick.cursor.dump())
        if any(r.job_name == names["prepare"] for r in tick.run_requests):
            return ticks  # the final report run: the sweep is done
        if not tick.run_requests:
            time.sleep(idle_sleep)
    raise TimeoutError(f"sweep not done after {max_seconds} s; last tick: {ticks[-1].message if ticks else 'none'}")


def main(argv: list[str]) -> int:
    """`python -m tests.pipelines.sweep_drill HOME N_TRIALS PARALLELISM [--kill-after-tick N] [--kill-in-run]`."""
    home, n_trials, parallelism = Path(argv[0]), int(argv[1]), int(argv[2])
    kill_after = int(argv[argv.index("--kill-after-tick") + 1]) if "--kill-after-tick" in argv else None
    kill_file = home / "kill-once"
    if "--kill-in-run" in argv:
        kill_file.write_text("1")
    spec = drill_spec(n_trials=n_trials, parallelism=parallelism)
    resources = drill_resources(home, TrivialLauncher(kill_once_file=str(kill_file)))
    instance = open_instance(home)
    if not (home / "sweep_cursor.json").exists() and not instance.get_latest_materialization_event(
        AssetKey([spec.team, spec.name, "sweep"])
    ):
        prepared_home(home, spec, resources, instance)
    elif (home / "optuna.db").exists():
        # A restart: let the crash lie further back than the grace period, as for a daemon
        # restarted minutes later, so the first tick finds a killed trial's heartbeat stale
        # instead of this drill waiting the grace period out.
        age_heartbeats(home / "optuna.db", resources["sweeps"].grace_period + 1)
    ticks = drive(home, spec, resources, instance, kill_after_tick=kill_after)
    print(json.dumps({"ticks": len(ticks), "last": ticks[-1].message}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
