"""What a supervised gang's state means to the user: why it waits in the queue, which pods are stuck and why,
and the Kubernetes events behind it (`GangReports`, a base of `resources.k8s.supervisor.JobSupervisor`)."""

from __future__ import annotations

import logging
from typing import Any, Optional

from kubernetes.client.exceptions import ApiException

from resources.k8s.errors import StuckGang
from resources.k8s.kinds import GangView
from resources.k8s.names import (
    KUEUE_GROUP,
    LABEL_TRIAL,
)
from resources.k8s.pods import PodView
from resources.k8s.stuck import HINTS, event_problems, pod_problems, read_workload
from resources.k8s.watch import Watch as _Watch
from resources.launcher import (
    LaunchError,
)
from training.spec import TrainSpec

logger = logging.getLogger("trainyard.k8s")


class GangReports:
    """The supervisor's reports on its gang: `JobSupervisor` supplies the API calls and the watch state."""

    # What `JobSupervisor` sets and provides (declared for the type checker).
    core: Any
    custom: Any
    namespace: str
    kueue_version: str
    stuck_seconds: float
    unschedulable_seconds: float
    _events_forbidden: bool
    _api: Any

    def _explain_queue(self, gang: GangView, name: str, w: _Watch, log: Any) -> None:
        """Log why Kueue has not admitted the gang yet, from its Workload (when readable)."""
        if w.workloads_forbidden:
            return
        uid = gang.uid
        try:
            found = self._api(
                f"list Kueue Workloads for {w.kind} {name}", self.custom.list_namespaced_custom_object,
                KUEUE_GROUP, self.kueue_version, self.namespace, "workloads",
                label_selector=f"{KUEUE_GROUP}/job-uid={uid}" if uid else None, expect=(403, 404),
            )
        except ApiException as e:
            if e.status == 403:
                w.workloads_forbidden = True
            return  # 404: no Kueue, or no Workload yet
        except LaunchError:
            return  # explanatory only; the watch goes on
        note, deactivated = read_workload(found.get("items", []), name, kind=w.kind)
        if deactivated is not None:
            raise StuckGang(
                f"trial {gang.labels.get(LABEL_TRIAL, name)}: {deactivated}; it is never admitted again: its pods did "
                "not all "
                f"become Ready within waitForPodsReady's timeout on any of its admissions (see the log above for why). "
                f"Deleted the {w.kind}.",
                kind="deactivated",
            )
        if note and note != w.workload_note:
            log.info(note)
        w.workload_note = note or w.workload_note

    def _report_pods(self, spec: TrainSpec, pods: list[PodView], w: _Watch, log: Any, now: float) -> None:
        for p in pods:
            if p.disrupted:
                key, level = "disrupted", log.warning
                text = (
                    f"{p.describe()}; disruption, not a failure: "
                    + (
                        "the Job fails and the run retries the trial"
                        if w.kind == "Job"
                        else "the JobSet restarts or resumes the gang"
                    )
                    + " from its checkpoint"
                )
            elif p.phase == "Failed":
                key, level = "failed", log.warning
                w.blame(p)
                text = (f"{p.describe()}; the Job fails (backoffLimit 0): the run retries the trial within its budget "
                        "unless the exit code is a user or config error" if w.kind == "Job" else
                        f"{p.describe()}; the JobSet restarts the whole gang within its failurePolicy.maxRestarts "
                        "unless the exit code is a user or config error")
            elif p.waiting_reason and not pod_problems([p]):  # problems are `_check_stuck`'s to report
                key, level = f"waiting:{p.waiting_reason}", log.warning
                text = p.describe()
            else:
                key, level, text = p.phase, log.info, ""
            if w.reported.get(p.name) != key:
                w.reported[p.name] = key
                if text:
                    level(f"trial {spec.trial_id}: {text}")

    def _bounds(self) -> dict[str, float]:
        return {
            "config": 0.0,
            "image": self.stuck_seconds,
            "crashloop": self.stuck_seconds,
            "create": self.stuck_seconds,
            "unschedulable": self.unschedulable_seconds,
        }

    def _check_stuck(self, spec: TrainSpec, gang: GangView, pods: list[PodView], w: _Watch, log: Any) -> None:
        """Log what keeps admitted pods from starting; past its bound, fail (the caller deletes the gang)."""
        problems = pod_problems(pods)
        live = [p for p in pods if p.phase in ("Pending", "Running")]
        if len(live) < gang.pods_wanted:
            problems += self._create_problems(gang)
        w.timers.bounds = self._bounds()
        new, expired = w.timers.update(problems, w.running_seconds)
        for p in new:
            bound = w.timers.bounds[p.kind]
            when = "failing the trial" if bound <= 0 else f"the trial fails if this lasts {bound:.0f} s"
            log.warning(f"trial {spec.trial_id}: {p.describe()} ({p.kind}; {when}; {HINTS[p.kind]})")
        if expired is not None:
            waited = w.timers.waited(expired.kind, w.running_seconds)
            raise StuckGang(
                f"trial {spec.trial_id}: {expired.describe()}; {expired.kind} for {waited:.0f} s of admitted time "
                f"(bound {w.timers.bounds[expired.kind]:.0f} s): {HINTS[expired.kind]}. Deleted the gang, so it holds "
                "no quota.",
                kind=expired.kind,
            )

    def _create_problems(self, gang: GangView) -> list[Any]:
        """FailedCreate events of the Job (of a JobSet: of its child Jobs, where the Job controller records them); []
        when unreadable."""
        out: list[Any] = []
        for name in gang.children:
            events = self._events("Job", name)
            if events is None:
                return []
            out += event_problems(events, "Job", name, gang.uid if gang.kind == "Job" else None)
        return out

    def _events(self, kind: str, name: str) -> Optional[list[Any]]:
        """The namespace's events about `kind` `name`; None when they cannot be read (forbidden: not asked again)."""
        if self._events_forbidden:
            return None
        try:
            events = self._api(
                f"list events of {kind} {name}", self.core.list_namespaced_event, self.namespace,
                field_selector=f"involvedObject.kind={kind},involvedObject.name={name}", expect=(403, 404),
            )
        except ApiException as e:
            self._events_forbidden = e.status == 403
            return None
        except LaunchError:
            return None
        return list(events.items or [])


def _true(cond: Any) -> bool:
    return cond is not None and cond.status == "True"
