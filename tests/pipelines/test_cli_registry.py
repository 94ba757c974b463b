"""`trainyard registry show` on an in-memory registry: what it says about each version."""

from __future__ import annotations

from typing import Optional

from pipelines.cli_registry import GBT_STRATEGY, describe, render
from resources.registry.versions import ModelVersionInfo
from trainyard.lineage import LineageRecord
from trainyard.promotion import Check, Decision, summarize
from trainyard.spec import GBT_MODEL_PATH

MODEL = "tabular.wine"


class FakeRegistry:
    """The registry calls `describe` makes, over a dict of versions."""

    def __init__(self, versions: list[ModelVersionInfo]) -> None:
        self.versions = {v.version: v for v in versions}

    def get_model_tags(self, model: str) -> dict[str, str]:
        return {}

    def get_alias(self, model: str, alias: str) -> Optional[ModelVersionInfo]:
        return next((v for v in self.versions.values() if alias in v.aliases), None)

    def list_versions(self, model: str) -> list[ModelVersionInfo]:
        return list(self.versions.values())

    def artifact_uri(self, model: str, version: str) -> str:
        return f"/store/mlflow-artifacts/{version}"


def version(
    number: str, *, model_path: str, aliases: tuple[str, ...] = (), decision: Optional[Decision] = None
) -> ModelVersionInfo:
    tags = LineageRecord(
        pipeline="tabular/wine", data_version="md5", world_size=1, strategy="ddp", model=model_path
    ).to_tags()
    tags.update(decision.tags() if decision else {})
    return ModelVersionInfo(
        name=MODEL,
        version=number,
        run_id=f"run{number}",
        model_uri=f"models:/{MODEL}/{number}",
        source="",
        tags=tags,
        aliases=aliases,
    )


def decision(number: str, checks: tuple[Check, ...]) -> Decision:
    promoted = all(c.passed for c in checks)
    return Decision(
        model=MODEL,
        version=number,
        action="promote",
        promoted=promoted,
        already_champion=False,
        reason=summarize(checks, force=False, reason=None),
        checks=checks,
        decided_by="sensor",
        at=f"2026-01-0{number}T00:00:00",
    )


def test_a_gbt_version_shows_no_distribution_strategy() -> None:
    registry = FakeRegistry([version("1", model_path=GBT_MODEL_PATH, aliases=("champion",))])
    shown = describe(registry, MODEL, registry.versions["1"])

    assert shown["lineage"]["strategy"] == GBT_STRATEGY
    assert f"  strategy         : {GBT_STRATEGY}" in render(shown)
    assert "ddp" not in render(shown)


def test_a_lightning_version_keeps_its_strategy() -> None:
    registry = FakeRegistry([version("1", model_path="pipelines.vision.models:Mlp", aliases=("champion",))])

    assert describe(registry, MODEL, registry.versions["1"])["lineage"]["strategy"] == "ddp"


def test_show_says_why_the_newest_challenger_was_rejected() -> None:
    beaten = Check("beats_champion", False, "test_acc=0.9800 does not beat champion v1 (0.9817) by more than 0.0")
    passed = Check("data_validation", True, "expectations check passed")
    registry = FakeRegistry(
        [
            version("1", model_path=GBT_MODEL_PATH, aliases=("champion",), decision=decision("1", (passed,))),
            version(
                "2",
                model_path=GBT_MODEL_PATH,
                decision=decision("2", (passed, Check("threshold", False, "test_acc=0.5 misses threshold >= 0.9"))),
            ),
            version("3", model_path=GBT_MODEL_PATH, aliases=("challenger",), decision=decision("3", (passed, beaten))),
            version("4", model_path=GBT_MODEL_PATH),
        ]
    )

    shown = describe(registry, MODEL, registry.versions["1"])
    assert [o["version"] for o in shown["other_decisions"]] == ["4", "3", "2"]
    newest = shown["other_decisions"][1]
    assert (newest["decision"], newest["aliases"], newest["failed_checks"]) == (
        "rejected",
        ["challenger"],
        [beaten.as_dict()],
    )

    text = render(shown)
    assert "other versions, latest decision (newest first)\n  v4: no decision recorded yet\n" in text
    assert (
        "  v3 [challenger]: rejected (promote) at 2026-01-03T00:00:00 by sensor: policy failed: beats_champion: "
        "test_acc=0.9800 does not beat champion v1 (0.9817) by more than 0.0\n"
        "    [FAIL] beats_champion: test_acc=0.9800 does not beat champion v1 (0.9817) by more than 0.0\n"
        "  v2: rejected (promote)"
    ) in text
    assert "[FAIL] data_validation" not in text


def test_show_of_a_challenger_lists_the_others_but_not_itself_or_the_champion() -> None:
    registry = FakeRegistry([
        version("1", model_path=GBT_MODEL_PATH, aliases=("champion",)),
        version("2", model_path=GBT_MODEL_PATH),
        version("3", model_path=GBT_MODEL_PATH, aliases=("challenger",)),
    ])

    shown = describe(registry, MODEL, registry.versions["3"])
    assert [o["version"] for o in shown["other_decisions"]] == ["2"]
