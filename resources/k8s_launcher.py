"""Kubernetes launcher: run a trial as an Indexed Job under Kueue and bring back its result.

`KubernetesLauncher` is the Dagster resource (configuration and API clients);
`JobSupervisor` holds the logic and takes its API objects, clock and sleep as
arguments, so tests drive queueing, retries and timeouts without a cluster and
without sleeping.

What a launch does:

1. Computes the deterministic Job name for (pipeline, trial, attempt). If that Job
   exists, the orchestrator was restarted or retried: re-attach to it (after
   checking its labels belong to this trial) and start nothing.
2. Otherwise clears stale `result.json`/failure records, writes `spec.json` next to
   them, creates the headless Service, then the Job. A 409 on create means an
   earlier try went through: re-attach. 5xx and connection errors are retried with
   backoff.
3. Watches by polling. A suspended Job is queued (Kueue has not admitted the gang;
   the Workload's conditions say why); queued time counts against the queue
   timeout only, never against the run timeout. Running: pods that were disrupted
   (DisruptionTarget) or failed while the Job still retries are reported, not
   treated as failures; rank 0's log lines are streamed to the Dagster log.
4. Job condition Complete: read `result.json`. Failed: map the failing pod's exit
   code and the trial's failure records to the launcher error hierarchy (78 bad
   config, 143 preempted), with the pod's reason and rank 0's log tail in the
   message.
5. Cleanup: the Service is deleted on every finished outcome; the Job is kept for
   its TTL (logs, debugging). Leaving before the Job finished (cancellation,
   timeouts, API failure) deletes Job and Service, then re-raises.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Optional, TypeVar

import fsspec
import urllib3
from dagster import Config
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.client import V1DeleteOptions
from kubernetes.client.exceptions import ApiException
from pydantic import Field, model_validator

from resources.k8s_manifests import (
    COMPLETION_INDEX_ANNOTATION,
    CONTAINER_NAME,
    LABEL_JOB,
    K8sJobConfig,
    Toleration,
    job_manifest,
    service_manifest,
    trial_labels,
)
from resources.launcher import (
    InfrastructureError,
    LaunchError,
    Launcher,
    LaunchOutcome,
    TrainingConfigError,
    join,
    outcome_error,
    read_failures,
)
from training.spec import EXIT_BAD_CONFIG, EXIT_PREEMPTED, FAILURE_DIR, RESULT_FILE, SPEC_FILE, TrainResult, TrainSpec

logger = logging.getLogger("trainyard.k8s")

T = TypeVar("T")

# Worth retrying: overload, throttling, gateway and control-plane hiccups.
TRANSIENT_STATUSES = frozenset({429, 500, 502, 503, 504})
# Container waiting reasons that no amount of waiting fixes (bad image name, a
# missing Secret or ConfigMap): fail the launch instead of idling until the run timeout.
STUCK_WAITING_REASONS = frozenset({"InvalidImageName", "CreateContainerConfigError", "ErrImageNeverPull"})
KUEUE_GROUP = "kueue.x-k8s.io"


class KubernetesAPIError(LaunchError):
    """The API server refused a request for good (forbidden, invalid manifest, no such namespace)."""

    def __init__(self, message: str, *, status: Optional[int] = None) -> None:
        super().__init__(message)
        self.status = status


class QueueTimeout(InfrastructureError):
    """Kueue did not admit the trial within the queue timeout; the Job was deleted."""


def _api_message(e: Any) -> str:
    try:
        return str(json.loads(e.body).get("message") or e.reason)
    except (TypeError, ValueError, AttributeError):
        return str(getattr(e, "reason", e))


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
    created: Optional[datetime] = None
    finished: Optional[datetime] = None

    @classmethod
    def of(cls, pod: Any) -> "PodView":
        meta, status = pod.metadata, pod.status
        raw_index = (meta.annotations or {}).get(COMPLETION_INDEX_ANNOTATION) or (meta.labels or {}).get(COMPLETION_INDEX_ANNOTATION)
        view = cls(
            name=meta.name,
            index=int(raw_index) if raw_index is not None and str(raw_index).isdigit() else None,
            phase=(status.phase if status and status.phase else "Unknown"),
            created=meta.creation_timestamp,
        )
        if status is None:
            return view
        for cond in status.conditions or []:
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


@dataclass
class _Watch:
    """Bookkeeping of one watch: what was reported already, time spent per state."""

    owns_job: bool = False
    owns_service: bool = False
    finished: bool = False
    queued_seconds: float = 0.0
    running_seconds: float = 0.0
    state: Optional[str] = None
    workload_note: str = ""
    reported: dict[str, str] = field(default_factory=dict)
    stuck_since: dict[str, float] = field(default_factory=dict)
    log_pod: Optional[str] = None
    log_read_at: Optional[float] = None
    follower: LogFollower = field(default_factory=LogFollower)
    workloads_forbidden: bool = False


class JobSupervisor:
    """Submits, watches and cleans up one trial's Job; all I/O through the given APIs.

    Args:
        batch_api, core_api, custom_api: `kubernetes.client` BatchV1Api, CoreV1Api,
            CustomObjectsApi (or objects with the same methods).
        clock: seconds, monotonic (e.g. `time.monotonic`).
        sleep: waits the given seconds (e.g. `time.sleep`).
        namespace: where Job, Service and pods live.
        poll_interval: seconds between status reads.
        run_timeout: seconds the Job may run once admitted (queued time excluded).
        queue_timeout: seconds the Job may wait for Kueue admission in total.
        log_tail_lines: rank 0's log lines carried in error messages.
        api_retries: retries of a transient API error (5xx, 429, connection) before
            giving up with a retryable `InfrastructureError`.
        api_backoff: first retry delay in seconds, doubled up to `api_backoff_max`.
        stuck_seconds: how long a container may wait with a reason that never
            resolves by itself (missing Secret, invalid image) before the launch fails.
        kueue_version: API version of Kueue's Workload resource.
    """

    def __init__(
        self,
        batch_api: Any,
        core_api: Any,
        custom_api: Any,
        clock: Callable[[], float],
        sleep: Callable[[float], None],
        *,
        namespace: str,
        poll_interval: float = 10.0,
        run_timeout: float = 7 * 86400.0,
        queue_timeout: float = 86400.0,
        log_tail_lines: int = 40,
        saved_log_lines: int = 5000,
        api_retries: int = 4,
        api_backoff: float = 1.0,
        api_backoff_max: float = 30.0,
        request_timeout: tuple[float, float] = (10.0, 60.0),
        stuck_seconds: float = 300.0,
        stream_tail_lines: int = 1000,
        kueue_version: str = "v1beta2",
    ) -> None:
        self.batch = batch_api
        self.core = core_api
        self.custom = custom_api
        self.clock = clock
        self.sleep = sleep
        self.namespace = namespace
        self.poll_interval = poll_interval
        self.run_timeout = run_timeout
        self.queue_timeout = queue_timeout
        self.log_tail_lines = log_tail_lines
        self.saved_log_lines = saved_log_lines
        self.api_retries = api_retries
        self.api_backoff = api_backoff
        self.api_backoff_max = api_backoff_max
        self.request_timeout = request_timeout
        self.stuck_seconds = stuck_seconds
        self.stream_tail_lines = stream_tail_lines
        self.kueue_version = kueue_version

    # -- API access -------------------------------------------------------------

    def _api(self, what: str, fn: Callable[..., T], *args: Any, expect: Iterable[int] = (), retries: Optional[int] = None, **kwargs: Any) -> T:
        """Call the API; retry transient errors; terminal ones become `KubernetesAPIError`.

        An `ApiException` whose status is in `expect` (404, 409) is re-raised for
        the caller to handle.
        """
        retries = self.api_retries if retries is None else retries
        delay = self.api_backoff
        tries = 0
        while True:
            tries += 1
            try:
                return fn(*args, _request_timeout=self.request_timeout, **kwargs)
            except ApiException as e:
                if e.status in tuple(expect):
                    raise
                if e.status not in TRANSIENT_STATUSES:
                    raise KubernetesAPIError(
                        f"Kubernetes API refused to {what} in namespace {self.namespace!r}: "
                        f"{e.status} {e.reason}: {_api_message(e)}",
                        status=e.status,
                    ) from e
                error: BaseException = e
                detail = f"{e.status} {e.reason}"
            except (urllib3.exceptions.HTTPError, ConnectionError) as e:
                error, detail = e, f"{type(e).__name__}: {e}"
            if tries > retries:
                raise InfrastructureError(
                    f"Kubernetes API unavailable: could not {what} after {tries} tries; last error {detail}"
                ) from error
            logger.warning("could not %s (%s); retrying in %.1f s", what, detail, delay)
            self.sleep(delay)
            delay = min(delay * 2, self.api_backoff_max)

    def _get_job(self, name: str) -> Any:
        try:
            return self._api(f"read Job {name}", self.batch.read_namespaced_job, name, self.namespace, expect=(404,))
        except ApiException:
            return None

    def _pods(self, name: str) -> list[PodView]:
        pods = self._api(
            f"list pods of Job {name}", self.core.list_namespaced_pod, self.namespace, label_selector=f"{LABEL_JOB}={name}"
        )
        # Filter here as well: the selector is an optimisation, the label is the truth.
        views = [PodView.of(p) for p in pods.items if (p.metadata.labels or {}).get(LABEL_JOB) == name]
        return sorted(views, key=lambda v: (v.index if v.index is not None else 1 << 30, v.created.timestamp() if v.created else 0.0))

    @staticmethod
    def _rank0(pods: list[PodView]) -> Optional[PodView]:
        zero = [p for p in pods if p.index == 0]
        if not zero:
            return None
        live = [p for p in zero if p.phase in ("Running", "Pending")]
        return (live or zero)[-1]

    def _read_log(self, pod: str, **kwargs: Any) -> str:
        resp = self._api(
            f"read the log of pod {pod}", self.core.read_namespaced_pod_log, pod, self.namespace,
            container=CONTAINER_NAME, _preload_content=False, expect=(400, 404), **kwargs,
        )
        # Raw bytes: the client would otherwise try to deserialize the log text.
        return resp.data.decode("utf-8", "replace")

    def _log_tail(self, pod: Optional[PodView], lines: int) -> str:
        if pod is None:
            return ""
        try:
            return self._read_log(pod.name, tail_lines=lines).rstrip("\n")
        except (ApiException, LaunchError) as e:
            return f"(no log from pod {pod.name}: {getattr(e, 'reason', e)})"

    # -- submission ---------------------------------------------------------------

    def _verify(self, obj: Any, want: dict[str, str], kind: str, name: str) -> None:
        labels = obj.metadata.labels or {}
        wrong = {k: {"found": labels.get(k), "expected": v} for k, v in want.items() if labels.get(k) != v}
        if wrong:
            raise LaunchError(
                f"{kind} {self.namespace}/{name} exists but does not belong to this trial attempt (labels {wrong}); "
                "not touching it. Delete it if it is stale, or launch another attempt."
            )

    def _ensure_service(self, service: dict[str, Any], want: dict[str, str], w: _Watch) -> None:
        name = service["metadata"]["name"]
        try:
            self._api(f"create Service {name}", self.core.create_namespaced_service, self.namespace, service, expect=(409,))
        except ApiException:
            existing = self._api(f"read Service {name}", self.core.read_namespaced_service, name, self.namespace)
            self._verify(existing, want, "Service", name)
        w.owns_service = True

    def _create_job(self, job: dict[str, Any], want: dict[str, str], w: _Watch) -> bool:
        """Create the Job; False when it already existed (a retried create that went through)."""
        name = job["metadata"]["name"]
        try:
            self._api(f"create Job {name}", self.batch.create_namespaced_job, self.namespace, job, expect=(409,))
            w.owns_job = True
            return True
        except ApiException:
            existing = self._get_job(name)
            if existing is None:
                raise InfrastructureError(f"Job {self.namespace}/{name} was reported to exist (409) but cannot be read")
            self._verify(existing, want, "Job", name)
            w.owns_job = True
            return False

    @staticmethod
    def _prepare_output(spec: TrainSpec, spec_uri: str) -> None:
        """A fresh launch: drop a stale result and failure records, write the spec the pods read."""
        fs, out = fsspec.core.url_to_fs(spec.output_uri)
        fs.makedirs(out, exist_ok=True)
        if fs.exists(f"{out}/{FAILURE_DIR}"):
            fs.rm(f"{out}/{FAILURE_DIR}", recursive=True)
        if fs.exists(f"{out}/{RESULT_FILE}"):
            fs.rm(f"{out}/{RESULT_FILE}")
        with fsspec.open(spec_uri, "w") as f:
            f.write(spec.to_json())

    # -- cleanup ---------------------------------------------------------------------

    def _delete(self, kind: str, name: str, fn: Callable[..., Any], log: Any, **kwargs: Any) -> None:
        try:
            self._api(f"delete {kind} {name}", fn, name, self.namespace, expect=(404,), retries=1, **kwargs)
        except ApiException:
            pass  # already gone
        except LaunchError as e:
            log.warning(f"could not delete {kind} {self.namespace}/{name}: {e}; delete it by hand "
                        f"(kubectl -n {self.namespace} delete {kind.lower()} {name})")

    def delete_job(self, name: str, log: Any = logger) -> None:
        """Delete the Job and, with it, its pods."""
        # Foreground: the Job object stays until its pods are gone, so the same
        # name cannot be re-created while old pods still write to the trial's
        # checkpoint directory.
        self._delete("Job", name, self.batch.delete_namespaced_job, log, body=V1DeleteOptions(propagation_policy="Foreground"))

    def delete_service(self, name: str, log: Any = logger) -> None:
        self._delete("Service", name, self.core.delete_namespaced_service, log)

    # -- the launch ------------------------------------------------------------------

    def run(self, spec: TrainSpec, spec_uri: str, attempt: int, cfg: K8sJobConfig, log: Any = logger) -> LaunchOutcome:
        """Launch (or re-attach to) the trial's Job and wait for its outcome.

        Raises:
            TrainingConfigError, TrainingCodeError: the trial cannot succeed (terminal).
            TrainingPreempted, InfrastructureError: retryable; a new attempt resumes
                from the last committed checkpoint.
            KubernetesAPIError: the API refused a request (RBAC, invalid manifest).
        """
        started = self.clock()
        job = job_manifest(spec, spec_uri, attempt, cfg)
        name = job["metadata"]["name"]
        want = trial_labels(spec, attempt)
        service = service_manifest(name, cfg, labels=want)
        w = _Watch()
        try:
            existing = self._get_job(name)
            if existing is not None:
                self._verify(existing, want, "Job", name)
                w.owns_job = True
                log.info(f"trial {spec.trial_id}: re-attaching to existing Job {self.namespace}/{name}")
                self._ensure_service(service, want, w)
            else:
                self._prepare_output(spec, spec_uri)
                self._ensure_service(service, want, w)
                if self._create_job(job, want, w):
                    log.info(f"trial {spec.trial_id}: created Job {self.namespace}/{name} "
                             f"({spec.distribution.nodes} pods, queue {cfg.queue_name or '-'})")
                else:
                    log.info(f"trial {spec.trial_id}: Job {self.namespace}/{name} already existed; re-attaching")
            return self._watch(spec, name, started, w, log)
        finally:
            if w.finished:
                # The Job stays for its TTL (logs, debugging); rendezvous is over.
                if w.owns_service:
                    self.delete_service(name, log)
            elif w.owns_job or w.owns_service:
                log.warning(f"trial {spec.trial_id}: leaving before Job {self.namespace}/{name} finished; deleting it")
                if w.owns_job:
                    self.delete_job(name, log)
                if w.owns_service:
                    self.delete_service(name, log)

    def _watch(self, spec: TrainSpec, name: str, started: float, w: _Watch, log: Any) -> LaunchOutcome:
        last = self.clock()
        while True:
            job = self._get_job(name)
            now = self.clock()
            if w.state == "queued":
                w.queued_seconds += now - last
            elif w.state == "running":
                w.running_seconds += now - last
            last = now
            if job is None:
                return self._vanished(spec, name, started, w)
            conditions = {c.type: c for c in (job.status.conditions or [])} if job.status else {}
            if _true(conditions.get("Complete")):
                w.finished = True
                pods = self._pods(name)
                self._stream(name, w, log, pods)
                return self._success(spec, name, started, pods)
            if _true(conditions.get("Failed")):
                w.finished = True
                raise self._failure(spec, name, conditions["Failed"], self._pods(name))

            state = "queued" if job.spec.suspend else "running"
            if state != w.state:
                self._transition(spec, name, w, state, log)
            w.state = state
            if state == "queued":
                self._explain_queue(job, name, w, log)
                if w.queued_seconds > self.queue_timeout:
                    raise QueueTimeout(
                        f"trial {spec.trial_id}: Kueue did not admit Job {self.namespace}/{name} within "
                        f"{self.queue_timeout:.0f} s ({w.workload_note or 'no Workload status'}); deleted it"
                    )
            else:
                if w.running_seconds > self.run_timeout:
                    raise InfrastructureError(
                        f"trial {spec.trial_id}: Job {self.namespace}/{name} ran {w.running_seconds:.0f} s, past the run "
                        f"timeout of {self.run_timeout:.0f} s; deleted it. Last log lines of rank 0:\n"
                        f"{self._log_tail(self._rank0(self._pods(name)), self.log_tail_lines)}"
                    )
                pods = self._pods(name)
                self._report_pods(spec, pods, w, log, now)
                self._stream(name, w, log, pods)
            self.sleep(self.poll_interval)

    def _transition(self, spec: TrainSpec, name: str, w: _Watch, state: str, log: Any) -> None:
        if state == "queued" and w.state is None:
            log.info(f"trial {spec.trial_id}: Job {name} is queued, waiting for Kueue to admit all its pods")
        elif state == "queued":
            log.warning(f"trial {spec.trial_id}: Job {name} was suspended again (preempted by Kueue); "
                        "it resumes from its last checkpoint once re-admitted")
        elif w.state == "queued":
            log.info(f"trial {spec.trial_id}: Job {name} admitted after {w.queued_seconds:.0f} s in the queue")
        else:
            log.info(f"trial {spec.trial_id}: Job {name} is running")

    def _explain_queue(self, job: Any, name: str, w: _Watch, log: Any) -> None:
        """Log why Kueue has not admitted the Job yet, from its Workload (when readable)."""
        if w.workloads_forbidden:
            return
        uid = getattr(job.metadata, "uid", None)
        try:
            found = self._api(
                f"list Kueue Workloads for Job {name}", self.custom.list_namespaced_custom_object,
                KUEUE_GROUP, self.kueue_version, self.namespace, "workloads",
                label_selector=f"{KUEUE_GROUP}/job-uid={uid}" if uid else None, expect=(403, 404),
            )
        except ApiException as e:
            if e.status == 403:
                w.workloads_forbidden = True
            return  # 404: no Kueue, or no Workload yet
        except LaunchError:
            return  # explanatory only; the watch goes on
        for wl in found.get("items", []):
            owners = wl.get("metadata", {}).get("ownerReferences", [])
            if not any(o.get("kind") == "Job" and o.get("name") == name for o in owners):
                continue
            conds = {c.get("type"): c for c in wl.get("status", {}).get("conditions", [])}
            note = ""
            for ctype, status in (("Evicted", "True"), ("QuotaReserved", "False"), ("Admitted", "False")):
                c = conds.get(ctype)
                if c and c.get("status") == status:
                    note = f"Workload {wl['metadata'].get('name')}: {ctype}={status} ({c.get('reason')}: {c.get('message')})"
                    break
            if note and note != w.workload_note:
                log.info(note)
            w.workload_note = note or w.workload_note
            return

    def _report_pods(self, spec: TrainSpec, pods: list[PodView], w: _Watch, log: Any, now: float) -> None:
        for p in pods:
            if p.disrupted:
                key, level = "disrupted", log.warning
                text = f"{p.describe()}; disruption, not a failure: the Job replaces the pod and the trial resumes from its checkpoint"
            elif p.phase == "Failed":
                key, level = "failed", log.warning
                text = f"{p.describe()}; the Job retries it within its backoffLimit"
            elif p.waiting_reason:
                key, level = f"waiting:{p.waiting_reason}", log.warning
                text = p.describe()
            else:
                key, level, text = p.phase, log.info, ""
            if w.reported.get(p.name) != key:
                w.reported[p.name] = key
                if text:
                    level(f"trial {spec.trial_id}: {text}")
            if p.waiting_reason in STUCK_WAITING_REASONS and p.phase == "Pending":
                since = w.stuck_since.setdefault(f"{p.name}:{p.waiting_reason}", now)
                if now - since > self.stuck_seconds:
                    raise LaunchError(
                        f"trial {spec.trial_id}: {p.describe()}; waited {now - since:.0f} s, this does not resolve by "
                        "itself (check the image name and that every Secret in env_from_secrets exists)"
                    )

    def _stream(self, name: str, w: _Watch, log: Any, pods: list[PodView]) -> None:
        """Send rank 0's new log lines to the log; a failed read skips this poll."""
        rank0 = self._rank0(pods)
        if rank0 is None or rank0.phase == "Pending":
            return
        kwargs: dict[str, Any] = {"timestamps": True, "tail_lines": self.stream_tail_lines}
        now = self.clock()
        if rank0.name == w.log_pod and w.log_read_at is not None:
            # Only a recent window: enough to cover the time since the last read.
            kwargs["since_seconds"] = int(math.ceil(now - w.log_read_at + self.poll_interval)) + 5
        try:
            text = self._read_log(rank0.name, **kwargs)
        except (ApiException, LaunchError):
            return
        w.log_pod, w.log_read_at = rank0.name, now
        for line in w.follower.new_lines(text):
            log.info(f"[rank 0] {line}")

    # -- outcomes --------------------------------------------------------------------

    def _save_log(self, spec: TrainSpec, name: str, pods: list[PodView]) -> str:
        """Keep rank 0's log with the trial's files; the pod goes away with the Job's TTL."""
        uri = join(spec.output_uri, "logs", f"{name}.rank0.log")
        fs, path = fsspec.core.url_to_fs(uri)
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        rank0 = self._rank0(pods)
        with fs.open(path, "w") as f:
            f.write(self._log_tail(rank0, self.saved_log_lines) if rank0 else "(no rank 0 pod left to read a log from)")
            f.write("\n")
        return uri

    def _read_result(self, spec: TrainSpec) -> Optional[TrainResult]:
        fs, path = fsspec.core.url_to_fs(join(spec.output_uri, RESULT_FILE))
        if not fs.exists(path):
            return None
        with fs.open(path, "r") as f:
            return TrainResult.model_validate_json(f.read())

    def _success(self, spec: TrainSpec, name: str, started: float, pods: list[PodView]) -> LaunchOutcome:
        log_uri = self._save_log(spec, name, pods)
        result = self._read_result(spec)
        if result is None:
            raise InfrastructureError(
                f"trial {spec.trial_id}: Job {self.namespace}/{name} completed but {join(spec.output_uri, RESULT_FILE)} "
                "does not exist (is output_uri shared storage the pods can write?)"
            )
        return LaunchOutcome(result=result, log_uri=log_uri, seconds=self.clock() - started)

    def _vanished(self, spec: TrainSpec, name: str, started: float, w: _Watch) -> LaunchOutcome:
        w.finished = True
        result = self._read_result(spec)
        if result is None:
            raise InfrastructureError(
                f"trial {spec.trial_id}: Job {self.namespace}/{name} disappeared before finishing "
                "(deleted by someone, or removed by its TTL unseen) and left no result"
            )
        return LaunchOutcome(result=result, log_uri=self._save_log(spec, name, []), seconds=self.clock() - started)

    def _failure(self, spec: TrainSpec, name: str, condition: Any, pods: list[PodView]) -> LaunchError:
        failed = [p for p in pods if p.phase == "Failed" and not p.disrupted]
        culprit = min(failed, key=_blame, default=None)
        code = culprit.exit_code if culprit is not None and culprit.exit_code is not None else -1
        rank0 = self._rank0(pods)
        tail = self._log_tail(rank0, self.log_tail_lines)
        err = outcome_error(code, read_failures(spec.output_uri), tail, spec.trial_id)
        if code == EXIT_BAD_CONFIG and not isinstance(err, TrainingConfigError):
            err = TrainingConfigError(
                f"trial {spec.trial_id}: the entrypoint exited {EXIT_BAD_CONFIG} (bad config) without a failure record "
                "(is spec.json readable from the pods?)", log_tail=tail,
            )
        details = [f"Kubernetes: Job {self.namespace}/{name} failed ({condition.reason}: {condition.message})"]
        if culprit is not None:
            details.append(culprit.describe())
            if rank0 is None or culprit.name != rank0.name:
                details.append(f"last {self.log_tail_lines} log lines of {culprit.name}:\n"
                               f"{self._log_tail(culprit, self.log_tail_lines)}")
        if rank0 is not None and tail and tail not in str(err):
            details.append(f"last {self.log_tail_lines} log lines of rank 0 ({rank0.name}):\n{tail}")
        try:
            self._save_log(spec, name, pods)
        except OSError as e:
            details.append(f"(could not save rank 0's log: {e})")
        return type(err)("\n".join([str(err), *details]), log_tail=tail, rank=err.rank)


def _blame(pod: PodView) -> tuple[int, float, int]:
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


def _true(cond: Any) -> bool:
    return cond is not None and cond.status == "True"


def attempt_number(context: Any) -> int:
    """The attempt a launch belongs to: 100 x run retry + step retry.

    A step retry (RetryPolicy) or a run retry is a new attempt, hence a new Job
    name; a restarted orchestrator in the same attempt computes the same name and
    re-attaches.
    """
    if context is None:
        return 0
    step = int(getattr(context, "retry_number", 0) or 0)
    run = getattr(context, "run", None)
    tags = getattr(run, "tags", None) or {}
    return 100 * int(tags.get("dagster/retry_number", 0)) + step


class TolerationConfig(Config):
    """A pod toleration; see `resources.k8s_manifests.Toleration`."""

    key: Optional[str] = None
    operator: str = "Equal"
    value: Optional[str] = None
    effect: Optional[str] = None
    toleration_seconds: Optional[int] = None


class KubernetesLauncher(Launcher):
    """Runs each trial as an Indexed Job (one pod per node) under Kueue.

    Cluster access, in order: `api_url` (a plain endpoint, for tests and
    `kubectl proxy`), `in_cluster` (the run pod's service account), else
    `kubeconfig`/`kube_context` (default kubeconfig when unset). The job fields
    are those of `K8sJobConfig` and are validated when the resource is built.
    """

    namespace: str
    image: str
    queue_name: Optional[str] = "trainyard"
    priority_class: Optional[str] = None
    workload_priority_class: Optional[str] = None
    service_account: Optional[str] = None
    gpus_per_pod: Optional[int] = None
    cpu: str = "2"
    memory: str = "8Gi"
    cpu_limit: Optional[str] = None
    memory_limit: Optional[str] = None
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[TolerationConfig] = Field(default_factory=list)
    shm_size: Optional[str] = "2Gi"
    termination_grace_seconds: int = 120
    ttl_seconds_after_finished: Optional[int] = 86400
    backoff_limit: int = 3
    active_deadline_seconds: Optional[int] = None
    env_from_secrets: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    master_port: int = 29500
    labels: dict[str, str] = Field(default_factory=dict)

    api_url: Optional[str] = Field(None, description="explicit API server URL (tests, kubectl proxy)")
    in_cluster: bool = False
    kubeconfig: Optional[str] = None
    kube_context: Optional[str] = None
    kueue_version: str = "v1beta2"
    poll_interval_seconds: float = Field(10.0, gt=0)
    run_timeout_seconds: float = Field(7 * 86400.0, gt=0, description="running time after admission")
    queue_timeout_seconds: float = Field(86400.0, gt=0, description="time waiting for Kueue admission")
    log_tail_lines: int = Field(40, ge=1)
    api_retries: int = Field(4, ge=0)

    @model_validator(mode="after")
    def _valid_job_config(self) -> "KubernetesLauncher":
        self.job_config()
        return self

    def job_config(self) -> K8sJobConfig:
        return K8sJobConfig(
            namespace=self.namespace, image=self.image, queue_name=self.queue_name,
            priority_class=self.priority_class, workload_priority_class=self.workload_priority_class,
            service_account=self.service_account, gpus_per_pod=self.gpus_per_pod, cpu=self.cpu,
            memory=self.memory, cpu_limit=self.cpu_limit, memory_limit=self.memory_limit,
            node_selector=dict(self.node_selector),
            tolerations=tuple(Toleration(**t.model_dump()) for t in self.tolerations),
            shm_size=self.shm_size, termination_grace_seconds=self.termination_grace_seconds,
            ttl_seconds_after_finished=self.ttl_seconds_after_finished, backoff_limit=self.backoff_limit,
            active_deadline_seconds=self.active_deadline_seconds, env_from_secrets=tuple(self.env_from_secrets),
            env=dict(self.env), master_port=self.master_port, labels=dict(self.labels),
        )

    @classmethod
    def from_env(cls, env: dict[str, str]) -> "KubernetesLauncher":
        """The launcher of the `cluster` environment, from `TRAINYARD_K8S_*` variables.

        Required: TRAINYARD_K8S_NAMESPACE, TRAINYARD_TRAINER_IMAGE. Optional:
        TRAINYARD_K8S_QUEUE (default 'trainyard'), TRAINYARD_K8S_PRIORITY_CLASS,
        TRAINYARD_K8S_SERVICE_ACCOUNT, TRAINYARD_K8S_SECRETS (comma-separated Secret
        names), TRAINYARD_K8S_GPUS_PER_POD; AWS_ENDPOINT_URL is passed to the pods.
        """
        missing = [k for k in ("TRAINYARD_K8S_NAMESPACE", "TRAINYARD_TRAINER_IMAGE") if not env.get(k)]
        if missing:
            raise ValueError(f"the Kubernetes launcher needs {', '.join(missing)} to be set")
        pod_env = {"AWS_ENDPOINT_URL": env["AWS_ENDPOINT_URL"]} if env.get("AWS_ENDPOINT_URL") else {}
        gpus = env.get("TRAINYARD_K8S_GPUS_PER_POD")
        return cls(
            namespace=env["TRAINYARD_K8S_NAMESPACE"],
            image=env["TRAINYARD_TRAINER_IMAGE"],
            queue_name=env.get("TRAINYARD_K8S_QUEUE", "trainyard") or None,
            priority_class=env.get("TRAINYARD_K8S_PRIORITY_CLASS") or None,
            service_account=env.get("TRAINYARD_K8S_SERVICE_ACCOUNT") or None,
            env_from_secrets=[s.strip() for s in env.get("TRAINYARD_K8S_SECRETS", "").split(",") if s.strip()],
            gpus_per_pod=int(gpus) if gpus else None,
            env=pod_env,
            in_cluster=bool(env.get("KUBERNETES_SERVICE_HOST")),
        )

    def _api_client(self) -> k8s_client.ApiClient:
        if self.api_url is not None:
            return k8s_client.ApiClient(k8s_client.Configuration(host=self.api_url))
        if self.in_cluster:
            configuration = k8s_client.Configuration()
            k8s_config.load_incluster_config(client_configuration=configuration)
            return k8s_client.ApiClient(configuration)
        return k8s_config.new_client_from_config(config_file=self.kubeconfig, context=self.kube_context)

    def supervisor(self, api_client: k8s_client.ApiClient) -> JobSupervisor:
        return JobSupervisor(
            k8s_client.BatchV1Api(api_client), k8s_client.CoreV1Api(api_client), k8s_client.CustomObjectsApi(api_client),
            clock=time.monotonic, sleep=time.sleep, namespace=self.namespace,
            poll_interval=self.poll_interval_seconds, run_timeout=self.run_timeout_seconds,
            queue_timeout=self.queue_timeout_seconds, log_tail_lines=self.log_tail_lines,
            api_retries=self.api_retries, kueue_version=self.kueue_version,
        )

    def launch(self, spec: TrainSpec, context: Any = None) -> LaunchOutcome:
        api_client = self._api_client()
        try:
            return self.supervisor(api_client).run(
                spec, join(spec.output_uri, SPEC_FILE), attempt_number(context), self.job_config(),
                log=context.log if context is not None else logger,
            )
        finally:
            api_client.close()
