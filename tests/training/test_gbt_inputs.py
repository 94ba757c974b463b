"""The inputs of a GBT trial: objective inference and the order in which parameter layers merge."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tests.support.gbt import make_spec
from tests.training.business_models import FEATURE_TYPES, FEATURES, KEEP, TARGET, write_business_splits
from training import gbt_inputs
from training.errors import ConfigError
from training.spec import DataSpec, ImportTarget, TrainSpec


def test_objective_is_inferred_from_the_target_type(tmp_path: Path) -> None:
    for kind, objective in (("binary", "binary"), ("multiclass", "multiclass"), ("regression", "regression")):
        spec = make_spec(tmp_path, kind)
        splits = gbt_inputs.load_splits(spec, None)
        params, patience = gbt_inputs.lightgbm_params(spec, splits, None)
        assert params["objective"] == objective and patience == gbt_inputs.DEFAULT_EARLY_STOPPING_ROUNDS
        assert params["seed"] == 0 and params["deterministic"] is True and params["metric"] == "None"
    assert params.get("num_class") is None
    multi = make_spec(tmp_path, "multiclass")
    assert gbt_inputs.lightgbm_params(multi, gbt_inputs.load_splits(multi, None), None)[0]["num_class"] == 3


def test_platform_layers_merge_in_order(tmp_path: Path) -> None:
    kwargs = {"force_row_wise": True, "early_stopping_rounds": 5, "learning_rate": 0.2}
    spec = make_spec(tmp_path, model=ImportTarget(path="lightgbm:train", kwargs=kwargs))
    params, patience = gbt_inputs.lightgbm_params(spec, gbt_inputs.load_splits(spec, None), None)
    assert patience == 5 and "early_stopping_rounds" not in params
    assert (
        params["force_row_wise"] is True and "force_col_wise" not in params
    )  # the pipeline's choice wins over the default
    assert params["learning_rate"] == 0.2 and params["verbosity"] == -1


def business(tmp_path: Path, **fields: object) -> TrainSpec:
    paths = write_business_splits(tmp_path / "data", rows=400)
    return TrainSpec(
        pipeline="churn/customers",
        trial_id="trial-0000",
        task="gbt",
        model=ImportTarget(path="lightgbm:train"),
        data=DataSpec(
            train_uri=paths["train"],
            val_uri=paths["val"],
            test_uri=paths["test"],
            features=FEATURES,
            target=TARGET,
            version="0" * 32,
            feature_types=FEATURE_TYPES,
            keep=KEEP,
            **fields.pop("data", {}),
        ),  # type: ignore[arg-type]
        output_uri=str(tmp_path / "run"),
        **fields,
    )  # type: ignore[arg-type]


def test_string_labels_are_sorted_and_balanced_weights_follow_the_train_split(tmp_path: Path) -> None:
    splits = gbt_inputs.load_splits(business(tmp_path, class_weight="balanced"), None)
    assert splits.classes == ["no", "yes"] and splits.positive == 1
    y = splits.y["train"]
    assert splits.weights is not None
    for k in (0, 1):
        assert splits.weights[y == k] == pytest.approx(len(y) / (2 * (y == k).sum()))
    assert (
        splits.x["train"].dtype == np.float64
        and splits.feature_names[:2] == ["plan", "country"]
        and splits.categorical == [0, 1]
    )
    assert "customer_id" not in splits.feature_names  # an id is kept, never trained on


def test_the_positive_label_must_be_a_label(tmp_path: Path) -> None:
    assert gbt_inputs.load_splits(business(tmp_path, data={"positive_label": "no"}), None).positive == 0
    with pytest.raises(
        ConfigError, match=r"positive_label 'maybe' is not one of the classes \['no', 'yes'\] of target 'churned'"
    ):
        gbt_inputs.load_splits(business(tmp_path, data={"positive_label": "maybe"}), None)


def test_an_auc_monitor_on_a_validation_split_without_positives_is_a_config_error(tmp_path: Path) -> None:
    spec = business(tmp_path, monitor="val_pr_auc")
    val = pd.read_parquet(spec.data.val_uri)
    val.assign(churned="no").to_parquet(spec.data.val_uri, index=False)
    splits = gbt_inputs.load_splits(spec, None)
    with pytest.raises(
        ConfigError,
        match=r"monitor='val_pr_auc' is undefined on the validation split, which holds no rows of class\(es\) "
              r"\['yes'\]",
    ):
        gbt_inputs.lightgbm_params(spec, splits, None)
