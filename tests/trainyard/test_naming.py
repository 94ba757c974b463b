"""Names and the object store layout: one spelling each, checked against exact strings."""

from __future__ import annotations

import pytest

from tests.pipelines.pipeline_fixtures import small_spec
from trainyard import naming
from trainyard.store import Store


def test_pipeline_names() -> None:
    spec = small_spec()
    assert naming.asset_path(spec, naming.SWEEP) == ["test", "digits", "sweep"]
    assert naming.node_name(spec, naming.TRIAL_MODEL) == "test__digits__trial_model"
    assert naming.group_name(spec) == "test_digits"
    assert naming.job_names(spec) == {
        "prepare": "test__digits__prepare",
        "train": "test__digits__train",
        "promote": "test__digits__promote",
    }
    assert naming.trials_partitions_name(spec) == "test__digits__trials"
    assert [
        naming.sweep_sensor_name(spec),
        naming.landing_sensor_name(spec),
        naming.drift_sensor_name(spec),
        naming.retrain_schedule_name(spec),
    ] == [
        "test__digits__sweep",
        "test__digits__landing",
        "test__digits__drift",
        "test__digits__retrain",
    ]
    assert naming.tracker_project(spec) == "test-digits"
    assert naming.ASSETS == ("raw_data", "validated_data", "sweep", "trial_model", "best_model", "registered_model")


def test_study_name_is_per_definition_and_data_version() -> None:
    spec = small_spec()
    name = naming.study_name(spec, "0123456789abcdef" * 2)
    assert name == f"test.digits.0123456789ab.{spec.fingerprint()}"
    assert (
        naming.study_name(small_spec(min_rows=50), "0123456789abcdef" * 2) == name
    )  # min_rows does not change what a trial trains
    assert naming.study_name(spec, "f" * 32) != name


def test_trial_keys_round_trip_and_refuse_other_keys() -> None:
    assert naming.trial_key(3) == "trial-0003" and naming.trial_key(12345) == "trial-12345"
    assert naming.trial_number("trial-0003") == 3
    for bad in ("trial-", "trial-x1", "run-0003", "trial0003", ""):
        with pytest.raises(ValueError, match="is not a trial key like 'trial-0003'"):
            naming.trial_number(bad)
        assert not naming.is_trial_key(bad)
    assert naming.is_trial_key("trial-0000")


def test_store_layout(tmp_path) -> None:
    store = Store(root=str(tmp_path))
    root = str(tmp_path)
    assert naming.run_dir(store, "t", "p", "s", "trial-0001") == f"{root}/runs/t/p/s/trial-0001"
    assert naming.trial_results_glob(store) == f"{root}/runs/*/*/*/*/result.json"
    assert naming.trial_results_glob(store, "t", "p") == f"{root}/runs/t/p/*/*/result.json"
    assert naming.sweep_report_dir(store, "t", "p", "s") == f"{root}/reports/t/p/s"
    assert naming.ingest_manifest(store, "t", "p") == f"{root}/data/t/p/ingest/manifest.json"
    assert naming.ingest_part(store, "t", "p", "ab") == f"{root}/data/t/p/ingest/parts/ab.arrow"
    assert naming.raw_dir(store, "t", "p", "m") == f"{root}/data/t/p/raw/m"
    assert naming.validated_latest(store, "t", "p") == f"{root}/data/t/p/validated/latest.json"
    assert naming.validated_dir(store, "t", "p", "sid") == f"{root}/data/t/p/validated/sid"
    assert naming.data_docs(store, "t", "p", "m") == f"{root}/data_docs/t/p/m/index.html"
    assert naming.quarantine_dir(store, "t", "p", "m") == f"{root}/quarantine/t/p/m"
    assert naming.handoff_dir(store) == f"{root}/handoff" and naming.handoff_dir(store, "t.p") == f"{root}/handoff/t.p"
    assert naming.asset_value_uri(store, ["t", "p", "sweep"]) == f"{root}/io/t/p/sweep/value.json"
    assert (
        naming.asset_value_uri(store, ["t", "p", "trial_model"], "trial-0002")
        == f"{root}/io/t/p/trial_model/trial-0002.json"
    )
    assert naming.usage_dir(store) == f"{root}/platform/gpu_usage"
    assert naming.reproduction_dir(store, "t.p", "v1-5") == f"{root}/reproductions/t.p/v1-5"
