"""A feature-store source: training rows whose features come from Feast, joined as of each row's time.

`FeastSourceSpec` is a `SourceSpec` (its landing files are the entity rows),
so ingestion, the landing sensor and the quarantine treat it like any source;
`trainyard.data.feast` does the retrieval. See docs/data.md, "Feature store
sources (Feast)".
"""

from __future__ import annotations

import re
from typing import Optional

from pydantic import Field, field_validator, model_validator

from trainyard.dataspec import ColumnSpec, SourceSpec

FEATURE_REF = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*:[A-Za-z_][A-Za-z0-9_]*$")


class FeastSourceSpec(SourceSpec):
    """Training data from a Feast feature store: entity rows from landing files, features joined as of each row's time.

    The inherited fields (`prefix`, `pattern`, `format`, `encoding`,
    `duplicates`) describe the *entity* landing files: one row per training
    example with the entity key columns (`keys`), the event time
    (`timestamp`) and the label (the pipeline's `target`). Every other
    declared column of the pipeline is a feature, retrieved with Feast's
    `get_historical_features` (a point-in-time join: each row gets the
    newest feature value written at or before its event time, within the
    feature view's ttl). The feature repository is read in its own
    interpreter (`TRAINYARD_FEAST_PYTHON`, see docs/data.md).

    Attributes:
        repo: The Feast repository: a directory with `feature_store.yaml`,
            relative to the object store root (like `prefix`) or absolute.
        keys: Entity key columns of the entity files and their types.
        timestamp: The entity files' event-time column: ISO 8601 text
            (`2024-05-01T12:00:00Z`; no zone means UTC) or epoch seconds.
        features: Feature references `view:feature`; each names a declared
            column (the feature's name). Exactly one of `features` and
            `feature_service` is set.
        feature_service: A Feast feature service naming the features.
        project: The Feast project, when not the one of `feature_store.yaml`.

    Example:
        >>> FeastSourceSpec(prefix="landing/commerce/churn", repo="feast/commerce",
        ...                 keys={"customer_id": ColumnSpec(dtype="int")},
        ...                 features=["customer_stats:balance"]).views
        ['customer_stats']
    """

    repo: str
    keys: dict[str, ColumnSpec]
    timestamp: str = "event_timestamp"
    features: list[str] = Field(default_factory=list)
    feature_service: Optional[str] = None
    project: Optional[str] = None

    @field_validator("repo")
    @classmethod
    def _repo(cls, v: str) -> str:
        if not v.strip() or ".." in v.split("/"):
            raise ValueError(
                f"repo {v!r} must be a directory holding feature_store.yaml, relative to the store root or absolute, "
                "without '..'"
            )
        return v

    @field_validator("keys")
    @classmethod
    def _keys(cls, v: dict[str, ColumnSpec]) -> dict[str, ColumnSpec]:
        if not v:
            raise ValueError(
                "keys must name at least one entity key column, e.g. {'customer_id': ColumnSpec(dtype='int')}"
            )
        for name, column in v.items():
            if column.nullable or column.dtype not in ("int", "str"):
                raise ValueError(
                    f"key {name!r}: entity keys are non-nullable 'int' or 'str' columns, got dtype {column.dtype!r}, "
                    f"nullable={column.nullable}"
                )
        return v

    @field_validator("features")
    @classmethod
    def _refs(cls, v: list[str]) -> list[str]:
        bad = [r for r in v if not FEATURE_REF.match(r)]
        if bad:
            raise ValueError(
                f"features {bad} are not feature references; write 'view:feature', e.g. 'customer_stats:balance'"
            )
        names = [r.split(":")[1] for r in v]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(
                f"features name {repeated} more than once; a feature name is a column, so each may come from one view "
                "only"
            )
        return v

    @model_validator(mode="after")
    def _one_selection(self) -> "FeastSourceSpec":
        if bool(self.features) == (self.feature_service is not None):
            raise ValueError(
                "set exactly one of features (['view:feature', ...]) and feature_service (a Feast feature service name)"
            )
        if self.timestamp in self.keys:
            raise ValueError(f"timestamp column {self.timestamp!r} is also an entity key; name two different columns")
        return self

    @property
    def views(self) -> list[str]:
        """The feature views named by `features`, in order of first mention (empty with a feature service)."""
        return list(dict.fromkeys(r.split(":")[0] for r in self.features))

    def check_columns(self, columns: dict[str, ColumnSpec], target: str) -> None:
        """Check the pipeline's columns against this source: keys and timestamp are not features, each referenced
        feature is declared.

        Raises:
            ValueError: A key or the timestamp is declared as a column, or the
                feature references and the declared feature columns differ.
        """
        clash = sorted((set(self.keys) | {self.timestamp}) & set(columns))
        if clash:
            raise ValueError(
                f"source: {clash} are entity keys or the event time, which are not trained on; leave them out of "
                "columns"
            )
        if self.features:
            referenced = {r.split(":")[1] for r in self.features}
            declared = set(columns) - {target}
            if referenced != declared:
                raise ValueError(
                    f"source.features names {sorted(referenced)} but the declared feature columns are "
                    f"{sorted(declared)}; "
                    "every declared column but the target is a feature retrieved from Feast (its name as in "
                    "'view:feature')"
                )
