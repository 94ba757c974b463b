from __future__ import annotations

import pytest
from pydantic import ValidationError

from training.spec import DataSpec, Distribution, ImportTarget, TrainSpec


def _spec(**over):
    base = dict(
        pipeline="vision/digits",
        trial_id="trial-0000",
        model=ImportTarget(path="pipelines.vision.models:DigitsMLP"),
        data=DataSpec(train_uri="a", val_uri="b", test_uri="c", features=["x"], target="y", version="v"),
        output_uri="/tmp/out",
    )
    base.update(over)
    return TrainSpec(**base)


def test_round_trips_through_json() -> None:
    spec = _spec(distribution=Distribution(procs_per_node=2))
    assert TrainSpec.from_json(spec.to_json()) == spec
    assert spec.distribution.world_size == 2


@pytest.mark.parametrize(
    "path", ["pipelines.vision.models", "no colon", "pkg.mod:1bad", ":Cls", "pkg..mod:Cls"]
)
def test_malformed_import_path_is_named(path: str) -> None:
    with pytest.raises(ValidationError, match="malformed; expected 'package.module:ClassName'"):
        ImportTarget(path=path)


def test_negative_epochs_rejected() -> None:
    with pytest.raises(ValidationError, match="max_epochs"):
        _spec(max_epochs=-1)


def test_pipeline_name_format() -> None:
    with pytest.raises(ValidationError, match="must be '<team>/<name>'"):
        _spec(pipeline="Digits")


def test_unknown_strategy_rejected() -> None:
    with pytest.raises(ValidationError, match="strategy"):
        Distribution(strategy="horovod")


def test_unknown_field_rejected() -> None:
    with pytest.raises(ValidationError, match="max_epoch"):
        _spec(max_epoch=3)
