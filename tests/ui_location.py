"""A code location for the browser UI test: one tiny GBT pipeline, `ui/breast_cancer`.

LightGBM on 300 rows of scikit-learn's bundled breast-cancer data, a sweep of one
trial with a handful of boosting rounds, so a whole journey (prepare, train,
promote) takes well under a minute of compute. Built like a team's own location
(`team_definitions`; the sweep sensor runs from the start and ends the sweep
with `promote`, as by default); resources come from `TRAINYARD_HOME` as in any
local `dagster dev`. `write_landing` puts the rows where the pipeline's
`raw_data` looks for them.

The team turns the landing sensor off (`on_new_data=False`): the test's one
landing file is there before the server starts, and the journey under test is
the one a UI user starts by materializing, not one a landing starts beside it.
"""

from __future__ import annotations

from pathlib import Path

from pipelines.tabular.breast_cancer import FEATURES, TARGET, landing_frame
from pipelines.team import team_definitions
from trainyard import ColumnSpec, ModelSpec, PipelineSpec, RetrainPolicy, SourceSpec, TeamSpec

ROWS = 300

team = TeamSpec(name="ui", gpu_pool_limit=1, retrain=RetrainPolicy(on_new_data=False))

pipeline = PipelineSpec(
    team="ui",
    name="breast_cancer",
    description="Breast-cancer diagnosis, a one-trial LightGBM sweep for the browser UI test.",
    source=SourceSpec(prefix="landing/ui/breast_cancer", pattern="*.csv"),
    columns={**{f: ColumnSpec(dtype="float", min=0) for f in FEATURES}, TARGET: ColumnSpec(dtype="int", domain=[0, 1])},
    target=TARGET,
    min_rows=200,
    model=ModelSpec(task="gbt", hparams={"objective": "binary", "num_leaves": 8}, max_epochs=20, monitor="val_logloss", monitor_mode="min"),
)


def write_landing(trainyard_home: Path, rows: int = ROWS) -> Path:
    """Write the first `rows` rows of the data as the pipeline's one landing file; returns its path."""
    landing = trainyard_home / "store" / pipeline.source.prefix
    landing.mkdir(parents=True, exist_ok=True)
    path = landing / "part-0.csv"
    landing_frame().head(rows).to_csv(path, index=False)
    return path


defs = team_definitions(team, pipeline)
