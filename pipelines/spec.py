"""The team-facing, declarative pipeline definition.

A team describes *what* to train; `pipelines.factory.build_definitions` turns it
into the six-asset lineage graph. Everything here is validated when the team
module is imported, so a mistake fails before any compute is spent, with a
message naming the field, the value and what would be accepted.

Configuration layers merge in one order, later wins:
platform defaults (the field defaults below) < this pipeline spec < Dagster run
config (launch-time overrides such as `max_epochs`).

Example:
    >>> spec = PipelineSpec(
    ...     team="vision", name="digits",
    ...     source=SourceSpec(prefix="landing/vision/digits"),
    ...     columns={"x": ColumnSpec(dtype="float"), "label": ColumnSpec(dtype="int", domain=[0, 1])},
    ...     target="label",
    ...     model=ModelSpec(path="pipelines.vision.models:DigitsMLP"),
    ... )
    >>> spec.key
    'vision/digits'
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import re
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from training.spec import CheckpointPolicy, Distribution, ImportTarget

_NAME = re.compile(r"^[a-z][a-z0-9_]{0,30}$")


def check_import_path(path: str) -> None:
    """Check that `module:attr` names a module that exists and defines `attr`.

    The module is located and its source parsed, not executed, so the
    orchestrator validates a model path without importing torch.
    """
    module, _, attr = path.partition(":")
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError) as e:
        raise ValueError(f"import path {path!r}: module {module!r} cannot be found ({e})") from e
    if found is None:
        raise ValueError(f"import path {path!r}: no module named {module!r} on the Python path")
    if found.origin and found.origin.endswith(".py"):
        tree = ast.parse(open(found.origin, encoding="utf-8").read(), filename=found.origin)
        names = set()
        for node in tree.body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        if attr not in names:
            raise ValueError(f"import path {path!r}: module {module!r} defines no {attr!r}")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SourceSpec(_Strict):
    """Landing files, relative to the object store root (or absolute `s3://...`)."""

    prefix: str
    pattern: str = "*.csv"
    format: Literal["csv", "parquet", "jsonl"] = "csv"


class ColumnSpec(_Strict):
    """Expectations on one column: type, nulls, range and categorical domain."""

    dtype: Literal["int", "float", "str", "bool"]
    nullable: bool = False
    min: Optional[float] = None
    max: Optional[float] = None
    domain: Optional[list[Union[int, str, bool]]] = None

    @model_validator(mode="after")
    def _range_ordered(self) -> "ColumnSpec":
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min {self.min} is greater than max {self.max}")
        return self


class SplitSpec(_Strict):
    """Deterministic stratified train/val/test split."""

    val_fraction: float = Field(0.15, gt=0, lt=0.5)
    test_fraction: float = Field(0.15, gt=0, lt=0.5)
    seed: int = 0


class FloatParam(_Strict):
    kind: Literal["float"] = "float"
    low: float
    high: float
    log: bool = False

    @model_validator(mode="after")
    def _bounds(self) -> "FloatParam":
        if not self.low < self.high:
            raise ValueError(f"low {self.low} must be below high {self.high}")
        if self.log and self.low <= 0:
            raise ValueError(f"log scale needs low > 0, got {self.low}")
        return self


class IntParam(_Strict):
    kind: Literal["int"] = "int"
    low: int
    high: int
    step: int = Field(1, ge=1)
    log: bool = False

    @model_validator(mode="after")
    def _bounds(self) -> "IntParam":
        if not self.low < self.high:
            raise ValueError(f"low {self.low} must be below high {self.high}")
        return self


class CategoricalParam(_Strict):
    kind: Literal["categorical"] = "categorical"
    choices: list[Union[int, float, str, bool]]

    @field_validator("choices")
    @classmethod
    def _non_empty(cls, v: list) -> list:
        if not v:
            raise ValueError("choices must not be empty")
        return v


Param = Union[FloatParam, IntParam, CategoricalParam]


class SearchSpec(_Strict):
    """An Optuna search space over model hyperparameters.

    A pipeline without a search space is a sweep of one trial with the model's
    own hyperparameters, so small and large jobs share one path.
    """

    params: dict[str, Param] = Field(default_factory=dict)
    n_trials: int = Field(1, ge=1)
    sampler: Literal["tpe", "random"] = "tpe"
    seed: int = 0

    @model_validator(mode="after")
    def _space(self) -> "SearchSpec":
        if self.n_trials > 1 and not self.params:
            raise ValueError(
                f"n_trials={self.n_trials} needs a non-empty search space in 'params' "
                "(e.g. {'lr': FloatParam(low=1e-4, high=1e-1, log=True)})"
            )
        return self


class ModelSpec(_Strict):
    """A LightningModule by import path, its fixed hyperparameters and the fit loop."""

    path: str
    hparams: dict[str, Any] = Field(default_factory=dict)
    datamodule: str = "training.data:ParquetDataModule"
    max_epochs: int = Field(10, ge=1)
    batch_size: int = Field(64, ge=1)
    monitor: str = "val_acc"
    monitor_mode: Literal["max", "min"] = "max"
    seed: int = 0

    @field_validator("path", "datamodule")
    @classmethod
    def _importable(cls, v: str) -> str:
        ImportTarget(path=v)  # raises on a malformed path
        check_import_path(v)
        return v


class RetrySpec(_Strict):
    """Run-level retries of a trial (Dagster re-launches; the pod resumes from its newest checkpoint).

    Infrastructure failures (killed or lost workers, storage outages) spend
    `max_infra_retries`; preemptions have their own, larger budget so a busy
    cluster does not use up the failure budget. Errors in model code and bad
    configuration are never retried.
    """

    max_infra_retries: int = Field(3, ge=0)
    max_preemptions: int = Field(20, ge=0)
    wait_seconds: float = Field(2.0, ge=0)


class PromotionSpec(_Strict):
    """When a new version may take the `champion` alias."""

    metric: str = "test_acc"
    mode: Literal["max", "min"] = "max"
    min_improvement: float = Field(0.0, ge=0.0)


class PipelineSpec(_Strict):
    """One team pipeline: source, expectations, model, search and promotion."""

    team: str
    name: str
    description: str = ""
    source: SourceSpec
    columns: dict[str, ColumnSpec]
    target: str
    min_rows: int = Field(10, ge=1)
    max_rows: Optional[int] = Field(None, ge=1)
    max_drift_psi: Optional[float] = Field(None, gt=0)
    split: SplitSpec = SplitSpec()
    model: ModelSpec
    search: SearchSpec = SearchSpec()
    distribution: Distribution = Distribution()
    promotion: PromotionSpec = PromotionSpec()
    checkpoint: CheckpointPolicy = CheckpointPolicy()
    retries: RetrySpec = RetrySpec()

    @field_validator("team", "name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(
                f"{v!r} is not a valid name; use 1-31 lowercase letters, digits or '_', starting with a letter"
            )
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "PipelineSpec":
        if self.target not in self.columns:
            raise ValueError(f"target {self.target!r} is not one of the declared columns {sorted(self.columns)}")
        if not self.features:
            raise ValueError("columns must declare at least one feature besides the target")
        if self.max_rows is not None and self.max_rows < self.min_rows:
            raise ValueError(f"max_rows {self.max_rows} is below min_rows {self.min_rows}")
        overlap = set(self.search.params) & set(self.model.hparams)
        if overlap:
            raise ValueError(
                f"search.params and model.hparams both set {sorted(overlap)}; a parameter is either searched or fixed"
            )
        return self

    @property
    def key(self) -> str:
        return f"{self.team}/{self.name}"

    @property
    def features(self) -> list[str]:
        return [c for c in self.columns if c != self.target]

    @property
    def model_name(self) -> str:
        """Registered model name in the registry."""
        return f"{self.team}.{self.name}"

    def fingerprint(self) -> str:
        """Hash of everything that changes what a trial trains (not the data)."""
        payload = self.model_dump(mode="json", include={"columns", "target", "split", "model", "search", "distribution"})
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]
