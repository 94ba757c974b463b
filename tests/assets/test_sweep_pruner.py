"""The `sweep` asset says so when the declared pruner can stop no trial of the sweep (too few trials for its startup
count)."""

from __future__ import annotations

from pathlib import Path

import pytest
from dagster import AssetKey

from tests.pipelines.sweep_drill import TrivialLauncher, drill_resources, drill_spec, open_instance, prepared_home
from training.spec import PrunerSpec


@pytest.mark.parametrize("n_trials, inert", [(4, True), (6, False)])
def test_the_sweep_warns_when_its_pruner_can_prune_nothing(tmp_path: Path, n_trials: int, inert: bool) -> None:
    spec = drill_spec(
        n_trials=n_trials, parallelism=1, pruner=PrunerSpec(kind="median")
    )  # Optuna's defaults: 5 startup trials
    instance = open_instance(tmp_path)
    prepared_home(tmp_path, spec, drill_resources(tmp_path, TrivialLauncher()), instance)
    meta = instance.get_latest_materialization_event(
        AssetKey([spec.team, spec.name, "sweep"])
    ).asset_materialization.metadata
    warnings = [
        e.message
        for e in instance.all_logs(instance.get_runs()[0].run_id)
        if e.level >= 30 and "no trial can be pruned" in e.message
    ]
    if inert:
        assert meta["pruner_inert"].value.startswith(
            f"pruner 'median' prunes only after 5 completed trial(s) (n_startup_trials=5), and the last of "
            f"this sweep's {n_trials} trial(s) sees at most {n_trials - 1}"
        )
        assert len(warnings) == 1 and meta["pruner_inert"].value in warnings[0]
    else:
        assert "pruner_inert" not in meta and warnings == []
