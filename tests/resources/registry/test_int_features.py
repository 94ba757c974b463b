"""A LightGBM model trained on integer feature columns registers and passes the serving smoke test.

Regression: the smoke test used to send its samples as one float array, so a
model whose signature declares an integer column (`long`) failed with MLflow's
"Failed to enforce schema ... Can not safely convert float64 to int64" although
a JSON client sending the same rows is served. The trial is a real LightGBM
trial through the entrypoint (`tests/support/gbt.py`), the registry a real
MLflow on SQLite, the smoke test a fresh `python -I` serving process.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from resources.registry import ModelRegistry
from resources.registry.backend import fluent_uris
from tests.support.gbt import make_spec, result, run, write_data

INT_COLUMNS = ["mean_radius", "mean_texture"]  # breast-cancer measurements, rounded to counts


def int_data(directory: Path):
    """The binary table's splits with two feature columns stored as int64, as a Feast Int64 feature lands."""
    data = write_data(directory, "binary")
    for uri in (data.train_uri, data.val_uri, data.test_uri):
        frame = pd.read_parquet(uri)
        frame[INT_COLUMNS] = frame[INT_COLUMNS].round().astype("int64")
        pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), uri)
    return data


def test_int_feature_columns_are_declared_long_and_the_smoke_test_serves_them(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, data=int_data(tmp_path / "data"))
    assert run(tmp_path) == 0
    model_dir = result(tmp_path).model_uri
    test = pd.read_parquet(spec.data.test_uri)
    features = test.drop(columns=["target"])
    assert features[INT_COLUMNS].dtypes.tolist() == ["int64", "int64"]

    registry = ModelRegistry(
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", artifact_root=str(tmp_path / "artifacts")
    )
    info = registry.register("tabular.ints", model_dir, trial_key="s/trial-0000", tags={}, metrics={}, description="",
                             input_example=test)
    import mlflow

    with fluent_uris(registry.tracking_uri):
        signature = mlflow.models.get_model_info(info.model_uri).signature
    types = {c.name: c.type.name for c in signature.inputs.inputs}
    assert {c: types[c] for c in INT_COLUMNS} == {"mean_radius": "long", "mean_texture": "long"}
    assert types["mean_smoothness"] == "double"

    expected = registry.predict(info.model_uri, features).tolist()
    assert float((pd.Series(expected) == test["target"]).mean()) == result(tmp_path).metrics["test_acc"]
    # The test rows as the promotion policy sends them (int columns as ints), and as a client that writes
    # every number as a float sends them: MLflow's scoring server casts both to the signature's types.
    as_floats = features.astype("float64")
    smoke = registry.smoke_test(info.model_uri, {"test": features, "floats": as_floats})
    assert smoke.passed, smoke.error
    assert smoke.predictions["test"] == smoke.predictions["floats"] == expected
    assert len(smoke.predictions["input_example"]) == 5


def test_a_json_client_sends_dates_as_iso_text_and_a_missing_one_as_null() -> None:
    import datetime as dt

    import pandas as pd

    from resources.registry.serving import client_payload

    frame = pd.DataFrame(
        {"n": [1, 2], "seen": pd.to_datetime(["2024-01-01T10:00Z", None]), "day": [dt.date(2022, 5, 4), None]}
    )
    assert client_payload(frame) == {"columns": ["n", "seen", "day"],
                                     "data": [[1, "2024-01-01T10:00:00+00:00", "2022-05-04"], [2, None, None]]}
