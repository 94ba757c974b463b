"""What the cluster simulator replays: jobs, node failures, the cluster and a scheduling policy.

Times are hours from the start of the trace. A job asks for `gpus` devices for
`work` hours of computation; around that it pays `startup_hours` every time it
(re)starts and `checkpoint_cost` hours every `checkpoint_every` hours of work.
Jobs of more than one node's worth of GPUs are gangs: they take whole nodes and
start all at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Optional

PRIORITIES = {"sweep": 0, "production": 1, "interactive": 2}
ORDERS = ("fifo", "strict_fifo", "best_effort_fifo", "priority")
Priority = Literal["sweep", "production", "interactive"]


class TraceError(ValueError):
    """A job, failure, cluster or policy is malformed; the message names the field."""


@dataclass(frozen=True)
class Job:
    """One workload.

    Attributes:
        id: unique name.
        team: owning team (its quota applies).
        kind: free label for reports (`gbt`, `sweep`, `gang`, `interactive`).
        priority: `interactive` > `production` > `sweep`.
        submit: arrival time (hours).
        gpus: devices held while running; above one node, a multiple of the node size.
        work: hours of computation to finish.
        checkpoint_every: hours of work between checkpoints; None never checkpoints
            (a failure or preemption loses everything since the start).
        checkpoint_cost: hours one save blocks the job.
        startup_hours: paid at every (re)start before work progresses.
    """

    id: str
    team: str
    kind: str
    priority: Priority
    submit: float
    gpus: int
    work: float
    checkpoint_every: Optional[float] = None
    checkpoint_cost: float = 0.0
    startup_hours: float = 0.0

    def __post_init__(self) -> None:
        if self.priority not in PRIORITIES:
            raise TraceError(f"job {self.id}: priority {self.priority!r} is not one of {sorted(PRIORITIES)}")
        if self.gpus < 1:
            raise TraceError(f"job {self.id}: gpus must be >= 1, got {self.gpus}")
        if not self.work > 0:
            raise TraceError(f"job {self.id}: work must be > 0 hours, got {self.work}")
        if self.submit < 0:
            raise TraceError(f"job {self.id}: submit must be >= 0, got {self.submit}")
        if self.checkpoint_every is not None and not self.checkpoint_every > 0:
            raise TraceError(f"job {self.id}: checkpoint_every must be > 0 or None, got {self.checkpoint_every}")
        if self.checkpoint_cost < 0 or self.startup_hours < 0:
            raise TraceError(f"job {self.id}: checkpoint_cost and startup_hours must be >= 0")

    @property
    def rank(self) -> int:
        return PRIORITIES[self.priority]

    def wall_hours(self, remaining: float) -> float:
        """Wall time to do `remaining` work from a (re)start: startup, work and the saves in between."""
        saves = 0 if self.checkpoint_every is None else max(0, math.ceil(remaining / self.checkpoint_every - 1e-9) - 1)
        return self.startup_hours + remaining + saves * self.checkpoint_cost


@dataclass(frozen=True)
class Failure:
    """Node `node` fails at `time`; every job on it stops; it returns after the cluster's repair time."""

    time: float
    node: int


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    repair_hours: float = 8.0

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def check(self, jobs: list[Job], failures: list[Failure]) -> None:
        """Raise TraceError for a job that can never be placed or a failure on a node that does not exist."""
        ids = set()
        for j in jobs:
            if j.id in ids:
                raise TraceError(f"job id {j.id!r} appears twice")
            ids.add(j.id)
            if j.gpus > self.gpus_per_node and j.gpus % self.gpus_per_node:
                raise TraceError(f"job {j.id}: a gang of {j.gpus} gpus must use whole nodes of {self.gpus_per_node}")
            if j.gpus > self.gpus:
                raise TraceError(f"job {j.id}: needs {j.gpus} gpus, the cluster has {self.gpus}")
        for f in failures:
            if not 0 <= f.node < self.nodes:
                raise TraceError(f"failure at {f.time}: node {f.node} is not in 0..{self.nodes - 1}")


@dataclass(frozen=True)
class Policy:
    """How the queue is served.

    Attributes:
        name: label in reports.
        order: how pending jobs are admitted:
            `strict_fifo` (Kueue's StrictFIFO: priority class, then arrival; the
            first job that does not fit blocks every later one),
            `best_effort_fifo` (Kueue's BestEffortFIFO: the same order, but a job
            that does not fit does not block later jobs that fit; no reservation),
            `fifo` (arrival order only, head-of-line blocking), or
            `priority` (the platform's: priority class, then jobs within their
            team's quota before borrowing ones, then arrival; with `backfill`
            and `preemption` below).
        backfill: with `priority`, later jobs may start while the first blocked job
            waits, if they do not delay its reservation (EASY backfill).
        reserve: with `backfill`, the first blocked job holds a reservation; without,
            later jobs pass it whenever they fit (as Kueue's BestEffortFIFO does).
        preemption: a blocked job may stop running jobs of a `preemptible` class:
            lower-priority jobs of its own team, and other teams' jobs admitted
            beyond their quota (when the blocked job is within its own). Victims checkpoint on SIGTERM first
            (checkpoint-aware: the cheapest victims in lost and redone GPU-hours go first).
        quotas: GPUs per team; absent teams have quota 0 (they only borrow).
        preemptors: priority classes whose jobs may preempt.
        preemptible: priority classes whose jobs may be preempted.
        max_blocked: with `priority`, blocked jobs examined per scheduling pass
            (a scheduler's backfill depth); the rest wait for the next pass.
    """

    name: str
    order: Literal["fifo", "strict_fifo", "best_effort_fifo", "priority"] = "fifo"
    backfill: bool = False
    reserve: bool = True
    preemption: bool = False
    quotas: dict[str, int] = field(default_factory=dict)
    preemptors: tuple[str, ...] = ("interactive", "production", "sweep")
    preemptible: tuple[str, ...] = ("sweep",)
    max_blocked: int = 64

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise TraceError(f"policy {self.name}: order {self.order!r} is not one of {', '.join(ORDERS)}")
        if self.order != "priority" and (self.backfill or self.preemption):
            raise TraceError(f"policy {self.name}: backfill and preemption need order 'priority'")
