"""Code location of the commerce team (see workspace.yaml)."""

from pipelines.commerce.churn import churn
from pipelines.team import team_definitions
from trainyard import TeamSpec

team = TeamSpec(name="commerce", gpu_pool_limit=2, queue="trainyard", priority_class="trainyard-sweep")

defs = team_definitions(team, churn)
