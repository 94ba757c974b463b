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
    assert (
        make().fingerprint()
        != make(model=ModelSpec(path="pipelines.vision.models:DigitsMLP", max_epochs=3)).fingerprint()
    )


def test_column_roles_and_business_dtypes_are_checked_at_import() -> None:
    import pytest as _pytest

    from trainyard.spec import ColumnSpec

    assert ColumnSpec(dtype="date", role="timestamp").role == "timestamp"
    assert ColumnSpec(dtype="category", domain=["a", "b"]).categorical and ColumnSpec(dtype="str").categorical
    for bad, says in [(dict(dtype="str", role="timestamp"), "role 'timestamp' needs dtype"),
                      (dict(dtype="float", role="id"), "role 'id' needs dtype"),
                      (dict(dtype="date", min=0), "min/max apply to int and float"),
                      (dict(dtype="datetime", domain=["x"]), "domain applies to"),
                      (dict(dtype="text"), "dtype")]:
        with _pytest.raises(ValueError, match=says):
            ColumnSpec(**bad)


def test_the_target_is_a_label_and_the_fingerprint_keeps_old_studies() -> None:
    import pytest as _pytest

    from tests.pipelines.pipeline_fixtures import small_spec
    from training.spec import Preprocessing
    from trainyard.spec import ColumnSpec

    base = small_spec()
    columns = dict(base.columns)
    with _pytest.raises(ValueError, match="has role 'id'"):
        small_spec(columns={**columns, "label": ColumnSpec(dtype="int", role="id")})
    with _pytest.raises(ValueError, match="not in the target's domain"):
        small_spec(positive_label=11)
    with _pytest.raises(ValueError, match="applies to a binary target"):
        small_spec(positive_label=3)
    # Fields added for business tables leave existing pipelines' fingerprints (and so their studies) unchanged ...
    assert "preprocessing" not in base.model_dump(mode="json", include={"columns", "model"})
    assert small_spec(preprocessing=Preprocessing()).fingerprint() == base.fingerprint()
    # ... and change it when set.
    assert small_spec(preprocessing=Preprocessing(categorical="index")).fingerprint() != base.fingerprint()
    assert (
        small_spec(columns={**columns, "px0_0": ColumnSpec(dtype="float", role="ignore")}).fingerprint()
        != base.fingerprint()
    )


def test_a_metric_named_without_its_mode_takes_its_direction() -> None:
    from trainyard.spec import ModelSpec, PromotionSpec

    assert PromotionSpec(metric="test_logloss").mode == "min" and PromotionSpec(metric="test_pr_auc").mode == "max"
    assert ModelSpec(task="gbt", monitor="val_logloss").monitor_mode == "min"
    import pytest as _pytest

    with _pytest.raises(ValueError, match="would promote worse models"):
        PromotionSpec(metric="test_logloss", mode="max")


def test_class_weights_and_a_text_target_are_for_classification_only() -> None:
    import pytest as _pytest

    from tests.pipelines.pipeline_fixtures import small_spec
    from trainyard.spec import ColumnSpec, ModelSpec

    columns = dict(small_spec().columns)
    with _pytest.raises(ValueError, match="weighs classes, but the task is 'regression'"):
        small_spec(
            columns={**columns, "label": ColumnSpec(dtype="float")},
            model=ModelSpec(path="pipelines.vision.models:DigitsMLP", class_weight="balanced", monitor="val_rmse"),
        )
    with _pytest.raises(ValueError, match="regression"):
        small_spec(columns={**columns, "label": ColumnSpec(dtype="category")}, task="regression")
