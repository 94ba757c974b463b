"""Read-side views of what the API returns: pods of a Job and the lines of their logs.

Pure code over the `kubernetes.client` models: the supervisor reads pods
through the API and decides with these views.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Optional

from resources.k8s.names import COMPLETION_INDEX_ANNOTATION, CONTAINER_NAME
from training.spec import EXIT_BAD_CONFIG, EXIT_PREEMPTED


@dataclass
class PodView:
    """What the launcher needs from one pod of the Job."""

    name: str
    index: Optional[int]
    phase: str
    disrupted: bool = False
    exit_code: Optional[int] = None
    reason: str = ""
    message: str = ""
    waiting_reason: str = ""
    # PodScheduled=False with reason Unschedulable: the scheduler's message ("0/8 nodes are available: ...").
    unschedulable: str = ""
    created: Optional[datetime] = None
    finished: Optional[datetime] = None
    node: str = ""  # the node the scheduler bound it to ("" while unplaced)
    terminating: bool = False  # deleted, stopping within its grace period

    @classmethod
    def of(cls, pod: Any) -> "PodView":
        meta, status = pod.metadata, pod.status
        raw_index = (meta.annotations or {}).get(COMPLETION_INDEX_ANNOTATION) or (meta.labels or {}).get(
            COMPLETION_INDEX_ANNOTATION
        )
        view = cls(
            name=meta.name,
            index=int(raw_index) if raw_index is not None and str(raw_index).isdigit() else None,
            phase=(status.phase if status and status.phase else "Unknown"),
            created=meta.creation_timestamp,
            node=(getattr(pod.spec, "node_name", None) or "") if getattr(pod, "spec", None) is not None else "",
            terminating=getattr(meta, "deletion_timestamp", None) is not None,
        )
        if status is None:
            return view
        for cond in status.conditions or []:
            if cond.type == "PodScheduled" and cond.status == "False" and cond.reason == "Unschedulable":
                view.unschedulable = cond.message or cond.reason
            if cond.type == "DisruptionTarget" and cond.status == "True":
                view.disrupted = True
                view.reason, view.message = cond.reason or "", cond.message or ""
        if not view.disrupted:
            view.reason, view.message = status.reason or "", status.message or ""
        for cs in status.container_statuses or []:
            if cs.name != CONTAINER_NAME or cs.state is None:
                continue
            if cs.state.terminated is not None:
                view.exit_code = cs.state.terminated.exit_code
                view.finished = cs.state.terminated.finished_at
                if not view.reason:
                    view.reason = cs.state.terminated.reason or ""
                    view.message = cs.state.terminated.message or ""
            elif cs.state.waiting is not None:
                view.waiting_reason = cs.state.waiting.reason or ""
                if not view.message:
                    view.message = cs.state.waiting.message or ""
        return view

    def describe(self) -> str:
        parts = [f"pod {self.name} (node rank {self.index if self.index is not None else '?'}): {self.phase}"]
        if self.exit_code is not None:
            parts.append(f"exit code {self.exit_code}")
        if self.reason or self.waiting_reason:
            parts.append(self.reason or self.waiting_reason)
        text = ", ".join(parts)
        return f"{text}: {self.message}" if self.message else text


_TS = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?Z$")


def _ts_key(stamp: str) -> Optional[tuple[str, str]]:
    m = _TS.match(stamp)
    return (m.group(1), (m.group(2) or "").ljust(9, "0")) if m else None


@dataclass
class LogFollower:
    """Turns repeated reads of a pod log (with kubelet timestamps) into new lines only.

    Each poll re-reads a recent window of the log; a line is new when its
    timestamp is later than the last one emitted, or equal to it with a text not
    yet emitted at that instant.
    """

    last: Optional[tuple[str, str]] = None
    at_last: set[str] = field(default_factory=set)

    def new_lines(self, text: str) -> list[str]:
        out = []
        for raw in text.splitlines():
            stamp, _, line = raw.partition(" ")
            key = _ts_key(stamp)
            if key is None:
                continue
            if self.last is None or key > self.last:
                self.last, self.at_last = key, {line}
                out.append(line)
            elif key == self.last and line not in self.at_last:
                self.at_last.add(line)
                out.append(line)
        return out


def rank0_pod(pods: list[PodView]) -> Optional[PodView]:
    """The pod of node rank 0 to read: its live incarnation if any, else the newest."""
    zero = [p for p in pods if p.index == 0]
    if not zero:
        return None
    live = [p for p in zero if p.phase in ("Running", "Pending")]
    return (live or zero)[-1]


def blame_order(pod: PodView) -> tuple[int, float, int]:
    """Order failed pods by how likely they caused the Job's failure.

    A bad config first; then pods that died on their own; pods that exited on
    SIGTERM last, because failing a Job terminates its remaining pods, so they
    are usually the victims; earliest termination first within each group.
    """
    if pod.exit_code == EXIT_BAD_CONFIG:
        rank = 0
    elif pod.exit_code not in (None, 0, EXIT_PREEMPTED):
        rank = 1
    else:
        rank = 2
    finished = pod.finished.timestamp() if pod.finished is not None else math.inf
    return (rank, finished, pod.index if pod.index is not None else 1 << 30)
