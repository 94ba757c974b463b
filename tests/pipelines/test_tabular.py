"""The tabular team's LightGBM pipeline: its declaration, and its whole chain through real Dagster runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from dagster import AssetKey
from pydantic import ValidationError

from pipelines.tabular.breast_cancer import FEATURES, TARGET, breast_cancer, landing_frame
from tests.pipelines.pipeline_fixtures import Harness, write_landing
from training.spec import Distribution
from trainyard.spec import ColumnSpec, ModelSpec, PipelineSpec, PromotionSpec, SourceSpec

ROOT = Path(__file__).resolve().parents[2]


def test_tabular_is_a_code_location_with_the_six_asset_chain() -> None:
    from pipelines.tabular.definitions import defs

    locations = {
        e["python_module"]["location_name"]: e["python_module"]["module_name"]
        for e in yaml.safe_load((ROOT / "workspace.yaml").read_text())["load_from"]
    }
    assert locations["tabular"] == "pipelines.tabular.definitions"
    names = ["raw_data", "validated_data", "sweep", "trial_model", "best_model", "registered_model"]
    assert {AssetKey(["tabular", "breast_cancer", n]) for n in names} <= set(
        defs.resolve_asset_graph().get_all_asset_keys()
    )
    assert breast_cancer.model.task == "gbt" and breast_cancer.model.path == "lightgbm:train"


def test_landing_frame_matches_the_declared_columns() -> None:
    frame = landing_frame()
    assert list(frame.columns) == [*FEATURES, TARGET] == list(breast_cancer.columns)
    assert len(frame) == 569 and set(frame[TARGET]) == {0, 1}


def _spec(**over) -> PipelineSpec:
    base = dict(
        team="t",
        name="p",
        source=SourceSpec(prefix="landing/t/p"),
        columns={"x": ColumnSpec(dtype="float"), "y": ColumnSpec(dtype="float")},
        target="y",
        model=ModelSpec(task="gbt", monitor="val_rmse", monitor_mode="min"),
        promotion=PromotionSpec(metric="test_rmse", mode="min"),
    )
    base.update(over)
    return PipelineSpec(**base)


def test_a_regression_pipeline_declares_rmse_throughout() -> None:
    spec = _spec()
    assert spec.model.gbt_metrics == ("val_rmse", "val_mae", "test_rmse", "test_mae")


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"distribution": Distribution(procs_per_node=2)}, "task 'gbt' trains in one process; got world size 2"),
        (
            {"promotion": PromotionSpec(metric="test_acc")},
            "promotion.metric 'test_acc' is not reported by this gbt model; use one of ['test_rmse', 'test_mae']",
        ),
    ],
)
def test_gbt_pipeline_mistakes_name_the_field(over: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace("[", r"\[")):
        _spec(**over)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"path": "pipelines.vision.models:DigitsMLP"}, "task 'gbt' trains LightGBM and takes no model path"),
        (
            {"monitor": "val_loss"},
            "monitor 'val_loss' is not a gbt metric; use one of ['val_acc', 'val_balanced_acc', 'val_f1', "
            "'val_logloss', 'val_mae', 'val_pr_auc', 'val_rmse', 'val_roc_auc']",
        ),
        (
            {"monitor": "val_rmse", "monitor_mode": "max"},
            "monitor_mode 'max' does not fit monitor 'val_rmse'; use 'min'",
        ),
    ],
)
def test_gbt_model_mistakes_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValidationError) as info:
        ModelSpec(task="gbt", **kwargs)
    assert message in str(info.value)


def test_lightning_models_still_need_a_path() -> None:
    with pytest.raises(ValidationError, match="a lightning model needs `path`, its LightningModule's import path"):
        ModelSpec()


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory):
    home = tmp_path_factory.mktemp("home")
    write_landing(home, landing_frame(), prefix=breast_cancer.source.prefix)
    spec = breast_cancer.model_copy(update={"search": breast_cancer.search.model_copy(update={"n_trials": 2})})
    harness = Harness(home, spec)
    return harness, harness.run_all()


@pytest.mark.slow
def test_gbt_chain_registers_a_champion_that_serves_its_test_accuracy(trained) -> None:
    import pandas as pd

    harness, out = trained
    assert out["sweep"]["trials"] == ["trial-0000", "trial-0001"]
    assert out["registered"]["created"] and out["registered"]["champion"]
    best = out["best"]
    assert best["world_size"] == 1 and best["checkpoint_uri"].endswith("/checkpoints/model.txt")
    meta = json.loads((Path(best["model_uri"]) / "meta.json").read_text())
    assert meta["format"] == "lightgbm" and meta["objective"] == "binary"
    registry = harness.resources["registry"]
    champion = registry.get_alias("tabular.breast_cancer", "champion")
    assert champion is not None and champion.version == out["registered"]["version"]
    assert champion.tags["trainyard.model"] == "lightgbm:train"
    store = harness.resources["store"]
    split = f"{best['lineage']['data_version']}-{harness.spec.fingerprint()}"
    test_df = pd.read_parquet(store.uri("data", "tabular", "breast_cancer", "validated", split, "test.parquet"))
    assert registry.evaluate_accuracy(champion.model_uri, test_df, TARGET) == best["metrics"]["test_acc"]
    assert best["best_metric"] == best["metrics"]["val_logloss"] == best["value"]


@pytest.mark.slow
def test_gbt_rerun_on_same_data_trains_nothing(trained) -> None:
    harness, first = trained
    again = harness.run_all()
    assert again["registered"]["version"] == first["registered"]["version"] and not again["registered"]["created"]
    assert again["best"]["wall_seconds"] == first["best"]["wall_seconds"]  # the stored result, not a new run
