"""What the landing files of a pipeline hold: its declared columns, or a feature-store source's entity rows.

A file source's landing files carry every declared column. A Feast source's
landing files (`FeastSourceSpec`) carry the entity rows only: the entity keys,
the event time and the label; the features come from the feature store. Ingest
and the landing sensor read the landing files through `landing_spec`, so
entity files get the same incremental ingestion, manifest, quarantine and DVC
pin as any landing file.
"""

from __future__ import annotations

from trainyard.feast_source import FeastSourceSpec
from trainyard.spec import ColumnSpec, PipelineSpec


def entity_columns(source: FeastSourceSpec, spec: PipelineSpec) -> dict[str, ColumnSpec]:
    """The entity files' columns: keys, the event time (read as text or epoch seconds, parsed by the feature store
    side), the label."""
    return {**source.keys, source.timestamp: ColumnSpec(dtype="str"), spec.target: spec.columns[spec.target]}


def landing_spec(spec: PipelineSpec) -> PipelineSpec:
    """The spec the landing files are read with: `spec` itself, or for a Feast source the same pipeline over its entity
    columns.

    The copy is not validated again (its columns hold no features on purpose);
    it is only given to ingestion, never built into assets.
    """
    if not isinstance(spec.source, FeastSourceSpec):
        return spec
    return spec.model_copy(update={"columns": entity_columns(spec.source, spec), "suite": None})
