"""The Kubernetes API over real HTTP: kmock's emulator on a loopback port, with what an API server adds.

kmock (`KubernetesEmulator`) stores what is created and serves it back; it runs
no controllers. `Emulator` adds what every API server does on create (a uid and
a creationTimestamp) and, when asked (`graceful=True`, the process-backed
cluster), two deletion rules of the real API server:

- a DELETE with `propagationPolicy: Foreground` keeps the object, with a
  `deletionTimestamp` and the `foregroundDeletion` finalizer, until the garbage
  collector (`tests.support.cluster.controllers`) has deleted its dependents;
- a pod DELETE is graceful: the pod stays, terminating, until its kubelet has
  stopped its containers (SIGTERM, the grace period, SIGKILL) and released it.

kmock facts the tests rely on: it ignores label and field selectors (the
launcher filters by label itself), treats only lowercase `watch=true` as a
watch, stores a created object before a scripted error response is sent, and
merges a PATCH into the stored object (dicts merged, lists replaced).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from datetime import UTC, datetime
from typing import Any, Optional

import kmock
from kmock._internal import apps as kmock_apps
from kmock._internal import dsl as kmock_dsl
from kmock._internal import rendering as kmock_rendering
from kubernetes import client

from resources.k8s.cluster import LAUNCHER_RULES

CONTROLLER_AGENT = "test-controller"
"""User-Agent of requests made by the emulated cluster or the test itself, not by the launcher."""

FOREGROUND = "foregroundDeletion"
KUBELET_FINALIZER = "emulator.trainyard.io/kubelet"
"""Held by a terminating pod until its emulated kubelet has stopped its processes."""


def rfc3339(epoch: float) -> str:
    """`epoch` seconds as the API's timestamp (second precision)."""
    return datetime.fromtimestamp(epoch, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def log_stamp(epoch_ns: int) -> str:
    """The kubelet's log timestamp (RFC 3339 with nanoseconds) for `epoch_ns`."""
    seconds, nanos = divmod(epoch_ns, 1_000_000_000)
    return f"{datetime.fromtimestamp(seconds, tz=UTC).strftime('%Y-%m-%dT%H:%M:%S')}.{nanos:09d}Z"


def holds(view: Any, request: Any) -> Optional[bool]:
    """Whether `request`, the one being served, is in kmock's `view`, judged from the request alone.

    kmock decides it by scanning every request the server ever received through the
    view's filters (`request in view`), for each reaction in turn, on every request:
    its cost grows with the history, and a drill's polling controllers sent thousands.
    For the views reactions sit on (filters, priorities, exclusions, and/or groups over
    the root) the request's own criteria decide the same; None for a view that needs
    the history (a slice such as `[:1]`, a stream), where the caller scans.
    """
    if isinstance(view, kmock_dsl.Root):
        return any(r is request for r in reversed(view._requests))  # the request was just appended: found at once
    if type(view) is kmock_dsl.Filter:
        inside = holds(view._source, request)
        return None if inside is None else inside and bool(view.criteria(request))
    if type(view) is kmock_dsl.Priority:
        return holds(view._source, request)
    if type(view) is kmock_dsl.Exclusion:
        verdicts = [holds(view._source, request), *(holds(v, request) for v in view._exclusions)]
        return None if None in verdicts else bool(verdicts[0]) and not any(verdicts[1:])
    if type(view) in (kmock_dsl.OrGroup, kmock_dsl.AndGroup):
        verdicts = [holds(v, request) for v in view._sources]
        if None in verdicts:
            return None
        return any(verdicts) if type(view) is kmock_dsl.OrGroup else all(verdicts)
    return None


class _MatchByRequest(kmock_apps.RawHandler):
    """kmock's reaction lookup (`RawHandler._handle`, kmock 0.8) with `holds` in place of the history scan.

    The same order (priorities, then registration), the same disabling of depleted
    reactions and the same fall-through; `tests/resources/k8s/test_emulated_server.py` checks
    that `holds` agrees with kmock's own membership on every reaction the emulator has.
    """

    async def _handle(self, request: Any) -> Any:
        priorities = [payload.priorities for payload in self._payloads]
        width = max((len(p) for p in priorities), default=0)
        keys = [tuple(-p for p in priority) + (0,) * (width - len(priority)) for priority in priorities]
        for index in sorted(range(len(keys)), key=keys.__getitem__):
            payload = self._payloads[index]
            inside = holds(payload._source, request)
            if inside is None:
                inside = request in payload._source
            if inside and not payload._disabled.is_set():
                try:
                    return await payload(request)
                except kmock_rendering.ReactionMismatchError:  # either mismatch or depletion
                    payload._disabled.set()
                except NotImplementedError:  # matched, but non-actionable (nothing to respond with)
                    pass
        raise NotImplementedError("Undefined server behaviour: no reaction matching the request is defined.")


class Emulator(kmock.KubernetesEmulator, _MatchByRequest):
    """kmock's emulator, plus a uid and creationTimestamp on create, and (graceful) foreground and pod deletion.

    Reactions are looked up by the request alone (`_MatchByRequest`), not by a scan of the history.
    """

    graceful: bool = False

    async def _handle(self, request: Any) -> Any:
        if request.resource is not None and request.action == kmock.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", rfc3339(time.time()))
        if self.graceful and request.resource is not None and request.action == kmock.action.DELETE and request.name:
            self._hold_for_deletion(request)
        return await super()._handle(request)

    def _hold_for_deletion(self, request: Any) -> None:
        """Add the finalizer that makes kmock mark the object terminating instead of removing it."""
        key = (request.resource, request.namespace, request.name)
        if key not in self._objects or self._objects[key].deleted:
            return  # kmock answers 404
        meta = self._objects[key].get("metadata", {})
        if meta.get("deletionTimestamp"):
            return
        body = request.data if isinstance(request.data, dict) else {}
        hold = []
        if body.get("propagationPolicy") == "Foreground":
            hold.append(FOREGROUND)
        if request.resource.plural == "pods":
            hold.append(KUBELET_FINALIZER)
            grace = body.get("gracePeriodSeconds")
            if grace is not None:
                self._objects[key].patch({"metadata": {"deletionGracePeriodSeconds": int(grace)}})
        if hold:
            # No await between this and kmock's DELETE handling: atomic on the server's event loop.
            self._objects[key].patch({"metadata": {"finalizers": [*meta.get("finalizers", []), *hold]}})


class KubeServer:
    """kmock's Kubernetes emulator on a loopback port, served from its own event loop thread.

    `logs` maps a pod name to its log lines, each `<RFC 3339 nano timestamp> <text>`,
    served by the pods/log endpoint (tailLines, timestamps; sinceSeconds when
    `graceful`); the emulated kubelet appends to it, tests may too.

    Args:
        graceful: the process-backed cluster's server: foreground deletion, graceful
            pod deletion (see the module) and sinceSeconds on logs, whose
            timestamps are then real; off, a DELETE removes the object at once
            (kmock's own behaviour) and logs are served whatever their timestamps.
    """

    def __init__(self, graceful: bool = False) -> None:
        self.logs: dict[str, list[str]] = {}
        self.graceful = graceful
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError(f"kmock did not start: {self._error}")
        if self._error is not None:
            raise RuntimeError(f"kmock did not start: {self._error}")

    def _serve(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # surfaced by __init__ / stop()
            self._error = e
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with Emulator() as km, kmock.Server(km) as server:
            km.graceful = self.graceful
            # Declared resources list as empty instead of 404, like a cluster with Kueue and JobSet installed.
            km.resources["v1/pods"] = {}  # type: ignore[assignment]
            km.resources["v1/services"] = {}  # type: ignore[assignment]
            km.resources["v1/secrets"] = {}  # type: ignore[assignment]
            km.resources["batch/v1/jobs"] = {}  # type: ignore[assignment]
            km.resources["v1/events"] = {}  # type: ignore[assignment]
            km.resources["kueue.x-k8s.io/v1beta2/workloads"] = {}  # type: ignore[assignment]
            km.resources["jobset.x-k8s.io/v1alpha2/jobsets"] = {}  # type: ignore[assignment]
            km[lambda req: req.subresource == "log"] << self._serve_log
            self.km, self.url = km, str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()

    def _serve_log(self, req: Any) -> bytes:
        lines = list(self.logs.get(req.name, []))
        if self.graceful and req.params.get("sinceSeconds"):  # the tests without a cluster write made-up timestamps
            since = log_stamp(time.time_ns() - int(req.params["sinceSeconds"]) * 1_000_000_000)
            lines = [line for line in lines if line.split(" ", 1)[0] >= since]
        if req.params.get("tailLines"):
            lines = lines[-int(req.params["tailLines"]):]
        if req.params.get("timestamps") != "True":
            lines = [line.split(" ", 1)[1] if " " in line else "" for line in lines]
        return "".join(f"{line}\n" for line in lines).encode()

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def api_client(self, user_agent: str = "trainyard-launcher") -> client.ApiClient:
        api = client.ApiClient(client.Configuration(host=self.url))
        api.user_agent = user_agent
        return api

    def requests(self, method: str, path: str) -> list[Any]:
        return [r for r in list(self.km) if r.method.value == method and r.url.path == path]

    def count(self, method: str, path: str) -> int:
        return len(self.requests(method, path))


def launcher_requests_outside_its_role(server: KubeServer, namespace: str) -> list[str]:
    """Every request the launcher made that its Role (`resources.k8s.cluster.LAUNCHER_RULES`) would not allow."""
    allowed = {
        (group, resource, verb)
        for r in LAUNCHER_RULES
        for group in r["apiGroups"]
        for resource in r["resources"]
        for verb in r["verbs"]
    }
    denied = []
    for r in list(server.km):
        if r.headers.get("User-Agent") == CONTROLLER_AGENT:
            continue
        parts = r.url.path.strip("/").split("/")
        group = "" if parts[0] == "api" else parts[1]
        rest = parts[2:] if parts[0] == "api" else parts[3:]
        assert rest[0] == "namespaces" and rest[1] == namespace, r.url.path  # namespaced, in the team namespace only
        resource = "/".join([rest[2], *rest[4:5]])
        named = len(rest) > 3
        verb = {"POST": "create", "DELETE": "delete", "PATCH": "patch", "PUT": "update"}.get(r.method.value) or (
            "get" if named else ("watch" if r.params.get("watch") in ("true", "1") else "list"))
        if (group, resource, verb) not in allowed:
            denied.append(f"{r.method.value} {r.url.path} ({verb} {group or 'core'}/{resource})")
    return denied
