"""Strict validation of Kubernetes objects against the schemas bundled with kubernetes-validate."""

from __future__ import annotations

import importlib.resources
import re
from typing import Any

import kubernetes_validate
from packaging.version import Version


def _schema_versions() -> list[str]:
    """Kubernetes versions whose strict schemas ship inside kubernetes-validate."""
    root = importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema"
    found = {m.group(1) for p in root.iterdir() if (m := re.match(r"^v(\d+\.\d+)\.\d+-local-strict$", p.name))}
    return sorted(found, key=Version)


NEWEST = _schema_versions()[-1]
# The oldest Kubernetes the platform supports and the newest schema available.
K8S_VERSIONS = ["1.29", NEWEST]


def k8s_validate(obj: dict[str, Any]) -> None:
    """Validate `obj` strictly (unknown fields rejected) against every version in `K8S_VERSIONS`.

    Raises:
        kubernetes_validate.ValidationError: The object does not match a schema.
        kubernetes_validate.SchemaNotFoundError: The kind is unknown; a failure too.
    """
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)
