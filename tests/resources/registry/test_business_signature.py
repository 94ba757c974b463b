"""A model of a business table keeps its MLflow signature, with the columns a batch brings in several dtypes typed
`Any`.

Regression: a zone-aware `datetime` feature (the canonical type of `dtype="datetime"`)
made MLflow infer no signature at all, with only a warning. The trial is a real
LightGBM trial through the entrypoint, the registry a real MLflow on SQLite.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from resources.registry import ModelRegistry
from resources.registry.backend import fluent_uris
from tests.training.business_models import FEATURE_TYPES, FEATURES, KEEP
from tests.training.test_business_trials import business_spec, train
from training.spec import DataSpec


def test_a_datetime_feature_keeps_the_signature_and_every_loose_column_is_any(tmp_path: Path) -> None:
    spec = business_spec(tmp_path, "gbt", max_epochs=20)
    for uri in (spec.data.train_uri, spec.data.val_uri, spec.data.test_uri):
        frame = pd.read_parquet(uri)
        stamps = pd.Series(pd.date_range("2024-01-01", periods=len(frame), freq="37min", tz="UTC"))
        frame["last_seen"] = stamps.where(frame.index % 17 != 0)  # zone-aware, with gaps
        frame.to_parquet(uri, index=False)
    data = DataSpec(**{**spec.data.model_dump(), "features": [*FEATURES, "last_seen"],
                       "feature_types": {**FEATURE_TYPES, "last_seen": "datetime"}})
    spec = spec.model_copy(update={"data": data})
    (tmp_path / "spec.json").write_text(spec.to_json())
    assert train(tmp_path) == 0

    test = pd.read_parquet(spec.data.test_uri)
    registry = ModelRegistry(
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", artifact_root=str(tmp_path / "artifacts")
    )
    info = registry.register(
        "crm.churn",
        str(tmp_path / "run" / "model"),
        trial_key="s/trial-0000",
        tags={},
        metrics={},
        description="",
        input_example=test,
    )
    import mlflow

    with fluent_uris(registry.tracking_uri):
        signature = mlflow.models.get_model_info(info.model_uri).signature
    assert signature is not None and signature.inputs is not None
    assert [c.name for c in signature.inputs.inputs] == [*KEEP, *FEATURES, "last_seen"]
    loose = [c.name for c in signature.inputs.inputs if type(c.type).__name__ == "AnyType"]
    assert loose == ["customer_id", "signup_date", "tenure", "last_seen"], signature.inputs
    # A user's batch read back from a CSV: the datetime as text with an offset, ints without gaps, dates as text.
    csv = tmp_path / "batch.csv"
    batch = test.drop(columns=["churned"]).head(40).copy()
    batch["last_seen"] = (
        batch["last_seen"].dt.tz_convert("Europe/Berlin").map(lambda t: None if pd.isna(t) else t.isoformat())
    )
    batch.to_csv(csv, index=False)
    served = registry.predict_output(info.model_uri, pd.read_csv(csv))
    assert list(served["customer_id"]) == list(batch["customer_id"]) and {"proba_no", "proba_yes"} <= set(
        served.columns
    )

    # A model directory whose meta.json names a state file that is not JSON is refused, and nothing stays registered.
    import shutil

    import pytest

    broken = tmp_path / "broken-model"
    shutil.copytree(tmp_path / "run" / "model", broken)
    (broken / "preprocessing.json").write_text("{ not json")
    with pytest.raises(ValueError, match="names preprocessing state 'preprocessing.json', which cannot be read"):
        registry.register(
            "crm.broken", str(broken), trial_key="s/trial-0001", tags={}, metrics={}, description="", input_example=test
        )
    assert "crm.broken" not in registry.list_models()  # refused before anything was written
