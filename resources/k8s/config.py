"""The validated inputs of the manifest builders: where and how trial pods run, and team quotas.

Every field is checked when the object is built, with a message naming the
field, the value and what would be accepted, so a bad setting fails when the
resource is configured, not when the API server rejects a manifest.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trainyard.podconfig import (
    Affinity,
    SecretKeyRef,
    Toleration,
    check_dns_subdomain,
    check_env,
    check_env_name,
    check_image,
    check_labels,
    check_quantity,
)

__all__ = ["Affinity", "K8sJobConfig", "SecretKeyRef", "TeamQuota", "Toleration", "check_dns_subdomain", "check_quantity"]

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_RESERVED_LABEL_PREFIXES = ("trainyard.io/", "kueue.x-k8s.io/", "batch.kubernetes.io/", "kubernetes.io/", "k8s.io/")


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class K8sJobConfig(_Frozen):
    """Where and how trial pods run: one per cluster/team, set by the platform.

    Args:
        namespace: the team namespace the Job, Service and pods live in.
        image: the trainer image (torch, lightning, `training/`, team model code; no Dagster),
            by digest (`<repository>@sha256:<64 hex>`); a tag is accepted, and the
            launcher warns about it.
        queue_name: the Kueue LocalQueue in `namespace`; None on clusters without Kueue
            (the Job then starts unsuspended).
        priority_class: a scheduling.k8s.io PriorityClass for the pods (`priority_classes()`).
        workload_priority_class: a Kueue WorkloadPriorityClass, only where configured.
        service_account: the pods' service account, one per team namespace
            (`trainyard-trial`); they need no API access and get no token.
        gpus_per_pod: GPUs each pod requests; None derives it from the spec
            (`procs_per_node` on GPU, 0 on CPU); when set it must agree.
        cpu, memory: requests per pod; cpu_limit (None: no CPU limit), memory_limit
            (None: equal to the request).
        node_selector, tolerations, affinity: placement (e.g. a GPU node pool).
        shm_size: size of the in-memory /dev/shm (DataLoader workers share batches
            through it; the container default of 64 MiB breaks them); None: no volume.
        scratch_size: size limit of each writable scratch emptyDir (HOME and /tmp;
            the root filesystem is read-only); None: bounded by the node only.
        termination_grace_seconds: SIGTERM-to-SIGKILL time; long enough to write the
            preemption checkpoint.
        ttl_seconds_after_finished: finished Jobs are garbage-collected after this.
        backoff_limit: whole-gang restarts a JobSet makes on infrastructure failures
            (its failurePolicy.maxRestarts; disruptions do not count). The Indexed
            Job option has backoffLimit 0 and restarts through the run's retries.
        active_deadline_seconds: optional wall-clock cap on the running Job.
        env_from_secrets: Secret names whose keys become environment variables;
            with `secret_env` (one Secret key per variable) the only way
            credentials reach pods.
        env: plain, non-secret settings (e.g. AWS_ENDPOINT_URL, NCCL_*).
        master_port: rank 0's rendezvous port.
        labels: extra labels on every object (cost centre, team).
        avoid_nodes: nodes the pods prefer not to land on (a preferred node
            anti-affinity on `kubernetes.io/hostname`): set by the supervisor from
            the pod-side agents' reports, where a rank hung or a straggler ran
            (`resources.launch_errors.nodes_to_avoid`); preferred, not required, so
            a cluster without other room still places the gang.
    """

    namespace: str
    image: str
    queue_name: Optional[str] = None
    priority_class: Optional[str] = None
    workload_priority_class: Optional[str] = None
    service_account: Optional[str] = None
    gpus_per_pod: Optional[int] = Field(None, ge=0)
    cpu: str = "2"
    memory: str = "8Gi"
    cpu_limit: Optional[str] = None
    memory_limit: Optional[str] = None
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: tuple[Toleration, ...] = ()
    affinity: Optional[Affinity] = None
    shm_size: Optional[str] = "2Gi"
    scratch_size: Optional[str] = None
    termination_grace_seconds: int = Field(120, ge=1)
    ttl_seconds_after_finished: Optional[int] = Field(86400, ge=0)
    backoff_limit: int = Field(3, ge=0)
    active_deadline_seconds: Optional[int] = Field(None, gt=0)
    env_from_secrets: tuple[str, ...] = ()
    env: dict[str, str] = Field(default_factory=dict)
    secret_env: dict[str, SecretKeyRef] = Field(default_factory=dict)
    master_port: int = Field(29500, ge=1024, le=65535)
    labels: dict[str, str] = Field(default_factory=dict)
    avoid_nodes: tuple[str, ...] = ()

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, v: str) -> str:
        if len(v) > 63 or not _DNS_LABEL.match(v):
            raise ValueError(f"namespace={v!r} is not a DNS label; accepted: lowercase letters, digits and '-', at most 63")
        return v

    @field_validator("image")
    @classmethod
    def _image(cls, v: str) -> str:
        return check_image("image", v)

    @field_validator("queue_name", "priority_class", "workload_priority_class", "service_account")
    @classmethod
    def _names(cls, v: Optional[str], info: Any) -> Optional[str]:
        return None if v is None else check_dns_subdomain(info.field_name, v)

    @field_validator("env_from_secrets")
    @classmethod
    def _secrets(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for name in v:
            check_dns_subdomain("env_from_secrets[]", name)
        return v

    @field_validator("cpu", "memory", "cpu_limit", "memory_limit", "shm_size", "scratch_size")
    @classmethod
    def _quantities(cls, v: Optional[str], info: Any) -> Optional[str]:
        return check_quantity(info.field_name, v)

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return check_env("env", v)

    @field_validator("secret_env")
    @classmethod
    def _secret_env(cls, v: dict[str, SecretKeyRef]) -> dict[str, SecretKeyRef]:
        for name in v:
            check_env_name("secret_env", name)
        return v

    @field_validator("labels", "node_selector")
    @classmethod
    def _labels(cls, v: dict[str, str], info: Any) -> dict[str, str]:
        check_labels(info.field_name, v)
        for key in v:
            if info.field_name == "labels" and key.startswith(_RESERVED_LABEL_PREFIXES):
                raise ValueError(f"labels key {key!r} is reserved for the platform; accepted: keys outside {_RESERVED_LABEL_PREFIXES}")
        return v

    @model_validator(mode="after")
    def _one_source_per_variable(self) -> "K8sJobConfig":
        both = sorted(set(self.env) & set(self.secret_env))
        if both:
            raise ValueError(f"env and secret_env both set {both}; accepted: each variable from one place")
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
