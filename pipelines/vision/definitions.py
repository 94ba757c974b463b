"""Code location of the vision team (see workspace.yaml)."""

from pipelines.team import team_definitions
from pipelines.vision.digit_images import digit_images
from pipelines.vision.digits import digits
from trainyard import TeamSpec

# At most two trials train at once (Dagster pool `vision_gpu`, set by `trainyard init`);
# on Kubernetes the trials queue in LocalQueue `trainyard` at sweep priority.
team = TeamSpec(name="vision", gpu_pool_limit=2, queue="trainyard", priority_class="trainyard-sweep")

defs = team_definitions(team, digits, digit_images)
