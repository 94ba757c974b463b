"""Run-level recovery through Dagster: preemption and lost workers are retried and resume; config layers merge."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.pipelines.pipeline_fixtures import Harness, failure_text, small_spec, write_landing
from training.spec import CheckpointPolicy, Distribution
from trainyard.spec import ModelSpec, RetrySpec


def trial_config(**drill) -> dict:
    return {"ops": {"test__digits__trial_model": {"config": drill}}}


def prepared(home: Path, **over) -> tuple[Harness, dict]:
    write_landing(home)
    spec = small_spec(
        search=small_spec().search.model_copy(update={"n_trials": 1}),
        distribution=over.pop("distribution", Distribution(procs_per_node=2)),
        checkpoint=CheckpointPolicy(every_n_steps=3),
        model=ModelSpec(path="pipelines.vision.models:DigitsMLP", max_epochs=2, batch_size=32),
        **over,
    )
    harness = Harness(home, spec)
    prepare = harness.run("prepare")
    assert prepare.success, failure_text(prepare)
    return harness, prepare.output_for_node(harness.node("sweep"))


def step_events(result, kind: str) -> list:
    return [e for e in result.all_events if e.event_type_value == kind]


@pytest.mark.slow
def test_preempted_trial_is_retried_by_dagster_and_resumes(tmp_path: Path) -> None:
    harness, sweep = prepared(tmp_path)
    result = harness.run("train", "trial-0000", run_config=trial_config(drill_sigterm_at_step=4))
    assert result.success, failure_text(result)
    assert len(step_events(result, "STEP_UP_FOR_RETRY")) == 1
    value = result.output_for_node(harness.node("trial_model"))
    assert value.resumed_from.endswith("step-000000005")  # the preemption save: the agreement after the signal's step
    assert value.goodput["restart_causes"] == ["preempted"]
    launches = json.loads(Path(value.result_uri).with_name("launches.json").read_text())
    assert [x["cause"] for x in launches] == ["TrainingPreempted"]
    # the resumed attempt continued the same W&B run: two offline directories, one run id
    run_dirs = list((harness.home / "wandb").rglob("offline-run-*"))
    assert len(run_dirs) == 2
    assert len({d.name.split("-", 3)[-1] for d in run_dirs}) == 1
    materialization = result.asset_materializations_for_node(harness.node("trial_model"))[0]
    assert materialization.metadata["resumed_from"].value.endswith("step-000000005")
    assert materialization.metadata["checkpoint_interval_source"].value == "steps"


@pytest.mark.slow
def test_infrastructure_failures_stop_at_the_budget(tmp_path: Path) -> None:
    harness, _ = prepared(
        tmp_path,
        retries=RetrySpec(max_infra_retries=0, wait_seconds=0),
        distribution=Distribution(procs_per_node=2, max_restarts=0),
    )
    # a rank dies and torchrun has no restarts left: an infrastructure failure, budget 0
    result = harness.run("train", "trial-0000", run_config=trial_config(drill_kill_rank=1, drill_kill_at_step=3))
    assert not result.success
    text = failure_text(result)
    assert "giving up after 1 infrastructure failure(s) (budget 0)" in text


@pytest.mark.slow
def test_run_config_overrides_the_pipeline_spec(tmp_path: Path) -> None:
    """Layers: platform defaults < pipeline spec (max_epochs=2) < run config (max_epochs=1)."""
    harness, _ = prepared(tmp_path)
    result = harness.run("train", "trial-0000", run_config=trial_config(max_epochs=1))
    assert result.success, failure_text(result)
    value = result.output_for_node(harness.node("trial_model"))
    assert value.epochs == 1 and value.lineage["max_epochs"] == 1
