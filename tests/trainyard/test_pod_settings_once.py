"""A trial pod's settings are declared once (`trainyard.podconfig.PodSettings`) and used, as declared, everywhere.

The team's `PodConfig`, the manifests' `K8sJobConfig` and the `KubernetesLauncher`
resource must carry each setting with the one declaration's name, default and
description; no class of the platform may declare one again; and what a team or
the platform sets must reach the manifest unchanged.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, Field

from resources.k8s.config import K8sJobConfig
from resources.k8s.launcher import KubernetesLauncher
from resources.k8s.manifests import job_manifest, jobset_manifest
from tests.support.k8s import k8s_validate
from tests.support.train_specs import make_spec
from training.spec import Distribution
from trainyard.podconfig import DEFAULT_ACTIVE_DEADLINE_SECONDS, POD_ENV, PodConfig, PodSettings
from trainyard.team import TeamSpec

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "registry.example/trainyard/trainer@sha256:" + "5e" * 32
SPEC_URI = "s3://bucket/runs/vision/digits/trial-0000/spec.json"
POD_FIELDS = set(PodSettings.model_fields)
JOB_FIELDS = set(K8sJobConfig.model_fields)
LAUNCHER_JOB_FIELDS = JOB_FIELDS - {"avoid_nodes"}  # set by the supervisor per attempt, not configured
# Classes whose fields share a name with a pod setting but are not one, and why.
NOT_POD_SETTINGS = {
    ("resources/k8s/config.py", "TeamQuota"): {"cpu", "memory"},  # a team's Kueue quota, not a pod's request
    ("trainyard/team.py", "TeamSpec"): {"env"},  # the environment the team's resources are built from, not the pods'
}
# A value unlike the default for every pod setting: what a team sets must reach the Job as set.
SET_BY_A_TEAM: dict[str, Any] = {
    "image": "registry.example/vision/trainer@sha256:" + "7a" * 32,
    "service_account": "vision-trial",
    "gpus_per_pod": 0,
    "cpu": "30",
    "memory": "200Gi",
    "cpu_limit": "32",
    "memory_limit": "220Gi",
    "node_selector": {"trainyard.io/pool": "gpu"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In",
                               "values": ["NVIDIA-H100-80GB-HBM3"]}]}]}}},
    "shm_size": "32Gi",
    "scratch_size": "100Gi",
    "termination_grace_seconds": 300,
    "active_deadline_seconds": 14 * 86400,
    "env": {"NCCL_DEBUG": "INFO"},
    "secret_env": {"HF_TOKEN": {"secret": "vision-hf", "key": "token"}},
    "env_from_secrets": ["vision-extra"],
}
PLATFORM_ENV = {"TRAINYARD_K8S_NAMESPACE": "vision", "TRAINYARD_TRAINER_IMAGE": IMAGE}


def _default(info: Any) -> Any:
    """A field's default as configuration carries it (a tuple is a list: Dagster config has no tuples)."""
    value = info.get_default(call_default_factory=True)
    return list(value) if isinstance(value, tuple) else value


def _declared_here(cls: type) -> set[str]:
    """The field names `cls`'s own body annotates (not inherited, not generated)."""
    return set(cls.__dict__.get("__annotations__", {}))


def _classes_declaring(names: set[str], roots: tuple[str, ...]) -> dict[tuple[str, str], set[str]]:
    """Every class under `roots` whose body annotates one of `names`, with those names, by (file, class)."""
    found: dict[tuple[str, str], set[str]] = {}
    for root in roots:
        for path in sorted((ROOT / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef):
                    fields = {s.target.id for s in node.body
                              if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
                    if fields & names:
                        found[(str(path.relative_to(ROOT)), node.name)] = fields & names
    return found


def test_no_class_of_the_platform_declares_a_pod_setting_again() -> None:
    """The one declaration is PodSettings'; another class of trainyard/, resources/, pipelines/ naming one is a copy."""
    found = _classes_declaring(POD_FIELDS, ("trainyard", "resources", "pipelines", "deploy"))
    assert found.pop(("trainyard/podconfig.py", "PodSettings")) == POD_FIELDS
    assert found == NOT_POD_SETTINGS


def test_the_team_the_manifests_and_the_launcher_use_the_one_declaration() -> None:
    """Same name, default and description in each; none declared again in its own body."""
    launcher_fields = KubernetesLauncher.model_fields
    for cls in (PodConfig, K8sJobConfig, KubernetesLauncher):
        assert not _declared_here(cls) & POD_FIELDS, cls
    assert not _declared_here(KubernetesLauncher) & LAUNCHER_JOB_FIELDS
    assert set(PodConfig.model_fields) == POD_FIELDS and POD_FIELDS < JOB_FIELDS
    assert LAUNCHER_JOB_FIELDS <= set(launcher_fields)
    for name in POD_FIELDS:
        declared = PodSettings.model_fields[name]
        for info in (PodConfig.model_fields[name], K8sJobConfig.model_fields[name], launcher_fields[name]):
            assert (_default(info), info.description) == (_default(declared), declared.description), name
        assert declared.description, f"{name} has no docstring"
    for name in LAUNCHER_JOB_FIELDS:  # the Job's own settings: the launcher's are K8sJobConfig's too
        info, declared = launcher_fields[name], K8sJobConfig.model_fields[name]
        assert (_default(info), info.description, info.is_required()) == (
            _default(declared), declared.description, declared.is_required()), name
    # and the Dagster config schema shows the same defaults
    schema = KubernetesLauncher.to_config_schema().as_field().config_type.fields
    assert schema["active_deadline_seconds"].default_value == DEFAULT_ACTIVE_DEADLINE_SECONDS
    assert schema["shm_size"].default_value == PodSettings.model_fields["shm_size"].default


def test_the_check_finds_a_setting_declared_twice() -> None:
    """The checks above can fail: a model re-declaring `shm_size` with another default is caught by both."""

    class Copy(BaseModel):
        shm_size: str = "1Gi"
        master_port: int = Field(29500)

    assert _declared_here(Copy) & POD_FIELDS == {"shm_size"}
    assert _default(Copy.model_fields["shm_size"]) != _default(PodSettings.model_fields["shm_size"])


def test_defaults_are_one_the_launchers_job_is_the_manifests(tmp_path: Path) -> None:
    """A launcher given only namespace and image builds the Job a bare K8sJobConfig builds (deadline included)."""
    spec = make_spec(tmp_path, distribution=Distribution(nodes=2, procs_per_node=2))
    for launcher in (KubernetesLauncher(namespace="vision", image=IMAGE), KubernetesLauncher.from_env(PLATFORM_ENV)):
        cfg = launcher.job_config()
        assert cfg == K8sJobConfig(namespace="vision", image=IMAGE)
        job = job_manifest(spec, SPEC_URI, 0, cfg)
        assert job == job_manifest(spec, SPEC_URI, 0, K8sJobConfig(namespace="vision", image=IMAGE))
        assert job["spec"]["activeDeadlineSeconds"] == DEFAULT_ACTIVE_DEADLINE_SECONDS == launcher.run_timeout_seconds
        assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "trainyard" and job["spec"]["suspend"] is True
        k8s_validate(job)


def test_every_pod_setting_a_team_sets_reaches_its_manifests(tmp_path: Path) -> None:
    """TeamSpec.pod -> .environment (TRAINYARD_K8S_POD) -> KubernetesLauncher.from_env -> K8sJobConfig -> the Job."""
    assert set(SET_BY_A_TEAM) == POD_FIELDS, "a new pod setting needs a value here, and its way to the manifest"
    team = TeamSpec(name="vision", pod=SET_BY_A_TEAM)
    env = {**PLATFORM_ENV, "TRAINYARD_K8S_ACTIVE_DEADLINE_SECONDS": "3600", "TRAINYARD_K8S_GPUS_PER_POD": "4"}
    cfg = KubernetesLauncher.from_env(team.environment(env)).job_config()
    for name in POD_FIELDS:
        default = PodSettings.model_fields[name].get_default(call_default_factory=True)
        assert getattr(cfg, name) == getattr(team.pod, name) != default, name
    spec = make_spec(tmp_path, distribution=Distribution(nodes=2, procs_per_node=2))
    for gang in (job_manifest(spec, SPEC_URI, 0, cfg), jobset_manifest(spec, SPEC_URI, 0, cfg)):
        job = gang if gang["kind"] == "Job" else gang["spec"]["replicatedJobs"][0]["template"]
        pod = job["spec"]["template"]["spec"]
        assert job["spec"]["activeDeadlineSeconds"] == 14 * 86400 and pod["terminationGracePeriodSeconds"] == 300
        assert {v["name"]: v["emptyDir"].get("sizeLimit") for v in pod["volumes"]}["dshm"] == "32Gi"
        assert pod["containers"][0]["resources"]["requests"]["cpu"] == "30"
        assert pod["serviceAccountName"] == "vision-trial"


def test_the_platforms_deadline_applies_unless_the_team_sets_one() -> None:
    """TRAINYARD_K8S_ACTIVE_DEADLINE_SECONDS is the platform's: under the team's; 0 is none, unset the default."""
    def deadline(env: dict[str, str], team: TeamSpec = TeamSpec(name="vision")) -> Any:
        launcher = KubernetesLauncher.from_env(team.environment({**PLATFORM_ENV, **env}))
        return launcher.job_config().active_deadline_seconds

    assert deadline({}) == DEFAULT_ACTIVE_DEADLINE_SECONDS
    assert deadline({"TRAINYARD_K8S_ACTIVE_DEADLINE_SECONDS": "3600"}) == 3600
    assert deadline({"TRAINYARD_K8S_ACTIVE_DEADLINE_SECONDS": "0"}) is None
    long_runs = TeamSpec(name="vision", pod=PodConfig(active_deadline_seconds=None))
    assert deadline({"TRAINYARD_K8S_ACTIVE_DEADLINE_SECONDS": "3600"}, long_runs) is None
    assert json.loads(long_runs.environment(PLATFORM_ENV)[POD_ENV]) == {"active_deadline_seconds": None}
    with pytest.raises(ValueError, match="TRAINYARD_K8S_ACTIVE_DEADLINE_SECONDS='soon' is not a number of seconds"):
        deadline({"TRAINYARD_K8S_ACTIVE_DEADLINE_SECONDS": "soon"})


def test_a_job_needs_an_image_and_says_so() -> None:
    with pytest.raises(ValueError, match="image is not set"):
        K8sJobConfig(namespace="vision")
