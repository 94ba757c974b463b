"""Code locations of teams whose module declares only specs.

A team module that imports nothing but `trainyard` (a `TeamSpec` and its
`PipelineSpec`s, e.g. `pipelines/fraud/team.py`) becomes a Dagster code location
through this module, named in `workspace.yaml` with the team as the attribute:

    - python_module:
        module_name: pipelines.locations
        attribute: fraud
        location_name: fraud

Dagster reads the attribute with `getattr`, so each location imports and builds
only its own team (`pipelines.team.team_location`); one team's broken module
never breaks another's location.
"""

from __future__ import annotations

from typing import Any

from pipelines.catalog import team_module_name
from pipelines.team import team_location


def __getattr__(team: str) -> Any:
    if team.startswith("__"):
        raise AttributeError(team)
    return team_location(team_module_name(team))
