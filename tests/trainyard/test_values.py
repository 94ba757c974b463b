"""Asset values as models: the JSON they store, what they refuse, and the message when a stored value does not fit."""

from __future__ import annotations

import pytest

from trainyard.values import (
    BestModel,
    RawData,
    RegisteredModel,
    TrialModel,
    ValidatedData,
    ValueMismatch,
    dump_value,
    parse_value,
)

RESULT = {
    "trial_id": "trial-0000",
    "status": "completed",
    "metrics": {"test_acc": 0.9},
    "best_metric": 0.91,
    "epochs": 2,
    "global_step": 8,
    "train_samples": 400,
    "fit_seconds": 1.0,
    "samples_per_second": 400.0,
    "wall_seconds": 2.0,
    "world_size": 1,
    "device_hours": 0.001,
    "model_uri": "/runs/t/model",
    "checkpoint_uri": None,
    "tracker_run": None,
    "lineage": {"data_version": "a"},
    "resumed_from": None,
    "checkpoint_interval_seconds": None,
    "checkpoint_interval_source": None,
    "goodput": {},
    "finish_seconds": {"load_best": 0.0, "evaluate": 0.1, "export": 0.2},
    "watchdog": {"hangs": 0, "stragglers": 0, "avoid_nodes": []},
}


def test_values_round_trip_as_todays_json() -> None:
    raw = {"uri": "/d/raw", "md5": "a" * 32, "rows": 3, "dvc_file": "outs: []\n", "files": 1, "warnings": []}
    assert dump_value(RawData.model_validate(raw)) == raw
    validated = {
        "md5": "a",
        "split_id": "a-f",
        "train": "/t",
        "val": "/v",
        "test": "/s",
        "rows": {"train": 2, "val": 1, "test": 1},
        "set_aside": 0,
        "profile": "/p.json",
    }
    assert dump_value(ValidatedData.model_validate(validated)) == validated
    sweep = {"study": "s", "trials": ["trial-0000"], "data_md5": "a"}
    assert dump_value(parse_value("sweep", sweep)) == sweep
    trial = {
        "trial": "trial-0000",
        "number": 0,
        "params": {"lr": 0.1},
        "result_uri": "/runs/t/result.json",
        **RESULT,
        "objectives": {"val_acc": 0.91},
    }
    assert dump_value(TrialModel.model_validate(trial)) == trial
    best = {**trial, "study": "s", "value": 0.91, "values": [0.91]}
    assert dump_value(BestModel.model_validate(best)) == best
    registered = {
        "name": "t.p",
        "version": "1",
        "model_uri": "models:/t.p/1",
        "champion": True,
        "created": True,
        "decision": "champion",
        "test_acc": 0.9,
    }
    value = RegisteredModel.model_validate(registered)
    assert dump_value(value) == registered and value.metrics == {"test_acc": 0.9}


def test_older_values_without_optional_fields_load() -> None:
    value = parse_value(
        "validated_data",
        {
            "md5": "d",
            "split_id": "d-x",
            "train": "/t",
            "val": "/v",
            "test": "/s",
            "rows": {"train": 1, "val": 1, "test": 1},
        },
    )
    assert (value.set_aside, value.profile) == (0, None)


def test_a_mismatch_names_the_asset_where_and_the_fields() -> None:
    with pytest.raises(ValueMismatch) as e:
        parse_value(
            "sweep",
            {"study": "s", "trials": "trial-0000", "data_md5": "a", "extra": 1},
            where="/store/io/t/p/sweep/value.json",
        )
    text = str(e.value)
    assert text.startswith("stored value of asset 'sweep' at /store/io/t/p/sweep/value.json does not match Sweep: ")
    assert (
        "field 'trials': Input should be a valid list" in text
        and "field 'extra': Extra inputs are not permitted" in text
    )
    with pytest.raises(ValueMismatch, match=r"field 'md5': Field required"):
        parse_value("raw_data", {"uri": "/d", "rows": 1, "dvc_file": "", "files": 1})
    with pytest.raises(ValueMismatch, match=r"field 'test_acc': Input should be a valid number"):
        parse_value(
            "registered_model",
            {
                "name": "n",
                "version": "1",
                "model_uri": "m",
                "champion": False,
                "created": False,
                "decision": "rejected",
                "test_acc": "high",
            },
        )


def test_assets_without_a_model_pass_unchanged() -> None:
    assert parse_value("gpu_usage", {"any": "thing"}) == {"any": "thing"}
    assert dump_value({"any": "thing"}) == {"any": "thing"}
