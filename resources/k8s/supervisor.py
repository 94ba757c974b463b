"""The waiter behind the Kubernetes launcher: submit a trial's gang (a JobSet, or an Indexed Job), watch it, bring back
its result.

`JobSupervisor` takes its API objects, clock and sleep as arguments, so tests
drive queueing, retries and timeouts without a cluster and without sleeping.

What a launch does:

1. Lists the trial's gangs (Jobs and JobSets) by label: deletes those of other
   Dagster runs or attempts and waits until they are gone (`resources.k8s.gangs`:
   one gang per trial). If this attempt's gang exists (a restarted orchestrator),
   re-attach.
2. Otherwise clears stale `result.json`/failure records, writes `spec.json`,
   creates the gang: a JobSet (its controller makes the child Job and the
   headless Service), or the Job, then the headless Service owned by it
   (ownerReference with the Job's uid). A 409 on create means an earlier try
   went through: re-attach.
   5xx and connection errors are retried with backoff (`common.retry`).
3. Watches by polling. A suspended Job is queued (Kueue has not admitted the gang;
   the Workload's conditions say why); queued time counts against the queue
   timeout only, never against the run timeout. Running: pods that were disrupted
   (DisruptionTarget) or failed while the Job still retries are reported, not
   treated as failures; rank 0's log lines are streamed to the Dagster log.
   Admitted pods that cannot start (Unschedulable, FailedCreate, image or config
   errors) are logged and fail the launch past their bound (`resources.k8s.stuck`).
   A JobSet's whole-gang restart (`status.restarts` grew: its failurePolicy
   restarted every pod after an infrastructure failure) is logged with the
   failing pod and its count against `maxRestarts`; every restart resumes from
   the newest committed checkpoint.
4. Condition Complete (Job) / Completed (JobSet): read `result.json`. Failed:
   map the failing pod's exit code and the trial's failure records to the
   launcher error hierarchy (78 bad config, 143 preempted), with the Job's or
   JobSet's and its child Job's reason, the pod's state and rank 0's (and the
   failing pod's) log tail in the message.
5. Cleanup: the Job's Service is deleted on every finished outcome (a JobSet's
   is owned by the JobSet and goes with it); the gang is kept for its TTL (logs,
   debugging). Leaving before the gang finished (cancellation, timeouts, API
   failure) deletes it (and the Job's Service), then re-raises.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from typing import Any, Optional, TypeVar

import urllib3
from kubernetes.client import V1DeleteOptions
from kubernetes.client.exceptions import ApiException

from common.retry import RetriesExhausted, retry_call
from resources.k8s.config import K8sJobConfig
from resources.k8s.elastic import ResizeNeeded, Resizer, run_elastic
from resources.k8s.errors import TRANSIENT_STATUSES, KubernetesAPIError, QueueTimeout, Transient, api_message
from resources.k8s.gangs import clear_other_gangs
from resources.k8s.kinds import GANG_KINDS, GangApi, GangView, kind_of
from resources.k8s.manifests import trial_objects
from resources.k8s.names import (
    CONTAINER_NAME,
    LABEL_JOB,
    MAX_JOB_NAME,
    MAX_JOBSET_NAME,
    gang_name,
    trial_labels,
)
from resources.k8s.pod_events import PodWatch
from resources.k8s.pods import PodView, blame_order, rank0_pod
from resources.k8s.reports import GangReports
from resources.k8s.stuck import restart_cause
from resources.k8s.watch import Outcomes
from resources.k8s.watch import Watch as _Watch
from resources.launch_errors import nodes_to_avoid, read_watchdog_events
from resources.launcher import (
    InfrastructureError,
    LaunchError,
    LaunchOutcome,
    prepare_output,
)
from training.spec import TrainSpec

logger = logging.getLogger("trainyard.k8s")

POD_WATCH_WINDOW_S = 60.0
"""Seconds one watch of a gang's pods lasts before the next starts (the API server's `timeoutSeconds`)."""

T = TypeVar("T")

def avoid_reported_nodes(spec: TrainSpec, cfg: K8sJobConfig, log: Any) -> K8sJobConfig:
    """`cfg` whose pods prefer other nodes than those where the trial's earlier gangs had a hung rank or an uncleared
    straggler.

    The pod-side agents write their reports under the trial's output
    (`training.watchdog`); every new gang (the next attempt, a resized
    generation) reads them. A JobSet's in-place restart keeps its template:
    the scheduler places those pods afresh without the preference.
    """
    avoid = tuple(nodes_to_avoid(read_watchdog_events(spec.output_uri)))
    if not avoid or avoid == cfg.avoid_nodes:
        return cfg
    log.info(f"trial {spec.trial_id}: the gang prefers nodes other than {', '.join(avoid)} "
             "(a rank hung there, or a straggler ran there and was not cleared)")
    return cfg.model_copy(update={"avoid_nodes": avoid})


class JobSupervisor(GangReports, Outcomes):
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
        saved_log_lines: rank 0's log lines kept with the trial's files when the Job ends.
        api_retries: retries of a transient API error (5xx, 429, connection) before
            giving up with a retryable `InfrastructureError`.
        api_backoff: first retry delay in seconds, doubled up to `api_backoff_max`.
        request_timeout: (connect, read) seconds of each API request.
        stuck_seconds: admitted seconds an image pull error, a crash loop or refused
            pod creation (FailedCreate) may last before the launch fails; config
            errors (missing Secret, invalid image name) fail at once
            (`resources.k8s.stuck`).
        unschedulable_seconds: admitted seconds a pod may stay Unschedulable.
        delete_timeout: seconds, on top of the pods' termination grace period, to
            wait for a deleted gang of another attempt to be gone.
        stream_tail_lines: log lines read from a pod of rank 0 seen for the first time (later reads take every new
        line).
        kueue_version: API version of Kueue's Workload resource.
        watch_pods: watch the gang's pods in a thread beside the polls (`resources.k8s.pod_events`),
            so a pod that fails and is deleted between two polls (a JobSet restart) is still named.
        resize_after: admitted seconds a gang with a node range (`Distribution.min_nodes`) waits with pods that
            cannot be placed before it continues smaller, or with part of its capacity probe running before it
            grows back (`resources.k8s.elastic`); None: never resize.
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
        unschedulable_seconds: float = 900.0,
        delete_timeout: float = 60.0,
        stream_tail_lines: int = 1000,
        kueue_version: str = "v1beta2",
        watch_pods: bool = False,
        resize_after: Optional[float] = None,
    ) -> None:
        if api_retries < 0:
            raise ValueError(f"api_retries={api_retries!r} is negative; accepted: 0 (no retry) or more")
        if not 0 <= api_backoff <= api_backoff_max:
            raise ValueError(
                f"api_backoff={api_backoff!r}, api_backoff_max={api_backoff_max!r}; accepted: 0 <= api_backoff <= "
                "api_backoff_max"
            )
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
        self.unschedulable_seconds = unschedulable_seconds
        self._events_forbidden = False
        self.delete_timeout = delete_timeout
        self.stream_tail_lines = stream_tail_lines
        self.kueue_version = kueue_version
        self.watch_pods = watch_pods
        self.resize_after = resize_after
        self.gangs = GangApi(batch_api, custom_api, namespace, self._api)

    # -- API access -------------------------------------------------------------

    def _api(
        self,
        what: str,
        fn: Callable[..., T],
        *args: Any,
        expect: Iterable[int] = (),
        retries: Optional[int] = None,
        **kwargs: Any,
    ) -> T:
        """Call the API; retry transient errors; terminal ones become `KubernetesAPIError`.

        An `ApiException` whose status is in `expect` (404, 409) is re-raised for
        the caller to handle. Transient errors (`TRANSIENT_STATUSES`, connection
        failures) are retried `retries` times (default `api_retries`) with waits of
        `api_backoff`, doubled up to `api_backoff_max`; then `InfrastructureError`.
        """
        retries = self.api_retries if retries is None else retries
        expected = tuple(expect)

        def attempt() -> T:
            try:
                return fn(*args, _request_timeout=self.request_timeout, **kwargs)
            except ApiException as e:
                if e.status in expected:
                    raise
                if e.status not in TRANSIENT_STATUSES:
                    raise KubernetesAPIError(
                        f"Kubernetes API refused to {what} in namespace {self.namespace!r}: "
                        f"{e.status} {e.reason}: {api_message(e)}",
                        status=e.status,
                    ) from e
                raise Transient(e, f"{e.status} {e.reason}") from e
            except (urllib3.exceptions.HTTPError, ConnectionError) as e:
                raise Transient(e, f"{type(e).__name__}: {e}") from e

        def on_retry(_attempt: int, error: BaseException, wait: float) -> None:
            logger.warning("could not %s (%s); retrying in %.1f s", what, error, wait)

        try:
            return retry_call(
                attempt,
                retry_on=Transient,
                attempts=retries + 1,
                backoff_s=self.api_backoff,
                max_backoff_s=self.api_backoff_max,
                sleep=self.sleep,
                clock=self.clock,
                on_retry=on_retry,
                describe=what,
            )
        except RetriesExhausted as e:
            last = e.last
            assert isinstance(last, Transient)
            raise InfrastructureError(
                f"Kubernetes API unavailable: could not {what} after {e.attempts} tries; last error {last.detail}"
            ) from last.error

    def _get_job(self, name: str) -> Any:
        """The Job `name` (the client's model), None when there is none."""
        try:
            return self._api(f"read Job {name}", self.batch.read_namespaced_job, name, self.namespace, expect=(404,))
        except ApiException:
            return None

    def get_gang(self, kind: str, name: str) -> Optional[GangView]:
        """The Job or JobSet (`kind`) `name`, None when there is none (or no JobSet API on the cluster)."""
        try:
            view: GangView = self.gangs.get(kind, name, expect=(404,))
            return view
        except ApiException:
            return None

    def _pods(self, name: str) -> list[PodView]:
        pods = self._api(
            f"list pods of Job {name}",
            self.core.list_namespaced_pod,
            self.namespace,
            label_selector=f"{LABEL_JOB}={name}",
        )
        # Filter here as well: the selector is an optimisation, the label is the truth.
        views = [PodView.of(p) for p in pods.items if (p.metadata.labels or {}).get(LABEL_JOB) == name]
        return sorted(
            views,
            key=lambda v: (v.index if v.index is not None else 1 << 30, v.created.timestamp() if v.created else 0.0),
        )

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
        labels = obj.labels if isinstance(obj, GangView) else (obj.metadata.labels or {})
        wrong = {k: {"found": labels.get(k), "expected": v} for k, v in want.items() if labels.get(k) != v}
        if wrong:
            raise LaunchError(
                f"{kind} {self.namespace}/{name} exists but does not belong to this trial attempt (labels {wrong}); "
                "not touching it. Delete it if it is stale, or launch another attempt."
            )

    def _ensure_service(self, service: dict[str, Any], want: dict[str, str], w: _Watch, owner: Any) -> None:
        """Create the Service, owned by the Job `owner` (as read back, with its uid), or adopt this attempt's existing
        one."""
        name = service["metadata"]["name"]
        if owner.uid:  # every API server sets one
            service = {**service, "metadata": {**service["metadata"], "ownerReferences": [
                {"apiVersion": "batch/v1", "kind": "Job", "name": owner.name, "uid": owner.uid}]}}
        try:
            self._api(
                f"create Service {name}", self.core.create_namespaced_service, self.namespace, service, expect=(409,)
            )
        except ApiException:
            existing = self._api(f"read Service {name}", self.core.read_namespaced_service, name, self.namespace)
            self._verify(existing, want, "Service", name)
        w.owns_service = True

    def _create_gang(self, obj: dict[str, Any], want: dict[str, str], w: _Watch) -> tuple[bool, GangView]:
        """Create the Job or JobSet: (True, it as created), or (False, it) when it already existed (a retried create
        went through)."""
        name, kind = obj["metadata"]["name"], obj["kind"]
        try:
            created = self.gangs.create(kind, obj, expect=(409,))
            w.owns_job = True
            return True, created
        except ApiException as e:
            existing = self.get_gang(kind, name)
            if existing is None:
                raise InfrastructureError(
                    f"{kind} {self.namespace}/{name} was reported to exist (409) but cannot be read"
                ) from e
            self._verify(existing, want, kind, name)
            w.owns_job = True
            return False, existing

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
        self._delete(
            "Job", name, self.batch.delete_namespaced_job, log, body=V1DeleteOptions(propagation_policy="Foreground")
        )

    def delete_gang(self, kind: str, name: str, log: Any = logger) -> None:
        """Delete the Job or JobSet (`kind`) and, with it, its child Jobs, pods and owned Service (foreground)."""
        if kind == "Job":
            self.delete_job(name, log)
            return
        try:
            self.gangs.delete(kind, name, expect=(404,), retries=1)
        except ApiException:
            pass  # already gone
        except LaunchError as e:
            log.warning(f"could not delete {kind} {self.namespace}/{name}: {e}; delete it by hand "
                        f"(kubectl -n {self.namespace} delete {kind.lower()} {name})")

    def delete_service(self, name: str, log: Any = logger) -> None:
        self._delete("Service", name, self.core.delete_namespaced_service, log)

    # -- the launch ------------------------------------------------------------------

    def run(self, spec: TrainSpec, spec_uri: str, attempt: int, cfg: K8sJobConfig, log: Any = logger,
            run_id: Optional[str] = None, tick: Callable[[], None] = lambda: None, kind: str = "job") -> LaunchOutcome:
        """Launch the trial's gang for `attempt` of Dagster run `run_id` (`run_gang`) and wait for its outcome.

        A gang with a node range (`Distribution.min_nodes` below `nodes`) and a
        `resize_after` bound continues smaller after losing nodes and grows back
        (`resources.k8s.elastic.run_elastic`): a new gang per size, each one
        `run_gang` of the next generation.
        """
        if spec.distribution.elastic and self.resize_after is not None:
            if self.resize_after >= self.unschedulable_seconds:
                log.warning(
                    f"trial {spec.trial_id}: resize_after {self.resize_after:g} s is not below the unschedulable bound "
                    f"{self.unschedulable_seconds:g} s: a gang that lost a node fails as stuck before it can continue "
                    "smaller"
                )
            return run_elastic(self, spec, spec_uri, attempt, cfg, log, run_id, tick, kind, self.resize_after)
        return self.run_gang(spec, spec_uri, attempt, cfg, log, run_id, tick, kind)

    def gang_name(self, spec: TrainSpec, attempt: int, kind: str, generation: int = 0) -> str:
        """The name of the gang `run_gang` creates for `attempt` at resize `generation`."""
        max_length = MAX_JOBSET_NAME if kind == "jobset" else MAX_JOB_NAME
        return gang_name(spec.pipeline, spec.trial_id, attempt, generation, max_length=max_length)

    def run_gang(self, spec: TrainSpec, spec_uri: str, attempt: int, cfg: K8sJobConfig, log: Any = logger,
                 run_id: Optional[str] = None, tick: Callable[[], None] = lambda: None, kind: str = "job",
                 generation: int = 0, resizer: Optional[Resizer] = None) -> LaunchOutcome:
        """Launch (or re-attach to) the trial's gang for `attempt` of Dagster run `run_id` and wait for its outcome.

        `kind` "jobset": a JobSet (whole-gang restarts by its failurePolicy);
        "job": an Indexed Job and its headless Service.
        First the trial's gangs of other runs or attempts are deleted (`resources.k8s.gangs`).
        `tick` is called at every poll while the gang is watched (the launcher
        turns new Pipes progress records into observations there).

        `generation` > 0 names a resized gang of the attempt; `resizer` (an elastic
        launch's) is asked at every poll of the running gang whether to resize.

        Raises:
            TrainingConfigError, TrainingCodeError: the trial cannot succeed (terminal).
            TrainingPreempted, InfrastructureError: retryable; a new attempt resumes
                from the last committed checkpoint.
            KubernetesAPIError: the API refused a request (RBAC, invalid manifest).
            ResizeNeeded: `resizer` asked for another size; the gang was deleted.
        """
        if kind not in GANG_KINDS:
            raise ValueError(f"kind={kind!r} is not a gang kind; accepted: {', '.join(GANG_KINDS)}")
        started = self.clock()
        cfg = avoid_reported_nodes(spec, cfg, log)
        objects = trial_objects(spec, spec_uri, attempt, cfg, kind=kind, run_id=run_id, generation=generation)
        gang, service = objects[0], (objects[1] if len(objects) > 1 else None)
        name, what = gang["metadata"]["name"], kind_of(kind)
        want = trial_labels(spec, attempt, run_id)
        w = _Watch(kind=what, resizer=resizer)
        try:
            clear_other_gangs(self, spec, name, want, log, timeout=cfg.termination_grace_seconds + self.delete_timeout)
            existing = self.get_gang(what, name)
            if existing is not None:
                self._verify(existing, want, what, name)
                w.owns_job = True
                w.restarts = existing.restarts
                log.info(f"trial {spec.trial_id}: re-attaching to existing {what} {self.namespace}/{name}")
            else:
                prepare_output(spec, spec_uri)
                created, existing = self._create_gang(gang, want, w)
                if created:
                    log.info(f"trial {spec.trial_id}: created {what} {self.namespace}/{name} "
                             f"({spec.distribution.nodes} pods, queue {cfg.queue_name or '-'})")
                else:
                    log.info(f"trial {spec.trial_id}: {what} {self.namespace}/{name} already existed; re-attaching")
            if service is not None:
                self._ensure_service(service, want, w, owner=existing)
            return self._watch(spec, name, started, w, log, tick)
        except ResizeNeeded:
            w.resized = True
            raise
        finally:
            if w.finished:
                # The gang stays for its TTL (logs, debugging); rendezvous is over.
                if w.owns_service:
                    self.delete_service(name, log)
            elif w.owns_job or w.owns_service:
                if not w.resized:
                    log.warning(
                        f"trial {spec.trial_id}: leaving before {what} {self.namespace}/{name} finished; deleting it"
                    )
                if w.owns_job:
                    self.delete_gang(what, name, log)
                if w.owns_service:
                    self.delete_service(name, log)

    def _watch(self, spec: TrainSpec, name: str, started: float, w: _Watch, log: Any,
               tick: Callable[[], None] = lambda: None) -> LaunchOutcome:
        if self.watch_pods:
            w.pod_watch = PodWatch(self.core, self.namespace, name, window=max(self.poll_interval, POD_WATCH_WINDOW_S),
                                   connect_timeout=self.request_timeout[0]).start()
        try:
            return self._poll(spec, name, started, w, log, tick)
        finally:
            if w.pod_watch is not None:
                w.pod_watch.stop()

    def _poll(
        self, spec: TrainSpec, name: str, started: float, w: _Watch, log: Any, tick: Callable[[], None]
    ) -> LaunchOutcome:
        last = self.clock()
        while True:
            tick()
            gang = self.get_gang(w.kind, name)
            w.take_watched()  # after the gang's read: a pod's failure comes before the restart it causes
            now = self.clock()
            if w.state == "queued":
                w.queued_seconds += now - last
            elif w.state == "running":
                w.running_seconds += now - last
            last = now
            if gang is None:
                return self._vanished(spec, name, started, w)
            if gang.complete is not None:
                w.finished = True
                pods = self._pods(name)
                self._stream(name, w, log, pods)
                return self._success(spec, name, started, pods, w)
            if gang.failed is not None:
                w.finished = True
                raise self._failure(spec, name, gang, self._pods(name), w)
            if gang.restarts > w.restarts:
                self._report_restart(spec, gang, w, log)

            state = "queued" if gang.suspended else "running"
            if state != w.state:
                self._transition(spec, name, w, state, log)
            w.state = state
            if state == "queued":
                self._explain_queue(gang, name, w, log)
                if (
                    w.running_seconds
                ):  # suspended again: its pods are stopping, say why (a disruption) while they are there
                    self._report_pods(spec, self._pods(name), w, log, now)
                if w.queued_seconds > self.queue_timeout:
                    raise QueueTimeout(
                        f"trial {spec.trial_id}: Kueue did not admit {w.kind} {self.namespace}/{name} within "
                        f"{self.queue_timeout:.0f} s ({w.workload_note or 'no Workload status'}); deleted it"
                    )
            else:
                if w.running_seconds > self.run_timeout:
                    raise InfrastructureError(
                        f"trial {spec.trial_id}: {w.kind} {self.namespace}/{name} ran {w.running_seconds:.0f} s, past "
                        "the run "
                        f"timeout of {self.run_timeout:.0f} s; deleted it. Last log lines of rank 0:\n"
                        f"{self._log_tail(rank0_pod(self._pods(name)), self.log_tail_lines)}"
                    )
                pods = self._pods(name)
                self._report_pods(spec, pods, w, log, now)
                self._check_stuck(spec, gang, pods, w, log)
                self._stream(name, w, log, pods)
                if w.resizer is not None:
                    w.resizer.check(pods, w.running_seconds)
            self.sleep(self.poll_interval)

    def _report_restart(self, spec: TrainSpec, gang: GangView, w: _Watch, log: Any) -> None:
        """Log a JobSet's whole-gang restart: its count against maxRestarts, why, and the pod that failed."""
        # The condition while it holds; the controller's event once it is cleared (the new Jobs became ready between
        # polls).
        cause = ((gang.restarting.message if gang.restarting is not None else None)
                 or restart_cause(self._events("JobSet", gang.name) or [], gang.name, gang.uid) or "a child Job failed")
        # The pod that most likely failed the gang (its own death, not the SIGTERM its peers got after it).
        first = min(w.failed_since_restart, key=blame_order, default=None)
        culprit = f"; {first.describe()}" if first is not None else ""
        log.warning(f"trial {spec.trial_id}: JobSet {self.namespace}/{gang.name} restarts the whole gang "
                    f"(restart {gang.restarts}, at most {gang.max_restarts} counted: {cause}{culprit}); "
                    "every pod resumes from the newest committed checkpoint")
        w.restarts = gang.restarts
        w.failed_since_restart = []

    def _transition(self, spec: TrainSpec, name: str, w: _Watch, state: str, log: Any) -> None:
        if state == "queued" and w.state is None:
            log.info(f"trial {spec.trial_id}: {w.kind} {name} is queued, waiting for Kueue to admit all its pods")
        elif state == "queued":
            log.warning(f"trial {spec.trial_id}: {w.kind} {name} was suspended again (preempted by Kueue); "
                        "it resumes from its last checkpoint once re-admitted")
        elif w.state == "queued":
            log.info(f"trial {spec.trial_id}: {w.kind} {name} admitted after {w.queued_seconds:.0f} s in the queue")
        else:
            log.info(f"trial {spec.trial_id}: {w.kind} {name} is running")

    def _stream(self, name: str, w: _Watch, log: Any, pods: list[PodView]) -> None:
        """Send rank 0's new log lines to the log; a failed read skips this poll."""
        rank0 = rank0_pod(pods)
        if rank0 is None or rank0.phase == "Pending":
            return
        kwargs: dict[str, Any] = {"timestamps": True}
        now = self.clock()
        if rank0.name == w.log_pod and w.log_read_at is not None:
            # Every line since the last read (with a margin; the follower drops lines it already sent),
            # however many: a burst between two polls is not cut to a tail.
            kwargs["since_seconds"] = int(math.ceil(now - w.log_read_at + self.poll_interval)) + 5
        else:
            # A pod seen for the first time (a re-attached Job may have run for days): its recent history only.
            kwargs["tail_lines"] = self.stream_tail_lines
        try:
            text = self._read_log(rank0.name, **kwargs)
        except (ApiException, LaunchError):
            return
        w.log_pod, w.log_read_at = rank0.name, now
        for line in w.follower.new_lines(text):
            log.info(f"[rank 0] {line}")
