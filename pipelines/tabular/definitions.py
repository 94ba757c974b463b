"""Code location of the tabular team (see workspace.yaml)."""

from pipelines.factory import build_definitions
from pipelines.tabular.breast_cancer import breast_cancer

defs = build_definitions(breast_cancer)
