"""Errors of the Kubernetes launcher, on top of `resources.launcher`'s hierarchy.

`ManifestError` is a configuration mistake found before anything is submitted;
`KubernetesAPIError` is a request the API server refused for good (terminal);
`QueueTimeout` is an `InfrastructureError`, so Dagster's RetryPolicy may retry it.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from resources.launcher import InfrastructureError, LaunchError

# Worth retrying: overload, throttling, gateway and control-plane hiccups.
TRANSIENT_STATUSES = frozenset({429, 500, 502, 503, 504})


def api_message(e: Any) -> str:
    try:
        return str(json.loads(e.body).get("message") or e.reason)
    except (TypeError, ValueError, AttributeError):
        return str(getattr(e, "reason", e))


class Transient(Exception):
    """A failed API call worth retrying; `error` is what the client raised."""

    def __init__(self, error: BaseException, detail: str) -> None:
        super().__init__(detail)
        self.error = error
        self.detail = detail


class ManifestError(ValueError):
    """A spec and a job configuration that cannot make a valid manifest."""


class KubernetesAPIError(LaunchError):
    """The API server refused a request for good (forbidden, invalid manifest, no such namespace)."""

    def __init__(self, message: str, *, status: Optional[int] = None) -> None:
        super().__init__(message)
        self.status = status


class QueueTimeout(InfrastructureError):
    """Kueue did not admit the trial within the queue timeout; the Job was deleted."""


class StuckGang(LaunchError):
    """Admitted pods that cannot start (Unschedulable, image or config errors, refused pod creation) past their bound.

    Not retryable: a new attempt would get stuck the same way. The gang was
    deleted, so it holds no quota. `kind` is the `resources.k8s.stuck` class.
    """

    def __init__(self, message: str, *, kind: str) -> None:
        super().__init__(message)
        self.kind = kind
