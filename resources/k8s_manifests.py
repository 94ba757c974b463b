"""Kubernetes manifests for trainyard, built by pure functions (no API calls).

A trial on Kubernetes is one Indexed Job (one pod per node, node rank = completion
index) plus a headless Service that gives every pod a stable DNS name, so torchrun
in each pod can reach rank 0 at `<job>-0.<job>`. Kueue admits the Job as one gang
(it is created suspended with a queue label), PriorityClasses order teams' work,
and a podFailurePolicy tells disruptions (not the trial's fault) from a spec that
can never work. `deploy/render.py` writes the cluster-wide objects (Kueue queues,
PriorityClasses, RBAC) from the functions here into `deploy/k8s/`.

Every function returns plain dicts that validate against the Kubernetes schemas
(`kubernetes-validate`, strict) or, for Kueue and JobSet, against their CRDs.

Example:
    cfg = K8sJobConfig(namespace="vision", image="registry.example/trainer:1.4.0",
                       queue_name="trainyard", priority_class="trainyard-sweep")
    job = job_manifest(spec, "s3://bucket/runs/trial-0003/spec.json", attempt=0, cfg=cfg)
    svc = service_manifest(job["metadata"]["name"], cfg, labels=trial_labels(spec, 0))
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from resources.launcher import torchrun_command
from trainyard.team import PRIORITIES
from training.spec import EXIT_BAD_CONFIG, LAUNCH_ID_ENV, TrainSpec

LABEL_PIPELINE = "trainyard.io/pipeline"
LABEL_TRIAL = "trainyard.io/trial"
LABEL_ATTEMPT = "trainyard.io/attempt"
# Our own pod label for the Service selector: the Job controller's `job-name`
# labels exist too, but selecting on a label this module writes keeps the
# Service correct without relying on controller behaviour.
LABEL_JOB = "trainyard.io/job-name"
ANNOTATION_SPEC_URI = "trainyard.io/spec-uri"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
CONTAINER_NAME = "trainer"
GPU_RESOURCE = "nvidia.com/gpu"
KUEUE_API = "kueue.x-k8s.io/v1beta2"
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
JOBSET_REPLICATED_JOB = "node"

# Indexed Job pods are named `<job>-<index>` for their hostname, which must stay a
# DNS label (<= 63 chars): keep 7 characters for "-<index>" (up to a million pods).
MAX_JOB_NAME = 56
# JobSet pod hostnames are `<jobset>-node-<job index>-<pod index>`.
MAX_JOBSET_NAME = 48
_HASH_LEN = 8

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_QUANTITY = re.compile(r"^(\d+(\.\d+)?|\.\d+)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei|[eE]\d+)?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Names that look like credentials: these must come from a Secret, never a literal.
_CREDENTIAL_NAME = re.compile(r"(?i)(secret|token|passw|credential|api_?key|access_?key|private_?key)")
_RESERVED_LABEL_PREFIXES = ("trainyard.io/", "kueue.x-k8s.io/", "batch.kubernetes.io/", "kubernetes.io/", "k8s.io/")
_PLATFORM_ENV = ("JOB_COMPLETION_INDEX", "PYTHONUNBUFFERED", LAUNCH_ID_ENV)


class ManifestError(ValueError):
    """A spec and a job configuration that cannot make a valid manifest."""


def _short_hash(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:_HASH_LEN]


def _dns_fragment(text: str) -> str:
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9]", "-", text.lower())).strip("-")


def job_name(pipeline: str, trial_id: str, attempt: int, *, max_length: int = MAX_JOB_NAME) -> str:
    """The Job's (and its Service's) name: deterministic, DNS-1035, at most `max_length`.

    A restarted or retried orchestrator computes the same name for the same trial
    and attempt, finds the Job already there and re-attaches instead of starting a
    second gang. The readable head (`<team>-<pipeline>-<trial>`) is truncated for
    long inputs; the tail `a<attempt>-<hash>` always survives, and the hash covers
    the untruncated inputs, so names differ whenever the inputs differ (sanitising
    maps both `/` and `_` to `-`, which alone could make two pipelines collide).

    Example:
        >>> job_name("vision/digits", "trial-0003", 0)[:28]
        'vision-digits-trial-0003-a0-'
    """
    if attempt < 0:
        raise ManifestError(f"attempt={attempt} is negative; attempts count from 0")
    tail = f"a{attempt}-{_short_hash(pipeline, trial_id, str(attempt))}"
    head = _dns_fragment(f"{pipeline}-{trial_id}")
    if not head or not head[0].isalpha():
        # Service names are DNS-1035 labels: they must start with a letter.
        head = f"t-{head}".rstrip("-")
    room = max_length - len(tail) - 1
    if room < 1:
        raise ManifestError(f"max_length={max_length} leaves no room for a name; accepted: >= {len(tail) + 2}")
    head = head[:room].rstrip("-")
    return f"{head}-{tail}"


def label_value(text: str) -> str:
    """`text` as a valid label value (<= 63 chars; a short hash marks lossy changes).

    Example:
        >>> label_value("vision/digits")
        'vision.digits'
    """
    value = re.sub(r"[^A-Za-z0-9_.-]", ".", text)
    value = re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", value)
    if len(value) > 63:
        value = value[: 63 - _HASH_LEN - 1].rstrip("-_.") + "-" + _short_hash(text)
    return value


def trial_labels(spec: TrainSpec, attempt: int) -> dict[str, str]:
    """The labels that identify a trial's objects; re-attaching checks them."""
    return {
        LABEL_PIPELINE: label_value(spec.pipeline),
        LABEL_TRIAL: label_value(spec.trial_id),
        LABEL_ATTEMPT: str(attempt),
    }


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_dns_subdomain(field: str, value: str) -> str:
    if len(value) > 253 or not _DNS_SUBDOMAIN.match(value):
        raise ValueError(
            f"{field}={value!r} is not a valid Kubernetes name; accepted: lowercase letters, digits, '-' and '.', "
            "starting and ending with a letter or digit, at most 253 characters"
        )
    return value


def _check_quantity(field: str, value: Optional[str]) -> Optional[str]:
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
        if len(v) > 63 or not re.match(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", v):
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
        return None if v is None else _check_dns_subdomain(info.field_name, v)

    @field_validator("env_from_secrets")
    @classmethod
    def _secrets(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for name in v:
            _check_dns_subdomain("env_from_secrets[]", name)
        return v

    @field_validator("cpu", "memory", "cpu_limit", "memory_limit", "shm_size")
    @classmethod
    def _quantities(cls, v: Optional[str], info: Any) -> Optional[str]:
        return _check_quantity(info.field_name, v)

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


def _pod_gpus(spec: TrainSpec, cfg: K8sJobConfig) -> int:
    dist = spec.distribution
    wanted = dist.procs_per_node if dist.accelerator == "gpu" else 0
    if cfg.gpus_per_pod is not None and cfg.gpus_per_pod != wanted:
        if dist.accelerator == "gpu":
            raise ManifestError(
                f"gpus_per_pod={cfg.gpus_per_pod} does not match distribution.procs_per_node={dist.procs_per_node}: "
                f"one process drives one GPU, so a pod must request exactly procs_per_node GPUs; accepted: {wanted} or unset"
            )
        raise ManifestError(
            f"gpus_per_pod={cfg.gpus_per_pod} with distribution.accelerator='cpu' would hold GPUs nobody uses; "
            "accepted: 0 or unset, or accelerator='gpu'"
        )
    return wanted


def _resources(gpus: int, cfg: K8sJobConfig) -> dict[str, Any]:
    requests: dict[str, Any] = {"cpu": cfg.cpu, "memory": cfg.memory}
    # A memory limit equal to the request makes OOM behaviour predictable (the
    # pod, not a neighbour, is killed); no CPU limit by default because CFS
    # throttling stalls data loading while idle cores sit next to it.
    limits: dict[str, Any] = {"memory": cfg.memory_limit or cfg.memory}
    if cfg.cpu_limit is not None:
        limits["cpu"] = cfg.cpu_limit
    if gpus:
        # Extended resources cannot be overcommitted: request must equal limit.
        requests[GPU_RESOURCE] = gpus
        limits[GPU_RESOURCE] = gpus
    return {"requests": requests, "limits": limits}


def _pod_template(
    spec: TrainSpec, spec_uri: str, cfg: K8sJobConfig, labels: dict[str, str], *, master_addr: str, subdomain: Optional[str]
) -> dict[str, Any]:
    dist = spec.distribution
    gpus = _pod_gpus(spec, cfg)
    if dist.nodes == 1:
        # One pod: torchrun's private rendezvous; no peers need to find it.
        command = torchrun_command(spec, spec_uri, python="python")
    else:
        # Kubernetes expands $(JOB_COMPLETION_INDEX) from the container env below.
        command = torchrun_command(
            spec, spec_uri, python="python", node_rank="$(JOB_COMPLETION_INDEX)",
            master_addr=master_addr, master_port=cfg.master_port,
        )
    env: list[dict[str, Any]] = [
        # The node rank. Recent Job controllers inject the same variable into
        # Indexed Job pods; declaring it here makes the $(JOB_COMPLETION_INDEX)
        # reference in the command resolvable from the manifest alone.
        {"name": "JOB_COMPLETION_INDEX",
         "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"}}},
        # Unbuffered output so rank 0's log lines reach `kubectl logs` (and the
        # orchestrator's log stream) as they are printed.
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        # One launch = one Job: attempt records and "fail at once" checks key on it.
        {"name": LAUNCH_ID_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['batch.kubernetes.io/job-name']"}}},
        *({"name": k, "value": v} for k, v in sorted(cfg.env.items())),
    ]
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": cfg.image,
        "imagePullPolicy": "IfNotPresent",
        "command": command,
        "env": env,
        "resources": _resources(gpus, cfg),
        "ports": [{"name": "rendezvous", "containerPort": cfg.master_port, "protocol": "TCP"}],
    }
    if cfg.env_from_secrets:
        # Credentials only by reference: the manifest (and the Dagster event log
        # it may end up in) never holds a secret value.
        container["envFrom"] = [{"secretRef": {"name": s}} for s in cfg.env_from_secrets]
    volumes: list[dict[str, Any]] = []
    if cfg.shm_size is not None:
        container["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": cfg.shm_size}})
    pod_spec: dict[str, Any] = {
        # Never restart a container in place: a failed torchrun agent must show up
        # as a failed pod so the Job's podFailurePolicy and backoffLimit see it
        # (podFailurePolicy requires Never), and a replacement pod gets a clean
        # rendezvous; in-process restarts are torchrun's --max-restarts.
        "restartPolicy": "Never",
        # SIGTERM (preemption, drain, cancel) to SIGKILL: time to write the
        # preemption checkpoint before the pod is killed.
        "terminationGracePeriodSeconds": cfg.termination_grace_seconds,
        # Trainer pods do not talk to the API server; no token to steal.
        "automountServiceAccountToken": False,
        # No per-Service environment variables: namespaces with many Services
        # would otherwise flood the environment of every pod.
        "enableServiceLinks": False,
        "containers": [container],
    }
    if subdomain is not None:
        # With the headless Service of the same name, pod `<job>-<i>` resolves as
        # `<job>-<i>.<subdomain>`: that is how ranks find rank 0.
        pod_spec["subdomain"] = subdomain
    if cfg.service_account is not None:
        pod_spec["serviceAccountName"] = cfg.service_account
    if cfg.priority_class is not None:
        # Kueue also orders the queue by this PriorityClass's value when no
        # WorkloadPriorityClass is set.
        pod_spec["priorityClassName"] = cfg.priority_class
    if cfg.node_selector:
        pod_spec["nodeSelector"] = dict(sorted(cfg.node_selector.items()))
    if cfg.tolerations:
        pod_spec["tolerations"] = [t.to_k8s() for t in cfg.tolerations]
    if volumes:
        pod_spec["volumes"] = volumes
    return {"metadata": {"labels": labels}, "spec": pod_spec}


def _pod_failure_policy() -> dict[str, Any]:
    return {
        "rules": [
            # Preemption, node drain, eviction: not the trial's fault. The Job makes
            # a replacement pod without counting it against backoffLimit; the
            # trial resumes from its last committed checkpoint.
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            # The entrypoint exits EXIT_BAD_CONFIG when the spec cannot work (bad
            # import path, rejected hyperparameters): retrying cannot help, so
            # fail the whole Job at once instead of burning backoffLimit retries.
            {"action": "FailJob",
             "onExitCodes": {"containerName": CONTAINER_NAME, "operator": "In", "values": [EXIT_BAD_CONFIG]}},
        ]
    }


def _metadata(name: str, cfg: K8sJobConfig, labels: dict[str, str], annotations: Optional[dict[str, str]] = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": cfg.namespace, "labels": labels}
    if annotations:
        meta["annotations"] = annotations
    return meta


def _queue_labels(cfg: K8sJobConfig) -> dict[str, str]:
    labels = {}
    if cfg.queue_name is not None:
        labels[KUEUE_QUEUE_LABEL] = cfg.queue_name
    if cfg.workload_priority_class is not None:
        labels[KUEUE_PRIORITY_LABEL] = cfg.workload_priority_class
    return labels


def service_manifest(name: str, cfg: K8sJobConfig, labels: Optional[Mapping[str, str]] = None) -> dict[str, Any]:
    """The headless Service whose name is the pods' subdomain (`<job>-<i>.<name>`)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(name, cfg, {**cfg.labels, **(labels or {}), LABEL_JOB: name}),
        "spec": {
            # Headless: DNS returns the pod addresses themselves, one record per pod.
            "clusterIP": "None",
            "selector": {LABEL_JOB: name},
            # Ranks rendezvous before any pod is Ready (there is no readiness
            # probe to pass), so records must exist as soon as pods have an IP.
            "publishNotReadyAddresses": True,
            "ports": [{"name": "rendezvous", "port": cfg.master_port, "targetPort": cfg.master_port, "protocol": "TCP"}],
        },
    }


def _job_spec(spec: TrainSpec, spec_uri: str, cfg: K8sJobConfig, name: str, pod_labels: dict[str, str], *,
              master_addr: str, subdomain: Optional[str], backoff_limit: int, suspend: bool) -> dict[str, Any]:
    nodes = spec.distribution.nodes
    job_spec: dict[str, Any] = {
        # One pod per node with a stable index 0..nodes-1: the index is the
        # torchrun node rank and names the pod's hostname `<job>-<index>`.
        "completionMode": "Indexed",
        "completions": nodes,
        "parallelism": nodes,
        "backoffLimit": backoff_limit,
        "podFailurePolicy": _pod_failure_policy(),
        "template": _pod_template(spec, spec_uri, cfg, pod_labels, master_addr=master_addr, subdomain=subdomain),
    }
    if suspend:
        # Created suspended: Kueue unsuspends it once quota for ALL pods is
        # reserved, so a gang never half-starts and holds GPUs waiting for peers.
        job_spec["suspend"] = True
    if cfg.active_deadline_seconds is not None:
        # On the Job, not the pod, so it bounds the whole run including pod
        # replacements; the timer restarts when Kueue unsuspends the Job, so
        # queueing does not consume it.
        job_spec["activeDeadlineSeconds"] = cfg.active_deadline_seconds
    if cfg.ttl_seconds_after_finished is not None:
        # Finished Jobs and their pods are kept this long for logs and debugging.
        job_spec["ttlSecondsAfterFinished"] = cfg.ttl_seconds_after_finished
    return job_spec


def job_manifest(spec: TrainSpec, spec_uri: str, attempt: int, cfg: K8sJobConfig) -> dict[str, Any]:
    """The batch/v1 Indexed Job that runs one attempt of a trial on `spec.distribution.nodes` pods.

    Every pod runs `torchrun_command(...)` with node rank `$(JOB_COMPLETION_INDEX)`
    and rank 0 at `<job>-0.<job>` (the headless Service from `service_manifest`).
    """
    name = job_name(spec.pipeline, spec.trial_id, attempt)
    labels = {**cfg.labels, **trial_labels(spec, attempt), LABEL_JOB: name}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _metadata(name, cfg, {**labels, **_queue_labels(cfg)}, {ANNOTATION_SPEC_URI: spec_uri}),
        "spec": _job_spec(
            spec, spec_uri, cfg, name, labels, master_addr=f"{name}-0.{name}", subdomain=name,
            backoff_limit=cfg.backoff_limit, suspend=cfg.queue_name is not None,
        ),
    }


def jobset_manifest(spec: TrainSpec, spec_uri: str, attempt: int, cfg: K8sJobConfig) -> dict[str, Any]:
    """The same trial as a JobSet (jobset.x-k8s.io/v1alpha2), for clusters running its controller.

    The JobSet makes its own headless Service (`network.subdomain`), and restarts
    the whole gang on a pod failure (`failurePolicy.maxRestarts`), which suits
    torchrun's static rendezvous better than replacing one pod.
    """
    name = job_name(spec.pipeline, spec.trial_id, attempt, max_length=MAX_JOBSET_NAME)
    labels = {**cfg.labels, **trial_labels(spec, attempt), LABEL_JOB: name}
    child = _job_spec(
        spec, spec_uri, cfg, name, labels,
        # Pod hostnames are <jobset>-<replicated job>-<job index>-<pod index>.
        master_addr=f"{name}-{JOBSET_REPLICATED_JOB}-0-0.{name}",
        subdomain=None,  # set by the JobSet controller from network.subdomain
        # Any counted pod failure fails the child Job at once, and the JobSet
        # restarts every pod together: a fresh rendezvous for all ranks.
        backoff_limit=0,
        suspend=False,  # the JobSet is what Kueue suspends and admits
    )
    child.pop("ttlSecondsAfterFinished", None)
    jobset_spec: dict[str, Any] = {
        "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True, "subdomain": name},
        "failurePolicy": {
            "maxRestarts": cfg.backoff_limit,
            "rules": [
                # The child Job failed through the podFailurePolicy's FailJob rule
                # (exit EXIT_BAD_CONFIG): restarting cannot help.
                {"name": "bad-config", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]},
            ],
        },
        "successPolicy": {"operator": "All"},
        "replicatedJobs": [
            {"name": JOBSET_REPLICATED_JOB, "replicas": 1, "template": {"metadata": {"labels": labels}, "spec": child}},
        ],
    }
    if cfg.queue_name is not None:
        jobset_spec["suspend"] = True
    if cfg.ttl_seconds_after_finished is not None:
        jobset_spec["ttlSecondsAfterFinished"] = cfg.ttl_seconds_after_finished
    return {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": _metadata(name, cfg, {**labels, **_queue_labels(cfg)}, {ANNOTATION_SPEC_URI: spec_uri}),
        "spec": jobset_spec,
    }


# Cluster-wide objects for deploy/ -------------------------------------------------


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
        if len(v) > 63 or not re.match(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", v):
            raise ValueError(f"{info.field_name}={v!r} is not a DNS label; accepted: lowercase letters, digits, '-'")
        return v

    @field_validator("cpu", "memory", "borrow_cpu", "borrow_memory")
    @classmethod
    def _quantity(cls, v: Optional[str], info: Any) -> Optional[str]:
        return _check_quantity(info.field_name, v)


# Priority values: interactive (a person waiting) > production (scheduled
# retraining) > sweep (exploration that can wait and be preempted).


def priority_classes() -> list[dict[str, Any]]:
    """scheduling.k8s.io/v1 PriorityClasses: interactive > production > sweep.

    Sweep pods never preempt anything (`preemptionPolicy: Never`): they wait for
    free capacity, and being lowest they are the first preempted; the
    preemption checkpoint makes that cheap.
    """
    out = []
    for name, (value, description) in PRIORITIES.items():
        out.append({
            "apiVersion": "scheduling.k8s.io/v1",
            "kind": "PriorityClass",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "trainyard"}},
            "value": value,
            "globalDefault": False,
            "preemptionPolicy": "Never" if name == "trainyard-sweep" else "PreemptLowerPriority",
            "description": description,
        })
    return out


def workload_priority_classes() -> list[dict[str, Any]]:
    """Kueue WorkloadPriorityClasses mirroring `priority_classes()` for queue ordering."""
    return [
        {
            "apiVersion": KUEUE_API,
            "kind": "WorkloadPriorityClass",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "trainyard"}},
            "value": value,
            "description": description,
        }
        for name, (value, description) in PRIORITIES.items()
    ]


def kueue_objects(teams: list[TeamQuota], cohort: str, flavor: str) -> list[dict[str, Any]]:
    """A ResourceFlavor, one ClusterQueue per team in one cohort, one LocalQueue per team namespace.

    Teams borrow each other's idle quota inside the cohort (up to their
    borrowing limit) and reclaim their own nominal quota by preempting borrowers.
    """
    _check_dns_subdomain("cohort", cohort)
    _check_dns_subdomain("flavor", flavor)
    names = [t.team for t in teams]
    if len(set(names)) != len(names):
        raise ManifestError(f"teams {names} repeat a name; accepted: one TeamQuota per team")
    part_of = {"app.kubernetes.io/part-of": "trainyard"}
    objs: list[dict[str, Any]] = [
        {"apiVersion": KUEUE_API, "kind": "ResourceFlavor", "metadata": {"name": flavor, "labels": part_of}, "spec": {}}
    ]
    for t in teams:
        resources = []
        for res, nominal, borrow in (("cpu", t.cpu, t.borrow_cpu), ("memory", t.memory, t.borrow_memory),
                                     (GPU_RESOURCE, t.gpus, t.borrow_gpus)):
            entry: dict[str, Any] = {"name": res, "nominalQuota": nominal}
            if borrow is not None:
                entry["borrowingLimit"] = borrow
            resources.append(entry)
        objs.append({
            "apiVersion": KUEUE_API,
            "kind": "ClusterQueue",
            "metadata": {"name": t.team, "labels": part_of},
            "spec": {
                "cohortName": cohort,
                # Only the team's own namespace may submit to its queue.
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": t.namespace}},
                # A big gang waiting for quota does not block smaller jobs behind it.
                "queueingStrategy": "BestEffortFIFO",
                "preemption": {
                    # Get nominal quota back from teams borrowing it.
                    "reclaimWithinCohort": "Any",
                    # Interactive and production work displaces the team's own sweeps.
                    "withinClusterQueue": "LowerPriority",
                },
                "resourceGroups": [
                    {"coveredResources": ["cpu", "memory", GPU_RESOURCE],
                     "flavors": [{"name": flavor, "resources": resources}]},
                ],
            },
        })
        objs.append({
            "apiVersion": KUEUE_API,
            "kind": "LocalQueue",
            "metadata": {"name": t.queue_name, "namespace": t.namespace, "labels": part_of},
            "spec": {"clusterQueue": t.team},
        })
    return objs


def rbac_objects(namespace: str, service_account: str, *, service_account_namespace: Optional[str] = None) -> list[dict[str, Any]]:
    """Least-privilege access for the launcher in one team namespace.

    The launcher creates and watches Jobs and their Services, reads pods and
    rank 0's log, and reads Kueue Workloads to say why a trial is queued;
    nothing else. `service_account_namespace` is where the launcher runs (the
    Dagster run pods); by default the team namespace itself.
    """
    _check_dns_subdomain("namespace", namespace)
    _check_dns_subdomain("service_account", service_account)
    sa_ns = service_account_namespace or namespace
    part_of = {"app.kubernetes.io/part-of": "trainyard"}
    role = service_account  # Role and RoleBinding named after the account they serve
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": {"name": service_account, "namespace": sa_ns, "labels": part_of}},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": role, "namespace": namespace, "labels": part_of},
            "rules": [
                {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["create", "get", "list", "watch", "delete"]},
                {"apiGroups": [""], "resources": ["services"], "verbs": ["create", "get", "delete"]},
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
                {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
                {"apiGroups": ["kueue.x-k8s.io"], "resources": ["workloads"], "verbs": ["get", "list", "watch"]},
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": role, "namespace": namespace, "labels": part_of},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
            "subjects": [{"kind": "ServiceAccount", "name": service_account, "namespace": sa_ns}],
        },
    ]
