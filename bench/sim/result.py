"""What a simulation returns: per-job outcomes and a summary of utilization, goodput, waits and completion times."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from bench.sim.model import Cluster, Job


@dataclass
class JobOutcome:
    """What happened to one job; GPU-hours in `allocated`, `useful`, `lost`, `overhead`.

    `allocated_window` and `useful_window` are the parts of `allocated` and
    `useful` that fall after the simulation's warm-up.
    """

    job: Job
    done: float = 0.0
    first_start: Optional[float] = None
    finished: Optional[float] = None
    starts: int = 0
    preemptions: int = 0
    failures: int = 0
    allocated: float = 0.0
    useful: float = 0.0
    lost: float = 0.0
    overhead: float = 0.0
    queued: float = 0.0
    pending_since: Optional[float] = None
    allocated_window: float = 0.0
    useful_window: float = 0.0

    def wait(self, horizon: float) -> float:
        """Hours from submission to first start; for a job never started, to the horizon (censored)."""
        return (self.first_start if self.first_start is not None else horizon) - self.job.submit

    def completion(self, horizon: float) -> float:
        """Hours from submission to finish; for a job not finished, to the horizon (censored)."""
        return (self.finished if self.finished is not None else horizon) - self.job.submit


@dataclass
class SimResult:
    policy: str
    horizon: float
    cluster: Cluster
    outcomes: dict[str, JobOutcome]
    preemptions: dict[str, int]
    node_failures: int
    down_gpu_hours: float
    warmup: float = 0.0

    def measured(self) -> list[JobOutcome]:
        """Jobs submitted after the warm-up: the ones whose waits and completion times are reported."""
        return [o for o in self.outcomes.values() if o.job.submit >= self.warmup]

    def metrics(self) -> dict[str, float]:
        """The benchmark's figures of this run (see `bench.cluster_sim`), cheaper than `summary`.

        Utilizations are over [warmup, horizon]; completion times and waits are
        of the jobs submitted in that window, censored at the horizon (a job not
        finished or not started counts with its time so far).
        """
        capacity = self.cluster.gpus * (self.horizon - self.warmup)
        out = self.outcomes.values()
        measured = self.measured()
        gangs = [o.wait(self.horizon) for o in measured if o.job.gpus > self.cluster.gpus_per_node]
        figures = {
            "effective_utilization": sum(o.useful_window for o in out) / capacity,
            "utilization": sum(o.allocated_window for o in out) / capacity,
            "p95_completion_hours": nearest_rank([o.completion(self.horizon) for o in measured], 0.95)
            if measured
            else 0.0,
            "p95_gang_start_hours": nearest_rank(gangs, 0.95) if gangs else 0.0,
            "gangs": float(len(gangs)),
            "gangs_not_started": float(
                sum(1 for o in measured if o.job.gpus > self.cluster.gpus_per_node and o.first_start is None)
            ),
            "unfinished": float(sum(1 for o in measured if o.finished is None)),
            "preemptions": float(sum(self.preemptions.values())),
        }
        for priority in ("interactive", "production", "sweep"):
            waits = [o.wait(self.horizon) for o in measured if o.job.priority == priority]
            figures[f"p95_wait_hours_{priority}"] = nearest_rank(waits, 0.95) if waits else 0.0
        return figures

    def summary(self) -> dict[str, Any]:
        """Utilization, goodput, waits and losses of this run (numbers rounded for reports).

        Utilizations are over [warmup, horizon]; waits and completion times are
        of the jobs submitted in that window, censored at the horizon.
        """
        out = list(self.outcomes.values())
        measured = self.measured()
        capacity = self.cluster.gpus * (self.horizon - self.warmup)
        allocated = sum(o.allocated for o in out)
        useful = sum(o.useful for o in out)
        waits: dict[str, dict[str, float]] = {}
        completion: dict[str, dict[str, float]] = {}
        for label, group in [*_groups(measured, lambda o: o.job.priority), *_groups(measured, lambda o: o.job.kind)]:
            waits[label] = _stats([o.wait(self.horizon) for o in group])
            completion[label] = _stats([o.completion(self.horizon) for o in group])
        teams = {}
        for team, group in _groups(out, lambda o: o.job.team):
            teams[team] = {
                "jobs": len(group),
                "gpu_hours": round(sum(o.allocated for o in group), 3),
                "useful_gpu_hours": round(sum(o.useful for o in group), 3),
                "mean_wait_hours": round(sum(o.wait(self.horizon) for o in group) / len(group), 4),
            }
        return {
            "policy": self.policy,
            "measured_from_hours": self.warmup,
            "utilization": sum(o.allocated_window for o in out) / capacity,
            "goodput": useful / allocated if allocated else 0.0,
            "effective_utilization": sum(o.useful_window for o in out) / capacity,
            "capacity_gpu_hours": capacity,
            "allocated_gpu_hours": round(allocated, 3),
            "useful_gpu_hours": round(useful, 3),
            "lost_gpu_hours": round(sum(o.lost for o in out), 3),
            "overhead_gpu_hours": round(sum(o.overhead for o in out), 3),
            "down_gpu_hours": round(self.down_gpu_hours, 3),
            "jobs": len(out),
            "completed": {
                k: sum(1 for o in g if o.finished is not None) for k, g in _groups(out, lambda o: o.job.kind)
            },
            "never_started": sum(1 for o in out if o.first_start is None),
            "preemptions": sum(self.preemptions.values()),
            "preemptions_by_reason": dict(sorted(self.preemptions.items())),
            "node_failures": self.node_failures,
            "restarts_after_failure": sum(o.failures for o in out),
            "wait_hours": waits,
            "completion_hours": completion,
            "teams": teams,
        }


def _groups(items: list[JobOutcome], key: Any) -> list[tuple[str, list[JobOutcome]]]:
    groups: dict[str, list[JobOutcome]] = {}
    for o in items:
        groups.setdefault(key(o), []).append(o)
    return sorted(groups.items())


def nearest_rank(values: list[float], q: float) -> float:
    """The nearest-rank `q` quantile (0 < q <= 1) of `values`: the smallest value with at least q of them at or below
    it."""
    if not values:
        raise ValueError("nearest_rank: no values")
    if not 0 < q <= 1:
        raise ValueError(f"nearest_rank: q={q} must be in (0, 1]")
    v = sorted(values)
    return v[max(0, math.ceil(q * len(v)) - 1)]


def _stats(values: list[float]) -> dict[str, float]:
    """Mean, nearest-rank p50/p95 and max."""
    v = sorted(values)
    return {"n": len(v), "mean": round(sum(v) / len(v), 4), "p50": round(nearest_rank(v, 0.5), 4),
            "p95": round(nearest_rank(v, 0.95), 4), "max": round(v[-1], 4)}
