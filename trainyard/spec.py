"""The team-facing, declarative pipeline definition.

A team describes *what* to train in its `TeamSpec` module; the team's code
location (`pipelines.team.team_definitions`, as README's "Write your own
pipeline" shows) turns each pipeline into the six-asset lineage graph. Everything here is validated when the team
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
import os
import re
from typing import Any, Literal, Optional, Union

from pydantic import Field, SerializeAsAny, ValidationInfo, field_validator, model_validator

from training.spec import CheckpointPolicy, Distribution, ImportTarget, PredictionTask, Preprocessing
from trainyard.dataspec import (
    ColumnSpec,
    SourceSpec,
    SplitSpec,
)  # public here too: `from trainyard.spec import SourceSpec`
from trainyard.policies import PromotionSpec, RetrainPolicy
from trainyard.project import project_dir
from trainyard.search import SWEEP_CONTROL_FIELDS, SearchSpec, StrictSpec
from trainyard.shardspec import (
    IMAGE_FEATURE,
    IMAGE_TARGET,
    TEXT_FEATURE,
    TEXT_TARGET,
    ImageShards,
    ShardSpec,
    TextShards,
)
from trainyard.tasks import GBT_METRICS, GBT_MONITORS, check_task, fill_task_defaults, infer_task, metric_direction

STREAMING_DATAMODULE = "training.streaming:StreamingShardDataModule"
"""The data module a sharded pipeline's trials get unless its `ModelSpec.datamodule` names another."""

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

GBT_MODEL_PATH = "lightgbm:train"

class ModelSpec(StrictSpec):
    """What trains: a LightningModule by import path (`task="lightning"`) or LightGBM (`task="gbt"`).

    For `task="gbt"` leave `path` unset (it is `lightgbm:train`); `hparams` are
    LightGBM parameters plus `objective` (inferred from the target when unset)
    and `early_stopping_rounds`; `max_epochs` is the number of boosting rounds;
    `monitor` is `val_acc` or `val_logloss` (classification) or `val_rmse`
    (regression, with `monitor_mode="min"`); `datamodule` and `batch_size` are unused.

    Example:
        >>> ModelSpec(task="gbt", hparams={"num_leaves": 15}, max_epochs=300)
    """

    task: Literal["lightning", "gbt"] = "lightning"
    # A default (checked): a gbt model takes no path, so a type checker must not ask for one.
    path: str = Field(default="", validate_default=True)
    hparams: dict[str, Any] = Field(default_factory=dict)
    datamodule: str = "training.data:ParquetDataModule"
    max_epochs: int = Field(10, ge=1)
    batch_size: int = Field(64, ge=1)
    monitor: str = "val_acc"
    monitor_mode: Literal["max", "min"] = "max"
    seed: int = 0
    class_weight: Optional[Literal["balanced"]] = None

    @model_validator(mode="before")
    @classmethod
    def _gbt_path(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("task") == "gbt" and data.get("path") is None:
            data = {**data, "path": GBT_MODEL_PATH}
        # A monitor named without its mode gets its direction (ModelSpec(monitor="val_logloss") minimises it).
        if isinstance(data, dict) and "monitor_mode" not in data and isinstance(data.get("monitor"), str):
            known = metric_direction(data["monitor"])
            if known is not None:
                data = {**data, "monitor_mode": known}
        return data

    @field_validator("path", "datamodule")
    @classmethod
    def _importable(cls, v: str, info: ValidationInfo) -> str:
        if info.field_name == "path" and not v:
            raise ValueError(
                "a lightning model needs `path`, its LightningModule's import path (e.g. "
                "'pipelines.myteam.models:ChurnNet'); "
                "task 'gbt' needs none"
            )
        if info.field_name == "path" and info.data.get("task") == "gbt":
            if v != GBT_MODEL_PATH:
                raise ValueError(
                    f"task 'gbt' trains LightGBM and takes no model path; leave path unset (or {GBT_MODEL_PATH!r}), "
                    f"got {v!r}"
                )
            return v
        ImportTarget(path=v)  # raises on a malformed path
        check_import_path(v)
        return v

    @model_validator(mode="after")
    def _gbt_monitor(self) -> "ModelSpec":
        if self.task == "gbt":
            if self.monitor not in GBT_MONITORS:
                raise ValueError(f"monitor {self.monitor!r} is not a gbt metric; use one of {sorted(GBT_MONITORS)}")
            if self.monitor_mode != GBT_MONITORS[self.monitor]:
                raise ValueError(
                    f"monitor_mode {self.monitor_mode!r} does not fit monitor {self.monitor!r}; use "
                    f"{GBT_MONITORS[self.monitor]!r}"
                )
        return self

    @property
    def gbt_metrics(self) -> tuple[str, ...]:
        """Metrics a gbt trial of this spec reports (empty for lightning)."""
        if self.task != "gbt":
            return ()
        return GBT_METRICS["regression" if self.monitor in GBT_METRICS["regression"] else "classification"]

class RetrySpec(StrictSpec):
    """Run-level retries of a trial (Dagster re-launches; the pod resumes from its newest checkpoint).

    Infrastructure failures (killed or lost workers, storage outages) spend
    `max_infra_retries`; preemptions have their own, larger budget so a busy
    cluster does not use up the failure budget. Errors in model code and bad
    configuration are never retried.
    """

    max_infra_retries: int = Field(3, ge=0)
    max_preemptions: int = Field(20, ge=0)
    wait_seconds: float = Field(2.0, ge=0)

def resolve_suite_path(path: str) -> str:
    """A suite path made absolute: a relative one is taken from the project directory (`trainyard.project`)."""
    return path if os.path.isabs(path) else str(project_dir() / path)

def load_suite_file(path: str) -> dict[str, Any]:
    """Read a Great Expectations suite JSON file and check its shape.

    The file is what `trainyard data profile` writes (GE 1.x suite JSON):
    `{"name": ..., "expectations": [{"type": "expect_...", "kwargs": {...}}, ...]}`.
    Whether each type exists is checked when the suite runs (GE is slow to import).

    Raises:
        ValueError: The file is missing, not JSON, or not shaped like a suite;
            the message names the file and the offending entry.
    """
    full = resolve_suite_path(path)
    try:
        with open(full, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise ValueError(f"suite {path!r}: cannot read {full} ({e.strerror or e})") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"suite {path!r}: {full} is not valid JSON ({e})") from e
    expectations = doc.get("expectations") if isinstance(doc, dict) else None
    if not isinstance(expectations, list) or not expectations:
        raise ValueError(f"suite {path!r}: expected a JSON object with a non-empty 'expectations' list")
    for i, entry in enumerate(expectations):
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("type"), str)
            or not entry["type"].startswith("expect_")
        ):
            raise ValueError(
                f"suite {path!r}: expectations[{i}] needs a 'type' like 'expect_column_values_to_be_between', got "
                f"{entry!r}"
            )
        if not isinstance(entry.get("kwargs", {}), dict):
            raise ValueError(f"suite {path!r}: expectations[{i}].kwargs must be an object, got {entry['kwargs']!r}")
    return doc

class PipelineSpec(StrictSpec):
    """One team pipeline: source, expectations, model, search and promotion.

    Data fields (see docs/data.md):

    - `on_bad_data`: what happens to bad input. `"reject"`: any bad file or
      failing expectation stops the graph; the file or snapshot is kept in
      quarantine with a report. `"warn"`: bad files are skipped and bad rows set
      aside (both kept in quarantine), the rest goes on with warnings; table-level
      failures (row count, columns) still reject.
    - `allow_duplicate_rows`: True keeps repeated rows whatever
      `source.duplicates` says (the same as `duplicates="allow"`).
    - `max_drift_psi` / `max_drift_ks`: per-column drift thresholds against the
      previous validated version (PSI for every feature, KS statistic for
      numeric ones); None turns a test off. PSI is on by default at 0.25, the
      usual "large shift" (`trainyard.data.drift_detection.PSI_ALERT`).
    - `on_drift`: what a drift beyond a threshold does. `"warn"` (default): the
      version is accepted and the check, its metadata and the run log say which
      features drifted — drift is a reason to retrain (`RetrainPolicy.drift_psi`),
      not to refuse the data. `"reject"`: the version is quarantined like bad data
      (a units change upstream, say), with `trainyard data release` as the way out.
    - `suite`: a Great Expectations suite JSON file (e.g. made by `trainyard data
      profile` and then edited), relative to the project directory
      (`TRAINYARD_PROJECT_DIR`, default: the current directory) or absolute; it
      replaces the suite built from `columns`. Platform checks always run.

    `task`: `classification` or `regression` (see `trainyard.tasks` and
    docs/tasks.md for each task's metrics, serving and defaults). Unset, the
    target column's dtype decides: `float` is regression, `int`/`str`/`bool`
    classification. The task's default monitor and promotion metric fill the
    fields this spec leaves unset (platform default < task default < this spec).

    `retrain` (a `RetrainPolicy`): landing data, cron and drift triggers; unset, the
    team's default applies (see `pipelines.team.TeamSpec`).
    """

    team: str
    name: str
    description: str = ""
    # A subclass (`trainyard.feast_source.FeastSourceSpec`) is kept and dumped whole.
    source: SerializeAsAny[SourceSpec]
    # A sharded pipeline (`shards` set) declares neither: its kind fixes the model's input and target.
    columns: dict[str, ColumnSpec] = Field(default_factory=dict)
    target: str = ""
    # None is resolved at validation (`_task_defaults`), so a built spec always holds its task.
    task: Optional[PredictionTask] = None
    min_rows: int = Field(10, ge=1)
    max_rows: Optional[int] = Field(None, ge=1)
    max_drift_psi: Optional[float] = Field(0.25, gt=0)
    max_drift_ks: Optional[float] = Field(None, gt=0, le=1)
    on_bad_data: Literal["reject", "warn"] = "reject"
    on_drift: Literal["warn", "reject"] = "warn"
    allow_duplicate_rows: bool = False
    suite: Optional[str] = None
    split: SplitSpec = SplitSpec()
    model: ModelSpec
    search: SearchSpec = SearchSpec()
    distribution: Distribution = Distribution()
    promotion: PromotionSpec = PromotionSpec()
    checkpoint: CheckpointPolicy = CheckpointPolicy()
    retries: RetrySpec = RetrySpec()
    # None: the team's default (`TeamSpec.retrain`), else the platform's (new landing data retrains).
    retrain: Optional[RetrainPolicy] = None
    preprocessing: Preprocessing = Preprocessing()
    positive_label: Optional[Union[int, str, bool]] = None
    # Documents or images streamed from shards instead of a table (`trainyard.shardspec`, docs/data.md "Shards").
    shards: Optional[ShardSpec] = None

    @field_validator("team", "name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(
                f"{v!r} is not a valid name; use 1-31 lowercase letters, digits or '_', starting with a letter"
            )
        return v

    @field_validator("suite")
    @classmethod
    def _suite_file(cls, v: Optional[str]) -> Optional[str]:
        if v is not None:
            load_suite_file(v)
        return v

    def suite_path(self) -> Optional[str]:
        """The absolute path of `suite`, or None when the suite is built from `columns`."""
        return None if self.suite is None else resolve_suite_path(self.suite)

    @model_validator(mode="before")
    @classmethod
    def _task_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        shards = data.get("shards")
        kind = shards.get("kind") if isinstance(shards, dict) else getattr(shards, "kind", None)
        if kind is not None and not data.get("task"):
            data = {**data, "task": "causal_lm" if kind == "text" else "classification"}
        model = data.get("model")
        if kind is not None and isinstance(model, dict) and "datamodule" not in model:
            data = {**data, "model": {**model, "datamodule": STREAMING_DATAMODULE}}
        elif kind is not None and isinstance(model, ModelSpec) and "datamodule" not in model.model_fields_set:
            data = {**data, "model": model.model_copy(update={"datamodule": STREAMING_DATAMODULE})}
        return fill_task_defaults(data, ModelSpec, PromotionSpec)

    @model_validator(mode="after")
    def _consistent(self) -> "PipelineSpec":
        if self.shards is not None:
            return self._consistent_shards()
        if self.task == "causal_lm":
            raise ValueError(
                "task 'causal_lm' trains on a text corpus: set shards=TextShards(...) (docs/data.md, \"Shards\")"
            )
        if not self.columns or not self.target:
            raise ValueError("a tabular pipeline declares its columns and its target (a sharded one sets shards=...)")
        if self.target not in self.columns:
            raise ValueError(f"target {self.target!r} is not one of the declared columns {sorted(self.columns)}")
        target = self.columns[self.target]
        if target.role != "feature":
            raise ValueError(
                f"target {self.target!r} has role {target.role!r}; the target is the label, so leave its role unset"
            )
        if target.dtype in ("date", "datetime"):
            raise ValueError(
                f"target {self.target!r} has dtype {target.dtype!r}; a target is a label (int, str, bool, category) "
                "or a number (float)"
            )
        if self.model.class_weight is not None and self.task == "regression":
            raise ValueError(
                f"model.class_weight={self.model.class_weight!r} weighs classes, but the task is 'regression'; leave "
                "it unset"
            )
        if self.positive_label is not None and target.domain is not None and self.positive_label not in target.domain:
            raise ValueError(f"positive_label {self.positive_label!r} is not in the target's domain {target.domain}")
        if self.positive_label is not None and target.domain is not None and len(target.domain) > 2:
            raise ValueError(
                f"positive_label applies to a binary target; {self.target!r} has {len(target.domain)} classes "
                f"{target.domain} (its roc_auc, pr_auc and f1 are macro averages over them)"
            )
        self.source.check_columns(self.columns, self.target)
        if not self.features:
            raise ValueError("columns must declare at least one feature besides the target")
        if self.max_rows is not None and self.max_rows < self.min_rows:
            raise ValueError(f"max_rows {self.max_rows} is below min_rows {self.min_rows}")
        if self.model.task == "gbt" and self.distribution.world_size != 1:
            raise ValueError(
                f"distribution: task 'gbt' trains in one process; got world size {self.distribution.world_size} "
                "(leave distribution unset)"
            )
        if self.model.gbt_metrics and self.promotion.metric not in self.model.gbt_metrics:
            raise ValueError(
                f"promotion.metric {self.promotion.metric!r} is not reported by this gbt model; use one of "
                f"{[m for m in self.model.gbt_metrics if m.startswith('test_')]}"
            )
        if self.task is not None:
            check_task(self.task, self.target, self.columns[self.target].dtype, self.model.task, self.model.monitor,
                       self.model.monitor_mode, self.promotion.metric, self.model.hparams)
        self.search.check_objectives(self.model.monitor)
        overlap = set(self.search.params) & set(self.model.hparams)
        if overlap:
            raise ValueError(
                f"search.params and model.hparams both set {sorted(overlap)}; a parameter is either searched or fixed"
            )
        return self

    def _consistent_shards(self) -> "PipelineSpec":
        assert self.shards is not None
        if self.columns or self.target:
            raise ValueError(
                f"a sharded pipeline ({self.shards.kind}) declares no columns or target: its kind fixes them "
                f"(model input {self.features[0]!r}, target {self.target_name!r})"
            )
        if self.model.task != "lightning":
            raise ValueError(
                f"model.task {self.model.task!r} trains on tables; a sharded pipeline trains a Lightning model"
            )
        expected = "causal_lm" if isinstance(self.shards, TextShards) else "classification"
        if self.task != expected:
            raise ValueError(f"task {self.task!r} does not fit shards of kind {self.shards.kind!r}; use {expected!r}")
        if self.positive_label is not None or self.suite is not None or self.preprocessing != Preprocessing():
            raise ValueError(
                "positive_label, suite and preprocessing apply to tables; a sharded pipeline leaves them unset"
            )
        check_task(self.task, self.target_name, "int", self.model.task, self.model.monitor, self.model.monitor_mode,
                   self.promotion.metric, self.model.hparams)
        self.search.check_objectives(self.model.monitor)
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
    def target_name(self) -> str:
        """The target: the declared column, or the one a shard kind fixes (`tokens`, `label`)."""
        if isinstance(self.shards, TextShards):
            return TEXT_TARGET
        if isinstance(self.shards, ImageShards):
            return IMAGE_TARGET
        return self.target

    @property
    def gpu_pool(self) -> str:
        """The Dagster pool of this team's trial steps; its limit is `TeamSpec.gpu_pool_limit` (set by `trainyard
        init`)."""
        return f"{self.team}_gpu"

    @property
    def retrain_policy(self) -> RetrainPolicy:
        """`retrain`, or the platform default (retrain when new landing data arrives)."""
        return self.retrain if self.retrain is not None else RetrainPolicy()

    @property
    def features(self) -> list[str]:
        """The columns the model is trained on: role `feature`, the target excepted (a shard kind's one input)."""
        if self.shards is not None:
            return [TEXT_FEATURE if isinstance(self.shards, TextShards) else IMAGE_FEATURE]
        return [c for c, col in self.columns.items() if c != self.target and col.role == "feature"]

    @property
    def keep_columns(self) -> list[str]:
        """The id and timestamp columns: kept with the data and returned with predictions, never trained on."""
        return [c for c, col in self.columns.items() if col.role in ("id", "timestamp")]

    @property
    def stored_columns(self) -> dict[str, ColumnSpec]:
        """The declared columns the canonical data holds: every one but those with role `ignore`, in declared order."""
        return {c: col for c, col in self.columns.items() if col.role != "ignore"}

    @property
    def model_name(self) -> str:
        """Registered model name in the registry."""
        return f"{self.team}.{self.name}"

    def fingerprint(self) -> str:
        """Hash of everything that changes what a trial trains (not the data)."""
        payload = self.model_dump(
            mode="json", include={"columns", "target", "split", "model", "search", "distribution"}
        )
        # The shuffled split hashes as it did before `method` existed, so versions split that way keep their split ids
        # and studies.
        if payload["split"]["method"] == "shuffle":
            payload["split"].pop("method")
        # Fields added after studies existed enter the hash only when set away from their default: old studies resume.
        if self.preprocessing != Preprocessing():
            payload["preprocessing"] = self.preprocessing.model_dump(mode="json")
        if self.positive_label is not None:
            payload["positive_label"] = self.positive_label
        for column in payload["columns"].values():
            if column.get("role") == "feature":
                column.pop("role")
        if payload["model"].get("class_weight") is None:
            payload["model"].pop("class_weight", None)
        # A node range says where a gang may continue after losing nodes, not what it trains: the same study resumes.
        payload["distribution"].pop("min_nodes", None)
        # How a sweep is run (budget, pace, stop rules, pick) does not change its trials: the same study resumes.
        payload["search"] = self.search.model_dump(mode="json", exclude=set(SWEEP_CONTROL_FIELDS))
        if self.shards is not None:
            payload["shards"] = self.shards.model_dump(mode="json")
            payload["task"] = self.task
        elif self.task != infer_task(self.columns[self.target].dtype):
            payload["task"] = self.task  # only a declared task that overrides the target's dtype changes the trials
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]
