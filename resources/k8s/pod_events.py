"""The pods of a gang that failed, from a watch that runs beside the supervisor's polls (`PodWatch`).

A JobSet restarts its whole gang as soon as a child Job fails, and deletes that
Job with its pods: the pod whose death caused the restart is usually gone within
a second or two, long before the next poll (10 s by default) lists pods. So while
the supervisor watches a gang, a thread holds a watch of the gang's pods and
keeps every pod that reaches `Failed`: from the MODIFIED event that says so, or
from the DELETED event, which carries the pod's last state. The pod's event comes
before the Job's failure and the JobSet's restart that follow from it, so the
poll that sees the restart finds the pod already kept.

Each watch lasts one window (`timeoutSeconds`; a server that ignores it, like
kmock, is cut off by the read timeout) and the next starts at once: a new watch
begins with the current pods (ADDED), so the only gap is the reconnect itself.
The watch asks with `watch=true` in lowercase, as kubectl and client-go do
(`kubernetes.watch.Watch` would send `True`).
"""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
import time
from types import SimpleNamespace
from typing import Any, Callable, Optional

import urllib3
from kubernetes.client.rest import ApiException
from kubernetes.watch.watch import iter_resp_lines

from resources.k8s.names import LABEL_JOB
from resources.k8s.pods import PodView

logger = logging.getLogger(__name__)

FORBIDDEN = 403


def watch_failed_pods(
    core: Any,
    namespace: str,
    name: str,
    seconds: float,
    found: Callable[[PodView], None],
    *,
    connect_timeout: float,
    stop: Callable[[], bool] = lambda: False,
    clock: Callable[[], float] = time.monotonic,
    opened: Callable[[Any], None] = lambda resp: None,
) -> bool:
    """One watch of the pods labelled `LABEL_JOB=name`, for about `seconds`; `found` gets each pod seen `Failed`, as it
    comes.

    False when the API refuses the watch (403: a Role without `watch` on pods). A
    watch that breaks (the connection, another API error) just ends early.
    `opened` gets the streaming response, for `PodWatch.stop` to shut it down.
    """
    deadline = clock() + seconds
    resp = None
    try:
        resp = core.list_namespaced_pod(
            namespace, label_selector=f"{LABEL_JOB}={name}", watch="true", timeout_seconds=max(1, math.ceil(seconds)),
            _preload_content=False, _request_timeout=(connect_timeout, max(seconds, 0.05)),
        )
        opened(resp)
        for line in iter_resp_lines(resp):
            pod = _failed_pod(core, json.loads(line), name) if line else None
            if pod is not None:
                found(pod)
            if stop() or clock() >= deadline:
                break
    except ApiException as e:
        if e.status == FORBIDDEN:
            return False
        logger.debug("watching the pods of %s ended early: %s %s", name, e.status, e.reason)
    except (urllib3.exceptions.HTTPError, OSError, ValueError) as e:
        # ReadTimeoutError: nothing changed for the whole window (a server that ignores timeoutSeconds).
        logger.debug("watching the pods of %s ended: %s", name, e)
    finally:
        if resp is not None:
            resp.close()
            resp.release_conn()
    return True


def _failed_pod(core: Any, event: dict[str, Any], name: str) -> Optional[PodView]:
    """The event's pod when it is one of the gang's and has failed."""
    if event.get("type") not in ("ADDED", "MODIFIED", "DELETED"):
        return None  # BOOKMARK, ERROR (410 Gone: the next window starts a new watch)
    raw = event.get("object") or {}
    if ((raw.get("metadata") or {}).get("labels") or {}).get(LABEL_JOB) != name:
        return None  # a server that ignores the label selector
    if (raw.get("status") or {}).get("phase") != "Failed":
        return None
    return PodView.of(core.api_client.deserialize(SimpleNamespace(data=json.dumps(raw)), "V1Pod"))


class PodWatch:
    """A thread that watches one gang's pods, window after window, until `stop()`; `failed()` drains what it kept."""

    def __init__(self, core: Any, namespace: str, name: str, *, window: float, connect_timeout: float,
                 pause: float = 1.0) -> None:
        self.core, self.namespace, self.name = core, namespace, name
        self.window, self.connect_timeout, self.pause = window, connect_timeout, pause
        self.forbidden = False
        self._kept: queue.SimpleQueue[PodView] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._resp: Any = None
        self._thread = threading.Thread(target=self._run, name=f"pod-watch-{name}", daemon=True)

    def start(self) -> "PodWatch":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stopping.is_set():
            started = time.monotonic()
            if not watch_failed_pods(
                self.core,
                self.namespace,
                self.name,
                self.window,
                self._kept.put,
                connect_timeout=self.connect_timeout,
                stop=self._stopping.is_set,
                opened=self._opened,
            ):
                self.forbidden = True
                logger.warning("the launcher may not watch pods in namespace %s (403); it names a failed pod only "
                               "when a poll lists it before the pod is deleted", self.namespace)
                return
            if time.monotonic() - started < self.window / 2:  # broke early (API down, refused): no busy reconnect loop
                self._stopping.wait(self.pause)

    def _opened(self, resp: Any) -> None:
        self._resp = resp
        if self._stopping.is_set():  # stopped while connecting
            self._shutdown()

    def _shutdown(self) -> None:
        resp = self._resp
        if resp is not None and hasattr(resp, "shutdown"):
            try:
                resp.shutdown()  # urllib3 >= 2.3: ends a read blocked in another thread
            except (OSError, urllib3.exceptions.HTTPError):
                pass

    def failed(self) -> list[PodView]:
        """The failed pods kept since the last call."""
        kept = []
        while True:
            try:
                kept.append(self._kept.get_nowait())
            except queue.Empty:
                return kept

    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """End the watch: its connection is shut down, so the thread ends at once (the caller never waits for it)."""
        self._stopping.set()
        self._shutdown()
