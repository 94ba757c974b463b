"""The validated inputs of the manifest builders: where and how trial pods run, and team quotas.

Every field is checked when the object is built, with a message naming the
field, the value and what would be accepted, so a bad setting fails when the
resource is configured, not when the API server rejects a manifest.
"""

from __future__ import annotations

import re
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from training.spec import LAUNCH_ID_ENV

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_QUANTITY = re.compile(r"^(\d+(\.\d+)?|\.\d+)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei|[eE]\d+)?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Names that look like credentials: these must come from a Secret, never a literal.
_CREDENTIAL_NAME = re.compile(r"(?i)(secret|token|passw|credential|api_?key|access_?key|private_?key)")
_RESERVED_LABEL_PREFIXES = ("trainyard.io/", "kueue.x-k8s.io/", "batch.kubernetes.io/", "kubernetes.io/", "k8s.io/")
_PLATFORM_ENV = ("JOB_COMPLETION_INDEX", "PYTHONUNBUFFERED", LAUNCH_ID_ENV)


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def check_dns_subdomain(field: str, value: str) -> str:
    """`value` if it is a valid Kubernetes object name (DNS-1123 subdomain); else a ValueError naming `field`."""
    if len(value) > 253 or not _DNS_SUBDOMAIN.match(value):
        raise ValueError(
            f"{field}={value!r} is not a valid Kubernetes name; accepted: lowercase letters, digits, '-' and '.', "
            "starting and ending with a letter or digit, at most 253 characters"
        )
    return value


def check_quantity(field: str, value: Optional[str]) -> Optional[str]:
    """`value` if it is None or a Kubernetes quantity ('500m', '16Gi'); else a ValueError naming `field`."""
    if value is not None and not _QUANTITY.match(value):
        raise ValueError(f"{field}={value!r} is not a Kubernetes quantity; accepted e.g. '500m', '2', '16Gi', '1.5'")
    return value


class Toleration(_Frozen):
    """A pod toleration (e.g. for a tainted GPU node pool)."""

    key: Optional[str] = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: Optional[str] = None
    effect: Optional[Literal["NoSchedule", "PreferNoSchedule", "NoExecute"]] = None
    toleration_seconds: Optional[int] = Field(None, ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> "Toleration":
        if self.operator == "Exists" and self.value is not None:
            raise ValueError(f"toleration value={self.value!r} with operator 'Exists'; accepted: no value")
        if self.operator == "Equal" and self.key is None:
            raise ValueError("toleration with operator 'Equal' needs a key; accepted: a key, or operator 'Exists'")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError(f"toleration_seconds with effect={self.effect!r}; accepted only with effect 'NoExecute'")
        return self

    def to_k8s(self) -> dict[str, Any]:
        out: dict[str, Any] = {"operator": self.operator}
        if self.key is not None:
            out["key"] = self.key
        if self.value is not None:
            out["value"] = self.value
        if self.effect is not None:
            out["effect"] = self.effect
        if self.toleration_seconds is not None:
            out["tolerationSeconds"] = self.toleration_seconds
        return out


class K8sJobConfig(_Frozen):
    """Where and how trial pods run: one per cluster/team, set by the platform.

    Args:
        namespace: the team namespace the Job, Service and pods live in.
        image: the trainer image (torch, lightning, `training/`, team model code; no Dagster).
        queue_name: the Kueue LocalQueue in `namespace`; None on clusters without Kueue
            (the Job then starts unsuspended).
        priority_class: a scheduling.k8s.io PriorityClass for the pods (`priority_classes()`).
        workload_priority_class: a Kueue WorkloadPriorityClass, only where configured.
        service_account: the pods' service account (they need no API access).
        gpus_per_pod: GPUs each pod requests; None derives it from the spec
            (`procs_per_node` on GPU, 0 on CPU); when set it must agree.
        cpu, memory: requests per pod; cpu_limit (None: no CPU limit), memory_limit
            (None: equal to the request).
        node_selector, tolerations: placement (e.g. a GPU node pool).
        shm_size: size of the in-memory /dev/shm (DataLoader workers share batches
            through it; the container default of 64 MiB breaks them); None: no volume.
        termination_grace_seconds: SIGTERM-to-SIGKILL time; long enough to write the
            preemption checkpoint.
        ttl_seconds_after_finished: finished Jobs are garbage-collected after this.
        backoff_limit: pod failures (not disruptions) the Job retries before failing.
        active_deadline_seconds: optional wall-clock cap on the running Job.
        env_from_secrets: Secret names whose keys become environment variables;
            the only way credentials reach pods.
        env: plain, non-secret settings (e.g. AWS_ENDPOINT_URL).
        master_port: rank 0's rendezvous port.
        labels: extra labels on every object (cost centre, team).
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
    shm_size: Optional[str] = "2Gi"
    termination_grace_seconds: int = Field(120, ge=1)
    ttl_seconds_after_finished: Optional[int] = Field(86400, ge=0)
    backoff_limit: int = Field(3, ge=0)
    active_deadline_seconds: Optional[int] = Field(None, gt=0)
    env_from_secrets: tuple[str, ...] = ()
    env: dict[str, str] = Field(default_factory=dict)
    master_port: int = Field(29500, ge=1024, le=65535)
    labels: dict[str, str] = Field(default_factory=dict)

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, v: str) -> str:
        if len(v) > 63 or not _DNS_LABEL.match(v):
            raise ValueError(f"namespace={v!r} is not a DNS label; accepted: lowercase letters, digits and '-', at most 63")
        return v

    @field_validator("image")
    @classmethod
    def _image(cls, v: str) -> str:
        if not v or any(c.isspace() for c in v):
            raise ValueError(f"image={v!r} is not an image reference; accepted e.g. 'registry.example/trainer:1.4.0'")
        return v

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

    @field_validator("cpu", "memory", "cpu_limit", "memory_limit", "shm_size")
    @classmethod
    def _quantities(cls, v: Optional[str], info: Any) -> Optional[str]:
        return check_quantity(info.field_name, v)

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v:
            if not _ENV_NAME.match(name):
                raise ValueError(f"env name {name!r} is invalid; accepted: letters, digits and '_', not starting with a digit")
            if _CREDENTIAL_NAME.search(name):
                raise ValueError(
                    f"env[{name!r}] looks like a credential; credentials reach pods only through a Secret: "
                    "put it in a Secret and list the Secret's name in env_from_secrets"
                )
            if name in _PLATFORM_ENV:
                raise ValueError(f"env[{name!r}] is set by the platform; accepted: any other name")
        return v

    @field_validator("labels", "node_selector")
    @classmethod
    def _labels(cls, v: dict[str, str], info: Any) -> dict[str, str]:
        for key, value in v.items():
            prefix, _, name = key.rpartition("/")
            if (prefix and not _DNS_SUBDOMAIN.match(prefix)) or len(name) > 63 or not _LABEL_NAME.match(name):
                raise ValueError(f"{info.field_name} key {key!r} is not a label key; accepted: '[prefix/]name', name <= 63 chars")
            if len(value) > 63 or not _LABEL_VALUE.match(value):
                raise ValueError(f"{info.field_name}[{key!r}]={value!r} is not a label value; accepted: <= 63 of [A-Za-z0-9_.-]")
            if info.field_name == "labels" and key.startswith(_RESERVED_LABEL_PREFIXES):
                raise ValueError(f"labels key {key!r} is reserved for the platform; accepted: keys outside {_RESERVED_LABEL_PREFIXES}")
        return v



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
