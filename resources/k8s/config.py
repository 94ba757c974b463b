"""The validated inputs of the manifest builders: where and how trial pods run, and team quotas.

The pods' own settings are declared once, in `trainyard.podconfig.PodSettings`;
`K8sJobConfig` adds the Job's. Every field is checked when the object is built,
with a message naming the field, the value and what would be accepted, so a bad
setting fails when the resource is configured, not when the API server rejects a
manifest.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trainyard.podconfig import (
    Affinity,
    PodSettings,
    SecretKeyRef,
    Toleration,
    check_dns_subdomain,
    check_labels,
    check_quantity,
)

__all__ = [
    "Affinity",
    "K8sJobConfig",
    "PodSettings",
    "SecretKeyRef",
    "TeamQuota",
    "Toleration",
    "check_dns_subdomain",
    "check_quantity",
]

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_RESERVED_LABEL_PREFIXES = ("trainyard.io/", "kueue.x-k8s.io/", "batch.kubernetes.io/", "kubernetes.io/", "k8s.io/")


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class K8sJobConfig(PodSettings):
    """Where and how trial pods run: one per cluster/team, what the manifests are built from.

    The pods' settings are `trainyard.podconfig.PodSettings`' fields (declared
    there once, with their defaults and checks); this adds the Job's own. The
    `KubernetesLauncher` resource's configuration is generated from these fields
    (all but `avoid_nodes`), and its `job_config()` builds this from it.
    """

    namespace: str
    """The team namespace the gang (JobSet or Job), its Service and pods live in."""
    queue_name: Optional[str] = "trainyard"
    """The Kueue LocalQueue in `namespace`; None on clusters without Kueue (the gang then starts unsuspended)."""
    priority_class: Optional[str] = None
    """A scheduling.k8s.io PriorityClass for the pods (`priority_classes()`)."""
    workload_priority_class: Optional[str] = None
    """A Kueue WorkloadPriorityClass, only where configured."""
    ttl_seconds_after_finished: Optional[int] = Field(86400, ge=0)
    """Finished gangs are garbage-collected after this; None: kept."""
    backoff_limit: int = Field(3, ge=0)
    """Whole-gang restarts a JobSet makes on infrastructure failures (its failurePolicy.maxRestarts; disruptions do
    not count). The Indexed Job option has backoffLimit 0 and restarts through the run's retries."""
    master_port: int = Field(29500, ge=1024, le=65535)
    """Rank 0's rendezvous port."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Extra labels on every object (cost centre, team)."""
    avoid_nodes: tuple[str, ...] = ()
    """Nodes the pods prefer not to land on (a preferred node anti-affinity on `kubernetes.io/hostname`): set by the
    supervisor from the pod-side agents' reports, where a rank hung or a straggler ran
    (`resources.launch_errors.nodes_to_avoid`); preferred, not required, so a cluster without other room still places
    the gang. Not a launcher setting."""

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, v: str) -> str:
        if len(v) > 63 or not _DNS_LABEL.match(v):
            raise ValueError(
                f"namespace={v!r} is not a DNS label; accepted: lowercase letters, digits and '-', at most 63"
            )
        return v

    @field_validator("queue_name", "priority_class", "workload_priority_class")
    @classmethod
    def _names(cls, v: Optional[str], info: Any) -> Optional[str]:
        return None if v is None else check_dns_subdomain(info.field_name, v)

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        check_labels("labels", v)
        for key in v:
            if key.startswith(_RESERVED_LABEL_PREFIXES):
                raise ValueError(
                    f"labels key {key!r} is reserved for the platform; accepted: keys outside "
                    f"{_RESERVED_LABEL_PREFIXES}"
                )
        return v

    @model_validator(mode="after")
    def _has_image(self) -> "K8sJobConfig":
        if self.image is None:
            raise ValueError(
                "image is not set; accepted: the trainer image, e.g. 'registry.example/trainer@sha256:<64 hex digits>'"
            )
        return self


class TeamQuota(_Frozen):
    """One team's guaranteed share of the cluster and what it may borrow beyond it.

    Args:
        team: the ClusterQueue's name.
        namespace: the team's namespace, which gets the LocalQueue `queue_name`.
        cpu, memory, gpus: nominal quota, guaranteed to the team.
        borrow_cpu, borrow_memory, borrow_gpus: the most the team may borrow from
            idle quota of others in the cohort; None: no limit.
        queue_name: name of the LocalQueue (the launcher's `queue_name`).
    """

    team: str
    namespace: str
    cpu: str
    memory: str
    gpus: int = Field(0, ge=0)
    borrow_cpu: Optional[str] = None
    borrow_memory: Optional[str] = None
    borrow_gpus: Optional[int] = Field(None, ge=0)
    queue_name: str = "trainyard"

    @field_validator("team", "namespace", "queue_name")
    @classmethod
    def _name(cls, v: str, info: Any) -> str:
        if len(v) > 63 or not _DNS_LABEL.match(v):
            raise ValueError(f"{info.field_name}={v!r} is not a DNS label; accepted: lowercase letters, digits, '-'")
        return v

    @field_validator("cpu", "memory", "borrow_cpu", "borrow_memory")
    @classmethod
    def _quantity(cls, v: Optional[str], info: Any) -> Optional[str]:
        return check_quantity(info.field_name, v)
