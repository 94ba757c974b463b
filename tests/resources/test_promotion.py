"""Promotion against the registry: evidence from Dagster, then decisions against a real MLflow registry.

The decision tests (marked slow) register tiny torch models, run the real
serving smoke test in a fresh process, move aliases and publish handoff events
to a local object store and a webhook served by a thread.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pandas as pd
import pytest
from dagster import AssetKey, DagsterInstance, MarkdownMetadataValue

from resources.registry import SmokeResult, promotion
from resources.registry.promotion import decision_metadata, validation_evidence
from tests.support.webhook import WebhookServer
from trainyard.lineage import HANDOFF_WEBHOOK_TAG, HISTORY_TAG
from trainyard.promotion import (
    CHALLENGER,
    CHAMPION,
    Candidate,
    Check,
    Decision,
    PromotionError,
    ValidationEvidence,
    check_smoke,
)
from trainyard.spec import PromotionSpec

PASSED = ValidationEvidence(True, "expectations check passed: 12 expectations, 0 failed", "md5a", 12, 0, 0.0, "run1")
SPLIT = "md5a-fp1"


def test_the_registry_smoke_result_is_what_the_policy_judges() -> None:
    result = SmokeResult("models:/m@challenger", "r1", {"input_example": [1], "test": [1, 2]}, 1.5, 4.25, (), None)
    check, evidence = check_smoke(
        PromotionSpec(), result, run_id="r1", test_labels=[1, 2], training_metrics={"test_acc": 1.0}
    )
    assert check.passed and evidence["served_value"] == 1.0 and evidence["load_seconds"] == 1.5


def test_decision_metadata_for_the_asset() -> None:
    d = Decision(
        model="m",
        version="2",
        action="register",
        promoted=True,
        already_champion=False,
        reason="policy passed",
        checks=(Check("threshold", True, "ok"),),
        smoke={"passed": True},
        handoff_uri="/store/handoff/m/e.json",
    )
    meta = decision_metadata(d)
    assert (meta["decision"], meta["champion"], meta["champion_before"], meta["override"]) == (
        "champion",
        True,
        "",
        False,
    )
    assert isinstance(meta["checks"], MarkdownMetadataValue)
    assert meta["checks"].md_str == "| check | result | evidence |\n|---|---|---|\n| threshold | pass | ok |"
    assert meta["smoke_test"].data == {"passed": True} and meta["handoff_event"].path == "/store/handoff/m/e.json"
    assert decision_metadata(Decision("m", "3", "promote", False, False, "policy failed"))["checks"] == ""


def test_validation_evidence_fails_without_a_passing_check_for_this_data() -> None:
    key = AssetKey(["t", "p", "validated_data"])
    with DagsterInstance.ephemeral() as instance:
        quarantined = validation_evidence(instance, key, "expectations", "md5a", quarantined=True)
        assert quarantined == ValidationEvidence(False, "data version md5a is quarantined", "md5a")
        missing = validation_evidence(instance, key, "expectations", "md5a", quarantined=False)
        assert (missing.passed, missing.detail) == (False, "no materialization of t/p/validated_data is recorded")


# -- decisions against a real registry (slow: each runs a serving process) ------------------


FEATURES = ["f0", "f1", "f2", "f3"]
CLASSES = [10, 20, 30]


@pytest.fixture(scope="module")
def webhook() -> Iterator[WebhookServer]:
    hook = WebhookServer()
    yield hook
    hook.close()



@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, webhook: WebhookServer) -> dict[str, Any]:
    """A registry, handoff publisher and three registered versions of model `m` with known test accuracy."""
    import torch

    from resources.handoff import HandoffPublisher
    from resources.registry import ModelRegistry
    from resources.storage import ObjectStore
    from tests.support.models import export_model

    home = tmp_path_factory.mktemp("promotion")
    registry = ModelRegistry(tracking_uri=f"sqlite:///{home / 'mlflow.db'}", artifact_root=str(home / "artifacts"),
                             retry_backoff_s=0.05)
    store = ObjectStore(root=str(home / "store"))
    handoff = HandoffPublisher(store=store, webhook_url=webhook.url, webhook_backoff_s=0.0)
    rng = np.random.default_rng(0)
    test_df = pd.DataFrame(rng.normal(size=(60, len(FEATURES))), columns=FEATURES)
    models = {}
    for seed in (0, 1, 2):
        torch.manual_seed(seed)
        models[seed] = torch.nn.Linear(len(FEATURES), len(CLASSES)).eval()
    with torch.no_grad():
        labels = {s: np.asarray(CLASSES)[m(torch.tensor(test_df.to_numpy(), dtype=torch.float32)).argmax(1).numpy()]
                  for s, m in models.items()}
    test_df["label"] = labels[0]  # model 0 is perfect on this split; the others are worse
    accuracy = {s: float((labels[s] == labels[0]).mean()) for s in models}
    versions = {}
    for seed, model in models.items():
        model_dir = export_model(model, home / f"trial-{seed}", FEATURES, CLASSES)
        versions[seed] = registry.register(
            "m", str(model_dir), trial_key=f"study/trial-{seed}",
            tags={"trainyard.test_split": SPLIT, "trainyard.metric.test_acc": repr(accuracy[seed]),
                  "trainyard.validation": "passed", "trainyard.data_version": "md5a"},
            metrics={"test_acc": accuracy[seed]}, description=f"seed {seed}", input_example=test_df,
        )
    return {"registry": registry, "store": store, "handoff": handoff, "test_df": test_df, "accuracy": accuracy,
            "versions": versions, "home": home}


def candidate(world: dict[str, Any], seed: int, *, policy: PromotionSpec = PromotionSpec(),
              validation: ValidationEvidence = PASSED, test_acc: float | None = None) -> Candidate:
    return Candidate(
        version=world["registry"].get_version("m", world["versions"][seed].version),
        policy=policy,
        metrics={"test_acc": world["accuracy"][seed] if test_acc is None else test_acc},
        split_id=SPLIT,
        test_df=world["test_df"],
        target="label",
        validation=validation,
    )


@pytest.mark.slow
def test_decisions_pass_fail_override_and_rollback(world: dict[str, Any], webhook: WebhookServer) -> None:
    from resources.handoff import HandoffEvent

    registry, handoff = world["registry"], world["handoff"]
    v = {s: world["versions"][s].version for s in world["versions"]}
    assert world["accuracy"][0] == 1.0 and world["accuracy"][1] < 1.0

    # 1. a version that beats nothing yet but misses the absolute threshold stays challenger only
    strict = PromotionSpec(threshold=0.999)
    d = promotion.decide(registry, handoff, candidate(world, 1, policy=strict), action="register", decided_by="test")
    assert (d.outcome, d.champion) == ("rejected", False)
    assert [c.name for c in d.checks if not c.passed] == ["threshold"]
    assert registry.get_alias("m", CHAMPION) is None
    assert registry.get_alias("m", CHALLENGER).version == v[1]
    assert registry.get_version("m", v[1]).tags["trainyard.promotion.decision"] == "rejected"

    # 2. the first version that passes becomes champion; its smoke test reproduced training accuracy
    d = promotion.decide(registry, handoff, candidate(world, 1), action="register", decided_by="test")
    assert (d.outcome, d.champion_before) == ("champion", None)
    assert (d.smoke["served_metric"], d.smoke["served_value"]) == ("test_acc", world["accuracy"][1])
    assert registry.get_alias("m", CHAMPION).version == v[1]
    event = handoff.read(d.handoff_uri)
    assert (event.version, event.action, event.previous_version, event.alias_uri) == (
        v[1],
        "promote",
        None,
        "models:/m@champion",
    )
    assert Path(d.handoff_uri).parent == world["home"] / "store" / "handoff" / "m"
    assert Path(d.handoff_uri).name.endswith(f"-v{v[1]}.json")
    assert (
        webhook.delivered()[-1]["event_id"] == event.event_id and webhook.delivered()[-1]["record_uri"] == d.handoff_uri
    )

    # 3. a better version whose data validation failed is rejected, with the evidence on the version
    quarantined = ValidationEvidence(False, "data version md5a is quarantined", "md5a")
    d = promotion.decide(
        registry, handoff, candidate(world, 0, validation=quarantined), action="register", decided_by="test"
    )
    assert d.outcome == "rejected" and [c.name for c in d.checks if not c.passed] == ["data_validation"]
    tags = registry.get_version("m", v[0]).tags
    assert tags["trainyard.promotion.reason"] == "policy failed: data_validation: data version md5a is quarantined"
    assert registry.get_alias("m", CHAMPION).version == v[1]

    # 4. a version whose recorded accuracy the served model does not reproduce fails the smoke test
    d = promotion.decide(registry, handoff, candidate(world, 0, test_acc=0.5), action="register", decided_by="test")
    assert "serving_smoke_test" in [c.name for c in d.checks if not c.passed]
    assert (
        "serving does not reproduce the evaluated model"
        in next(c for c in d.checks if c.name == "serving_smoke_test").detail
    )

    # 5. with good evidence it passes and replaces the champion
    d = promotion.decide(registry, handoff, candidate(world, 0), action="register", decided_by="test")
    assert (d.outcome, d.champion_before, d.champion_value) == ("champion", v[1], world["accuracy"][1])
    assert "recorded on this split" in d.checks[1].detail
    assert registry.get_alias("m", CHAMPION).version == v[0]
    assert registry.get_version("m", v[1]).tags["trainyard.champion.replaced"].endswith(f"by v{v[0]} (test)")

    # 6. a worse version is rejected on the relative check; forcing it needs a reason and is an override
    with pytest.raises(ValueError, match="force=True needs reason"):
        promotion.decide(registry, handoff, candidate(world, 2), action="promote", decided_by="test", force=True)
    d = promotion.decide(registry, handoff, candidate(world, 2), action="promote", decided_by="test")
    assert d.outcome == "rejected" and [c.name for c in d.checks if not c.passed] == ["beats_champion"]
    d = promotion.decide(registry, handoff, candidate(world, 2), action="promote", decided_by="test",
                         force=True, reason="hotfix INC-7")
    assert (d.outcome, d.override, d.override_reason) == ("champion", True, "hotfix INC-7")
    tags = registry.get_version("m", v[2]).tags
    assert (tags["trainyard.promotion.override"], tags["trainyard.promotion.override_reason"]) == (
        "true",
        "hotfix INC-7",
    )
    assert HandoffEvent.model_validate(json.loads(Path(d.handoff_uri).read_text())).override is True

    # 7. rollback returns to the previous champion (v0), then to the one before (v1), then stops
    d = promotion.rollback(registry, handoff, world["store"], "m", decided_by="test")
    assert (d.outcome, d.version, d.champion_before) == ("rolled_back_to", v[0], v[2])
    assert registry.get_alias("m", CHAMPION).version == v[0]
    assert handoff.read(d.handoff_uri).action == "rollback"
    d = promotion.rollback(registry, handoff, world["store"], "m", decided_by="test")
    assert registry.get_alias("m", CHAMPION).version == v[1]
    with pytest.raises(PromotionError, match=f"v{v[1]} is the first champion on record"):
        promotion.rollback(registry, handoff, world["store"], "m", decided_by="test")
    history = json.loads(registry.get_model_tags("m")[HISTORY_TAG])
    assert [(e["version"], e["action"]) for e in history["log"]] == [
        (v[1], "register"), (v[0], "register"), (v[2], "promote"), (v[0], "rollback"), (v[1], "rollback")
    ]
    assert [Path(u).name.split("-v")[1] for u in handoff.list_events("m")] == [f"{v[i]}.json" for i in (1, 0, 2, 0, 1)]
    assert registry.list_models() == ["m"]  # no lock left behind


@pytest.mark.slow
def test_failed_webhook_is_redelivered_by_the_next_run(world: dict[str, Any], webhook: WebhookServer) -> None:
    from resources.handoff import HandoffDeliveryFailed

    registry, handoff = world["registry"], world["handoff"]
    current = registry.get_alias("m", CHAMPION)
    target = next(s for s, info in world["versions"].items() if current is None or info.version != current.version)
    webhook.statuses = [503, 503, 503]
    with pytest.raises(HandoffDeliveryFailed, match="after 3 attempt"):
        promotion.decide(registry, handoff, candidate(world, target), action="promote", decided_by="test",
                         force=True, reason="redelivery drill")
    version = world["versions"][target].version
    assert registry.get_alias("m", CHAMPION).version == version  # moved; the record exists
    tags = registry.get_version("m", version).tags
    assert tags[HANDOFF_WEBHOOK_TAG].startswith("failed: webhook")
    received = len(webhook.delivered())
    d = promotion.decide(registry, handoff, candidate(world, target), action="promote", decided_by="test")
    assert d.already_champion and d.webhook == "delivered"
    assert len(webhook.delivered()) == received + 1
    assert webhook.delivered()[-1]["record_uri"] == tags["trainyard.handoff.event_uri"]
    assert registry.get_version("m", version).tags[HANDOFF_WEBHOOK_TAG] == "delivered"
