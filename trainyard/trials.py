"""Plain functions over a sweep's trials: the launch ledger, the pick of the best trial, the tables people read.

Trials are Optuna `FrozenTrial`s (or anything with `number`, `values`,
`params` and `user_attrs`); nothing here talks to a study or to Dagster.
"""

from __future__ import annotations

from typing import Any, Iterable, Literal, Sequence

from trainyard.compare import render, trial_rows
from trainyard.naming import trial_key
from trainyard.store import FileStore

LAUNCHES_FILE = "launches.json"


def record_launch_failure(
    store: FileStore, output_uri: str, *, retry_number: int, cause: str, message: str, at: float
) -> list[dict[str, Any]]:
    """Append a failed launch to the trial's ledger `<output_uri>/launches.json` and return the ledger.

    The ledger is the retry budget's count and the record of restart causes;
    the first attempt of a run (`retry_number` 0) starts a new one.
    """
    uri = f"{output_uri}/{LAUNCHES_FILE}"
    launches = store.read_json(uri) if retry_number > 0 and store.exists(uri) else []
    launches.append({"retry_number": retry_number, "cause": cause, "message": message[:1000], "at": at})
    store.write_json(uri, launches)
    return launches


def count_failures(launches: Iterable[dict[str, Any]], preempted_cause: str) -> tuple[int, int]:
    """(infrastructure failures, preemptions) in a launch ledger; a preemption is a failure whose cause is
    `preempted_cause`."""
    causes = [x["cause"] for x in launches]
    preemptions = sum(1 for c in causes if c == preempted_cause)
    return len(causes) - preemptions, preemptions


def best_single_objective(done: Sequence[Any], mode: Literal["max", "min"]) -> Any:
    """The best completed trial of a single-objective study; ties go to the earlier trial."""
    sign = 1.0 if mode == "max" else -1.0
    return max(done, key=lambda t: (sign * t.values[0], -t.number))


def trials_markdown_table(rows: Sequence[Any], metrics: Sequence[str]) -> str:
    """A markdown table of trials in the given order: key, objective values, parameters."""
    head = f"| trial | {', '.join(metrics)} | params |\n|---|---|---|\n"
    return head + "\n".join(
        f"| {trial_key(t.number)} | {', '.join(f'{v:.4f}' for v in t.values)} | {t.params} |" for t in rows
    )


def trial_comparison(store: FileStore, trials: Iterable[Any]) -> str:
    """The `trainyard compare --trials` table (fields that differ between trials) as markdown."""
    results = [store.read_json(t.user_attrs["result_uri"]) for t in trials if "result_uri" in t.user_attrs]
    return render(trial_rows(results), "markdown", only_differences=True)


def model_bytes(store: FileStore, model_uri: str) -> int:
    """Size of an exported model: the sum over the files under its directory."""
    return sum(f.size for f in store.list_files(f"{model_uri}/**"))
