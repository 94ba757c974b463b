"""The clean-lineage check on lineage recorded from real git checkouts: blocks, warns, or passes, and says why."""

from __future__ import annotations

import json
from pathlib import Path

import pydantic
import pytest

from tests.support.lineage_repo import checkout, make_dirty, trained_tags
from trainyard import lineage
from trainyard.promotion import (
    CHECK_NAMES,
    WARNINGS_TAG,
    Check,
    Decision,
    ValidationEvidence,
    check_lineage,
    clean_lineage_required,
    evaluate_policy,
    lineage_findings,
    model_card,
    recorded_policy,
    summarize,
)
from trainyard.spec import ColumnSpec, ModelSpec, PipelineSpec, PromotionSpec, SourceSpec

DEPLOYED = lineage.lock_hash()
PASSED = ValidationEvidence(True, "expectations check passed", "md5a")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return checkout(tmp_path / "repo")


def test_clean_lineage_passes_everywhere_and_names_commit_and_lock(repo: Path) -> None:
    tags = trained_tags(repo)
    commit = tags["trainyard.code_version"]
    assert tags["trainyard.code_dirty"] == "False" and tags["trainyard.lock_hash"] == DEPLOYED != "unknown"
    for environment in ("local", "cluster"):
        check = check_lineage(PromotionSpec(), tags, environment=environment, deployed_lock=DEPLOYED)
        assert check == Check(
            "clean_lineage", True, f"trained from committed code {commit} with the deployed dependency lock {DEPLOYED}"
        )


def test_dirty_code_is_blocked_in_the_cluster_by_default_with_the_way_out(repo: Path) -> None:
    make_dirty(repo)
    tags = trained_tags(repo)
    commit = tags["trainyard.code_version"]
    check = check_lineage(
        PromotionSpec(), tags, environment="cluster", deployed_lock=DEPLOYED, model="team.m", version="3"
    )
    assert (check.passed, check.warning) == (False, False)
    assert check.detail == (
        f"it was trained from uncommitted (dirty) code on top of commit {commit} (trainyard.code_dirty=True); "
        "clean lineage is required by the cluster environment's default (PromotionSpec.require_clean_lineage=None). "
        "Retrain from a clean commit with the deployed lock, or override (recorded with its reason): "
        'trainyard registry promote team.m --version 3 --force --reason "..."; '
        "a team relaxes it per pipeline with PromotionSpec(require_clean_lineage=False)"
    )
    rollback = check_lineage(
        PromotionSpec(),
        tags,
        environment="cluster",
        deployed_lock=DEPLOYED,
        model="team.m",
        version="2",
        command="rollback",
    )
    assert (
        'override (recorded with its reason): trainyard registry rollback team.m --version 2 --force --reason "..."'
        in rollback.detail
    )


def test_dirty_code_is_a_warning_locally_by_default(repo: Path) -> None:
    make_dirty(repo)
    check = check_lineage(PromotionSpec(), trained_tags(repo), environment="local", deployed_lock=DEPLOYED)
    assert (check.passed, check.warning) == (True, True)
    assert check.detail.startswith("WARNING: it was trained from uncommitted (dirty) code on top of commit ")
    assert check.detail.endswith(
        "not blocking: clean lineage is not required by the local environment's default "
        "(PromotionSpec.require_clean_lineage=None)"
    )


def test_a_lock_that_differs_from_the_deployed_one_is_blocked_and_both_hashes_named(tmp_path: Path) -> None:
    repo = checkout(tmp_path / "old", lock_text="torch==2.0.0\n")
    tags = trained_tags(repo)
    trained_lock = tags["trainyard.lock_hash"]
    assert trained_lock != DEPLOYED
    check = check_lineage(PromotionSpec(), tags, environment="cluster", deployed_lock=DEPLOYED)
    assert not check.passed
    assert check.detail.startswith(
        f"its dependency lock {trained_lock} (trainyard.lock_hash) differs from the deployed lock {DEPLOYED} (the "
        "orchestrator's constraints.txt); "
        "clean lineage is required by the cluster environment's default"
    )


def test_the_teams_setting_overrides_the_environment_default(repo: Path) -> None:
    make_dirty(repo)
    tags = trained_tags(repo)
    relaxed = check_lineage(
        PromotionSpec(require_clean_lineage=False), tags, environment="cluster", deployed_lock=DEPLOYED
    )
    assert (relaxed.passed, relaxed.warning) == (True, True)
    assert relaxed.detail.endswith(
        "not blocking: clean lineage is not required by PromotionSpec.require_clean_lineage=False"
    )
    strict = check_lineage(PromotionSpec(require_clean_lineage=True), tags, environment="local", deployed_lock=DEPLOYED)
    assert (
        not strict.passed and "clean lineage is required by PromotionSpec.require_clean_lineage=True." in strict.detail
    )
    assert "relaxes" not in strict.detail  # the team asked for it; no hint to turn it off
    assert clean_lineage_required(PromotionSpec(), "cluster") == (
        True,
        "the cluster environment's default (PromotionSpec.require_clean_lineage=None)",
    )
    assert clean_lineage_required(PromotionSpec(require_clean_lineage=True), "staging")[0] is True
    with pytest.raises(
        ValueError, match="environment 'staging' has no clean-lineage default; use one of \\['cluster', 'local'\\]"
    ):
        clean_lineage_required(PromotionSpec(), "staging")


def test_unknown_or_missing_lineage_is_never_clean(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRAINYARD_CODE_VERSION", raising=False)
    outside = tmp_path / "not-a-checkout"
    outside.mkdir()
    commit, dirty = lineage.code_version.__wrapped__(str(outside))
    assert (commit, dirty) == ("unknown", True)
    unknown = {"trainyard.code_version": commit, "trainyard.code_dirty": str(dirty), "trainyard.lock_hash": DEPLOYED}
    assert lineage_findings(unknown, DEPLOYED) == [
        "the code it was trained from is unknown (trainyard.code_version=unknown: not trained from a git checkout)"
    ]
    assert lineage_findings({"trainyard.code_version": "c" * 40}, DEPLOYED) == [
        "it records no code state (trainyard.code_dirty=missing)",
        "it records no dependency lock (trainyard.lock_hash=missing)",
    ]
    clean = {"trainyard.code_version": "c" * 40, "trainyard.code_dirty": "False", "trainyard.lock_hash": DEPLOYED}
    assert lineage_findings(clean, "unknown") == [
        f"its dependency lock {DEPLOYED} cannot be compared: the deploying orchestrator has no lock file "
        "(constraints.txt)"
    ]
    assert not check_lineage(PromotionSpec(), {}, environment="cluster", deployed_lock=DEPLOYED).passed


def test_an_image_without_git_records_the_commit_it_was_built_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The orchestrator image has no `.git`: its build passes the commit in TRAINYARD_CODE_VERSION, so lineage can be
    clean."""
    installed = tmp_path / "site-packages"
    installed.mkdir()
    commit = "ab" * 20
    monkeypatch.setenv("TRAINYARD_CODE_VERSION", commit)
    assert lineage.code_version.__wrapped__(str(installed)) == (commit, False)
    tags = {"trainyard.code_version": commit, "trainyard.code_dirty": "False", "trainyard.lock_hash": DEPLOYED}
    assert check_lineage(PromotionSpec(), tags, environment="cluster", deployed_lock=DEPLOYED).passed
    monkeypatch.setenv("TRAINYARD_CODE_VERSION", f"{commit}-dirty")
    assert lineage.code_version.__wrapped__(str(installed)) == (commit, True)
    monkeypatch.setenv("TRAINYARD_CODE_VERSION", "unknown")
    assert lineage.code_version.__wrapped__(str(installed)) == ("unknown", True)
    # in a checkout, git is the truth whatever the variable says
    monkeypatch.setenv("TRAINYARD_CODE_VERSION", commit)
    repo = checkout(tmp_path / "repo")
    assert lineage.code_version.__wrapped__(str(repo))[0] not in (commit, "unknown")


def test_the_warning_travels_with_the_checks_reason_and_tags(repo: Path) -> None:
    make_dirty(repo)
    warned = check_lineage(PromotionSpec(), trained_tags(repo), environment="local", deployed_lock=DEPLOYED)
    checks = evaluate_policy(PromotionSpec(), value=0.9, champion=None, split_id="s", validation=PASSED,
                             smoke=Check("serving_smoke_test", True, "ok"), lineage=warned)
    assert tuple(c.name for c in checks) == CHECK_NAMES and all(c.passed for c in checks)
    reason = summarize(checks, force=False, reason=None)
    assert reason.startswith("policy passed with warnings (clean_lineage): ") and warned.detail in reason
    d = Decision(
        model="m", version="1", action="register", promoted=True, already_champion=False, reason=reason, checks=checks
    )
    tags = d.tags()
    assert json.loads(tags[WARNINGS_TAG]) == [f"clean_lineage: {warned.detail}"]
    recorded = json.loads(tags["trainyard.promotion.checks"])
    assert recorded[-1] == {"name": "clean_lineage", "passed": True, "detail": warned.detail, "warning": True}
    assert Check(**recorded[-1]) == warned and Check(**recorded[0]) == checks[0]
    assert json.loads(Decision("m", "1", "register", True, False, "policy passed").tags()[WARNINGS_TAG]) == []


def test_the_model_card_states_the_lineage(repo: Path) -> None:
    spec = PipelineSpec(
        team="test", name="gate", source=SourceSpec(prefix="landing/x"),
        columns={"a": ColumnSpec(dtype="float"), "label": ColumnSpec(dtype="int", domain=[0, 1])}, target="label",
        model=ModelSpec(path="pipelines.vision.models:DigitsMLP"),
    )
    commit, dirty = lineage.code_version.__wrapped__(str(repo))
    rec = {
        "data_version": "md5a",
        "code_version": commit,
        "code_dirty": dirty,
        "lock_hash": lineage.lock_hash(repo / "constraints.txt"),
    }
    best = {"lineage": rec, "metrics": {"test_acc": 0.9}, "trial": "trial-0000", "study": "s", "params": {}}
    validated = {"split_id": "md5a-fp", "rows": {"train": 8, "val": 2, "test": 2}}
    card = model_card(spec, best, validated, PASSED)
    assert f"- lineage: clean (committed code, the deployed dependency lock {DEPLOYED})\n" in card
    assert (
        "- clean lineage (committed code, the deployed dependency lock): the environment's default (required in "
        "cluster)\n"
        in card
    )
    make_dirty(repo)
    rec["code_dirty"] = lineage.code_version.__wrapped__(str(repo))[1]
    card = model_card(spec, best, validated, PASSED, deployed_lock="0123456789abcdef")
    assert (
        f"- lineage WARNING: it was trained from uncommitted (dirty) code on top of commit {commit} "
        "(trainyard.code_dirty=True); "
        f"its dependency lock {DEPLOYED} (trainyard.lock_hash) differs from the deployed lock 0123456789abcdef "
        "(the orchestrator's constraints.txt) (blocks promotion where clean lineage is required)\n"
    ) in card


def test_the_setting_is_part_of_the_recorded_policy() -> None:
    policy = PromotionSpec(require_clean_lineage=False)
    version = type("V", (), {"name": "m", "version": "1", "run_id": None, "model_uri": "models:/m/1",
                             "tags": {"trainyard.promotion_policy": policy.model_dump_json()}})()
    assert recorded_policy(version).require_clean_lineage is False
    assert PromotionSpec().require_clean_lineage is None
    with pytest.raises(pydantic.ValidationError, match="require_clean_lineage"):
        PromotionSpec(require_clean_lineage="sometimes")
