"""The JSON IO manager: values stored as their fields in the object store, validated against their model when loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dagster import AssetKey, build_input_context, build_output_context

from resources.io_manager import ObjectStoreJsonIOManager
from resources.storage import ObjectStore
from trainyard.values import Sweep, ValueMismatch

KEY = AssetKey(["t", "p", "sweep"])


def manager(tmp_path: Path) -> ObjectStoreJsonIOManager:
    return ObjectStoreJsonIOManager(store=ObjectStore(root=str(tmp_path)))


def test_a_value_is_stored_as_json_and_loaded_as_its_model(tmp_path: Path) -> None:
    io = manager(tmp_path)
    io.handle_output(build_output_context(asset_key=KEY), Sweep(study="s", trials=["trial-0000"], data_md5="a"))
    stored = tmp_path / "io" / "t" / "p" / "sweep" / "value.json"
    assert json.loads(stored.read_text()) == {"study": "s", "trials": ["trial-0000"], "data_md5": "a"}
    loaded = io.load_input(build_input_context(asset_key=KEY))
    assert loaded == Sweep(study="s", trials=["trial-0000"], data_md5="a")


def test_a_stored_value_that_does_not_fit_fails_naming_asset_and_field(tmp_path: Path) -> None:
    stored = tmp_path / "io" / "t" / "p" / "sweep" / "value.json"
    stored.parent.mkdir(parents=True)
    stored.write_text(json.dumps({"study": "s", "trials": ["trial-0000"]}))
    with pytest.raises(
        ValueMismatch,
        match=rf"stored value of asset 'sweep' at {stored} does not match Sweep: field 'data_md5': Field required",
    ):
        manager(tmp_path).load_input(build_input_context(asset_key=KEY))


def test_nothing_stored_says_materialize_first(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no stored value for t/p/sweep at .*; materialize it first"):
        manager(tmp_path).load_input(build_input_context(asset_key=KEY))


def test_plain_values_and_partitions(tmp_path: Path) -> None:
    io = manager(tmp_path)
    key = AssetKey(["platform", "gpu_usage"])
    io.handle_output(build_output_context(asset_key=key), {"runs": 1})
    assert io.load_input(build_input_context(asset_key=key)) == {"runs": 1}
    io.handle_output(build_output_context(asset_key=key, partition_key="trial-0001"), {"runs": 2})
    assert json.loads((tmp_path / "io" / "platform" / "gpu_usage" / "trial-0001.json").read_text()) == {"runs": 2}
