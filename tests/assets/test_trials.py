"""`trial_model` on a finished trial: reuse, retraining on purpose, and drills that retrain or fail clearly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import pytest

from pipelines.factory import build_definitions, job_names
from resources.launcher import LaunchOutcome
from tests.pipelines.pipeline_fixtures import Harness, failure_text, small_spec, write_landing
from tests.pipelines.sweep_drill import TrivialLauncher, drill_resources, drill_spec, open_instance, prepared_home
from training.spec import CheckpointPolicy, Distribution, TrainSpec
from trainyard.spec import ModelSpec

NODE = "test__digits__trial_model"


class RecordingLauncher(TrivialLauncher):
    """The trivial trial, recording each `TrainSpec` it gets under `record_dir` (launch order).

    Args:
        drill_restarts: the restarts a drilled trial reports in its goodput (a
            trial without a drill reports none); None: no goodput at all.
    """

    record_dir: str
    drill_restarts: Optional[int] = 1

    def launch(self, spec: TrainSpec, context: Any = None) -> LaunchOutcome:
        out = Path(self.record_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{len(list(out.iterdir())):03d}.json").write_text(spec.model_dump_json())
        outcome = super().launch(spec, context)
        drilled = spec.faults.kill_at_step is not None or spec.faults.sigterm_at_step is not None
        if self.drill_restarts is None:
            return outcome
        restarts = self.drill_restarts if drilled else 0
        result = outcome.result.model_copy(
            update={"goodput": {"restarts": restarts, "restart_causes": ["lost (process killed)"] * restarts}}
        )
        (Path(spec.output_uri) / "result.json").write_text(result.model_dump_json())
        return LaunchOutcome(result=result, log_uri=outcome.log_uri, seconds=outcome.seconds)


class CurvesLauncher(TrivialLauncher):
    """The trivial trial, with the two epochs of progress a real pod sends over Pipes."""

    def launch(self, spec: TrainSpec, context: Any = None) -> LaunchOutcome:
        outcome = super().launch(spec, context)
        outcome.progress = [
            {
                "type": "progress",
                "epoch": e,
                "max_epochs": 2,
                "step": e + 1,
                "metrics": {"val_acc": 0.4 + 0.2 * e, "val_loss": 1.0 - 0.3 * e},
            }
            for e in range(2)
        ]
        return outcome


def launched(home: Path) -> list[TrainSpec]:
    return [TrainSpec.model_validate_json(p.read_text()) for p in sorted((home / "launched").glob("*.json"))]


class Trials:
    """A prepared drill sweep whose trial runs take run config."""

    def __init__(self, home: Path, **launcher: Any) -> None:
        self.home = home
        self.spec = drill_spec(n_trials=1, parallelism=1)
        self.instance = open_instance(home)
        self.resources = drill_resources(home, RecordingLauncher(record_dir=str(home / "launched"), **launcher))
        self.sweep = prepared_home(home, self.spec, self.resources, self.instance)

    def train(self, key: str = "trial-0000", **config: Any):
        defs = build_definitions(self.spec, resources=self.resources)
        return defs.resolve_job_def(job_names(self.spec)["train"]).execute_in_process(
            instance=self.instance,
            partition_key=key,
            raise_on_error=False,
            run_config={"ops": {NODE: {"config": config}}} if config else None,
        )

    def trial(self, number: int = 0) -> Any:
        return self.resources["sweeps"].trial(self.sweep["study"], number)


def metadata(result) -> dict[str, Any]:
    return {k: v.value for k, v in result.asset_materializations_for_node(NODE)[0].metadata.items()}


def test_a_finished_trial_is_reused_without_retrain(tmp_path: Path) -> None:
    trials = Trials(tmp_path)
    assert trials.train().success
    again = trials.train()
    assert again.success and len(launched(tmp_path)) == 1  # reused: nothing launched the second time
    assert again.output_for_node(NODE).result_uri == trials.trial().user_attrs["result_uri"]


def test_trial_model_shows_its_training_curves_also_when_reused(tmp_path: Path) -> None:
    trials = Trials(tmp_path)
    trials.resources["launcher"] = CurvesLauncher()
    result = trials.train()
    assert result.success, failure_text(result)
    meta = metadata(result)
    assert meta["epochs_reported"] == 2
    assert meta["curves_plot"].startswith("![training curves](data:image/png;base64,iVBORw0KGgo")  # an embedded PNG
    assert (
        meta["curves"]
        == "| epoch | step | val_acc | val_loss |\n|---|---|---|---|\n| 0 | 1 | 0.4 | 1 |\n| 1 | 2 | 0.6 | 0.7 |"
    )
    assert (Path(result.output_for_node(NODE).result_uri).parent / "curves.json").exists()
    again = trials.train()  # reused as stored: the curves come from beside the result
    assert again.success and metadata(again)["curves"] == meta["curves"]


def test_one_reported_epoch_is_a_table_without_a_plot(tmp_path: Path) -> None:
    from assets.sweeps.trials import curves_metadata
    from resources.storage import ObjectStore

    store = ObjectStore(root=str(tmp_path))
    store.write_json(
        store.uri("run", "curves.json"), [{"epoch": 20, "step": 20, "val_logloss": 0.25}]
    )  # a GBT trial's one report
    meta = curves_metadata(store, store.uri("run", "result.json"), "t")
    assert list(meta) == ["epochs_reported", "curves"]  # no plot of a single marker
    assert meta["epochs_reported"] == 1
    assert meta["curves"].value == "| epoch | step | val_logloss |\n|---|---|---|\n| 20 | 20 | 0.25 |"


def test_retrain_config_retrains_one_finished_trial_and_leaves_the_study_alone(tmp_path: Path) -> None:
    trials = Trials(tmp_path)
    first = trials.train()
    assert first.success
    recorded = trials.trial()
    recorded_uri = recorded.user_attrs["result_uri"]
    recorded_bytes = Path(recorded_uri).read_bytes()
    result = trials.train(retrain=True)
    assert result.success, failure_text(result)
    specs = launched(tmp_path)
    assert len(specs) == 2  # the retrain launched again
    retrain_dir = Path(specs[1].output_uri)
    assert retrain_dir.parent == Path(specs[0].output_uri) and retrain_dir.name == f"retrain-{result.run_id[:8]}"
    assert specs[1].optuna.pruner.kind == "none"  # a finished trial takes no reports, so no pruner
    value = result.output_for_node(NODE)
    assert value.result_uri == str(retrain_dir / "result.json") and value.best_metric == recorded.value
    # the study's record and the result it points to are untouched
    after = trials.trial()
    assert (after.state.name, after.value, after.user_attrs["result_uri"]) == ("COMPLETE", recorded.value, recorded_uri)
    assert Path(recorded_uri).read_bytes() == recorded_bytes
    meta = metadata(result)
    assert meta["retrain"] == {
        "reason": "retrain requested",
        "study_state": "COMPLETE",
        "recorded_result": recorded_uri,
        "study_unchanged": True,
    }
    assert meta["recorded_val_acc"] == recorded.value and "drill" not in meta


def test_drill_on_a_finished_trial_retrains_it_and_reports_the_recovery(tmp_path: Path) -> None:
    """The drill used to be ignored ("already complete ...; reusing its result") and the run passed."""
    trials = Trials(tmp_path)
    assert trials.train().success
    result = trials.train(drill_kill_rank=0, drill_kill_at_step=1)
    assert result.success, failure_text(result)
    specs = launched(tmp_path)
    assert (
        len(specs) == 2 and specs[1].faults.kill_rank == 0 and specs[1].faults.kill_at_step == 1
    )  # the drill reached the pod
    assert Path(specs[1].output_uri).name.startswith("retrain-")
    meta = metadata(result)
    assert meta["drill"] == {"kill_rank": 0, "kill_at_step": 1}
    assert meta["drill_recovered"] is True and meta["drill_restarts"] == 1
    assert meta["retrain"]["reason"] == "a drill on a finished trial retrains it"
    assert trials.trial().state.name == "COMPLETE"


def test_drill_that_cannot_fire_fails_before_compute(tmp_path: Path) -> None:
    trials = Trials(tmp_path)
    assert trials.train().success
    result = trials.train(drill_kill_rank=1, drill_kill_at_step=5)
    assert not result.success
    text = failure_text(result)
    assert "trial-0000: the drill cannot run: drill_kill_rank=1 names no rank of a 1-process trial (ranks 0..0)" in text
    assert "drill_kill_at_step=5 is past the trial's last step (it trained 1 steps); use a step in 1..1" in text
    assert len(launched(tmp_path)) == 1  # nothing launched for the drill


def test_drill_that_never_restarted_the_trial_fails(tmp_path: Path) -> None:
    trials = Trials(tmp_path, drill_restarts=0)
    assert trials.train().success
    result = trials.train(drill_sigterm_at_step=1)
    assert not result.success
    assert (
        "trial-0000: drill {'sigterm_at_step': 1} never fired: the retrain finished without a restart"
        in failure_text(result)
    )


def test_a_failed_trial_can_be_retrained_for_debugging_and_stays_failed(tmp_path: Path) -> None:
    trials = Trials(tmp_path)
    trials.resources["launcher"] = TrivialLauncher(fail=True)
    assert not trials.train().success
    assert trials.trial().state.name == "FAIL"
    refused = trials.train()
    assert not refused.success and "run config `retrain: true` trains it again" in failure_text(refused)
    trials.resources["launcher"] = TrivialLauncher()
    result = trials.train(retrain=True)
    assert result.success, failure_text(result)
    assert metadata(result)["retrain"]["study_state"] == "FAIL"
    assert trials.trial().state.name == "FAIL"


@pytest.mark.slow
def test_kill_drill_on_a_finished_real_trial_retrains_and_recovers(tmp_path: Path) -> None:
    """Two torchrun processes; rank 1 is killed at step 3 of the retrain and the trial resumes from its checkpoint."""
    write_landing(tmp_path)
    spec = small_spec(
        search=small_spec().search.model_copy(update={"n_trials": 1}),
        distribution=Distribution(procs_per_node=2),
        checkpoint=CheckpointPolicy(every_n_steps=2),
        model=ModelSpec(path="pipelines.vision.models:DigitsMLP", max_epochs=2, batch_size=32),
    )
    harness = Harness(tmp_path, spec)
    assert harness.run("prepare").success
    first = harness.run("train", "trial-0000")
    assert first.success, failure_text(first)
    recorded = first.output_for_node(NODE)
    drill = harness.run(
        "train", "trial-0000", run_config={"ops": {NODE: {"config": {"drill_kill_rank": 1, "drill_kill_at_step": 3}}}}
    )
    assert drill.success, failure_text(drill)
    value = drill.output_for_node(NODE)
    assert Path(value.result_uri).parent.name.startswith("retrain-")
    assert (Path(value.result_uri).parent / "faults" / "kill").exists()  # the kill fired in the retrain's directory
    assert value.goodput["restarts"] >= 1 and value.resumed_from
    meta = metadata(drill)
    assert meta["drill_recovered"] is True and meta["drill_restarts"] >= 1
    assert (
        json.loads(Path(recorded.result_uri).read_text())["best_metric"] == recorded.best_metric
    )  # the recorded result is untouched


@pytest.mark.slow
def test_the_sweep_starts_the_warm_server_for_its_trials_in_the_background(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep with trials to run on this machine starts the warm server while the first trial run is on its way."""
    import shutil
    import tempfile
    import time

    from resources.launcher import LocalLauncher
    from resources.warm import WARM_DIR_ENV, stop_servers

    warm = Path(tempfile.mkdtemp(prefix="tyw-"))  # a socket path must stay short
    monkeypatch.setenv(WARM_DIR_ENV, str(warm))
    try:
        spec = drill_spec(n_trials=2, parallelism=1)
        instance = open_instance(tmp_path)
        sweep = prepared_home(tmp_path, spec, drill_resources(tmp_path, LocalLauncher()), instance)
        assert sweep["trials"] == ["trial-0000"]
        deadline = time.monotonic() + 180
        while not list(warm.glob("*.sock")) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(list(warm.glob("*.sock"))) == 1 and len(list(warm.glob("*.pid"))) == 1
        logs = [e.message for e in instance.all_logs(instance.get_runs()[0].run_id)]
        assert any("starting the warm worker server in the background" in m for m in logs)
    finally:
        stop_servers(warm)
        shutil.rmtree(warm, ignore_errors=True)
