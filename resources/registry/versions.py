"""`ModelVersionInfo`: a registered model version as trainyard sees it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from trainyard.lineage import TRIAL_KEY_TAG

if TYPE_CHECKING:
    from mlflow.entities.model_registry import ModelVersion


@dataclass(frozen=True)
class ModelVersionInfo:
    """One registered model version, as trainyard sees it.

    Attributes:
        name: Registered model name.
        version: Version number as a string (MLflow's own representation).
        run_id: MLflow run that logged the model.
        model_uri: `models:/<name>/<version>`, loadable by `mlflow.pyfunc.load_model`.
        source: Where MLflow says the artifacts live (the logged model's URI).
        tags: Version tags, including `trainyard.trial_key` when registered here.
        aliases: Aliases pointing at this version (e.g. `champion`).
        created: True only when the call that returned this created the version.
    """

    name: str
    version: str
    run_id: Optional[str]
    model_uri: str
    source: str
    tags: dict[str, str] = field(default_factory=dict)
    aliases: tuple[str, ...] = ()
    created: bool = False

    @property
    def trial_key(self) -> Optional[str]:
        """The trial this version was registered from, if it was registered by trainyard."""
        return self.tags.get(TRIAL_KEY_TAG)


def version_info(mv: "ModelVersion", *, created: bool = False) -> ModelVersionInfo:
    """The `ModelVersionInfo` of an MLflow `ModelVersion`."""
    return ModelVersionInfo(
        name=mv.name,
        version=str(mv.version),
        run_id=mv.run_id,
        model_uri=f"models:/{mv.name}/{mv.version}",
        source=mv.source or "",  # MLflow types it Optional; a registered version always has one
        tags=dict(mv.tags or {}),
        aliases=tuple(mv.aliases or ()),
        created=created,
    )
