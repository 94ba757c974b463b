"""The values passed between a pipeline's assets, as pydantic models.

An asset value is a small pointer-and-summary record (URIs, versions, metrics),
never data; `resources.io_manager.ObjectStoreJsonIOManager` keeps it as JSON in
the object store and validates it against its model when a downstream asset
loads it, so a stored value that no longer fits fails with the asset and field
named instead of a `KeyError` deep inside an asset.

Unknown keys are refused (`extra="forbid"`): every key an asset writes is a
declared field, so a typo or a stale value from another version of the code
is caught at load rather than passed on. The trial values extend the pod's
`TrainResult`, so a field the pod adds is declared in one place. One value is
open: `RegisteredModel`, whose test metrics sit beside its fields (the stored
JSON keeps that shape); its extra keys must be numbers. Fields that values
written by older code or by test drills lack (`set_aside`, `profile`) have
defaults.

Example:
    >>> value = parse_value("sweep", {"study": "s", "trials": ["trial-0000"], "data_md5": "ab"}, where="io/t/p/sweep")
    >>> value.trials
    ['trial-0000']
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from training.spec import TrainResult


class AssetValue(BaseModel):
    """Base of asset values: unknown keys are refused."""

    model_config = ConfigDict(extra="forbid")


class RawData(AssetValue):
    """`raw_data`: the canonical Parquet snapshot of the landing files and its DVC pin."""

    uri: str
    md5: str = Field(description="DVC md5 of the snapshot: the data version")
    rows: int
    dvc_file: str = Field(description="text of the `.dvc` pin that restores these bytes")
    files: int = Field(description="landing files in the snapshot")
    warnings: list[str] = Field(default_factory=list)


class ValidatedData(AssetValue):
    """`validated_data`: an accepted data version split into train/val/test."""

    md5: str
    split_id: str
    train: str
    val: str
    test: str
    rows: dict[str, int] = Field(description="rows per part: train, val, test")
    set_aside: int = Field(0, description="rows set aside (quarantined) by the bad-data policy")
    profile: Optional[str] = Field(None, description="URI of the data profile kept beside the split")


class Sweep(AssetValue):
    """`sweep`: the Optuna study of this pipeline and data version and its trials' partition keys."""

    study: str
    trials: list[str]
    data_md5: str


class TrialModel(TrainResult):
    """`trial_model` (one per partition): the trial's `TrainResult` plus where it came from.

    `objectives` holds the objective values told to the study (absent for a
    pruned trial or a result reused as stored).
    """

    model_config = ConfigDict(extra="forbid", frozen=False)

    trial: str
    number: int
    params: dict[str, Any]
    result_uri: str
    objectives: Optional[dict[str, float]] = None


class BestModel(TrialModel):
    """`best_model`: the best finished trial of the study, with its held-out test metrics."""

    study: str
    value: float = Field(description="its first objective value")
    values: list[float]


class RegisteredModel(AssetValue):
    """`registered_model`: the registry version and the promotion decision; the trial's metrics are extra float keys."""

    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, float] = Field(init=False)

    name: str
    version: str
    model_uri: str
    champion: bool
    created: bool
    decision: str

    @property
    def metrics(self) -> dict[str, float]:
        return dict(self.model_extra or {})


VALUE_TYPES: dict[str, type[BaseModel]] = {
    "raw_data": RawData,
    "validated_data": ValidatedData,
    "sweep": Sweep,
    "trial_model": TrialModel,
    "best_model": BestModel,
    "registered_model": RegisteredModel,
}


class ValueMismatch(ValueError):
    """A stored asset value does not match its model; the message names the asset and the fields."""


def parse_value(asset: str, data: Any, where: str = "") -> Any:
    """`data` as the model of asset `asset` (its last key part); assets without a model pass unchanged.

    Raises:
        ValueMismatch: `data` does not fit the model: names the asset, where it
            is stored and each failing field with the reason.
    """
    model = VALUE_TYPES.get(asset)
    if model is None:
        return data
    try:
        return model.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(
            f"field {'.'.join(str(p) for p in err['loc']) or '<value>'!r}: {err['msg']}" for err in e.errors()
        )
        at = f" at {where}" if where else ""
        raise ValueMismatch(
            f"stored value of asset {asset!r}{at} does not match {model.__name__}: {problems}; "
            "materialize the asset again to rewrite it"
        ) from e


def dump_value(value: Any) -> Any:
    """The JSON form of an asset value (models as their fields, anything else unchanged)."""
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else value
