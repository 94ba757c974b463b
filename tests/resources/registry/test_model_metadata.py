"""The MLflow model `metadata` a version is registered with (e.g. a Feast source's feature references): plain JSON or a
clear error."""

from __future__ import annotations

import math

import pytest

from resources.registry.registration import model_metadata_of


def test_metadata_is_copied_as_plain_json() -> None:
    given = {
        "feast": {
            "features": {"balance": "customer_stats:balance"},
            "entity_keys": ("customer_id",),
            "feature_service": None,
        }
    }
    assert model_metadata_of(given) == {
        "feast": {
            "features": {"balance": "customer_stats:balance"},
            "entity_keys": ["customer_id"],
            "feature_service": None,
        }
    }
    assert model_metadata_of(None) is None


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        (["feast"], r"model_metadata must be a mapping with string keys, got \['feast'\]"),
        ({1: "x"}, r"model_metadata must be a mapping with string keys, got \{1: 'x'\}"),
        (
            {"feast": {"at": object()}},
            r"model_metadata must hold JSON values only \(the MLmodel file stores it\): Object of type object",
        ),
        (
            {"score": math.nan},
            r"model_metadata must hold JSON values only \(the MLmodel file stores it\): Out of range float values",
        ),
    ],
)
def test_metadata_that_is_not_json_is_refused_naming_the_argument(metadata: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        model_metadata_of(metadata)  # type: ignore[arg-type]
