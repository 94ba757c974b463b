"""Admitted gangs that do not start: what is wrong, and how long the launcher waits before failing the trial.

Kueue's quota is reserved once a gang is admitted, so an admitted gang whose pods
cannot start holds GPUs nobody uses. The launcher classifies what it reads from
the API (pod conditions and container states, the Job's events; a JobSet's child Jobs' events) into kinds with
a bound each; a kind seen for longer than its bound, counted in admitted time
only (time queued, e.g. after Kueue's `waitForPodsReady` eviction, does not
count), fails the trial with the reason, and the gang is deleted:

- config: container waiting CreateContainerConfigError, CreateContainerError,
  InvalidImageName, ErrImageNeverPull; at once.
- image: container waiting ImagePullBackOff, ErrImagePull; `stuck_seconds` (5 min).
- crashloop: container waiting CrashLoopBackOff; `stuck_seconds`.
- create: a Warning event FailedCreate on the Job (ResourceQuota, LimitRange,
  Pod Security, an admission webhook); `stuck_seconds`.
- unschedulable: pod condition PodScheduled=False, reason Unschedulable;
  `unschedulable_seconds` (15 min).

`unschedulable_seconds` is longer than Kueue's `waitForPodsReady.timeout` (10
min, `deploy/render.py`), so Kueue evicts and requeues the gang first (freeing
its quota and maybe placing it elsewhere); the launcher's bound catches the
gang that stays unschedulable across re-admissions, or a cluster without
`waitForPodsReady`. A timer restarts when its kind is no longer seen while the
gang runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from resources.k8s.pods import PodView

CONFIG_REASONS = frozenset(
    {"CreateContainerConfigError", "CreateContainerError", "InvalidImageName", "ErrImageNeverPull"}
)
IMAGE_REASONS = frozenset({"ImagePullBackOff", "ErrImagePull"})
CRASH_REASONS = frozenset({"CrashLoopBackOff"})

HINTS = {
    "config": "check that every Secret and ConfigMap the pod references exists and the image name is valid",
    "image": "check the image reference and that the nodes may pull it (imagePullSecrets, registry reachable)",
    "crashloop": "the container keeps exiting at start; see its log",
    "create": "the API refused to create the Job's pods (ResourceQuota, LimitRange, Pod Security, an admission "
              "webhook)",
    "unschedulable": "no node fits the pods (resources, nodeSelector, tolerations); check the node pool and the "
                     "quota's flavor",
}


@dataclass(frozen=True)
class Problem:
    """One thing keeping an admitted gang from starting."""

    kind: str
    subject: str
    detail: str

    def describe(self) -> str:
        return f"{self.subject}: {self.detail}"


def pod_problems(pods: list[PodView]) -> list[Problem]:
    """What keeps the gang's pods from running, read off their conditions and container states."""
    out = []
    for p in pods:
        if p.phase != "Pending":
            continue
        subject = f"pod {p.name} (node rank {p.index if p.index is not None else '?'})"
        if p.unschedulable:
            out.append(Problem("unschedulable", subject, f"Unschedulable: {p.unschedulable}"))
        for kind, reasons in (("config", CONFIG_REASONS), ("image", IMAGE_REASONS), ("crashloop", CRASH_REASONS)):
            if p.waiting_reason in reasons:
                detail = f"{p.waiting_reason}: {p.message}" if p.message else p.waiting_reason
                out.append(Problem(kind, subject, detail))
    return out


def _get(obj: Any, *names: str) -> Any:
    """Attribute or key `names` in turn (the client's models, or plain dicts)."""
    for name in names:
        if obj is None:
            return None
        obj = obj.get(name) if isinstance(obj, dict) else getattr(obj, _snake(name), None)
    return obj


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name)


def event_problems(events: list[Any], kind: str, name: str, uid: Optional[str]) -> list[Problem]:
    """FailedCreate warnings the Job controller recorded on this Job (this incarnation: same uid)."""
    out = []
    for e in events:
        if _get(e, "reason") != "FailedCreate" or _get(e, "type") != "Warning":
            continue
        if _get(e, "involvedObject", "kind") != kind or _get(e, "involvedObject", "name") != name:
            continue
        if uid and _get(e, "involvedObject", "uid") not in (None, "", uid):
            continue
        out.append(Problem("create", f"{kind} {name}", f"FailedCreate: {_get(e, 'message') or ''}".rstrip(": ")))
    return out[-1:]  # the newest says enough; the event's count grows, not the list


# The JobSet controller's Warning events for a whole-gang restart (pkg/constants, applied by failurePolicyRecreateAll).
RESTART_EVENT_REASONS = ("RestartJobSetFailurePolicyAction", "RestartJobSetAndIgnoreMaxRestartsFailurePolicyAction")


def restart_cause(events: list[Any], name: str, uid: Optional[str]) -> Optional[str]:
    """The newest restart event's message on JobSet `name` (this incarnation), e.g. "applying RestartJobSet failure
    policy action (first failed job: <child Job>)"; None when there is none.

    Events outlive the JobSet's RestartingJobSet condition, which the controller clears once the new Jobs are ready
    (and which older JobSet versions never set), so a launcher whose polls straddle that window still learns why.
    """
    found = [
        e
        for e in events
        if _get(e, "reason") in RESTART_EVENT_REASONS
        and _get(e, "involvedObject", "kind") == "JobSet"
        and _get(e, "involvedObject", "name") == name
        and (not uid or _get(e, "involvedObject", "uid") in (None, "", uid))
    ]
    if not found:
        return None
    newest = max(
        found, key=lambda e: str(_get(e, "lastTimestamp") or _get(e, "eventTime") or _get(e, "firstTimestamp") or "")
    )
    return str(_get(newest, "message") or "") or None


@dataclass
class StuckTimers:
    """When each kind of problem was first seen, in admitted seconds; `bounds` maps kind -> seconds allowed."""

    bounds: dict[str, float]
    since: dict[str, float] = field(default_factory=dict)
    reported: set[str] = field(default_factory=set)

    def update(self, problems: list[Problem], admitted_seconds: float) -> tuple[list[Problem], Optional[Problem]]:
        """Record this poll's problems: (new ones to log, the one past its bound or None)."""
        seen = {p.kind for p in problems}
        for kind in list(self.since):
            if kind not in seen:
                del self.since[kind]
        new = []
        for p in problems:
            self.since.setdefault(p.kind, admitted_seconds)
            key = f"{p.kind}:{p.describe()}"
            if key not in self.reported:
                self.reported.add(key)
                new.append(p)
        for p in problems:
            if admitted_seconds - self.since[p.kind] >= self.bounds.get(p.kind, 0.0):
                return new, p
        return new, None

    def waited(self, kind: str, admitted_seconds: float) -> float:
        return admitted_seconds - self.since.get(kind, admitted_seconds)


def read_workload(workloads: list[dict[str, Any]], job: str, kind: str = "Job") -> tuple[str, Optional[str]]:
    """From the Kueue Workloads listed for the Job (or JobSet, `kind`) `job`: (why it is not admitted, or ""; why it was
    deactivated, or None).

    Kueue deactivates a Workload (`spec.active: false`) once it was requeued
    `waitForPodsReady.requeuingStrategy.backoffLimitCount` times; the Job then
    stays suspended for good.
    """
    for wl in workloads:
        owners = wl.get("metadata", {}).get("ownerReferences", [])
        if not any(o.get("kind") == kind and o.get("name") == job for o in owners):
            continue
        name = wl.get("metadata", {}).get("name")
        conds = {c.get("type"): c for c in wl.get("status", {}).get("conditions", [])}
        if wl.get("spec", {}).get("active") is False:
            why = conds.get("Evicted") or conds.get("DeactivationTarget") or conds.get("Requeued") or {}
            return "", (f"Kueue deactivated Workload {name} of {kind} {job} "
                        f"({why.get('reason', 'Deactivated')}: {why.get('message', 'spec.active is false')})")
        for ctype, status in (("Evicted", "True"), ("QuotaReserved", "False"), ("Admitted", "False")):
            c = conds.get(ctype)
            if c and c.get("status") == status:
                return f"Workload {name}: {ctype}={status} ({c.get('reason')}: {c.get('message')})", None
        return "", None
    return "", None
