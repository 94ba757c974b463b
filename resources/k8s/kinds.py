"""The two gang kinds the supervisor drives, read into one view: an Indexed Job (+ its Service) or a JobSet.

`GangView` is what a watch needs of either object: its labels and uid, whether
Kueue holds it suspended, its terminal condition, how many pods it wants, and
for a JobSet its whole-gang restarts (`status.restarts`) and child Jobs
(`<jobset>-<replicatedJob>-<index>`, where the Job controller records
FailedCreate events and failure reasons). `GangApi` reads, creates, lists and
deletes either kind through the `kubernetes.client` APIs (a JobSet through
`CustomObjectsApi`, as plain dicts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from kubernetes.client import V1DeleteOptions

from resources.k8s.names import JOBSET_API, JOBSET_REPLICATED_JOB

GANG_KINDS = ("job", "jobset")
JOBSET_GROUP, JOBSET_VERSION = JOBSET_API.split("/")
JOBSET_PLURAL = "jobsets"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
JOBSET_RESTART_LABEL = "jobset.sigs.k8s.io/restart-attempt"


@dataclass(frozen=True)
class Condition:
    type: str
    status: str
    reason: str = ""
    message: str = ""


@dataclass
class GangView:
    """One Job or JobSet as the supervisor reads it."""

    kind: str  # "Job" or "JobSet"
    name: str
    uid: Optional[str]
    labels: dict[str, str]
    suspended: bool
    conditions: dict[str, Condition] = field(default_factory=dict)
    pods_wanted: int = 1
    restarts: int = 0
    max_restarts: int = 0
    children: tuple[str, ...] = ()
    owned_by_jobset: bool = False

    def _true(self, *types: str) -> Optional[Condition]:
        for t in types:
            c = self.conditions.get(t)
            if c is not None and c.status == "True":
                return c
        return None

    @property
    def complete(self) -> Optional[Condition]:
        return self._true("Complete", "Completed")

    @property
    def failed(self) -> Optional[Condition]:
        return self._true("Failed")

    @property
    def finished(self) -> bool:
        return self.complete is not None or self.failed is not None

    @property
    def restarting(self) -> Optional[Condition]:
        return self._true("RestartingJobSet")


def job_view(job: Any) -> GangView:
    """A `V1Job` (the client's model) as a gang."""
    meta, spec, status = job.metadata, job.spec, job.status
    conds = (
        {c.type: Condition(c.type, c.status, c.reason or "", c.message or "") for c in (status.conditions or [])}
        if status
        else {}
    )
    owners = meta.owner_references or []
    return GangView(
        kind="Job", name=meta.name, uid=meta.uid, labels=dict(meta.labels or {}), suspended=bool(spec and spec.suspend),
        conditions=conds, pods_wanted=int((spec.parallelism if spec else None) or 1), children=(meta.name,),
        owned_by_jobset=any(o.kind == "JobSet" for o in owners),
    )


def jobset_view(js: dict[str, Any]) -> GangView:
    """A JobSet (a dict from `CustomObjectsApi`) as a gang."""
    meta, spec, status = js.get("metadata") or {}, js.get("spec") or {}, js.get("status") or {}
    conds = {c["type"]: Condition(c["type"], c.get("status", ""), c.get("reason") or "", c.get("message") or "")
             for c in status.get("conditions") or []}
    rjobs = spec.get("replicatedJobs") or []
    wanted = sum(
        int(rj.get("replicas", 1)) * int(((rj.get("template") or {}).get("spec") or {}).get("parallelism", 1))
        for rj in rjobs
    )
    children = tuple(f"{meta.get('name')}-{rj['name']}-{i}" for rj in rjobs for i in range(int(rj.get("replicas", 1))))
    return GangView(
        kind="JobSet",
        name=meta.get("name", ""),
        uid=meta.get("uid"),
        labels=dict(meta.get("labels") or {}),
        suspended=bool(spec.get("suspend")),
        conditions=conds,
        pods_wanted=wanted or 1,
        restarts=int(status.get("restarts") or 0),
        max_restarts=int((spec.get("failurePolicy") or {}).get("maxRestarts", 0)),
        children=children or (f"{meta.get('name')}-{JOBSET_REPLICATED_JOB}-0",),
    )


def kind_of(kind: str) -> str:
    """'job' -> 'Job', 'jobset' -> 'JobSet' (the object's kind for a gang kind setting)."""
    return {"job": "Job", "jobset": "JobSet"}[kind]


class GangApi:
    """Create, read, list and delete Jobs and JobSets of one namespace; `call` is the supervisor's retrying API call."""

    def __init__(self, batch: Any, custom: Any, namespace: str, call: Any) -> None:
        self.batch = batch
        self.custom = custom
        self.namespace = namespace
        self.call = call

    def create(self, kind: str, obj: dict[str, Any], **kw: Any) -> GangView:
        name = obj["metadata"]["name"]
        if kind == "Job":
            return job_view(
                self.call(f"create Job {name}", self.batch.create_namespaced_job, self.namespace, obj, **kw)
            )
        created = self.call(f"create JobSet {name}", self.custom.create_namespaced_custom_object, JOBSET_GROUP,
                            JOBSET_VERSION, self.namespace, JOBSET_PLURAL, obj, **kw)
        if not isinstance(created, dict) or not created.get("metadata"):
            # An API server answers with the created object; one that did not (an empty body): read it back.
            created = self.call(f"read JobSet {name}", self.custom.get_namespaced_custom_object, JOBSET_GROUP,
                                JOBSET_VERSION, self.namespace, JOBSET_PLURAL, name)
        return jobset_view(created)

    def get(self, kind: str, name: str, **kw: Any) -> Any:
        """The view, or raises what `call` raises (an expected 404 as `ApiException`)."""
        if kind == "Job":
            return job_view(self.call(f"read Job {name}", self.batch.read_namespaced_job, name, self.namespace, **kw))
        return jobset_view(self.call(f"read JobSet {name}", self.custom.get_namespaced_custom_object, JOBSET_GROUP,
                                     JOBSET_VERSION, self.namespace, JOBSET_PLURAL, name, **kw))

    def list(self, kind: str, selector: str, **kw: Any) -> list[GangView]:
        if kind == "Job":
            jobs = self.call("list Jobs", self.batch.list_namespaced_job, self.namespace, label_selector=selector, **kw)
            return [job_view(j) for j in jobs.items]
        found = self.call("list JobSets", self.custom.list_namespaced_custom_object, JOBSET_GROUP, JOBSET_VERSION,
                          self.namespace, JOBSET_PLURAL, label_selector=selector, **kw)
        return [jobset_view(js) for js in found.get("items", [])]

    def delete(self, kind: str, name: str, **kw: Any) -> None:
        """Foreground: the gang object stays until its pods are gone, so the name cannot be reused while they write."""
        body = V1DeleteOptions(propagation_policy="Foreground")
        if kind == "Job":
            self.call(f"delete Job {name}", self.batch.delete_namespaced_job, name, self.namespace, body=body, **kw)
        else:
            self.call(
                f"delete JobSet {name}",
                self.custom.delete_namespaced_custom_object,
                JOBSET_GROUP,
                JOBSET_VERSION,
                self.namespace,
                JOBSET_PLURAL,
                name,
                body=body,
                **kw,
            )
