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
from types import ModuleType
from typing import Any, Iterable, Optional

from pipelines.environments import resources_for
from pipelines.factory import build_definitions
from trainyard.spec import PipelineSpec
from trainyard.team import TeamSpec, check_pipelines


def team_resources(team: TeamSpec, base_env: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """The team's resources: the environment's (`TRAINYARD_ENV`) built from `team.environment(base_env)`."""
    return resources_for(env=team.environment(base_env))


def team_definitions(team: TeamSpec, *pipelines: PipelineSpec, resources: Optional[dict[str, Any]] = None) -> Any:
    """The Definitions of a team's code location: its pipelines (see `pipelines.factory.build_definitions`) with the
    team's resources.

    Args:
        team: The team's settings.
        pipelines: The team's pipelines; each must name this team.
        resources: Resources to use instead of the team's environment's (tests).
    """
    specs = check_pipelines(team, pipelines)
    return build_definitions(*specs, resources=resources if resources is not None else team_resources(team))


def declared_specs(module: ModuleType) -> tuple[TeamSpec, list[PipelineSpec]]:
    """The one `TeamSpec` and the `PipelineSpec`s a spec-only team module holds at module level, in order.

    Raises:
        ValueError: the module declares no `TeamSpec` or more than one.
    """
    values = list(vars(module).values())
    teams = [v for v in values if isinstance(v, TeamSpec)]
    if len(teams) != 1:
        found = "none" if not teams else ", ".join(repr(t.name) for t in teams)
        raise ValueError(f"{module.__name__}: a team module declares exactly one TeamSpec, found {found}")
    specs = list({id(v): v for v in values if isinstance(v, PipelineSpec)}.values())
    return teams[0], specs


def team_location(module_name: str, resources: Optional[dict[str, Any]] = None) -> Any:
    """The Definitions of a spec-only team module (see `pipelines.locations`).

    Args:
        module_name: The team module, e.g. `pipelines.fraud.team`.
        resources: Resources to use instead of the team's environment's (tests).
    """
    team, specs = declared_specs(importlib.import_module(module_name))
    return team_definitions(team, *specs, resources=resources)


def apply_pool_limits(instance: Any, teams: Iterable[TeamSpec]) -> dict[str, int]:
    """Set each team's GPU pool limit on the Dagster instance (what `trainyard init` does); returns {pool: limit}.

    Raises:
        ValueError: the instance's storage keeps no pool limits, or two teams share a name.
    """
    storage = instance.event_log_storage
    if not storage.supports_global_concurrency_limits:
        raise ValueError(
            f"the Dagster instance's event log storage ({type(storage).__name__}) keeps no pool limits; use SQLite or "
            "PostgreSQL storage"
        )
    limits: dict[str, int] = {}
    for team in teams:
        if limits.get(team.pool, team.gpu_pool_limit) != team.gpu_pool_limit:
            raise ValueError(
                f"team {team.name!r} is declared twice with gpu_pool_limit {limits[team.pool]} and "
                f"{team.gpu_pool_limit}; "
                "give each team one TeamSpec and import it where needed"
            )
        limits[team.pool] = team.gpu_pool_limit
    for pool, limit in limits.items():
        storage.set_concurrency_slots(pool, limit)
    return limits
