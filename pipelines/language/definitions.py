"""Code location of the language team (see workspace.yaml)."""

from pipelines.language.precedence import precedence
from pipelines.language.stdlib_lm import stdlib_lm
from pipelines.team import team_definitions
from trainyard import TeamSpec

# At most two trials train at once (Dagster pool `language_gpu`, set by `trainyard init`), each a
# 2-process FSDP gang; on Kubernetes the trials queue in LocalQueue `trainyard` at sweep priority.
team = TeamSpec(name="language", gpu_pool_limit=2, queue="trainyard", priority_class="trainyard-sweep")

defs = team_definitions(team, precedence, stdlib_lm)
