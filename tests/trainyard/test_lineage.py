"""The lineage record: one definition of the registry tags, read and written without loss."""

from __future__ import annotations

import pytest

from pipelines.commerce.churn import churn
from trainyard import lineage
from trainyard.lineage import LineageError, LineageRecord, flatten
from trainyard.spec import ColumnSpec, ModelSpec, PipelineSpec, SourceSpec

# Tags exactly as `registered_model` has written them (values are strings; metrics via repr).
REGISTERED = {
    "trainyard.pipeline": "vision/digits",
    "trainyard.pipeline_fingerprint": "fp12",
    "trainyard.data_version": "0cc175b9c0f1b6a831c399e269772661",
    "trainyard.code_version": "a" * 40,
    "trainyard.code_dirty": "False",
    "trainyard.lock_hash": "0123456789abcdef",
    "trainyard.seed": "0",
    "trainyard.world_size": "2",
    "trainyard.strategy": "ddp",
    "trainyard.params.lr": "0.003",
    "trainyard.params.hidden": "64",
    "trainyard.hparams.dropout": "0.1",
    "trainyard.hparams.optim.betas": "(0.9, 0.99)",
    "trainyard.model": "pipelines.vision.models:Mlp",
    "trainyard.max_epochs": "3",
    "trainyard.batch_size": "None",
    "trainyard.determinism_caveats": "['NCCL reductions are deterministic for a fixed world size']",
    "trainyard.trial": "trial-0001",
    "trainyard.study": "vision.digits.0cc175b9c0f1.fp12",
    "trainyard.checkpoint_uri": "/store/runs/vision/digits/s/trial-0001/checkpoints/best.ckpt",
    "trainyard.tracker_run": "",
    "trainyard.test_split": "0cc175b9-fp12",
    "trainyard.test_uri": "/store/data/vision/digits/validated/0cc175b9-fp12/test.parquet",
    "trainyard.target": "label",
    "trainyard.promotion_policy": '{"metric":"test_acc"}',
    "trainyard.validation": "passed",
    "trainyard.validation.summary": "expectations check passed: 12 expectations, 0 failed",
    "trainyard.metric.test_acc": "0.9722222222222222",
    "trainyard.metric.test_loss": "0.1",
}


def test_tags_to_record_to_tags_is_identical() -> None:
    record = LineageRecord.from_tags(REGISTERED)
    assert record.to_tags() == REGISTERED
    assert (record.seed, record.code_dirty, record.batch_size, record.metrics["test_acc"]) == (
        0,
        False,
        None,
        0.9722222222222222,
    )
    assert record.params == {"lr": "0.003", "hidden": "64"} and record.hparams == {
        "dropout": "0.1",
        "optim.betas": "(0.9, 0.99)",
    }
    assert record.determinism_caveats == ["NCCL reductions are deterministic for a fixed world size"]


def test_other_records_tags_are_ignored_and_minimal_records_stay_minimal() -> None:
    others = {
        "trainyard.trial_key": "s/trial-0001",
        "trainyard.promotion.decision": "champion",
        "trainyard.smoke.passed": "true",
        "trainyard.handoff.webhook": "delivered",
        "mlflow.source": "x",
    }
    assert LineageRecord.from_tags({**REGISTERED, **others}).to_tags() == REGISTERED
    minimal = {"trainyard.pipeline": "t/p", "trainyard.data_version": "md5"}
    assert LineageRecord.from_tags(minimal).to_tags() == minimal


def test_missing_or_malformed_tags_name_the_tag() -> None:
    with pytest.raises(
        LineageError, match="tag trainyard.data_version is missing: the version was not registered by trainyard"
    ):
        LineageRecord.from_tags({"trainyard.pipeline": "t/p"})
    with pytest.raises(LineageError, match="tag trainyard.seed is 'x'; expected an integer"):
        LineageRecord.from_tags({**REGISTERED, "trainyard.seed": "x"})
    with pytest.raises(LineageError, match="tag trainyard.code_dirty is 'yes'; expected 'True' or 'False'"):
        LineageRecord.from_tags({**REGISTERED, "trainyard.code_dirty": "yes"})
    with pytest.raises(LineageError, match="tag trainyard.metric.test_acc is 'n/a'; expected a number"):
        LineageRecord.from_tags({**REGISTERED, "trainyard.metric.test_acc": "n/a"})
    with pytest.raises(LineageError, match="tag trainyard.determinism_caveats is 'oops'; expected a list of strings"):
        LineageRecord.from_tags({**REGISTERED, "trainyard.determinism_caveats": "oops"})
    with pytest.raises(LineageError, match="has no field|Extra inputs are not permitted"):
        LineageRecord.from_config({"pipeline": "t/p", "data_version": "md5", "colour": "blue"})
    with pytest.raises(LineageError, match="lineage field 'params' has no tag of its own"):
        LineageRecord.tag("params")
    assert LineageRecord.tag("validation_summary") == "trainyard.validation.summary"


def spec() -> PipelineSpec:
    return PipelineSpec(
        team="vision", name="digits", source=SourceSpec(prefix="landing/x"),
        columns={"a": ColumnSpec(dtype="float"), "label": ColumnSpec(dtype="int", domain=[0, 1])}, target="label",
        model=ModelSpec(path="pipelines.vision.models:DigitsMLP", hparams={"hidden": 32}),
    )


def test_trial_record_is_the_config_and_registration_writes_what_it_always_wrote(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(lineage, "code_version", lambda: ("c" * 40, True))
    monkeypatch.setattr(lineage, "lock_hash", lambda: "feedfacefeedface")
    s = spec()
    config = lineage.record(s, "md5", params={"lr": 0.01}, seed=3)
    # determinism caveats are the pod's to add; `feast` is a Feast source's only
    assert list(config) == [f for f in LineageRecord.TRIAL_FIELDS if f not in ("determinism_caveats", "feast")]
    assert config["params"] == {"lr": 0.01} and config["code_dirty"] is True and config["seed"] == 3
    config["determinism_caveats"] = []
    record = LineageRecord.from_config(config, trial="trial-0000", metrics={"test_acc": 0.5})
    assert record.to_config() == config
    # the tags registration wrote before the record existed: `trainyard.<flattened key>` = str(value)
    expected = {f"trainyard.{k}": str(v) for k, v in flatten(config).items()}
    expected.update({"trainyard.trial": "trial-0000", "trainyard.metric.test_acc": "0.5"})
    assert record.to_tags() == expected
    assert LineageRecord.from_tags(record.to_tags()).to_tags() == expected
    meta = record.to_metadata()
    assert (meta["params.lr"], meta["metric.test_acc"], meta["code_version"], meta["trial"]) == (
        0.01,
        0.5,
        "c" * 40,
        "trial-0000",
    )


FEAST_LINEAGE = {  # `raw/<md5>/feast.json` as `trainyard.data.feast` writes it
    "entity_md5": "e" * 32, "project": "commerce", "entity_uri": "/store/data/commerce/churn/raw/e/data.parquet",
    "features": ["customer_stats:balance", "customer_stats:txn_count_7d", "customer_stats:tickets_30d"],
    "feature_service": {"name": "churn_features", "features": ["customer_stats:balance"]},
    "feature_views": [{"name": "customer_stats", "definition": "0123456789abcdef" * 4, "version": 3, "ttl_s": 2592000}],
    "time_range": ["2024-01-03T00:00:00+00:00", "2024-03-30T00:00:00+00:00"],
    "updated": {"customer_stats": "2024-04-01T00:00:00+00:00"},
}


def test_a_feast_trial_record_carries_references_views_service_and_time_range_to_config_and_tags(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(lineage, "code_version", lambda: ("c" * 40, False))
    config = lineage.record(churn, "md5", params={"num_leaves": 7}, seed=0, feast=FEAST_LINEAGE)
    feast = {
        "features": "customer_stats:balance,customer_stats:txn_count_7d,customer_stats:tickets_30d",
        "feature_service": "churn_features",
        "feature_views": "customer_stats@0123456789ab",
        "time_range": "2024-01-03T00:00:00+00:00/2024-03-30T00:00:00+00:00",
        "entity_md5": "e" * 32,
    }
    assert config["feast"] == feast  # the W&B run config and TrainSpec.lineage
    assert list(config)[-1] == "feast"
    record = LineageRecord.from_config(config, trial="trial-0001")
    tags = record.to_tags()
    assert {k: v for k, v in tags.items() if k.startswith("trainyard.feast.")} == {
        f"trainyard.feast.{k}": v for k, v in feast.items()
    }
    assert LineageRecord.from_tags(tags).feast == feast and LineageRecord.from_tags(tags).to_tags() == tags
    assert record.to_metadata()["feast.feature_views"] == "customer_stats@0123456789ab"
    # A landing-file source's record has no feast field at all.
    assert "feast" not in lineage.record(spec(), "md5", params={}, seed=0)


def test_feast_serving_maps_each_model_input_to_its_reference_in_signature_order() -> None:
    served = lineage.feast_serving(FEAST_LINEAGE, ["tickets_30d", "balance", "txn_count_7d"], ["customer_id"])
    assert served == {
        "project": "commerce",
        "feature_service": "churn_features",
        "entity_keys": ["customer_id"],
        "features": {
            "tickets_30d": "customer_stats:tickets_30d",
            "balance": "customer_stats:balance",
            "txn_count_7d": "customer_stats:txn_count_7d",
        },
        "feature_views": ["customer_stats@0123456789ab"],
    }
    assert list(served["features"]) == ["tickets_30d", "balance", "txn_count_7d"]
    listed = lineage.feast_serving({**FEAST_LINEAGE, "feature_service": None}, ["balance"], ["customer_id"])
    assert listed["feature_service"] is None and listed["features"] == {"balance": "customer_stats:balance"}


def test_feast_serving_refuses_an_input_without_a_reference_or_an_ambiguous_column() -> None:
    with pytest.raises(
        LineageError,
        match=r"model input column\(s\) \['age'\] have no Feast feature reference; the retrieval's references are "
              r"\['customer_stats:balance'",
    ):
        lineage.feast_serving(FEAST_LINEAGE, ["balance", "age"], ["customer_id"])
    twice = {**FEAST_LINEAGE, "features": ["customer_stats:balance", "accounts:balance"]}
    with pytest.raises(LineageError, match=r"give column\(s\) \['balance'\] more than once"):
        lineage.feast_serving(twice, ["balance"], ["customer_id"])
