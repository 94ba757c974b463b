"""The controllers of the emulated cluster, each one reconcile step over what the API holds.

They follow the rules of the real ones that the platform relies on:

- `GarbageCollector`: foreground deletion (dependents first, then the owner; a
  dependent Job in the foreground too) and background deletion of objects whose
  owner is gone (ownerReferences).
- `KueueController` (Kueue 0.x, batch/v1 Jobs and JobSets): a suspended Job or
  JobSet with the queue-name label gets a Workload (a JobSet ONE, with a podSet
  per replicatedJob of replicas x parallelism pods; its child Jobs carry no
  queue label and get none); it is admitted (QuotaReserved, Admitted, the Job or
  JobSet unsuspended) when the ClusterQueue's quota fits every pod; with
  `waitForPodsReady`, a gang whose pods are not all Ready within the timeout
  is evicted (reason PodsReadyTimeout: the Job suspended, its pods deleted)
  and requeued after `backoffBaseSeconds * 2^(n-1)` (at most
  `backoffMaxSeconds`); past `backoffLimitCount` requeues the Workload is
  deactivated (`spec.active: false`). `preempt` evicts with reason Preempted.
  An evicted Workload is readmitted only once its Job has no pod left running.
- `JobController` (batch/v1, Indexed): one pod per incomplete index (hostname
  `<job>-<index>`, subdomain from the template, completion-index annotation and
  label, `batch.kubernetes.io/job-tracking` finalizer until the pod is
  accounted), a replacement only once the failed pod is terminal
  (podReplacementPolicy Failed, the default with a podFailurePolicy), the
  podFailurePolicy rules in order on the pod's real exit code and its
  DisruptionTarget condition (FailJob, Ignore, Count; no rule: Count),
  backoffLimit, exponential pod backoff, activeDeadlineSeconds, suspension
  (pods deleted, not counted), and the 1.31+ terminal conditions: FailureTarget
  or SuccessCriteriaMet first, Failed or Complete once no pod is left running.
- `Scheduler`: binds a pod to a node that matches its nodeSelector and
  required node affinity and has room for its requests; otherwise the pod
  stays Pending with PodScheduled=False, reason Unschedulable, and a
  FailedScheduling Event, as kube-scheduler reports it.

The kubelet, which runs the bound pods as local processes, is
`tests.support.cluster.kubelet.Kubelet`; the JobSet controller is
`tests.support.cluster.jobset.JobSetController`.
"""

from __future__ import annotations

import random
import string
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Optional

from kubernetes.utils import parse_quantity

from tests.support.cluster.api import Api
from tests.support.cluster.server import FOREGROUND, rfc3339

COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
CONTROLLER_UID = "batch.kubernetes.io/controller-uid"
JOB_TRACKING = "batch.kubernetes.io/job-tracking"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
TERMINAL = ("Succeeded", "Failed")


def now_iso() -> str:
    return rfc3339(time.time())


def conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}


def is_true(obj: dict[str, Any], ctype: str) -> bool:
    return conditions(obj).get(ctype, {}).get("status") == "True"


def with_condition(
    obj: dict[str, Any], ctype: str, status: str, reason: str, message: str = ""
) -> list[dict[str, Any]]:
    """`obj`'s conditions with `ctype` set (its transition time kept when the status did not change)."""
    out, found = [], False
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c["type"] == ctype:
            found = True
            changed = c.get("status") != status
            c = {**c, "status": status, "reason": reason, "message": message}
            if changed:
                c["lastTransitionTime"] = now_iso()
        out.append(c)
    if not found:
        out.append(
            {"type": ctype, "status": status, "reason": reason, "message": message, "lastTransitionTime": now_iso()}
        )
    return out


def owned_by(obj: dict[str, Any], uid: str) -> bool:
    return any(o.get("uid") == uid for o in obj["metadata"].get("ownerReferences") or [])


def terminating(obj: dict[str, Any]) -> bool:
    return bool(obj["metadata"].get("deletionTimestamp"))


def pod_requests(template_spec: dict[str, Any]) -> dict[str, Decimal]:
    """Summed container requests of a pod spec (quantities as numbers)."""
    total: dict[str, Decimal] = {}
    for c in template_spec.get("containers") or []:
        for res, q in ((c.get("resources") or {}).get("requests") or {}).items():
            total[res] = total.get(res, Decimal(0)) + parse_quantity(q)
    return total


def exit_code(pod: dict[str, Any], container: Optional[str] = None) -> Optional[int]:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if container is None or cs["name"] == container:
            term = (cs.get("state") or {}).get("terminated")
            if term is not None:
                return int(term["exitCode"])
    return None


def suffix() -> str:
    return "".join(random.choices(string.ascii_lowercase + string.digits, k=5))


def record_event(api: Api, obj: dict[str, Any], kind: str, reason: str, message: str, component: str) -> None:
    """A Warning Event about `obj` (of `kind`), as a controller's event recorder writes it (in the object's
    namespace)."""
    meta = obj["metadata"]
    api.create("Event", {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": f"{meta['name']}.{suffix()}", "namespace": meta["namespace"]},
        "involvedObject": {"kind": kind, "name": meta["name"], "namespace": meta["namespace"], "uid": meta["uid"],
                           "apiVersion": obj.get("apiVersion", "v1")},
        "reason": reason, "message": message, "type": "Warning", "count": 1,
        "firstTimestamp": now_iso(), "lastTimestamp": now_iso(), "source": {"component": component},
    })


@dataclass
class Node:
    """An emulated node: its labels and what it can allocate (quantities as in a manifest)."""

    name: str
    allocatable: dict[str, str] = field(default_factory=lambda: {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "0"})
    labels: dict[str, str] = field(default_factory=dict)

    def all_labels(self) -> dict[str, str]:
        return {"kubernetes.io/hostname": self.name, "kubernetes.io/os": "linux", **self.labels}


@dataclass
class KueueSettings:
    """The ClusterQueue's quota, the LocalQueues feeding it, and `waitForPodsReady` (deploy/render.py's PODS_READY)."""

    quota: dict[str, str] = field(default_factory=lambda: {"cpu": "16", "memory": "64Gi", "nvidia.com/gpu": "0"})
    cluster_queue: str = "vision"
    local_queues: tuple[str, ...] = ("trainyard",)
    flavor: str = "default-flavor"
    pods_ready_timeout: Optional[float] = 600.0
    backoff_base_seconds: float = 60.0
    backoff_max_seconds: float = 1800.0
    backoff_limit_count: Optional[int] = 3


class GarbageCollector:
    """Foreground deletion and the removal of objects whose owner is gone."""

    def __init__(self, api: Api) -> None:
        self.api = api

    def step(self, dependents: list[dict[str, Any]], owners: list[dict[str, Any]]) -> None:
        """`dependents` were listed before `owners`, so an owner created in between is not missed."""
        uids = {o["metadata"]["uid"] for o in owners}
        for owner in owners:
            if terminating(owner) and FOREGROUND in (owner["metadata"].get("finalizers") or []):
                mine = [d for d in dependents if owned_by(d, owner["metadata"]["uid"])]
                for d in mine:
                    if not terminating(d):
                        # A dependent that owns objects itself (a JobSet's child Job) is deleted in the foreground too,
                        # so the owner stays until the whole tree is gone (the GC's blockOwnerDeletion chain).
                        self.api.delete(d, propagation="Foreground" if d.get("kind") == "Job" else "Background")
                if not mine:
                    rest = [f for f in owner["metadata"]["finalizers"] if f != FOREGROUND]
                    self.api.patch(owner, {"metadata": {"finalizers": rest}})
        for d in dependents:
            refs = d["metadata"].get("ownerReferences") or []
            if refs and not terminating(d) and not any(r.get("uid") in uids for r in refs):
                self.api.delete(d)


class KueueController:
    """One ClusterQueue's admission, `waitForPodsReady` eviction and requeueing, and `preempt`."""

    def __init__(self, api: Api, settings: KueueSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.api = api
        self.settings = settings
        self.clock = clock
        self.admitted_at: dict[str, float] = {}  # workload uid -> when admitted (clock)
        self.requeue_at: dict[str, float] = {}
        self.preempt_requests: set[tuple[str, str]] = set()  # (namespace, job name)
        self.evictions: list[tuple[str, str]] = []  # (workload name, reason), for tests

    def quota(self) -> dict[str, Decimal]:
        return {k: parse_quantity(v) for k, v in self.settings.quota.items()}

    @staticmethod
    def usage_of(wl: dict[str, Any]) -> dict[str, Decimal]:
        out: dict[str, Decimal] = {}
        for ps in wl["spec"]["podSets"]:
            for res, q in pod_requests(ps["template"]["spec"]).items():
                out[res] = out.get(res, Decimal(0)) + q * ps["count"]
        return out

    def used(self, workloads: list[dict[str, Any]]) -> dict[str, Decimal]:
        total: dict[str, Decimal] = {}
        for wl in workloads:
            if is_true(wl, "QuotaReserved") and not is_true(wl, "Finished"):
                for res, q in self.usage_of(wl).items():
                    total[res] = total.get(res, Decimal(0)) + q
        return total

    def step(self, jobs: list[dict[str, Any]], pods: list[dict[str, Any]], workloads: list[dict[str, Any]],
             jobsets: Optional[list[dict[str, Any]]] = None) -> None:
        """Workloads of queued Jobs and JobSets (a JobSet is ONE Workload, a podSet per replicatedJob; its child Jobs
        none)."""
        jobsets = jobsets or []
        owners = [*jobs, *jobsets]
        by_owner = {wl["metadata"]["labels"].get(JOB_UID_LABEL): wl for wl in workloads}
        for owner in owners:
            if (
                QUEUE_LABEL in owner["metadata"].get("labels", {})
                and owner["metadata"]["uid"] not in by_owner
                and not terminating(owner)
            ):
                wl = self._create_workload(owner)
                workloads.append(wl)
                by_owner[owner["metadata"]["uid"]] = wl
        owners_by_uid = {o["metadata"]["uid"]: o for o in owners}
        for wl in sorted(workloads, key=lambda w: w["metadata"]["creationTimestamp"]):
            found = owners_by_uid.get(wl["metadata"]["labels"].get(JOB_UID_LABEL))
            if found is None or terminating(found) or is_true(wl, "Finished"):
                continue
            owner = found
            finished = ("Completed", "Failed") if owner.get("kind") == "JobSet" else ("Complete", "Failed")
            if any(is_true(owner, t) for t in finished):
                self._finish(wl, owner)
                continue
            uids = {owner["metadata"]["uid"]} | {
                j["metadata"]["uid"] for j in jobs if owned_by(j, owner["metadata"]["uid"])
            }
            owner_pods = [p for p in pods if any(owned_by(p, u) for u in uids)]
            if is_true(wl, "QuotaReserved"):
                self._watch_admitted(wl, owner, owner_pods)
            elif wl["spec"].get("active", True):
                self._try_admit(wl, owner, owner_pods, workloads)

    @staticmethod
    def pod_sets(owner: dict[str, Any]) -> list[dict[str, Any]]:
        """Kueue's podSets: one (`main`) for a Job; one per replicatedJob of a JobSet, count replicas x parallelism."""
        spec = owner["spec"]
        if owner.get("kind") == "JobSet":
            return [
                {
                    "name": rj["name"],
                    "count": int(rj.get("replicas", 1)) * int(rj["template"]["spec"].get("parallelism", 1)),
                    "template": rj["template"]["spec"]["template"],
                }
                for rj in spec["replicatedJobs"]
            ]
        return [{"name": "main", "count": spec.get("parallelism", 1), "template": spec["template"]}]

    def _create_workload(self, owner: dict[str, Any]) -> dict[str, Any]:
        meta = owner["metadata"]
        kind = owner.get("kind", "Job")
        wl = {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "Workload",
            "metadata": {
                "name": f"{kind.lower()}-{meta['name']}-{suffix()}",
                "namespace": meta["namespace"],
                "labels": {JOB_UID_LABEL: meta["uid"]},
                "ownerReferences": [
                    {
                        "apiVersion": owner.get("apiVersion", "batch/v1"),
                        "kind": kind,
                        "name": meta["name"],
                        "uid": meta["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": {"active": True, "queueName": meta["labels"][QUEUE_LABEL], "podSets": self.pod_sets(owner)},
            "status": {"conditions": []},
        }
        return self.api.create("Workload", wl)

    def _try_admit(
        self, wl: dict[str, Any], job: dict[str, Any], job_pods: list[dict[str, Any]], workloads: list[dict[str, Any]]
    ) -> None:
        s = self.settings
        if wl["spec"]["queueName"] not in s.local_queues:
            self._set(
                wl, [("QuotaReserved", "False", "Inadmissible", f"LocalQueue {wl['spec']['queueName']} doesn't exist")]
            )
            return
        if any(p["status"].get("phase") not in TERMINAL for p in job_pods):
            return  # evicted: requeued once its pods are gone
        uid = wl["metadata"]["uid"]
        if self.clock() < self.requeue_at.get(uid, 0.0):
            return
        need, used, quota = self.usage_of(wl), self.used(workloads), self.quota()
        for res, q in sorted(need.items()):
            free = quota.get(res, Decimal(0)) - used.get(res, Decimal(0))
            if q > free:
                message = (
                    f"couldn't assign flavors to pod set {wl['spec']['podSets'][0]['name']}: insufficient unused "
                    f"quota for {res} in flavor "
                    f"{s.flavor}, {q - free} more needed"
                )
                self._set(wl, [("QuotaReserved", "False", "Pending", message)])
                return
        self.requeue_at.pop(uid, None)
        admission = {"clusterQueue": s.cluster_queue, "podSetAssignments": [
            {"name": ps["name"], "count": ps["count"], "flavors": {res: s.flavor for res in need},
             "resourceUsage": {res: str(q * ps["count"]) for res, q in pod_requests(ps["template"]["spec"]).items()}}
            for ps in wl["spec"]["podSets"]]}
        self._set(wl, [("QuotaReserved", "True", "QuotaReserved", f"Quota reserved in ClusterQueue {s.cluster_queue}"),
                       ("Admitted", "True", "Admitted", "The workload is admitted"),
                       ("Evicted", "False", "QuotaReserved", "Previously: evicted"),
                       ("PodsReady", "False", "PodsReady", "Not all pods are ready or succeeded")], admission=admission)
        self.admitted_at[uid] = self.clock()
        self.api.patch(job, {"spec": {"suspend": False}})

    def _watch_admitted(self, wl: dict[str, Any], job: dict[str, Any], job_pods: list[dict[str, Any]]) -> None:
        uid = wl["metadata"]["uid"]
        key = (job["metadata"]["namespace"], job["metadata"]["name"])
        if key in self.preempt_requests:
            self.preempt_requests.discard(key)
            for p in job_pods:
                if p["status"].get("phase") not in TERMINAL:
                    self.api.patch(
                        p,
                        {
                            "status": {
                                "conditions": with_condition(
                                    p,
                                    "DisruptionTarget",
                                    "True",
                                    "PreemptionByKueue",
                                    f"Kueue preempted Workload {wl['metadata']['name']} to accommodate a higher "
                                    "priority workload",
                                )
                            }
                        },
                    )
            self._evict(wl, job, "Preempted", "Preempted to accommodate a higher priority Workload", backoff=False)
            return
        parallelism = sum(int(ps["count"]) for ps in wl["spec"]["podSets"])
        ready = sum(1 for p in job_pods if not terminating(p) and (
            p["status"].get("phase") == "Succeeded" or (p["status"].get("phase") == "Running" and is_true(p, "Ready"))))
        if ready >= parallelism:
            if not is_true(wl, "PodsReady"):
                self._set(
                    wl, [("PodsReady", "True", "PodsReady", "All pods reached readiness and the workload is running")]
                )
            return
        timeout = self.settings.pods_ready_timeout
        if (
            timeout is not None
            and not is_true(wl, "PodsReady")
            and self.clock() - self.admitted_at.get(uid, self.clock()) > timeout
        ):
            ns, name = job["metadata"]["namespace"], wl["metadata"]["name"]
            self._evict(wl, job, "PodsReadyTimeout", f"Exceeded the PodsReady timeout {ns}/{name}", backoff=True)

    def _evict(self, wl: dict[str, Any], job: dict[str, Any], reason: str, message: str, backoff: bool) -> None:
        s = self.settings
        uid = wl["metadata"]["uid"]
        self.evictions.append((wl["metadata"]["name"], reason))
        self.admitted_at.pop(uid, None)
        updates = [
            ("Evicted", "True", reason, message),
            ("QuotaReserved", "False", "Pending", message),
            ("Admitted", "False", "NoReservation", "The workload has no reservation"),
            ("PodsReady", "False", reason, message),
        ]
        body: dict[str, Any] = {}
        if backoff:
            count = int((wl["status"].get("requeueState") or {}).get("count", 0)) + 1
            wait = min(s.backoff_base_seconds * 2 ** (count - 1), s.backoff_max_seconds)
            if s.backoff_limit_count is not None and count > s.backoff_limit_count:
                body["spec"] = {"active": False}
                updates.append(
                    (
                        "Requeued",
                        "False",
                        "InactiveWorkload",
                        "The workload is deactivated due to exceeding the maximum number of re-queuing retries "
                        f"({reason})",
                    )
                )
            else:
                self.requeue_at[uid] = self.clock() + wait
                updates.append(("Requeued", "False", reason, f"Requeued after {wait:g} s of backoff"))
            body["status"] = {"requeueState": {"count": count, "requeueAt": rfc3339(time.time() + wait)}}
        else:
            updates.append(("Requeued", "True", reason, message))
        self._set(wl, updates, **body)
        self.api.patch(job, {"spec": {"suspend": True}})

    def _finish(self, wl: dict[str, Any], job: dict[str, Any]) -> None:
        self.admitted_at.pop(wl["metadata"]["uid"], None)
        failed = is_true(job, "Failed")
        kind = job.get("kind", "Job")
        self._set(wl, [("Finished", "True", "Failed" if failed else "Succeeded",
                        f"{kind} failed" if failed else f"{kind} finished successfully")])

    def _set(
        self,
        wl: dict[str, Any],
        updates: list[tuple[str, str, str, str]],
        admission: Optional[dict[str, Any]] = None,
        **body: Any,
    ) -> None:
        conds = wl
        for ctype, value, reason, message in updates:
            conds = {"status": {"conditions": with_condition(conds, ctype, value, reason, message)}}
        status: dict[str, Any] = {"conditions": conds["status"]["conditions"], **(body.pop("status", {}))}
        if admission is not None:
            status["admission"] = admission
        self.api.patch(wl, {"status": status, **body})


class JobController:
    """batch/v1 Indexed Jobs: pods per index, podFailurePolicy, backoffLimit, suspension, deadlines."""

    def __init__(self, api: Api, pod_backoff_seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.api = api
        self.pod_backoff_seconds = pod_backoff_seconds
        self.clock = clock
        self.counted: set[str] = set()  # terminal pod uids accounted for
        self.stopped: set[str] = (
            set()
        )  # pods the controller deleted (suspension, finished Job): their failure is not counted
        self.failures: dict[str, int] = {}  # job uid -> counted failures
        self.ignored: dict[str, int] = {}  # job uid -> failures ignored by the podFailurePolicy
        self.last_failure: dict[str, float] = {}
        self.started: dict[str, float] = {}  # job uid -> when last unsuspended (clock)

    def step(self, jobs: list[dict[str, Any]], pods: list[dict[str, Any]]) -> None:
        for job in jobs:
            mine = [p for p in pods if owned_by(p, job["metadata"]["uid"])]
            self._reconcile(job, mine)
        uids = {j["metadata"]["uid"] for j in jobs}
        for p in pods:  # the tracking finalizer of pods whose Job is gone: nothing is left to account them to
            if (
                p["metadata"].get("labels", {}).get(CONTROLLER_UID) not in uids
                and (p["status"].get("phase") in TERMINAL or terminating(p))
                and JOB_TRACKING in (p["metadata"].get("finalizers") or [])
            ):
                self.api.patch(
                    p, {"metadata": {"finalizers": [f for f in p["metadata"]["finalizers"] if f != JOB_TRACKING]}}
                )

    def _reconcile(self, job: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        uid = job["metadata"]["uid"]
        spec = job["spec"]
        conds = conditions(job)
        done = any(conds.get(t, {}).get("status") == "True" for t in ("Complete", "Failed"))
        target = next(
            (t for t in ("FailureTarget", "SuccessCriteriaMet") if conds.get(t, {}).get("status") == "True"), None
        )
        live = [p for p in pods if p["status"].get("phase") not in TERMINAL]
        completed = {
            int(p["metadata"]["annotations"][COMPLETION_INDEX]) for p in pods if p["status"].get("phase") == "Succeeded"
        }
        verdict: Optional[tuple[str, str, str]] = None
        for p in pods:
            if p["status"].get("phase") in TERMINAL and p["metadata"]["uid"] not in self.counted:
                if (
                    p["status"]["phase"] == "Failed"
                    and p["metadata"]["uid"] not in self.stopped
                    and not (done or target)
                ):
                    verdict = verdict or self._account_failure(job, p)
                self.counted.add(p["metadata"]["uid"])
            if p["status"].get("phase") in TERMINAL and JOB_TRACKING in (p["metadata"].get("finalizers") or []):
                self.api.patch(
                    p, {"metadata": {"finalizers": [f for f in p["metadata"]["finalizers"] if f != JOB_TRACKING]}}
                )
        status: dict[str, Any] = {
            "active": len([p for p in live if not terminating(p)]),
            "ready": sum(1 for p in live if is_true(p, "Ready")),
            "failed": self.failures.get(uid, 0) + self.ignored.get(uid, 0),
            "succeeded": len(completed),
            "completedIndexes": ",".join(str(i) for i in sorted(completed)),
        }
        if done or terminating(job):
            self._stop(live)
            return
        if target is None and verdict is None:
            if len(completed) >= spec.get("completions", 1):
                verdict = ("SuccessCriteriaMet", "CompletionsReached", "Reached expected number of succeeded pods")
            elif spec.get("suspend"):
                self.started.pop(uid, None)
                self._stop(live)
                if not is_true(job, "Suspended"):
                    self.api.patch(job, {"status": {**status, "startTime": None, "conditions": with_condition(
                        job, "Suspended", "True", "JobSuspended", "Job suspended")}})
                return
            else:
                if uid not in self.started:
                    self.started[uid] = self.clock()
                    status["startTime"] = now_iso()
                    if "Suspended" in conds:
                        status["conditions"] = with_condition(job, "Suspended", "False", "JobResumed", "Job resumed")
                deadline = spec.get("activeDeadlineSeconds")
                if deadline is not None and self.clock() - self.started[uid] > deadline:
                    verdict = ("FailureTarget", "DeadlineExceeded", "Job was active longer than specified deadline")
        if verdict is not None:
            target = verdict[0]
            status["conditions"] = with_condition(job, verdict[0], "True", verdict[1], verdict[2])
            job.setdefault("status", {})["conditions"] = status["conditions"]
        if target is not None:
            self._stop(live)
            if not live:
                final = "Complete" if target == "SuccessCriteriaMet" else "Failed"
                t = conditions(job)[target]
                status["conditions"] = with_condition(job, final, "True", t["reason"], t["message"])
                if final == "Complete":
                    status["completionTime"] = now_iso()
            self._write_status(job, status)
            return
        self._create_missing(job, pods, completed)
        self._write_status(job, status)

    def _write_status(self, job: dict[str, Any], status: dict[str, Any]) -> None:
        """PATCH the Job's status when it changed (every reconcile would otherwise write it)."""
        current = job.get("status") or {}
        if any(current.get(k) != v for k, v in status.items()):
            self.api.patch(job, {"status": status})

    def _account_failure(self, job: dict[str, Any], pod: dict[str, Any]) -> Optional[tuple[str, str, str]]:
        """Apply the podFailurePolicy to one failed pod; a terminal verdict for the Job, or None."""
        uid = job["metadata"]["uid"]
        rules = (job["spec"].get("podFailurePolicy") or {}).get("rules") or []
        action, index = "Count", -1
        for i, rule in enumerate(rules):
            if self._matches(rule, pod):
                action, index = rule["action"], i
                break
        self.last_failure[uid] = self.clock()
        name = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
        if action == "FailJob":
            code = exit_code(pod)
            what = (
                (
                    "Container "
                    f"{rules[index]['onExitCodes'].get('containerName') or pod['spec']['containers'][0]['name']} for "
                    "pod "
                    f"{name} failed with exit code {code} matching FailJob rule at index {index}"
                )
                if "onExitCodes" in rules[index]
                else f"Pod {name} has condition DisruptionTarget matching FailJob rule at index {index}"
            )
            return ("FailureTarget", "PodFailurePolicy", what)
        if action == "Ignore":
            self.ignored[uid] = self.ignored.get(uid, 0) + 1
            return None
        self.failures[uid] = self.failures.get(uid, 0) + 1
        if self.failures[uid] > job["spec"].get("backoffLimit", 6):
            return ("FailureTarget", "BackoffLimitExceeded", "Job has reached the specified backoff limit")
        return None

    @staticmethod
    def _matches(rule: dict[str, Any], pod: dict[str, Any]) -> bool:
        if "onPodConditions" in rule:
            conds = conditions(pod)
            return any(
                conds.get(c["type"], {}).get("status") == c.get("status", "True") for c in rule["onPodConditions"]
            )
        req = rule.get("onExitCodes") or {}
        for cs in pod["status"].get("containerStatuses") or []:
            if req.get("containerName") not in (None, cs["name"]):
                continue
            term = (cs.get("state") or {}).get("terminated")
            if term is None:
                continue
            code = int(term["exitCode"])
            hit = code in req["values"] if req["operator"] == "In" else (code != 0 and code not in req["values"])
            if hit:
                return True
        return False

    def _stop(self, live: list[dict[str, Any]]) -> None:
        for p in live:
            self.stopped.add(p["metadata"]["uid"])
            if not terminating(p):
                self.api.delete(p)

    def _create_missing(self, job: dict[str, Any], pods: list[dict[str, Any]], completed: set[int]) -> None:
        uid = job["metadata"]["uid"]
        failures = self.failures.get(uid, 0) + self.ignored.get(uid, 0)
        if failures and self.clock() < self.last_failure.get(uid, 0.0) + self.pod_backoff_seconds * 2 ** (
            self.failures.get(uid, 1) - 1
        ):
            return
        busy = {
            int(p["metadata"]["annotations"][COMPLETION_INDEX])
            for p in pods
            if p["status"].get("phase") not in TERMINAL
        }
        for index in range(job["spec"].get("completions", 1)):
            if index not in completed and index not in busy:
                self.api.create("Pod", self._pod(job, index))

    def _pod(self, job: dict[str, Any], index: int) -> dict[str, Any]:
        meta, template = job["metadata"], job["spec"]["template"]
        name = meta["name"]
        labels = {**(template.get("metadata") or {}).get("labels", {}), JOB_NAME_LABEL: name, "job-name": name,
                  CONTROLLER_UID: meta["uid"], "controller-uid": meta["uid"], COMPLETION_INDEX: str(index)}
        annotations = {**(template.get("metadata") or {}).get("annotations", {}), COMPLETION_INDEX: str(index)}
        spec = {**template["spec"], "hostname": f"{name}-{index}"}
        spec["containers"] = [
            {
                **c,
                "env": [
                    *(c.get("env") or []),
                    *(
                        []
                        if any(e["name"] == "JOB_COMPLETION_INDEX" for e in c.get("env") or [])
                        else [{"name": "JOB_COMPLETION_INDEX", "value": str(index)}]
                    ),
                ],
            }
            for c in spec["containers"]
        ]
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{name}-{index}-{suffix()}",
                "namespace": meta["namespace"],
                "labels": labels,
                "annotations": annotations,
                "finalizers": [JOB_TRACKING],
                "ownerReferences": [
                    {
                        "apiVersion": "batch/v1",
                        "kind": "Job",
                        "name": name,
                        "uid": meta["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": spec,
            "status": {"phase": "Pending", "conditions": []},
        }


class Scheduler:
    """Binds pending pods to nodes with room, or reports them Unschedulable."""

    def __init__(self, api: Api, nodes: list[Node]) -> None:
        self.api = api
        self.nodes = nodes
        self.reported: set[str] = set()

    def step(self, pods: list[dict[str, Any]]) -> None:
        nodes = list(self.nodes)  # a test may take a node away (or give it back) meanwhile
        for pod in pods:
            if pod["spec"].get("nodeName") or terminating(pod) or pod["status"].get("phase") != "Pending":
                continue
            node, why = self._fit(pod, pods, nodes)
            if node is not None:
                self.api.patch(pod, {"spec": {"nodeName": node.name}, "status": {
                    "conditions": with_condition(pod, "PodScheduled", "True", "", "")}})
                continue
            message = f"0/{len(nodes)} nodes are available: {why}. preemption: 0/{len(nodes)} nodes are available: " \
                      f"{len(nodes)} Preemption is not helpful for scheduling."
            if pod["metadata"]["uid"] not in self.reported:
                self.reported.add(pod["metadata"]["uid"])
                self.api.patch(
                    pod,
                    {"status": {"conditions": with_condition(pod, "PodScheduled", "False", "Unschedulable", message)}},
                )
                record_event(self.api, pod, "Pod", "FailedScheduling", message, "default-scheduler")

    def _fit(self, pod: dict[str, Any], pods: list[dict[str, Any]], nodes: list[Node]) -> tuple[Optional[Node], str]:
        need = pod_requests(pod["spec"])
        reasons: dict[str, int] = {}
        for node in nodes:
            why = self._node_misfit(pod, node, need, pods)
            if why is None:
                return node, ""
            reasons[why] = reasons.get(why, 0) + 1
        return None, ", ".join(f"{n} {why}" for why, n in sorted(reasons.items()))

    def _node_misfit(
        self, pod: dict[str, Any], node: Node, need: dict[str, Decimal], pods: list[dict[str, Any]]
    ) -> Optional[str]:
        labels = node.all_labels()
        selector = pod["spec"].get("nodeSelector") or {}
        terms = (((pod["spec"].get("affinity") or {}).get("nodeAffinity") or {})
                 .get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms")
        if any(labels.get(k) != v for k, v in selector.items()) or (
            terms and not any(self._term(t, labels) for t in terms)
        ):
            return "node(s) didn't match Pod's node affinity/selector"
        used: dict[str, Decimal] = {}
        for other in pods:
            if other["spec"].get("nodeName") == node.name and other["status"].get("phase") not in TERMINAL:
                for res, q in pod_requests(other["spec"]).items():
                    used[res] = used.get(res, Decimal(0)) + q
        for res, q in sorted(need.items()):
            if q > parse_quantity(node.allocatable.get(res, "0")) - used.get(res, Decimal(0)):
                return f"Insufficient {res}"
        return None

    @staticmethod
    def _term(term: dict[str, Any], labels: dict[str, str]) -> bool:
        for e in term.get("matchExpressions") or []:
            value, op = labels.get(e["key"]), e["operator"]
            ok = {"In": value in (e.get("values") or []), "NotIn": value not in (e.get("values") or []),
                  "Exists": value is not None, "DoesNotExist": value is None}.get(op, False)
            if not ok:
                return False
        return True
