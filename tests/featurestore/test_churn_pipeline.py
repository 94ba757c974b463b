"""The commerce team's churn pipeline: Feast features through the same six assets to a registered champion."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from dagster import AssetKey

from pipelines.commerce.churn import churn
from resources.registry.backend import fluent_uris
from tests.featurestore.support import make_example
from tests.pipelines.pipeline_fixtures import Harness

ROOT = Path(__file__).resolve().parents[2]


def test_commerce_is_a_code_location_with_the_six_asset_chain() -> None:
    from pipelines.commerce.definitions import defs

    locations = {
        e["python_module"]["location_name"]: e["python_module"]["module_name"]
        for e in yaml.safe_load((ROOT / "workspace.yaml").read_text())["load_from"]
    }
    assert locations["commerce"] == "pipelines.commerce.definitions"
    names = ["raw_data", "validated_data", "sweep", "trial_model", "best_model", "registered_model"]
    assert {AssetKey(["commerce", "churn", n]) for n in names} <= set(defs.resolve_asset_graph().get_all_asset_keys())


@pytest.mark.slow
def test_churn_chain_trains_on_point_in_time_features_and_registers_a_champion(tmp_path: Path) -> None:
    make_example(tmp_path / "store", customers=300)
    harness = Harness(tmp_path, churn)
    out = harness.run_all()
    assert out["registered"]["created"] and out["registered"]["champion"]
    raw = harness.run("prepare").output_for_node(harness.node("raw_data"))
    assert raw.md5 == out["best"]["lineage"]["data_version"]
    # Leakage would make the held-out accuracy near 1; the point-in-time features leave a real, imperfect signal.
    assert 0.6 < out["best"]["metrics"]["test_acc"] < 0.97
    metrics = out["best"]["metrics"]
    assert metrics["test_roc_auc"] > metrics["baseline_test_roc_auc"] == 0.5  # promoted on ranking, the baseline beaten
    champion = harness.resources["registry"].get_alias("commerce.churn", "champion")
    assert champion is not None and champion.version == out["registered"]["version"]
    refs = "customer_stats:balance,customer_stats:txn_count_7d,customer_stats:tickets_30d"
    assert champion.tags["trainyard.feast.features"] == refs
    assert champion.tags["trainyard.feast.feature_service"] == "churn_features"
    assert champion.tags["trainyard.feast.feature_views"].startswith("customer_stats@")
    assert champion.tags["trainyard.feast.time_range"].startswith("2024-")
    import mlflow
    from mlflow import MlflowClient

    registry = harness.resources["registry"]
    card = (
        MlflowClient(tracking_uri=registry.tracking_uri)
        .get_model_version("commerce.churn", champion.version)
        .description
    )
    assert "## Features (Feast)" in card and "`customer_stats:balance`" in card and "churn_features" in card

    # The registered model itself tells serving which online features to fetch, for which signature column.
    with fluent_uris(registry.tracking_uri):
        info = mlflow.models.get_model_info(champion.model_uri)
    inputs = [(c.name, c.type.name) for c in info.signature.inputs.inputs]
    assert inputs == [
        ("balance", "double"),
        ("txn_count_7d", "long"),
        ("tickets_30d", "long"),
    ]  # Feast Float64, Int64, Int64
    served = info.metadata["feast"]
    assert served["features"] == {name: f"customer_stats:{name}" for name, _ in inputs}
    assert sorted(served["features"].values()) == sorted(refs.split(","))
    assert served["feature_service"] == "churn_features" and served["entity_keys"] == ["customer_id"]
    assert served["project"] == "commerce" and served["feature_views"] == champion.tags[
        "trainyard.feast.feature_views"
    ].split(",")

    # The trial's lineage record, its W&B run config and the version's tags carry the same Feast fields.
    feast = out["best"]["lineage"]["feast"]
    assert {f"trainyard.feast.{k}": v for k, v in feast.items()} == {
        k: v for k, v in champion.tags.items() if k.startswith("trainyard.feast.")
    }
    assert set(feast) == {"features", "feature_service", "feature_views", "time_range", "entity_md5"}
    runs = list((harness.home / "wandb").rglob("run-*.wandb"))
    assert runs and all(
        feast["feature_views"].encode() in p.read_bytes() and refs.encode() in p.read_bytes() for p in runs
    )
