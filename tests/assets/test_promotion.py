"""The promotion policy: pure checks with exact values, then decisions against a real MLflow registry.

The decision tests (marked slow) register tiny torch models, run the real
serving smoke test in a fresh process, move aliases and publish handoff events
to a local object store and a webhook served by a thread.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pandas as pd
import pydantic
import pytest

from assets.promotion import (
    CHAMPION,
    CHALLENGER,
    HANDOFF_WEBHOOK_TAG,
    HISTORY_TAG,
    Candidate,
    Check,
    ChampionScore,
    Decision,
    PromotionError,
    ValidationEvidence,
    check_beats_champion,
    check_smoke,
    check_threshold,
    evaluate_policy,
    next_history,
    rollback_target,
    summarize,
)
from trainyard.spec import PromotionSpec
from resources.registry import SmokeResult

MAX = PromotionSpec(metric="test_acc", mode="max", min_improvement=0.01, threshold=0.8)
MIN = PromotionSpec(metric="test_rmse", mode="min", threshold=2.0)
PASSED = ValidationEvidence(True, "expectations check passed: 12 expectations, 0 failed", "md5a", 12, 0, 0.0, "run1")
SPLIT = "md5a-fp1"


def smoke(predictions: dict[str, list], *, run_id: str = "r1", error: str | None = None) -> SmokeResult:
    return SmokeResult("models:/m@challenger", run_id, predictions, 1.5, 4.25, (), error)


# -- threshold -------------------------------------------------------------------


def test_threshold_max_mode() -> None:
    assert check_threshold(MAX, 0.8) == Check("threshold", True, "test_acc=0.8000 meets threshold >= 0.8")
    assert check_threshold(MAX, 0.79) == Check("threshold", False, "test_acc=0.7900 misses threshold >= 0.8")


def test_threshold_min_mode_and_absent() -> None:
    assert check_threshold(MIN, 2.0) == Check("threshold", True, "test_rmse=2.0000 meets threshold <= 2.0")
    assert check_threshold(MIN, 2.5).passed is False
    assert check_threshold(PromotionSpec(), 0.1) == Check("threshold", True, "test_acc=0.1000; no absolute threshold declared")
    assert check_threshold(MAX, None) == Check("threshold", False, "test_acc was not measured for this version")
    assert check_threshold(MAX, float("nan")).passed is False


# -- relative to the champion ----------------------------------------------------------


def test_beats_champion_needs_more_than_min_improvement() -> None:
    champion = ChampionScore("3", 0.90, "recorded on this split")
    ok = check_beats_champion(MAX, 0.92, champion, SPLIT)
    assert ok == Check(
        "beats_champion",
        True,
        "test_acc=0.9200 beats champion v3 (0.9000, recorded on this split) by more than 0.01 (max) on test split md5a-fp1",
    )
    assert check_beats_champion(MAX, 0.91, champion, SPLIT).passed is False  # exactly the margin is not enough
    assert check_beats_champion(MAX, 0.95, champion, SPLIT).passed is True
    # equal scores never replace the champion, even without a margin
    assert check_beats_champion(PromotionSpec(), 0.90, champion, SPLIT).passed is False


def test_beats_champion_min_mode() -> None:
    champion = ChampionScore("1", 1.5, "re-evaluated on this split")
    assert check_beats_champion(MIN, 1.4, champion, SPLIT).passed is True
    assert check_beats_champion(MIN, 1.5, champion, SPLIT).passed is False


def test_beats_champion_without_champion_or_comparable_score() -> None:
    assert check_beats_champion(MAX, 0.5, None, SPLIT) == Check(
        "beats_champion", True, "no champion yet: the first version that passes becomes champion"
    )
    unusable = ChampionScore("2", None, "it was measured on split x and no test data is available")
    assert check_beats_champion(MAX, 0.99, unusable, SPLIT) == Check(
        "beats_champion", False, "champion v2 cannot be compared: it was measured on split x and no test data is available"
    )


# -- serving smoke test -----------------------------------------------------------------


def test_smoke_passes_when_serving_reproduces_training() -> None:
    result = smoke({"input_example": [1, 2], "test": [1, 2, 2, 1]})
    check, evidence = check_smoke(MAX, result, run_id="r1", test_labels=[1, 2, 2, 2], training_metrics={"test_acc": 0.75})
    assert check == Check(
        "serving_smoke_test",
        True,
        "loaded models:/m@challenger in a serving-only process (4.2s), predicted the input example and 4 test rows "
        "(served test_acc 0.750000, training-side 0.750000)",
    )
    assert evidence == {
        "model_uri": "models:/m@challenger", "seconds": 4.25, "load_seconds": 1.5, "blocked_imports": [],
        "input_example_predictions": [1, 2], "test_rows": 4, "served_metric": "test_acc", "served_value": 0.75,
        "training_value": 0.75, "passed": True,
    }


def test_smoke_fails_when_served_accuracy_differs_from_training() -> None:
    result = smoke({"input_example": [1], "test": [1, 2, 2, 1]})
    check, evidence = check_smoke(MAX, result, run_id="r1", test_labels=[1, 2, 2, 2], training_metrics={"test_acc": 0.8})
    assert not check.passed
    assert check.detail == (
        "served test_acc 0.750000 differs from the training-side 0.800000 by more than 1e-06: "
        "serving does not reproduce the evaluated model"
    )
    assert evidence["passed"] is False and evidence["served_value"] == 0.75


def test_smoke_recomputes_rmse_for_regression() -> None:
    result = smoke({"input_example": [0.5], "test": [1.0, 2.0, 4.0]})
    check, evidence = check_smoke(MIN, result, run_id="r1", test_labels=[1.0, 2.0, 2.0],
                                  training_metrics={"test_rmse": 2 / 3 ** 0.5})
    assert check.passed, check.detail
    assert evidence["served_metric"] == "test_rmse" and evidence["served_value"] == pytest.approx(1.1547005383792515)
    check, _ = check_smoke(MIN, result, run_id="r1", test_labels=[1.0, 2.0, 2.0], training_metrics={"test_rmse": 1.0})
    assert not check.passed and check.detail.startswith("served test_rmse 1.154701 differs from the training-side 1.000000")


def test_smoke_fails_on_process_error_wrong_model_or_missing_rows() -> None:
    failed = smoke({}, run_id=None, error="ModuleNotFoundError: No module named 'torch'")
    assert check_smoke(MAX, failed, run_id="r1", test_labels=None, training_metrics={})[0] == Check(
        "serving_smoke_test", False,
        "serving process failed on models:/m@challenger: ModuleNotFoundError: No module named 'torch'",
    )
    other = smoke({"input_example": [1]}, run_id="r9")
    assert check_smoke(MAX, other, run_id="r1", test_labels=None, training_metrics={})[0].detail == (
        "models:/m@challenger resolved to run r9, not this version's run r1"
    )
    short = smoke({"input_example": [1], "test": [1]})
    assert check_smoke(MAX, short, run_id="r1", test_labels=[1, 1], training_metrics={})[0].detail == (
        "served 1 predictions for 2 test rows"
    )
    assert check_smoke(MAX, None, run_id="r1", test_labels=None, training_metrics={})[0].passed is False


# -- the whole policy ----------------------------------------------------------------------


def test_policy_passes_only_when_every_check_passes() -> None:
    good_smoke = Check("serving_smoke_test", True, "ok")
    champion = ChampionScore("1", 0.85, "recorded on this split")
    checks = evaluate_policy(MAX, value=0.9, champion=champion, split_id=SPLIT, validation=PASSED, smoke=good_smoke)
    assert [c.name for c in checks] == ["threshold", "beats_champion", "data_validation", "serving_smoke_test"]
    assert all(c.passed for c in checks)

    failed_validation = ValidationEvidence(False, "data version md5a is quarantined", "md5a")
    checks = evaluate_policy(MAX, value=0.9, champion=champion, split_id=SPLIT, validation=failed_validation, smoke=good_smoke)
    assert [c.name for c in checks if not c.passed] == ["data_validation"]
    assert summarize(checks, force=False, reason=None) == "policy failed: data_validation: data version md5a is quarantined"
    assert summarize(checks, force=True, reason="INC-7") == (
        "OVERRIDE (INC-7) of policy failed: data_validation: data version md5a is quarantined"
    )

    bad_smoke = Check("serving_smoke_test", False, "serving process failed")
    checks = evaluate_policy(MAX, value=0.9, champion=champion, split_id=SPLIT, validation=PASSED, smoke=bad_smoke)
    assert [c.name for c in checks if not c.passed] == ["serving_smoke_test"]


def test_rollback_skips_the_relative_check_but_not_the_others() -> None:
    champion = ChampionScore("2", 0.99, "recorded on this split")
    checks = evaluate_policy(MAX, value=0.85, champion=champion, split_id=SPLIT, validation=PASSED,
                             smoke=Check("serving_smoke_test", True, "ok"), relative=False)
    assert checks[1] == Check("beats_champion", True, "not applied: a rollback restores an earlier version on purpose")
    assert all(c.passed for c in checks)
    checks = evaluate_policy(MAX, value=0.5, champion=None, split_id=SPLIT, validation=PASSED,
                             smoke=Check("serving_smoke_test", True, "ok"), relative=False)
    assert [c.name for c in checks if not c.passed] == ["threshold"]


def test_policy_spec_names_field_value_and_rule() -> None:
    with pytest.raises(pydantic.ValidationError, match="promotion.metric 'val_acc' must be a metric measured on the held-out test split"):
        PromotionSpec(metric="val_acc")
    with pytest.raises(pydantic.ValidationError, match="smoke_test_timeout_s"):
        PromotionSpec(smoke_test_timeout_s=0)
    with pytest.raises(pydantic.ValidationError, match="min_improvement"):
        PromotionSpec(min_improvement=-0.1)
    with pytest.raises(pydantic.ValidationError, match="promotion.mode 'max' with metric 'test_rmse' would promote worse models"):
        PromotionSpec(metric="test_rmse")


# -- champion history ----------------------------------------------------------------------


def test_history_push_and_rollback_steps_back() -> None:
    h: dict[str, Any] = {}
    h = next_history(h, action="register", version="1", current=None, entry={"version": "1"})
    h = next_history(h, action="register", version="2", current="1", entry={"version": "2"})
    h = next_history(h, action="promote", version="4", current="2", entry={"version": "4"})
    assert h["stack"] == ["1", "2", "4"]
    assert rollback_target(h, "4") == "2"
    h = next_history(h, action="rollback", version="2", current="4", entry={"version": "2"})
    assert h["stack"] == ["1", "2"]
    assert rollback_target(h, "2") == "1"
    h = next_history(h, action="rollback", version="1", current="2", entry={"version": "1"})
    assert h["stack"] == ["1"]
    with pytest.raises(PromotionError, match="v1 is the first champion on record"):
        rollback_target(h, "1")
    # a rollback to a version that was never champion pushes it
    h = next_history(h, action="rollback", version="3", current="1", entry={"version": "3"})
    assert h["stack"] == ["1", "3"]
    assert [e["version"] for e in h["log"]] == ["1", "2", "4", "2", "1", "3"]


def test_history_adopts_a_champion_set_before_it_existed_and_detects_outside_moves() -> None:
    h = next_history({}, action="register", version="5", current="3", entry={})
    assert h["stack"] == ["3", "5"]
    with pytest.raises(PromotionError, match="the alias was moved outside trainyard"):
        rollback_target(h, "4")
    with pytest.raises(PromotionError, match="there is no champion to roll back from"):
        rollback_target(h, None)


def test_validation_evidence_from_tags() -> None:
    assert ValidationEvidence.from_tags({}).passed is False
    recorded = ValidationEvidence.from_tags({"trainyard.validation": "passed", "trainyard.validation.summary": "12 ok",
                                             "trainyard.data_version": "md5a"})
    assert (recorded.passed, recorded.detail, recorded.data_version) == (True, "recorded at registration: passed (12 ok)", "md5a")


def test_validation_evidence_fails_without_a_passing_check_for_this_data() -> None:
    from dagster import AssetKey, DagsterInstance

    from assets.promotion import validation_evidence

    key = AssetKey(["t", "p", "validated_data"])
    with DagsterInstance.ephemeral() as instance:
        quarantined = validation_evidence(instance, key, "expectations", "md5a", quarantined=True)
        assert quarantined == ValidationEvidence(False, "data version md5a is quarantined", "md5a")
        missing = validation_evidence(instance, key, "expectations", "md5a", quarantined=False)
        assert (missing.passed, missing.detail) == (False, "no materialization of t/p/validated_data is recorded")


def test_decision_tags_record_the_evidence() -> None:
    d = Decision(
        model="m", version="2", action="promote", promoted=True, already_champion=False, reason="OVERRIDE (x) of ...",
        checks=(Check("threshold", False, "misses"),), metric="test_acc", value=0.5, champion_before="1",
        champion_value=0.9, override=True, override_reason="x", decided_by="cli a@b", at="2025-01-01T00:00:00+00:00",
        smoke={"passed": True},
    )
    tags = d.tags()
    assert tags["trainyard.promotion.decision"] == "champion"
    assert tags["trainyard.promotion.override"] == "true"
    assert tags["trainyard.promotion.override_reason"] == "x"
    assert json.loads(tags["trainyard.promotion.checks"]) == [{"name": "threshold", "passed": False, "detail": "misses"}]
    assert tags["trainyard.promotion.champion_before"] == "1"
    assert tags["trainyard.smoke.passed"] == "true"
    assert d.outcome == "champion" and d.champion


# -- decisions against a real registry (slow: each runs a serving process) ------------------


FEATURES = ["f0", "f1", "f2", "f3"]
CLASSES = [10, 20, 30]


class _Webhook:
    """A loopback HTTP endpoint that records POSTs and answers with `statuses` in turn (then 200)."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        self.statuses: list[int] = []
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status = hook.statuses.pop(0) if hook.statuses else 200
                if status == 200:
                    hook.received.append({"event_id": self.headers["X-Trainyard-Event-Id"], **body})
                self.send_response(status)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/handoff"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def webhook() -> Iterator[_Webhook]:
    hook = _Webhook()
    yield hook
    hook.close()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, webhook: _Webhook) -> dict[str, Any]:
    """A registry, handoff publisher and three registered versions of model `m` with known test accuracy."""
    import torch

    from resources.handoff import HandoffPublisher
    from resources.registry import ModelRegistry
    from resources.storage import ObjectStore
    from tests.resources.test_registry import export_model

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
def test_decisions_pass_fail_override_and_rollback(world: dict[str, Any], webhook: _Webhook) -> None:
    from assets import promotion
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
    assert (event.version, event.action, event.previous_version, event.alias_uri) == (v[1], "promote", None, "models:/m@champion")
    assert Path(d.handoff_uri).parent == world["home"] / "store" / "handoff" / "m"
    assert Path(d.handoff_uri).name.endswith(f"-v{v[1]}.json")
    assert webhook.received[-1]["event_id"] == event.event_id and webhook.received[-1]["record_uri"] == d.handoff_uri

    # 3. a better version whose data validation failed is rejected, with the evidence on the version
    quarantined = ValidationEvidence(False, "data version md5a is quarantined", "md5a")
    d = promotion.decide(registry, handoff, candidate(world, 0, validation=quarantined), action="register", decided_by="test")
    assert d.outcome == "rejected" and [c.name for c in d.checks if not c.passed] == ["data_validation"]
    tags = registry.get_version("m", v[0]).tags
    assert tags["trainyard.promotion.reason"] == "policy failed: data_validation: data version md5a is quarantined"
    assert registry.get_alias("m", CHAMPION).version == v[1]

    # 4. a version whose recorded accuracy the served model does not reproduce fails the smoke test
    d = promotion.decide(registry, handoff, candidate(world, 0, test_acc=0.5), action="register", decided_by="test")
    assert "serving_smoke_test" in [c.name for c in d.checks if not c.passed]
    assert "serving does not reproduce the evaluated model" in d.checks[3].detail

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
    assert (tags["trainyard.promotion.override"], tags["trainyard.promotion.override_reason"]) == ("true", "hotfix INC-7")
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
def test_failed_webhook_is_redelivered_by_the_next_run(world: dict[str, Any], webhook: _Webhook) -> None:
    from assets import promotion
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
    received = len(webhook.received)
    d = promotion.decide(registry, handoff, candidate(world, target), action="promote", decided_by="test")
    assert d.already_champion and d.webhook == "delivered"
    assert len(webhook.received) == received + 1
    assert webhook.received[-1]["record_uri"] == tags["trainyard.handoff.event_uri"]
    assert registry.get_version("m", version).tags[HANDOFF_WEBHOOK_TAG] == "delivered"


@pytest.mark.slow
def test_concurrent_promotions_leave_consistent_aliases(tmp_path: Path) -> None:
    """Two registrations of one model promoted at once: the lock serialises them, the better one is champion."""
    import torch

    from assets import promotion
    from resources.handoff import HandoffPublisher
    from resources.registry import ModelRegistry
    from resources.storage import ObjectStore
    from tests.resources.test_registry import export_model

    registry = ModelRegistry(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", artifact_root=str(tmp_path / "a"),
                             retry_backoff_s=0.05, retry_attempts=6)
    handoff = HandoffPublisher(store=ObjectStore(root=str(tmp_path / "store")))
    rng = np.random.default_rng(1)
    test_df = pd.DataFrame(rng.normal(size=(40, len(FEATURES))), columns=FEATURES)
    dirs, labels = {}, {}
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = torch.nn.Linear(len(FEATURES), len(CLASSES)).eval()
        with torch.no_grad():
            labels[seed] = np.asarray(CLASSES)[model(torch.tensor(test_df.to_numpy(), dtype=torch.float32)).argmax(1).numpy()]
        dirs[seed] = export_model(model, tmp_path / f"t{seed}", FEATURES, CLASSES)
    test_df["label"] = labels[0]
    accuracy = {s: float((labels[s] == labels[0]).mean()) for s in dirs}
    results: dict[int, Any] = {}
    errors: list[BaseException] = []

    def register_and_promote(seed: int) -> None:
        try:
            info = registry.register("c", str(dirs[seed]), trial_key=f"s/trial-{seed}",
                                     tags={"trainyard.test_split": SPLIT}, metrics={"test_acc": accuracy[seed]},
                                     description="", input_example=test_df)
            cand = Candidate(info, PromotionSpec(), {"test_acc": accuracy[seed]}, SPLIT, test_df, "label", PASSED)
            results[seed] = promotion.decide(registry, handoff, cand, action="register", decided_by=f"thread {seed}")
        except BaseException as e:  # surfaced by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=register_and_promote, args=(s,)) for s in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    versions = {s: r.version for s, r in results.items()}
    assert len(set(versions.values())) == 2
    champion = registry.get_alias("c", CHAMPION)
    assert champion.version == versions[0]  # the better model, whichever order the lock gave them
    assert champion.tags["trainyard.promotion.decision"] == "champion"
    challenger = registry.get_alias("c", CHALLENGER)
    assert challenger.version in versions.values()
    history = json.loads(registry.get_model_tags("c")[HISTORY_TAG])
    assert history["stack"][-1] == versions[0]
    events = [handoff.read(u) for u in handoff.list_events("c")]
    assert events[-1].version == versions[0]
    assert registry.list_models() == ["c"]
