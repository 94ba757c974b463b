"""A team's pod configuration, from its `TeamSpec` and the platform's environment to the Job the launcher submits.

The path is the real one: `TeamSpec.environment` (what `pipelines.team` builds a
team's resources from) -> `KubernetesLauncher.from_env` (what the cluster
environment builds) -> `job_manifest` / `jobset_manifest` (what the launcher
submits), each object validated strictly.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from resources.k8s.launcher import KubernetesLauncher
from resources.k8s.manifests import job_manifest, jobset_manifest
from tests.support.k8s import k8s_validate, restricted_violations
from tests.support.train_specs import make_spec
from training.spec import Distribution
from trainyard.podconfig import POD_ENV, PodConfig, UnpinnedImageWarning
from trainyard.team import TeamSpec

DIGEST = "sha256:" + "5e" * 32
PLATFORM_IMAGE = f"registry.example/trainyard/trainer@{DIGEST}"
TEAM_IMAGE = "registry.example/vision/trainer@sha256:" + "7a" * 32
SPEC_URI = "s3://bucket/runs/vision/digits/trial-0000/spec.json"
# What the Helm values give the vision location (deploy/render.py): the GPU pool and NCCL settings.
PLATFORM_ENV = {
    "TRAINYARD_K8S_NAMESPACE": "vision",
    "TRAINYARD_TRAINER_IMAGE": PLATFORM_IMAGE,
    "TRAINYARD_K8S_SERVICE_ACCOUNT": "trainyard-trial",
    "TRAINYARD_K8S_SECRETS": "trainyard-storage,trainyard-tracking",
    "AWS_ENDPOINT_URL": "http://minio.storage:9000",
    POD_ENV: json.dumps({
        "cpu": "16", "memory": "96Gi", "shm_size": "8Gi",
        "node_selector": {"trainyard.io/pool": "gpu"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "env": {"NCCL_SOCKET_IFNAME": "eth0", "NCCL_DEBUG": "WARN"},
    }),
}
AFFINITY = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
    {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-H100-80GB-HBM3"]}]}]}}}
TEAM = TeamSpec(name="vision", namespace="vision", queue="vision-gpu", priority_class="trainyard-production", pod={
    "image": TEAM_IMAGE, "cpu": "30", "memory": "200Gi", "cpu_limit": "32", "memory_limit": "220Gi", "gpus_per_pod": 4,
    "shm_size": "32Gi", "affinity": AFFINITY,
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                    {"key": "vision-only", "operator": "Equal", "value": "true", "effect": "NoSchedule"}],
    "env": {"NCCL_DEBUG": "INFO", "NCCL_IB_HCA": "mlx5"},
    "secret_env": {"HF_TOKEN": {"secret": "vision-hf", "key": "token"}},
    "env_from_secrets": ["vision-extra"],
})


@pytest.fixture(scope="module")
def gpu_spec(tmp_path_factory: pytest.TempPathFactory):
    return make_spec(
        tmp_path_factory.mktemp("spec"), distribution=Distribution(nodes=2, procs_per_node=4, accelerator="gpu")
    )


def test_the_teams_pods_carry_its_configuration_over_the_platforms(gpu_spec) -> None:
    launcher = KubernetesLauncher.from_env(TEAM.environment(PLATFORM_ENV))
    job = job_manifest(gpu_spec, SPEC_URI, 0, launcher.job_config())
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert (
        job["metadata"]["namespace"] == "vision"
        and job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "vision-gpu"
    )
    assert container["image"] == TEAM_IMAGE
    assert container["resources"] == {
        "requests": {"cpu": "30", "memory": "200Gi", "nvidia.com/gpu": 4},
        "limits": {"cpu": "32", "memory": "220Gi", "nvidia.com/gpu": 4},
    }
    # The team's tolerations replace the platform's; the platform's node selector stays.
    assert pod["tolerations"] == [
        {"operator": "Exists", "key": "nvidia.com/gpu", "effect": "NoSchedule"},
        {"operator": "Equal", "key": "vision-only", "value": "true", "effect": "NoSchedule"},
    ]
    assert pod["nodeSelector"] == {"trainyard.io/pool": "gpu"}
    assert pod["affinity"] == AFFINITY
    assert pod["serviceAccountName"] == "trainyard-trial" and pod["automountServiceAccountToken"] is False
    assert pod["priorityClassName"] == "trainyard-production"
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "32Gi"}} in pod["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    env = {e["name"]: e for e in container["env"]}
    # Plain settings merge, the team's win; credentials only by reference.
    assert env["NCCL_DEBUG"] == {"name": "NCCL_DEBUG", "value": "INFO"}
    assert env["NCCL_SOCKET_IFNAME"]["value"] == "eth0" and env["NCCL_IB_HCA"]["value"] == "mlx5"
    assert env["AWS_ENDPOINT_URL"]["value"] == "http://minio.storage:9000"
    assert env["HF_TOKEN"] == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "vision-hf", "key": "token"}}}
    assert container["envFrom"] == [
        {"secretRef": {"name": n}} for n in ("trainyard-storage", "trainyard-tracking", "vision-extra")
    ]
    assert restricted_violations(pod) == []
    k8s_validate(job)
    jobset = jobset_manifest(gpu_spec, SPEC_URI, 0, launcher.job_config())
    assert (
        jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["env"]
        == container["env"]
    )


def test_a_team_without_pod_settings_gets_the_platforms(gpu_spec) -> None:
    env = TeamSpec(name="vision").environment(PLATFORM_ENV)
    assert env[POD_ENV] == PLATFORM_ENV[POD_ENV]
    cfg = KubernetesLauncher.from_env(env).job_config()
    assert (cfg.image, cfg.cpu, cfg.memory, cfg.shm_size, cfg.node_selector) == (
        PLATFORM_IMAGE,
        "16",
        "96Gi",
        "8Gi",
        {"trainyard.io/pool": "gpu"},
    )
    assert cfg.env == {
        "AWS_ENDPOINT_URL": "http://minio.storage:9000",
        "NCCL_SOCKET_IFNAME": "eth0",
        "NCCL_DEBUG": "WARN",
    }
    # And without any pod configuration at all, the launcher's own defaults.
    bare = {k: v for k, v in PLATFORM_ENV.items() if k != POD_ENV}
    cfg = KubernetesLauncher.from_env(TeamSpec(name="vision").environment(bare)).job_config()
    assert (cfg.cpu, cfg.memory, cfg.shm_size, cfg.tolerations, cfg.affinity) == ("2", "8Gi", "2Gi", (), None)


def test_a_team_may_bring_its_own_image_when_the_platform_names_none() -> None:
    env = {k: v for k, v in PLATFORM_ENV.items() if k != "TRAINYARD_TRAINER_IMAGE"}
    assert KubernetesLauncher.from_env(TEAM.environment(env)).image == TEAM_IMAGE
    with pytest.raises(ValueError, match="needs TRAINYARD_TRAINER_IMAGE to be set"):
        KubernetesLauncher.from_env(TeamSpec(name="vision").environment(env))


@pytest.mark.parametrize(
    ("pod", "fragment"),
    [
        ({"cpu": "lots"}, "cpu='lots' is not a Kubernetes quantity; accepted e.g. '500m'"),
        ({"shm_size": "2GB"}, "shm_size='2GB' is not a Kubernetes quantity"),
        ({"gpus_per_pod": -1}, "pod.gpus_per_pod"),
        ({"image": "Registry Example/trainer"}, "image='Registry Example/trainer' is not an image reference"),
        ({"image": "reg/trainer@sha256:1234"}, "accepted: 'sha256:' followed by 64 lowercase hex digits"),
        ({"service_account": "Trainer_SA"}, "service_account='Trainer_SA' is not a valid Kubernetes name"),
        ({"node_selector": {"pool": "a" * 64}}, "node_selector['pool']="),
        ({"tolerations": [{"operator": "Equal", "value": "x"}]}, "toleration with operator 'Equal' needs a key"),
        ({"tolerations": [{"key": "k", "operator": "Sometimes"}]}, "pod.tolerations.0.operator"),
        (
            {
                "affinity": {
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [
                                {"matchExpressions": [{"key": "gen", "operator": "Gt", "values": ["new"]}]}
                            ]
                        }
                    }
                }
            },
            "operator 'Gt' on key 'gen' needs exactly one integer",
        ),
        (
            {
                "affinity": {
                    "podAffinity": {
                        "preferredDuringSchedulingIgnoredDuringExecution": [
                            {"weight": 500, "podAffinityTerm": {"topologyKey": "zone"}}
                        ]
                    }
                }
            },
            "less than or equal to 100",
        ),
        ({"env": {"WANDB_API_KEY": "abc"}}, "env['WANDB_API_KEY'] looks like a credential"),
        ({"env": {"NCCL_DEBUG": 1}}, "pod.env.NCCL_DEBUG"),
        ({"env": {"TRAINYARD_OPTUNA_URL": "postgresql://optuna:pw@db/optuna"}}, "holds a URL with credentials"),
        ({"env": {"HOME": "/root"}}, "env['HOME'] is set by the platform"),
        ({"env": {"2FAST": "1"}}, "env name '2FAST' is invalid"),
        ({"secret_env": {"HF_TOKEN": {"secret": "hf", "key": "to ken"}}}, "key='to ken' is not a Secret key"),
        ({"env_from_secrets": ["Vision Secrets"]}, "env_from_secrets[]='Vision Secrets'"),
        ({"cpus": "4"}, "pod.cpus"),
    ],
)
def test_pod_settings_are_checked_when_the_team_is_declared(pod: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValidationError) as err:
        TeamSpec(name="vision", pod=pod)
    assert fragment in str(err.value)


def test_a_bad_platform_pod_configuration_names_the_variable() -> None:
    for text, fragment in [
        ("{cpu: 4}", "TRAINYARD_K8S_POD is not JSON"),
        ('{"memory": "lots"}', "TRAINYARD_K8S_POD is not a valid pod configuration: memory"),
    ]:
        with pytest.raises(ValueError, match=fragment):
            KubernetesLauncher.from_env({**PLATFORM_ENV, POD_ENV: text})
        with pytest.raises(ValueError, match=fragment):
            TEAM.environment({**PLATFORM_ENV, POD_ENV: text})
    with pytest.raises(ValueError, match="TRAINYARD_K8S_GPUS_PER_POD='four' is not a number of GPUs"):
        KubernetesLauncher.from_env({**PLATFORM_ENV, "TRAINYARD_K8S_GPUS_PER_POD": "four"})


def test_pod_configuration_round_trips_through_the_environment() -> None:
    assert PodConfig.from_json(TEAM.pod.to_json()) == TEAM.pod
    assert PodConfig.from_json("") == PodConfig() and PodConfig().to_json() == "{}"
    merged = PodConfig(env={"A": "1"}, secret_env={"B": {"secret": "s", "key": "k"}}).overlay(PodConfig(env={"B": "2"}))
    assert (merged.env, merged.secret_env) == ({"A": "1", "B": "2"}, {})


def test_an_image_named_by_tag_is_accepted_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    tagged = {**PLATFORM_ENV, "TRAINYARD_TRAINER_IMAGE": "registry.example/trainyard/trainer:1.4.0"}
    with (
        caplog.at_level(logging.WARNING, logger="trainyard.k8s"),
        pytest.warns(UnpinnedImageWarning, match="is not pinned by digest") as caught,
    ):
        launcher = KubernetesLauncher.from_env(tagged)
    assert launcher.image == "registry.example/trainyard/trainer:1.4.0"
    assert "image='registry.example/trainyard/trainer:1.4.0' is not pinned by digest" in str(caught[0].message)
    assert any("not pinned by digest" in r.getMessage() for r in caplog.records)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnpinnedImageWarning)
        KubernetesLauncher.from_env(PLATFORM_ENV)  # pinned: no warning


def test_the_cluster_environment_builds_the_teams_launcher(tmp_path: Path) -> None:
    """`pipelines.team.team_resources` -> `pipelines.environments.cluster_resources`: the launcher line there."""
    from pipelines.team import team_resources

    env = {
        **PLATFORM_ENV,
        "TRAINYARD_ENV": "cluster",
        "TRAINYARD_S3_ROOT": "s3://lake/trainyard",
        "TRAINYARD_HOME": str(tmp_path),
        "TRAINYARD_OPTUNA_URL": "postgresql+psycopg2://optuna@db/optuna",
        "MLFLOW_TRACKING_URI": "http://mlflow:5000",
    }
    cfg = team_resources(TEAM, base_env=env)["launcher"].job_config()
    assert (cfg.image, cfg.cpu, cfg.gpus_per_pod, cfg.shm_size) == (TEAM_IMAGE, "30", 4, "32Gi")
    assert cfg.affinity is not None and cfg.affinity.to_k8s() == AFFINITY
