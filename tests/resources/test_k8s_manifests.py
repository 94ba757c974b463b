"""Kubernetes manifests: exact values, name limits, validation, and schema checks.

Core objects are validated with kubernetes-validate (strict: unknown fields fail)
against the oldest supported version (1.29) and the newest schema it ships;
Kueue and JobSet objects against their CRDs' openAPIV3Schema, made strict the
same way. An object whose schema cannot be found fails the test.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
from pydantic import ValidationError

from resources.k8s.cluster import (
    kueue_objects,
    priority_classes,
    rbac_objects,
    trial_rbac_objects,
    workload_priority_classes,
)
from resources.k8s.config import K8sJobConfig, SecretKeyRef, TeamQuota, Toleration
from resources.k8s.errors import ManifestError
from resources.k8s.manifests import job_manifest, jobset_manifest, service_manifest, trial_objects
from resources.k8s.names import job_name, label_value, trial_labels
from resources.launcher import torchrun_command
from tests.support.k8s import crd_validate, k8s_validate, load_crd_schemas, validate_any
from tests.support.train_specs import make_spec
from training.spec import EXIT_BAD_CONFIG, EXIT_INFRA, EXIT_PREEMPTED, EXIT_USER_ERROR, Distribution

ROOT = Path(__file__).resolve().parents[2]
SPEC_URI = "s3://bucket/runs/vision/digits/trial-0000/spec.json"
# The name of (vision/digits, trial-0000, attempt 0). Written out, not computed: a
# new orchestrator version must compute the names of Jobs an older one started.
NAME = "vision-digits-trial-0000-a0-b0219d58"
IMAGE = "registry.example/trainyard/trainer@sha256:" + "3f" * 32
AFFINITY = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
    {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-A100-SXM4-80GB"]}]}]}}}


@pytest.fixture(scope="module")
def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    return load_crd_schemas()


@pytest.fixture(scope="module")
def two_node_spec(tmp_path_factory: pytest.TempPathFactory):
    return make_spec(
        tmp_path_factory.mktemp("spec"), distribution=Distribution(nodes=2, procs_per_node=4, accelerator="gpu")
    )


def full_config(**over: Any) -> K8sJobConfig:
    base: dict[str, Any] = dict(
        namespace="vision",
        image=IMAGE,
        queue_name="trainyard",
        priority_class="trainyard-sweep",
        service_account="trainer",
        gpus_per_pod=4,
        cpu="30",
        memory="200Gi",
        node_selector={"pool": "a100"},
        tolerations=(Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule"),),
        affinity=AFFINITY,
        shm_size="16Gi",
        scratch_size="50Gi",
        termination_grace_seconds=180,
        ttl_seconds_after_finished=3600,
        backoff_limit=2,
        active_deadline_seconds=86400,
        env_from_secrets=("wandb-credentials", "s3-credentials"),
        env={"AWS_ENDPOINT_URL": "http://minio.storage:9000", "NCCL_SOCKET_IFNAME": "eth0"},
        secret_env={"HF_TOKEN": SecretKeyRef(secret="hf-credentials", key="token")},
        labels={"cost-center": "ml-vision"},
    )
    base.update(over)
    return K8sJobConfig(**base)


def test_two_node_job_exact(two_node_spec) -> None:
    cfg = full_config()
    job = job_manifest(two_node_spec, SPEC_URI, 0, cfg)
    labels = {
        "cost-center": "ml-vision",
        "trainyard.io/pipeline": "vision.digits",
        "trainyard.io/trial": "trial-0000",
        "trainyard.io/attempt": "0",
        "trainyard.io/job-name": NAME,
    }
    command = [
        "python", "-m", "training.gang", "--nnodes=2", "--nproc-per-node=4", "--max-restarts=2",
        "--node-rank=$(JOB_COMPLETION_INDEX)", f"--master-addr={NAME}-0.{NAME}", "--master-port=29500",
        "-m", "training.entrypoint", "--spec", SPEC_URI,
    ]
    assert job == {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": NAME,
            "namespace": "vision",
            "labels": {**labels, "kueue.x-k8s.io/queue-name": "trainyard"},
            "annotations": {"trainyard.io/spec-uri": SPEC_URI},
        },
        "spec": {
            "completionMode": "Indexed",
            "completions": 2,
            "parallelism": 2,
            "backoffLimit": 0,  # whatever backoff_limit says: a gang restarts whole, through the run's retry
            "podFailurePolicy": {
                "rules": [
                    {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                    {
                        "action": "FailJob",
                        "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [1, 78]},
                    },
                    {
                        "action": "FailJob",
                        "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [143]},
                    },
                    {"action": "Count", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [75]}},
                ]
            },
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": 180,
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": 10001,
                        "runAsGroup": 10001,
                        "fsGroup": 10001,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "containers": [
                        {
                            "name": "trainer",
                            "image": IMAGE,
                            "imagePullPolicy": "IfNotPresent",
                            "command": command,
                            "workingDir": "/home/trainer",
                            "env": [
                                {
                                    "name": "JOB_COMPLETION_INDEX",
                                    "valueFrom": {
                                        "fieldRef": {
                                            "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"  # noqa: E501
                                        }
                                    },
                                },
                                {"name": "PYTHONUNBUFFERED", "value": "1"},
                                {
                                    "name": "TRAINYARD_LAUNCH_ID",
                                    "valueFrom": {
                                        "fieldRef": {"fieldPath": "metadata.labels['batch.kubernetes.io/job-name']"}
                                    },
                                },
                                {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                                {"name": "HOME", "value": "/home/trainer"},
                                {"name": "TMPDIR", "value": "/tmp"},
                                {"name": "XDG_CACHE_HOME", "value": "/home/trainer/.cache"},
                                {"name": "XDG_CONFIG_HOME", "value": "/home/trainer/.config"},
                                {"name": "TORCHINDUCTOR_CACHE_DIR", "value": "/home/trainer/.cache/torchinductor"},
                                {"name": "TRITON_CACHE_DIR", "value": "/home/trainer/.cache/triton"},
                                {"name": "MPLCONFIGDIR", "value": "/home/trainer/.config/matplotlib"},
                                {"name": "WANDB_DIR", "value": "/home/trainer/wandb"},
                                {"name": "WANDB_CACHE_DIR", "value": "/home/trainer/.cache/wandb"},
                                {"name": "WANDB_CONFIG_DIR", "value": "/home/trainer/.config/wandb"},
                                {"name": "MALLOC_MMAP_THRESHOLD_", "value": "33554432"},
                                {"name": "MALLOC_TRIM_THRESHOLD_", "value": "4294967296"},
                                {"name": "AWS_ENDPOINT_URL", "value": "http://minio.storage:9000"},
                                {"name": "NCCL_SOCKET_IFNAME", "value": "eth0"},
                                {
                                    "name": "HF_TOKEN",
                                    "valueFrom": {"secretKeyRef": {"name": "hf-credentials", "key": "token"}},
                                },
                            ],
                            "resources": {
                                "requests": {"cpu": "30", "memory": "200Gi", "nvidia.com/gpu": 4},
                                "limits": {"memory": "200Gi", "nvidia.com/gpu": 4},
                            },
                            "ports": [{"name": "rendezvous", "containerPort": 29500, "protocol": "TCP"}],
                            "securityContext": {
                                "allowPrivilegeEscalation": False,
                                "capabilities": {"drop": ["ALL"]},
                                "privileged": False,
                                "readOnlyRootFilesystem": True,
                                "runAsNonRoot": True,
                            },
                            "envFrom": [
                                {"secretRef": {"name": "wandb-credentials"}},
                                {"secretRef": {"name": "s3-credentials"}},
                            ],
                            "volumeMounts": [
                                {"name": "home", "mountPath": "/home/trainer"},
                                {"name": "tmp", "mountPath": "/tmp"},
                                {"name": "dshm", "mountPath": "/dev/shm"},
                            ],
                        }
                    ],
                    "volumes": [
                        {"name": "home", "emptyDir": {"sizeLimit": "50Gi"}},
                        {"name": "tmp", "emptyDir": {"sizeLimit": "50Gi"}},
                        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}},
                    ],
                    "subdomain": NAME,
                    "serviceAccountName": "trainer",
                    "priorityClassName": "trainyard-sweep",
                    "nodeSelector": {"pool": "a100"},
                    "tolerations": [{"operator": "Exists", "key": "nvidia.com/gpu", "effect": "NoSchedule"}],
                    "affinity": AFFINITY,
                },
            },
            "suspend": True,
            "activeDeadlineSeconds": 86400,
            "ttlSecondsAfterFinished": 3600,
        },
    }
    # The command is the launcher's, not a copy of it.
    assert command == torchrun_command(
        two_node_spec, SPEC_URI, python="python", node_rank="$(JOB_COMPLETION_INDEX)",
        master_addr=f"{NAME}-0.{NAME}", master_port=29500,
    )
    k8s_validate(job)


def test_invariants_hold_for_other_shapes(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, distribution=Distribution(nodes=3, procs_per_node=2))
    cfg = K8sJobConfig(namespace="vision", image="trainer:1", queue_name="q", master_port=29400, shm_size=None)
    job = job_manifest(spec, SPEC_URI, 5, cfg)
    s, pod = job["spec"], job["spec"]["template"]["spec"]
    assert (s["completionMode"], s["parallelism"], s["completions"], s["suspend"]) == ("Indexed", 3, 3, True)
    container = pod["containers"][0]
    assert "nvidia.com/gpu" not in container["resources"]["requests"]  # CPU training holds no GPU
    # No /dev/shm volume and no Secrets; the writable scratch space is always there.
    assert pod["volumes"] == [{"name": "home", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}]
    assert [m["mountPath"] for m in container["volumeMounts"]] == [
        "/home/trainer",
        "/tmp",
    ] and "envFrom" not in container
    assert "affinity" not in pod and "nodeSelector" not in pod and "tolerations" not in pod
    assert "--master-port=29400" in container["command"]
    assert job["metadata"]["labels"]["trainyard.io/attempt"] == "5"
    k8s_validate(job)


def test_pod_failure_rules_follow_the_gang_exit_codes(two_node_spec) -> None:
    """The container's status is `training.gang`'s contract (tests/training/test_gang.py runs it): each code has its
    rule."""
    rules = job_manifest(two_node_spec, SPEC_URI, 0, full_config())["spec"]["podFailurePolicy"]["rules"]
    by_code = {code: r["action"] for r in rules if "onExitCodes" in r for code in r["onExitCodes"]["values"]}
    # Every failure fails the Job (backoffLimit 0): FailJob rules give the launcher (and a JobSet) the cause in the
    # Job's reason and message; EXIT_INFRA and anything else is counted, past backoffLimit 0.
    assert by_code == {
        EXIT_USER_ERROR: "FailJob",
        EXIT_BAD_CONFIG: "FailJob",
        EXIT_PREEMPTED: "FailJob",
        EXIT_INFRA: "Count",
    }
    assert all(
        r["onExitCodes"]["containerName"] == "trainer" and r["onExitCodes"]["operator"] == "In"
        for r in rules
        if "onExitCodes" in r
    )
    assert rules[0] == {
        "action": "FailJob",
        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
    }  # checked first
    command = job_manifest(two_node_spec, SPEC_URI, 0, full_config())["spec"]["template"]["spec"]["containers"][0][
        "command"
    ]
    assert command[:3] == ["python", "-m", "training.gang"]


def test_trial_objects_are_what_one_attempt_submits(two_node_spec) -> None:
    cfg = full_config()
    job, service = trial_objects(
        two_node_spec, SPEC_URI, 1, cfg, kind="job"
    )  # the Job first: the Service is owned by it
    assert job == job_manifest(two_node_spec, SPEC_URI, 1, cfg)
    assert service == service_manifest(job["metadata"]["name"], cfg, labels=trial_labels(two_node_spec, 1))
    assert trial_objects(two_node_spec, SPEC_URI, 1, cfg, kind="jobset") == [
        jobset_manifest(two_node_spec, SPEC_URI, 1, cfg)
    ]
    # With a Dagster run id, every object and every pod carries it (a UUID is a valid label value as it is).
    run_id = "6c4f0a0e-2b1d-4c3e-9f6a-0d2a6f1e8b77"
    for obj in (*trial_objects(two_node_spec, SPEC_URI, 1, cfg, kind="job", run_id=run_id),
                *trial_objects(two_node_spec, SPEC_URI, 1, cfg, kind="jobset", run_id=run_id)):
        assert obj["metadata"]["labels"]["trainyard.io/dagster-run"] == run_id
        for _, pod_labels in _pod_template_labels(obj):
            assert pod_labels["trainyard.io/dagster-run"] == run_id and pod_labels["trainyard.io/attempt"] == "1"
        validate_any(obj, load_crd_schemas())
    owned = service_manifest(
        "n", cfg, owner={"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "n", "uid": "u-1"}}
    )
    assert owned["metadata"]["ownerReferences"] == [
        {"apiVersion": "batch/v1", "kind": "Job", "name": "n", "uid": "u-1"}
    ]
    k8s_validate(owned)
    with pytest.raises(ManifestError, match="has no uid yet"):
        service_manifest("n", cfg, owner={"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "n"}})
    with pytest.raises(ManifestError, match="kind='pod' is not a gang kind; accepted: job, jobset"):
        trial_objects(two_node_spec, SPEC_URI, 1, cfg, kind="pod")


def _pod_template_labels(obj: dict) -> list[tuple[str, dict]]:
    if obj["kind"] == "Job":
        return [("job", obj["spec"]["template"]["metadata"]["labels"])]
    if obj["kind"] == "JobSet":
        return [
            (rj["name"], rj["template"]["spec"]["template"]["metadata"]["labels"])
            for rj in obj["spec"]["replicatedJobs"]
        ]
    return []


def test_single_node_uses_standalone_rendezvous(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, distribution=Distribution(procs_per_node=2))
    job = job_manifest(spec, SPEC_URI, 0, K8sJobConfig(namespace="vision", image="trainer:1", queue_name=None))
    assert job["spec"]["template"]["spec"]["containers"][0]["command"] == torchrun_command(
        spec, SPEC_URI, python="python"
    )
    assert "--standalone" in job["spec"]["template"]["spec"]["containers"][0]["command"]
    # No queue (a cluster without Kueue): nothing would ever unsuspend the Job.
    assert "suspend" not in job["spec"] and "kueue.x-k8s.io/queue-name" not in job["metadata"]["labels"]
    k8s_validate(job)


def test_a_jobs_own_allocator_setting_replaces_the_platforms(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, max_epochs=1)
    cfg = K8sJobConfig(namespace="vision", image="trainer:1", env={"MALLOC_TRIM_THRESHOLD_": "131072"})
    env = job_manifest(spec, SPEC_URI, 0, cfg)["spec"]["template"]["spec"]["containers"][0]["env"]
    malloc = [(e["name"], e["value"]) for e in env if e["name"].startswith("MALLOC_")]
    assert malloc == [("MALLOC_MMAP_THRESHOLD_", "33554432"), ("MALLOC_TRIM_THRESHOLD_", "131072")]  # each name once


def test_workload_priority_label_only_when_configured(two_node_spec) -> None:
    job = job_manifest(two_node_spec, SPEC_URI, 0, full_config(workload_priority_class="trainyard-production"))
    assert job["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "trainyard-production"
    assert "kueue.x-k8s.io/priority-class" not in job["spec"]["template"]["metadata"]["labels"]
    assert (
        "kueue.x-k8s.io/priority-class"
        not in job_manifest(two_node_spec, SPEC_URI, 0, full_config())["metadata"]["labels"]
    )


def test_service_is_headless_and_selects_the_jobs_pods(two_node_spec) -> None:
    cfg = full_config()
    job = job_manifest(two_node_spec, SPEC_URI, 0, cfg)
    svc = service_manifest(NAME, cfg, labels=trial_labels(two_node_spec, 0))
    assert svc == {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": NAME,
            "namespace": "vision",
            "labels": {
                "cost-center": "ml-vision",
                "trainyard.io/pipeline": "vision.digits",
                "trainyard.io/trial": "trial-0000",
                "trainyard.io/attempt": "0",
                "trainyard.io/job-name": NAME,
            },
        },
        "spec": {
            "clusterIP": "None",
            "selector": {"trainyard.io/job-name": NAME},
            "publishNotReadyAddresses": True,
            "ports": [{"name": "rendezvous", "port": 29500, "targetPort": 29500, "protocol": "TCP"}],
        },
    }
    pod_labels = job["spec"]["template"]["metadata"]["labels"]
    assert all(pod_labels[k] == v for k, v in svc["spec"]["selector"].items())
    assert job["spec"]["template"]["spec"]["subdomain"] == svc["metadata"]["name"]
    k8s_validate(svc)


def test_job_names_are_deterministic_short_and_distinct() -> None:
    assert job_name("vision/digits", "trial-0000", 0) == NAME
    long = job_name("a" * 40 + "/" + "b" * 80, "trial-" + "9" * 200, 12)
    assert len(long) <= 63 and long == job_name("a" * 40 + "/" + "b" * 80, "trial-" + "9" * 200, 12)
    assert long.endswith("-a12-" + long.rsplit("-", 1)[1])
    names = {
        job_name("vision/digits", "trial-0000", 0), job_name("vision/digits", "trial-0000", 1),
        job_name("vision/digits", "trial-0001", 0), job_name("vision/dig_its", "trial-0000", 0),
        job_name("vision/dig-its", "trial-0000", 0), job_name("vision-dig/its", "trial-0000", 0),
    }
    assert len(names) == 6
    for n in names | {long, job_name("9team/x", "0", 0)}:
        # DNS-1035 (Service names), and `<name>-<index>` still a DNS label.
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", n) and len(n + "-99999") <= 63, n
    with pytest.raises(ManifestError, match="attempt=-1"):
        job_name("vision/digits", "t", -1)


def test_label_values_are_sanitised() -> None:
    assert label_value("vision/digits") == "vision.digits"
    long = label_value("x/" * 60)
    assert len(long) <= 63 and re.fullmatch(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?", long)


@pytest.mark.parametrize(
    ("over", "fragment"),
    [
        (dict(namespace="Vision_NS"), "namespace='Vision_NS' is not a DNS label; accepted"),
        (dict(image="trainer latest"), "image='trainer latest' is not an image reference"),
        (
            dict(image="reg/trainer@sha256:abc"),
            "has digest 'sha256:abc'; accepted: 'sha256:' followed by 64 lowercase hex digits",
        ),
        (dict(env={"MLFLOW_URI": "http://u:pw@mlflow"}), "env['MLFLOW_URI'] holds a URL with credentials"),
        (dict(env={"HOME": "/root"}), "env['HOME'] is set by the platform"),
        (dict(secret_env={"TMPDIR": SecretKeyRef(secret="s", key="k")}), "secret_env['TMPDIR'] is set by the platform"),
        (
            dict(env={"HF_HOME": "/x"}, secret_env={"HF_HOME": SecretKeyRef(secret="s", key="k")}),
            "env and secret_env both set ['HF_HOME']",
        ),
        (
            dict(
                affinity={
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In"}]}]
                        }
                    }
                }
            ),
            "operator 'In' on key 'zone' needs values",
        ),
        (
            dict(
                affinity={
                    "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{"labelSelector": {}}]}
                }
            ),
            "topologyKey",
        ),
        (dict(affinity={"nodeAfinity": {}}), "nodeAfinity"),
        (dict(scratch_size="big"), "scratch_size='big' is not a Kubernetes quantity"),
        (dict(memory="lots"), "memory='lots' is not a Kubernetes quantity; accepted"),
        (dict(queue_name="Bad Queue"), "queue_name='Bad Queue' is not a valid Kubernetes name"),
        (dict(env={"WANDB_API_KEY": "abc"}), "env['WANDB_API_KEY'] looks like a credential"),
        (
            dict(env={"AWS_SECRET_ACCESS_KEY": "abc"}),
            "put it in a Secret and list the Secret's name in env_from_secrets",
        ),
        (dict(env={"JOB_COMPLETION_INDEX": "0"}), "is set by the platform"),
        (dict(env_from_secrets=("Not_A_Name",)), "env_from_secrets[]='Not_A_Name'"),
        (dict(labels={"trainyard.io/trial": "x"}), "reserved for the platform"),
        (dict(labels={"team": "x" * 64}), "is not a label value"),
        (dict(master_port=80), "master_port"),
        (dict(termination_grace_seconds=0), "termination_grace_seconds"),
        (dict(surprise=1), "surprise"),
    ],
)
def test_config_validation_names_field_value_and_rule(over: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValidationError) as err:
        full_config(**over)
    assert fragment in str(err.value)


def test_tolerations_are_checked() -> None:
    with pytest.raises(ValidationError, match="operator 'Equal' needs a key"):
        Toleration(operator="Equal", value="x")
    with pytest.raises(ValidationError, match="accepted only with effect 'NoExecute'"):
        Toleration(key="k", operator="Exists", effect="NoSchedule", toleration_seconds=5)


def test_gpus_per_pod_must_match_processes_per_node(two_node_spec, tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match=r"gpus_per_pod=8 does not match distribution.procs_per_node=4"):
        job_manifest(two_node_spec, SPEC_URI, 0, full_config(gpus_per_pod=8))
    derived = job_manifest(two_node_spec, SPEC_URI, 0, full_config(gpus_per_pod=None))
    assert derived["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 4
    cpu_spec = make_spec(tmp_path, distribution=Distribution(nodes=2))
    with pytest.raises(ManifestError, match="accelerator='cpu' would hold GPUs nobody uses"):
        job_manifest(cpu_spec, SPEC_URI, 0, full_config(gpus_per_pod=1))


def test_validators_are_strict(two_node_spec, crd_schemas) -> None:
    """The schema checks used above reject unknown fields and unknown kinds."""
    job = job_manifest(two_node_spec, SPEC_URI, 0, full_config())
    typo = copy.deepcopy(job)
    typo["spec"]["template"]["spec"]["restartPolicyy"] = "Never"
    with pytest.raises(kubernetes_validate.ValidationError):
        k8s_validate(typo)
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        k8s_validate({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": "q"}})
    queue = kueue_objects([TeamQuota(team="vision", namespace="vision", cpu="8", memory="32Gi")], "c", "f")[-1]
    bad = {**queue, "spec": {**queue["spec"], "clusterQueu": "vision"}}
    with pytest.raises(jsonschema.ValidationError):
        crd_validate(bad, crd_schemas)
    with pytest.raises(AssertionError, match="no CRD schema"):
        crd_validate({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload"}, crd_schemas)


def test_jobset_equivalent(two_node_spec, crd_schemas) -> None:
    js = jobset_manifest(two_node_spec, SPEC_URI, 0, full_config())
    name = js["metadata"]["name"]
    assert len(name) <= 48 and js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "trainyard"
    assert js["spec"]["suspend"] is True
    assert js["spec"]["network"] == {"enableDNSHostnames": True, "publishNotReadyAddresses": True, "subdomain": name}
    child = js["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert child["backoffLimit"] == 0 and "suspend" not in child and child["completionMode"] == "Indexed"
    # Every pod failure fails the child Job at once; the JobSet decides for the whole gang by its reason and message.
    # The Indexed Job option has the same policy: both gang kinds fail their Job on any pod failure.
    job = job_manifest(two_node_spec, SPEC_URI, 0, full_config())["spec"]
    assert [r["action"] for r in child["podFailurePolicy"]["rules"]] == ["FailJob", "FailJob", "FailJob", "Count"]
    assert child["podFailurePolicy"] == job["podFailurePolicy"] and job["backoffLimit"] == 0
    assert js["spec"]["failurePolicy"] == {
        "maxRestarts": 2,
        "rules": [  # maxRestarts: backoff_limit
            {
                "name": "user-or-config-error",
                "action": "FailJobSet",
                "onJobFailureReasons": ["PodFailurePolicy"],
                "onJobFailureMessagePatterns": ["failed with exit code (1|78) matching FailJob rule"],
            },
            {
                "name": "disruption",
                "action": "RestartJobSetAndIgnoreMaxRestarts",
                "onJobFailureReasons": ["PodFailurePolicy"],
            },
            {"name": "deadline", "action": "FailJobSet", "onJobFailureReasons": ["DeadlineExceeded"]},
        ],
    }
    command = child["template"]["spec"]["containers"][0]["command"]
    assert f"--master-addr={name}-node-0-0.{name}" in command and "subdomain" not in child["template"]["spec"]
    assert len(f"{name}-node-0-99999") <= 63
    crd_validate(js, crd_schemas)


def test_nodes_to_avoid_are_a_preference_beside_the_teams_own_affinity(two_node_spec, crd_schemas) -> None:
    cfg = full_config(avoid_nodes=("gpu-node-7", "gpu-node-3"))
    (js,) = trial_objects(two_node_spec, SPEC_URI, 1, cfg, kind="jobset")
    affinity = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["affinity"]
    assert affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == AFFINITY["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]  # the team's own placement is kept
    assert affinity["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"] == [
        {
            "weight": 100,
            "preference": {
                "matchExpressions": [
                    {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["gpu-node-3", "gpu-node-7"]}
                ]
            },
        }
    ]
    crd_validate(js, crd_schemas)
    job = job_manifest(two_node_spec, SPEC_URI, 1, full_config(affinity=None, avoid_nodes=("gpu-node-7",)))
    assert list(job["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]) == [
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    k8s_validate(job)


def test_priority_classes() -> None:
    pcs = {p["metadata"]["name"]: p for p in priority_classes()}
    assert (
        pcs["trainyard-interactive"]["value"] > pcs["trainyard-production"]["value"] > pcs["trainyard-sweep"]["value"]
    )
    assert pcs["trainyard-sweep"]["preemptionPolicy"] == "Never"
    assert pcs["trainyard-production"]["preemptionPolicy"] == "PreemptLowerPriority"
    assert not any(p["globalDefault"] for p in pcs.values())
    for p in pcs.values():
        k8s_validate(p)


def test_kueue_objects(crd_schemas) -> None:
    teams = [
        TeamQuota(team="vision", namespace="vision", cpu="96", memory="768Gi", gpus=16, borrow_gpus=8),
        TeamQuota(team="nlp", namespace="nlp-train", cpu="64", memory="512Gi", queue_name="training"),
    ]
    objs = kueue_objects(teams, cohort="trainyard", flavor="default-flavor")
    assert [(o["kind"], o["metadata"]["name"]) for o in objs] == [
        ("ResourceFlavor", "default-flavor"), ("ClusterQueue", "vision"), ("LocalQueue", "trainyard"),
        ("ClusterQueue", "nlp"), ("LocalQueue", "training"),
    ]
    vision = objs[1]["spec"]
    assert vision["cohortName"] == "trainyard"
    assert vision["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "vision"}}
    group = vision["resourceGroups"][0]
    assert group["flavors"][0]["resources"] == [
        {"name": "cpu", "nominalQuota": "96"},
        {"name": "memory", "nominalQuota": "768Gi"},
        {"name": "nvidia.com/gpu", "nominalQuota": 16, "borrowingLimit": 8},
    ]
    # CEL rule the JSON schema cannot express: one quota per covered resource.
    assert all(len(f["resources"]) == len(group["coveredResources"]) for f in group["flavors"])
    assert objs[4]["metadata"]["namespace"] == "nlp-train" and objs[4]["spec"] == {"clusterQueue": "nlp"}
    for o in objs + workload_priority_classes():
        crd_validate(o, crd_schemas)
    with pytest.raises(ManifestError, match="repeat a name"):
        kueue_objects(teams + teams[:1], "trainyard", "default-flavor")


def test_rbac_is_least_privilege() -> None:
    objs = rbac_objects("vision", "trainyard-launcher-vision", service_account_namespace="dagster")
    sa, role, binding = objs
    assert sa == {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "automountServiceAccountToken": False,
        "metadata": {
            "name": "trainyard-launcher-vision",
            "namespace": "dagster",
            "labels": {"app.kubernetes.io/part-of": "trainyard"},
        },
    }
    assert role["metadata"]["namespace"] == "vision"
    # Exactly what JobSupervisor calls (test_k8s_launcher checks every call it makes against these rules).
    assert {(tuple(r["apiGroups"]), tuple(r["resources"])): set(r["verbs"]) for r in role["rules"]} == {
        (("batch",), ("jobs",)): {"create", "get", "list", "delete"},
        (("jobset.x-k8s.io",), ("jobsets",)): {"create", "get", "list", "delete"},
        (("",), ("services",)): {"create", "get", "list", "delete"},
        (("",), ("pods",)): {"list", "watch"},  # watch: resources.k8s.pod_events
        (("",), ("events",)): {"list"},
        (("",), ("pods/log",)): {"get"},
        (("kueue.x-k8s.io",), ("workloads",)): {"list"},
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "trainyard-launcher-vision", "namespace": "dagster"}
    ]
    assert binding["roleRef"]["name"] == role["metadata"]["name"] and binding["metadata"]["namespace"] == "vision"
    for o in objs:
        k8s_validate(o)


def test_trial_service_account_is_bound_only_in_its_namespace_and_granted_nothing() -> None:
    sa, role, binding = trial_rbac_objects("language")
    assert (
        sa["metadata"]["namespace"] == role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "language"
    )
    assert sa["automountServiceAccountToken"] is False and role["rules"] == []
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "trainyard-trial", "namespace": "language"}]
    for o in (sa, role, binding):
        k8s_validate(o)
