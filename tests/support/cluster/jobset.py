"""The JobSet controller of the emulated cluster (jobset.x-k8s.io/v1alpha2), one reconcile step over the API.

It follows `pkg/controllers/jobset_controller.go` and `failure_policy.go` of
kubernetes-sigs/jobset (the Recreate restart strategy, without startupPolicy,
dependsOn, coordinator, exclusive placement, TTL or in-place restarts):

- child Jobs `<jobset>-<replicatedJob>-<jobIndex>`, one per replica, with the
  replicatedJob's template, the JobSet's labels and annotations on the Job and
  its pod template (jobset-name, jobset-uid, replicatedjob-name,
  replicatedjob-replicas, job-index, job-key, restart-attempt, ...), a
  controller ownerReference to the JobSet, `spec.suspend` from the JobSet's,
  and the pod template's `subdomain` when `network.enableDNSHostnames`;
- the headless Service named after the subdomain (selector jobset-name,
  `publishNotReadyAddresses` from the network, default true), owned by the JobSet;
- a child Job whose restart-attempt label is below `status.restarts` is a
  previous one: deleted (foreground) and, once gone, created again;
- a failed child Job: the failurePolicy's first rule (in order) matching a failed
  Job's `Failed` condition reason (`onJobFailureReasons`) and replicatedJob
  (`targetReplicatedJobs`), the earliest failed Job first; its action
  FailJobSet, RestartJobSet (within `maxRestarts`, counted in
  `restartsCountTowardsMax`, else Failed with ReachedMaxRestarts) or
  RestartJobSetAndIgnoreMaxRestarts; no rule: RestartJobSet; no failurePolicy:
  Failed (FailedJobs). A restart adds 1 to `status.restarts` and records a Warning
  Event on the JobSet (reason the action's, message naming the first failed Job);
- successPolicy (All or Any, `targetReplicatedJobs`): Completed (AllJobsCompleted);
- a finished JobSet deletes its active child Jobs; a suspended one suspends its
  active child Jobs (the Job controller deletes their pods), a resumed one
  resumes them; conditions Suspended, RestartingJobSet, Completed, Failed and
  `status.terminalState`, `status.replicatedJobsStatus`.
"""

from __future__ import annotations

import copy
import hashlib
import re
from typing import Any, Optional

from tests.support.cluster.api import Api
from tests.support.cluster.controllers import conditions, is_true, owned_by, record_event, terminating, with_condition

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
JOBSET_UID = "jobset.sigs.k8s.io/jobset-uid"
REPLICATED_JOB = "jobset.sigs.k8s.io/replicatedjob-name"
REPLICATED_JOB_REPLICAS = "jobset.sigs.k8s.io/replicatedjob-replicas"
GLOBAL_REPLICAS = "jobset.sigs.k8s.io/global-replicas"
JOB_INDEX = "jobset.sigs.k8s.io/job-index"
JOB_GLOBAL_INDEX = "jobset.sigs.k8s.io/job-global-index"
JOB_KEY = "jobset.sigs.k8s.io/job-key"
RESTART_ATTEMPT = "jobset.sigs.k8s.io/restart-attempt"

# pkg/constants/constants.go
REACHED_MAX_RESTARTS = ("ReachedMaxRestarts", "jobset failed due to reaching max number of restarts")
FAILED_JOBS = ("FailedJobs", "jobset failed due to one or more job failures")
ALL_JOBS_COMPLETED = ("AllJobsCompleted", "jobset completed successfully")
FAIL_JOBSET_ACTION = ("FailJobSetFailurePolicyAction", "applying FailJobSet failure policy action")
RESTART_JOBSET_ACTION = ("RestartJobSetFailurePolicyAction", "applying RestartJobSet failure policy action")
RESTART_IGNORE_MAX_ACTION = ("RestartJobSetAndIgnoreMaxRestartsFailurePolicyAction",
                             "applying RestartJobSetAndIgnoreMaxRestarts failure policy action")


def job_finished(job: dict[str, Any]) -> Optional[str]:
    """"Complete" or "Failed" when the child Job has that condition True, else None."""
    for ctype in ("Complete", "Failed"):
        if is_true(job, ctype):
            return ctype
    return None


def jobset_finished(js: dict[str, Any]) -> bool:
    return is_true(js, "Completed") or is_true(js, "Failed")


def child_job_name(jobset: str, replicated_job: str, index: int) -> str:
    return f"{jobset}-{replicated_job}-{index}"


def subdomain(js: dict[str, Any]) -> str:
    return ((js["spec"].get("network") or {}).get("subdomain")) or js["metadata"]["name"]


class JobSetController:
    """Reconciles every JobSet: child Jobs, the headless Service, failure and success policies, suspension."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self.restarts: list[tuple[str, str]] = []  # (jobset, the failed child Job that caused a restart), for tests

    def step(self, jobsets: list[dict[str, Any]], jobs: list[dict[str, Any]], services: list[dict[str, Any]]) -> None:
        for js in jobsets:
            if terminating(js):
                continue  # the garbage collector deletes its child Jobs (foreground) and Service
            mine = [j for j in jobs if owned_by(j, js["metadata"]["uid"])]
            self._reconcile(js, mine, services)

    def _reconcile(self, js: dict[str, Any], jobs: list[dict[str, Any]], services: list[dict[str, Any]]) -> None:
        status = copy.deepcopy(js.get("status") or {})
        status.setdefault("restarts", 0)
        status.setdefault("restartsCountTowardsMax", 0)
        restarts = int(status["restarts"])
        previous, active, failed, successful = [], [], [], []
        for j in jobs:
            if int(j["metadata"].get("labels", {}).get(RESTART_ATTEMPT, "0")) < restarts:
                previous.append(j)
            elif job_finished(j) == "Failed":
                failed.append(j)
            elif job_finished(j) == "Complete":
                successful.append(j)
            else:
                active.append(j)
        current = [*active, *failed, *successful]
        status["replicatedJobsStatus"] = [self._rjob_status(rj["name"], current) for rj in js["spec"]["replicatedJobs"]]
        if jobset_finished(js):
            self._delete_jobs(active)
            self._write(js, status)
            return
        self._delete_jobs(previous)
        if (
            not js["spec"].get("suspend")
            and self._all_ready(js, status["replicatedJobsStatus"])
            and "RestartingJobSet" in conditions(js)
        ):
            self._condition(js, status, "RestartingJobSet", "False", "JobsReady", "all jobs are ready")
        if failed:
            self._failure_policy(js, status, failed)
            self._write(js, status)
            return
        if successful and self._succeeded(js, successful):
            self._condition(js, status, "Completed", "True", *ALL_JOBS_COMPLETED)
            self._condition(js, status, "RestartingJobSet", "False", "JobSetCompleted", ALL_JOBS_COMPLETED[1])
            status["terminalState"] = "Completed"
            self._write(js, status)
            return
        self._headless_service(js, services)
        names = {j["metadata"]["name"] for j in [*current, *previous]}
        for rj in js["spec"]["replicatedJobs"]:
            for index in range(int(rj.get("replicas", 1))):
                if child_job_name(js["metadata"]["name"], rj["name"], index) not in names:
                    self.api.create("Job", self._construct_job(js, rj, index, restarts))
        if js["spec"].get("suspend"):
            for j in active:
                if not j["spec"].get("suspend"):
                    self.api.patch(j, {"spec": {"suspend": True}})
            self._condition(js, status, "Suspended", "True", "SuspendedJobs", "jobset is suspended")
            if "RestartingJobSet" in conditions(js):
                self._condition(js, status, "RestartingJobSet", "False", "JobSetSuspended", "jobset is suspended")
        else:
            for j in active:
                if j["spec"].get("suspend"):
                    self.api.patch(j, {"spec": {"suspend": False}})
            if "Suspended" in conditions(js):
                self._condition(js, status, "Suspended", "False", "ResumeJobs", "jobset is resumed")
        self._write(js, status)

    # -- policies --------------------------------------------------------------------

    def _failure_policy(self, js: dict[str, Any], status: dict[str, Any], failed: list[dict[str, Any]]) -> None:
        policy = js["spec"].get("failurePolicy")
        first = min(failed, key=_failure_time)
        if policy is None:
            self._fail(js, status, FAILED_JOBS[0], _with_job(FAILED_JOBS[1], first))
            return
        rule, job = None, first
        for r in policy.get("rules") or []:
            matching = [j for j in failed if _rule_applies(r, j)]
            if matching:
                rule, job = r, min(matching, key=_failure_time)
                break
        action = rule["action"] if rule is not None else "RestartJobSet"
        if action == "FailJobSet":
            self._fail(js, status, FAIL_JOBSET_ACTION[0], _with_job(FAIL_JOBSET_ACTION[1], job))
            return
        if action == "RestartJobSet" and int(status["restartsCountTowardsMax"]) >= int(policy.get("maxRestarts", 0)):
            self._fail(js, status, REACHED_MAX_RESTARTS[0], _with_job(REACHED_MAX_RESTARTS[1], job))
            return
        if action not in ("RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts"):
            raise NotImplementedError(f"failurePolicy action {action!r} is not emulated")
        status["restarts"] = int(status["restarts"]) + 1
        if action == "RestartJobSet":
            status["restartsCountTowardsMax"] = int(status["restartsCountTowardsMax"]) + 1
        event = RESTART_JOBSET_ACTION if action == "RestartJobSet" else RESTART_IGNORE_MAX_ACTION
        message = _with_job(event[1], job)
        reason = f"FailurePolicy_{rule['name']}" if rule is not None else "DefaultFailurePolicy"
        self._condition(js, status, "RestartingJobSet", "True", reason, message)
        # failurePolicyRecreateAll's event: it outlives the condition, which is cleared once the new Jobs are ready.
        record_event(self.api, js, "JobSet", event[0], message, "jobset-controller")
        self.restarts.append((js["metadata"]["name"], job["metadata"]["name"]))

    def _fail(self, js: dict[str, Any], status: dict[str, Any], reason: str, message: str) -> None:
        self._condition(js, status, "Failed", "True", reason, message)
        self._condition(js, status, "RestartingJobSet", "False", "JobSetFailed", "jobset failed")
        status["terminalState"] = "Failed"

    @staticmethod
    def _succeeded(js: dict[str, Any], successful: list[dict[str, Any]]) -> bool:
        policy = js["spec"].get("successPolicy") or {"operator": "All"}
        targets = policy.get("targetReplicatedJobs") or [rj["name"] for rj in js["spec"]["replicatedJobs"]]
        done = sum(1 for j in successful if j["metadata"]["labels"].get(REPLICATED_JOB) in targets)
        if policy.get("operator", "All") == "Any":
            return done >= 1
        return done >= sum(int(rj.get("replicas", 1)) for rj in js["spec"]["replicatedJobs"] if rj["name"] in targets)

    @staticmethod
    def _rjob_status(name: str, jobs: list[dict[str, Any]]) -> dict[str, Any]:
        mine = [j for j in jobs if j["metadata"]["labels"].get(REPLICATED_JOB) == name]
        counts = {"ready": 0, "succeeded": 0, "failed": 0, "active": 0, "suspended": 0}
        out = counts
        for j in mine:
            finished = job_finished(j)
            st = j.get("status") or {}
            if finished == "Complete":
                out["succeeded"] += 1
            elif finished == "Failed":
                out["failed"] += 1
            elif j["spec"].get("suspend"):
                out["suspended"] += 1
            else:
                out["active"] += 1
                if int(st.get("ready", 0)) + int(st.get("succeeded", 0)) >= int(j["spec"].get("parallelism", 1)):
                    out["ready"] += 1
        return {"name": name, **counts}

    @staticmethod
    def _all_ready(js: dict[str, Any], statuses: list[dict[str, Any]]) -> bool:
        return sum(int(rj.get("replicas", 1)) for rj in js["spec"]["replicatedJobs"]) == sum(
            s["ready"] + s["succeeded"] for s in statuses
        )

    # -- objects -----------------------------------------------------------------------

    def _headless_service(self, js: dict[str, Any], services: list[dict[str, Any]]) -> None:
        network = js["spec"].get("network") or {}
        if not network.get("enableDNSHostnames"):
            return
        name, ns = subdomain(js), js["metadata"]["namespace"]
        if any(s["metadata"]["name"] == name and s["metadata"]["namespace"] == ns for s in services):
            return
        svc = {"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": name, "namespace": ns, "ownerReferences": [_controller_ref(js)]},
               "spec": {"clusterIP": "None", "selector": {JOBSET_NAME: js["metadata"]["name"]},
                        "publishNotReadyAddresses": network.get("publishNotReadyAddresses", True)}}
        services.append(self.api.create("Service", svc))

    @staticmethod
    def _construct_job(js: dict[str, Any], rj: dict[str, Any], index: int, restarts: int) -> dict[str, Any]:
        template = copy.deepcopy(rj["template"])
        name = child_job_name(js["metadata"]["name"], rj["name"], index)
        spec = template["spec"]
        meta = template.get("metadata") or {}
        pod_template = spec.setdefault("template", {})
        pod_meta = pod_template.setdefault("metadata", {})
        stamp = _jobset_labels(js, rj, index, restarts, name)
        job_meta = {
            "name": name,
            "namespace": js["metadata"]["namespace"],
            "labels": {**(meta.get("labels") or {}), **stamp},
            "annotations": {**(meta.get("annotations") or {}), **stamp},
            "ownerReferences": [_controller_ref(js)],
        }
        pod_meta["labels"] = {**(pod_meta.get("labels") or {}), **stamp}
        pod_meta["annotations"] = {**(pod_meta.get("annotations") or {}), **stamp}
        if (js["spec"].get("network") or {}).get("enableDNSHostnames"):
            pod_template["spec"]["subdomain"] = subdomain(js)
        spec["suspend"] = bool(js["spec"].get("suspend"))
        return {"apiVersion": "batch/v1", "kind": "Job", "metadata": job_meta, "spec": spec}

    def _delete_jobs(self, jobs: list[dict[str, Any]]) -> None:
        for j in jobs:
            if not terminating(j):
                self.api.delete(j, propagation="Foreground")

    def _condition(
        self, js: dict[str, Any], status: dict[str, Any], ctype: str, value: str, reason: str, message: str
    ) -> None:
        status["conditions"] = with_condition({"status": status}, ctype, value, reason, message)

    def _write(self, js: dict[str, Any], status: dict[str, Any]) -> None:
        current = js.get("status") or {}
        if any(current.get(k) != v for k, v in status.items()):
            self.api.patch(js, {"status": status})


def _controller_ref(js: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": JOBSET_API, "kind": "JobSet", "name": js["metadata"]["name"], "uid": js["metadata"]["uid"],
            "controller": True, "blockOwnerDeletion": True}


def _jobset_labels(js: dict[str, Any], rj: dict[str, Any], index: int, restarts: int, job: str) -> dict[str, str]:
    """What `labelAndAnnotateObject` puts on a child Job and its pod template (labels and annotations alike)."""
    rjobs = js["spec"]["replicatedJobs"]
    before = sum(int(r.get("replicas", 1)) for r in rjobs[: rjobs.index(rj)])
    ns = js["metadata"]["namespace"]
    return {
        JOBSET_NAME: js["metadata"]["name"], JOBSET_UID: js["metadata"]["uid"], REPLICATED_JOB: rj["name"],
        RESTART_ATTEMPT: str(restarts), REPLICATED_JOB_REPLICAS: str(int(rj.get("replicas", 1))),
        GLOBAL_REPLICAS: str(sum(int(r.get("replicas", 1)) for r in rjobs)), JOB_INDEX: str(index),
        JOB_KEY: hashlib.sha1(f"{ns}/{job}".encode()).hexdigest(), JOB_GLOBAL_INDEX: str(before + index),
    }


def _failure_time(job: dict[str, Any]) -> str:
    return str(conditions(job).get("Failed", {}).get("lastTransitionTime", ""))


def _rule_applies(rule: dict[str, Any], job: dict[str, Any]) -> bool:
    failed = conditions(job).get("Failed", {})
    if rule.get("onJobFailureReasons") and failed.get("reason") not in rule["onJobFailureReasons"]:
        return False
    patterns = rule.get("onJobFailureMessagePatterns")
    if patterns and not any(re.search(p, failed.get("message") or "") for p in patterns):  # Go's regexp.MatchString
        return False
    targets = rule.get("targetReplicatedJobs")
    return not targets or job["metadata"]["labels"].get(REPLICATED_JOB) in targets


def _with_job(message: str, job: dict[str, Any]) -> str:
    return f"{message} (first failed job: {job['metadata']['name']})"

