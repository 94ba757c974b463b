"""Benchmark result files: `bench/results/<name>.json` with name, value, unit, baseline, ratio, details.

Conventions every benchmark follows (docs/benchmarks.md):

- `ratio` is always `value / baseline` = platform / reference; `details.better`
  says whether a higher or a lower value (and ratio) is better.
- Every benchmark declares its targets: `Target(metric, op, threshold)` where
  `metric` is `value`, `ratio`, `baseline` or a dotted path into the details
  (`details.added_ms_per_step`) and `op` is `<=` or `>=`. A benchmark may also
  put already-evaluated targets in `details["targets"]` as dicts
  `{"metric", "op", "threshold", "value", "met"}`; `met` is recomputed here from
  `value`, never taken on trust.
- A benchmark that repeats passes its repetitions as `runs` and reports their
  median as `value` (or says in `aggregate` what else the value is).
- Every record carries `details.provenance` (the commit, whether the tree was
  dirty, the UTC start and end time, the load average before and after, the
  machine) and `details.repeats` (how many repetitions, what the value is of
  them, and their spread: min/median/max, also of the baseline's).

`python -m bench` (bench/__main__.py) runs benchmarks and prints a table of
their targets; it exits non-zero when a target is missed or a benchmark failed.
"""

from __future__ import annotations

import json
import math
import operator
import os
import platform
import resource
import statistics
import subprocess
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
RESULTS_ENV = "TRAINYARD_BENCH_RESULTS"  # where results go (tests point it at a temporary directory)
# set by the runner: JSON {"time_utc", "load_average"} taken before the benchmark's process started
STARTED_ENV = "TRAINYARD_BENCH_STARTED"
RESULTS = Path(os.environ.get(RESULTS_ENV) or ROOT / "bench" / "results")
OPS = {"<=": operator.le, ">=": operator.ge}
BETTER = ("higher", "lower")
RESERVED = ("provenance", "repeats")  # details keys the harness writes (besides `targets` and `better`)


def _utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _started() -> dict[str, Any]:
    given = os.environ.get(STARTED_ENV)
    if given:
        return dict(json.loads(given))
    return {"time_utc": _utc_now(), "load_average": _load()}


# Benchmarks import this module first thing: without the runner, "before" is this process's start.
_STARTED = _started()


def started_marker() -> str:
    """The value of `STARTED_ENV` for a benchmark process about to start (the runner sets it)."""
    return json.dumps({"time_utc": _utc_now(), "load_average": _load()})


@dataclass(frozen=True)
class Target:
    """A target a benchmark declares: `metric op threshold`, e.g. `Target("ratio", ">=", 0.98)`.

    `metric` is `value`, `ratio`, `baseline` or `details.<key>[.<key>...]`;
    `unit` (optional) is shown in the table for metrics other than `value`.
    """

    metric: str
    op: str
    threshold: float
    unit: Optional[str] = None

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"target {self.metric!r}: op must be '<=' or '>=', got {self.op!r}")
        if not (self.metric in ("value", "ratio", "baseline") or self.metric.startswith("details.")):
            raise ValueError(
                f"target metric must be 'value', 'ratio', 'baseline' or 'details.<key>', got {self.metric!r}"
            )
        if (
            not isinstance(self.threshold, (int, float))
            or isinstance(self.threshold, bool)
            or not math.isfinite(self.threshold)
        ):
            raise ValueError(f"target {self.metric!r}: threshold must be a finite number, got {self.threshold!r}")


def _lookup(record: dict[str, Any], metric: str) -> Any:
    if not metric.startswith("details."):
        return record.get(metric)
    node: Any = record.get("details", {})
    for key in metric.split(".")[1:]:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def evaluate_target(target: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """`target` with its measured `value` and `met` filled in (met is False when the value is missing or not finite).

    The value is looked up in `record` when the metric names something there;
    otherwise the `value` the benchmark gave is used. Raises ValueError when the
    target itself is malformed (unknown op, threshold not a number).
    """
    for key in ("metric", "op", "threshold"):
        if key not in target:
            raise ValueError(f"target {target!r} lacks {key!r} (needs metric, op, threshold)")
    op, threshold = target["op"], target["threshold"]
    if op not in OPS:
        raise ValueError(f"target {target['metric']!r}: op must be '<=' or '>=', got {op!r}")
    if not isinstance(threshold, (int, float)) or isinstance(threshold, bool):
        raise ValueError(f"target {target['metric']!r}: threshold must be a number, got {threshold!r}")
    looked_up = _lookup(record, str(target["metric"]))
    value = looked_up if looked_up is not None else target.get("value")
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return {
        **target,
        "value": value,
        "met": bool(number and OPS[op](value, threshold)),
        "better": "higher" if op == ">=" else "lower",
    }


def git_commit(root: Path = ROOT) -> tuple[Optional[str], Optional[bool]]:
    """(HEAD's sha, whether tracked or untracked-not-ignored files differ from it); (None, None) outside a git
    checkout."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None, None
    return sha, bool(status.strip())


def spread(runs: Sequence[float]) -> dict[str, float]:
    """min / median / max of a benchmark's repetitions."""
    if not runs:
        raise ValueError("spread of no repetitions")
    return {"min": min(runs), "median": statistics.median(runs), "max": max(runs)}


def peak_rss_bytes() -> int:
    """This process's own peak resident set size (Linux `VmHWM`).

    Not `getrusage(RUSAGE_SELF).ru_maxrss`: on Linux a process started with
    fork/vfork + exec keeps its parent's high-water mark as its own, so a
    child of a 2.7 GiB parent reports at least 2.7 GiB however little it
    uses. `VmHWM` belongs to the process's address space and starts afresh at
    exec. Falls back to `ru_maxrss` where /proc is missing.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def write_result(
    name: str,
    value: float,
    unit: str,
    baseline: Optional[float],
    details: dict[str, Any],
    *,
    targets: Sequence[Target] = (),
    better: Optional[str] = None,
    runs: Optional[Sequence[float]] = None,
    baseline_runs: Optional[Sequence[float]] = None,
    aggregate: str = "median",
) -> dict[str, Any]:
    """Write `bench/results/<name>.json` and return the record.

    Args:
        name, value, unit: what was measured; `value` is the platform's figure.
        baseline: the reference in the same unit, or None; `ratio` = value / baseline.
        details: anything else; may carry `targets` (evaluated dicts, see the module
            docstring) and `better` instead of the keyword arguments.
        targets: targets declared by the benchmark; evaluated against the record.
        better: "higher" or "lower": which direction of value and ratio is better.
        runs: the repetitions whose `aggregate` is `value` (median by default).
        baseline_runs: the repetitions of the baseline.
        aggregate: what `value` is of `runs`; with "median", value must be their median.

    Raises:
        ValueError: a malformed target or direction, a value that is not the
            median of its runs, or details using a key the harness writes.
    """
    better = better if better is not None else details.get("better")
    if better is not None and better not in BETTER:
        raise ValueError(f"{name}: better must be 'higher' or 'lower', got {better!r}")
    clash = sorted(set(details) & set(RESERVED))
    if clash:
        raise ValueError(f"{name}: details keys {clash} are written by the harness; rename them")
    if (
        runs is not None
        and aggregate == "median"
        and not math.isclose(value, statistics.median(runs), rel_tol=1e-9, abs_tol=1e-12)
    ):
        raise ValueError(
            f"{name}: value {value} is not the median of its runs {list(runs)}; pass aggregate= to say what it is"
        )
    commit, dirty = git_commit()
    record: dict[str, Any] = {
        "name": name,
        "value": value,
        "unit": unit,
        "baseline": baseline,
        "ratio": (value / baseline) if baseline else None,
        "details": {
            **details,
            "better": better,
            "provenance": {
                "commit": commit,
                "dirty": dirty,
                "started_utc": _STARTED["time_utc"],
                "finished_utc": _utc_now(),
                "load_average": {"before": _STARTED["load_average"], "after": _load()},
                "machine": {"python": platform.python_version(), "cpu": platform.processor() or platform.machine(),
                            "cpus": os.cpu_count()},
            },
            "repeats": {
                "count": len(runs) if runs is not None else 1,
                "aggregate": aggregate if runs is not None else "single run",
                "spread": spread(runs) if runs is not None else spread([value]),
                "baseline_spread": spread(baseline_runs) if baseline_runs is not None else None,
            },
        },
    }
    declared = [dict(t) for t in details.get("targets", [])] + [
        {"metric": t.metric, "op": t.op, "threshold": t.threshold, **({"unit": t.unit} if t.unit else {})}
        for t in targets
    ]
    record["details"]["targets"] = [evaluate_target(t, record) for t in declared]
    results = Path(os.environ.get(RESULTS_ENV) or RESULTS)
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{name}.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return record
