"""Code location `platform` (see workspace.yaml): `platform/gpu_usage` over every team's runs, refreshed daily.

A separate location because an asset key belongs to exactly one code location;
the asset reads the shared object store, so it sees the runs of every team.
"""

from dagster import AssetSelection, Definitions, ScheduleDefinition, define_asset_job

from assets.usage import USAGE_KEY, gpu_usage
from pipelines.environments import resources_for

usage_job = define_asset_job("platform__usage", selection=AssetSelection.assets(USAGE_KEY))

defs = Definitions(
    assets=[gpu_usage],
    jobs=[usage_job],
    schedules=[ScheduleDefinition(job=usage_job, cron_schedule="0 6 * * *", execution_timezone="UTC")],
    resources=resources_for(),
)
