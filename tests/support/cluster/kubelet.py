"""What a kubelet does with the pods bound to the emulated nodes: each container a local process group.

`Kubelet` (one reconcile step over the pods, for every node at once) starts
bound pods, reports their phase, Ready and the container's real exit status,
stops terminating pods (SIGTERM, grace period, SIGKILL) and releases them; a pod
deleted before it ran is marked Failed first, as PodGC does. `PodProcess` is
one container.

The container's command and environment are the rendered manifest's, resolved
the way the kubelet resolves them:

- `$(VAR)` in the command expands from the container's environment (`$$` is a
  literal `$`, an undefined variable stays as written);
- `env` values, `fieldRef`s (the pod's name, namespace, uid, labels,
  annotations, node) and Secret references (`secretKeyRef`, `envFrom`; a missing
  Secret is the container's `CreateContainerConfigError`, as on a node);
- every emptyDir is a fresh local directory; variables and the working
  directory naming paths inside a mount point at it (`tests.support.k8s`);
- the image's `python` is this virtualenv's interpreter, its `ENV` is
  `IMAGE_ENV` with PYTHONPATH at this checkout, and `PATH`/`LANG` come from here.

The one substitution that is not Kubernetes behaviour is DNS: a name
`<hostname>.<subdomain>` of a pod that exists, whose subdomain is a Service of
its namespace, is replaced by 127.0.0.1 in the command and the environment
(every pod runs here). A name nothing resolves stays, and fails as it would.

The process runs in its own session; every process it starts carries the
marker variable `POD_MARKER` with the pod's uid, so stopping the pod finds and
kills all of them, as tearing down the container's cgroup does. The container's
"PID 1" (the command) gets SIGTERM on deletion and, past the grace period,
everything gets SIGKILL; when PID 1 exits, whatever it left behind is killed.
"""

from __future__ import annotations

import base64
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import psutil

from tests.support.cluster.api import Api
from tests.support.cluster.controllers import TERMINAL, now_iso, terminating, with_condition
from tests.support.cluster.server import KUBELET_FINALIZER, log_stamp
from tests.support.k8s import local_env, local_volumes, remap

ROOT = Path(__file__).resolve().parents[3]
POD_MARKER = "TRAINYARD_EMULATED_POD_UID"
# The trainer image's ENV (deploy/docker/trainer.Dockerfile); HOME is its emptyDir, PYTHONPATH this checkout.
IMAGE_ENV = {"PYTHONUNBUFFERED": "1", "PIP_NO_CACHE_DIR": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
             "HOME": "/home/trainer", "PYTHONPATH": str(ROOT)}
_VAR = re.compile(r"\$(\$|\(([A-Za-z_][A-Za-z0-9_.-]*)\))")
_FIELD = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")


class ContainerConfigError(Exception):
    """The container cannot be configured (a missing Secret or key, an unknown fieldRef): CreateContainerConfigError."""


def expand(text: str, env: dict[str, str]) -> str:
    """`text` with `$(VAR)` expanded from `env` as the kubelet does (`$$` escapes, an unknown variable stays)."""
    def sub(m: re.Match[str]) -> str:
        if m.group(1) == "$":
            return "$"
        return env.get(m.group(2), m.group(0))
    return _VAR.sub(sub, text)


def field_value(pod: dict[str, Any], path: str) -> str:
    """The value of a downward-API `fieldRef` path of `pod`.

    Raises:
        ContainerConfigError: a path the kubelet would not resolve here.
    """
    meta, spec, status = pod["metadata"], pod.get("spec", {}), pod.get("status", {})
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
        "status.podIP": status.get("podIP"),
        "status.hostIP": status.get("hostIP"),
    }
    if path in simple and simple[path] is not None:
        return str(simple[path])
    m = _FIELD.match(path)
    if m:
        return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
    raise ContainerConfigError(f"fieldRef {path!r} cannot be resolved")


def secrets_of(container: dict[str, Any]) -> set[str]:
    """Names of the Secrets the container's environment references."""
    names = {ref["secretRef"]["name"] for ref in container.get("envFrom") or [] if "secretRef" in ref}
    names |= {v["valueFrom"]["secretKeyRef"]["name"] for v in container.get("env") or []
              if "secretKeyRef" in (v.get("valueFrom") or {})}
    return names


def resolve_names(text: str, records: dict[str, str]) -> str:
    """`text` with each DNS name in `records` (whole names only) replaced by its address."""
    for name in sorted(records, key=len, reverse=True):
        text = re.sub(rf"(?<![\w.-]){re.escape(name)}(?![\w-]|\.[\w-])", records[name], text)
    return text


class PodProcess:
    """One pod's container as a local process group, its output kept as the pod's log.

    Args:
        pod: the pod as the API returns it (bound to a node).
        root: where its emptyDirs are made.
        logs: pod name -> log lines (`KubeServer.logs`), appended to as output arrives.
        secrets: Secret name -> data (decoded) for the Secrets the container references.
        dns: DNS name -> address, the names the pod can resolve.
        node_env: set on top of the image's ENV (this machine's settings, e.g. thread counts).

    Raises:
        ContainerConfigError: the container cannot be configured (see `field_value`, missing Secrets).
    """

    def __init__(self, pod: dict[str, Any], root: Path, logs: dict[str, list[str]], secrets: dict[str, dict[str, str]],
                 dns: dict[str, str], node_env: Optional[dict[str, str]] = None) -> None:
        self.name, self.uid = pod["metadata"]["name"], pod["metadata"]["uid"]
        spec = pod["spec"]
        self.node = str(spec.get("nodeName") or "")
        container = spec["containers"][0]
        self.container = container["name"]
        missing = sorted(secrets_of(container) - set(secrets))
        if missing:
            raise ContainerConfigError(f'secret "{missing[0]}" not found')
        for var in container.get("env") or []:
            ref = (var.get("valueFrom") or {}).get("secretKeyRef")
            if ref and ref["key"] not in secrets[ref["name"]]:
                raise ContainerConfigError(
                    f"couldn't find key {ref['key']} in Secret {pod['metadata']['namespace']}/{ref['name']}"
                )
        mounts = local_volumes(spec, container, root)
        refs = {
            v["valueFrom"]["fieldRef"]["fieldPath"]: ""
            for v in container.get("env") or []
            if "fieldRef" in (v.get("valueFrom") or {})
        }
        # PYTHONPATH is this checkout, the image's copy of the code, never inside a mount (a checkout under /tmp is not
        # the pod's /tmp).
        env = {k: v if k == "PYTHONPATH" else remap(v, mounts) for k, v in IMAGE_ENV.items()}
        env.update(local_env(container, mounts, {path: field_value(pod, path) for path in refs}, secrets))
        env = {k: resolve_names(v, dns) for k, v in env.items()}
        command = [
            resolve_names(expand(arg, env), dns) for arg in [*container.get("command", []), *container.get("args", [])]
        ]
        if not command or command[0] != "python":
            raise ContainerConfigError(
                f"command {command[:1]} is not the image's python; the emulation runs python only"
            )
        self.command = [sys.executable, *command[1:]]
        self.env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": os.environ.get("LANG", "C.UTF-8"),
                    **env, **(node_env or {}), POD_MARKER: self.uid}
        self.cwd = Path(remap(container.get("workingDir") or "/", mounts))
        self.logs = logs
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.kill_at: Optional[float] = None
        self._reader: Optional[threading.Thread] = None

    def start(self) -> None:
        self.logs.setdefault(self.name, [])
        self.proc = subprocess.Popen(self.command, cwd=self.cwd, env=self.env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self._reader = threading.Thread(target=self._read, args=(self.proc,), daemon=True)
        self._reader.start()

    def _read(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        lines = self.logs[self.name]
        for raw in proc.stdout:
            lines.append(f"{log_stamp(time.time_ns())} {raw.decode('utf-8', 'replace').rstrip(chr(10))}")

    def exit_code(self) -> Optional[int]:
        """The container's exit status once PID 1 ended (128 + signal when killed, as runtimes report), else None."""
        if self.proc is None or self.proc.poll() is None:
            return None
        rc = self.proc.returncode
        return 128 - rc if rc < 0 else rc

    def signal(self, sig: int) -> None:
        """Send `sig` to the container's PID 1 (what `kill` in the pod, or the runtime's stop, does)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def terminate(self, grace: float, clock: Callable[[], float] = time.monotonic) -> None:
        """SIGTERM to PID 1 now, SIGKILL to everything once `grace` seconds passed (`reap`)."""
        if self.kill_at is None:
            self.kill_at = clock() + grace
            self.signal(signal.SIGTERM)

    def reap(self, clock: Callable[[], float] = time.monotonic) -> Optional[int]:
        """Advance termination; the exit code once PID 1 ended and nothing of the pod is left, else None."""
        if self.kill_at is not None and clock() >= self.kill_at:
            self.kill_all()
        code = self.exit_code()
        if code is None:
            return None
        self.kill_all()  # the container is gone with its PID 1
        if self._reader is not None:
            self._reader.join(5)
        return code

    def kill_all(self) -> None:
        """SIGKILL every process of the pod (those carrying its marker), as removing its cgroup does."""
        for p in pod_processes(self.uid):
            try:
                p.kill()
            except psutil.Error:
                pass
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass


def pod_processes(uid: str) -> list[psutil.Process]:
    """Live processes started by the pod `uid` (its marker in their environment)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(POD_MARKER) == uid:
                found.append(p)
        except psutil.Error:
            continue
    return found


class Kubelet:
    """Runs the bound pods of every node here as `PodProcess`es and reports their status."""

    def __init__(self, api: Api, root: Path, logs: dict[str, list[str]], node_env: dict[str, str],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.api = api
        self.root = root
        self.logs = logs
        self.node_env = node_env
        self.clock = clock
        self.procs: dict[str, PodProcess] = {}
        self.done: set[str] = set()
        self.lost: set[str] = set()  # nodes gone: nothing starts there

    def step(self, pods: list[dict[str, Any]], services: list[dict[str, Any]]) -> None:
        for pod in pods:
            uid = pod["metadata"]["uid"]
            proc = self.procs.get(uid)
            if proc is None:
                if terminating(pod):
                    self._abandon(pod)
                elif pod["spec"].get("nodeName") in self.lost and uid not in self.done:
                    self.done.add(uid)
                    self._gone_with_node(pod)
                elif pod["spec"].get("nodeName") and uid not in self.done:
                    self._start(pod, pods, services)
                continue
            if proc is not None and uid not in self.done:
                if terminating(pod):
                    grace = pod["metadata"].get(
                        "deletionGracePeriodSeconds", pod["spec"].get("terminationGracePeriodSeconds", 30)
                    )
                    proc.terminate(float(grace), self.clock)
                code = proc.reap(self.clock)
                if code is not None:
                    self.done.add(uid)
                    self._terminated(pod, code)
                    continue
            if terminating(pod) and uid in self.done:
                self._release(pod)

    def _dns(self, pods: list[dict[str, Any]], services: list[dict[str, Any]]) -> dict[str, str]:
        """Names cluster DNS gives pods: `<hostname>.<subdomain>` of a pod whose subdomain is a Service of its
        namespace."""
        svcs = {(s["metadata"]["namespace"], s["metadata"]["name"]) for s in services if not terminating(s)}
        out = {}
        for p in pods:
            host, sub, ns = p["spec"].get("hostname"), p["spec"].get("subdomain"), p["metadata"]["namespace"]
            if host and sub and (ns, sub) in svcs and p["status"].get("phase") not in TERMINAL:
                for name in (
                    f"{host}.{sub}",
                    f"{host}.{sub}.{ns}",
                    f"{host}.{sub}.{ns}.svc",
                    f"{host}.{sub}.{ns}.svc.cluster.local",
                ):
                    out[name] = "127.0.0.1"
        return out

    def _secrets(self, namespace: str) -> dict[str, dict[str, str]]:
        return {s["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in (s.get("data") or {}).items()}
                | dict(s.get("stringData") or {}) for s in self.api.list("Secret", namespace)}

    def _start(self, pod: dict[str, Any], pods: list[dict[str, Any]], services: list[dict[str, Any]]) -> None:
        container = pod["spec"]["containers"][0]
        try:
            proc = PodProcess(
                pod,
                self.root / pod["metadata"]["name"],
                self.logs,
                self._secrets(pod["metadata"]["namespace"]),
                self._dns(pods, services),
                self.node_env,
            )
        except ContainerConfigError as e:
            state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(e)}}
            self.api.patch(pod, {"status": {"containerStatuses": [self._status(container, state, False)]}})
            return  # retried next step, as the kubelet retries the pod's sync
        proc.start()
        self.procs[pod["metadata"]["uid"]] = proc
        started = now_iso()
        conds = pod
        for ctype in ("Initialized", "ContainersReady", "Ready"):
            conds = {"status": {"conditions": with_condition(conds, ctype, "True", "", "")}}
        self.api.patch(pod, {"status": {
            "phase": "Running", "podIP": "127.0.0.1", "hostIP": "127.0.0.1", "startTime": started,
            "conditions": conds["status"]["conditions"],
            "containerStatuses": [self._status(container, {"running": {"startedAt": started}}, True)]}})

    def _terminated(self, pod: dict[str, Any], code: int) -> None:
        container = pod["spec"]["containers"][0]
        started = (
            ((pod["status"].get("containerStatuses") or [{}])[0].get("state") or {}).get("running", {}).get("startedAt")
        )
        conds = pod
        for ctype in ("ContainersReady", "Ready"):
            conds = {
                "status": {
                    "conditions": with_condition(
                        conds, ctype, "False", "PodCompleted" if code == 0 else "PodFailed", ""
                    )
                }
            }
        term = {"exitCode": code, "reason": "Completed" if code == 0 else "Error", "startedAt": started or now_iso(),
                "finishedAt": now_iso(), "containerID": f"emulated://{pod['metadata']['uid']}"}
        self.api.patch(
            pod,
            {
                "status": {
                    "phase": "Succeeded" if code == 0 else "Failed",
                    "conditions": conds["status"]["conditions"],
                    "containerStatuses": [self._status(container, {"terminated": term}, False)],
                }
            },
        )

    def _abandon(self, pod: dict[str, Any]) -> None:
        """A pod deleted before its container ran (never scheduled, or not configurable): Failed, then released, as
        PodGC does."""
        if pod["status"].get("phase") not in TERMINAL:
            self.api.patch(
                pod,
                {
                    "status": {
                        "phase": "Failed",
                        "conditions": with_condition(
                            pod,
                            "DisruptionTarget",
                            "True",
                            "DeletionByPodGC",
                            "PodGC: node no longer exists or pod was deleted before it ran",
                        ),
                    }
                },
            )
        self._release(pod)

    def _gone_with_node(self, pod: dict[str, Any]) -> None:
        """A pod bound to a node that is gone before it ran: Failed with DisruptionTarget, as PodGC marks it."""
        self.api.patch(pod, {"status": {"phase": "Failed", "conditions": with_condition(
            pod, "DisruptionTarget", "True", "DeletionByPodGC", "PodGC: node no longer exists")}})

    def lose_node(self, node: str) -> list[str]:
        """The node is gone: SIGKILL every process of its pods (by PID), start nothing there; the pods killed."""
        self.lost.add(node)
        killed = []
        for proc in list(self.procs.values()):
            if proc.node == node and proc.exit_code() is None:
                proc.kill_all()
                killed.append(proc.name)
        return killed

    def return_node(self, node: str) -> None:
        self.lost.discard(node)

    def _release(self, pod: dict[str, Any]) -> None:
        finalizers = pod["metadata"].get("finalizers") or []
        if KUBELET_FINALIZER in finalizers:
            self.api.patch(pod, {"metadata": {"finalizers": [f for f in finalizers if f != KUBELET_FINALIZER]}})

    @staticmethod
    def _status(container: dict[str, Any], state: dict[str, Any], ready: bool) -> dict[str, Any]:
        return {"name": container["name"], "image": container["image"], "imageID": f"emulated://{container['image']}",
                "ready": ready, "restartCount": 0, "started": "running" in state, "state": state}

    def signal(self, pod_name: str, sig: int) -> None:
        """Send `sig` to the PID 1 of the running pod `pod_name`.

        Raises:
            LookupError: no running pod of that name here.
        """
        for proc in list(self.procs.values()):
            if proc.name == pod_name and proc.exit_code() is None:
                proc.signal(sig)
                return
        raise LookupError(
            f"pod {pod_name} is not running on this node; running: "
            f"{sorted(p.name for p in self.procs.values() if p.exit_code() is None)}"
        )

    def stop_all(self) -> None:
        for proc in self.procs.values():
            proc.kill_all()
