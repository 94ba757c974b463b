"""Find team pipeline definitions by key, without building Dagster definitions."""

from __future__ import annotations

import importlib
import pkgutil

import pipelines
from trainyard.spec import PipelineSpec

# Modules of a team package that hold no pipeline definitions (model code is imported by pods).
_SKIP = {"models", "definitions"}


def all_pipelines() -> dict[str, PipelineSpec]:
    """Every `PipelineSpec` declared at module level in `pipelines/<team>/*.py`, by key."""
    found: dict[str, PipelineSpec] = {}
    for team in pkgutil.iter_modules(pipelines.__path__):
        if not team.ispkg:
            continue
        package = importlib.import_module(f"pipelines.{team.name}")
        for module in pkgutil.iter_modules(package.__path__):
            if module.name in _SKIP or module.ispkg:
                continue
            mod = importlib.import_module(f"pipelines.{team.name}.{module.name}")
            for value in vars(mod).values():
                if isinstance(value, PipelineSpec):
                    found[value.key] = value
    return found


def find_pipeline(key: str) -> PipelineSpec:
    specs = all_pipelines()
    if key not in specs:
        raise KeyError(f"no pipeline {key!r}; known pipelines: {sorted(specs)}")
    return specs[key]
