"""The lineage graph tells the state: drift verdicts and promotion decisions are asset checks, through real Dagster
runs."""

from __future__ import annotations

from typing import Any

import pytest
from dagster import AssetCheckSeverity, AssetKey

from tests.digits import digits_frame
from tests.pipelines.pipeline_fixtures import Harness, failure_text, small_spec, write_landing
from trainyard.spec import PromotionSpec


def evaluations(result: Any) -> dict[tuple[str, str], Any]:
    return {(e.asset_key.path[-1], e.check_name): e for e in result.get_asset_check_evaluations()}


@pytest.mark.slow
def test_a_rejected_retrain_and_a_drifted_delivery_are_warnings_on_the_graph(trained) -> None:
    harness, first = trained
    # The first training promoted its version: the check passed.
    champion = harness.resources["registry"].get_alias("test.digits", "champion")
    assert champion is not None and champion.version == first["registered"]["version"]

    # A second delivery, shifted, and a policy no retrain can meet: the version registers, the champion stays.
    strict = Harness(harness.home, small_spec(promotion=PromotionSpec(min_improvement=0.9)))
    shifted = digits_frame().sample(300, random_state=5).reset_index(drop=True)
    features = [c for c in shifted.columns if c != "label"]
    shifted[features] = (shifted[features] + 6).clip(upper=16)
    write_landing(harness.home, shifted, name="part-1.csv")
    prepare = strict.run("prepare")
    assert prepare.success, failure_text(prepare)
    drift = evaluations(prepare)[("validated_data", "drift")]
    assert not drift.passed and drift.severity == AssetCheckSeverity.WARN
    assert drift.metadata["drift_verdict"].value == "drifted"
    assert drift.description.startswith("drifted: ") and drift.metadata["max_psi"].value > 0.2
    assert evaluations(prepare)[
        ("validated_data", "expectations")
    ].passed  # the on_drift policy let it through: a warning, not a stop
    sweep = prepare.output_for_node(strict.node("sweep"))
    for key in sweep.trials:
        assert strict.run("train", key).success
    promote = strict.run("promote")
    assert promote.success, failure_text(promote)  # a rejection is the policy working: the run stays green
    check = evaluations(promote)[("registered_model", "promotion")]
    registered = promote.output_for_node(strict.node("registered_model"))
    assert registered.decision == "rejected" and registered.version != champion.version
    assert not check.passed and check.severity == AssetCheckSeverity.WARN
    assert check.metadata["failed_checks"].value == "beats_champion"
    assert check.metadata["champion_before"].value == champion.version
    assert check.description.startswith("policy failed: beats_champion: test_acc=")
    assert "beats_champion" in check.metadata["failed"].value
    assert harness.resources["registry"].get_alias("test.digits", "champion").version == champion.version
    # The instance keeps the latest evaluation, as the UI shows it on the graph.
    from dagster import AssetCheckKey

    records = strict.instance.event_log_storage.get_asset_check_execution_history(
        AssetCheckKey(AssetKey(["test", "digits", "registered_model"]), "promotion"), limit=5)
    assert records[0].event.dagster_event.event_specific_data.passed is False
