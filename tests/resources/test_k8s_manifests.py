"""Kubernetes manifests: exact values, name limits, validation, and schema checks.

Core objects are validated with kubernetes-validate (strict: unknown fields fail)
against the oldest supported version (1.29) and the newest schema it ships;
Kueue and JobSet objects against their CRDs' openAPIV3Schema, made strict the
same way. An object whose schema cannot be found fails the test.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from pydantic import ValidationError

from resources.k8s.cluster import kueue_objects, priority_classes, rbac_objects, workload_priority_classes
from resources.k8s.config import K8sJobConfig, TeamQuota, Toleration
from resources.k8s.errors import ManifestError
from resources.k8s.manifests import job_manifest, jobset_manifest, service_manifest
from resources.k8s.names import job_name, label_value, trial_labels
from resources.launcher import torchrun_command
from tests.support.k8s import k8s_validate
from tests.support.train_specs import make_spec
from training.spec import Distribution

ROOT = Path(__file__).resolve().parents[2]
CRD_DIR = ROOT.parent / "shared" / "crds"
SPEC_URI = "s3://bucket/runs/vision/digits/trial-0000/spec.json"
# The name of (vision/digits, trial-0000, attempt 0). Written out, not computed: a
# new orchestrator version must compute the names of Jobs an older one started.
NAME = "vision-digits-trial-0000-a0-b0219d58"


def _strict(schema: Any) -> Any:
    """Reject unknown fields like the API server's strict field validation does."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    if not CRD_DIR.is_dir():
        message = f"CRD schemas not found at {CRD_DIR} (a copy of shared/crds beside the repository)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    schemas = {}
    for path in sorted(CRD_DIR.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schemas[(f"{group}/{version['name']}", kind)] = _strict(version["schema"]["openAPIV3Schema"])
    return schemas


def crd_validate(obj: dict[str, Any], schemas: dict[tuple[str, str], dict[str, Any]]) -> None:
    key = (obj["apiVersion"], obj["kind"])
    assert key in schemas, f"no CRD schema for {key}; known: {sorted(schemas)}"
    jsonschema.Draft202012Validator(schemas[key]).validate(obj)


@pytest.fixture(scope="module")
def two_node_spec(tmp_path_factory: pytest.TempPathFactory):
    return make_spec(tmp_path_factory.mktemp("spec"), distribution=Distribution(nodes=2, procs_per_node=4, accelerator="gpu"))


def full_config(**over: Any) -> K8sJobConfig:
    base: dict[str, Any] = dict(
        namespace="vision",
        image="registry.example/trainyard/trainer:1.4.0",
        queue_name="trainyard",
        priority_class="trainyard-sweep",
        service_account="trainer",
        gpus_per_pod=4,
        cpu="30",
        memory="200Gi",
        node_selector={"pool": "a100"},
        tolerations=(Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule"),),
        shm_size="16Gi",
        termination_grace_seconds=180,
        ttl_seconds_after_finished=3600,
        backoff_limit=2,
        active_deadline_seconds=86400,
        env_from_secrets=("wandb-credentials", "s3-credentials"),
        env={"AWS_ENDPOINT_URL": "http://minio.storage:9000"},
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
        "python", "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=4", "--max-restarts=2",
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
            "backoffLimit": 2,
            "podFailurePolicy": {
                "rules": [
                    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                    {"action": "FailJob", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [78]}},
                ]
            },
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": 180,
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "containers": [
                        {
                            "name": "trainer",
                            "image": "registry.example/trainyard/trainer:1.4.0",
                            "imagePullPolicy": "IfNotPresent",
                            "command": command,
                            "env": [
                                {"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {
                                    "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
                                {"name": "PYTHONUNBUFFERED", "value": "1"},
                                {"name": "TRAINYARD_LAUNCH_ID",
                                 "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['batch.kubernetes.io/job-name']"}}},
                                {"name": "AWS_ENDPOINT_URL", "value": "http://minio.storage:9000"},
                            ],
                            "resources": {
                                "requests": {"cpu": "30", "memory": "200Gi", "nvidia.com/gpu": 4},
                                "limits": {"memory": "200Gi", "nvidia.com/gpu": 4},
                            },
                            "ports": [{"name": "rendezvous", "containerPort": 29500, "protocol": "TCP"}],
                            "envFrom": [{"secretRef": {"name": "wandb-credentials"}}, {"secretRef": {"name": "s3-credentials"}}],
                            "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
                        }
                    ],
                    "subdomain": NAME,
                    "serviceAccountName": "trainer",
                    "priorityClassName": "trainyard-sweep",
                    "nodeSelector": {"pool": "a100"},
                    "tolerations": [{"operator": "Exists", "key": "nvidia.com/gpu", "effect": "NoSchedule"}],
                    "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}],
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
    assert "volumes" not in pod and "volumeMounts" not in container and "envFrom" not in container
    assert "--master-port=29400" in container["command"]
    assert job["metadata"]["labels"]["trainyard.io/attempt"] == "5"
    k8s_validate(job)


def test_single_node_uses_standalone_rendezvous(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, distribution=Distribution(procs_per_node=2))
    job = job_manifest(spec, SPEC_URI, 0, K8sJobConfig(namespace="vision", image="trainer:1"))
    assert job["spec"]["template"]["spec"]["containers"][0]["command"] == torchrun_command(spec, SPEC_URI, python="python")
    assert "--standalone" in job["spec"]["template"]["spec"]["containers"][0]["command"]
    # No queue configured: nothing would ever unsuspend the Job.
    assert "suspend" not in job["spec"] and "kueue.x-k8s.io/queue-name" not in job["metadata"]["labels"]
    k8s_validate(job)


def test_workload_priority_label_only_when_configured(two_node_spec) -> None:
    job = job_manifest(two_node_spec, SPEC_URI, 0, full_config(workload_priority_class="trainyard-production"))
    assert job["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "trainyard-production"
    assert "kueue.x-k8s.io/priority-class" not in job["spec"]["template"]["metadata"]["labels"]
    assert "kueue.x-k8s.io/priority-class" not in job_manifest(two_node_spec, SPEC_URI, 0, full_config())["metadata"]["labels"]


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
            "labels": {"cost-center": "ml-vision", "trainyard.io/pipeline": "vision.digits", "trainyard.io/trial": "trial-0000",
                       "trainyard.io/attempt": "0", "trainyard.io/job-name": NAME},
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
        (dict(memory="lots"), "memory='lots' is not a Kubernetes quantity; accepted"),
        (dict(queue_name="Bad Queue"), "queue_name='Bad Queue' is not a valid Kubernetes name"),
        (dict(env={"WANDB_API_KEY": "abc"}), "env['WANDB_API_KEY'] looks like a credential"),
        (dict(env={"AWS_SECRET_ACCESS_KEY": "abc"}), "put it in a Secret and list the Secret's name in env_from_secrets"),
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
    assert child["podFailurePolicy"]["rules"][1]["onExitCodes"]["values"] == [78]
    command = child["template"]["spec"]["containers"][0]["command"]
    assert f"--master-addr={name}-node-0-0.{name}" in command and "subdomain" not in child["template"]["spec"]
    assert len(f"{name}-node-0-99999") <= 63
    crd_validate(js, crd_schemas)


def test_priority_classes() -> None:
    pcs = {p["metadata"]["name"]: p for p in priority_classes()}
    assert pcs["trainyard-interactive"]["value"] > pcs["trainyard-production"]["value"] > pcs["trainyard-sweep"]["value"]
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
    objs = rbac_objects("vision", "trainyard-launcher", service_account_namespace="dagster")
    sa, role, binding = objs
    assert sa["metadata"] == {"name": "trainyard-launcher", "namespace": "dagster", "labels": {"app.kubernetes.io/part-of": "trainyard"}}
    assert role["metadata"]["namespace"] == "vision"
    assert {(tuple(r["apiGroups"]), tuple(r["resources"])): set(r["verbs"]) for r in role["rules"]} == {
        (("batch",), ("jobs",)): {"create", "get", "list", "watch", "delete"},
        (("",), ("services",)): {"create", "get", "delete"},
        (("",), ("pods",)): {"get", "list", "watch"},
        (("",), ("pods/log",)): {"get"},
        (("kueue.x-k8s.io",), ("workloads",)): {"get", "list", "watch"},
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "trainyard-launcher", "namespace": "dagster"}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    for o in objs:
        k8s_validate(o)


def _load_render():
    spec = importlib.util.spec_from_file_location("trainyard_deploy_render", ROOT / "deploy" / "render.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def test_rendered_deploy_files_are_current_and_valid(crd_schemas) -> None:
    render = _load_render()
    rendered = render.render()
    on_disk = {p.name: p.read_text() for p in (ROOT / "deploy" / "k8s").glob("*.yaml")}
    assert on_disk == rendered, "deploy/k8s is stale: run `.venv/bin/python deploy/render.py`"
    kinds = set()
    for text in rendered.values():
        for obj in yaml.safe_load_all(text):
            kinds.add(obj["kind"])
            if obj["apiVersion"].startswith(("kueue.x-k8s.io/", "jobset.x-k8s.io/")):
                crd_validate(obj, crd_schemas)
            else:
                k8s_validate(obj)
    assert {"Namespace", "PriorityClass", "ClusterQueue", "LocalQueue", "ResourceFlavor", "Role", "RoleBinding", "ServiceAccount"} <= kinds
