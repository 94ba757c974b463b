"""What fails every trial is found before the sweep asks one: the sweep asset fails naming the columns, with no study
made."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from assets.sweeps.sweep import preflight
from pipelines.factory import build_definitions, job_names
from tests.pipelines.pipeline_fixtures import small_spec
from tests.pipelines.sweep_drill import TrivialLauncher, drill_resources, open_instance, prepared_data
from training.spec import Preprocessing
from trainyard.spec import ColumnSpec
from trainyard.store import Store
from trainyard.values import ValidatedData


def validated(tmp_path: Path, frame: pd.DataFrame) -> ValidatedData:
    frame.to_parquet(tmp_path / "train.parquet", index=False)
    return ValidatedData(
        md5="a" * 32,
        split_id="a" * 32 + "-f",
        train=str(tmp_path / "train.parquet"),
        val="v",
        test="t",
        rows={"train": len(frame), "val": 0, "test": 0},
    )


def test_preprocessing_off_with_text_or_gaps_is_named_before_any_trial(tmp_path: Path) -> None:
    base = small_spec()
    columns = {**base.columns, "plan": ColumnSpec(dtype="category", domain=["basic", "pro"])}
    spec = small_spec(columns=columns, preprocessing=Preprocessing(enabled=False))
    frame = pd.DataFrame({c: np.ones(4) for c in spec.features if c != "plan"})
    frame.loc[1, "px0_3"] = np.nan
    problems = preflight(spec, validated(tmp_path, frame), Store(root=str(tmp_path)))
    assert problems[0].startswith("feature 'plan' is declared 'category', and preprocessing is off")
    assert problems[1].startswith("feature 'px0_3' has 1 missing value(s) in the train split, and preprocessing is off")
    assert len(problems) == 2
    assert (
        preflight(small_spec(columns=columns), validated(tmp_path, frame), Store(root=str(tmp_path))) == []
    )  # preprocessing handles both


def test_the_sweep_asset_fails_before_making_a_study(tmp_path: Path) -> None:
    base = small_spec()
    spec = small_spec(
        columns={**base.columns, "plan": ColumnSpec(dtype="str")}, preprocessing=Preprocessing(enabled=False)
    )
    resources = drill_resources(tmp_path, TrivialLauncher())
    instance = open_instance(tmp_path)
    prepared_data(tmp_path, spec, resources)
    from dagster import AssetKey

    result = (
        build_definitions(spec, resources=resources)
        .resolve_job_def(job_names(spec)["prepare"])
        .execute_in_process(
            instance=instance, asset_selection=[AssetKey([spec.team, spec.name, "sweep"])], raise_on_error=False
        )
    )
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    assert (
        "the sweep cannot train: feature 'plan' is declared 'str', and preprocessing is off"
        in failure.event_specific_data.error.message
    )
    import optuna

    assert optuna.get_all_study_names(resources["sweeps"].storage()) == []
    assert instance.get_dynamic_partitions("test__digits__trials") == []


pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
