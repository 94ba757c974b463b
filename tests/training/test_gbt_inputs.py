"""The inputs of a GBT trial: objective inference and the order in which parameter layers merge."""

from __future__ import annotations

from pathlib import Path

from tests.support.gbt import make_spec
from training import gbt_inputs
from training.spec import ImportTarget


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
    assert params["force_row_wise"] is True and "force_col_wise" not in params  # the pipeline's choice wins over the default
    assert params["learning_rate"] == 0.2 and params["verbosity"] == -1
