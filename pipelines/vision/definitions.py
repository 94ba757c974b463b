"""Code location of the vision team (see workspace.yaml)."""

from pipelines.factory import build_definitions
from pipelines.vision.digits import digits

defs = build_definitions(digits)
