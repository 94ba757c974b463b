"""A pipeline definition with a mistake fails at import time with a message naming the fix."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pipelines.vision.digits import digits
from trainyard.search import FloatParam, IntParam, SearchSpec
from trainyard.spec import ColumnSpec, ModelSpec, PipelineSpec, SourceSpec


def make(**over) -> PipelineSpec:
    base = dict(
        team="vision",
        name="digits",
        source=SourceSpec(prefix="landing/x"),
        columns={"a": ColumnSpec(dtype="float"), "label": ColumnSpec(dtype="int", domain=[0, 1])},
        target="label",
        model=ModelSpec(path="pipelines.vision.models:DigitsMLP"),
    )
    base.update(over)
    return PipelineSpec(**base)


def test_example_pipeline_is_valid() -> None:
    assert digits.key == "vision/digits"
    assert len(digits.features) == 64 and digits.target == "label"
    assert digits.search.n_trials >= 4 and set(digits.search.params) == {"lr", "hidden"}
    assert digits.distribution.procs_per_node == 2


def test_unknown_module_named() -> None:
    with pytest.raises(ValidationError, match="no module named 'pipelines.vision.nomodels' on the Python path"):
        ModelSpec(path="pipelines.vision.nomodels:DigitsMLP")


def test_unknown_class_named() -> None:
    with pytest.raises(ValidationError, match="module 'pipelines.vision.models' defines no 'Digits'"):
        ModelSpec(path="pipelines.vision.models:Digits")


def test_malformed_path_named() -> None:
    with pytest.raises(ValidationError, match="expected 'package.module:ClassName'"):
        ModelSpec(path="pipelines/vision/models.py")


def test_negative_epochs() -> None:
    with pytest.raises(ValidationError, match="max_epochs\n  Input should be greater than or equal to 1"):
        ModelSpec(path="pipelines.vision.models:DigitsMLP", max_epochs=-2)


def test_empty_search_space_with_many_trials() -> None:
    with pytest.raises(ValidationError, match="n_trials=4 needs a non-empty search space"):
        SearchSpec(n_trials=4)


@pytest.mark.parametrize(
    "param, message",
    [
        (lambda: FloatParam(low=1.0, high=0.1), "low 1.0 must be below high 0.1"),
        (lambda: FloatParam(low=0.0, high=1.0, log=True), "log scale needs low > 0"),
        (lambda: IntParam(low=5, high=5), "low 5 must be below high 5"),
    ],
)
def test_malformed_search_space(param, message) -> None:
    with pytest.raises(ValidationError, match=message):
        param()


def test_malformed_search_space_kind() -> None:
    with pytest.raises(ValidationError, match="params.lr"):
        SearchSpec(params={"lr": {"kind": "gaussian", "mean": 0}}, n_trials=2)


def test_target_must_be_declared() -> None:
    with pytest.raises(ValidationError, match="target 'y' is not one of the declared columns"):
        make(target="y")


def test_searched_and_fixed_parameter() -> None:
    with pytest.raises(ValidationError, match=r"both set \['lr'\]"):
        make(
            model=ModelSpec(path="pipelines.vision.models:DigitsMLP", hparams={"lr": 0.1}),
            search=SearchSpec(params={"lr": FloatParam(low=0.01, high=0.1)}, n_trials=2),
        )


def test_bad_team_name() -> None:
    with pytest.raises(ValidationError, match="'Vision Team' is not a valid name"):
        make(team="Vision Team")


def test_fingerprint_tracks_training_inputs_only() -> None:
    assert make().fingerprint() == make(description="other words").fingerprint()
    assert make().fingerprint() != make(model=ModelSpec(path="pipelines.vision.models:DigitsMLP", max_epochs=3)).fingerprint()
