"""Errors of the Kubernetes launcher, on top of `resources.launcher`'s hierarchy.

`ManifestError` is a configuration mistake found before anything is submitted;
`KubernetesAPIError` is a request the API server refused for good (terminal);
`QueueTimeout` is an `InfrastructureError`, so Dagster's RetryPolicy may retry it.
"""

from __future__ import annotations

from typing import Optional

from resources.launcher import InfrastructureError, LaunchError


class ManifestError(ValueError):
    """A spec and a job configuration that cannot make a valid manifest."""


class KubernetesAPIError(LaunchError):
    """The API server refused a request for good (forbidden, invalid manifest, no such namespace)."""

    def __init__(self, message: str, *, status: Optional[int] = None) -> None:
        super().__init__(message)
        self.status = status


class QueueTimeout(InfrastructureError):
    """Kueue did not admit the trial within the queue timeout; the Job was deleted."""
