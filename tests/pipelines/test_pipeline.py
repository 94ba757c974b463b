"""The whole lineage graph through real Dagster runs on embedded resources."""

from __future__ import annotations

from pathlib import Path

import pytest
from dagster import AssetKey

from resources.versioning import DataVersioning
from tests.digits import digits_frame
from tests.pipelines.pipeline_fixtures import Harness, failure_text, small_spec, write_landing


def test_definitions_have_the_six_asset_chain() -> None:
    from pipelines.vision.definitions import defs

    graph = defs.resolve_asset_graph()
    names = ["raw_data", "validated_data", "sweep", "trial_model", "best_model", "registered_model"]
    keys = [AssetKey(["vision", "digits", n]) for n in names]
    assert set(keys) <= set(graph.get_all_asset_keys())
    parents = {k: {p for p in graph.get(k).parent_keys} for k in keys}
    assert parents[keys[1]] == {keys[0]}
    assert parents[keys[2]] == {keys[1]}
    assert parents[keys[3]] == {keys[1], keys[2]}
    assert parents[keys[4]] == {keys[2], keys[3]}
    assert parents[keys[5]] == {keys[4], keys[1]}
    checks = list(graph.asset_check_keys)
    assert sorted(c.name for c in checks if c.asset_key == keys[1]) == ["drift", "expectations"]  # a set: no order
    assert graph.get_check_spec(next(c for c in checks if c.name == "expectations")).blocking
    assert not graph.get_check_spec(next(c for c in checks if c.name == "drift")).blocking
    assert [c.name for c in checks if c.asset_key == keys[5]] == ["promotion"]
    assert graph.get(keys[3]).partitions_def.name == "vision__digits__trials"


def test_chain_registers_a_champion_with_lineage(trained) -> None:
    harness, out = trained
    assert out["sweep"]["trials"] == ["trial-0000", "trial-0001"]
    assert out["registered"]["created"] and out["registered"]["champion"]
    registry = harness.resources["registry"]
    champion = registry.get_alias("test.digits", "champion")
    assert champion is not None and champion.version == out["registered"]["version"]
    raw_md5 = out["best"]["lineage"]["data_version"]
    assert champion.tags["trainyard.data_version"] == raw_md5
    assert (
        len(champion.tags["trainyard.code_version"]) in (40, 7) or champion.tags["trainyard.code_version"] == "unknown"
    )
    assert champion.tags["trainyard.trial"] == out["best"]["trial"]
    assert champion.tags["trainyard.promotion.decision"] == "champion"
    # the registered model predicts on the held-out split with the accuracy the trial reported
    import pandas as pd

    test_df = pd.read_parquet(
        harness.resources["store"].uri(
            "data", "test", "digits", "validated", f"{raw_md5}-{harness.spec.fingerprint()}", "test.parquet"
        )
    )
    acc = registry.evaluate_accuracy(champion.model_uri, test_df, "label")
    assert acc == pytest.approx(out["best"]["metrics"]["test_acc"], abs=1e-6)


def test_raw_snapshot_restores_with_dvc(trained, tmp_path: Path) -> None:
    harness, out = trained
    raw = harness.resources["io_manager"].store.read_json(
        harness.resources["store"].uri("io", "test", "digits", "raw_data", "value.json")
    )
    versioning: DataVersioning = harness.resources["versioning"]
    from resources.versioning import parse_dvc_file

    md5, _, rel = parse_dvc_file(raw["dvc_file"])
    restored = versioning.restore(raw["dvc_file"], rel, str(tmp_path / "fresh"))
    assert Path(restored).read_bytes() == Path(raw["uri"]).read_bytes()
    assert md5 == raw["md5"]


@pytest.mark.slow
def test_rerun_on_same_data_trains_nothing_and_registers_no_duplicate(trained) -> None:
    harness, first = trained
    again = harness.run_all()
    assert again["registered"]["version"] == first["registered"]["version"]
    assert not again["registered"]["created"]
    assert len(harness.resources["registry"].list_versions("test.digits")) == 1


def test_bad_data_stops_the_graph_and_is_quarantined(tmp_path: Path) -> None:
    frame = digits_frame(300)
    frame.loc[5, "px0_1"] = 99.0  # out of the declared 0..16 range
    frame.loc[7, "label"] = 12  # outside the label domain
    write_landing(tmp_path, frame)
    harness = Harness(tmp_path, small_spec())
    result = harness.run("prepare")
    assert not result.success
    text = failure_text(result)
    assert "expectations failed" in text and "quarantine" in text
    checks = {
        e.event_specific_data.check_name: e.event_specific_data
        for e in result.all_events
        if e.event_type_value == "ASSET_CHECK_EVALUATION"
    }
    assert sorted(checks) == ["drift", "expectations"] and not checks["expectations"].passed
    assert (
        checks["drift"].passed and checks["drift"].metadata["drift_verdict"].value == "none"
    )  # a first version: nothing to drift from
    quarantined = list((tmp_path / "store" / "quarantine" / "test" / "digits").glob("*/report.json"))
    assert len(quarantined) == 1 and (quarantined[0].parent / "data.parquet").exists()
    import json

    report = json.loads(quarantined[0].read_text())
    failed = {(r["expectation"], r["column"]) for r in report["validation"]["results"] if not r["success"]}
    assert ("expect_column_values_to_be_between", "px0_1") in failed
    assert ("expect_column_values_to_be_in_set", "label") in failed
    # nothing downstream ran: no sweep partitions, nothing registered
    assert harness.instance.get_dynamic_partitions("test__digits__trials") == []
    assert harness.resources["registry"].list_versions("test.digits") == []


def test_missing_landing_data_is_named(tmp_path: Path) -> None:
    harness = Harness(tmp_path, small_spec())
    result = harness.run("prepare")
    assert not result.success
    assert "landing/test/digits" in failure_text(result) and "*.csv" in failure_text(result)


def test_wrong_schema_is_named(tmp_path: Path) -> None:
    write_landing(tmp_path, digits_frame(200).drop(columns=["px3_3"]))
    result = Harness(tmp_path, small_spec()).run("prepare")
    assert not result.success
    assert "px3_3" in failure_text(result)


def test_bad_model_path_fails_before_compute_and_registers_nothing(tmp_path: Path) -> None:
    from pydantic import ValidationError

    from trainyard.spec import ModelSpec

    with pytest.raises(ValidationError, match="defines no 'Nope'"):
        small_spec(model=ModelSpec(path="pipelines.vision.models:Nope"))
