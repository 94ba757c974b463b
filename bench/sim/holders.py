"""The simulator's records of who holds GPUs, and of one pass of the platform's scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from bench.sim.model import PRIORITIES, Job

_RELEASE, _HANDOVER, _FAIL, _ARRIVE = 0, 1, 2, 3  # order of events at one instant
_LOWEST = min(PRIORITIES.values())


@dataclass
class _Pass:
    """State of one scheduling pass of the platform's policy."""

    use: dict[str, int]  # GPUs per team, as jobs start in the pass
    start: dict[str, int]  # GPUs per team when the pass began (orders within-quota before borrowing)
    reservation: Optional[tuple[float, frozenset[int]]] = None  # (shadow time, nodes) of the first blocked job
    blocked: int = 0
    no_fit: set[int] = field(default_factory=set)  # sizes with no place (capacity shrinks until a preemption)


@dataclass
class _Holder:
    id: int
    job: Job
    kind: str  # run | drain (a preempted job saving) | claim (GPUs kept for a preemptor)
    alloc: dict[int, int]
    start: float
    end: float
    base: float = 0.0  # work committed when a run began
    transfer: dict[int, int] = field(default_factory=dict)  # drain: GPUs handed to claim `claim_id`
    claim_id: Optional[int] = None
    borrowing: bool = False  # admitted beyond its team's quota (a run)
