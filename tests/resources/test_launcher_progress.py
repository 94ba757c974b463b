"""Live training curves: the local launcher turns each epoch's Pipes record into an asset observation while the trial
runs."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from dagster import (
    AssetKey,
    DagsterEventType,
    DagsterInstance,
    EventLogEntry,
    MaterializeResult,
    StaticPartitionsDefinition,
    asset,
    materialize,
)

from resources.launcher import LocalLauncher, ProgressRelay, wait_ticking
from tests.support.train_specs import make_spec
from training.spec import RESULT_FILE, TrainResult

TRIAL = "trial-0000"


class FakeContext:
    """The parts of an asset context the relay uses; `log_event` records what it gets."""

    def __init__(self, keys: tuple[AssetKey, ...] = (AssetKey("trial_model"),), partition: str | None = TRIAL) -> None:
        self.has_assets_def = bool(keys)
        self.assets_def = type("AssetsDef", (), {"keys": set(keys)})()
        self.asset_key = keys[0] if keys else None
        self.has_partition_key = partition is not None
        self.partition_key = partition
        self.events: list[Any] = []

    def log_event(self, event: Any) -> None:
        self.events.append(event)


def record(epoch: int, **metrics: float) -> dict[str, Any]:
    return {"type": "progress", "epoch": epoch, "max_epochs": 3, "step": 4 * (epoch + 1), "metrics": metrics}


def test_relay_emits_each_new_epoch_once_on_the_trials_partition() -> None:
    stream: list[Any] = []
    context = FakeContext()
    relay = ProgressRelay(context, lambda: tuple(stream))
    relay.poll()
    assert context.events == []
    stream += [record(0, val_acc=0.5), {"type": "something else"}]
    relay.poll()
    stream.append(record(1, val_acc=0.75, val_loss=0.5))
    relay.poll()
    relay.poll()
    assert [(e.asset_key, e.partition) for e in context.events] == [(AssetKey("trial_model"), TRIAL)] * 2
    assert [{k: v.value for k, v in e.metadata.items()} for e in context.events] == [
        {"epoch": 0, "step": 4, "val_acc": 0.5},
        {"epoch": 1, "step": 8, "val_acc": 0.75, "val_loss": 0.5},
    ]
    assert relay.emitted == 2


def test_relay_without_one_asset_emits_nothing() -> None:
    """An op or a multi-asset has no single asset to observe; the launch still works."""
    for context in (FakeContext(keys=()), FakeContext(keys=(AssetKey("a"), AssetKey("b")))):
        relay = ProgressRelay(context, lambda: (record(0, val_acc=0.5),))
        relay.poll()
        assert context.events == [] and relay.seen == 1


def test_wait_ticks_while_the_process_runs_and_keeps_the_deadline() -> None:
    ticks: list[int] = []
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.6)"])
    assert wait_ticking(proc, 30, lambda: ticks.append(1), every=0.1) == 0
    assert len(ticks) >= 3
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            wait_ticking(slow, 0.3, lambda: None, every=0.1)
    finally:
        slow.kill()
        slow.wait()


# Stands in for `python -m torch.distributed.run ... --spec <uri>`: reports three epochs over Pipes a second
# apart, then writes the result, so the test sees whether observations came before the process ended.
FAKE_TORCHRUN = """#!{python}
import json, sys, time
from dagster_pipes import open_dagster_pipes
spec = json.load(open(sys.argv[-1]))
with open_dagster_pipes() as pipes:
    for epoch in range(3):
        pipes.log.info(f"epoch {{epoch}}")
        pipes.report_custom_message({{"type": "progress", "epoch": epoch, "max_epochs": 3, "step": epoch + 1,
                                      "metrics": {{"val_acc": 0.3 * (epoch + 1), "val_loss": 1.0 / (epoch + 1)}}}})
        time.sleep(1.0)
    with open(spec["output_uri"] + "/{result_file}", "w") as f:
        f.write({result!r})
"""


def fake_torchrun(tmp_path: Path, output_uri: str) -> str:
    result = TrainResult(
        trial_id=TRIAL,
        metrics={"val_acc": 0.9},
        best_metric=0.9,
        epochs=3,
        global_step=3,
        train_samples=3,
        fit_seconds=1.0,
        samples_per_second=1.0,
        wall_seconds=1.0,
        world_size=1,
        device_hours=0.0,
        model_uri=f"{output_uri}/model",
    )
    path = tmp_path / "fake-python"
    path.write_text(
        FAKE_TORCHRUN.format(python=sys.executable, result_file=RESULT_FILE, result=result.model_dump_json())
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def launch_as_asset(tmp_path: Path, launcher: LocalLauncher, **spec: Any) -> tuple[Any, list[EventLogEntry], Path]:
    """Materialize a one-partition asset whose body launches a trial; (result, the run's log entries, result file)."""
    train_spec = make_spec(tmp_path, **spec)
    outcomes: list[Any] = []

    # `context` is left unannotated: under postponed annotations Dagster would see the string and refuse it.
    @asset(partitions_def=StaticPartitionsDefinition([TRIAL]))
    def trial_model(context) -> MaterializeResult:  # type: ignore[no-untyped-def]
        outcome = launcher.launch(train_spec, context=context)
        outcomes.append(outcome)
        return MaterializeResult(metadata={"epochs_reported": len(outcome.progress)})

    instance = DagsterInstance.ephemeral()
    result = materialize([trial_model], partition_key=TRIAL, instance=instance)
    assert result.success
    return result, list(instance.all_logs(result.run_id)), Path(train_spec.output_uri, RESULT_FILE)


def observations(entries: list[EventLogEntry]) -> list[EventLogEntry]:
    return [
        e
        for e in entries
        if e.dagster_event is not None and e.dagster_event.event_type == DagsterEventType.ASSET_OBSERVATION
    ]


def observed(entry: EventLogEntry) -> dict[str, Any]:
    obs = entry.dagster_event.asset_observation_data.asset_observation
    assert obs.asset_key == AssetKey("trial_model") and obs.partition == TRIAL
    return {k: v.value for k, v in obs.metadata.items()}


def test_observations_arrive_while_the_trial_runs(tmp_path: Path) -> None:
    """Through a real Pipes session: the first epoch is observed seconds before the process writes its result."""
    out = str(tmp_path / "run")
    launcher = LocalLauncher(python=fake_torchrun(tmp_path, out), progress_poll_seconds=0.2)
    _, entries, result_file = launch_as_asset(tmp_path, launcher)
    seen = observations(entries)
    assert [observed(e) for e in seen] == [
        {"epoch": e, "step": e + 1, "val_acc": pytest.approx(0.3 * (e + 1)), "val_loss": pytest.approx(1.0 / (e + 1))}
        for e in range(3)
    ]
    finished = os.stat(result_file).st_mtime
    assert seen[0].timestamp < finished - 1.0  # live: not collected after the run
    assert seen[1].timestamp < finished
    assert {"epoch 0", "epoch 1", "epoch 2"} <= {e.user_message for e in entries}  # the pod's lines are in the run log


@pytest.mark.slow
def test_a_real_trial_is_observed_epoch_by_epoch(tmp_path: Path) -> None:
    """One torchrun process training the digits MLP for 4 epochs: one observation per epoch, the first before the
    result."""
    result, entries, result_file = launch_as_asset(tmp_path, LocalLauncher(progress_poll_seconds=0.1), max_epochs=4)
    seen = observations(entries)
    points = [observed(e) for e in seen]
    assert [p["epoch"] for p in points] == [0, 1, 2, 3]
    assert all("val_acc" in p and "val_loss" in p for p in points)
    assert seen[0].timestamp < os.stat(result_file).st_mtime
    materialization = result.asset_materializations_for_node("trial_model")[0]
    assert materialization.metadata["epochs_reported"].value == 4
