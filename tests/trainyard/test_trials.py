"""Plain functions over a sweep's trials: the launch ledger and its budget count, the pick, the tables."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainyard.store import Store
from trainyard.trials import best_single_objective, count_failures, record_launch_failure, trials_markdown_table


@dataclass
class T:
    number: int
    values: list[float]
    params: dict[str, Any] = field(default_factory=dict)
    user_attrs: dict[str, Any] = field(default_factory=dict)


def test_the_ledger_restarts_with_each_run_and_counts_causes(tmp_path) -> None:
    store = Store(root=str(tmp_path))
    out = store.uri("runs", "t", "p", "s", "trial-0000")
    first = record_launch_failure(store, out, retry_number=0, cause="TrainingPreempted", message="x" * 2000, at=1.0)
    assert first == [{"retry_number": 0, "cause": "TrainingPreempted", "message": "x" * 1000, "at": 1.0}]
    ledger = record_launch_failure(store, out, retry_number=1, cause="InfrastructureError", message="node lost", at=2.0)
    assert [x["cause"] for x in ledger] == ["TrainingPreempted", "InfrastructureError"]
    assert store.read_json(f"{out}/launches.json") == ledger
    assert count_failures(ledger, "TrainingPreempted") == (1, 1)
    again = record_launch_failure(store, out, retry_number=0, cause="InfrastructureError", message="new run", at=3.0)
    assert len(again) == 1  # a new run starts a new budget


def test_best_single_objective_breaks_ties_by_the_earlier_trial() -> None:
    done = [T(0, [0.5]), T(1, [0.9]), T(2, [0.9]), T(3, [0.1])]
    assert best_single_objective(done, "max").number == 1
    assert best_single_objective(done, "min").number == 3


def test_trials_table() -> None:
    table = trials_markdown_table([T(1, [0.9, 100.0], {"lr": 0.1})], ["val_acc", "model_bytes"])
    assert (
        table
        == "| trial | val_acc, model_bytes | params |\n|---|---|---|\n| trial-0001 | 0.9000, 100.0000 | {'lr': 0.1} |"
    )
