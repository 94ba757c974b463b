"""trainyard's public API and Dagster-free core.

A team's pipeline module needs this one import:

    from trainyard import ColumnSpec, Distribution, ModelSpec, PipelineSpec, SearchSpec, SourceSpec, TeamSpec

Everything exported here is a validated, declarative value (pydantic); nothing
imports Dagster, torch or the data stack. The code location that turns a team's
specs into Dagster definitions is one line on top (`pipelines.team.team_definitions`).
"""

from training.spec import CheckpointPolicy, Distribution, Preprocessing, PrunerSpec
from trainyard.feast_source import FeastSourceSpec
from trainyard.podconfig import PodConfig
from trainyard.search import CategoricalParam, FloatParam, IntParam, Objective, PickPolicy, SearchSpec
from trainyard.shardspec import ImageShards, TextShards
from trainyard.spec import (
    ColumnSpec,
    ModelSpec,
    PipelineSpec,
    PromotionSpec,
    RetrainPolicy,
    RetrySpec,
    SourceSpec,
    SplitSpec,
)
from trainyard.team import TeamSpec

__all__ = [
    "CategoricalParam",
    "CheckpointPolicy",
    "ColumnSpec",
    "Distribution",
    "FeastSourceSpec",
    "FloatParam",
    "ImageShards",
    "IntParam",
    "ModelSpec",
    "Objective",
    "PickPolicy",
    "PodConfig",
    "Preprocessing",
    "PipelineSpec",
    "PromotionSpec",
    "PrunerSpec",
    "RetrainPolicy",
    "RetrySpec",
    "SearchSpec",
    "SourceSpec",
    "SplitSpec",
    "TeamSpec",
    "TextShards",
]
