"""A team's settings, declared once: GPU quota, Kueue queue, priority, retraining default, environment, trial pods.

Where each setting takes effect is described in `pipelines.team`, which turns a
`TeamSpec` and its pipelines into a Dagster code location.
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterable, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

from common.settings import settings
from trainyard.podconfig import POD_ENV, PodConfig
from trainyard.redact import SECRET_ENV_VARS, url_has_credentials
from trainyard.spec import _NAME, PipelineSpec, RetrainPolicy

PRIORITIES: dict[str, tuple[int, str]] = {
    "trainyard-interactive": (100_000, "A person is waiting: notebooks, debugging runs."),
    "trainyard-production": (10_000, "Scheduled and sensor-triggered retraining of registered models."),
    "trainyard-sweep": (1_000, "Hyperparameter sweep trials: preemptible, never preempt others."),
}
"""The platform's PriorityClasses (value, description), created by `deploy/k8s/10-priority-classes.yaml`."""

# Kubernetes names (RFC 1123 labels): what a LocalQueue or a namespace may be called.
_K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_ENV_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")
# Variables a team may set: those the environments and resources read.
ENV_PREFIXES = ("TRAINYARD_", "AWS_", "MLFLOW_", "WANDB_")


def priority_class_names() -> list[str]:
    """The PriorityClasses `deploy/k8s/10-priority-classes.yaml` creates, highest first."""
    return sorted(PRIORITIES, key=lambda n: -PRIORITIES[n][0])


class TeamSpec(BaseModel):
    """One team's settings (see the module docstring for where each applies).

    `pod` is what the team's trial pods need beyond the platform's defaults
    (`trainyard.podconfig.PodConfig`, any of the settings `PodSettings` declares:
    image digest, CPU/memory/GPUs, tolerations, node selector, affinity, /dev/shm,
    scratch size, termination grace, the Job's deadline, NCCL settings, Secrets by
    name, service account); it reaches the Kubernetes launcher through `environment()`.

    Example:
        >>> TeamSpec(name="vision", gpu_pool_limit=4, queue="vision", priority_class="trainyard-sweep",
        ...          pod={"cpu": "16", "memory": "96Gi", "node_selector": {"pool": "gpu"}})
    """

    model_config = ConfigDict(
        extra="forbid", frozen=True, hide_input_in_errors=True
    )  # an env value may be a credential

    name: str
    gpu_pool_limit: int = 2
    queue: str = "trainyard"
    namespace: Optional[str] = None
    priority_class: str = "trainyard-sweep"
    retrain: RetrainPolicy = RetrainPolicy()
    env: dict[str, str] = Field(default_factory=dict)
    pod: PodConfig = PodConfig()

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(
                f"team name {v!r} is not valid; use 1-31 lowercase letters, digits or '_', starting with a letter "
                "(e.g. 'vision')"
            )
        return v

    @field_validator("gpu_pool_limit")
    @classmethod
    def _limit(cls, v: int) -> int:
        if v < 1:
            raise ValueError(
                f"gpu_pool_limit={v} would let no trial train; set it to the most trials the team may train at once "
                "(1 or more)"
            )
        return v

    @field_validator("queue", "namespace")
    @classmethod
    def _k8s_name(cls, v: Optional[str], info: Any) -> Optional[str]:
        if v is not None and not _K8S_NAME.match(v):
            raise ValueError(
                f"{info.field_name} {v!r} is not a Kubernetes name; use lowercase letters, digits and '-', "
                "starting and ending with a letter or digit, at most 63 characters (e.g. 'vision')"
            )
        return v

    @field_validator("priority_class")
    @classmethod
    def _priority(cls, v: str) -> str:
        names = priority_class_names()
        if v not in names:
            short = f"trainyard-{v}" if f"trainyard-{v}" in names else None
            hint = f"did you mean {short!r}? " if short else ""
            raise ValueError(
                f"priority_class {v!r} is not a platform PriorityClass; {hint}use one of {names} (highest first)"
            )
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v:
            if not _ENV_NAME.match(name) or not name.startswith(ENV_PREFIXES):
                raise ValueError(
                    f"env {name!r} is not a setting the platform reads; use upper-case variables starting with one of "
                    f"{list(ENV_PREFIXES)} (e.g. 'TRAINYARD_OPTUNA_URL')"
                )
            if name in SECRET_ENV_VARS or url_has_credentials(v[name]):
                raise ValueError(
                    f"env {name!r} holds a credential, and team code is no place for one: set it in the code "
                    "location's "
                    "environment from a Secret (docs/operations.md, 'Credentials'); a URL here may name user and host "
                    "only"
                )
        return v

    @property
    def pool(self) -> str:
        """The Dagster pool of the team's trial steps (`PipelineSpec.gpu_pool`)."""
        return f"{self.name}_gpu"

    def environment(self, base: Optional[dict[str, str]] = None) -> dict[str, str]:
        """The environment the team's resources are built from: `base` (default `os.environ`), the team's Kubernetes
        settings, then `env`.

        The team's `pod` is laid over the platform's pod configuration in
        `TRAINYARD_K8S_POD` (JSON, see `PodConfig.overlay`), which the Kubernetes
        launcher reads on top of its `TRAINYARD_K8S_*` defaults.

        Raises:
            ValueError: the platform's `TRAINYARD_K8S_POD` is not a valid pod configuration.
        """
        env = dict(os.environ if base is None else base)
        env["TRAINYARD_K8S_QUEUE"] = self.queue
        env["TRAINYARD_K8S_PRIORITY_CLASS"] = self.priority_class
        if self.namespace is not None:
            env["TRAINYARD_K8S_NAMESPACE"] = self.namespace
        env.update(self.env)
        if self.pod.model_fields_set:
            platform = PodConfig.from_json(settings(env).k8s_pod, source=POD_ENV)
            env[POD_ENV] = platform.overlay(self.pod).to_json()
        return env


def check_pipelines(team: TeamSpec, pipelines: Iterable[PipelineSpec]) -> list[PipelineSpec]:
    """The pipelines, each with the team's retraining default unless it sets its own.

    Raises:
        ValueError: no pipeline, or a pipeline of another team; the message names the field and the fix.
    """
    out = []
    for p in pipelines:
        if not isinstance(p, PipelineSpec):
            raise ValueError(f"team {team.name!r}: expected PipelineSpec objects, got {type(p).__name__} {p!r}")
        if p.team != team.name:
            raise ValueError(
                f"pipeline {p.key!r}: team={p.team!r} does not match this team module's TeamSpec(name={team.name!r}); "
                f"set PipelineSpec(team={team.name!r}, ...) or move the pipeline to the {p.team!r} team's module"
            )
        out.append(p if p.retrain is not None else p.model_copy(update={"retrain": team.retrain}))
    if not out:
        raise ValueError(
            f"team {team.name!r}: team_definitions needs at least one pipeline, e.g. team_definitions(team, "
            "my_pipeline)"
        )
    return out


