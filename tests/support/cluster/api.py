"""The emulated controllers' own client: JSON over the same HTTP API the launcher uses.

Controllers read and write objects as plain dicts, cluster-wide lists and
per-object PATCHes (kmock merges a PATCH into the stored object: dicts merged,
lists replaced, so a condition list is always written whole). Every request
carries `CONTROLLER_AGENT`, so the launcher's Role check ignores them.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import urllib3

from tests.support.cluster.server import CONTROLLER_AGENT

# kind -> (API prefix, plural)
KINDS = {
    "Job": ("/apis/batch/v1", "jobs"),
    "Pod": ("/api/v1", "pods"),
    "Service": ("/api/v1", "services"),
    "Event": ("/api/v1", "events"),
    "Secret": ("/api/v1", "secrets"),
    "Workload": ("/apis/kueue.x-k8s.io/v1beta2", "workloads"),
    "JobSet": ("/apis/jobset.x-k8s.io/v1alpha2", "jobsets"),
}


class ApiError(Exception):
    """A request of the emulated cluster that the API server answered with an error."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"{status}: {text[:300]}")
        self.status = status


class Api:
    """Plain-dict access to the API server at `url`."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.http = urllib3.PoolManager(
            maxsize=4, headers={"User-Agent": CONTROLLER_AGENT, "Content-Type": "application/json"}
        )

    def _path(self, kind: str, namespace: Optional[str] = None, name: Optional[str] = None) -> str:
        prefix, plural = KINDS[kind]
        path = f"{prefix}/namespaces/{namespace}/{plural}" if namespace else f"{prefix}/{plural}"
        return f"{path}/{name}" if name else path

    def _call(self, method: str, path: str, body: Optional[dict[str, Any]] = None) -> Any:
        resp = self.http.request(
            method, self.url + path, body=None if body is None else json.dumps(body).encode(), timeout=30.0
        )
        text = resp.data.decode("utf-8", "replace")
        if resp.status >= 400:
            raise ApiError(resp.status, text)
        return json.loads(text) if text else None

    def list(self, kind: str, namespace: Optional[str] = None) -> list[dict[str, Any]]:
        """Every object of `kind` (in `namespace`, or cluster-wide), not being removed from the store."""
        items = list(self._call("GET", self._path(kind, namespace)).get("items", []))
        for item in items:
            item.setdefault("kind", kind)
        return items

    def get(self, kind: str, namespace: str, name: str) -> Optional[dict[str, Any]]:
        try:
            obj: dict[str, Any] = self._call("GET", self._path(kind, namespace, name))
            obj.setdefault("kind", kind)
            return obj
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def create(self, kind: str, obj: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", self._path(kind, obj["metadata"]["namespace"]), obj)

    def patch(self, obj: dict[str, Any], body: dict[str, Any]) -> Optional[dict[str, Any]]:
        """Merge `body` into `obj` (kind and name from it) and update `obj` in place to the result; None when it is
        gone."""
        meta = obj["metadata"]
        try:
            patched = self._call("PATCH", self._path(obj["kind"], meta["namespace"], meta["name"]), body)
        except ApiError as e:
            if e.status == 404:
                return None
            raise
        kind = obj["kind"]
        obj.clear()
        obj.update(patched)
        obj.setdefault("kind", kind)
        return obj

    def delete(self, obj: dict[str, Any], propagation: str = "Background") -> None:
        """Delete `obj`; one already gone is fine."""
        meta = obj["metadata"]
        try:
            self._call(
                "DELETE", self._path(obj["kind"], meta["namespace"], meta["name"]), {"propagationPolicy": propagation}
            )
        except ApiError as e:
            if e.status != 404:
                raise
