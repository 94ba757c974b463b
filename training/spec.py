"""The contract between the orchestrator and a training process.

`TrainSpec` is the only object that crosses the boundary between orchestration
(`assets`, `resources`, `pipelines`) and the pod side (`training`). It is plain
pydantic over the standard library, so both sides can import it without pulling
in Dagster or torch, and it serialises to JSON that is written next to the
trial's checkpoints.

Example:
    >>> spec = TrainSpec(
    ...     pipeline="vision/digits", trial_id="trial-0000", task="lightning",
    ...     model=ImportTarget(path="pipelines.vision.models:DigitsMLP"),
    ...     data=DataSpec(train_uri="/d/train.parquet", val_uri="/d/val.parquet",
    ...                   test_uri="/d/test.parquet", features=["a"], target="y",
    ...                   version="abc"),
    ...     output_uri="/runs/trial-0000",
    ... )
    >>> TrainSpec.model_validate_json(spec.model_dump_json()) == spec
    True
"""

from __future__ import annotations

import os
import re
from typing import Any, Literal, Mapping, Optional

from pydantic import Field, field_validator, model_validator

from training.spec_policies import HANG_ACTION_SECONDS, CheckpointPolicy, FaultInjection, WatchdogPolicy  # noqa: F401  (re-exported)
from training.spec_policies import StrictModel as _Strict
from training.urls import SECRET_PARAMS, redact_url, same_database, strip_url_credentials, url_has_credentials  # noqa: F401

# Exit statuses of `python -m training.entrypoint`. Launchers map them to
# retryable or terminal errors; the Kubernetes podFailurePolicy fails a Job at
# once on EXIT_BAD_CONFIG instead of retrying a spec that can never work.
EXIT_OK = 0
EXIT_USER_ERROR = 1  # an exception raised by model or data module code
EXIT_BAD_CONFIG = 78  # EX_CONFIG: the spec cannot work (bad import path, bad hparams)
EXIT_PREEMPTED = 143  # 128 + SIGTERM: stopped on request after a checkpoint
EXIT_INFRA = 75  # EX_TEMPFAIL: storage or another dependency failed; a retry may succeed

LAUNCH_ID_ENV = "TRAINYARD_LAUNCH_ID"  # set by launchers, one value per launch
# A listening socket rank 0's TCPStore serves instead of binding MASTER_PORT itself (set by the warm supervisor).
STORE_LISTEN_FD_ENV = "TRAINYARD_STORE_LISTEN_FD"
WANDB_SERVICE_ENV = (
    "WANDB_SERVICE"  # W&B's own variable naming a running service to connect to (a warm server's shared one)
)
# glibc malloc settings every launcher gives a training process unless its environment sets them. By default glibc
# serves a large block (a 10 MB activation, gradient or optimizer temporary) with a fresh mmap, unmaps it when it is
# freed, and keeps adapting its thresholds (and trimming the heap) as it goes, so a step that allocates and frees the
# same large tensors again every step can fault tens of thousands of fresh, zeroed pages a second, and how many
# depends on each process's allocation history. On the 10M-parameter benchmark (`bench/overhead.py`) a rank faulted
# 13k-172k pages/s and stepped in 119-134 ms; with these settings ~1k pages/s and ~109 ms, bare Lightning alike. Fixed
# thresholds keep freed blocks up to 32 MB (glibc's most) in the heap and never trim it below 4 GB of free space: a
# training process holds on to its peak memory, as jemalloc or tcmalloc would.
TRAINING_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(4 * 2**30)}
# The thread counts the OpenMP and BLAS runtimes (and numexpr) read when they load, each library its own first
# (OpenBLAS: OPENBLAS_NUM_THREADS, GOTO_NUM_THREADS, then OMP_NUM_THREADS; MKL: MKL_NUM_THREADS, then OMP_NUM_THREADS).
# A warm server starts with one of each; the entrypoint applies the launch's (`training.threads.apply_thread_counts`).
THREAD_COUNT_ENV = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "GOTO_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)
OPTUNA_URL_ENV = "TRAINYARD_OPTUNA_URL"  # the Optuna storage URL with its credentials, in the pod's environment
RESULT_FILE = "result.json"
SPEC_FILE = "spec.json"
FAILURE_DIR = "failures"
# Pipes message params key naming the store folder rank 0 writes message chunks to (training.pipes_store)
PIPES_STORE_KEY = "trainyard_store_uri"
ATTEMPTS_DIR = "attempts"
# The pod-side agent's reports of hung ranks and stragglers under a trial directory, one JSON file an event
# (`training.watchdog`); the orchestrator shows them in the Dagster run (docs/operations.md, "Hung and slow ranks").
WATCHDOG_DIR = "watchdog"
# A local directory `training.gang` names to its workers: each rank's progress record and its stack dumps.
PROGRESS_DIR_ENV = "TRAINYARD_PROGRESS_DIR"
CHECKPOINT_DIR = "checkpoints"

PredictionTask = Literal["classification", "regression", "causal_lm"]
"""What a model predicts: a class label per row, a number per row, or the next token of a text (see docs/tasks.md)."""
# LightGBM objectives by the task they train; the orchestrator checks a declared objective against the pipeline's task.
CLASSIFICATION_OBJECTIVES = ("binary", "multiclass", "multiclassova")
REGRESSION_OBJECTIVES = (
    "regression",
    "regression_l1",
    "huber",
    "fair",
    "poisson",
    "quantile",
    "mape",
    "gamma",
    "tweedie",
)

_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$")


class ImportTarget(_Strict):
    """A class named by import path (`package.module:Class`) and its keyword arguments."""

    path: str
    kwargs: dict[str, Any] = Field(default_factory=dict)

    @field_validator("path")
    @classmethod
    def _check_path(cls, v: str) -> str:
        if not _IMPORT_PATH.match(v):
            raise ValueError(
                f"import path {v!r} is malformed; expected 'package.module:ClassName'"
            )
        return v


FeatureDtype = Literal["int", "float", "str", "bool", "category", "date", "datetime"]
"""A column's declared dtype (`trainyard.spec.ColumnSpec.dtype`), as the pod sees it."""


class DataSpec(_Strict):
    """Where the split data lives, what version it is, and what each column is.

    `features` are the raw columns the model is trained on (ids, timestamps and
    ignored columns are never among them); `feature_types` their declared dtypes
    (empty, as in specs written before the field: every feature is numeric);
    `domains` the closed domains declared for categorical features; `keep` the id
    and timestamp columns carried next to the features and returned with every
    prediction, never trained on.
    """

    train_uri: str
    val_uri: str
    test_uri: str
    features: list[str]
    target: str
    version: str = Field(description="DVC md5 of the raw snapshot the split came from")
    feature_types: dict[str, FeatureDtype] = Field(default_factory=dict)
    domains: dict[str, list[Any]] = Field(default_factory=dict)
    keep: list[str] = Field(default_factory=list)
    positive_label: Optional[Any] = Field(
        None,
        description="the positive class of a binary target (None: the second of the sorted labels, e.g. 1, True or "
                    "'yes')",
    )

    @field_validator("features")
    @classmethod
    def _non_empty(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("features must name at least one column")
        return v


class Distribution(_Strict):
    """How many processes train and how the model is spread over them.

    - `ddp`: every rank holds the whole model (tensor_parallel_size must be 1).
    - `fsdp`: parameters, gradients and optimizer state sharded over all ranks (FSDP2).
    - `tp`: tensor parallel over groups of `tensor_parallel_size` ranks, FSDP2 over
      the remaining `world_size / tensor_parallel_size` (2-D when both exceed 1).
    - `auto`: a pipeline-level choice only. The orchestrator's capacity planner
      (`trainyard.planner.plan_trial`) replaces it, per trial and before launch,
      by the cheapest of the above whose per-device memory fits (and picks
      `tensor_parallel_size`, so leave it at 1). A `TrainSpec` never holds `auto`.
    On GPUs one process drives one device, so devices per node = procs_per_node.

    A node range (`nodes=4, min_nodes=2`) lets a multi-node gang continue smaller
    when it loses a node that cannot be replaced, and grow back when capacity
    returns (on Kubernetes: "Node lost: continue smaller, grow back" in
    docs/kubernetes.md). `min_nodes` None is `nodes`: a fixed size. Every size in
    the range must keep the mesh valid.
    """

    nodes: int = Field(1, ge=1)
    min_nodes: Optional[int] = Field(
        None, ge=1, description="fewest nodes the gang may continue on after losing nodes (None: nodes, a fixed size)")
    procs_per_node: int = Field(1, ge=1)
    strategy: Literal["ddp", "fsdp", "tp", "auto"] = "ddp"
    tensor_parallel_size: int = Field(1, ge=1)
    accelerator: Literal["cpu", "gpu"] = "cpu"
    # In-job restarts: a lost worker (OOM kill, a node hiccup) comes back in seconds from
    # the newest committed checkpoint, where a new launch costs a new run and pod start.
    # Two, not more: a worker that keeps dying is better retried on fresh infrastructure,
    # and a restarted group that finds a config/user failure of its launch exits at once.
    max_restarts: int = Field(2, ge=0, description="torchrun restarts of the worker group before the launch fails")

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.tensor_parallel_size

    @property
    def smallest(self) -> int:
        """The fewest nodes the gang may run on: `min_nodes`, or `nodes` for a fixed size."""
        return self.nodes if self.min_nodes is None else self.min_nodes

    @property
    def elastic(self) -> bool:
        """Whether the gang may change size (its node range holds more than one size)."""
        return self.smallest < self.nodes

    def at_nodes(self, nodes: int) -> "Distribution":
        """This distribution on `nodes` nodes of its range (the range itself kept).

        Raises:
            ValueError: `nodes` is outside [`smallest`, `nodes`].
        """
        if not self.smallest <= nodes <= self.nodes:
            raise ValueError(f"nodes={nodes} is outside the range [{self.smallest}, {self.nodes}] of this distribution")
        return self.model_copy(update={"nodes": nodes})

    @model_validator(mode="after")
    def _mesh_fits(self) -> "Distribution":
        tp = self.tensor_parallel_size
        if self.strategy == "auto" and tp != 1:
            raise ValueError(
                f"tensor_parallel_size={tp} with strategy 'auto': the planner picks the size; leave it at 1"
            )
        if self.strategy in ("ddp", "fsdp") and tp != 1:
            raise ValueError(f"tensor_parallel_size={tp} needs strategy 'tp'; strategy {self.strategy!r} takes 1")
        if self.min_nodes is not None and self.min_nodes > self.nodes:
            raise ValueError(
                f"min_nodes={self.min_nodes} is above nodes={self.nodes}; accepted: 1 <= min_nodes <= nodes"
            )
        if self.strategy == "tp":
            if tp < 2:
                raise ValueError("strategy 'tp' needs tensor_parallel_size >= 2")
            if self.world_size % tp:
                raise ValueError(
                    f"tensor_parallel_size={tp} does not divide world size {self.world_size} "
                    f"({self.nodes} nodes x {self.procs_per_node} processes); mesh sizes must multiply to the world "
                    "size"
                )
            bad = [n for n in range(self.smallest, self.nodes) if (n * self.procs_per_node) % tp]
            if bad:
                raise ValueError(
                    f"tensor_parallel_size={tp} does not divide the world size at {bad[0]} nodes "
                    f"({bad[0] * self.procs_per_node} "
                    f"processes) of the node range [{self.smallest}, {self.nodes}]; every size in the range must keep "
                    "the mesh "
                    "valid: raise min_nodes, or pick a tensor_parallel_size that divides "
                    f"procs_per_node={self.procs_per_node}"
                )
        return self


class TrackerSpec(_Strict):
    """Experiment tracking settings handed to the pod (W&B)."""

    kind: Literal["wandb", "none"] = "wandb"
    mode: Literal["offline", "online", "disabled"] = "offline"
    project: str = "trainyard"
    entity: Optional[str] = None
    group: Optional[str] = None
    name: Optional[str] = None
    dir: Optional[str] = None
    config: dict[str, Any] = Field(default_factory=dict, description="lineage record")


class PrunerSpec(_Strict):
    """How a sweep stops unpromising trials early (an Optuna pruner).

    A trial reports its monitored metric once per epoch (the step is the epoch
    number); rank 0 asks the pruner and every rank stops together.

    - `none`: every trial runs to `max_epochs`.
    - `median`: stop a trial whose best value so far is worse than the median of
      the completed trials at the same epoch, once `n_startup_trials` trials
      completed and after `n_warmup_steps` epochs, checked every `interval_steps`.
    - `successive_halving`: asynchronous successive halving: at epochs
      `min_resource * reduction_factor**k` only the top `1/reduction_factor` go on.
    - `hyperband`: several successive-halving brackets between `min_resource`
      and `max_resource` epochs (None: the trial's `max_epochs`).
    - `threshold`: stop when the value leaves `[lower, upper]` after
      `n_warmup_steps` epochs; deterministic, and catches diverging runs.

    Example:
        >>> PrunerSpec(kind="median", n_startup_trials=3, n_warmup_steps=2).enabled
        True
    """

    kind: Literal["none", "median", "successive_halving", "hyperband", "threshold"] = "none"
    n_startup_trials: int = Field(5, ge=0)
    n_warmup_steps: int = Field(0, ge=0)
    interval_steps: int = Field(1, ge=1)
    min_resource: int = Field(1, ge=1)
    max_resource: Optional[int] = Field(None, ge=1)
    reduction_factor: int = Field(3, ge=2)
    lower: Optional[float] = None
    upper: Optional[float] = None

    @model_validator(mode="after")
    def _settings_fit(self) -> "PrunerSpec":
        if self.kind == "threshold":
            if self.lower is None and self.upper is None:
                raise ValueError(
                    "pruner 'threshold' needs lower or upper (or both), e.g. PrunerSpec(kind='threshold', lower=0.2)"
                )
            if self.lower is not None and self.upper is not None and not self.lower < self.upper:
                raise ValueError(f"pruner 'threshold': lower {self.lower} must be below upper {self.upper}")
        elif self.lower is not None or self.upper is not None:
            raise ValueError(f"lower/upper apply to pruner 'threshold' only; this pruner is {self.kind!r}")
        if self.kind == "hyperband" and self.max_resource is not None and self.max_resource <= self.min_resource:
            raise ValueError(
                f"pruner 'hyperband': max_resource {self.max_resource} must exceed min_resource {self.min_resource}"
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.kind != "none"


# -- credentials in URLs: `training.urls`, re-exported above (callers import them from here) ------

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class OptunaSpec(_Strict):
    """The Optuna trial this run belongs to, and how it is pruned.

    With an enabled `pruner`, rank 0 reports `report_metric` (default: the
    spec's `monitor`) after every validation and the run stops early when the
    pruner says so; the trial then ends PRUNED and `result.json` says `pruned`.

    Credentials only by reference: `storage_url` never carries a password (the
    spec is a file in the object store). A storage that needs one names the
    environment variable that holds the full URL (`storage_url_env`, made by
    `by_reference`); the pod reads it there (`connect_url`): on Kubernetes from
    a Secret of the team's `env_from_secrets`, locally from the launcher.
    """

    storage_url: str = Field(description="the study's storage, without credentials")
    storage_url_env: Optional[str] = Field(
        None, description="environment variable holding `storage_url` with its credentials"
    )
    study_name: str
    trial_number: int = Field(ge=0)
    pruner: PrunerSpec = PrunerSpec()
    report_metric: Optional[str] = None

    @field_validator("storage_url")
    @classmethod
    def _no_credentials(cls, v: str) -> str:
        if url_has_credentials(v):
            raise ValueError(
                f"storage_url {redact_url(v)!r} carries a credential, and a spec file never holds one; "
                f"give the URL without it and name the environment variable holding the full URL in storage_url_env "
                f"(OptunaSpec.by_reference does both)"
            )
        return v

    @field_validator("storage_url_env")
    @classmethod
    def _env_name(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not _ENV_NAME.match(v):
            raise ValueError(
                f"storage_url_env {v!r} is not an environment variable name; use letters, digits and '_' (e.g. "
                f"{OPTUNA_URL_ENV!r})"
            )
        return v

    @classmethod
    def by_reference(cls, url: str, env: str = OPTUNA_URL_ENV, **fields: Any) -> "OptunaSpec":
        """The spec of a trial in storage `url`: `url` without credentials, and `env` named when it had some."""
        stripped = strip_url_credentials(url)
        return cls(storage_url=stripped, storage_url_env=env if stripped != url else None, **fields)

    def connect_url(self, environ: Optional[Mapping[str, str]] = None) -> str:
        """The URL to connect with: `storage_url`, or the full URL from `storage_url_env` (`environ`, default
        `os.environ`).

        Raises:
            ValueError: the variable is not set, or names another database than `storage_url`.
        """
        if self.storage_url_env is None:
            return self.storage_url
        value = (os.environ if environ is None else environ).get(self.storage_url_env)
        if not value:
            raise ValueError(
                f"the Optuna storage {self.storage_url} needs its credentials from the environment variable "
                f"{self.storage_url_env}, which this process does not have: on Kubernetes, put the full URL under "
                "that key "
                "in a Secret listed in the team's env_from_secrets; a local launch sets it from the SweepStore resource"
            )
        if not same_database(value, self.storage_url):
            raise ValueError(
                f"{self.storage_url_env} points to {redact_url(value)}, but the trial's study is in "
                f"{self.storage_url}; "
                f"set {self.storage_url_env} to the orchestrator's Optuna storage"
            )
        return value


class Preprocessing(_Strict):
    """The preprocessing the platform owns (`training.preprocessing`): fitted on the train split only,
    saved with the trial and inside the registered model, so serving takes the raw columns.

    - numeric (`int`, `float`, `bool`) features: for Lightning, missing values imputed
      with the train median (`impute`), plus a 0/1 indicator column per feature that
      had missing values (`missing_indicators`), and standardised to zero mean and
      unit variance (`scale`); LightGBM keeps NaN (its own missing-value handling)
      and is never scaled;
    - categorical (`str`, `category`) features: a vocabulary of the train split's
      `max_categories` most frequent values; anything else (an unseen category at
      serving, a missing value) is its own "other" level. LightGBM gets integer
      codes as native categorical features; Lightning models get one-hot columns
      (`categorical="onehot"`) or the codes as floats (`"index"`);
    - `date` / `datetime` features: the parts in `date_parts` (year, month, day,
      day of week, day of year; and hour, in UTC, for `datetime` only) as numeric features.

    `enabled=False` hands the raw columns to the model as numbers: a string, date
    or missing value then fails before compute, naming the column. A table whose
    features are all numeric and complete in every split reaches the model unchanged
    (no scaling), so pipelines written before preprocessing existed train as before.
    """

    enabled: bool = True
    impute: Literal["median", "mean", "zero"] = "median"
    missing_indicators: bool = True
    scale: bool = True
    categorical: Literal["onehot", "index"] = "onehot"
    max_categories: int = Field(50, ge=1, le=10_000)
    date_parts: tuple[Literal["year", "month", "day", "dayofweek", "dayofyear", "hour"], ...] = (
        "year", "month", "day", "dayofweek", "dayofyear", "hour")


class TrainSpec(_Strict):
    """Everything a training process needs; JSON-serialisable."""

    pipeline: str = Field(description="'<team>/<pipeline>'")
    trial_id: str
    task: Literal["lightning", "gbt"] = "lightning"
    prediction_task: Optional[PredictionTask] = Field(
        None,
        description="classification or regression (the pipeline's `task`; `task` above names the trainer). "
        "None, as in specs written before the field: lightning trials classify, gbt trials infer it from the target "
        "column",
    )
    model: ImportTarget
    datamodule: ImportTarget = ImportTarget(path="training.data:ParquetDataModule")
    data: DataSpec
    output_uri: str = Field(description="trial directory: spec, result, checkpoints, model")
    max_epochs: int = Field(10, ge=1)
    batch_size: int = Field(64, ge=1)
    limit_train_batches: Optional[int] = Field(None, ge=1)
    log_every_n_steps: int = Field(50, ge=1, description="metric logging interval of the tracker")
    monitor: str = "val_acc"
    monitor_mode: Literal["max", "min"] = "max"
    distribution: Distribution = Distribution()
    seed: int = 0
    deterministic: bool = True
    precision: Literal["32-true", "bf16-mixed", "16-mixed"] = "32-true"
    tracker: TrackerSpec = TrackerSpec(kind="none")
    optuna: Optional[OptunaSpec] = None
    checkpoint: CheckpointPolicy = CheckpointPolicy()
    faults: FaultInjection = FaultInjection()
    lineage: dict[str, Any] = Field(default_factory=dict)
    preprocessing: Preprocessing = Preprocessing()
    class_weight: Optional[Literal["balanced"]] = Field(
        None,
        description="'balanced': each class weighs n_rows / (n_classes * its rows) in the training loss (gbt: sample "
                    "weights; "
        "lightning: a `class_weights` tensor for a model whose constructor takes one)",
    )

    @field_validator("pipeline")
    @classmethod
    def _pipeline_name(cls, v: str) -> str:
        if not re.match(r"^[a-z0-9][a-z0-9_-]*/[a-z0-9][a-z0-9_-]*$", v):
            raise ValueError(
                f"pipeline {v!r} must be '<team>/<name>' in lowercase letters, digits, '-' or '_'"
            )
        return v

    @model_validator(mode="after")
    def _strategy_fits(self) -> "TrainSpec":
        if self.distribution.strategy == "auto":
            raise ValueError(
                "distribution.strategy 'auto' must be resolved by trainyard.planner.plan_trial before launch; "
                "a TrainSpec takes 'ddp', 'fsdp' or 'tp'"
            )
        if self.task == "gbt" and self.distribution.world_size != 1:
            raise ValueError(
                f"distribution: gbt tasks run in one process, got world size {self.distribution.world_size}"
            )
        return self

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    @classmethod
    def from_json(cls, text: str) -> "TrainSpec":
        return cls.model_validate_json(text)


class TrainResult(_Strict):
    """What a finished training process writes to `<output_uri>/result.json`."""

    trial_id: str
    status: Literal["completed", "pruned"] = Field(
        "completed", description="pruned: stopped early by the sweep's pruner"
    )
    metrics: dict[str, float]
    best_metric: float
    epochs: int
    global_step: int
    train_samples: int
    fit_seconds: float
    samples_per_second: float
    wall_seconds: float
    world_size: int
    device_hours: float
    model_uri: str = Field(description="directory holding the exported serving model")
    checkpoint_uri: Optional[str] = None
    tracker_run: Optional[str] = None
    lineage: dict[str, Any] = Field(default_factory=dict)
    resumed_from: Optional[str] = Field(None, description="checkpoint the last attempt resumed from")
    checkpoint_interval_seconds: Optional[float] = None
    checkpoint_interval_source: Optional[str] = None
    goodput: dict[str, Any] = Field(default_factory=dict)
    finish_seconds: dict[str, float] = Field(
        default_factory=dict, description="rank 0's time after the last step: load_best, evaluate, export (seconds)"
    )
    watchdog: dict[str, Any] = Field(
        default_factory=dict,
        description="what the pod-side agents found (hung ranks, stragglers, `avoid_nodes`); set by the orchestrator",
    )
