"""Capacity model: per-device memory of each distribution strategy, the cheapest that fits, and what a run costs.

Pure Python (no torch), so the orchestrator can plan before any pod starts.
`plan` estimates memory per device for DDP, FSDP (ZeRO-3 over all devices) and
FSDP x tensor parallel, and picks the first that fits in the order
DDP -> FSDP -> FSDP x TP (smallest tensor parallel size that fits), because each
step down that list adds communication. `trainyard.planner` applies it to one
trial of a pipeline.

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

from dataclasses import dataclass, field
from typing import Any, Literal, Optional, TypedDict

GIB = 2**30
Strategy = Literal["ddp", "fsdp", "tp"]
Optimizer = Literal["adam", "sgd"]

# fp32 states the optimizer keeps per parameter.
OPTIMIZER_STATES: dict[str, int] = {"adam": 2, "sgd": 0}
# Peak dense bf16 tensor-core throughput without sparsity (H100 SXM and H200 share the compute die).
H100_BF16_TFLOPS = 989.0
H200_BF16_TFLOPS = 989.0


class Sizing(TypedDict):
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
    common = Sizing(params=params, dtype_bytes=dtype_bytes, optimizer=optimizer, devices=devices,
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
    lines = [
        f"usable memory {usable:.1f} of {device_memory_gb:.1f} GiB per device; {devices} devices on {nodes} node(s)"
    ]
    for key, label in (("ddp", "DDP"), ("fsdp", f"FSDP over {devices}"), ("tp", "FSDP x TP")):
        if key in estimates:
            e = estimates[key]
            name = (
                f"FSDP x TP (tp={e.tensor_parallel_size}, dp={devices // e.tensor_parallel_size})"
                if key == "tp"
                else label
            )
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


def _what_would_fit(common: Sizing, per_node: int, tp_sizes: list[int], usable: float, max_nodes: int = 4096) -> str:
    """The smallest job of whole nodes like these on which FSDP or FSDP x TP would fit."""
    options: list[tuple[Strategy, int]] = [("fsdp", 1), *(("tp", t) for t in tp_sizes)]
    for n in range(1, max_nodes + 1):
        devices = n * per_node
        sizing: Sizing = {**common, "devices": devices}
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
