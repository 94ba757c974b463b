"""The Kubernetes objects of one trial, built by pure functions (no API calls).

A trial attempt on Kubernetes is one gang, one pod per node. By default a JobSet
(`jobset_manifest`): one replicated Job `node` (an Indexed Job, node rank =
completion index) whose pods find rank 0 at `<jobset>-node-0-0.<jobset>` through
the headless Service the JobSet controller makes; any failure of a pod fails the
child Job at once, and the JobSet's failurePolicy restarts the whole gang (every
pod, a fresh rendezvous, from the newest committed checkpoint) or fails it, by
the child Job's failure reason and message: a user or config error fails at
once, a disruption or preemption restarts without using up the budget, anything
else (a lost node, OOM, SIGKILL, infrastructure) restarts within `maxRestarts`.
For clusters without the JobSet controller, one Indexed Job (`job_manifest`)
plus a headless Service (`service_manifest`) that gives every pod a stable DNS
name, so torchrun in each pod can reach rank 0 at `<job>-0.<job>`; it has the
child Job's policy (backoffLimit 0, any pod failure fails it at once), and the
Dagster run's retry is its whole-gang restart: a new attempt, a new Job, a
fresh rendezvous from the newest committed checkpoint (a replacement pod could
not rejoin torchrun's static rendezvous of the survivors). Either
way Kueue admits the gang as one Workload (it is created suspended with a queue
label), PriorityClasses order teams' work, and the policies read each pod's
exit status, which `training.gang` makes the classified status of the first
failing worker. `trial_objects` is every object one attempt submits, in order.

Every function returns plain dicts that validate against the Kubernetes schemas
(`kubernetes-validate`, strict) or, for JobSet, against its CRD.

Every pod satisfies the `restricted` Pod Security profile: it runs as the
image's non-root user, without privilege escalation or capabilities, under the
runtime's default seccomp profile, on a read-only root filesystem; what
libraries write (HOME, /tmp, caches of torch, triton, W&B, matplotlib) goes to
emptyDirs, pointed at by the variables in `trainyard.podconfig.WRITABLE_ENV`.

Example:
    cfg = K8sJobConfig(namespace="vision", image="registry.example/trainer@sha256:<64 hex>",
                       queue_name="trainyard", priority_class="trainyard-sweep")
    job = job_manifest(spec, "s3://bucket/runs/trial-0003/spec.json", attempt=0, cfg=cfg)
    svc = service_manifest(job["metadata"]["name"], cfg, labels=trial_labels(spec, 0))
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

from resources.k8s.config import K8sJobConfig
from resources.k8s.errors import ManifestError
from resources.k8s.names import (
    ANNOTATION_SPEC_URI,
    COMPLETION_INDEX_ANNOTATION,
    CONTAINER_NAME,
    GPU_RESOURCE,
    JOBSET_API,
    JOBSET_REPLICATED_JOB,
    KUEUE_PRIORITY_LABEL,
    KUEUE_QUEUE_LABEL,
    LABEL_JOB,
    MAX_JOB_NAME,
    MAX_JOBSET_NAME,
    gang_name,
    trial_labels,
)
from resources.launcher import torchrun_command
from training.spec import (
    EXIT_BAD_CONFIG,
    EXIT_INFRA,
    EXIT_PREEMPTED,
    EXIT_USER_ERROR,
    LAUNCH_ID_ENV,
    TRAINING_MALLOC_ENV,
    TrainSpec,
)
from trainyard.podconfig import SCRATCH_DIR, TRAINER_HOME, TRAINER_UID, WRITABLE_ENV

# The restricted Pod Security profile, and a read-only root filesystem on top.
POD_SECURITY_CONTEXT: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": TRAINER_UID,
    "runAsGroup": TRAINER_UID,
    # emptyDirs (and any mounted volume) writable by the pod's group.
    "fsGroup": TRAINER_UID,
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY_CONTEXT: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "privileged": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
}


def _pod_gpus(spec: TrainSpec, cfg: K8sJobConfig) -> int:
    dist = spec.distribution
    wanted = dist.procs_per_node if dist.accelerator == "gpu" else 0
    if cfg.gpus_per_pod is not None and cfg.gpus_per_pod != wanted:
        if dist.accelerator == "gpu":
            raise ManifestError(
                f"gpus_per_pod={cfg.gpus_per_pod} does not match distribution.procs_per_node={dist.procs_per_node}: "
                f"one process drives one GPU, so a pod must request exactly procs_per_node GPUs; accepted: {wanted} "
                "or unset"
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


def _env(cfg: K8sJobConfig) -> list[dict[str, Any]]:
    return [
        # The node rank. Recent Job controllers inject the same variable into
        # Indexed Job pods; declaring it here makes the $(JOB_COMPLETION_INDEX)
        # reference in the command resolvable from the manifest alone.
        {
            "name": "JOB_COMPLETION_INDEX",
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"}},
        },
        # Unbuffered output so rank 0's log lines reach `kubectl logs` (and the
        # orchestrator's log stream) as they are printed.
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        # One launch = one Job: attempt records and "fail at once" checks key on it.
        {
            "name": LAUNCH_ID_ENV,
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['batch.kubernetes.io/job-name']"}},
        },
        # The node, so the pod-side watchdog names where a hung or slow rank ran (`training.watchdog`).
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        # HOME, TMPDIR and the caches of torch, triton, W&B and matplotlib: inside
        # the writable emptyDirs, since the root filesystem is read-only.
        *({"name": k, "value": v} for k, v in WRITABLE_ENV.items()),
        # The training processes' allocator settings (`TRAINING_MALLOC_ENV`), unless the job's env sets them.
        *({"name": k, "value": v} for k, v in TRAINING_MALLOC_ENV.items() if k not in cfg.env),
        *({"name": k, "value": v} for k, v in sorted(cfg.env.items())),
        # Credentials only by reference: the manifest (and the Dagster event log
        # it may end up in) never holds a secret value.
        *(ref.to_k8s(k) for k, ref in sorted(cfg.secret_env.items())),
    ]


def _volumes(cfg: K8sJobConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The pod's volumes and the container's mounts: the writable places on a read-only root filesystem."""
    scratch: dict[str, Any] = {"sizeLimit": cfg.scratch_size} if cfg.scratch_size is not None else {}
    volumes: list[dict[str, Any]] = [
        {"name": "home", "emptyDir": dict(scratch)},
        {"name": "tmp", "emptyDir": dict(scratch)},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "home", "mountPath": TRAINER_HOME},
        {"name": "tmp", "mountPath": SCRATCH_DIR},
    ]
    if cfg.shm_size is not None:
        # DataLoader workers share batches through /dev/shm; the runtime's 64 MiB breaks them.
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": cfg.shm_size}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    return volumes, mounts


def _container(spec: TrainSpec, spec_uri: str, cfg: K8sJobConfig, *, master_addr: str) -> dict[str, Any]:
    if spec.distribution.nodes == 1:
        # One pod: torchrun's private rendezvous; no peers need to find it.
        command = torchrun_command(spec, spec_uri, python="python")
    else:
        # Kubernetes expands $(JOB_COMPLETION_INDEX) from the container env below.
        command = torchrun_command(
            spec, spec_uri, python="python", node_rank="$(JOB_COMPLETION_INDEX)",
            master_addr=master_addr, master_port=cfg.master_port,
        )
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": cfg.image,
        "imagePullPolicy": "IfNotPresent",
        "command": command,
        # Writable (an emptyDir): stray files in the working directory (a
        # library's default output directory) land here, not on the read-only image.
        "workingDir": TRAINER_HOME,
        "env": _env(cfg),
        "resources": _resources(_pod_gpus(spec, cfg), cfg),
        "ports": [{"name": "rendezvous", "containerPort": cfg.master_port, "protocol": "TCP"}],
        "securityContext": dict(CONTAINER_SECURITY_CONTEXT),
    }
    if cfg.env_from_secrets:
        container["envFrom"] = [{"secretRef": {"name": s}} for s in cfg.env_from_secrets]
    return container


def _pod_template(
    spec: TrainSpec,
    spec_uri: str,
    cfg: K8sJobConfig,
    labels: dict[str, str],
    *,
    master_addr: str,
    subdomain: Optional[str],
) -> dict[str, Any]:
    container = _container(spec, spec_uri, cfg, master_addr=master_addr)
    volumes, container["volumeMounts"] = _volumes(cfg)
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
        "securityContext": dict(POD_SECURITY_CONTEXT),
        "containers": [container],
        "volumes": volumes,
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
    affinity = avoiding(cfg.affinity.to_k8s() if cfg.affinity is not None else {}, cfg.avoid_nodes)
    if affinity:
        pod_spec["affinity"] = affinity
    return {"metadata": {"labels": labels}, "spec": pod_spec}


HOSTNAME_LABEL = "kubernetes.io/hostname"
AVOID_WEIGHT = 100  # the most a preference weighs: the scheduler places elsewhere whenever it can


def avoiding(affinity: dict[str, Any], nodes: tuple[str, ...]) -> dict[str, Any]:
    """`affinity` (a pod's, as in a manifest) with a preference against `nodes` added to the team's own terms.

    Preferred, not required: a hung rank or a straggler makes a node suspect, not
    unusable, and a cluster with no other room must still place the gang.

    Example:
        >>> preferred = avoiding({}, ("node-b",))["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        >>> preferred[0]["preference"]
        {'matchExpressions': [{'key': 'kubernetes.io/hostname', 'operator': 'NotIn', 'values': ['node-b']}]}
    """
    if not nodes:
        return affinity
    term = {
        "weight": AVOID_WEIGHT,
        "preference": {
            "matchExpressions": [{"key": HOSTNAME_LABEL, "operator": "NotIn", "values": sorted(set(nodes))}]
        },
    }
    node_affinity = dict(affinity.get("nodeAffinity", {}))
    node_affinity["preferredDuringSchedulingIgnoredDuringExecution"] = [
        *node_affinity.get("preferredDuringSchedulingIgnoredDuringExecution", []), term]
    return {**affinity, "nodeAffinity": node_affinity}


def _exit_codes(*codes: int) -> dict[str, Any]:
    return {"containerName": CONTAINER_NAME, "operator": "In", "values": sorted(codes)}


def _metadata(
    name: str, cfg: K8sJobConfig, labels: dict[str, str], annotations: Optional[dict[str, str]] = None
) -> dict[str, Any]:
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


def owner_reference(job: Mapping[str, Any]) -> dict[str, Any]:
    """An ownerReference to `job` (as the API returned it, with its uid): deleting the Job deletes the owned object."""
    meta = job["metadata"]
    if not meta.get("uid"):
        raise ManifestError(
            f"{job.get('kind')} {meta.get('name')} has no uid yet; an owner must exist before what it owns"
        )
    # No blockOwnerDeletion: setting it needs `update` on jobs/finalizers, which the launcher's Role does not grant.
    return {"apiVersion": job["apiVersion"], "kind": job["kind"], "name": meta["name"], "uid": meta["uid"]}


def service_manifest(name: str, cfg: K8sJobConfig, labels: Optional[Mapping[str, str]] = None,
                     owner: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """The headless Service whose name is the pods' subdomain (`<job>-<i>.<name>`).

    `owner` is the created Job (with its uid): the Service then carries an
    ownerReference to it, so the garbage collector deletes it with the Job.
    """
    meta = _metadata(name, cfg, {**cfg.labels, **(labels or {}), LABEL_JOB: name})
    if owner is not None:
        meta["ownerReferences"] = [owner_reference(owner)]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            # Headless: DNS returns the pod addresses themselves, one record per pod.
            "clusterIP": "None",
            "selector": {LABEL_JOB: name},
            # Ranks rendezvous before any pod is Ready (there is no readiness
            # probe to pass), so records must exist as soon as pods have an IP.
            "publishNotReadyAddresses": True,
            "ports": [
                {"name": "rendezvous", "port": cfg.master_port, "targetPort": cfg.master_port, "protocol": "TCP"}
            ],
        },
    }


def _gang_pod_failure_policy() -> dict[str, Any]:
    """A gang's Job (a JobSet's child, or the Indexed Job option): every pod failure fails the Job at once.

    A JobSet then decides for the whole gang: FailJob rules give the child Job
    the failure reason PodFailurePolicy and a message naming the rule's cause,
    which the JobSet's failurePolicy matches (`_jobset_failure_policy`);
    anything else is counted against backoffLimit 0 (reason
    BackoffLimitExceeded). For the Indexed Job option the launcher decides from
    the failed pod's exit code or DisruptionTarget condition (user or config
    error, preempted, infrastructure) and the Dagster run retries or fails.

    The container runs `training.gang`, which exits with the classified status
    of the first failing worker (`training.spec.EXIT_*`), not torchrun's 1.
    """
    return {
        "rules": [
            # Preemption, node drain, eviction: the JobSet restarts the gang without using up maxRestarts.
            {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            # A bug in model or data code, or a spec that cannot work: the JobSet fails at once.
            {"action": "FailJob", "onExitCodes": _exit_codes(EXIT_USER_ERROR, EXIT_BAD_CONFIG)},
            # Stopped on request after a checkpoint, without a DisruptionTarget condition: a preemption too.
            {"action": "FailJob", "onExitCodes": _exit_codes(EXIT_PREEMPTED)},
            # A lost worker, node or dependency (EXIT_INFRA), or the container killed: the JobSet restarts the
            # gang within maxRestarts.
            {"action": "Count", "onExitCodes": _exit_codes(EXIT_INFRA)},
        ]
    }


# The Job controller's message for a FailJob rule on exit codes (pkg/controller/job/pod_failure_policy.go):
# "Container trainer for pod <ns>/<pod> failed with exit code 1 matching FailJob rule at index 1".
USER_ERROR_PATTERN = f"failed with exit code ({EXIT_USER_ERROR}|{EXIT_BAD_CONFIG}) matching FailJob rule"


def _jobset_failure_policy(max_restarts: int) -> dict[str, Any]:
    """What a failed child Job means to the JobSet; the first matching rule acts, no match restarts within
    `max_restarts`."""
    return {
        "maxRestarts": max_restarts,
        "rules": [
            # Exit EXIT_USER_ERROR or EXIT_BAD_CONFIG (`_gang_pod_failure_policy` rule 1): restarting cannot help.
            # First, so that a JobSet controller without onJobFailureMessagePatterns (before v0.10), whose API
            # server drops the field, fails every PodFailurePolicy failure instead of restarting user errors.
            {
                "name": "user-or-config-error",
                "action": "FailJobSet",
                "onJobFailureReasons": ["PodFailurePolicy"],
                "onJobFailureMessagePatterns": [USER_ERROR_PATTERN],
            },
            # The other FailJob rules, preempted or disrupted (rules 0 and 2): not the trial's fault; the whole
            # gang restarts from its preemption checkpoint without using up the budget.
            {
                "name": "disruption",
                "action": "RestartJobSetAndIgnoreMaxRestarts",
                "onJobFailureReasons": ["PodFailurePolicy"],
            },
            # activeDeadlineSeconds: a hung or too-long trial would run as long again.
            {"name": "deadline", "action": "FailJobSet", "onJobFailureReasons": ["DeadlineExceeded"]},
            # No rule (BackoffLimitExceeded: exit EXIT_INFRA, a SIGKILL, OOM, a lost node): RestartJobSet within
            # maxRestarts.
        ],
    }


def _job_spec(spec: TrainSpec, spec_uri: str, cfg: K8sJobConfig, name: str, pod_labels: dict[str, str], *,
              master_addr: str, subdomain: Optional[str], suspend: bool) -> dict[str, Any]:
    nodes = spec.distribution.nodes
    job_spec: dict[str, Any] = {
        # One pod per node with a stable index 0..nodes-1: the index is the
        # torchrun node rank and names the pod's hostname `<job>-<index>`.
        "completionMode": "Indexed",
        "completions": nodes,
        "parallelism": nodes,
        # Any pod failure fails the Job at once: a gang restarts whole, never one pod
        # (torchrun's static rendezvous cannot take a replacement of one node).
        "backoffLimit": 0,
        "podFailurePolicy": _gang_pod_failure_policy(),
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


def job_manifest(spec: TrainSpec, spec_uri: str, attempt: int, cfg: K8sJobConfig, run_id: Optional[str] = None,
                 generation: int = 0) -> dict[str, Any]:
    """The batch/v1 Indexed Job that runs one attempt of a trial on `spec.distribution.nodes` pods.

    Every pod runs `torchrun_command(...)` with node rank `$(JOB_COMPLETION_INDEX)`
    and rank 0 at `<job>-0.<job>` (the headless Service from `service_manifest`).
    A failed pod fails the Job at once (backoffLimit 0); the launcher classifies
    it and the Dagster run's retry starts the next attempt's Job.
    """
    name = gang_name(spec.pipeline, spec.trial_id, attempt, generation, max_length=MAX_JOB_NAME)
    labels = {**cfg.labels, **trial_labels(spec, attempt, run_id), LABEL_JOB: name}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _metadata(name, cfg, {**labels, **_queue_labels(cfg)}, {ANNOTATION_SPEC_URI: spec_uri}),
        "spec": _job_spec(
            spec,
            spec_uri,
            cfg,
            name,
            labels,
            master_addr=f"{name}-0.{name}",
            subdomain=name,
            suspend=cfg.queue_name is not None,
        ),
    }


def jobset_manifest(spec: TrainSpec, spec_uri: str, attempt: int, cfg: K8sJobConfig, run_id: Optional[str] = None,
                    generation: int = 0) -> dict[str, Any]:
    """The trial attempt as a JobSet (jobset.x-k8s.io/v1alpha2): the launcher's default gang.

    The JobSet controller makes its headless Service (`network.subdomain`) and
    the child Job `<jobset>-node-0`; a pod's failure fails the child Job at once
    and the JobSet restarts the whole gang (`failurePolicy`: `cfg.backoff_limit`
    counted restarts; disruptions not counted; a user or config error or the
    deadline fails it), which suits torchrun's static rendezvous: every restart
    is a fresh rendezvous of all ranks from the newest committed checkpoint.
    """
    name = gang_name(spec.pipeline, spec.trial_id, attempt, generation, max_length=MAX_JOBSET_NAME)
    labels = {**cfg.labels, **trial_labels(spec, attempt, run_id), LABEL_JOB: name}
    child = _job_spec(
        spec, spec_uri, cfg, name, labels,
        # Pod hostnames are <jobset>-<replicated job>-<job index>-<pod index>.
        master_addr=f"{name}-{JOBSET_REPLICATED_JOB}-0-0.{name}",
        subdomain=None,  # set by the JobSet controller from network.subdomain
        # Any pod failure fails the child Job at once (backoffLimit 0), and the
        # JobSet restarts every pod together: a fresh rendezvous for all ranks.
        suspend=False,  # the JobSet is what Kueue suspends and admits
    )
    child.pop("ttlSecondsAfterFinished", None)
    jobset_spec: dict[str, Any] = {
        "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True, "subdomain": name},
        "failurePolicy": _jobset_failure_policy(cfg.backoff_limit),
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


GANG_KINDS = ("job", "jobset")


def trial_objects(spec: TrainSpec, spec_uri: str, attempt: int, cfg: K8sJobConfig, kind: str = "jobset",
                  run_id: Optional[str] = None, generation: int = 0) -> list[dict[str, Any]]:
    """Every object one attempt of a trial submits, in the order it creates them.

    `kind` "jobset" (the launcher's default): the JobSet (its controller makes
    the child Job and the Service); "job": the Indexed Job, then the headless
    Service (the launcher adds an ownerReference to the created Job, whose uid
    only the API knows). Every object carries the
    trial's labels, with the Dagster run id `run_id` when given; `generation` > 0
    names a resized gang of the attempt (`resources.k8s.names.gang_name`).
    `trainyard k8s render` prints these, and the Kubernetes launcher creates them.

    Raises:
        ManifestError: `kind` is not one of `GANG_KINDS`, or the configuration does not fit the spec.
    """
    if kind == "jobset":
        return [jobset_manifest(spec, spec_uri, attempt, cfg, run_id, generation)]
    if kind != "job":
        raise ManifestError(f"kind={kind!r} is not a gang kind; accepted: {', '.join(GANG_KINDS)}")
    job = job_manifest(spec, spec_uri, attempt, cfg, run_id, generation)
    return [job, service_manifest(job["metadata"]["name"], cfg, labels=trial_labels(spec, attempt, run_id))]


PROBE_COMMAND = ["python", "-c", "import signal; signal.pause()"]


def capacity_probe_manifest(
    spec: TrainSpec, cfg: K8sJobConfig, name: str, pods: int, labels: Mapping[str, str]
) -> dict[str, Any]:
    """An Indexed Job of `pods` placeholder pods shaped like the gang's: the capacity a smaller gang would grow back
    into.

    Each pod asks for what one of the gang's pods asks for (requests, GPUs, node
    selector, tolerations, affinity, the same Pod Security settings) and only
    sleeps, so a pod that the scheduler places and starts proves that one more
    node of the gang fits, and holds that node until the gang grows into it.
    It carries no Kueue queue label: it stands in the quota the trial's
    full-size gang was admitted with, and is not a workload of its own.
    """
    meta_labels = {**cfg.labels, **labels, LABEL_JOB: name}
    template = _pod_template(spec, "", cfg, meta_labels, master_addr="probe", subdomain=None)
    container = template["spec"]["containers"][0]
    container["command"] = list(PROBE_COMMAND)
    container.pop("ports", None)
    # Nothing to save: a probe pod stops at once when the gang grows into its node.
    template["spec"]["terminationGracePeriodSeconds"] = 1
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _metadata(name, cfg, meta_labels),
        "spec": {
            "completionMode": "Indexed",
            "completions": pods,
            "parallelism": pods,
            "backoffLimit": 6,
            "template": template,
        },
    }
