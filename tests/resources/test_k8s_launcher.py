"""The Kubernetes launcher over real HTTP against kmock's emulated API server.

`KubeServer` (`tests.support.cluster.server`) is kmock's `KubernetesEmulator`
on a loopback port; it stores what is created and serves it back, but it
runs no controllers here (`tests/resources/test_k8s_emulated.py` runs the
process-backed cluster on it): a test thread (`play`) acts as Kueue and the Job controller,
unsuspending the Job, creating pods, writing `result.json` like the pod would and
setting Job conditions. Where time matters (timeouts), the supervisor gets a fake
clock whose sleep drives the same cluster actions synchronously.

kmock facts these tests rely on: it ignores label selectors (the launcher filters
pods by label itself), treats only lowercase `watch=true` as a watch (the
launcher polls), stores a created object before a scripted error response is
sent (so a 503 on create is "the create went through but the answer was lost",
the case that makes the retry see 409), and returns the pod object for `/log`
unless a reaction serves logs (the `logs` dict below does).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import pytest
from dagster import DagsterExecutionInterruptedError
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from resources.k8s.config import K8sJobConfig
from resources.k8s.errors import KubernetesAPIError, QueueTimeout
from resources.k8s.launcher import KubernetesLauncher, attempt_number
from resources.k8s.manifests import job_manifest, service_manifest
from resources.k8s.names import COMPLETION_INDEX_ANNOTATION, LABEL_JOB, job_name, trial_labels
from resources.k8s.pods import LogFollower
from resources.k8s.supervisor import JobSupervisor
from resources.launcher import (
    InfrastructureError,
    LaunchError,
    TrainingCodeError,
    TrainingConfigError,
    TrainingPreempted,
)
from tests.support.cluster.server import CONTROLLER_AGENT, KubeServer
from tests.support.cluster.server import launcher_requests_outside_its_role as requests_outside_role
from tests.support.train_specs import make_spec
from training.spec import Distribution, TrainResult, TrainSpec

NS = "vision"
JOBS = f"/apis/batch/v1/namespaces/{NS}/jobs"
SERVICES = f"/api/v1/namespaces/{NS}/services"
PODS = f"/api/v1/namespaces/{NS}/pods"
WORKLOADS = f"/apis/kueue.x-k8s.io/v1beta2/namespaces/{NS}/workloads"
CFG = K8sJobConfig(namespace=NS, image="trainer:1", queue_name="trainyard")


def launcher_requests_outside_its_role(server: KubeServer) -> list[str]:
    """Every request the launcher made in namespace `NS` that its Role would not allow
    (`tests.support.cluster.server`)."""
    return requests_outside_role(server, NS)


@pytest.fixture
def kube() -> Iterator[KubeServer]:
    server = KubeServer()
    yield server
    server.stop()
    # Whatever the scenario, the launcher stayed inside the access deploy/k8s gives it.
    assert launcher_requests_outside_its_role(server) == []


class Cluster:
    """Kueue, the Job controller and the pods, acting through the API like the real ones."""

    def __init__(self, server: KubeServer) -> None:
        self.server = server
        self.api = server.api_client(CONTROLLER_AGENT)
        self.batch = client.BatchV1Api(self.api)
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.errors: list[BaseException] = []
        self._ticks = 0

    def wait(self, cond: Callable[[], Any], timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError("timed out waiting for the launcher")
            time.sleep(0.01)

    def job(self, name: str) -> Optional[dict[str, Any]]:
        # Through the list endpoint: `GET jobs/<name>` is the launcher's alone, so
        # tests can script its responses and count its polls.
        items = json.loads(self.batch.list_namespaced_job(NS, _preload_content=False).data)["items"]
        return next((j for j in items if j["metadata"]["name"] == name), None)

    def sleep(self, seconds: float) -> None:
        """The launcher's sleep in threaded tests: stop it when the controller thread failed."""
        if self.errors:
            raise AssertionError(f"the controller thread failed: {self.errors[0]!r}")
        time.sleep(seconds)

    def wait_job(self, name: str) -> dict[str, Any]:
        self.wait(lambda: self.job(name) is not None)
        return self.job(name)  # type: ignore[return-value]

    def polls(self, name: str) -> int:
        return self.server.count("GET", f"{JOBS}/{name}")

    def wait_polls(self, name: str, n: int = 2) -> None:
        start = self.polls(name)
        self.wait(lambda: self.polls(name) >= start + n)

    def queue(self, name: str, message: str) -> None:
        self.custom.create_namespaced_custom_object(
            "kueue.x-k8s.io",
            "v1beta2",
            NS,
            "workloads",
            {
                "apiVersion": "kueue.x-k8s.io/v1beta2",
                "kind": "Workload",
                "metadata": {
                    "name": f"job-{name}-1a2b3",
                    "namespace": NS,
                    "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": "u1"}],
                },
                "status": {
                    "conditions": [
                        {"type": "QuotaReserved", "status": "False", "reason": "Pending", "message": message}
                    ]
                },
            },
        )

    def admit(self, name: str) -> None:
        self.batch.patch_namespaced_job(name, NS, {"spec": {"suspend": False}})

    def suspend(self, name: str) -> None:
        self.batch.patch_namespaced_job(name, NS, {"spec": {"suspend": True}})

    def add_pod(
        self, job: str, index: int, suffix: str = "a", phase: str = "Running", waiting: Optional[tuple[str, str]] = None
    ) -> str:
        pod = f"{job}-{index}-{suffix}"
        state = {"waiting": {"reason": waiting[0], "message": waiting[1]}} if waiting else {"running": {}}
        self.core.create_namespaced_pod(NS, {
            "metadata": {"name": pod, "namespace": NS,
                         "labels": {LABEL_JOB: job, COMPLETION_INDEX_ANNOTATION: str(index)},
                         "annotations": {COMPLETION_INDEX_ANNOTATION: str(index)}},
            "spec": {"containers": [{"name": "trainer", "image": "trainer:1"}]},
            "status": {"phase": phase, "containerStatuses": [
                {"name": "trainer", "image": "trainer:1", "imageID": "", "ready": phase == "Running",
                 "restartCount": 0, "state": state}]},
        })
        return pod

    def end_pod(
        self, pod: str, exit_code: int, reason: str = "Error", disruption: Optional[tuple[str, str]] = None
    ) -> None:
        conditions = (
            [{"type": "DisruptionTarget", "status": "True", "reason": disruption[0], "message": disruption[1]}]
            if disruption
            else []
        )
        self.core.patch_namespaced_pod_status(
            pod,
            NS,
            {
                "status": {
                    "phase": "Succeeded" if exit_code == 0 else "Failed",
                    "conditions": conditions,
                    "containerStatuses": [
                        {
                            "name": "trainer",
                            "image": "trainer:1",
                            "imageID": "",
                            "ready": False,
                            "restartCount": 0,
                            "state": {"terminated": {"exitCode": exit_code, "reason": reason}},
                        }
                    ],
                }
            },
        )

    def log(self, pod: str, *lines: str) -> None:
        for line in lines:
            self._ticks += 1
            self.server.logs.setdefault(pod, []).append(
                f"2026-01-01T00:{self._ticks // 60:02d}:{self._ticks % 60:02d}.{self._ticks:09d}Z {line}"
            )

    def log_reads(self, pod: str) -> int:
        return self.server.count("GET", f"{PODS}/{pod}/log")

    def finish(self, name: str, kind: str, reason: str = "", message: str = "") -> None:
        cond = {"type": kind, "status": "True", "reason": reason or kind, "message": message}
        self.batch.patch_namespaced_job_status(name, NS, {"status": {"conditions": [cond]}})


@contextmanager
def playing(server: KubeServer, script: Callable[[Cluster], None]) -> Iterator[Cluster]:
    """Run `script` in a thread as the cluster's controllers; its failures fail the test."""
    cluster = Cluster(server)
    errors = cluster.errors

    def run() -> None:
        try:
            script(cluster)
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield cluster
    finally:
        thread.join(20)
    if errors:
        raise errors[0]
    assert not thread.is_alive(), "the controller thread did not finish"


class Recorder:
    """Stands in for `context.log`."""

    def __init__(self) -> None:
        self.records: list[tuple[str, str]] = []

    def info(self, msg: str) -> None:
        self.records.append(("info", msg))

    def warning(self, msg: str) -> None:
        self.records.append(("warning", msg))

    def error(self, msg: str) -> None:
        self.records.append(("error", msg))

    def text(self) -> str:
        return "\n".join(m for _, m in self.records)

    def count(self, fragment: str) -> int:
        return sum(fragment in m for _, m in self.records)


class FakeTime:
    """A clock that moves only when slept on; `hook(now)` plays the cluster at each sleep."""

    def __init__(self, hook: Optional[Callable[[float], None]] = None) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []
        self.hook = hook

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        if self.hook is not None:
            self.hook(self.now)


def supervisor(
    server: KubeServer,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    **kw: Any,
) -> JobSupervisor:
    api = server.api_client()
    # Real-time runs stop at 20 s even if a controller thread misbehaves.
    options: dict[str, Any] = dict(
        namespace=NS, poll_interval=0.02, run_timeout=20, queue_timeout=20, api_backoff=0.01, log_tail_lines=5
    )
    options.update(kw)
    return JobSupervisor(
        client.BatchV1Api(api), client.CoreV1Api(api), client.CustomObjectsApi(api), clock, sleep, **options
    )


def two_node_spec(tmp: Path) -> TrainSpec:
    return make_spec(tmp, distribution=Distribution(nodes=2, procs_per_node=1))


def write_result(spec: TrainSpec, world_size: int = 2) -> None:
    result = TrainResult(
        trial_id=spec.trial_id, metrics={"val_acc": 0.9, "test_acc": 0.88}, best_metric=0.9, epochs=2, global_step=14,
        train_samples=420, fit_seconds=3.0, samples_per_second=140.0, wall_seconds=5.0, world_size=world_size,
        device_hours=0.001, model_uri=f"{spec.output_uri}/model",
    )
    Path(spec.output_uri, "result.json").write_text(result.model_dump_json())


def write_failure(spec: TrainSpec, record: dict[str, Any]) -> None:
    d = Path(spec.output_uri, "failures")
    d.mkdir(parents=True, exist_ok=True)
    (d / f"rank-{record['rank']}.json").write_text(json.dumps(record))


def run(sup: JobSupervisor, spec: TrainSpec, log: Optional[Recorder] = None, attempt: int = 0, cfg: K8sJobConfig = CFG):
    return sup.run(spec, f"{spec.output_uri}/spec.json", attempt, cfg, log=log or Recorder())


# -- scenarios over HTTP with a controller thread ----------------------------------


def test_admission_delay_then_success(kube: KubeServer, tmp_path: Path) -> None:
    spec = two_node_spec(tmp_path)
    name = job_name(spec.pipeline, spec.trial_id, 0)
    launcher = KubernetesLauncher(namespace=NS, image="trainer:1", api_url=kube.url, poll_interval_seconds=0.02,
                                  queue_timeout_seconds=30, run_timeout_seconds=30, gang_kind="job")
    context = SimpleNamespace(log=Recorder(), retry_number=0, run=SimpleNamespace(tags={}))
    quota = "couldn't assign flavors to pod set main: insufficient unused quota for nvidia.com/gpu in flavor a100"

    def play(c: Cluster) -> None:
        job = c.wait_job(name)
        assert job["spec"]["suspend"] is True and job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "trainyard"
        c.queue(name, quota)
        c.wait(lambda: kube.count("GET", WORKLOADS) >= 3)  # queued for a while, the launcher keeps asking why
        c.admit(name)
        pod0 = c.add_pod(name, 0)
        c.add_pod(name, 1)
        c.log(pod0, "epoch 0 loss 2.30", "epoch 1 loss 1.10")
        reads = c.log_reads(pod0)
        c.wait(lambda: c.log_reads(pod0) >= reads + 3)  # re-read windows overlap: lines must not repeat
        c.log(pod0, "epoch 2 loss 0.50")
        write_result(spec)
        for i in (0, 1):
            c.end_pod(f"{name}-{i}-a", 0, "Completed")
        c.finish(name, "Complete")

    with playing(kube, play) as cluster:
        outcome = launcher.launch(spec, context=context)

    assert outcome.result.world_size == 2 and outcome.result.trial_id == spec.trial_id
    log = context.log
    assert log.count(f"Job {name} is queued") == 1
    assert log.count(quota) == 1
    assert log.count("admitted after") == 1
    for line in ("epoch 0 loss 2.30", "epoch 1 loss 1.10", "epoch 2 loss 0.50"):
        assert log.count(f"[rank 0] {line}") == 1, log.text()
    assert "epoch 2 loss 0.50" in Path(outcome.log_uri).read_text()
    assert TrainSpec.from_json(Path(spec.output_uri, "spec.json").read_text()) == spec
    assert kube.count("POST", JOBS) == 1
    # The Service is gone with the rendezvous; the Job stays for its TTL.
    assert cluster.job(name) is not None
    with pytest.raises(client.ApiException) as gone:
        cluster.core.read_namespaced_service(name, NS)
    assert gone.value.status == 404


def test_a_disrupted_pod_fails_the_indexed_job_as_a_preemption_not_a_failure(kube: KubeServer, tmp_path: Path) -> None:
    """The Indexed Job option fails on any pod failure (backoffLimit 0): a pod with DisruptionTarget is a preemption.

    The Job's podFailurePolicy fails it (reason PodFailurePolicy); the launcher
    raises `TrainingPreempted`, which the run retries from the checkpoint the
    pods wrote on SIGTERM, under the preemption budget.
    """
    spec = two_node_spec(tmp_path)
    name = job_name(spec.pipeline, spec.trial_id, 0)
    log = Recorder()

    def play(c: Cluster) -> None:
        c.wait_job(name)
        c.admit(name)
        c.add_pod(name, 0)
        pod1 = c.add_pod(name, 1)
        c.wait_polls(name)
        c.end_pod(pod1, 143, disruption=("PreemptionByScheduler", "Preempted in order to admit critical pod"))
        c.wait_polls(name)  # the launcher sees the disrupted pod before the Job's failure
        c.finish(
            name,
            "Failed",
            "PodFailurePolicy",
            f"Pod {NS}/{name}-1-a has condition DisruptionTarget matching FailJob rule at index 0",
        )

    with playing(kube, play) as cluster, pytest.raises(TrainingPreempted) as err:
        run(supervisor(kube, sleep=cluster.sleep), spec, log)
    assert err.value.retryable
    assert f"pod {name}-1-a (node rank 1): Failed, exit code 143, PreemptionByScheduler" in str(err.value), str(
        err.value
    )
    assert "a disruption, not a failure: the run retries the trial from its last checkpoint" in str(err.value)
    assert (
        log.count("disruption, not a failure: the Job fails and the run retries the trial from its checkpoint") == 1
    ), log.text()


@pytest.mark.parametrize(
    ("case", "exit_code", "pod_reason", "job_reason", "record", "expected"),
    [
        (
            "user",
            1,
            "Error",
            "BackoffLimitExceeded",
            {
                "category": "user",
                "rank": 0,
                "error": "ValueError: loss is nan",
                "traceback": "Traceback (most recent call last): ...",
            },
            TrainingCodeError,
        ),
        ("config", 78, "Error", "PodFailurePolicy", None, TrainingConfigError),
        ("preempted", 143, "Error", "BackoffLimitExceeded", None, TrainingPreempted),
        ("oom", 137, "OOMKilled", "BackoffLimitExceeded", None, InfrastructureError),
    ],
)
def test_failure_carries_pod_reason_and_log_tail(
    kube: KubeServer,
    tmp_path: Path,
    case: str,
    exit_code: int,
    pod_reason: str,
    job_reason: str,
    record: Optional[dict[str, Any]],
    expected: type,
) -> None:
    spec = two_node_spec(tmp_path)
    name = job_name(spec.pipeline, spec.trial_id, 0)
    culprit_index = 1 if case == "oom" else 0

    def play(c: Cluster) -> None:
        c.wait_job(name)
        c.admit(name)
        pods = [c.add_pod(name, 0), c.add_pod(name, 1)]
        c.log(pods[0], *(f"rank0 step {i}" for i in range(30)))
        c.log(pods[1], *(f"rank1 step {i}" for i in range(30)))
        c.wait_polls(name)
        if record is not None:
            write_failure(spec, record)
        c.end_pod(pods[culprit_index], exit_code, pod_reason)
        c.end_pod(pods[1 - culprit_index], 143, "Error")
        c.finish(name, "Failed", job_reason, f"Job has reached the specified backoff limit ({job_reason})")

    with playing(kube, play) as cluster, pytest.raises(LaunchError) as err:
        run(supervisor(kube, sleep=cluster.sleep), spec)
    e = err.value
    assert type(e) is expected, str(e)
    message = str(e)
    assert (
        f"pod {name}-{culprit_index}-a (node rank {culprit_index}): Failed, exit code {exit_code}, {pod_reason}"
        in message
    )
    assert f"Job {NS}/{name} failed ({job_reason}:" in message
    assert "rank0 step 29" in message and "rank0 step 24" not in message  # the tail, 5 lines
    assert e.log_tail == "\n".join(f"rank0 step {i}" for i in range(25, 30))
    if case == "oom":
        assert "rank1 step 29" in message  # the failing pod's own tail, too
    if case == "user":
        assert "ValueError: loss is nan" in message and "Traceback" in message
    assert e.retryable is (case in ("preempted", "oom"))
    # A failed Job stays for debugging; only the Service goes.
    assert cluster.job(name) is not None
    assert kube.count("DELETE", f"{JOBS}/{name}") == 0 and kube.count("DELETE", f"{SERVICES}/{name}") == 1


def test_transient_errors_are_retried_and_a_409_on_create_reattaches(kube: KubeServer, tmp_path: Path) -> None:
    spec = two_node_spec(tmp_path)
    name = job_name(spec.pipeline, spec.trial_id, 0)
    # Each create goes through but its answer is a 5xx; the retry then gets 409.
    kube.km[f"post {SERVICES}"][:1] << 500
    kube.km[f"post {JOBS}"][:1] << 503
    # The 2nd and 3rd reads of the Job (after the existence check) fail too.
    kube.km[f"get {JOBS}/{name}"][1:3] << 502
    sleeps: list[float] = []

    def play(c: Cluster) -> None:
        c.wait_job(name)
        c.admit(name)
        c.add_pod(name, 0)
        c.add_pod(name, 1)
        c.wait_polls(name)
        write_result(spec)
        c.finish(name, "Complete")

    with playing(kube, play) as cluster:
        def sleep(s: float) -> None:
            sleeps.append(s)
            cluster.sleep(s)

        log = Recorder()
        outcome = run(supervisor(kube, sleep=sleep, poll_interval=0.03), spec, log)
    assert outcome.result.world_size == 2
    assert kube.count("POST", SERVICES) == 2 and kube.count("POST", JOBS) == 2
    assert (
        cluster.batch.list_namespaced_job(NS).items[0].metadata.name == name
        and len(cluster.batch.list_namespaced_job(NS).items) == 1
    )
    # Backoff doubles per retry: the Job's create, two reads of it after the 409, then the Service's create.
    assert [s for s in sleeps if s != 0.03] == [0.01, 0.01, 0.02, 0.01]
    assert log.count("already existed; re-attaching") == 1


def test_restarted_orchestrator_reattaches_to_running_job(kube: KubeServer, tmp_path: Path) -> None:
    spec = two_node_spec(tmp_path)
    name = job_name(spec.pipeline, spec.trial_id, 0)
    spec_uri = f"{spec.output_uri}/spec.json"
    # What the orchestrator that died had done: spec written, Service and Job created, Job admitted and running.
    Path(spec.output_uri).mkdir(parents=True)
    Path(spec_uri).write_text(spec.model_dump_json())
    setup = Cluster(kube)
    setup.core.create_namespaced_service(NS, service_manifest(name, CFG, labels=trial_labels(spec, 0)))
    setup.batch.create_namespaced_job(NS, job_manifest(spec, spec_uri, 0, CFG))
    setup.admit(name)
    setup.add_pod(name, 0)
    setup.add_pod(name, 1)
    creates = kube.count("POST", JOBS)

    def play(c: Cluster) -> None:
        c.wait_polls(name, 3)
        write_result(spec)
        c.finish(name, "Complete")

    log = Recorder()
    with playing(kube, play) as cluster:
        outcome = run(supervisor(kube, sleep=cluster.sleep), spec, log)
    assert outcome.result.world_size == 2
    assert kube.count("POST", JOBS) == creates  # no second Job
    assert Path(spec_uri).read_text() == spec.model_dump_json()  # a running trial's files are not touched
    assert log.count(f"re-attaching to existing Job {NS}/{name}") == 1


def test_restarted_orchestrator_collects_a_finished_job(kube: KubeServer, tmp_path: Path) -> None:
    spec = two_node_spec(tmp_path)
    name = job_name(spec.pipeline, spec.trial_id, 0)
    setup = Cluster(kube)
    setup.core.create_namespaced_service(NS, service_manifest(name, CFG, labels=trial_labels(spec, 0)))
    setup.batch.create_namespaced_job(NS, job_manifest(spec, "s", 0, CFG))
    setup.finish(name, "Complete")
    Path(spec.output_uri).mkdir(parents=True)
    write_result(spec)
    outcome = run(supervisor(kube), spec)
    assert outcome.result.world_size == 2
    assert kube.count("POST", JOBS) == 1 and kube.count("DELETE", f"{SERVICES}/{name}") == 1


def test_a_job_of_another_trial_under_the_name_is_left_alone(kube: KubeServer, tmp_path: Path) -> None:
    spec = two_node_spec(tmp_path)
    name = job_name(spec.pipeline, spec.trial_id, 0)
    foreign = job_manifest(spec, "s", 0, CFG)
    foreign["metadata"]["labels"]["trainyard.io/trial"] = "trial-9999"
    Cluster(kube).batch.create_namespaced_job(NS, foreign)
    with pytest.raises(LaunchError, match="does not belong to this trial attempt") as err:
        run(supervisor(kube), spec)
    assert "trial-9999" in str(err.value) and not err.value.retryable
    assert kube.count("DELETE", f"{JOBS}/{name}") == 0 and Cluster(kube).job(name) is not None


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, DagsterExecutionInterruptedError])
def test_cancellation_deletes_job_and_service(kube: KubeServer, tmp_path: Path, interrupt: type[BaseException]) -> None:
    spec = two_node_spec(tmp_path)
    name = job_name(spec.pipeline, spec.trial_id, 0)
    running = threading.Event()

    def sleep(s: float) -> None:
        if running.is_set():
            raise interrupt()
        cluster.sleep(s)

    def play(c: Cluster) -> None:
        c.wait_job(name)
        c.admit(name)
        c.add_pod(name, 0)
        c.add_pod(name, 1)
        c.wait(lambda: kube.count("GET", PODS) >= 2)
        running.set()

    with playing(kube, play) as cluster, pytest.raises(interrupt):
        run(supervisor(kube, sleep=sleep), spec)
    deletes = kube.requests("DELETE", f"{JOBS}/{name}")
    assert len(deletes) == 1 and deletes[0].data == {"propagationPolicy": "Foreground"}
    assert kube.count("DELETE", f"{SERVICES}/{name}") == 1
    assert cluster.job(name) is None


# -- time-driven scenarios: fake clock, the cluster played from its sleep ------------


def suspended_and_resumed(kube: KubeServer, spec: TrainSpec, suspend: Callable[[Cluster, str], Any],
                          between: Optional[Callable[[Cluster, str], Any]] = None) -> tuple[Any, Recorder]:
    """Fake clock: queued 0-100 s, runs 100-120 s, `suspend` at 120 s, `between` at 130 s, re-admitted with new pods
    150 s, done at 175 s; what the supervisor returned (run timeout 50 s, queue timeout 500 s) and its log."""
    name = job_name(spec.pipeline, spec.trial_id, 0)
    cluster = Cluster(kube)
    actions = {
        100: lambda: (cluster.admit(name), cluster.add_pod(name, 0), cluster.add_pod(name, 1)),
        120: lambda: suspend(cluster, name),
        130: lambda: between(cluster, name) if between else None,
        150: lambda: (cluster.admit(name), cluster.add_pod(name, 0, "b"), cluster.add_pod(name, 1, "b")),
        175: lambda: (write_result(spec), cluster.finish(name, "Complete")),
    }

    def hook(now: float) -> None:
        if now in actions:
            actions.pop(now)()

    t = FakeTime(hook)
    log = Recorder()
    return run(
        supervisor(kube, clock=t.clock, sleep=t.sleep, poll_interval=5, run_timeout=50, queue_timeout=500), spec, log
    ), log


def test_queued_time_does_not_count_against_the_run_timeout(kube: KubeServer, tmp_path: Path) -> None:
    """Queued 0-100 s, runs 100-120 s, preempted by Kueue (suspended) 120-150 s, runs 150-175 s.

    45 s of running time: within a run timeout of 50 s although 175 s passed.
    """
    spec = two_node_spec(tmp_path)
    outcome, log = suspended_and_resumed(kube, spec, lambda cluster, name: cluster.suspend(name))
    assert outcome.result.world_size == 2 and outcome.seconds == pytest.approx(175)
    assert log.count("admitted after 100 s in the queue") == 1
    assert log.count("was suspended again (preempted by Kueue)") == 1
    assert log.count("admitted after 130 s in the queue") == 1  # queued time is a total


def test_pods_stopped_by_a_suspension_are_reported_as_a_disruption(kube: KubeServer, tmp_path: Path) -> None:
    """Kueue preempts: the pods get DisruptionTarget and stop on SIGTERM and the Job is suspended in one pass.

    No poll saw the pods disrupted while the gang ran; the launcher still says, once per pod
    and while they are there, that they were disrupted and why, then resumes the gang.
    """
    spec = two_node_spec(tmp_path)
    name = job_name(spec.pipeline, spec.trial_id, 0)
    why = ("PreemptionByKueue", "Kueue preempted Workload w to accommodate a higher priority workload")

    def preempt(cluster: Cluster, name: str) -> None:
        for index in (0, 1):
            cluster.end_pod(f"{name}-{index}-a", 143, disruption=why)
        cluster.suspend(name)

    def gone(cluster: Cluster, name: str) -> None:
        for index in (0, 1):
            cluster.core.delete_namespaced_pod(f"{name}-{index}-a", NS)

    outcome, log = suspended_and_resumed(kube, spec, preempt, gone)
    assert outcome.result.world_size == 2
    assert log.count("was suspended again (preempted by Kueue)") == 1
    for index in (0, 1):
        assert log.count(f"pod {name}-{index}-a (node rank {index}): Failed, exit code 143, PreemptionByKueue") == 1, (
            log.text()
        )
    assert log.count("disruption, not a failure") == 2, log.text()


def test_a_jobset_restart_seen_only_after_its_condition_cleared_names_its_cause_from_the_event(
        kube: KubeServer, tmp_path: Path) -> None:
    """The JobSet controller restarts the gang and clears RestartingJobSet (new Jobs ready) between two polls.

    The launcher never sees the condition; the cause and the first failed Job still reach the
    log, from the controller's restart event on this JobSet (not the decoys: another JobSet's,
    and an earlier incarnation's of the same name), with the pod that failed first.
    """
    spec = two_node_spec(tmp_path)
    name = job_name(spec.pipeline, spec.trial_id, 0, max_length=48)
    cluster = Cluster(kube)
    group, version = "jobset.x-k8s.io", "v1alpha2"
    action = "applying RestartJobSet failure policy action"

    def jobset() -> dict[str, Any]:
        return cluster.custom.get_namespaced_custom_object(group, version, NS, "jobsets", name)

    def status(**fields: Any) -> None:
        cluster.custom.patch_namespaced_custom_object(group, version, NS, "jobsets", name, {"status": fields})

    def event(about: str, uid: str, message: str, at: str) -> None:
        cluster.core.create_namespaced_event(
            NS,
            {
                "metadata": {"name": f"{about}.{at[-3:-1]}", "namespace": NS},
                "involvedObject": {
                    "kind": "JobSet",
                    "name": about,
                    "namespace": NS,
                    "uid": uid,
                    "apiVersion": f"{group}/{version}",
                },
                "reason": "RestartJobSetFailurePolicyAction",
                "message": message,
                "type": "Warning",
                "firstTimestamp": at,
                "lastTimestamp": at,
            },
        )

    def restart() -> None:
        for pod in (f"{name}-0-a", f"{name}-1-a"):
            cluster.core.delete_namespaced_pod(pod, NS)
        uid = jobset()["metadata"]["uid"]
        event(name, "uid-of-an-earlier-jobset", f"{action} (first failed job: {name}-worker-9)", "2026-01-01T00:00:50Z")
        event(f"{name}x", "other", f"{action} (first failed job: {name}x-node-1)", "2026-01-01T00:00:40Z")
        event(name, uid, f"{action} (first failed job: {name}-node-0)", "2026-01-01T00:00:30Z")
        ready = {"type": "RestartingJobSet", "status": "False", "reason": "JobsReady", "message": "all jobs are ready",
                 "lastTransitionTime": "2026-01-01T00:00:31Z"}
        status(restarts=1, restartsCountTowardsMax=1, conditions=[ready])
        cluster.add_pod(name, 0, "b")
        cluster.add_pod(name, 1, "b")

    def complete() -> None:
        write_result(spec)
        status(
            terminalState="Completed",
            conditions=[
                {
                    "type": "Completed",
                    "status": "True",
                    "reason": "AllJobsCompleted",
                    "message": "jobset completed successfully",
                }
            ],
        )

    actions = {
        10: lambda: (
            cluster.custom.patch_namespaced_custom_object(
                group, version, NS, "jobsets", name, {"spec": {"suspend": False}}
            ),
            cluster.add_pod(name, 0),
            cluster.add_pod(name, 1),
        ),
        20: lambda: (cluster.end_pod(f"{name}-1-a", 137), cluster.end_pod(f"{name}-0-a", 143)),
        25: restart,
        40: complete,
    }
    t = FakeTime(lambda now: actions.pop(now)() if now in actions else None)
    log = Recorder()
    sup = supervisor(kube, clock=t.clock, sleep=t.sleep, poll_interval=5, run_timeout=500, queue_timeout=500)
    outcome = sup.run(spec, f"{spec.output_uri}/spec.json", 0, CFG, log=log, kind="jobset")
    assert outcome.result.world_size == 2
    (restarted,) = [m for _, m in log.records if "restarts the whole gang (restart" in m]
    assert f"(restart 1, at most 3 counted: {action} (first failed job: {name}-node-0); " in restarted, restarted
    assert f"pod {name}-1-a (node rank 1): Failed, exit code 137" in restarted, restarted


def test_a_job_deleted_under_the_launcher_is_an_infrastructure_error(kube: KubeServer, tmp_path: Path) -> None:
    spec = two_node_spec(tmp_path)
    name = job_name(spec.pipeline, spec.trial_id, 0)
    cluster = Cluster(kube)

    def hook(now: float) -> None:
        if now == 10:
            cluster.batch.delete_namespaced_job(name, NS)

    t = FakeTime(hook)
    with pytest.raises(InfrastructureError, match="disappeared before finishing") as err:
        run(supervisor(kube, clock=t.clock, sleep=t.sleep, poll_interval=10), spec)
    assert err.value.retryable and kube.count("DELETE", f"{SERVICES}/{name}") == 1


def test_queue_timeout_deletes_the_job(kube: KubeServer, tmp_path: Path) -> None:
    spec = two_node_spec(tmp_path)
    name = job_name(spec.pipeline, spec.trial_id, 0)
    cluster = Cluster(kube)
    cluster.queue(name, "insufficient unused quota for nvidia.com/gpu")
    t = FakeTime()
    with pytest.raises(QueueTimeout, match="within 60 s .*insufficient unused quota") as err:
        run(supervisor(kube, clock=t.clock, sleep=t.sleep, poll_interval=10, queue_timeout=60, run_timeout=1), spec)
    assert err.value.retryable
    assert cluster.job(name) is None and kube.count("DELETE", f"{SERVICES}/{name}") == 1


def test_run_timeout_deletes_the_job(kube: KubeServer, tmp_path: Path) -> None:
    spec = two_node_spec(tmp_path)
    name = job_name(spec.pipeline, spec.trial_id, 0)
    cluster = Cluster(kube)

    def hook(now: float) -> None:
        if now == 10:
            cluster.admit(name)
            cluster.log(cluster.add_pod(name, 0), "still training")
            cluster.add_pod(name, 1)

    t = FakeTime(hook)
    with pytest.raises(InfrastructureError, match="past the run timeout of 50 s") as err:
        run(supervisor(kube, clock=t.clock, sleep=t.sleep, poll_interval=10, run_timeout=50, queue_timeout=500), spec)
    assert "still training" in str(err.value)
    assert cluster.job(name) is None


def test_a_container_that_cannot_start_fails_the_launch(kube: KubeServer, tmp_path: Path) -> None:
    spec = two_node_spec(tmp_path)
    name = job_name(spec.pipeline, spec.trial_id, 0)
    cluster = Cluster(kube)

    def hook(now: float) -> None:
        if now == 10:
            cluster.admit(name)
            cluster.add_pod(name, 0, phase="Pending",
                            waiting=("CreateContainerConfigError", 'secret "wandb-credentials" not found'))

    t = FakeTime(hook)
    log = Recorder()
    with pytest.raises(LaunchError, match='CreateContainerConfigError: secret "wandb-credentials" not found') as err:
        run(
            supervisor(kube, clock=t.clock, sleep=t.sleep, poll_interval=10, stuck_seconds=60, run_timeout=1000),
            spec,
            log,
        )
    assert not err.value.retryable and log.count("CreateContainerConfigError") == 1
    assert cluster.job(name) is None


def test_api_refusal_is_terminal_and_not_retried(kube: KubeServer, tmp_path: Path) -> None:
    spec = two_node_spec(tmp_path)
    name = job_name(spec.pipeline, spec.trial_id, 0)
    (
        kube.km[f"post {JOBS}"]
        << 403
        << {"kind": "Status", "code": 403, "message": 'jobs.batch is forbidden: User "x" cannot create'}
    )
    t = FakeTime()
    with pytest.raises(KubernetesAPIError, match="refused to create Job .* 403 .*forbidden") as err:
        run(supervisor(kube, clock=t.clock, sleep=t.sleep), spec)
    assert err.value.status == 403 and not err.value.retryable
    assert kube.count("POST", JOBS) == 1 and t.sleeps == []
    # The Service comes after its Job: none was made, none is left behind.
    assert kube.count("POST", SERVICES) == 0 and kube.count("DELETE", f"{SERVICES}/{name}") == 0


def test_api_outage_is_retryable_after_backoff(kube: KubeServer, tmp_path: Path) -> None:
    spec = two_node_spec(tmp_path)
    name = job_name(spec.pipeline, spec.trial_id, 0)
    kube.km[f"get {JOBS}/{name}"] << 503
    t = FakeTime()
    with pytest.raises(InfrastructureError, match="could not read Job .* after 3 tries; last error 503") as err:
        run(supervisor(kube, clock=t.clock, sleep=t.sleep, api_retries=2, api_backoff=1.0), spec)
    assert err.value.retryable and t.sleeps == [1.0, 2.0]
    assert kube.count("POST", JOBS) == 0 and kube.count("POST", SERVICES) == 0


def test_unreachable_api_server_is_retryable(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    api = client.ApiClient(client.Configuration(host=f"http://127.0.0.1:{port}"))
    api.configuration.retries = 0
    t = FakeTime()
    sup = JobSupervisor(client.BatchV1Api(api), client.CoreV1Api(api), client.CustomObjectsApi(api), t.clock, t.sleep,
                        namespace=NS, api_retries=1)
    with pytest.raises(InfrastructureError, match="Kubernetes API unavailable"):
        run(sup, two_node_spec(tmp_path))
    assert t.sleeps == [1.0]


def test_api_backoff_is_capped_and_the_last_error_is_chained() -> None:
    calls: list[dict[str, Any]] = []

    def unavailable(*args: Any, **kwargs: Any) -> None:
        calls.append(kwargs)
        raise ApiException(status=503, reason="Service Unavailable")

    t = FakeTime()
    sup = JobSupervisor(
        None, None, None, t.clock, t.sleep, namespace=NS, api_retries=4, api_backoff=1.0, api_backoff_max=3.0
    )
    with pytest.raises(
        InfrastructureError, match="could not list things after 5 tries; last error 503 Service Unavailable"
    ) as err:
        sup._api("list things", unavailable)
    assert t.sleeps == [1.0, 2.0, 3.0, 3.0] and len(calls) == 5
    assert isinstance(err.value.__cause__, ApiException) and err.value.__cause__.status == 503
    assert calls[0] == {"_request_timeout": sup.request_timeout}


# -- pure pieces --------------------------------------------------------------------


def test_log_follower_emits_each_line_once() -> None:
    f = LogFollower()
    first = "2026-01-01T00:00:01.5Z a\n2026-01-01T00:00:02Z b\n2026-01-01T00:00:02Z c\n"
    assert f.new_lines(first) == ["a", "b", "c"]
    # The next window overlaps, repeats an instant with a new line, and adds later ones.
    again = "2026-01-01T00:00:02Z b\n2026-01-01T00:00:02Z c\n2026-01-01T00:00:02Z d\n2026-01-01T00:00:02.000000001Z e\n"
    assert f.new_lines(again) == ["d", "e"]
    assert f.new_lines("2026-01-01T00:00:01.9Z late\nnot a log line\n") == []


def test_attempt_number_separates_step_and_run_retries() -> None:
    assert attempt_number(None) == 0
    assert attempt_number(SimpleNamespace(retry_number=2, run=SimpleNamespace(tags={}))) == 2
    assert (
        attempt_number(SimpleNamespace(retry_number=1, run=SimpleNamespace(tags={"dagster/retry_number": "3"}))) == 301
    )


def test_resource_validates_job_config_and_reads_env() -> None:
    with pytest.raises(Exception, match="namespace='Vision' is not a DNS label"):
        KubernetesLauncher(namespace="Vision", image="trainer:1")
    with pytest.raises(ValueError, match="TRAINYARD_TRAINER_IMAGE"):
        KubernetesLauncher.from_env({"TRAINYARD_K8S_NAMESPACE": "vision"})
    launcher = KubernetesLauncher.from_env({
        "TRAINYARD_K8S_NAMESPACE": "vision", "TRAINYARD_TRAINER_IMAGE": "reg/trainer:1.4.0",
        "TRAINYARD_K8S_PRIORITY_CLASS": "trainyard-sweep", "TRAINYARD_K8S_SECRETS": "wandb, s3",
        "AWS_ENDPOINT_URL": "http://minio:9000", "TRAINYARD_K8S_GPUS_PER_POD": "4",
    })
    cfg = launcher.job_config()
    assert cfg.queue_name == "trainyard" and cfg.priority_class == "trainyard-sweep"
    assert cfg.env_from_secrets == ("wandb", "s3") and cfg.env == {"AWS_ENDPOINT_URL": "http://minio:9000"}
    assert cfg.gpus_per_pod == 4


def test_the_role_check_sees_a_request_outside_the_role() -> None:
    server = KubeServer()
    try:
        api = server.api_client()
        client.BatchV1Api(api).create_namespaced_job(NS, {"metadata": {"name": "j"}})
        with pytest.raises(ApiException):
            client.CoreV1Api(api).read_namespaced_secret("trainyard-storage", NS)
        client.BatchV1Api(api).patch_namespaced_job("j", NS, {"spec": {"suspend": False}}, _preload_content=False)
        client.BatchV1Api(server.api_client(CONTROLLER_AGENT)).list_namespaced_job(
            NS, _preload_content=False
        )  # the test's own: not counted
    finally:
        server.stop()
    assert launcher_requests_outside_its_role(server) == [
        f"GET /api/v1/namespaces/{NS}/secrets/trainyard-storage (get core/secrets)",
        f"PATCH {JOBS}/j (patch batch/jobs)",
    ]
