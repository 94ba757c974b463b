"""Promotion gated on recorded lineage, against a real MLflow registry on SQLite.

Versions carry the lineage a trial records when trained from a real git
checkout (clean, or with an uncommitted change) with the project's or another
dependency lock (`tests.support.lineage_repo`); each decision runs the real
serving smoke test. In the cluster environment (`TRAINYARD_ENV=cluster`) unclean
lineage blocks `champion` unless forced with a reason; locally it is promoted
with the warning recorded; the pipeline's `PromotionSpec` overrides either default.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from pipelines.cli import main
from resources.registry import promotion
from tests.support.lineage_repo import checkout, make_dirty, trained_tags
from trainyard import lineage
from trainyard.lineage import POLICY_TAG
from trainyard.promotion import CHAMPION, WARNINGS_TAG, Candidate, ValidationEvidence
from trainyard.spec import PromotionSpec

FEATURES = ["f0", "f1", "f2", "f3"]
CLASSES = [10, 20, 30]
SPLIT = "md5a-fp1"
PASSED = ValidationEvidence(True, "expectations check passed: 12 expectations, 0 failed", "md5a", 12, 0, 0.0, "run1")
DEPLOYED = lineage.lock_hash()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A local TRAINYARD_HOME's registry and store, three exported models, and lineage from real checkouts."""
    import torch

    from resources.handoff import HandoffPublisher
    from resources.registry import ModelRegistry
    from resources.storage import ObjectStore
    from tests.support.models import export_model

    home = tmp_path_factory.mktemp("gate")
    registry = ModelRegistry(
        tracking_uri=f"sqlite:///{home / 'mlflow.db'}",
        artifact_root=str(home / "store" / "mlflow-artifacts"),
        retry_backoff_s=0.05,
    )
    store = ObjectStore(root=str(home / "store"))
    rng = np.random.default_rng(0)
    test_df = pd.DataFrame(rng.normal(size=(60, len(FEATURES))), columns=FEATURES)
    models, dirs = {}, {}
    for seed in (0, 1, 2):
        torch.manual_seed(seed)
        models[seed] = torch.nn.Linear(len(FEATURES), len(CLASSES)).eval()
        dirs[seed] = export_model(models[seed], home / f"trial-{seed}", FEATURES, CLASSES)
    with torch.no_grad():
        labels = {s: np.asarray(CLASSES)[m(torch.tensor(test_df.to_numpy(), dtype=torch.float32)).argmax(1).numpy()]
                  for s, m in models.items()}
    test_df["label"] = labels[0]  # model 0 is perfect on this split; the others are worse
    clean = checkout(home / "clean")
    dirty = checkout(home / "dirty")
    make_dirty(dirty)
    foreign = checkout(home / "foreign-lock", lock_text="torch==2.0.0\n")
    return {
        "home": home, "registry": registry, "store": store, "handoff": HandoffPublisher(store=store),
        "test_df": test_df, "dirs": dirs, "accuracy": {s: float((labels[s] == labels[0]).mean()) for s in models},
        "lineage": {"clean": trained_tags(clean), "dirty": trained_tags(dirty), "foreign_lock": trained_tags(foreign)},
    }


def register(
    world: dict[str, Any], model: str, seed: int, lineage_kind: str, policy: PromotionSpec = PromotionSpec()
) -> Any:
    tags = {**world["lineage"][lineage_kind], "trainyard.test_split": SPLIT, "trainyard.validation": "passed",
            "trainyard.metric.test_acc": repr(world["accuracy"][seed]), POLICY_TAG: policy.model_dump_json()}
    return world["registry"].register(
        model,
        str(world["dirs"][seed]),
        trial_key=f"study/{lineage_kind}-{seed}",
        tags=tags,
        metrics={"test_acc": world["accuracy"][seed]},
        description="",
        input_example=world["test_df"][FEATURES],
    )


def candidate(world: dict[str, Any], info: Any, seed: int, policy: PromotionSpec = PromotionSpec()) -> Candidate:
    return Candidate(version=info, policy=policy, metrics={"test_acc": world["accuracy"][seed]}, split_id=SPLIT,
                     test_df=world["test_df"], target="label", validation=PASSED)


def failed(decision: Any) -> list[str]:
    return [c.name for c in decision.checks if not c.passed]


@pytest.mark.slow
def test_cluster_blocks_dirty_code_and_a_foreign_lock_until_forced_locally_it_warns(
    world: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from resources.handoff import HandoffEvent

    registry, handoff = world["registry"], world["handoff"]
    assert world["lineage"]["clean"]["trainyard.lock_hash"] == DEPLOYED  # the gate compares with this process's lock
    assert 1.0 == world["accuracy"][0] > world["accuracy"][2]
    dirty = register(world, "gate", 1, "dirty")
    foreign = register(world, "gate", 2, "foreign_lock")
    better_dirty = register(world, "gate", 0, "dirty")
    monkeypatch.setenv("TRAINYARD_ENV", "cluster")

    # 1. dirty code: every other check passes, clean_lineage blocks; the decision says what and how to override
    d = promotion.decide(registry, handoff, candidate(world, dirty, 1), action="register", decided_by="test")
    assert (d.outcome, failed(d)) == ("rejected", ["clean_lineage"])
    commit = world["lineage"]["dirty"]["trainyard.code_version"]
    detail = d.checks[-1].detail
    assert detail.startswith(
        f"it was trained from uncommitted (dirty) code on top of commit {commit} (trainyard.code_dirty=True); "
        "clean lineage is required by the cluster environment's default"
    )
    assert f'trainyard registry promote gate --version {dirty.version} --force --reason "..."' in detail
    assert registry.get_alias("gate", CHAMPION) is None
    assert (
        registry.get_version("gate", dirty.version).tags["trainyard.promotion.reason"]
        == f"policy failed: clean_lineage: {detail}"
    )

    # 2. committed code with a dependency lock other than the deployed one: blocked, both hashes named
    d = promotion.decide(registry, handoff, candidate(world, foreign, 2), action="register", decided_by="test")
    assert (d.outcome, failed(d)) == ("rejected", ["clean_lineage"])
    trained_lock = world["lineage"]["foreign_lock"]["trainyard.lock_hash"]
    assert d.checks[-1].detail.startswith(
        f"its dependency lock {trained_lock} (trainyard.lock_hash) differs from the deployed lock {DEPLOYED} (the "
        "orchestrator's constraints.txt)"
    )

    # 3. `trainyard registry promote --force --reason` (the CLI's path): champion, recorded as an override with its
    # reason
    with pytest.raises(ValueError, match="force=True needs reason"):
        promotion.promote(registry, handoff, world["store"], "gate", version=foreign.version, force=True)
    d = promotion.promote(registry, handoff, world["store"], "gate", version=foreign.version, force=True,
                          reason="INC-42: lock bump verified by hand", decided_by="test")
    assert (d.outcome, d.override, failed(d)) == ("champion", True, ["clean_lineage"])
    assert registry.get_alias("gate", CHAMPION).version == foreign.version
    tags = registry.get_version("gate", foreign.version).tags
    assert (tags["trainyard.promotion.override"], tags["trainyard.promotion.override_reason"]) == (
        "true",
        "INC-42: lock bump verified by hand",
    )
    assert tags["trainyard.promotion.reason"].startswith(
        "OVERRIDE (INC-42: lock bump verified by hand) of policy failed: clean_lineage: its dependency lock"
    )
    assert HandoffEvent.model_validate(json.loads(Path(d.handoff_uri).read_text())).override is True

    # 4. locally the same kind of lineage is promoted, with the warning in the decision, its tags and its metadata
    monkeypatch.delenv("TRAINYARD_ENV")
    d = promotion.decide(registry, handoff, candidate(world, better_dirty, 0), action="register", decided_by="test")
    assert (d.outcome, d.override, failed(d)) == ("champion", False, [])
    assert registry.get_alias("gate", CHAMPION).version == better_dirty.version
    warning = d.checks[-1]
    assert warning.warning and warning.detail.startswith(
        f"WARNING: it was trained from uncommitted (dirty) code on top of commit {commit}"
    )
    tags = registry.get_version("gate", better_dirty.version).tags
    assert json.loads(tags[WARNINGS_TAG]) == [f"clean_lineage: {warning.detail}"]
    assert tags["trainyard.promotion.reason"].startswith("policy passed with warnings (clean_lineage): ")
    assert json.loads(tags["trainyard.promotion.checks"])[-1]["warning"] is True
    meta = promotion.decision_metadata(d)
    assert meta["warnings"] == f"clean_lineage: {warning.detail}"
    assert f"| clean_lineage | WARN | {warning.detail} |" in meta["checks"].md_str


@pytest.mark.slow
def test_the_pipelines_setting_overrides_the_cluster_default(
    world: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    relaxed = PromotionSpec(require_clean_lineage=False)
    info = register(world, "gate_relaxed", 1, "dirty", relaxed)
    monkeypatch.setenv("TRAINYARD_ENV", "cluster")
    d = promotion.decide(
        world["registry"], world["handoff"], candidate(world, info, 1, relaxed), action="register", decided_by="test"
    )
    assert (d.outcome, failed(d)) == ("champion", [])
    assert d.warnings == (f"clean_lineage: {d.checks[-1].detail}",)
    assert d.checks[-1].detail.endswith(
        "not blocking: clean lineage is not required by PromotionSpec.require_clean_lineage=False"
    )
    assert world["registry"].get_alias("gate_relaxed", CHAMPION).version == info.version


@pytest.mark.slow
def test_cli_promote_needs_force_and_reason_where_the_team_requires_clean_lineage(
    world: dict[str, Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    info = register(world, "gate_cli", 1, "dirty", PromotionSpec(require_clean_lineage=True))
    monkeypatch.setenv("TRAINYARD_HOME", str(world["home"]))
    monkeypatch.delenv(
        "TRAINYARD_ENV", raising=False
    )  # local: by default only a warning; the team's policy requires it
    monkeypatch.delenv("TRAINYARD_HANDOFF_WEBHOOK", raising=False)
    argv = ["registry", "promote", "gate_cli", "--version", info.version]

    assert main(argv) == 1
    out = capsys.readouterr().out
    assert f"gate_cli version {info.version} was NOT promoted" in out
    assert "  [FAIL] clean_lineage: it was trained from uncommitted (dirty) code on top of commit " in out
    assert "clean lineage is required by PromotionSpec.require_clean_lineage=True." in out
    assert f'trainyard registry promote gate_cli --version {info.version} --force --reason "..."' in out
    assert world["registry"].get_alias("gate_cli", CHAMPION) is None

    assert main([*argv, "--force"]) == 2
    assert "--force needs --reason" in capsys.readouterr().err

    assert main([*argv, "--force", "--reason", "INC-7: retrain queued, serving fix needed now"]) == 0
    out = capsys.readouterr().out
    assert f"gate_cli version {info.version} is now champion" in out
    assert "  OVERRIDE recorded: INC-7: retrain queued, serving fix needed now" in out
    assert world["registry"].get_alias("gate_cli", CHAMPION).version == info.version
    tags = world["registry"].get_version("gate_cli", info.version).tags
    assert (tags["trainyard.promotion.decision"], tags["trainyard.promotion.override_reason"]) == (
        "champion", "INC-7: retrain queued, serving fix needed now"
    )
