"""Code location of the tabular team (see workspace.yaml)."""

from pipelines.tabular.breast_cancer import breast_cancer
from pipelines.team import team_definitions
from trainyard import TeamSpec

# At most two trials train at once (Dagster pool `tabular_gpu`, set by `trainyard init`);
# on Kubernetes the trials queue in LocalQueue `trainyard` at sweep priority.
team = TeamSpec(name="tabular", gpu_pool_limit=2, queue="trainyard", priority_class="trainyard-sweep")

defs = team_definitions(team, breast_cancer)
