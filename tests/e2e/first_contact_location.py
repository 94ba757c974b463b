"""The code location of the first-contact test: a new team's two pipelines on data no other test uses.

- `contact/blobs`: three well-separated Gaussian blobs (300 rows, 4 features),
  Lightning `MLPClassifier`, 2 trials. Every trial reaches val_acc 1.0, so the
  sweep's report meets a study where all trials tie. The landing sensor is on
  (the default policy): a file landing starts `prepare`.
- `contact/linear`: a noisy linear target (300 rows, 4 features), Lightning
  `MLPRegressor`, 2 trials. No landing sensor (`on_new_data=False`), so the
  only start is a person materializing `raw_data`.

Both are built as a team builds its location (`team_definitions`, resources
from `TRAINYARD_HOME`), then their sensors are rebuilt by the same builders
with a 5 s tick instead of 30-60 s, and runs execute their steps in the run's
own process instead of one process per step, so the test spends its minutes
training rather than starting Python; the sensors' default statuses are the
policies' own.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from dagster import Definitions

from pipelines.factory import job_names
from pipelines.landing_sensor import build_landing_sensor
from pipelines.sensors import with_sweep_sensors
from pipelines.team import team_definitions
from training.spec import Distribution
from trainyard import ColumnSpec, ModelSpec, PipelineSpec, SourceSpec, TeamSpec
from trainyard.search import FloatParam, SearchSpec
from trainyard.spec import RetrainPolicy

TICK_S = 5
ROWS = 300
FEATURES = ["f0", "f1", "f2", "f3"]

team = TeamSpec(name="contact", gpu_pool_limit=2)


def _search() -> SearchSpec:
    return SearchSpec(
        params={"lr": FloatParam(low=0.02, high=0.05, log=True)}, n_trials=2, parallelism=2, sampler="random", seed=3
    )


blobs = PipelineSpec(
    team="contact",
    name="blobs",
    description="Three separable blobs: every trial ties at val_acc 1.0.",
    source=SourceSpec(prefix="landing/contact/blobs", pattern="*.csv"),
    columns={**{f: ColumnSpec(dtype="float") for f in FEATURES}, "label": ColumnSpec(dtype="int", domain=[0, 1, 2])},
    target="label",
    min_rows=200,
    model=ModelSpec(
        path="training.parallel:MLPClassifier",
        hparams={"width": 16, "blocks": 1, "expansion": 2},
        max_epochs=3,
        batch_size=32,
    ),
    search=_search(),
    distribution=Distribution(procs_per_node=1),
)

linear = PipelineSpec(
    team="contact",
    name="linear",
    description="A noisy linear target, regressed by a Lightning MLP.",
    source=SourceSpec(prefix="landing/contact/linear", pattern="*.csv"),
    columns={**{f: ColumnSpec(dtype="float") for f in FEATURES}, "y": ColumnSpec(dtype="float")},
    target="y",
    min_rows=200,
    model=ModelSpec(
        path="training.parallel:MLPRegressor",
        hparams={"width": 16, "blocks": 1, "expansion": 2, "target_scale": 5.0},
        max_epochs=2,
        batch_size=32,
    ),
    search=_search(),
    distribution=Distribution(procs_per_node=1),
    retrain=RetrainPolicy(on_new_data=False),
)

PIPELINES = (blobs, linear)


def blobs_frame(rows: int = ROWS, seed: int = 0) -> pd.DataFrame:
    """Class k sits at 6 on feature k and 0 elsewhere, with noise 0.3: no two classes come near."""
    rng = np.random.default_rng(seed)
    labels = np.arange(rows) % 3
    x = rng.normal(0.0, 0.3, size=(rows, len(FEATURES)))
    x[np.arange(rows), labels] += 6.0
    return pd.DataFrame({**{f: x[:, i].round(6) for i, f in enumerate(FEATURES)}, "label": labels})


def linear_frame(rows: int = ROWS, seed: int = 1) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, 1.0, size=(rows, len(FEATURES)))
    y = x @ np.array([3.0, -2.0, 1.0, 0.5]) + 1.0 + rng.normal(0.0, 0.1, size=rows)
    return pd.DataFrame({**{f: x[:, i].round(6) for i, f in enumerate(FEATURES)}, "y": y.round(6)})


def write_landing(trainyard_home: Path, spec: PipelineSpec, frame: pd.DataFrame, name: str = "part-0.csv") -> Path:
    """Land `frame` as one CSV of the pipeline, whole or not at all (written aside, then renamed into the pattern)."""
    landing = trainyard_home / "store" / spec.source.prefix
    landing.mkdir(parents=True, exist_ok=True)
    path = landing / name
    aside = landing / f".{name}.partial"
    frame.to_csv(aside, index=False)
    aside.replace(path)
    return path


def definitions() -> Definitions:
    full = team_definitions(team, *PIPELINES)
    bare = Definitions(
        assets=list(full.assets or []), jobs=list(full.jobs or []), resources=full.resources, executor=full.executor
    )
    landing = [
        build_landing_sensor(s, job_names(s)["prepare"], minimum_interval_seconds=TICK_S)
        for s in PIPELINES
        if s.retrain_policy.on_new_data
    ]
    return Definitions.merge(
        with_sweep_sensors(bare, *PIPELINES, minimum_interval_seconds=TICK_S), Definitions(sensors=landing)
    )


defs = definitions()
