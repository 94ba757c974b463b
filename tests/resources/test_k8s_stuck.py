"""Admitted gangs that cannot start: the launcher logs why, waits within a bound counted in admitted time, then fails
and deletes.

Same emulated API as tests/resources/test_k8s_launcher.py (kmock over HTTP, a
FakeTime whose sleeps play the cluster). The pod conditions, container states,
events and Workloads written here have the shapes the real API serves
(core/v1 Pod status, core/v1 Event, Kueue v1beta2 Workload); what is under test
is the launcher's reaction to them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from resources.k8s.errors import StuckGang
from resources.k8s.names import COMPLETION_INDEX_ANNOTATION, LABEL_JOB, job_name
from resources.launcher import LaunchError
from tests.resources import test_k8s_launcher
from tests.resources.test_k8s_launcher import (
    JOBS,
    NS,
    SERVICES,
    Cluster,
    FakeTime,
    KubeServer,
    Recorder,
    run,
    supervisor,
    two_node_spec,
    write_result,
)

UNSCHEDULABLE = ("0/4 nodes are available: 4 Insufficient nvidia.com/gpu. preemption: 0/4 nodes are available: "
                 "4 No preemption victims found for incoming pod.")

kube = test_k8s_launcher.kube  # the emulated API server, as a fixture


def add_pending_pod(c: Cluster, job: str, index: int, suffix: str = "a", *, unschedulable: Optional[str] = None,
                    waiting: Optional[tuple[str, str]] = None) -> str:
    """A Pending pod as the API shows it: not scheduled (PodScheduled=False/Unschedulable) or with a waiting
    container."""
    pod = f"{job}-{index}-{suffix}"
    status: dict[str, Any] = {"phase": "Pending"}
    if unschedulable is not None:
        status["conditions"] = [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": unschedulable,
                "lastTransitionTime": "2026-01-01T00:00:00Z",
            }
        ]
    if waiting is not None:
        status["conditions"] = [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "False",
                                                                               "reason": "ContainersNotReady"}]
        status["containerStatuses"] = [
            {
                "name": "trainer",
                "image": "trainer:1",
                "imageID": "",
                "ready": False,
                "restartCount": 0,
                "state": {"waiting": {"reason": waiting[0], "message": waiting[1]}},
            }
        ]
    c.core.create_namespaced_pod(NS, {
        "metadata": {"name": pod, "namespace": NS, "labels": {LABEL_JOB: job, COMPLETION_INDEX_ANNOTATION: str(index)},
                     "annotations": {COMPLETION_INDEX_ANNOTATION: str(index)}},
        "spec": {"containers": [{"name": "trainer", "image": "trainer:1"}]},
        "status": status,
    })
    return pod


def delete_pods(c: Cluster, job: str) -> None:
    for pod in c.core.list_namespaced_pod(NS).items:
        if (pod.metadata.labels or {}).get(LABEL_JOB) == job:
            c.core.delete_namespaced_pod(pod.metadata.name, NS)


def play(actions: dict[float, Callable[[], Any]]) -> Callable[[float], None]:
    def hook(now: float) -> None:
        if now in actions:
            actions.pop(now)()
    return hook


def test_unschedulable_gang_fails_after_its_bound_of_admitted_time_and_is_deleted(
    kube: KubeServer, tmp_path: Path
) -> None:
    """Admitted at 10 s, unschedulable; Kueue's waitForPodsReady evicts it at 300 s (requeued, not admitted until 500
    s);
    unschedulable again: 290 s + 110 s of admitted time reach the 400 s bound at about 610 s, not at 410 s."""
    spec = two_node_spec(tmp_path)
    name = job_name(spec.pipeline, spec.trial_id, 0)
    c = Cluster(kube)

    def admit(suffix: str) -> None:
        c.admit(name)
        for i in (0, 1):
            add_pending_pod(c, name, i, suffix, unschedulable=UNSCHEDULABLE)

    def evict() -> None:
        c.suspend(name)
        delete_pods(c, name)

    t = FakeTime(play({10: lambda: admit("a"), 300: evict, 500: lambda: admit("b")}))
    log = Recorder()
    with pytest.raises(StuckGang) as err:
        run(
            supervisor(
                kube,
                clock=t.clock,
                sleep=t.sleep,
                poll_interval=10,
                unschedulable_seconds=400,
                queue_timeout=5000,
                run_timeout=5000,
            ),
            spec,
            log,
        )
    e = err.value
    assert e.kind == "unschedulable" and not e.retryable
    assert UNSCHEDULABLE in str(e) and "holds no quota" in str(e)
    assert 600 <= t.now <= 630, t.now  # the 200 s queued after the eviction did not count
    # Reported in the run's log as soon as seen, with the bound.
    assert log.count(f"pod {name}-0-a (node rank 0): Unschedulable: {UNSCHEDULABLE}") == 1, log.text()
    assert log.count("the trial fails if this lasts 400 s") >= 2
    assert log.count("was suspended again (preempted by Kueue)") == 1
    # Deleted: Job and Service gone, nothing holds quota.
    assert c.job(name) is None
    assert kube.count("DELETE", f"{JOBS}/{name}") == 1 and kube.count("DELETE", f"{SERVICES}/{name}") == 1


@pytest.mark.parametrize(
    ("reason", "message", "kind", "fails_by"),
    [
        ("ErrImagePull", 'failed to pull image "registry.example/trainer:1": not found', "image", (300, 330)),
        ("ImagePullBackOff", 'Back-off pulling image "registry.example/trainer:1"', "image", (300, 330)),
        ("CrashLoopBackOff", "back-off 5m0s restarting failed container=trainer", "crashloop", (300, 330)),
        ("CreateContainerConfigError", 'secret "wandb-credentials" not found', "config", (10, 20)),
        (
            "InvalidImageName",
            'Failed to apply default image tag "Trainer:1": invalid reference format',
            "config",
            (10, 20),
        ),
    ],
)
def test_container_that_cannot_start_fails_within_its_bound(kube: KubeServer, tmp_path: Path, reason: str, message: str,
                                                             kind: str, fails_by: tuple[float, float]) -> None:
    spec = two_node_spec(tmp_path)
    name = job_name(spec.pipeline, spec.trial_id, 0)
    c = Cluster(kube)
    t = FakeTime(
        play({10: lambda: (c.admit(name), c.add_pod(name, 0), add_pending_pod(c, name, 1, waiting=(reason, message)))})
    )
    log = Recorder()
    with pytest.raises(StuckGang, match=f"{reason}: ") as err:
        run(
            supervisor(kube, clock=t.clock, sleep=t.sleep, poll_interval=10, stuck_seconds=300, run_timeout=5000),
            spec,
            log,
        )
    assert err.value.kind == kind and message in str(err.value)
    assert fails_by[0] <= t.now <= fails_by[1], t.now
    assert log.count(f"pod {name}-1-a (node rank 1): {reason}: {message}") == 1, log.text()
    assert c.job(name) is None


def test_refused_pod_creation_is_read_from_the_jobs_events(kube: KubeServer, tmp_path: Path) -> None:
    spec = two_node_spec(tmp_path)
    name = job_name(spec.pipeline, spec.trial_id, 0)
    c = Cluster(kube)
    refused = (f'Error creating: pods "{name}-0-x7k2p" is forbidden: exceeded quota: team-gpus, requested: '
               "nvidia.com/gpu=1, used: nvidia.com/gpu=8, limited: nvidia.com/gpu=8")

    def event(ename: str, job: str, uid: str, reason: str, message: str) -> None:
        c.core.create_namespaced_event(NS, {
            "metadata": {"name": ename, "namespace": NS},
            "involvedObject": {"apiVersion": "batch/v1", "kind": "Job", "name": job, "namespace": NS, "uid": uid},
            "reason": reason, "message": message, "type": "Warning" if reason == "FailedCreate" else "Normal",
            "source": {"component": "job-controller"}, "count": 3,
            "firstTimestamp": "2026-01-01T00:00:00Z", "lastTimestamp": "2026-01-01T00:01:00Z",
        })

    def admit() -> None:
        c.admit(name)
        uid = c.job(name)["metadata"]["uid"]  # type: ignore[index]
        event("e1", name, uid, "SuccessfulCreate", f"Created pod: {name}-1-abcde")
        event("e2", name, uid, "FailedCreate", refused)
        event("e3", "some-other-job", "u-other", "FailedCreate", "Error creating: pods is forbidden: not this trial's")
        c.add_pod(name, 1)

    t = FakeTime(play({10: admit}))
    log = Recorder()
    with pytest.raises(StuckGang, match="exceeded quota: team-gpus") as err:
        run(
            supervisor(kube, clock=t.clock, sleep=t.sleep, poll_interval=10, stuck_seconds=120, run_timeout=5000),
            spec,
            log,
        )
    assert err.value.kind == "create" and "not this trial's" not in str(err.value)
    assert 120 <= t.now <= 150, t.now
    assert log.count(f"Job {name}: FailedCreate: {refused}") == 1, log.text()
    assert c.job(name) is None


def test_a_problem_that_clears_restarts_its_timer(kube: KubeServer, tmp_path: Path) -> None:
    """An image pull that backs off for 200 s twice, with a running spell between, stays under a 300 s bound."""
    spec = two_node_spec(tmp_path)
    name = job_name(spec.pipeline, spec.trial_id, 0)
    c = Cluster(kube)
    pull = ("ImagePullBackOff", 'Back-off pulling image "trainer:1"')

    def pulling(suffix: str) -> None:
        delete_pods(c, name)
        c.add_pod(name, 0, suffix)
        add_pending_pod(c, name, 1, suffix, waiting=pull)

    def running(suffix: str) -> None:
        delete_pods(c, name)
        c.add_pod(name, 0, suffix)
        c.add_pod(name, 1, suffix)

    t = FakeTime(play({10: lambda: (c.admit(name), pulling("a")), 210: lambda: running("b"), 250: lambda: pulling("c"),
                       450: lambda: running("d"), 500: lambda: (write_result(spec), c.finish(name, "Complete"))}))
    log = Recorder()
    outcome = run(
        supervisor(kube, clock=t.clock, sleep=t.sleep, poll_interval=10, stuck_seconds=300, run_timeout=5000), spec, log
    )
    assert outcome.result.world_size == 2
    assert log.count("ImagePullBackOff") == 2


def test_a_workload_kueue_deactivated_fails_the_launch(kube: KubeServer, tmp_path: Path) -> None:
    """After backoffLimitCount requeues Kueue sets spec.active=false: the Job would stay suspended for good."""
    spec = two_node_spec(tmp_path)
    name = job_name(spec.pipeline, spec.trial_id, 0)
    c = Cluster(kube)

    def deactivate() -> None:
        c.custom.create_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", NS, "workloads", {
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
            "metadata": {"name": f"job-{name}-1a2b3", "namespace": NS,
                         "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": "u1"}]},
            "spec": {"active": False, "queueName": "trainyard", "podSets": []},
            "status": {"requeueState": {"count": 3}, "conditions": [
                {"type": "Evicted", "status": "True", "reason": "Deactivated",
                 "message": "The workload is deactivated due to exceeding the maximum number of re-queuing retries"},
                {"type": "QuotaReserved", "status": "False", "reason": "Pending", "message": "evicted"},
            ]},
        })

    t = FakeTime(play({30: deactivate}))
    with pytest.raises(StuckGang, match="exceeding the maximum number of re-queuing retries") as err:
        run(supervisor(kube, clock=t.clock, sleep=t.sleep, poll_interval=10, queue_timeout=5000), spec)
    assert err.value.kind == "deactivated" and t.now <= 50
    assert c.job(name) is None


def test_bounds_and_the_active_deadline_come_from_the_environment() -> None:
    from resources.k8s.launcher import DEFAULT_ACTIVE_DEADLINE_SECONDS, KubernetesLauncher

    base = {"TRAINYARD_K8S_NAMESPACE": "vision", "TRAINYARD_TRAINER_IMAGE": "trainer@sha256:" + "0" * 64}
    default = KubernetesLauncher.from_env(base)
    assert (default.stuck_seconds, default.unschedulable_seconds) == (300, 900)
    assert default.job_config().active_deadline_seconds == DEFAULT_ACTIVE_DEADLINE_SECONDS
    custom = KubernetesLauncher.from_env(
        {
            **base,
            "TRAINYARD_K8S_STUCK_SECONDS": "120",
            "TRAINYARD_K8S_UNSCHEDULABLE_SECONDS": "1800",
            "TRAINYARD_K8S_ACTIVE_DEADLINE_SECONDS": "0",
        }
    )
    assert (custom.stuck_seconds, custom.unschedulable_seconds, custom.active_deadline_seconds) == (120, 1800, None)
    sup = custom.supervisor(None)  # type: ignore[arg-type]  # no calls: the API objects are only held
    assert (sup.stuck_seconds, sup.unschedulable_seconds) == (120, 1800)
    with pytest.raises(ValueError, match="TRAINYARD_K8S_STUCK_SECONDS='5m' is not a number of seconds"):
        KubernetesLauncher.from_env({**base, "TRAINYARD_K8S_STUCK_SECONDS": "5m"})


def test_a_job_past_its_active_deadline_is_not_retried(kube: KubeServer, tmp_path: Path) -> None:
    spec = two_node_spec(tmp_path)
    name = job_name(spec.pipeline, spec.trial_id, 0)
    c = Cluster(kube)

    def deadline() -> None:
        for i in (0, 1):
            c.end_pod(f"{name}-{i}-a", 143, "Error")
        c.finish(name, "Failed", "DeadlineExceeded", "Job was active longer than specified deadline")

    t = FakeTime(play({10: lambda: (c.admit(name), c.add_pod(name, 0), c.add_pod(name, 1)), 50: deadline}))
    with pytest.raises(LaunchError, match="activeDeadlineSeconds") as err:
        run(supervisor(kube, clock=t.clock, sleep=t.sleep, poll_interval=10, run_timeout=5000), spec)
    assert type(err.value) is LaunchError and not err.value.retryable
    assert "DeadlineExceeded: Job was active longer than specified deadline" in str(err.value)
