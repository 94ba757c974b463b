"""Promotion against a real MLflow registry: two promotions at once, and every promotion metric on a new split.

In a file of their own, apart from `test_promotion.py`'s decisions (each decision runs
the serving smoke test in a fresh process), so that xdist's `loadfile` can run them
beside those rather than after them.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from resources.registry import promotion
from tests.resources.test_promotion import CLASSES, FEATURES, PASSED, SPLIT
from trainyard.lineage import HISTORY_TAG
from trainyard.promotion import CHALLENGER, CHAMPION, Candidate, Decision
from trainyard.spec import PromotionSpec


@pytest.mark.slow
def test_concurrent_promotions_leave_consistent_aliases(tmp_path: Path) -> None:
    """Two registrations of one model promoted at once: the lock serialises them, the better one is champion."""
    import torch

    from resources.handoff import HandoffPublisher
    from resources.registry import ModelRegistry
    from resources.storage import ObjectStore
    from tests.support.models import export_model

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
            labels[seed] = np.asarray(CLASSES)[
                model(torch.tensor(test_df.to_numpy(), dtype=torch.float32)).argmax(1).numpy()
            ]
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


@pytest.mark.slow
def test_every_accepted_metric_decides_a_retrain_on_a_new_split(tmp_path: Path) -> None:
    """The champion was measured on the old data's split: for each promotion metric a classification accepts,
    it is re-evaluated on the candidate's split from its served labels and probabilities, and the decision is made."""
    import torch

    from resources.handoff import HandoffPublisher
    from resources.registry import ModelRegistry
    from resources.storage import ObjectStore
    from tests.support.models import export_model
    from trainyard.promotion import SERVED_METRICS, served_metric
    from trainyard.tasks import KNOWN_METRICS

    registry = ModelRegistry(
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", artifact_root=str(tmp_path / "a"), retry_backoff_s=0.05
    )
    handoff = HandoffPublisher(store=ObjectStore(root=str(tmp_path / "store")))
    rng = np.random.default_rng(2)
    test_df = pd.DataFrame(rng.normal(size=(80, len(FEATURES))), columns=FEATURES)
    models = {}
    for seed in (0, 1):
        torch.manual_seed(seed)
        models[seed] = torch.nn.Linear(len(FEATURES), len(CLASSES)).eval()
    with torch.no_grad():
        test_df["label"] = np.asarray(CLASSES)[
            models[0](torch.tensor(test_df[FEATURES].to_numpy(), dtype=torch.float32)).argmax(1).numpy()
        ]
    info = {
        s: registry.register(
            "r",
            str(export_model(m, tmp_path / f"t{s}", FEATURES, CLASSES)),
            trial_key=f"s/trial-{s}",
            tags={"trainyard.test_split": "md5-old-fp1"},
            metrics={},
            description="",
            input_example=test_df,
        )
        for s, m in models.items()
    }
    served = {s: registry.predict_output(i.model_uri, test_df[FEATURES]) for s, i in info.items()}
    assert list(served[0].columns) == ["label", *(f"proba_{c}" for c in CLASSES)]
    labels = test_df["label"].tolist()
    classification = [m for m in SERVED_METRICS if KNOWN_METRICS[m][0] == "classification"]
    assert classification == ["test_acc", "test_logloss", "test_roc_auc", "test_pr_auc", "test_f1", "test_balanced_acc"]

    def decide(seed: int, metric: str, extra: dict[str, float] | None = None) -> Decision:
        value = served_metric(metric, served[seed], labels, target="label")
        metrics = {metric: value, "test_acc": served_metric("test_acc", served[seed], labels), **(extra or {})}
        cand = Candidate(
            registry.get_version("r", info[seed].version),
            PromotionSpec(metric=metric, mode="min" if metric == "test_logloss" else "max"),
            metrics,
            "md5-new-fp1",
            test_df,
            "label",
            PASSED,
        )
        return promotion.decide(registry, handoff, cand, action="register", decided_by="test")

    from resources.registry.promotion import score_champion

    champion_before = registry.get_version("r", info[1].version)
    for metric in classification:  # every metric: the champion measured on the old split is re-evaluated on this one
        score = score_champion(registry, PromotionSpec(metric=metric), champion_before, "md5-new-fp1", test_df, "label")
        assert score.served and score.value == pytest.approx(
            served_metric(metric, served[1], labels, target="label")
        ), (metric, score)
    # Whole decisions (each with its serving smoke test, ~10 s) for a lower-is-better and a ranking metric, both ways.
    for metric in ("test_logloss", "test_pr_auc"):
        registry.set_alias("r", CHAMPION, info[1].version)  # the weaker model holds champion, measured on the old split
        d = decide(0, metric)
        beats = next(c for c in d.checks if c.name == "beats_champion")
        assert (d.outcome, beats.passed) == ("champion", True), (metric, d.reason)
        assert "re-evaluated on this split" in beats.detail and "cannot be re-evaluated" not in d.reason
        assert d.champion_value == pytest.approx(served_metric(metric, served[1], labels, target="label"))
        d = decide(1, metric)  # and back: the weaker candidate loses against the re-evaluated champion
        assert d.outcome == "rejected" and [c.name for c in d.checks if not c.passed] == ["beats_champion"], (
            metric,
            d.reason,
        )

    # The trivial baseline blocks with its evidence: a candidate no better than the class prior is not promoted.
    registry.set_alias("r", CHAMPION, info[1].version)
    d = decide(0, "test_acc", {"baseline_test_acc": 1.0})
    assert d.outcome == "rejected" and [c.name for c in d.checks if not c.passed] == ["beats_baseline"]
    assert "does not beat the trivial baseline's 1.0000 (baseline_test_acc" in d.reason
