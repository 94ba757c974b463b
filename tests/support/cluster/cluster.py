"""`EmulatedCluster`: the API server, the controllers in one thread, and the pods as local processes.

    with EmulatedCluster(tmp_path / "cluster", kueue=KueueSettings(pods_ready_timeout=30)) as cluster:
        launcher = KubernetesLauncher(namespace="vision", image="trainer:1", api_url=cluster.url, ...)
        outcome = launcher.launch(spec)

Tests act only as a user or the cluster would: `kill` sends a signal to a
pod's process, `preempt` asks Kueue to evict a gang, `lose_node` takes a node's
capacity away and SIGKILLs its pods' processes (`return_node` gives it back); every exit code, phase and
condition comes from the processes and the controllers' rules
(`tests.support.cluster.controllers`). A failure inside the control loop stops
it and is raised by `check()`, by `wait_for` and on leaving the context.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Optional, TypeVar

from tests.support.cluster.api import Api
from tests.support.cluster.controllers import (
    TERMINAL,
    GarbageCollector,
    JobController,
    KueueController,
    KueueSettings,
    Node,
    Scheduler,
    conditions,
)
from tests.support.cluster.jobset import JobSetController
from tests.support.cluster.kubelet import Kubelet
from tests.support.cluster.server import KubeServer

T = TypeVar("T")


class EmulatedCluster:
    """A process-backed Kubernetes cluster with Kueue, for the launcher's tests.

    Args:
        root: where pods' emptyDirs are made.
        nodes: the nodes pods can be scheduled on (default: two with 8 CPUs, 32 Gi, no GPU).
        kueue: the ClusterQueue's quota and `waitForPodsReady` settings.
        node_env: environment the emulated nodes add to every container (this
            machine's settings, e.g. `OMP_NUM_THREADS`); never the trial's own settings.
        pod_backoff_seconds: the Job controller's first delay before re-creating a
            failed pod, doubled per counted failure (Kubernetes: 10 s).
        tick: seconds between reconcile steps.
    """

    def __init__(
        self,
        root: Path,
        nodes: Optional[list[Node]] = None,
        kueue: Optional[KueueSettings] = None,
        node_env: Optional[dict[str, str]] = None,
        pod_backoff_seconds: float = 1.0,
        tick: float = 0.1,
    ) -> None:
        self.root = root
        self.nodes = nodes if nodes is not None else [Node("node-a"), Node("node-b")]
        self.kueue_settings = kueue or KueueSettings()
        self.node_env = dict(node_env or {})
        self.pod_backoff_seconds = pod_backoff_seconds
        self.tick = tick
        self.errors: list[BaseException] = []
        self._lost: dict[str, Node] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "EmulatedCluster":
        self.server = KubeServer(graceful=True)
        self.url = self.server.url
        self.api = Api(self.url)
        self.gc = GarbageCollector(self.api)
        self.kueue = KueueController(self.api, self.kueue_settings)
        self.jobs = JobController(self.api, self.pod_backoff_seconds)
        self.jobsets = JobSetController(self.api)
        self.scheduler = Scheduler(self.api, self.nodes)
        self.kubelet = Kubelet(self.api, self.root, self.server.logs, self.node_env)
        self._thread = threading.Thread(target=self._loop, name="emulated-cluster", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        self.kubelet.stop_all()
        self.server.stop()
        if exc is None:
            self.check()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except (
                BaseException
            ) as e:  # re-raised in the test by check(); the cluster stops like a crashed control plane
                self.errors.append(e)
                self.kubelet.stop_all()
                return
            self._stop.wait(self.tick)

    def step(self) -> None:
        """One reconcile pass of every controller over a fresh read of the API."""
        pods = self.api.list("Pod")
        services = self.api.list("Service")
        workloads = self.api.list("Workload")
        jobs = self.api.list("Job")
        jobsets = self.api.list("JobSet")
        self.gc.step([*pods, *services, *workloads, *jobs], [*jobs, *jobsets])
        self.kueue.step(jobs, pods, workloads, jobsets)
        self.jobsets.step(jobsets, jobs, services)
        jobs = self.api.list("Job")
        self.jobs.step(jobs, pods)
        pods = self.api.list("Pod")
        self.scheduler.step(pods)
        self.kubelet.step(pods, self.api.list("Service"))

    def check(self) -> None:
        """Raise the control loop's failure, if it had one."""
        if self.errors:
            raise AssertionError(f"the emulated cluster's control loop failed: {self.errors[0]!r}") from self.errors[0]

    # -- what tests do, as a user or the cluster would ------------------------------

    def kill(self, pod: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to the main process of running pod `pod` (as `kill` on its node does)."""
        self.kubelet.signal(pod, sig)

    def lose_node(self, name: str) -> list[str]:
        """Node `name` is lost: its capacity is gone (the scheduler places nothing there) and every process of its pods
        is SIGKILLed by PID (exit 137, as the runtime reports a killed container); the names of the pods killed.

        A pod bound there that had not started is Failed with a DisruptionTarget condition, as PodGC marks it.
        """
        node = next((n for n in self.nodes if n.name == name), None)
        if node is None:
            raise LookupError(f"no node {name}; nodes: {[n.name for n in self.nodes]}")
        self._lost[name] = node
        self.nodes.remove(node)
        return self.kubelet.lose_node(name)

    def return_node(self, name: str) -> None:
        """Node `name` (lost by `lose_node`) is back with its capacity."""
        node = self._lost.pop(name)
        self.kubelet.return_node(name)
        self.nodes.append(node)

    def preempt(self, gang: str, namespace: str) -> None:
        """Ask Kueue to preempt the admitted Workload of Job or JobSet `gang`: evicted with reason Preempted, its pods
        stopped."""
        self.kueue.preempt_requests.add((namespace, gang))

    # -- reading the cluster ----------------------------------------------------------

    def wait_for(self, what: str, cond: Callable[[], Optional[T]], timeout: float = 120.0, every: float = 0.2) -> T:
        """Poll `cond` until it returns a truthy value; that value.

        Raises:
            AssertionError: `timeout` seconds passed (naming `what`), or the control loop failed.
        """
        deadline = time.monotonic() + timeout
        while True:
            self.check()
            value = cond()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(every)

    def pods(self, job: Optional[str] = None) -> list[dict[str, Any]]:
        """Pods (of Job `job`), oldest first."""
        pods = [
            p
            for p in self.api.list("Pod")
            if job is None or p["metadata"]["labels"].get("batch.kubernetes.io/job-name") == job
        ]
        return sorted(pods, key=lambda p: p["metadata"]["creationTimestamp"])

    def running(self, job: str) -> list[dict[str, Any]]:
        return [
            p
            for p in self.pods(job)
            if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
        ]

    def job(self, name: str, namespace: str) -> Optional[dict[str, Any]]:
        return self.api.get("Job", namespace, name)

    def job_conditions(self, name: str, namespace: str) -> dict[str, dict[str, Any]]:
        job = self.job(name, namespace)
        return conditions(job) if job is not None else {}

    def jobset(self, name: str, namespace: str) -> Optional[dict[str, Any]]:
        return self.api.get("JobSet", namespace, name)

    def objects(self, kind: str) -> list[dict[str, Any]]:
        return self.api.list(kind)

    def live_processes(self) -> list[str]:
        """Pods whose processes are still running here."""
        return [p.name for p in self.kubelet.procs.values() if p.exit_code() is None]

    def quota_used(self) -> dict[str, str]:
        """What admitted Workloads hold of the ClusterQueue's quota (resource -> amount; empty when nothing)."""
        return {k: str(v) for k, v in self.kueue.used(self.api.list("Workload")).items() if v}

    def log(self, pod: str) -> str:
        return "\n".join(line.split(" ", 1)[1] for line in self.server.logs.get(pod, []))

    def pod_phases(self, job: str) -> list[tuple[str, str, Optional[int]]]:
        """(pod, phase, exit code) of every pod of `job`, oldest first."""
        from tests.support.cluster.controllers import exit_code

        return [(p["metadata"]["name"], p["status"].get("phase", ""), exit_code(p)) for p in self.pods(job)]


__all__ = ["TERMINAL", "EmulatedCluster", "KueueSettings", "Node"]
