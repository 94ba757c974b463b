"""A pod that fails and is deleted between two polls is still named: the supervisor waits on a watch of the gang's pods.

The JobSet controller deletes a failed child Job's pods as it restarts the gang,
usually well within one poll interval (10 s by default). The controller here does
all of it while the supervisor waits: pod 1 dies (137), its peer gets SIGTERM
(143), both are deleted and the restarted gang's pods appear, all before the next
poll. Real time, the kmock API over HTTP (tests/resources/test_k8s_launcher.py).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from resources.k8s.names import job_name
from resources.k8s.pod_events import PodWatch, watch_failed_pods
from resources.k8s.pods import PodView
from tests.resources import test_k8s_launcher
from tests.resources.test_k8s_launcher import (
    CFG,
    NS,
    Cluster,
    KubeServer,
    Recorder,
    playing,
    supervisor,
    two_node_spec,
    write_result,
)

kube = test_k8s_launcher.kube  # the emulated API server, as a fixture

GROUP, VERSION = "jobset.x-k8s.io", "v1alpha2"
PODS = f"/api/v1/namespaces/{NS}/pods"
ACTION = "applying RestartJobSet failure policy action"
POLL_S = 1.0


def pod_watches(kube: KubeServer) -> int:
    """The watches of pods opened so far."""
    return sum(1 for r in kube.requests("GET", PODS) if r.params.get("watch") == "true")


def restart_between_polls(kube: KubeServer, name: str, spec: Any) -> Any:
    """The controllers: admit, run, then fail, delete and replace the gang's pods in one go, then complete."""

    def script(c: Cluster) -> None:
        c.wait(
            lambda: any(
                j["metadata"]["name"] == name
                for j in c.custom.list_namespaced_custom_object(GROUP, VERSION, NS, "jobsets")["items"]
            )
        )
        c.custom.patch_namespaced_custom_object(GROUP, VERSION, NS, "jobsets", name, {"spec": {"suspend": False}})
        c.add_pod(name, 0)
        c.add_pod(name, 1)
        # Act just after a poll, while the supervisor waits: right after it opens a watch, or 0.3 s into its sleep.
        opened, polls = pod_watches(kube), kube.count("GET", PODS)
        c.wait(lambda: pod_watches(kube) > opened or kube.count("GET", PODS) > polls + 1)
        time.sleep(0.3)
        c.end_pod(f"{name}-1-a", 137)
        c.end_pod(f"{name}-0-a", 143)
        for pod in (f"{name}-0-a", f"{name}-1-a"):
            c.core.delete_namespaced_pod(pod, NS)
        c.custom.patch_namespaced_custom_object(GROUP, VERSION, NS, "jobsets", name, {"status": {
            "restarts": 1, "restartsCountTowardsMax": 1,
            "conditions": [{"type": "RestartingJobSet", "status": "True", "reason": "DefaultFailurePolicy",
                            "message": f"{ACTION} (first failed job: {name}-node-0)"}]}})
        c.add_pod(name, 0, "b")
        c.add_pod(name, 1, "b")
        time.sleep(POLL_S + 0.5)
        write_result(spec)
        c.custom.patch_namespaced_custom_object(
            GROUP,
            VERSION,
            NS,
            "jobsets",
            name,
            {
                "status": {
                    "terminalState": "Completed",
                    "conditions": [
                        {
                            "type": "Completed",
                            "status": "True",
                            "reason": "AllJobsCompleted",
                            "message": "jobset completed successfully",
                        }
                    ],
                }
            },
        )

    return script


@pytest.mark.parametrize("watch", [True, False], ids=["watching", "sleeping"])
def test_a_pod_deleted_by_a_restart_between_two_polls_is_named_only_when_watched(
    kube: KubeServer, tmp_path: Path, watch: bool
) -> None:
    spec = two_node_spec(tmp_path)
    name = job_name(spec.pipeline, spec.trial_id, 0, max_length=48)
    log = Recorder()
    with playing(kube, restart_between_polls(kube, name, spec)):
        sup = supervisor(kube, poll_interval=POLL_S, run_timeout=30, queue_timeout=30, watch_pods=watch)
        outcome = sup.run(spec, f"{spec.output_uri}/spec.json", 0, CFG, log=log, kind="jobset")
    assert outcome.result.world_size == 2
    (restart,) = [m for _, m in log.records if "restarts the whole gang (restart" in m]
    assert f"(restart 1, at most 3 counted: {ACTION} (first failed job: {name}-node-0)" in restart, restart
    culprit = f"pod {name}-1-a (node rank 1): Failed, exit code 137"
    if watch:
        assert culprit in restart, restart  # the killed pod, not its peer (143)
        assert pod_watches(kube) >= 1
    else:  # what the supervisor saw before the watch: no pod at all, the failed ones were gone at the next poll
        assert "; pod " not in restart and culprit not in restart, restart
        assert pod_watches(kube) == 0


def test_a_watch_the_role_forbids_ends_the_pod_watch_and_polls_go_on(kube: KubeServer) -> None:
    """A Role without `watch` on pods: 403; the thread ends at once (no retry loop) and keeps nothing."""
    (
        kube.km["get"][PODS][{"watch": "true"}]
        << 403
        << {"kind": "Status", "code": 403, "reason": "Forbidden", "message": "pods is forbidden"}
    )
    core = Cluster(kube).core
    assert watch_failed_pods(core, NS, "any", 0.2, lambda pod: None, connect_timeout=5) is False
    watch = PodWatch(core, NS, "any", window=0.2, connect_timeout=5).start()
    deadline = time.monotonic() + 5
    while not watch.forbidden and time.monotonic() < deadline:
        time.sleep(0.01)
    assert watch.forbidden and watch.failed() == []
    assert pod_watches(kube) == 2


def test_a_quiet_watch_ends_with_its_window_and_keeps_only_the_gangs_failed_pods(kube: KubeServer) -> None:
    """kmock, like a server that ignores timeoutSeconds, keeps a quiet watch open: the read timeout ends the window.

    kmock also ignores the label selector: another Job's failed pod is not kept.
    """
    c = Cluster(kube)
    c.add_pod("other-job", 0)
    c.end_pod("other-job-0-a", 137)
    c.add_pod("a-job", 0)
    c.add_pod("a-job", 1)
    c.end_pod("a-job-1-a", 1)
    kept: list[PodView] = []
    started = time.monotonic()
    assert watch_failed_pods(c.core, NS, "a-job", 0.5, kept.append, connect_timeout=5) is True
    assert (
        0.45 <= time.monotonic() - started < 30.0
    )  # the 0.5 s window ended it (nothing else would); room for a loaded machine
    assert [(p.name, p.phase, p.exit_code) for p in kept] == [("a-job-1-a", "Failed", 1)]


def test_stop_ends_a_watch_blocked_in_a_long_window_at_once(kube: KubeServer) -> None:
    """The supervisor's finally: a watch stopped mid-window (60 s in production) lets go of its connection at once
    (within a second on a quiet machine; the bound leaves room for a loaded one and stays far below the window)."""
    watch = PodWatch(Cluster(kube).core, NS, "a-job", window=60, connect_timeout=5).start()
    deadline = time.monotonic() + 5
    while pod_watches(kube) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # blocked in its read now
    stopped = time.monotonic()
    watch.stop()
    while watch.running() and time.monotonic() - stopped < 15:
        time.sleep(0.01)
    assert not watch.running() and time.monotonic() - stopped < 15.0


def test_a_watch_the_api_keeps_failing_is_retried_once_a_pause_not_in_a_busy_loop(kube: KubeServer) -> None:
    """An API that answers the watch with 500 (down, restarting): the thread waits `pause` between tries."""
    (
        kube.km["get"][PODS][{"watch": "true"}]
        << 500
        << {"kind": "Status", "code": 500, "reason": "InternalError", "message": "etcd is down"}
    )
    watch = PodWatch(Cluster(kube).core, NS, "a-job", window=2, connect_timeout=5, pause=0.5).start()
    time.sleep(1.2)
    watch.stop()
    assert not watch.forbidden and 2 <= pod_watches(kube) <= 4, pod_watches(kube)
