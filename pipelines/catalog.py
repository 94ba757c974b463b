"""Find team pipeline definitions by key, from the code locations in `workspace.yaml`.

The workspace is the project directory's (`workspace_file`: `TRAINYARD_PROJECT_DIR`,
default the current directory, as `dagster dev -w workspace.yaml` reads it).

Only each location's own module (e.g. `pipelines.tabular.definitions`) is imported,
exactly as `dagster dev` would load it; a team folder's other modules (helper
scripts, notebooks exported as `.py`, model code) are never executed by discovery,
so a script that writes files or prints on import stays inert. A location serves
the `PipelineSpec`s its module holds at module level (`from .wine import wine`) or
through a module of its own team package that it imported itself (`from . import
wine` then `team_definitions(team, wine.wine)`).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Iterator, Optional

import yaml

from trainyard.project import PROJECT_DIR_ENV, project_dir
from trainyard.spec import PipelineSpec
from trainyard.team import TeamSpec

WORKSPACE_FILE = "workspace.yaml"

LOCATIONS_MODULE = "pipelines.locations"
"""The module that serves spec-only team modules as code locations, one attribute per team."""


def team_module_name(team: str) -> str:
    """The spec-only module of `team` that `pipelines.locations` loads: `pipelines.<team>.team`."""
    return f"pipelines.{team}.team"


def workspace_file() -> Path:
    """`workspace.yaml` in the project directory (`trainyard.project.project_dir`).

    Raises:
        FileNotFoundError: There is none; the message says where it looked and how to point elsewhere.
    """
    path = project_dir() / WORKSPACE_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"no {WORKSPACE_FILE} in {path.parent}: run from the project directory or set {PROJECT_DIR_ENV} to it"
        )
    return path


def location_modules(workspace: Optional[Path] = None) -> list[str]:
    """The module holding each `python_module` code location's specs in `workspace`, in file order.

    A location served through `pipelines.locations` (attribute = team) holds its
    specs in the team's spec-only module, `pipelines.<team>.team`.
    """
    doc = yaml.safe_load(Path(workspace or workspace_file()).read_text()) or {}
    names: list[str] = []
    for entry in doc.get("load_from") or []:
        target = entry.get("python_module") if isinstance(entry, dict) else None
        name = target.get("module_name") if isinstance(target, dict) else target
        if isinstance(name, str) and name == LOCATIONS_MODULE and isinstance(target, dict) and target.get("attribute"):
            names.append(team_module_name(str(target["attribute"])))
        elif isinstance(name, str) and name:
            names.append(name)
    return names


def workspace_teams(workspace: Optional[Path] = None) -> list[TeamSpec]:
    """The TeamSpecs the code locations of `workspace` declare (module attributes of that type), first of each name."""
    teams: dict[str, TeamSpec] = {}
    for name in location_modules(workspace):
        for value in vars(importlib.import_module(name)).values():
            if isinstance(value, TeamSpec):
                teams.setdefault(value.name, value)
    return list(teams.values())


def _served_specs(module: ModuleType) -> Iterator[PipelineSpec]:
    package = module.__name__.rpartition(".")[0]
    for value in vars(module).values():
        if isinstance(value, PipelineSpec):
            yield value
        elif isinstance(value, ModuleType) and package and value.__name__.startswith(package + "."):
            yield from (v for v in vars(value).values() if isinstance(v, PipelineSpec))


def all_pipelines(workspace: Optional[Path] = None) -> dict[str, PipelineSpec]:
    """Every `PipelineSpec` served by a code location of `workspace`, by key.

    Args:
        workspace: The Dagster workspace file whose `python_module` locations are loaded (default: `workspace_file()`).

    Raises:
        ValueError: two locations serve different pipelines under one key.
    """
    found: dict[str, PipelineSpec] = {}
    for name in location_modules(workspace):
        for spec in _served_specs(importlib.import_module(name)):
            if found.setdefault(spec.key, spec) != spec:
                raise ValueError(
                    f"pipeline {spec.key!r} is served by two code locations (second: {name}); give each pipeline one "
                    "key"
                )
    return found


def find_pipeline(key: str, workspace: Optional[Path] = None) -> PipelineSpec:
    """The pipeline `<team>/<name>` served by a code location of `workspace`.

    Raises:
        KeyError: no location serves `key`; the message lists the known keys.
    """
    specs = all_pipelines(workspace)
    if key not in specs:
        raise KeyError(f"no pipeline {key!r}; known pipelines: {sorted(specs)}")
    return specs[key]
