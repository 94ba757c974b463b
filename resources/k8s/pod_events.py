"""The pods of a gang that failed while the supervisor waited between two polls, from a watch.

A JobSet restarts its whole gang as soon as a child Job fails, and deletes that
Job with its pods: the pod whose death caused the restart is usually gone within
a second or two, long before the next poll (10 s by default) lists pods. So the
supervisor waits on a watch of the gang's pods instead of sleeping: a pod that
reaches `Failed` during the wait is seen in the MODIFIED event that says so, or
in the DELETED event, which carries the pod's last state. A watch is also cheaper
than a shorter poll: the API server pushes only what changed.

The watch asks with `watch=true` in lowercase, as kubectl and client-go do
(`kubernetes.watch.Watch` would send `True`).
"""

from __future__ import annotations

import json
import logging
import math
from types import SimpleNamespace
from typing import Any, Callable, Optional

import urllib3
from kubernetes.client.rest import ApiException
from kubernetes.watch.watch import iter_resp_lines

from resources.k8s.names import LABEL_JOB
from resources.k8s.pods import PodView

logger = logging.getLogger(__name__)

FORBIDDEN = 403


def failed_pods_during(core: Any, namespace: str, name: str, seconds: float, *, connect_timeout: float,
                       clock: Callable[[], float], sleep: Callable[[float], None]) -> Optional[list[PodView]]:
    """Wait about `seconds` on a watch of the pods labelled `LABEL_JOB=name`; the pods seen `Failed` meanwhile.

    None when the API refuses the watch (403: a Role without `watch` on pods); the
    caller then sleeps between polls as before. A watch that breaks early (the
    connection, an API error) leaves the rest of the wait to `sleep`, so a broken
    watch never turns the poll loop into a busy one.
    """
    deadline = clock() + seconds
    failed: dict[str, PodView] = {}
    resp = None
    try:
        resp = core.list_namespaced_pod(
            namespace, label_selector=f"{LABEL_JOB}={name}", watch="true", timeout_seconds=max(1, math.ceil(seconds)),
            _preload_content=False, _request_timeout=(connect_timeout, max(seconds, 0.05)),
        )
        for line in iter_resp_lines(resp):
            if line:
                _record(core, json.loads(line), name, failed)
            if clock() >= deadline:
                break
    except ApiException as e:
        if e.status == FORBIDDEN:
            return None
        logger.debug("watching the pods of %s ended early: %s %s", name, e.status, e.reason)
    except (urllib3.exceptions.HTTPError, OSError, ValueError) as e:
        # ReadTimeoutError: nothing changed for the whole wait (a server that ignores timeoutSeconds).
        logger.debug("watching the pods of %s ended: %s", name, e)
    finally:
        if resp is not None:
            resp.close()
            resp.release_conn()
    left = deadline - clock()
    if left > 0:
        sleep(left)
    return list(failed.values())


def _record(core: Any, event: dict[str, Any], name: str, failed: dict[str, PodView]) -> None:
    """Keep the event's pod when it is one of the gang's and has failed."""
    if event.get("type") not in ("ADDED", "MODIFIED", "DELETED"):
        return  # BOOKMARK, ERROR (410 Gone: the next wait starts a new watch)
    raw = event.get("object") or {}
    if ((raw.get("metadata") or {}).get("labels") or {}).get(LABEL_JOB) != name:
        return  # a server that ignores the label selector
    if (raw.get("status") or {}).get("phase") != "Failed":
        return
    pod = core.api_client.deserialize(SimpleNamespace(data=json.dumps(raw)), "V1Pod")
    failed[pod.metadata.name] = PodView.of(pod)
