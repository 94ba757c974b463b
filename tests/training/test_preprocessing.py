"""The platform's preprocessing (`training.preprocessing`): fitted on train only, applied to raw rows at serving."""

from __future__ import annotations

import datetime as dt
import json

import numpy as np
import pandas as pd
import pytest

from training import preprocessing as pp
from training.errors import ConfigError

TYPES = {"plan": "category", "signup": "date", "charges": "float", "calls": "int"}


def train_frame() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "plan": ["basic", "pro", "basic", None, "plus", "basic"],
            "signup": [
                dt.date(2022, 5, 4),
                dt.date(2021, 1, 31),
                None,
                dt.date(2020, 2, 29),
                dt.date(2023, 12, 1),
                dt.date(2022, 6, 6),
            ],
            "charges": [10.0, np.nan, 30.0, 40.0, 50.0, 60.0],
            "calls": [1, 2, 3, 4, 5, 6],
        }
    )


def columns(state: dict, frame: pd.DataFrame) -> dict[str, np.ndarray]:
    x, names = pp.transform(frame, state)
    return {n: x[:, i] for i, n in enumerate(names)}


def test_lightning_state_one_hot_imputes_with_indicators_scales_and_splits_dates() -> None:
    state = pp.fit(train_frame(), TYPES, trainer="lightning")
    json.dumps(state)  # JSON-able: saved as preprocessing.json
    out = columns(state, train_frame())
    assert [n for n in out if n.startswith("plan=")] == ["plan=basic", "plan=plus", "plan=pro", f"plan={pp.OTHER}"]
    assert out[f"plan={pp.OTHER}"].tolist() == [0, 0, 0, 1, 0, 0]  # a missing category is the "other" level
    # charges: the gap is imputed with the train median (40) and flagged; then standardised with the train statistics
    filled = np.array([10.0, 40.0, 30.0, 40.0, 50.0, 60.0])
    assert out["charges__missing"].tolist() == [0, 1, 0, 0, 0, 0]
    np.testing.assert_allclose(out["charges"], (filled - filled.mean()) / filled.std(), rtol=1e-6)
    assert "calls__missing" not in out  # no gaps in train: no indicator
    assert {
        "signup__year",
        "signup__month",
        "signup__day",
        "signup__dayofweek",
        "signup__dayofyear",
        "signup__year__missing",
    } <= set(out)
    raw_year = state["columns"][[c["name"] for c in state["columns"]].index("signup__year")]
    years = out["signup__year"] * raw_year["std"] + raw_year["mean"]
    np.testing.assert_allclose(years[[0, 1, 3]], [2022, 2021, 2020], rtol=1e-6)
    assert out["signup__year__missing"].tolist() == [0, 0, 1, 0, 0, 0]
    assert x_dtype(state) == np.float32


def x_dtype(state: dict) -> np.dtype:
    return pp.transform(train_frame(), state)[0].dtype


def test_a_category_seen_only_outside_train_and_one_unseen_at_serving_are_other() -> None:
    state = pp.fit(train_frame(), TYPES, trainer="lightning")
    serving = pd.DataFrame(
        {
            "plan": ["enterprise", "pro"],
            "signup": ["2024-02-29", None],
            "charges": [None, 20.0],
            "calls": [3, None],
            "customer_id": ["C1", "C2"],
        }
    )
    out = columns(state, serving)
    assert out[f"plan={pp.OTHER}"].tolist() == [1, 0] and out["plan=pro"].tolist() == [0, 1]
    assert out["charges__missing"].tolist() == [1, 0]
    assert np.isfinite(np.column_stack(list(out.values()))).all()  # every gap filled, ISO text dates parsed


def test_gbt_state_native_categorical_codes_raw_numbers_and_nan_left_to_lightgbm() -> None:
    state = pp.fit(train_frame(), TYPES, trainer="gbt")
    x, names = pp.transform(train_frame(), state)
    assert x.dtype == np.float64
    assert pp.categorical_outputs(state) == [names.index("plan")]
    plan = x[:, names.index("plan")]
    assert plan.tolist() == [0, 2, 0, 3, 1, 0]  # basic, pro, basic, other (missing) = 3, plus
    charges = x[:, names.index("charges")]
    assert np.isnan(charges[1]) and charges[0] == 10.0  # not imputed, not scaled
    assert not any(n.endswith("__missing") for n in names)
    unseen = pp.transform(
        pd.DataFrame({"plan": ["gold"], "signup": ["2020-01-01"], "charges": [1.0], "calls": [1]}), state
    )[0]
    assert unseen[0, names.index("plan")] == 3


def test_max_categories_keeps_the_most_frequent() -> None:
    state = pp.fit(train_frame(), TYPES, config={"max_categories": 1}, trainer="gbt")
    assert state["columns"][0]["vocabulary"] == ["basic"]


def test_a_complete_numeric_table_reaches_the_model_unchanged() -> None:
    frame = pd.DataFrame({"a": [1.5, 2.5, -3.0], "b": [1, 2, 3]})
    for trainer, dtype in (("gbt", "float64"), ("lightning", "float32")):
        state = pp.fit(frame, {}, trainer=trainer)  # a spec written before feature types: all numeric
        assert state["passthrough"]
        x, names = pp.transform(frame, state)
        assert names == ["a", "b"]
        np.testing.assert_array_equal(x, frame.to_numpy(dtype=dtype))


def test_preprocessing_off_names_every_column_that_is_not_a_number() -> None:
    with pytest.raises(ConfigError) as caught:
        pp.fit(train_frame(), TYPES, config={"enabled": False}, trainer="lightning")
    message = str(caught.value)
    assert "'plan' holds text (e.g. 'basic')" in message and "'signup' holds dates (e.g. '2022-05-04')" in message
    assert "'charges' has 1 missing value of 6" in message and "'calls'" not in message
    assert "PipelineSpec.preprocessing" in message
    # a complete numeric table passes, and a later gap (a val split, a served row) is refused as well
    state = pp.fit(train_frame()[["calls"]], {"calls": "int"}, config={"enabled": False}, trainer="gbt")
    with pytest.raises(ConfigError, match="'calls' has 1 missing value"):
        pp.transform(pd.DataFrame({"calls": [1, None]}), state)


def test_text_in_a_numeric_column_names_the_column() -> None:
    with pytest.raises(
        ConfigError, match="feature 'charges' is declared 'float' but holds 'n/a' \\(row 2 of the input\\)"
    ):
        pp.fit(pd.DataFrame({"charges": ["1.0", "n/a"]}), {"charges": "float"}, trainer="gbt")


def test_labels_sorted_encoded_and_the_positive_class() -> None:
    classes = pp.class_list(np.array(["no", "yes", "no"], dtype=object), ["no"])
    assert classes == ["no", "yes"] and pp.positive_index(classes) == 1 and pp.positive_index(classes, "no") == 0
    assert pp.encode_labels(["yes", "no"], classes).tolist() == [1, 0]
    assert pp.class_list(np.array([True, False])) == [False, True]
    with pytest.raises(ValueError, match="'maybe' is not one of the classes"):
        pp.encode_labels(["maybe"], classes)


def test_index_categoricals_and_no_scaling_for_lightning() -> None:
    state = pp.fit(
        train_frame(),
        TYPES,
        config={"categorical": "index", "scale": False, "missing_indicators": False, "impute": "zero"},
        trainer="lightning",
    )
    out = columns(state, train_frame())
    assert out["plan"].tolist() == [0, 2, 0, 3, 1, 0]  # basic, pro, basic, other, plus, basic as float codes
    assert out["charges"].tolist() == [10.0, 0.0, 30.0, 40.0, 50.0, 60.0]  # imputed with zero, not scaled, no indicator
    assert not any(n.endswith("__missing") for n in out)


def test_timestamps_give_their_hour_and_a_missing_column_is_named() -> None:
    frame = pd.DataFrame({"seen": pd.to_datetime(["2024-01-01T10:00Z", "2024-01-02T23:30Z"], utc=True)})
    state = pp.fit(
        frame, {"seen": "datetime"}, config={"date_parts": ["hour", "dayofweek"], "scale": False}, trainer="lightning"
    )
    out = columns(state, pd.DataFrame({"seen": ["2024-03-04T05:06:07+00:00", "2024-03-04T05:06:07+02:00"]}))
    assert out["seen__hour"].tolist() == [5, 3] and out["seen__dayofweek"].tolist() == [0, 0]  # in UTC
    with pytest.raises(ValueError, match=r"model input is missing feature columns \['seen'\]"):
        pp.transform(pd.DataFrame({"other": [1]}), state)


def test_serving_reads_an_empty_text_cell_as_missing_and_a_datetime_keeps_its_hour() -> None:
    state = pp.fit(train_frame(), TYPES, trainer="lightning")
    # A batch read with keep_default_na=False holds "" where the CSV cell was empty: missing, as at ingest.
    raw = train_frame().astype({"charges": object})
    raw.loc[1, "charges"] = ""
    assert np.array_equal(columns(state, raw)["charges__missing"], columns(state, train_frame())["charges__missing"])
    stamps = pd.DataFrame({"seen": ["2024-01-01T02:00:00Z", "2024-01-01T14:00:00+02:00", "2024-01-01T13:00:00Z"]})
    timed = pp.fit(stamps, {"seen": "datetime"}, trainer="gbt")
    x, names = pp.transform(stamps, timed)
    assert "seen__hour" in names and x[:, names.index("seen__hour")].tolist() == [2.0, 12.0, 13.0]  # in UTC


def test_a_bad_served_value_is_named_with_its_declared_dtype_and_1_based_row() -> None:
    state = pp.fit(pd.DataFrame({"commercial": [True, False, True], "seen": ["2024-01-01T00:00Z"] * 3}),
                   {"commercial": "bool", "seen": "datetime"}, trainer="gbt")
    batch = pd.DataFrame({"commercial": ["true", "maybe"], "seen": ["2024-01-01T00:00Z", "2024-01-01T00:00Z"]})
    with pytest.raises(
        ValueError,
        match=r"feature 'commercial' is declared 'bool' but holds 'maybe' \(row 2 of the input\); give true/false",
    ):
        pp.transform(batch, state)
    batch = pd.DataFrame({"commercial": [True, True], "seen": ["2024-01-01T00:00Z", "06/01/2024 10:00"]})
    with pytest.raises(
        ValueError,
        match=r"feature 'seen' is declared 'datetime' but holds '06/01/2024 10:00' \(row 2 of the input\); give ISO "
              r"8601",
    ):
        pp.transform(batch, state)
