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
from pathlib import Path
from typing import Any, Iterable, Optional

import yaml

from pipelines.environments import resources_for
from pipelines.factory import build_definitions
from trainyard.spec import PipelineSpec
from trainyard.team import TeamSpec, check_pipelines

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def team_resources(team: TeamSpec, base_env: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """The team's resources: the environment's (`TRAINYARD_ENV`) built from `team.environment(base_env)`."""
    return resources_for(env=team.environment(base_env))


def team_definitions(team: TeamSpec, *pipelines: PipelineSpec, resources: Optional[dict[str, Any]] = None) -> Any:
    """The Definitions of a team's code location: its pipelines (see `pipelines.factory.build_definitions`) with the team's resources.

    Args:
        team: The team's settings.
        pipelines: The team's pipelines; each must name this team.
        resources: Resources to use instead of the team's environment's (tests).
    """
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
