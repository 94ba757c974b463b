"""Turn declarative `PipelineSpec`s into Dagster `Definitions`."""

from __future__ import annotations

from typing import Any, Optional

from dagster import AssetKey, AssetSelection, Definitions, define_asset_job

from assets.factory import build_assets, trials_partitions
from pipelines.spec import PipelineSpec


def job_names(spec: PipelineSpec) -> dict[str, str]:
    base = f"{spec.team}__{spec.name}"
    return {"prepare": f"{base}__prepare", "train": f"{base}__train", "promote": f"{base}__promote"}


def build_definitions(*specs: PipelineSpec, resources: Optional[dict[str, Any]] = None) -> Definitions:
    """All assets and jobs of the given pipelines, with the environment's resources.

    Jobs per pipeline: `prepare` (raw_data, validated_data, sweep), `train`
    (one trial_model partition per run) and `promote` (best_model,
    registered_model).
    """
    from pipelines.environments import resources_for

    seen: set[str] = set()
    assets: list[Any] = []
    jobs: list[Any] = []
    for spec in specs:
        if spec.key in seen:
            raise ValueError(f"pipeline {spec.key!r} is defined twice")
        seen.add(spec.key)
        assets += build_assets(spec)
        names = job_names(spec)
        k = lambda n: AssetKey([spec.team, spec.name, n])  # noqa: E731
        jobs += [
            define_asset_job(names["prepare"], selection=AssetSelection.assets(k("raw_data"), k("validated_data"), k("sweep"))),
            define_asset_job(names["train"], selection=AssetSelection.assets(k("trial_model")), partitions_def=trials_partitions(spec)),
            define_asset_job(names["promote"], selection=AssetSelection.assets(k("best_model"), k("registered_model"))),
        ]
    return Definitions(assets=assets, jobs=jobs, resources=resources if resources is not None else resources_for())
