"""Planning one trial: the capacity model (`trainyard.capacity`) applied to a pipeline's real model.

`plan_trial` counts the parameters of the trial's model (built on the meta
device), takes the device count from the distribution and device memory from
`device_memory`, resolves `Distribution(strategy="auto")` to a concrete
strategy before the `TrainSpec` is built, checks a fixed strategy (a warning
when it does not fit), and gives the trial_model asset its metadata (table and
reasoning).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, Optional, TypedDict

from common.settings import settings
from training.spec import Distribution
from trainyard.capacity import (
    GIB,
    MemoryEstimate,
    NothingFitsError,
    Optimizer,
    Plan,
    Sizing,
    Strategy,
    TransformerShape,
    bytes_per_param,
    memory_per_device,
    plan,
)
from trainyard.metadata import Markdown
from trainyard.shardspec import ImageShards

if TYPE_CHECKING:
    from trainyard.spec import PipelineSpec


# --- Planning a trial: the estimates above applied to a pipeline's real model ---

DEVICE_MEMORY_ENV = "TRAINYARD_DEVICE_MEMORY_GB"
DEFAULT_GPU_MEMORY_GB = 79.6  # H100 80GB, as nvidia-smi reports it
PRECISION_BYTES: dict[str, int] = {"32-true": 4, "bf16-mixed": 2, "16-mixed": 2}
_QUANTITY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


@dataclass(frozen=True)
class TrialPlan:
    """The distribution one trial launches with, and the estimates and reasoning behind it.

    Attributes:
        distribution: what the TrainSpec gets; never 'auto' unless `error` is set.
        chosen_by: "planner" (the pipeline declared strategy 'auto'), "user" (a fixed
            strategy, only checked) or "skipped" (gbt: one LightGBM process, nothing to plan).
        reasoning: one paragraph a person reads in the UI.
        params: parameters of the model as instantiated with the trial's hyperparameters.
        estimates: per-device memory of every strategy (all tensor parallel sizes).
        usable_gb: the part of `device_memory_gb` an estimate may use.
        warnings: lines for the run log (a fixed strategy the planner says does not fit).
        error: why 'auto' cannot be resolved (nothing fits, or the model cannot shard);
            the trial must not launch.
    """

    distribution: Distribution
    chosen_by: Literal["planner", "user", "skipped"]
    reasoning: str
    params: int = 0
    dtype_bytes: int = 4
    optimizer: Optimizer = "adam"
    device_memory_gb: float = 0.0
    device_memory_source: str = ""
    usable_gb: float = 0.0
    estimates: tuple[MemoryEstimate, ...] = ()
    warnings: tuple[str, ...] = ()
    error: Optional[str] = None

    @property
    def strategy_label(self) -> str:
        d = self.distribution
        if self.chosen_by == "skipped":
            return "none (one process)"
        return f"tp (tensor_parallel_size={d.tensor_parallel_size})" if d.strategy == "tp" else d.strategy

    def table_markdown(self) -> str:
        """Per-device memory of each strategy: weights, gradients, optimizer states, buffers, activations, total vs
        usable."""
        if not self.estimates:
            return ""
        per = bytes_per_param(self.dtype_bytes, self.optimizer)
        head = ("| strategy | params | grads | optimizer | buffers | activations | total | usable | fits |\n"
                "|---|---:|---:|---:|---:|---:|---:|---:|---|\n")
        rows = []
        for e in self.estimates:
            share = e.model_states_gb / per  # GiB per byte-per-parameter of model state
            name = _label(e)
            if (e.strategy, e.tensor_parallel_size) == (
                self.distribution.strategy,
                self.distribution.tensor_parallel_size,
            ):
                name = f"**{name}** ({'chosen' if self.chosen_by == 'planner' else 'fixed'})"
            cells = [name, _size(share * self.dtype_bytes), _size(share * self.dtype_bytes),
                     _size(share * (per - 2 * self.dtype_bytes)), _size(e.buffers_gb), _size(e.activations_gb),
                     _size(e.total_gb), _size(self.usable_gb), "yes" if e.total_gb <= self.usable_gb else "no"]
            rows.append("| " + " | ".join(cells) + " |")
        return head + "\n".join(rows)

    def metadata(self) -> dict[str, Any]:
        """Metadata of the trial_model asset; markdown values are `Markdown` (rendered by the asset layer)."""
        meta: dict[str, Any] = {
            "strategy": self.strategy_label,
            "strategy_chosen_by": self.chosen_by,
            "plan_reasoning": Markdown(self.reasoning),
        }
        if self.estimates:
            meta.update({
                "plan": Markdown(self.table_markdown()),
                "model_params": self.params,
                "usable_device_memory_gb": round(self.usable_gb, 3),
                "device_memory_source": self.device_memory_source,
            })
        if self.warnings:
            meta["plan_warning"] = " ".join(self.warnings)
        return meta


def _label(e: MemoryEstimate) -> str:
    return f"fsdp x tp (tp={e.tensor_parallel_size})" if e.strategy == "tp" else e.strategy


def _size(gib: float) -> str:
    """A GiB amount in the unit that keeps it readable (a digits MLP is kilobytes, a 70B model terabytes)."""
    if gib == 0:
        return "0"
    if gib >= 1:
        return f"{gib:,.1f} GiB"
    if gib * 1024 >= 1:
        return f"{gib * 1024:.1f} MiB"
    return f"{gib * 1024 * 1024:.1f} KiB"


def device_memory(
    distribution: Distribution, launcher: Any = None, environ: Optional[Mapping[str, str]] = None
) -> tuple[float, str]:
    """Memory of one device (GPU, or one CPU process's share of its machine) in GiB, and where the number came from.

    First that applies: the `TRAINYARD_DEVICE_MEMORY_GB` environment variable; a
    `device_memory_gb` field of the launcher; on GPU, 79.6 (an H100 80GB); on CPU,
    the launcher's pod memory (`memory_limit`, else `memory`, as on
    `KubernetesLauncher`) or else this machine's RAM, shared by `procs_per_node` processes.
    """
    value = settings(environ).device_memory_gb  # a bad value: common.settings.SettingsError, a ValueError naming it
    if value is not None:
        return value, f"{DEVICE_MEMORY_ENV}={value:g}"
    declared = getattr(launcher, "device_memory_gb", None)
    if declared:
        return float(declared), f"{type(launcher).__name__}.device_memory_gb"
    procs = distribution.procs_per_node
    if distribution.accelerator == "gpu":
        return DEFAULT_GPU_MEMORY_GB, f"default for GPUs (H100 80GB); set {DEVICE_MEMORY_ENV} for others"
    pod = getattr(launcher, "memory_limit", None) or getattr(launcher, "memory", None)
    if isinstance(pod, str):
        return quantity_gib(pod) / procs, f"{type(launcher).__name__} pod memory {pod} / {procs} process(es) per pod"
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    return host / procs, f"host RAM {host:.1f} GiB / {procs} process(es)"


def quantity_gib(quantity: str) -> float:
    """A Kubernetes memory quantity ('16Gi', '8G', '512Mi', '1e9') in GiB."""
    for suffix in sorted(_QUANTITY, key=len, reverse=True):
        if quantity.endswith(suffix):
            return float(quantity[: -len(suffix)]) * _QUANTITY[suffix] / GIB
    return float(quantity) / GIB


class _TrialInputs(TypedDict):
    """The `TrialPlan` fields `plan_distribution` fills in whatever the strategy."""

    params: int
    dtype_bytes: int
    optimizer: Optimizer
    device_memory_gb: float
    device_memory_source: str
    usable_gb: float
    estimates: tuple[MemoryEstimate, ...]


def plan_distribution(
    distribution: Distribution,
    params: int,
    dtype_bytes: int,
    device_memory_gb: float,
    optimizer: Optimizer = "adam",
    *,
    activation_gb: Optional[float] = None,
    shape: Optional[TransformerShape] = None,
    fsdp_units: Optional[int] = None,
    usable_fraction: float = 0.9,
    device_memory_source: str = "",
) -> TrialPlan:
    """Resolve strategy 'auto' to the cheapest strategy that fits, or check a fixed one; pure Python.

    Devices are the distribution's world size (one process drives one device),
    spread over `nodes`. A fixed strategy is kept even when it does not fit (the
    estimate may be pessimistic): the plan then carries a warning.

    Raises:
        NothingFitsError: strategy is 'auto' and nothing fits; the message names
            `distribution.strategy`, each estimate and how many devices would do.

    Example:
        >>> p = plan_distribution(Distribution(procs_per_node=2, strategy="auto"), params=4_810, dtype_bytes=4,
        ...                       device_memory_gb=16)
        >>> p.distribution.strategy, p.chosen_by
        ('ddp', 'planner')
    """
    devices, nodes = distribution.world_size, distribution.nodes
    common = Sizing(params=params, dtype_bytes=dtype_bytes, optimizer=optimizer, devices=devices,
                     activation_gb=activation_gb, shape=shape, fsdp_units=fsdp_units)
    per_node = devices // nodes
    estimates = [memory_per_device("ddp", **common), memory_per_device("fsdp", **common)]
    estimates += [
        memory_per_device("tp", tensor_parallel_size=t, **common) for t in range(2, per_node + 1) if per_node % t == 0
    ]
    usable = device_memory_gb * usable_fraction
    inputs = _TrialInputs(
        params=params,
        dtype_bytes=dtype_bytes,
        optimizer=optimizer,
        device_memory_gb=device_memory_gb,
        device_memory_source=device_memory_source,
        usable_gb=usable,
        estimates=tuple(estimates),
    )
    facts = (
        f"{params:,} parameters, {dtype_bytes}-byte weights and {optimizer} = "
        f"{bytes_per_param(dtype_bytes, optimizer)} "
        f"bytes per parameter of model state, on {devices} device(s) ({nodes} node(s)) with "
        f"{_size(usable)} usable of {_size(device_memory_gb)} each ({device_memory_source or 'given'})"
    )
    if activation_gb is None and shape is None:
        facts += "; activations not estimated for this model"
    chosen: Optional[Plan] = None
    nothing: Optional[NothingFitsError] = None
    try:
        chosen = plan(usable_fraction=usable_fraction, device_memory_gb=device_memory_gb, nodes=nodes, **common)
    except NothingFitsError as e:
        nothing = e
    if distribution.strategy == "auto":
        return _planner_choice(
            distribution, chosen, nothing, estimates, usable, device_memory_gb, device_memory_source, facts, inputs
        )
    return _user_choice(distribution, distribution.strategy, chosen, estimates, usable, common, facts, inputs)


def _planner_choice(
    distribution: Distribution,
    chosen: Optional[Plan],
    nothing: Optional[NothingFitsError],
    estimates: list[MemoryEstimate],
    usable: float,
    device_memory_gb: float,
    device_memory_source: str,
    facts: str,
    inputs: _TrialInputs,
) -> TrialPlan:
    """Strategy 'auto': the planner's choice (`chosen`), with each strategy it tried in order and why.

    Raises:
        NothingFitsError: nothing fits (`nothing`, the planner's own error, is chained).
    """
    if chosen is None:
        raise NothingFitsError(
            f"distribution.strategy='auto': no strategy fits {_size(usable)} usable per device "
            f"(device memory {device_memory_gb:.1f} GiB from {device_memory_source or 'the caller'}): {nothing}. "
            f"Add devices (distribution.procs_per_node / distribution.nodes), set a larger device memory "
            f"({DEVICE_MEMORY_ENV}), or make the model smaller"
        ) from nothing
    resolved = Distribution(**{**distribution.model_dump(), "strategy": chosen.strategy,
                               "tensor_parallel_size": chosen.tensor_parallel_size})
    steps = []
    for tried in _order(estimates, chosen):
        if tried.total_gb > usable:
            steps.append(f"{_label(tried)} needs {_size(tried.total_gb)} > {_size(usable)}")
        else:
            steps.append(f"{_label(tried)} fits: {_size(tried.total_gb)} of {_size(usable)} usable per device")
    reasoning = ("; ".join(steps) + f". Chosen by the planner as the first that fits in the order ddp, fsdp, fsdp x tp "
                 f"(each step adds communication). Inputs: {facts}.")
    return TrialPlan(resolved, "planner", reasoning, **inputs)


def _user_choice(
    distribution: Distribution,
    strategy: Strategy,
    chosen: Optional[Plan],
    estimates: list[MemoryEstimate],
    usable: float,
    common: Sizing,
    facts: str,
    inputs: _TrialInputs,
) -> TrialPlan:
    """A strategy fixed by the pipeline (`strategy`, the distribution's): kept, with whether it fits and what 'auto'
    would choose;
    a warning when it may not fit."""
    # A fixed tensor parallel size may span nodes, which the planner never tries: estimate it on its own.
    fixed = memory_per_device(strategy, tensor_parallel_size=distribution.tensor_parallel_size, **common)
    if fixed not in estimates:
        estimates.append(fixed)
        inputs["estimates"] = tuple(estimates)
    warnings: tuple[str, ...] = ()
    if fixed.total_gb <= usable:
        reasoning = (
            f"{_label(fixed)} (fixed by the pipeline) fits: {_size(fixed.total_gb)} of {_size(usable)} usable per "
            "device"
        )
        if chosen is not None and (chosen.strategy, chosen.tensor_parallel_size) != (
            fixed.strategy,
            fixed.tensor_parallel_size,
        ):
            reasoning += f"; strategy 'auto' would choose {_label(chosen.estimates[chosen.strategy])}"
    else:
        instead = (
            f"strategy 'auto' would choose {_label(chosen.estimates[chosen.strategy])} "
            f"({_size(chosen.per_device_gb[chosen.strategy])})"
            if chosen is not None
            else "no strategy fits these devices"
        )
        reasoning = (
            f"{_label(fixed)} (fixed by the pipeline) needs {_size(fixed.total_gb)} > {_size(usable)} usable per "
            "device "
            f"and may run out of memory; {instead}"
        )
        warnings = (f"distribution.strategy={distribution.strategy!r} may not fit: {reasoning}",)
    return TrialPlan(distribution, "user", f"{reasoning}. Inputs: {facts}.", warnings=warnings, **inputs)


def _order(estimates: list[MemoryEstimate], chosen: Plan) -> list[MemoryEstimate]:
    """The estimates the planner tried, in its order, up to and including the chosen one."""
    out = []
    for e in estimates:
        out.append(e)
        if (e.strategy, e.tensor_parallel_size) == (chosen.strategy, chosen.tensor_parallel_size):
            break
    return out


@dataclass(frozen=True)
class ModelQuery:
    """The model a trial will build: what a describer instantiates (`training.describe` on the pod side).

    Attributes:
        model: the class's import path, `module:attribute`.
        hparams: its keyword arguments for this trial.
        n_features: filled in when the constructor takes `n_features` and `hparams` does not set it.
        classification: whether `n_classes` is filled in (as `training.lightning_task.build` does).
        n_classes: called only when the constructor takes `n_classes` and `hparams` does not set it.
        data_kwargs: what the data fixes for a constructor that takes it and `hparams` does not set it
            (a text corpus's `vocab_size` and `block_size`: `trainyard.shardspec`).
    """

    model: str
    hparams: dict[str, Any]
    n_features: int
    classification: bool
    n_classes: Callable[[], int]
    data_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelFacts:
    """What the planner needs of a built model.

    Attributes:
        name: the class's name, for messages.
        params: parameters, each shared (tied) one counted once.
        fsdp_units: `len(fsdp_units())` (at least 1) of a model that has the method, else None.
        parallel: it has both `fsdp_units()` and `tensor_parallel_plan()` (a `training.parallel.ParallelizableModule`).
        tp_plan: its `tensor_parallel_plan()` is not empty.
    """

    name: str
    params: int
    fsdp_units: Optional[int] = None
    parallel: bool = False
    tp_plan: bool = False


Describer = Callable[[ModelQuery], ModelFacts]
"""Builds the query's model and tells its facts; raises `TrialPlanError` when the model cannot be built.

The orchestrator imports no pod code, so it never builds the model itself: `resources.model_facts.describe_model`
runs `training.describe` on a warm worker (or in a fresh interpreter)."""


def input_width_bound(spec: PipelineSpec) -> int:
    """The most model inputs the platform's preprocessing can make of the declared features (`training.preprocessing`).

    The exact width is fitted on the train split (a vocabulary, which columns had
    gaps); planning happens before, so it sizes the model for the widest case: a
    one-hot column per kept category plus "other" (`max_categories` for an open
    categorical, its domain for a closed one), the declared date parts (hour for
    datetimes only), and a missing-value indicator per nullable column.
    """
    if isinstance(spec.shards, ImageShards):
        return spec.shards.pixels
    if spec.shards is not None:
        return 1  # a token stream: the model's input is token ids, its width `vocab_size` (ModelQuery.data_kwargs)
    pre = spec.preprocessing
    if not pre.enabled:
        return len(spec.features)
    width = 0
    for name in spec.features:
        column = spec.columns[name]
        if column.categorical:
            width += (
                1
                if pre.categorical == "index"
                else min(pre.max_categories, len(column.domain or ()) or pre.max_categories) + 1
            )
        elif column.dtype in ("date", "datetime"):
            width += len([p for p in pre.date_parts if p != "hour" or column.dtype == "datetime"])
        else:
            width += 1
        if column.nullable and pre.missing_indicators:
            width += 1
    return width


def plan_trial(
    spec: "PipelineSpec",
    hparams: dict[str, Any],
    n_classes: Callable[[], int],
    launcher: Any = None,
    *,
    describe: Describer,
    precision: str = "32-true",
    optimizer: Optimizer = "adam",
    environ: Optional[Mapping[str, str]] = None,
) -> TrialPlan:
    """The plan of one trial of `spec`: its model built with `hparams`, on the launcher's devices.

    The model class is instantiated like the entrypoint does (`n_features` and,
    for classification, `n_classes` filled in when its constructor takes them),
    on torch's meta device so no weights are allocated, by `describe` in a
    process of its own. With strategy 'auto' the chosen strategy must also be
    one the model supports (fsdp and tp: a `training.parallel.ParallelizableModule`,
    recognised by its methods; the pod checks the details again).
    gbt tasks are not planned (one LightGBM process).

    Never raises for a plan that cannot work: it returns one with `error` set
    (the caller fails the trial with it), so the orchestrator decides how to fail.

    Args:
        spec: the pipeline; `distribution` may say 'auto'.
        hparams: the model's keyword arguments for this trial (pipeline hparams and trial params).
        n_classes: called only when the model takes `n_classes` and it is not in `hparams`.
        launcher: the launcher resource; see `device_memory` for what is read from it.
        describe: builds the model and tells its facts (`resources.model_facts.describe_model`).
        precision: `TrainSpec.precision` (weight bytes: 4 for '32-true', 2 for the 16-bit ones).
        optimizer: 'adam' (default) or 'sgd'.
        environ: environment to read `TRAINYARD_DEVICE_MEMORY_GB` from (default `os.environ`).
    """
    dist = spec.distribution
    if spec.model.task == "gbt":
        resolved = dist if dist.strategy != "auto" else Distribution(**{**dist.model_dump(), "strategy": "ddp"})
        return TrialPlan(
            resolved, "skipped", "gbt task: LightGBM trains in one process, there is no distribution to plan."
        )
    if precision not in PRECISION_BYTES:
        raise ValueError(f"precision={precision!r} must be one of {sorted(PRECISION_BYTES)}")
    memory_gb, source = device_memory(dist, launcher, environ)
    chosen_by: Literal["planner", "user"] = "planner" if dist.strategy == "auto" else "user"
    try:
        data_kwargs = spec.shards.model_inputs() if spec.shards is not None else {}
        model = describe(
            ModelQuery(
                spec.model.path,
                dict(hparams),
                input_width_bound(spec),
                spec.task == "classification",
                n_classes,
                data_kwargs,
            )
        )
        result = plan_distribution(dist, model.params, PRECISION_BYTES[precision], memory_gb, optimizer,
                                   fsdp_units=model.fsdp_units, device_memory_source=source)
        if result.chosen_by == "planner":
            _check_supports(model, result.distribution.strategy)
    except (TrialPlanError, NothingFitsError) as e:
        return TrialPlan(dist, chosen_by, f"cannot plan: {e}", error=str(e), device_memory_gb=memory_gb,
                         device_memory_source=source)
    return result


class TrialPlanError(ValueError):
    """A trial's model cannot be built from its hyperparameters, or cannot follow the strategy 'auto' chose."""


def _check_supports(model: ModelFacts, strategy: str) -> None:
    """What `training.strategies.check_model_supports` requires, told by the model's methods (orchestration imports no
    pod code)."""
    if strategy == "ddp":
        return
    if not model.parallel:
        raise TrialPlanError(
            f"distribution.strategy='auto' chose {strategy!r} (ddp does not fit), but model {model.name} does not "
            "support strategy "
            f"{strategy!r}: inherit training.parallel.ParallelizableModule, or add devices so that ddp fits"
        )
    if strategy == "tp" and not model.tp_plan:
        raise TrialPlanError(
            f"distribution.strategy='auto' chose 'tp' (ddp and fsdp do not fit), but model {model.name} does not "
            "support strategy "
            "'tp': tensor_parallel_plan() is empty; return {submodule FQN: ColwiseParallel() | RowwiseParallel()}"
        )


def count_classes(spec: "PipelineSpec", validated_data: dict[str, Any], store: Any) -> int:
    """Distinct target values over the train/val/test splits, as `ParquetDataModule.classes()` counts them.

    Reads the target column with pyarrow alone: a run worker that plans a trial need not import pandas (0.3 s).
    """
    import pyarrow.parquet as pq

    shards = getattr(spec, "shards", None)
    if isinstance(shards, ImageShards):
        return len(shards.labels)  # every image's label is one of them (ingest rejects any other directory)
    seen: set[Any] = set()
    for split in ("train", "val", "test"):
        with store.open(validated_data[split], "rb") as f:
            # ParquetFile.read, not read_table, which imports pandas to look for pandas metadata
            values = pq.ParquetFile(f).read(columns=[spec.target]).column(spec.target).unique().to_pylist()
        # Labels as they are: "yes"/"no", True/False or 0/1 (the pod sorts and indexes them the same way).
        seen.update(v for v in values if v is not None)
    return len(seen)
