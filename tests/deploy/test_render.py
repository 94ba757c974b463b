"""deploy/: the rendered cluster objects and Helm values are current, valid, isolated per team, and pinned by digest.

The committed files must equal `deploy/render.py`'s output. Every object
validates strictly (Kubernetes 1.29 and newest; Kueue CRDs). Isolation is read
off the rendered RBAC: each team's launcher account is bound in its own
namespace only, trial pods have their own account per namespace, code servers
have no binding, and no Role grants anything on Secrets. Pods: the trial pods
each location's settings produce (through the real launcher), the run pods
Dagster's own `dagster_k8s` builds from each location's container context, and
the code servers, all pass the `restricted` Pod Security check.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import jsonschema
import pytest
import yaml
from dagster_k8s.container_context import K8sContainerContext
from dagster_k8s.job import DagsterK8sJobConfig, construct_dagster_k8s_job
from kubernetes.client import ApiClient

from resources.k8s.cluster import LAUNCHER_RULES, TRIAL_SERVICE_ACCOUNT
from resources.k8s.helm import CODE_SERVER_SECRETS, RUN_SECRETS, TRIAL_SECRETS
from resources.k8s.kueue_config import (
    KUEUE_CONFIG_KEY,
    KUEUE_CONFIG_MAP,
    KUEUE_NAMESPACE,
    PodsReadyPolicy,
    kueue_configuration,
)
from resources.k8s.launcher import KubernetesLauncher
from resources.k8s.manifests import job_manifest, jobset_manifest
from tests.support.k8s import (
    go_duration_seconds,
    k8s_validate,
    kueue_configuration_validate,
    load_crd_schemas,
    pod_specs,
    read_only_root_violations,
    restricted_violations,
    validate_any,
)
from tests.support.train_specs import make_spec
from training.spec import Distribution
from trainyard.podconfig import UnpinnedImageWarning, image_is_pinned

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def render() -> ModuleType:
    spec = importlib.util.spec_from_file_location("trainyard_deploy_render", ROOT / "deploy" / "render.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def objects() -> list[dict[str, Any]]:
    return [o for p in sorted((ROOT / "deploy" / "k8s").glob("*.yaml")) for o in yaml.safe_load_all(p.read_text())]


@pytest.fixture(scope="module")
def values() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "deploy" / "helm" / "values.yaml").read_text())


def _of(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def test_rendered_files_are_current_and_valid(render: ModuleType, objects: list[dict[str, Any]]) -> None:
    assert render.on_disk() == render.render(), (
        "deploy/k8s or deploy/helm/values.yaml is stale: run `.venv/bin/python deploy/render.py`"
    )
    assert render.main(["--check"]) == 0
    schemas = load_crd_schemas()
    for obj in objects:
        validate_any(obj, schemas)
    assert {
        "Namespace",
        "PriorityClass",
        "ClusterQueue",
        "LocalQueue",
        "ResourceFlavor",
        "Role",
        "RoleBinding",
        "ServiceAccount",
        "ConfigMap",
    } <= {o["kind"] for o in objects}


def test_the_check_sees_a_stale_file(render: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copytree(ROOT / "deploy" / "k8s", tmp_path / "k8s")
    shutil.copy(ROOT / "deploy" / "helm" / "values.yaml", tmp_path / "values.yaml")
    monkeypatch.setattr(render, "OUT_DIR", tmp_path / "k8s")
    monkeypatch.setattr(render, "VALUES", tmp_path / "values.yaml")
    assert render.main(["--check"]) == 0
    values = tmp_path / "values.yaml"
    values.write_text(values.read_text().replace("runAsNonRoot: true", "runAsNonRoot: false", 1))
    assert render.main(["--check"]) == 1


def test_team_namespaces_enforce_the_restricted_profile(render: ModuleType, objects: list[dict[str, Any]]) -> None:
    labels = {ns["metadata"]["name"]: ns["metadata"]["labels"] for ns in _of(objects, "Namespace")}
    teams = {loc.namespace for loc in render.LOCATIONS}
    assert teams == {"vision", "language", "tabular"} and set(labels) == teams | {"dagster"}
    for name in teams:
        for mode in ("enforce", "audit", "warn"):
            assert labels[name][f"pod-security.kubernetes.io/{mode}"] == "restricted", (name, mode)
    assert labels["dagster"]["pod-security.kubernetes.io/enforce"] == "baseline"
    assert labels["dagster"]["pod-security.kubernetes.io/warn"] == "restricted"
    # Any workload deploy/ itself puts into a team namespace must pass too (today: none; trial pods are tested below).
    for obj in objects:
        if obj["metadata"].get("namespace") in teams:
            for where, pod, pod_annotations in pod_specs(obj):
                assert restricted_violations(pod, pod_annotations) == [], where


def test_each_service_account_is_bound_only_where_it_belongs(render: ModuleType, objects: list[dict[str, Any]]) -> None:
    assert not _of(objects, "ClusterRole") and not _of(objects, "ClusterRoleBinding")
    bound: dict[tuple[str, str], set[str]] = {}
    roles = {(r["metadata"]["namespace"], r["metadata"]["name"]): r for r in _of(objects, "Role")}
    for binding in _of(objects, "RoleBinding"):
        ns = binding["metadata"]["namespace"]
        assert (ns, binding["roleRef"]["name"]) in roles and binding["roleRef"]["kind"] == "Role"
        for s in binding["subjects"]:
            bound.setdefault((s["namespace"], s["name"]), set()).add(ns)
    accounts = {(sa["metadata"]["namespace"], sa["metadata"]["name"]): sa for sa in _of(objects, "ServiceAccount")}
    for loc in render.LOCATIONS:
        # The team's runs can create pods (and so mount Secrets) in the team's namespace only.
        assert bound[("dagster", f"trainyard-launcher-{loc.name}")] == {loc.namespace}
        assert bound[(loc.namespace, TRIAL_SERVICE_ACCOUNT)] == {loc.namespace}
        assert roles[(loc.namespace, TRIAL_SERVICE_ACCOUNT)]["rules"] == []
        assert roles[(loc.namespace, f"trainyard-launcher-{loc.name}")]["rules"] == LAUNCHER_RULES
    assert ("dagster", "trainyard-code-server") in accounts and ("dagster", "trainyard-code-server") not in bound
    assert set(bound) <= set(accounts)
    assert all(sa["automountServiceAccountToken"] is False for sa in accounts.values())
    for role in roles.values():
        for rule in role["rules"]:
            assert (
                "secrets" not in rule["resources"] and "*" not in rule["resources"] + rule["verbs"] + rule["apiGroups"]
            ), role


def test_images_are_pinned_by_digest(render: ModuleType, values: dict[str, Any]) -> None:
    deployments = values["dagster-user-deployments"]["deployments"]
    assert [d["name"] for d in deployments] == [loc.name for loc in render.LOCATIONS]
    for d in deployments:
        image = d["image"]
        # The chart renders "<repository>:<tag>".
        assert image_is_pinned(f"{image['repository']}:{image['tag']}"), image
    config_maps = {c["metadata"]["name"]: c["data"] for c in _of(yaml.safe_load_all(
        (ROOT / "deploy" / "k8s" / "40-code-locations.yaml").read_text()), "ConfigMap")}
    assert config_maps and all(image_is_pinned(data["TRAINYARD_TRAINER_IMAGE"]) for data in config_maps.values())
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnpinnedImageWarning)
        assert render.check_images() == []


def test_a_tag_is_rendered_with_a_warning(
    render: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    tagged = render.PLATFORM.model_copy(update={"trainer_image": "registry.example.com/trainyard/trainer:0.1.0"})
    monkeypatch.setattr(render, "PLATFORM", tagged)
    with pytest.warns(
        UnpinnedImageWarning,
        match="trainer_image='registry.example.com/trainyard/trainer:0.1.0' is not pinned by digest",
    ):
        assert render.check_images() == ["trainer_image"]
    assert (
        "TRAINYARD_TRAINER_IMAGE: registry.example.com/trainyard/trainer:0.1.0"
        in render.render()["deploy/k8s/40-code-locations.yaml"]
    )
    monkeypatch.setattr(render, "OUT_DIR", Path("/nonexistent"))  # --check only reads; nothing is written
    render.main(["--check"])
    assert (
        "warning: trainer_image='registry.example.com/trainyard/trainer:0.1.0' is not pinned by digest"
        in capsys.readouterr().err
    )


def _location(objects: list[dict[str, Any]], name: str) -> dict[str, str]:
    return next(c["data"] for c in _of(objects, "ConfigMap") if c["metadata"]["name"] == f"trainyard-location-{name}")


def test_trial_pods_of_every_location_are_restricted_and_isolated(
    render: ModuleType, objects: list[dict[str, Any]], tmp_path: Path
) -> None:
    """The launcher each location builds (its ConfigMap's environment) renders trial pods in the team's namespace
    only."""
    spec = make_spec(tmp_path, distribution=Distribution(nodes=2, procs_per_node=2))
    schemas = load_crd_schemas()
    for loc in render.LOCATIONS:
        env = _location(objects, loc.name)
        cfg = KubernetesLauncher.from_env(env).job_config()
        if any(t.key == "nvidia.com/gpu" for t in cfg.tolerations):  # a GPU pool: a GPU trial
            trial = spec.model_copy(update={"distribution": Distribution(nodes=2, procs_per_node=4, accelerator="gpu")})
        else:
            trial = spec
        manifests = [
            job_manifest(trial, "s3://b/spec.json", 0, cfg),
            jobset_manifest(trial, "s3://b/spec.json", 0, cfg),
        ]
        for obj in manifests:
            validate_any(obj, schemas)
            assert obj["metadata"]["namespace"] == loc.namespace
            for where, pod, pod_annotations in pod_specs(obj):
                assert restricted_violations(pod, pod_annotations) == [], (loc.name, where)
                assert read_only_root_violations(pod) == [], (loc.name, where)
                assert (
                    pod["serviceAccountName"] == TRIAL_SERVICE_ACCOUNT and pod["automountServiceAccountToken"] is False
                )
                assert pod["containers"][0]["envFrom"] == [{"secretRef": {"name": s}} for s in TRIAL_SECRETS]
                assert pod["containers"][0]["image"] == render.PLATFORM.trainer_image


def _run_pod(deployment: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The run pod the K8sRunLauncher would start for this location: built by dagster_k8s from its container context."""
    env = {e["name"]: e["value"] for e in deployment["env"]}
    context = K8sContainerContext.create_from_config(json.loads(env["DAGSTER_CONTAINER_CONTEXT"]))
    launcher = type(
        "RunLauncher",
        (),
        {
            "job_image": None,
            "dagster_home": "/opt/dagster/dagster_home",
            "instance_config_map": "dagster-instance",
            "postgres_password_secret": "dagster-postgresql-secret",
        },
    )()
    image = f"{deployment['image']['repository']}:{deployment['image']['tag']}"
    job_config: DagsterK8sJobConfig = context.get_k8s_job_config(job_image=image, run_launcher=launcher)
    job = construct_dagster_k8s_job(
        job_config,
        args=["dagster", "api", "execute_run", "{}"],
        job_name="dagster-run-0123",
        user_defined_k8s_config=context.run_k8s_config,
        pod_name="dagster-run-0123",
        component="run_worker",
    )
    return ApiClient().sanitize_for_serialization(job), {"namespace": context.namespace}


def test_run_pods_run_as_their_teams_launcher(render: ModuleType, values: dict[str, Any]) -> None:
    for deployment in values["dagster-user-deployments"]["deployments"]:
        job, where = _run_pod(deployment)
        k8s_validate(job)
        pod = job["spec"]["template"]["spec"]
        assert where["namespace"] == "dagster"
        assert pod["serviceAccountName"] == f"trainyard-launcher-{deployment['name']}"
        assert restricted_violations(pod) == []
        env_from = pod["containers"][0]["envFrom"]
        assert {"configMapRef": {"name": f"trainyard-location-{deployment['name']}"}} in env_from
        assert [e["secretRef"]["name"] for e in env_from if "secretRef" in e] == list(RUN_SECRETS)


def test_code_servers_have_no_api_access_and_only_the_secrets_they_need(
    render: ModuleType, values: dict[str, Any]
) -> None:
    chart = values["dagster-user-deployments"]
    assert chart["serviceAccount"]["name"] == "trainyard-code-server"
    for d in chart["deployments"]:
        # The account has no RoleBinding (test above); no W&B key, which only runs and trials use.
        assert d["serviceAccount"] == {"create": False, "name": "trainyard-code-server", "annotations": {}}
        assert [s["name"] for s in d["envSecrets"]] == list(
            CODE_SERVER_SECRETS
        ) and "trainyard-tracking" not in CODE_SERVER_SECRETS
        assert d["includeConfigInLaunchedRuns"] == {"enabled": False}
        # The chart's Deployment template puts these on the code server's pod and its one container.
        pod = {
            "securityContext": d["podSecurityContext"],
            "containers": [{"name": "dagster-user-deployments", "image": "x", "securityContext": d["securityContext"]}],
        }
        assert restricted_violations(pod) == [], d["name"]


def test_kueue_configuration_enables_wait_for_pods_ready(render: ModuleType, objects: list[dict[str, Any]]) -> None:
    """The Kueue ConfigMap on disk parses into a Configuration Kueue's manager accepts, with waitForPodsReady on."""
    maps = [o for o in _of(objects, "ConfigMap") if o["metadata"]["name"] == KUEUE_CONFIG_MAP]
    assert len(maps) == 1 and maps[0]["metadata"]["namespace"] == KUEUE_NAMESPACE
    assert set(maps[0]["data"]) == {KUEUE_CONFIG_KEY}
    config = yaml.safe_load(maps[0]["data"][KUEUE_CONFIG_KEY])
    kueue_configuration_validate(config)
    wfpr = config["waitForPodsReady"]
    assert wfpr["enable"] is True and wfpr["blockAdmission"] is True
    timeout, recovery = go_duration_seconds(wfpr["timeout"]), go_duration_seconds(wfpr["recoveryTimeout"])
    assert 60 <= recovery <= timeout <= 3600, wfpr
    requeue = wfpr["requeuingStrategy"]
    assert requeue["timestamp"] == "Eviction" and requeue["backoffLimitCount"] >= 1
    assert 0 < requeue["backoffBaseSeconds"] <= requeue["backoffMaxSeconds"]
    assert {"batch/job", "jobset.x-k8s.io/jobset"} <= set(config["integrations"]["frameworks"])
    assert config["manageJobsWithoutQueueName"] is False
    # The launcher's own bound on an Unschedulable gang comes after Kueue's eviction, so Kueue frees the quota first.
    launcher = KubernetesLauncher(namespace="vision", image="trainer@sha256:" + "0" * 64)
    assert launcher.unschedulable_seconds >= timeout
    assert render.PODS_READY.worst_case_seconds() == 4 * 600 + 60 + 120 + 240


@pytest.mark.parametrize("bad", [{"timeout": "10 minutes"}, {"requeuingStrategy": {"timestamp": "Now"}},
                                 {"requeuingStrategy": {"backoffLimit": 3}}, {"enabled": True}])
def test_the_kueue_configuration_check_rejects_what_kueue_would(bad: dict[str, Any]) -> None:
    config = kueue_configuration()
    config["waitForPodsReady"] = {**config["waitForPodsReady"], **bad}
    with pytest.raises(jsonschema.ValidationError):
        kueue_configuration_validate(config)
    with pytest.raises(ValueError, match="backoff_base_seconds"):
        PodsReadyPolicy(backoff_base_seconds=600, backoff_max_seconds=60)


def test_run_monitoring_resumes_a_killed_run_pod(values: dict[str, Any]) -> None:
    """A run pod that dies is resumed (same run, same attempt: its launcher re-attaches to the trial's gang), not left
    STARTED."""
    from dagster_k8s import K8sRunLauncher

    monitoring = values["dagsterDaemon"]["runMonitoring"]
    assert monitoring["enabled"] is True and monitoring["maxResumeRunAttempts"] >= 1, monitoring
    assert values["runLauncher"]["type"] == "K8sRunLauncher"
    # Resuming needs a launcher that can check a run worker's health and resume it; the chart's is one.
    assert K8sRunLauncher.supports_resume_run.fget(None) is True  # a property that reads nothing of the instance
    coordinator = values["dagsterDaemon"]["runCoordinator"]
    assert coordinator["type"] == "CustomRunCoordinator"
    custom = coordinator["config"]["customRunCoordinator"]
    assert (custom["module"], custom["class"]) == ("instance.run_queue", "RunQueue")
    queue = custom["config"]
    assert (
        queue["dequeue_interval_seconds"] == 1
        and queue["dequeue_use_threads"] is True
        and queue["dequeue_num_workers"] >= 2
    )


def test_the_daemon_and_the_webserver_run_the_orchestrator_image_that_has_the_queue(values: dict[str, Any]) -> None:
    """The queue class is ours, so every process that makes it (the daemon, the webserver that submits) runs our
    image."""
    locations = {
        d["image"]["repository"] + ":" + d["image"]["tag"] for d in values["dagster-user-deployments"]["deployments"]
    }
    assert len(locations) == 1
    for part in ("dagsterDaemon", "dagsterWebserver"):
        image = values[part]["image"]
        assert {image["repository"] + ":" + image["tag"]} == locations, part
