"""Values for the official Dagster Helm chart, built by pure functions for `deploy/render.py`.

One code location (a Deployment of the chart's `dagster-user-deployments`) per
team, each isolated from the others:

- its code server runs as `code_server_account`, an account with no RBAC
  binding (it never calls the API, so it can read no Secret through it) and
  gets only the Secrets its sensors need (`CODE_SERVER_SECRETS`: object store
  and Optuna, not the W&B key);
- its runs (the pods the K8sRunLauncher starts, which call the trial launcher)
  run as `launcher_account(team)`, bound only in that team's namespace
  (`resources.k8s.cluster.rbac_objects`), so a team's runs can start pods, and
  mount Secrets, in that team's namespace only;
- its trial pods run as the team namespace's own account
  (`resources.k8s.cluster.TRIAL_SERVICE_ACCOUNT`), with the team namespace's
  Secrets (`TRIAL_SECRETS`) by name.

A location's plain settings (never credentials) are one ConfigMap in the
Dagster namespace (`location_config_map`), read by its code server and its run
pods alike. The run pods' settings are written as the code location's container context
(`DAGSTER_CONTAINER_CONTEXT`, read by `dagster api grpc`) instead of the chart's
`includeConfigInLaunchedRuns`, because the chart would give every location's
runs one shared service account. Images are pinned by digest: the chart joins
`repository` and `tag` with ':', so `<repo>@sha256:<hex>` is written as
repository `<repo>@sha256` and tag `<hex>`.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

from resources.k8s.cluster import TRIAL_SERVICE_ACCOUNT
from resources.k8s.errors import ManifestError
from trainyard.podconfig import POD_ENV, TRAINER_UID, PodConfig, check_dns_subdomain, check_image, image_is_pinned
from trainyard.team import priority_class_names

CODE_SERVER_SECRETS = ("trainyard-storage", "trainyard-optuna")
"""dagster namespace: what code servers need (sensors read the object store and Optuna studies)."""
RUN_SECRETS = ("trainyard-storage", "trainyard-tracking", "trainyard-optuna")
"""dagster namespace: what run pods need (storage, W&B, Optuna)."""
TRIAL_SECRETS = ("trainyard-storage", "trainyard-tracking", "trainyard-optuna")
"""Each team namespace: what trial pods need (`TRAINYARD_K8S_SECRETS`)."""
GRPC_PORT = 3030
# The restricted Pod Security profile for the code servers and run pods (the
# orchestrator image runs as uid 10001 too); their root filesystem stays
# writable (Dagster writes under DAGSTER_HOME and temporary files).
_POD_SECURITY = {"runAsNonRoot": True, "runAsUser": TRAINER_UID, "runAsGroup": TRAINER_UID, "fsGroup": TRAINER_UID,
                 "seccompProfile": {"type": "RuntimeDefault"}}
_CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True}
_RESOURCES = {"requests": {"cpu": "500m", "memory": "2Gi"}, "limits": {"memory": "2Gi"}}


def launcher_account(team: str) -> str:
    """The service account of team `team`'s run pods: its launcher, bound only in the team's namespace."""
    return check_dns_subdomain("launcher account", f"trainyard-launcher-{team.replace('_', '-')}")


def _snake(obj: Any) -> Any:
    """A manifest fragment with Dagster's snake_case keys (`runAsNonRoot` -> `run_as_non_root`)."""
    if isinstance(obj, dict):
        return {re.sub(r"(?<!^)(?=[A-Z])", "_", k).lower(): _snake(v) for k, v in obj.items()}
    return obj


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CodeLocation(_Frozen):
    """One team's code location on the cluster.

    Args:
        name: the location's (and team's) name; the chart's Deployment name.
        module: the Python module `dagster api grpc` loads (`pipelines.<team>.definitions`).
        namespace: the team namespace its trials run in.
        priority_class, queue_name: the launcher's defaults (a `TeamSpec` may change them).
        pod: the platform's pod configuration for this team (TRAINYARD_K8S_POD); the
            team's own `TeamSpec.pod` is laid over it.
    """

    name: str
    module: str
    namespace: str
    priority_class: str = "trainyard-production"
    queue_name: str = "trainyard"
    pod: PodConfig = PodConfig()

    @field_validator("name", "namespace", "queue_name")
    @classmethod
    def _names(cls, v: str, info: Any) -> str:
        return check_dns_subdomain(info.field_name, v)

    @field_validator("priority_class")
    @classmethod
    def _priority(cls, v: str) -> str:
        if v not in priority_class_names():
            raise ValueError(
                f"priority_class={v!r} is not a platform PriorityClass; accepted: {priority_class_names()}"
            )
        return v


class Platform(_Frozen):
    """The cluster-wide settings of the chart's values: images, where the shared services are."""

    orchestrator_image: str
    trainer_image: str
    dagster_namespace: str = "dagster"
    code_server_account: str = "trainyard-code-server"
    s3_root: str = "s3://trainyard-prod"
    mlflow_tracking_uri: str = "http://mlflow.mlflow.svc.cluster.local:5000"
    postgres_host: str = "postgres.dagster.svc.cluster.local"

    @field_validator("orchestrator_image", "trainer_image")
    @classmethod
    def _image(cls, v: str, info: Any) -> str:
        return check_image(info.field_name, v)

    @field_validator("dagster_namespace", "code_server_account")
    @classmethod
    def _names(cls, v: str, info: Any) -> str:
        return check_dns_subdomain(info.field_name, v)


def chart_image(ref: str) -> dict[str, str]:
    """The chart's `image` block for `ref`: a digest split at '@sha256:' so the chart's `repository:tag` rejoins it."""
    if image_is_pinned(ref):
        repository, digest = ref.split("@sha256:")
        return {"repository": f"{repository}@sha256", "tag": digest, "pullPolicy": "IfNotPresent"}
    repository, _, tag = ref.rpartition(":")
    if not repository or "/" in tag:
        raise ManifestError(f"image={ref!r} has neither a digest nor a tag; accepted: '<repository>@sha256:<64 hex>'")
    return {"repository": repository, "tag": tag, "pullPolicy": "IfNotPresent"}


def config_map_name(loc: CodeLocation) -> str:
    """The name of the ConfigMap holding `loc`'s plain settings."""
    return check_dns_subdomain("config map", f"trainyard-location-{loc.name}")


def location_env(loc: CodeLocation, platform: Platform) -> dict[str, str]:
    """The plain environment of a location's code server and run pods (credentials come from `envSecrets`)."""
    env = {
        "TRAINYARD_ENV": "cluster",
        "TRAINYARD_S3_ROOT": platform.s3_root,
        "MLFLOW_TRACKING_URI": platform.mlflow_tracking_uri,
        # The trial launcher (KubernetesLauncher.from_env).
        "TRAINYARD_K8S_NAMESPACE": loc.namespace,
        "TRAINYARD_TRAINER_IMAGE": platform.trainer_image,
        "TRAINYARD_K8S_QUEUE": loc.queue_name,
        "TRAINYARD_K8S_PRIORITY_CLASS": loc.priority_class,
        "TRAINYARD_K8S_SERVICE_ACCOUNT": TRIAL_SERVICE_ACCOUNT,
        "TRAINYARD_K8S_SECRETS": ",".join(TRIAL_SECRETS),
    }
    if loc.pod.model_fields_set:
        env[POD_ENV] = loc.pod.to_json()
    return env


def location_config_map(loc: CodeLocation, platform: Platform) -> dict[str, Any]:
    """The ConfigMap (Dagster namespace) with `location_env`: one definition for the code server and its runs."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": config_map_name(loc), "namespace": platform.dagster_namespace,
                     "labels": {"app.kubernetes.io/part-of": "trainyard", "trainyard.io/code-location": loc.name}},
        "data": location_env(loc, platform),
    }


def run_container_context(loc: CodeLocation, platform: Platform) -> dict[str, Any]:
    """The container context of `loc`'s runs: the launcher's account, the location's env and Secrets, restricted
    pods."""
    return {
        "k8s": {
            "namespace": platform.dagster_namespace,
            "service_account_name": launcher_account(loc.name),
            "image_pull_policy": "IfNotPresent",
            "env_config_maps": [config_map_name(loc)],
            "env_secrets": list(RUN_SECRETS),
            "resources": copy.deepcopy(_RESOURCES),
            "security_context": _snake(_CONTAINER_SECURITY),
            "run_k8s_config": {
                # The run pod is the trial launcher: it needs its token for the API.
                "pod_spec_config": {"automount_service_account_token": True, "security_context": _snake(_POD_SECURITY)},
            },
        }
    }


def user_deployment(loc: CodeLocation, platform: Platform) -> dict[str, Any]:
    """The chart's `dagster-user-deployments.deployments[]` entry of one location."""
    context = json.dumps(run_container_context(loc, platform), sort_keys=True, separators=(",", ":"))
    return {
        "name": loc.name,
        "image": chart_image(platform.orchestrator_image),
        "dagsterApiGrpcArgs": ["--module-name", loc.module],
        "port": GRPC_PORT,
        # Not the chart's: it would run every location's runs as one shared account.
        "includeConfigInLaunchedRuns": {"enabled": False},
        "serviceAccount": {"create": False, "name": platform.code_server_account, "annotations": {}},
        "env": [{"name": "DAGSTER_CONTAINER_CONTEXT", "value": context}],
        "envConfigMaps": [{"name": config_map_name(loc)}],
        "envSecrets": [{"name": s} for s in CODE_SERVER_SECRETS],
        "podSecurityContext": copy.deepcopy(_POD_SECURITY),
        "securityContext": copy.deepcopy(_CONTAINER_SECURITY),
        "resources": copy.deepcopy(_RESOURCES),
    }


# The daemon's queue (`dagster.yaml`'s `run_coordinator.config`, as the chart writes a custom coordinator's).
RUN_QUEUE = {
    "max_concurrent_runs": 50,
    "dequeue_interval_seconds": 1,
    "dequeue_use_threads": True,
    "dequeue_num_workers": 4,
}


def dagster_values(locations: list[CodeLocation], platform: Platform) -> dict[str, Any]:
    """The values of the `dagster/dagster` chart: PostgreSQL storage, K8sRunLauncher, queued runs, one location per
    team."""
    names = [loc.name for loc in locations]
    if len(set(names)) != len(names) or not names:
        raise ManifestError(f"code locations {names} are empty or repeat a name; accepted: one CodeLocation per team")
    return {
        "postgresql": {
            # An external database (managed PostgreSQL); the password comes from the Secret below.
            "enabled": False,
            "postgresqlHost": platform.postgres_host,
            "postgresqlUsername": "dagster",
            "postgresqlPassword": "",
            "postgresqlDatabase": "dagster",
            "postgresqlParams": {},
            "service": {"port": 5432},
        },
        "generatePostgresqlPasswordSecret": False,
        "global": {"postgresqlSecretName": "dagster-postgresql-secret"},
        "runLauncher": {
            "type": "K8sRunLauncher",
            "config": {
                "k8sRunLauncher": {
                    "imagePullPolicy": "IfNotPresent",
                    "loadInclusterConfig": True,
                    "envConfigMaps": [],
                    "envSecrets": [],
                    "envVars": [],
                }
            },
        },
        "dagsterDaemon": {
            "enabled": True,
            # A run mostly waits on its trial's Job; Kueue decides how many trials
            # train at once. This only bounds the number of waiting run pods.
            # Runs dequeued together are launched in parallel threads (Dagster launches them one after the other by
            # default: each waits for the previous launch's Job creation).
            # The queue is Dagster's, made by `instance.run_queue.RunQueue`, which makes the run launcher before the
            # dequeue threads and run monitoring ask for it (Dagster's lazy `instance.run_launcher` is not
            # thread-safe): so the daemon, and the webserver that submits to the queue, run the orchestrator image.
            "image": chart_image(platform.orchestrator_image),
            "runCoordinator": {
                "enabled": True,
                "type": "CustomRunCoordinator",
                "config": {
                    "customRunCoordinator": {"module": "instance.run_queue", "class": "RunQueue", "config": RUN_QUEUE}
                },
            },
            # A run pod killed (node lost, evicted, OOM) is resumed: a new run worker for the same
            # run and attempt, whose launcher re-attaches to the trial's running gang (same name,
            # attempt and run id) instead of starting a second one (resources.k8s.gangs).
            "runMonitoring": {
                "enabled": True,
                "startTimeoutSeconds": 300,
                "pollIntervalSeconds": 60,
                "maxResumeRunAttempts": 3,
            },
        },
        "dagsterWebserver": {"image": chart_image(platform.orchestrator_image)},
        "dagster-user-deployments": {
            "enabled": True,
            "enableSubchart": True,
            # The default account of the subchart: the code servers' (no bindings).
            "serviceAccount": {"create": False, "name": platform.code_server_account, "annotations": {}},
            "deployments": [user_deployment(loc, platform) for loc in locations],
        },
        "telemetry": {"enabled": False},
    }
