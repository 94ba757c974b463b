"""A team's settings, declared once: GPU quota, Kueue queue, priority, retraining default, environment.

A team module (`pipelines/<team>/definitions.py`, one code location in
`workspace.yaml`) declares a `TeamSpec` and builds its pipelines with it:

    team = TeamSpec(name="vision", gpu_pool_limit=2)
    defs = team_definitions(team, digits)

Where each setting takes effect:

- `gpu_pool_limit`: the limit of the Dagster pool `<team>_gpu`, which every
  `trial_model` step of the team claims, so at most this many trials train at
  once across all runs; set on the instance by `trainyard init` (re-run it
  after changing a team), see `apply_pool_limits`. The run queue's per-team
  limit in `dagster.yaml` still bounds the team's runs as a whole.
- `queue`, `namespace`, `priority_class`: the Kubernetes launcher's Kueue
  LocalQueue, namespace and PriorityClass of the team's trial Jobs (cluster
  environment only; the local launcher ignores them).
- `retrain`: the default `RetrainPolicy` of pipelines that set none.
- `env`: environment variables layered over the process environment when the
  team's resources are built (e.g. `TRAINYARD_ENV`, `TRAINYARD_OPTUNA_URL`).

Layers, later wins: platform defaults < process environment < team config < a
pipeline's own fields < Dagster run config.
"""

from __future__ import annotations

import importlib
import os
import re
from pathlib import Path
from typing import Any, Iterable, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pipelines.spec import _NAME, PipelineSpec, RetrainPolicy

PROJECT_ROOT = Path(__file__).resolve().parent.parent
# Kubernetes names (RFC 1123 labels): what a LocalQueue or a namespace may be called.
_K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_ENV_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")
# Variables a team may set: those the environments and resources read.
ENV_PREFIXES = ("TRAINYARD_", "AWS_", "MLFLOW_", "WANDB_")


def priority_class_names() -> list[str]:
    """The PriorityClasses `deploy/k8s/10-priority-classes.yaml` creates, highest first."""
    from resources.k8s_manifests import PRIORITIES

    return sorted(PRIORITIES, key=lambda n: -PRIORITIES[n][0])


class TeamSpec(BaseModel):
    """One team's settings (see the module docstring for where each applies).

    Example:
        >>> TeamSpec(name="vision", gpu_pool_limit=4, queue="vision", priority_class="trainyard-sweep")
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    gpu_pool_limit: int = 2
    queue: str = "trainyard"
    namespace: Optional[str] = None
    priority_class: str = "trainyard-sweep"
    retrain: RetrainPolicy = RetrainPolicy()
    env: dict[str, str] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(f"team name {v!r} is not valid; use 1-31 lowercase letters, digits or '_', starting with a letter (e.g. 'vision')")
        return v

    @field_validator("gpu_pool_limit")
    @classmethod
    def _limit(cls, v: int) -> int:
        if v < 1:
            raise ValueError(
                f"gpu_pool_limit={v} would let no trial train; set it to the most trials the team may train at once (1 or more)"
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
            raise ValueError(f"priority_class {v!r} is not a platform PriorityClass; {hint}use one of {names} (highest first)")
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
        return v

    @property
    def pool(self) -> str:
        """The Dagster pool of the team's trial steps (`PipelineSpec.gpu_pool`)."""
        return f"{self.name}_gpu"

    def environment(self, base: Optional[dict[str, str]] = None) -> dict[str, str]:
        """The environment the team's resources are built from: `base` (default `os.environ`), the team's Kubernetes settings, then `env`."""
        env = dict(os.environ if base is None else base)
        env["TRAINYARD_K8S_QUEUE"] = self.queue
        env["TRAINYARD_K8S_PRIORITY_CLASS"] = self.priority_class
        if self.namespace is not None:
            env["TRAINYARD_K8S_NAMESPACE"] = self.namespace
        env.update(self.env)
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
        raise ValueError(f"team {team.name!r}: team_definitions needs at least one pipeline, e.g. team_definitions(team, my_pipeline)")
    return out


def team_resources(team: TeamSpec, base_env: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """The team's resources: the environment's (`TRAINYARD_ENV`) built from `team.environment(base_env)`."""
    from pipelines.environments import resources_for

    return resources_for(env=team.environment(base_env))


def team_definitions(team: TeamSpec, *pipelines: PipelineSpec, resources: Optional[dict[str, Any]] = None) -> Any:
    """The Definitions of a team's code location: its pipelines (see `pipelines.factory.build_definitions`) with the team's resources.

    Args:
        team: The team's settings.
        pipelines: The team's pipelines; each must name this team.
        resources: Resources to use instead of the team's environment's (tests).
    """
    from pipelines.factory import build_definitions

    specs = check_pipelines(team, pipelines)
    return build_definitions(*specs, resources=resources if resources is not None else team_resources(team))


def apply_pool_limits(instance: Any, teams: Iterable[TeamSpec]) -> dict[str, int]:
    """Set each team's GPU pool limit on the Dagster instance (what `trainyard init` does); returns {pool: limit}.

    Raises:
        ValueError: the instance's storage keeps no pool limits, or two teams share a name.
    """
    storage = instance.event_log_storage
    if not storage.supports_global_concurrency_limits:
        raise ValueError(f"the Dagster instance's event log storage ({type(storage).__name__}) keeps no pool limits; use SQLite or PostgreSQL storage")
    limits: dict[str, int] = {}
    for team in teams:
        if limits.get(team.pool, team.gpu_pool_limit) != team.gpu_pool_limit:
            raise ValueError(
                f"team {team.name!r} is declared twice with gpu_pool_limit {limits[team.pool]} and {team.gpu_pool_limit}; "
                "give each team one TeamSpec and import it where needed"
            )
        limits[team.pool] = team.gpu_pool_limit
    for pool, limit in limits.items():
        storage.set_concurrency_slots(pool, limit)
    return limits


def workspace_teams(workspace: Path = PROJECT_ROOT / "workspace.yaml") -> list[TeamSpec]:
    """The TeamSpecs of the code locations in `workspace.yaml` (module attributes of that type)."""
    import yaml

    doc = yaml.safe_load(workspace.read_text()) or {}
    teams: dict[str, TeamSpec] = {}
    for entry in doc.get("load_from", []):
        target = entry.get("python_module") if isinstance(entry, dict) else None
        module_name = target.get("module_name") if isinstance(target, dict) else target
        if not module_name:
            continue
        module = importlib.import_module(module_name)
        for value in vars(module).values():
            if isinstance(value, TeamSpec):
                teams.setdefault(value.name, value)
    return list(teams.values())
