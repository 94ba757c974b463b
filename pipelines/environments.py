"""One builder per environment, chosen once per code location by `TRAINYARD_ENV`.

- `local` (default, embedded): everything under `TRAINYARD_HOME` (default
  `.trainyard` in the project directory, `trainyard.project`): object store
  on the local filesystem, DVC remote inside it, W&B offline unless
  `WANDB_API_KEY` is set, MLflow on SQLite, Optuna on SQLite (or the database
  of `TRAINYARD_OPTUNA_URL` when set), torchrun on this machine.
- `cluster`: object store and DVC remote on S3 (`TRAINYARD_S3_ROOT`, optional
  `AWS_ENDPOINT_URL`), Optuna on PostgreSQL (`TRAINYARD_OPTUNA_URL`), an MLflow
  tracking server (`MLFLOW_TRACKING_URI`) with artifacts on S3, training as
  Kueue-admitted Kubernetes Jobs (`TRAINYARD_K8S_NAMESPACE`,
  `TRAINYARD_TRAINER_IMAGE`, see `KubernetesLauncher.from_env`).

Both publish champion changes as handoff events under `<store>/handoff/` and,
when `TRAINYARD_HANDOFF_WEBHOOK` is set, POST them to that URL.

Credentials only by reference: Dagster keeps every resource's configuration
(shown on the UI's resource pages), so none holds a credential. The Optuna
storage is configured with its URL without the password plus the name of the
variable holding the full URL (`SweepStore.by_reference`); MLflow takes its
credentials from `MLFLOW_TRACKING_USERNAME`/`MLFLOW_TRACKING_PASSWORD` (a
tracking server) or `PGPASSWORD` (a database), S3 clients from the AWS
variables, W&B from `WANDB_API_KEY`, all read from the environment where they
are used (docs/operations.md, "Credentials").
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from common.settings import ENVIRONMENTS, Settings, SettingsError, settings
from resources.handoff import HandoffPublisher
from resources.io_manager import ObjectStoreJsonIOManager
from resources.launcher import LocalLauncher
from resources.registry import ModelRegistry
from resources.storage import ObjectStore
from resources.sweeps import SweepStore
from resources.tracking import Tracking
from resources.versioning import DataVersioning
from training.spec import OPTUNA_URL_ENV
from trainyard.project import project_dir
from trainyard.redact import redact_url, url_has_credentials

HANDOFF_WEBHOOK_ENV = "TRAINYARD_HANDOFF_WEBHOOK"
"""The variable the handoff publisher reads its webhook URL from, by reference at delivery (`common.settings` declares
it)."""


class EnvironmentError_(ValueError):
    """The environment is unknown or misses a required setting."""


def _settings(env: Mapping[str, str]) -> Settings:
    """The `TRAINYARD_*` settings in `env`; a value that does not parse is this environment's error (it names it)."""
    try:
        return settings(env)
    except SettingsError as e:
        raise EnvironmentError_(str(e)) from None


def trainyard_home(env: Mapping[str, str] | None = None) -> Path:
    """`TRAINYARD_HOME`, else `.trainyard` in the project directory."""
    return (settings(env).home or project_dir(env) / ".trainyard").resolve()


def local_resources(home: Path | None = None, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    env = os.environ if env is None else env
    s = _settings(env)
    home = Path(home) if home is not None else trainyard_home(env)
    store = ObjectStore(root=str(home / "store"))
    return {
        "store": store,
        "versioning": DataVersioning(repo_dir=str(home / "dvc"), remote_url=str(home / "store" / "dvc-remote")),
        "tracking": Tracking(mode="auto", dir=str(home / "wandb")),
        "launcher": LocalLauncher(),
        "sweeps": SweepStore.by_reference(s.optuna_url or f"sqlite:///{home / 'optuna.db'}"),
        "registry": ModelRegistry(
            tracking_uri=f"sqlite:///{home / 'mlflow.db'}", artifact_root=str(home / "store" / "mlflow-artifacts")
        ),
        "handoff": HandoffPublisher(store=store, webhook_url_env=HANDOFF_WEBHOOK_ENV if s.handoff_webhook else None),
        "io_manager": ObjectStoreJsonIOManager(store=store),
    }


def _require(env: dict[str, str], name: str) -> str:
    value = env.get(name)
    if not value:
        raise EnvironmentError_(f"environment 'cluster' needs {name} to be set")
    return value


def _credential_free(env: dict[str, str], name: str) -> str:
    """The URL of variable `name`, which must hold no credential (it becomes resource configuration)."""
    value = _require(env, name)
    if url_has_credentials(value):
        raise EnvironmentError_(
            f"{name}={redact_url(value)} carries a password, which would be kept in Dagster's resource configuration; "
            f"set {name} without it and give the credentials as MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD "
            "(a tracking server) or PGPASSWORD (a PostgreSQL backend), which MLflow reads from the environment"
        )
    return value


def cluster_resources(env: dict[str, str] | None = None) -> dict[str, Any]:
    # Imported here: the Kubernetes client takes seconds to import, which every run
    # worker and code server of the local environment would pay for nothing.
    from resources.k8s.launcher import KubernetesLauncher

    env = dict(os.environ if env is None else env)
    s = _settings(env)
    # Every missing setting at once: a user setting up the environment fixes them in one go.
    required = (
        ("TRAINYARD_S3_ROOT", s.s3_root),
        (OPTUNA_URL_ENV, s.optuna_url),
        ("MLFLOW_TRACKING_URI", env.get("MLFLOW_TRACKING_URI")),
    )
    missing = [name for name, value in required if not value]
    missing += KubernetesLauncher.missing_settings(env)
    if missing or not s.s3_root or not s.optuna_url:
        raise EnvironmentError_(
            f"environment 'cluster' needs {', '.join(missing)} to be set (docs/kubernetes.md, \"6. Configure the "
            "cluster environment\")"
        )
    root = s.s3_root.rstrip("/")
    if not root.startswith("s3://"):
        raise EnvironmentError_(f"TRAINYARD_S3_ROOT must be an s3:// URI, got {root!r}")
    endpoint = env.get("AWS_ENDPOINT_URL") or None
    store = ObjectStore(root=root, endpoint_url=endpoint)
    home = s.home or Path("/tmp/trainyard")
    return {
        "store": store,
        "versioning": DataVersioning(
            repo_dir=str(home / "dvc"), remote_url=f"{root}/dvc-remote", remote_endpoint_url=endpoint
        ),
        "tracking": Tracking(mode=s.tracking_mode, entity=env.get("WANDB_ENTITY") or None),
        "launcher": KubernetesLauncher.from_env(env),
        "sweeps": SweepStore.by_reference(s.optuna_url),
        "registry": ModelRegistry(
            tracking_uri=_credential_free(env, "MLFLOW_TRACKING_URI"), artifact_root=f"{root}/mlflow-artifacts"
        ),
        "handoff": HandoffPublisher(store=store, webhook_url_env=HANDOFF_WEBHOOK_ENV if s.handoff_webhook else None),
        "io_manager": ObjectStoreJsonIOManager(store=store),
    }


def resources_for(name: str | None = None, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The resources of environment `name` (default `TRAINYARD_ENV`), configured from `env` (default `os.environ`)."""
    env = dict(os.environ if env is None else env)
    name = name or _settings(env).env
    if name == "local":
        return local_resources(env=env)
    if name == "cluster":
        return cluster_resources(env)
    raise EnvironmentError_(f"TRAINYARD_ENV={name!r} is not an environment; use one of {ENVIRONMENTS}")
