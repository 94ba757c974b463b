"""Capacity planning: the cheapest distribution strategy whose per-device memory fits, and what a run costs.

Pure Python (no torch), so the orchestrator can plan before any pod starts.
`plan` estimates memory per device for DDP, FSDP (ZeRO-3 over all devices) and
FSDP x tensor parallel, and picks the first that fits in the order
DDP -> FSDP -> FSDP x TP (smallest tensor parallel size that fits), because each
step down that list adds communication.

`plan_trial` applies it to one trial of a pipeline: it counts the parameters of
the trial's model (built on the meta device), takes the device count from the
distribution and device memory from `device_memory`, resolves
`Distribution(strategy="auto")` to a concrete strategy before the `TrainSpec`
is built, checks a fixed strategy (a warning when it does not fit), and gives
the trial_model asset its metadata (table and reasoning).

Memory model, per device, for N parameters stored in `dtype_bytes`, D devices
and tensor parallel size t (all sizes in GiB = 2**30 bytes):

- model states, bytes per parameter: weights `dtype_bytes` + gradients
  `dtype_bytes` + 4 per fp32 optimizer state (Adam 2: exp_avg, exp_avg_sq;
  SGD without momentum 0) + a 4-byte fp32 master copy when `dtype_bytes < 4`.
  Adam in bf16: 2 + 2 + 8 + 4 = 16 bytes; Adam in fp32: 4 + 4 + 8 = 16.
- DDP: all model states on every device, plus one more gradient-sized copy:
  DDP all-reduces through flat buckets that are separate from `.grad` unless
  `gradient_as_bucket_view=True` (not Lightning's default).
- FSDP: model states / D, plus the gathered working set: FSDP2 unshards one
  unit at a time and prefetches the next, so at most two units' full weights
  and one unit's full gradients (before its reduce-scatter) exist at once:
  (min(2, units) * dtype_bytes + dtype_bytes) * N / units.
- FSDP x TP: model states / D (t-way split inside a node, D/t-way FSDP across),
  the gathered working set / t (only when D/t > 1), activations / t
  (tensor parallel with sequence parallelism shards every activation).
- activations: given (`activation_gb`, per device for one micro-batch without
  tensor parallel) or estimated from a `TransformerShape` with Korthikanti et al.
  2022 ("Reducing Activation Recomputation in Large Transformer Models", eq. 2
  and section 4.2.2): per layer s*b*h*(34 + 5*a*s/h) bytes in 16-bit, the
  5*a*s/h attention-score term dropped with FlashAttention, plus fp32 logits.

A device is "fitting" when the estimate is at most `usable_fraction` of its
memory (default 90%: the CUDA context, NCCL buffers and allocator
fragmentation take the rest).

Example:
    >>> p = plan(params=7_000_000_000, dtype_bytes=2, optimizer="adam", device_memory_gb=79.6,
    ...          devices=8, shape=TransformerShape(layers=32, hidden=4096, heads=32, seq_len=4096))
    >>> p.strategy, p.tensor_parallel_size
    ('fsdp', 1)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, Optional, TypedDict

from training.spec import Distribution
from trainyard.metadata import Markdown

if TYPE_CHECKING:
    from trainyard.spec import PipelineSpec

GIB = 2**30
Strategy = Literal["ddp", "fsdp", "tp"]
Optimizer = Literal["adam", "sgd"]

# fp32 states the optimizer keeps per parameter.
OPTIMIZER_STATES: dict[str, int] = {"adam": 2, "sgd": 0}
# Peak dense bf16 tensor-core throughput without sparsity (H100 SXM and H200 share the compute die).
H100_BF16_TFLOPS = 989.0
H200_BF16_TFLOPS = 989.0


class _Sizing(TypedDict):
    """The keyword arguments of `memory_per_device` that stay the same across the strategies tried."""

    params: int
    dtype_bytes: int
    optimizer: Optimizer
    devices: int
    activation_gb: Optional[float]
    shape: Optional[TransformerShape]
    fsdp_units: Optional[int]


class NothingFitsError(ValueError):
    """No strategy fits the model on the given devices; the message says how far each one is."""


@dataclass(frozen=True)
class TransformerShape:
    """What activation memory depends on, for a decoder-only transformer.

    Args:
        layers: transformer blocks (also the natural FSDP unit count).
        hidden: model width h.
        heads: attention heads a.
        seq_len: tokens per sequence s.
        micro_batch_size: sequences per device per step b.
        vocab: vocabulary size; adds fp32 logits for the loss (0 to leave out).
        flash_attention: attention scores are never materialised (drops 5*a*s/h).
        activation_checkpointing: keep only each block's input and recompute one block at a time.
    """

    layers: int
    hidden: int
    heads: int
    seq_len: int
    micro_batch_size: int = 1
    vocab: int = 0
    flash_attention: bool = True
    activation_checkpointing: bool = False

    def activation_bytes(self, tensor_parallel_size: int = 1) -> float:
        """Activation bytes per device for one micro-batch (tensor parallel with sequence parallelism)."""
        s, b, h, a, t = self.seq_len, self.micro_batch_size, self.hidden, self.heads, tensor_parallel_size
        per_layer = s * b * h * 34 / t
        if not self.flash_attention:
            per_layer += 5 * a * s * s * b / t
        if self.activation_checkpointing:
            stored = self.layers * 2 * s * b * h / t + per_layer  # block inputs (16-bit) + one block recomputed
        else:
            stored = self.layers * per_layer
        return stored + 4 * s * b * self.vocab / t

    def tokens_per_step(self, data_parallel_size: int) -> int:
        return self.seq_len * self.micro_batch_size * data_parallel_size


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-device memory of one strategy, in GiB."""

    strategy: Strategy
    tensor_parallel_size: int
    model_states_gb: float
    buffers_gb: float  # DDP gradient buckets, or FSDP's gathered working set
    activations_gb: float

    @property
    def total_gb(self) -> float:
        return self.model_states_gb + self.buffers_gb + self.activations_gb

    def describe(self) -> str:
        buffers = "DDP buckets" if self.strategy == "ddp" else "gathered units"
        return (
            f"{self.total_gb:.1f} GiB (model states {self.model_states_gb:.1f}, {buffers} {self.buffers_gb:.1f}, "
            f"activations {self.activations_gb:.1f})"
        )


@dataclass(frozen=True)
class Plan:
    """The chosen strategy and the estimates behind it.

    `per_device_gb` and `fits` have keys "ddp", "fsdp" and "tp"; "tp" is absent
    when a node has one device. For "tp" they describe the chosen (or, when
    nothing fits, the largest) tensor parallel size.
    """

    strategy: Strategy
    tensor_parallel_size: int
    per_device_gb: dict[str, float]
    fits: dict[str, bool]
    reasoning: str
    usable_gb: float
    devices: int
    nodes: int
    estimates: dict[str, MemoryEstimate] = field(default_factory=dict)

    def distribution_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `training.spec.Distribution` for this plan (GPU, one process per device)."""
        return {
            "nodes": self.nodes,
            "procs_per_node": self.devices // self.nodes,
            "strategy": self.strategy,
            "tensor_parallel_size": self.tensor_parallel_size,
            "accelerator": "gpu",
        }


def bytes_per_param(dtype_bytes: int, optimizer: Optimizer) -> int:
    """Model-state bytes per parameter: weights, gradients, fp32 optimizer states, fp32 master copy."""
    master = 4 if dtype_bytes < 4 else 0
    return 2 * dtype_bytes + 4 * OPTIMIZER_STATES[optimizer] + master


def memory_per_device(
    strategy: Strategy,
    params: int,
    dtype_bytes: int,
    optimizer: Optimizer,
    devices: int,
    tensor_parallel_size: int = 1,
    *,
    activation_gb: Optional[float] = None,
    shape: Optional[TransformerShape] = None,
    fsdp_units: Optional[int] = None,
) -> MemoryEstimate:
    """Per-device memory of `strategy` (see the module docstring for the model).

    Args:
        strategy: "ddp", "fsdp" or "tp" (FSDP x TP).
        params: parameter count N.
        dtype_bytes: bytes of a weight as trained (2 for bf16/fp16, 4 for fp32).
        optimizer: "adam" or "sgd" (no momentum).
        devices: devices in the job D.
        tensor_parallel_size: t, for "tp" only.
        activation_gb: activations per device for one micro-batch without tensor parallel;
            overrides `shape`. Neither given: activations are left out.
        shape: estimates activations when `activation_gb` is None.
        fsdp_units: FSDP units (default: `shape.layers`, else 1 = the whole model at once).
    """
    _check_common(params, dtype_bytes, optimizer, devices)
    t = tensor_parallel_size
    if strategy != "tp" and t != 1:
        raise ValueError(f"tensor_parallel_size={t} applies to strategy 'tp' only, not {strategy!r}")
    if strategy == "tp" and (t < 2 or devices % t):
        raise ValueError(f"tensor_parallel_size={t} must be >= 2 and divide devices={devices}")
    units = fsdp_units if fsdp_units is not None else (shape.layers if shape else 1)
    if units < 1:
        raise ValueError(f"fsdp_units={units} must be >= 1")
    if activation_gb is not None:
        activations = activation_gb / t
    elif shape is not None:
        activations = shape.activation_bytes(t) / GIB
    else:
        activations = 0.0
    states = params * bytes_per_param(dtype_bytes, optimizer) / GIB
    gathered = (min(2, units) * dtype_bytes + dtype_bytes) * params / units / GIB
    if strategy == "ddp":
        return MemoryEstimate("ddp", 1, states, params * dtype_bytes / GIB, activations)
    if strategy == "fsdp":
        return MemoryEstimate("fsdp", 1, states / devices, gathered, activations)
    if strategy == "tp":
        data_parallel = devices // t
        return MemoryEstimate("tp", t, states / devices, gathered / t if data_parallel > 1 else 0.0, activations)
    raise ValueError(f"strategy {strategy!r} is not one of 'ddp', 'fsdp', 'tp'")


def plan(
    params: int,
    dtype_bytes: int,
    optimizer: Optimizer,
    device_memory_gb: float,
    devices: int,
    nodes: int = 1,
    *,
    activation_gb: Optional[float] = None,
    shape: Optional[TransformerShape] = None,
    fsdp_units: Optional[int] = None,
    usable_fraction: float = 0.9,
) -> Plan:
    """Choose the cheapest strategy that fits: DDP, else FSDP, else FSDP x TP with the smallest TP size.

    Tensor parallel groups stay inside a node (they all-reduce every layer), so
    TP sizes tried are the divisors of devices per node from 2 up.

    Args:
        params, dtype_bytes, optimizer, activation_gb, shape, fsdp_units: as in `memory_per_device`.
        device_memory_gb: memory of one device in GiB (H100 80GB: 79.6, H200: 140.4, as nvidia-smi reports).
        devices: devices in the job, across all nodes.
        nodes: nodes the devices are spread over (must divide `devices`).
        usable_fraction: share of device memory the estimate may use.

    Raises:
        NothingFitsError: no strategy fits; the message gives each estimate and how many devices FSDP would need.
        ValueError: an argument is out of range.
    """
    _check_common(params, dtype_bytes, optimizer, devices)
    if nodes < 1 or devices % nodes:
        raise ValueError(f"nodes={nodes} must be >= 1 and divide devices={devices}")
    if device_memory_gb <= 0:
        raise ValueError(f"device_memory_gb={device_memory_gb} must be > 0")
    if not 0 < usable_fraction <= 1:
        raise ValueError(f"usable_fraction={usable_fraction} must be in (0, 1]")
    usable = device_memory_gb * usable_fraction
    common = _Sizing(params=params, dtype_bytes=dtype_bytes, optimizer=optimizer, devices=devices,
                     activation_gb=activation_gb, shape=shape, fsdp_units=fsdp_units)
    estimates = {"ddp": memory_per_device("ddp", **common), "fsdp": memory_per_device("fsdp", **common)}
    per_node = devices // nodes
    tp_sizes = [t for t in range(2, per_node + 1) if per_node % t == 0]
    for t in tp_sizes:
        estimates["tp"] = memory_per_device("tp", tensor_parallel_size=t, **common)
        if estimates["tp"].total_gb <= usable:
            break
    fits = {k: e.total_gb <= usable for k, e in estimates.items()}
    per_device = {k: e.total_gb for k, e in estimates.items()}
    lines = [f"usable memory {usable:.1f} of {device_memory_gb:.1f} GiB per device; {devices} devices on {nodes} node(s)"]
    for key, label in (("ddp", "DDP"), ("fsdp", f"FSDP over {devices}"), ("tp", "FSDP x TP")):
        if key in estimates:
            e = estimates[key]
            name = f"FSDP x TP (tp={e.tensor_parallel_size}, dp={devices // e.tensor_parallel_size})" if key == "tp" else label
            lines.append(f"{name}: {e.describe()} -> {'fits' if fits[key] else 'does not fit'}")
    if not tp_sizes:
        lines.append("FSDP x TP: one device per node, no tensor parallel group")
    order: tuple[Strategy, ...] = ("ddp", "fsdp", "tp")
    chosen = next((k for k in order if fits.get(k)), None)
    if chosen is None:
        lines.append(_what_would_fit(common, per_node, tp_sizes, usable))
        raise NothingFitsError("; ".join(lines))
    t = estimates[chosen].tensor_parallel_size
    choice = f"choose {chosen}" + (f" with tensor_parallel_size={t}" if chosen == "tp" else "")
    lines.append(f"{choice} (the first that fits in the order DDP, FSDP, FSDP x TP)")
    return Plan(chosen, t, per_device, fits, "\n".join(lines), usable, devices, nodes, estimates)


def _what_would_fit(common: _Sizing, per_node: int, tp_sizes: list[int], usable: float, max_nodes: int = 4096) -> str:
    """The smallest job of whole nodes like these on which FSDP or FSDP x TP would fit."""
    options: list[tuple[Strategy, int]] = [("fsdp", 1), *(("tp", t) for t in tp_sizes)]
    for n in range(1, max_nodes + 1):
        devices = n * per_node
        sizing: _Sizing = {**common, "devices": devices}
        for strategy, t in options:
            e = memory_per_device(strategy, tensor_parallel_size=t, **sizing)
            if e.total_gb <= usable:
                name = "FSDP" if strategy == "fsdp" else f"FSDP x TP (tp={t})"
                return f"nothing fits; {name} would fit on {devices} devices ({n} node(s) of {per_node})"
    return (
        f"nothing fits on up to {max_nodes} nodes: activations and gathered units alone exceed a device; "
        "reduce micro-batch or sequence length, checkpoint activations, or use more FSDP units"
    )


def _check_common(params: int, dtype_bytes: int, optimizer: str, devices: int) -> None:
    if params < 1:
        raise ValueError(f"params={params} must be >= 1")
    if dtype_bytes not in (1, 2, 4, 8):
        raise ValueError(f"dtype_bytes={dtype_bytes} must be 1, 2, 4 or 8")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer={optimizer!r} must be one of {sorted(OPTIMIZER_STATES)}")
    if devices < 1:
        raise ValueError(f"devices={devices} must be >= 1")


@dataclass(frozen=True)
class RunCost:
    """Time of a training run at a given model FLOPs utilisation."""

    tokens_per_second: float
    seconds: float

    @property
    def days(self) -> float:
        return self.seconds / 86400


def training_time(params: int, tokens: float, devices: int, peak_tflops: float, mfu: float) -> RunCost:
    """Run time from 6 * N * tokens training FLOPs (forward 2N, backward 4N per token) at `mfu` of peak."""
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu={mfu} must be in (0, 1]")
    flops_per_second = devices * peak_tflops * 1e12 * mfu
    tokens_per_second = flops_per_second / (6 * params)
    return RunCost(tokens_per_second, tokens / tokens_per_second)


def checkpoint_gb(params: int, dtype_bytes: int, optimizer: Optimizer) -> float:
    """Size of a resumable checkpoint in GiB: weights, fp32 master copy and optimizer states (no gradients)."""
    return params * (bytes_per_param(dtype_bytes, optimizer) - dtype_bytes) / GIB


def checkpoint_seconds(size_gb: float, bandwidth_gb_s: float) -> float:
    """Seconds to write `size_gb` GiB at an aggregate storage bandwidth of `bandwidth_gb_s` GiB/s."""
    if bandwidth_gb_s <= 0:
        raise ValueError(f"bandwidth_gb_s={bandwidth_gb_s} must be > 0")
    return size_gb / bandwidth_gb_s


def estimate_params(model: Any) -> int:
    """Parameters of a torch module, each shared (tied) parameter counted once. Imports torch only here."""
    import torch

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"estimate_params takes a torch.nn.Module, got {type(model).__name__}")
    # parameters() yields a shared (tied) Parameter once
    return sum(p.numel() for p in model.parameters())


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
        """Per-device memory of each strategy: weights, gradients, optimizer states, buffers, activations, total vs usable."""
        if not self.estimates:
            return ""
        per = bytes_per_param(self.dtype_bytes, self.optimizer)
        head = ("| strategy | params | grads | optimizer | buffers | activations | total | usable | fits |\n"
                "|---|---:|---:|---:|---:|---:|---:|---:|---|\n")
        rows = []
        for e in self.estimates:
            share = e.model_states_gb / per  # GiB per byte-per-parameter of model state
            name = _label(e)
            if (e.strategy, e.tensor_parallel_size) == (self.distribution.strategy, self.distribution.tensor_parallel_size):
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


def device_memory(distribution: Distribution, launcher: Any = None, environ: Optional[Mapping[str, str]] = None) -> tuple[float, str]:
    """Memory of one device (GPU, or one CPU process's share of its machine) in GiB, and where the number came from.

    First that applies: the `TRAINYARD_DEVICE_MEMORY_GB` environment variable; a
    `device_memory_gb` field of the launcher; on GPU, 79.6 (an H100 80GB); on CPU,
    the launcher's pod memory (`memory_limit`, else `memory`, as on
    `KubernetesLauncher`) or else this machine's RAM, shared by `procs_per_node` processes.
    """
    env = os.environ if environ is None else environ
    raw = env.get(DEVICE_MEMORY_ENV)
    if raw:
        try:
            value = float(raw)
        except ValueError as e:
            raise ValueError(f"{DEVICE_MEMORY_ENV}={raw!r} is not a number of GiB, e.g. '79.6'") from e
        if value <= 0:
            raise ValueError(f"{DEVICE_MEMORY_ENV}={raw!r} must be > 0 GiB")
        return value, f"{DEVICE_MEMORY_ENV}={raw}"
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
        >>> p = plan_distribution(Distribution(procs_per_node=2, strategy="auto"), params=4_810, dtype_bytes=4, device_memory_gb=16)
        >>> p.distribution.strategy, p.chosen_by
        ('ddp', 'planner')
    """
    devices, nodes = distribution.world_size, distribution.nodes
    common = _Sizing(params=params, dtype_bytes=dtype_bytes, optimizer=optimizer, devices=devices,
                     activation_gb=activation_gb, shape=shape, fsdp_units=fsdp_units)
    per_node = devices // nodes
    estimates = [memory_per_device("ddp", **common), memory_per_device("fsdp", **common)]
    estimates += [memory_per_device("tp", tensor_parallel_size=t, **common) for t in range(2, per_node + 1) if per_node % t == 0]
    usable = device_memory_gb * usable_fraction
    inputs = _TrialInputs(params=params, dtype_bytes=dtype_bytes, optimizer=optimizer, device_memory_gb=device_memory_gb,
                          device_memory_source=device_memory_source, usable_gb=usable, estimates=tuple(estimates))
    facts = (f"{params:,} parameters, {dtype_bytes}-byte weights and {optimizer} = {bytes_per_param(dtype_bytes, optimizer)} "
             f"bytes per parameter of model state, on {devices} device(s) ({nodes} node(s)) with "
             f"{_size(usable)} usable of {_size(device_memory_gb)} each ({device_memory_source or 'given'})")
    if activation_gb is None and shape is None:
        facts += "; activations not estimated for this model"
    chosen: Optional[Plan] = None
    nothing: Optional[NothingFitsError] = None
    try:
        chosen = plan(usable_fraction=usable_fraction, device_memory_gb=device_memory_gb, nodes=nodes, **common)
    except NothingFitsError as e:
        nothing = e
    if distribution.strategy == "auto":
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
    # A fixed tensor parallel size may span nodes, which the planner never tries: estimate it on its own.
    fixed = memory_per_device(distribution.strategy, tensor_parallel_size=distribution.tensor_parallel_size, **common)
    if fixed not in estimates:
        estimates.append(fixed)
        inputs["estimates"] = tuple(estimates)
    warnings: tuple[str, ...] = ()
    if fixed.total_gb <= usable:
        reasoning = f"{_label(fixed)} (fixed by the pipeline) fits: {_size(fixed.total_gb)} of {_size(usable)} usable per device"
        if chosen is not None and (chosen.strategy, chosen.tensor_parallel_size) != (fixed.strategy, fixed.tensor_parallel_size):
            reasoning += f"; strategy 'auto' would choose {_label(chosen.estimates[chosen.strategy])}"
    else:
        instead = (f"strategy 'auto' would choose {_label(chosen.estimates[chosen.strategy])} "
                   f"({_size(chosen.per_device_gb[chosen.strategy])})" if chosen is not None else "no strategy fits these devices")
        reasoning = (f"{_label(fixed)} (fixed by the pipeline) needs {_size(fixed.total_gb)} > {_size(usable)} usable per device "
                     f"and may run out of memory; {instead}")
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


def plan_trial(
    spec: "PipelineSpec",
    hparams: dict[str, Any],
    n_classes: Callable[[], int],
    launcher: Any = None,
    *,
    precision: str = "32-true",
    optimizer: Optimizer = "adam",
    environ: Optional[Mapping[str, str]] = None,
) -> TrialPlan:
    """The plan of one trial of `spec`: its model built with `hparams`, on the launcher's devices.

    The model class is instantiated like the entrypoint does (`n_features` and
    `n_classes` filled in when its constructor takes them), on torch's meta
    device so no weights are allocated. With strategy 'auto' the chosen strategy
    must also be one the model supports (fsdp and tp: a `training.parallel.ParallelizableModule`,
    recognised by its methods; the pod checks the details again).
    gbt tasks are not planned (one LightGBM process).

    Never raises for a plan that cannot work: it returns one with `error` set
    (the caller fails the trial with it), so the orchestrator decides how to fail.

    Args:
        spec: the pipeline; `distribution` may say 'auto'.
        hparams: the model's keyword arguments for this trial (pipeline hparams and trial params).
        n_classes: called only when the model takes `n_classes` and it is not in `hparams`.
        launcher: the launcher resource; see `device_memory` for what is read from it.
        precision: `TrainSpec.precision` (weight bytes: 4 for '32-true', 2 for the 16-bit ones).
        optimizer: 'adam' (default) or 'sgd'.
        environ: environment to read `TRAINYARD_DEVICE_MEMORY_GB` from (default `os.environ`).
    """
    dist = spec.distribution
    if spec.model.task == "gbt":
        resolved = dist if dist.strategy != "auto" else Distribution(**{**dist.model_dump(), "strategy": "ddp"})
        return TrialPlan(resolved, "skipped", "gbt task: LightGBM trains in one process, there is no distribution to plan.")
    if precision not in PRECISION_BYTES:
        raise ValueError(f"precision={precision!r} must be one of {sorted(PRECISION_BYTES)}")
    memory_gb, source = device_memory(dist, launcher, environ)
    chosen_by: Literal["planner", "user"] = "planner" if dist.strategy == "auto" else "user"
    try:
        model = _meta_model(spec, hparams, n_classes)
        result = plan_distribution(dist, estimate_params(model), PRECISION_BYTES[precision], memory_gb, optimizer,
                                   fsdp_units=_fsdp_units(model), device_memory_source=source)
        if result.chosen_by == "planner":
            _check_supports(model, result.distribution.strategy)
    except (TrialPlanError, NothingFitsError) as e:
        return TrialPlan(dist, chosen_by, f"cannot plan: {e}", error=str(e), device_memory_gb=memory_gb,
                         device_memory_source=source)
    return result


class TrialPlanError(ValueError):
    """A trial's model cannot be built from its hyperparameters, or cannot follow the strategy 'auto' chose."""


def _check_supports(model: Any, strategy: str) -> None:
    """What `training.strategies.check_model_supports` requires, told by the model's methods (orchestration imports no pod code)."""
    if strategy == "ddp":
        return
    name = type(model).__name__
    if not (callable(getattr(model, "fsdp_units", None)) and callable(getattr(model, "tensor_parallel_plan", None))):
        raise TrialPlanError(
            f"distribution.strategy='auto' chose {strategy!r} (ddp does not fit), but model {name} does not support strategy "
            f"{strategy!r}: inherit training.parallel.ParallelizableModule, or add devices so that ddp fits"
        )
    if strategy == "tp" and not model.tensor_parallel_plan():
        raise TrialPlanError(
            f"distribution.strategy='auto' chose 'tp' (ddp and fsdp do not fit), but model {name} does not support strategy "
            "'tp': tensor_parallel_plan() is empty; return {submodule FQN: ColwiseParallel() | RowwiseParallel()}"
        )


def _meta_model(spec: "PipelineSpec", hparams: dict[str, Any], n_classes: Callable[[], int]) -> Any:
    """The trial's model, built as `training.entrypoint.build` builds it, without allocating weights."""
    import importlib
    import inspect

    import torch

    module, _, attr = spec.model.path.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise TrialPlanError(f"model {spec.model.path!r} cannot be imported: {e}") from e
    kwargs = dict(hparams)
    accepted = inspect.signature(cls.__init__).parameters
    if "n_features" in accepted and "n_features" not in kwargs:
        kwargs["n_features"] = len(spec.features)
    if "n_classes" in accepted and "n_classes" not in kwargs:
        kwargs["n_classes"] = n_classes()
    try:
        try:
            with torch.device("meta"):
                return cls(**kwargs)
        except (NotImplementedError, RuntimeError):
            # A constructor that reads a tensor's value back cannot run on meta tensors; pay for real weights.
            return cls(**kwargs)
    except TypeError as e:
        raise TrialPlanError(f"model {spec.model.path!r} rejected hyperparameters {kwargs}: {e}") from e


def _fsdp_units(model: Any) -> Optional[int]:
    """FSDP units of a `ParallelizableModule` (its `fsdp_units()`, at least 1); None for other models."""
    units = getattr(model, "fsdp_units", None)
    return max(1, len(units())) if callable(units) else None


def count_classes(spec: "PipelineSpec", validated_data: dict[str, Any], store: Any) -> int:
    """Distinct target values over the train/val/test splits, as `ParquetDataModule.classes()` counts them."""
    import pandas as pd

    seen: set[int] = set()
    for split in ("train", "val", "test"):
        with store.open(validated_data[split], "rb") as f:
            seen.update(int(v) for v in pd.read_parquet(f, columns=[spec.target])[spec.target].unique())
    return len(seen)
