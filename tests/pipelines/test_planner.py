"""The capacity planner: exact estimates, choice order DDP -> FSDP -> FSDP x TP, and the no-fit error."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipelines.planner import (
    GIB,
    NothingFitsError,
    TransformerShape,
    bytes_per_param,
    checkpoint_gb,
    checkpoint_seconds,
    estimate_params,
    memory_per_device,
    plan,
    training_time,
)

B = 1_000_000_000


def test_bytes_per_param() -> None:
    assert bytes_per_param(2, "adam") == 2 + 2 + 8 + 4  # bf16 weights, grads; fp32 exp_avg, exp_avg_sq; fp32 master
    assert bytes_per_param(4, "adam") == 4 + 4 + 8
    assert bytes_per_param(2, "sgd") == 2 + 2 + 4
    assert bytes_per_param(4, "sgd") == 4 + 4


def test_exact_estimates_per_strategy() -> None:
    common = dict(params=10 * B, dtype_bytes=2, optimizer="adam", devices=8, activation_gb=4.0, fsdp_units=40)
    ddp = memory_per_device("ddp", **common)
    assert (ddp.model_states_gb, ddp.buffers_gb, ddp.activations_gb) == (160e9 / GIB, 20e9 / GIB, 4.0)
    fsdp = memory_per_device("fsdp", **common)
    # states / 8; two gathered units of weights + one of gradients, 10B / 40 params each, 2 bytes
    assert (fsdp.model_states_gb, fsdp.buffers_gb, fsdp.activations_gb) == (20e9 / GIB, 1.5e9 / GIB, 4.0)
    tp = memory_per_device("tp", tensor_parallel_size=2, **common)
    assert (tp.model_states_gb, tp.buffers_gb, tp.activations_gb) == (20e9 / GIB, 0.75e9 / GIB, 2.0)
    assert tp.total_gb == pytest.approx((20e9 + 0.75e9) / GIB + 2.0, rel=1e-15)
    # tensor parallel over all devices: no data-parallel dimension, nothing to gather
    assert memory_per_device("tp", tensor_parallel_size=8, **common).buffers_gb == 0.0
    # one FSDP unit: the whole model's weights and gradients are unsharded at once
    assert memory_per_device("fsdp", **{**common, "fsdp_units": 1}).buffers_gb == 40e9 / GIB


def test_transformer_activation_estimate() -> None:
    shape = TransformerShape(layers=2, hidden=1024, heads=16, seq_len=2048, micro_batch_size=2, vocab=1000)
    sbh = 2048 * 2 * 1024
    assert shape.activation_bytes() == 2 * sbh * 34 + 4 * 2048 * 2 * 1000
    assert shape.activation_bytes(tensor_parallel_size=2) == (2 * sbh * 34 + 4 * 2048 * 2 * 1000) / 2
    no_flash = TransformerShape(layers=2, hidden=1024, heads=16, seq_len=2048, micro_batch_size=2, flash_attention=False)
    assert no_flash.activation_bytes() == 2 * (sbh * 34 + 5 * 16 * 2048 * 2048 * 2)
    ckpt = TransformerShape(layers=2, hidden=1024, heads=16, seq_len=2048, micro_batch_size=2, activation_checkpointing=True)
    assert ckpt.activation_bytes() == 2 * 2 * sbh + sbh * 34


def test_ddp_when_it_fits() -> None:
    p = plan(params=1 * B, dtype_bytes=2, optimizer="adam", device_memory_gb=80, devices=8, activation_gb=2.0)
    assert (p.strategy, p.tensor_parallel_size) == ("ddp", 1)
    assert p.per_device_gb["ddp"] == pytest.approx((16e9 + 2e9) / GIB + 2.0, rel=1e-15)  # 18.76 GiB
    assert p.usable_gb == 72.0 and p.fits == {"ddp": True, "fsdp": True, "tp": True}
    assert "choose ddp" in p.reasoning
    assert p.distribution_kwargs() == {"nodes": 1, "procs_per_node": 8, "strategy": "ddp", "tensor_parallel_size": 1, "accelerator": "gpu"}


def test_choice_order_ddp_then_fsdp_then_smallest_tp() -> None:
    common = dict(params=7 * B, dtype_bytes=2, optimizer="adam", devices=8, fsdp_units=32)
    # DDP needs 18 bytes/param = 117.3 GiB: fits only a device larger than that
    assert plan(device_memory_gb=160, activation_gb=10, **common).strategy == "ddp"
    # FSDP: 13.04 states + 1.22 gathered + 10 activations
    fsdp = plan(device_memory_gb=79.6, activation_gb=10, **common)
    assert fsdp.strategy == "fsdp" and fsdp.fits["ddp"] is False
    assert fsdp.per_device_gb["fsdp"] == pytest.approx((14e9 + 6 * 7e9 / 32) / GIB + 10, rel=1e-15)
    # 100 GiB of activations: tp=2 halves them to 50 -> 13.04 + 0.61 + 50 = 63.65 <= 71.64
    tp2 = plan(device_memory_gb=79.6, activation_gb=100, **common)
    assert (tp2.strategy, tp2.tensor_parallel_size) == ("tp", 2) and tp2.fits == {"ddp": False, "fsdp": False, "tp": True}
    assert tp2.per_device_gb["tp"] == pytest.approx((14e9 + 3 * 7e9 / 32) / GIB + 50, rel=1e-15)
    # 130 GiB: tp=2 gives 78.7 (no), tp=4 gives 13.04 + 0.31 + 32.5 = 45.85
    tp4 = plan(device_memory_gb=79.6, activation_gb=130, **common)
    assert (tp4.strategy, tp4.tensor_parallel_size) == ("tp", 4)
    assert tp4.distribution_kwargs()["tensor_parallel_size"] == 4


def test_tensor_parallel_stays_inside_a_node() -> None:
    # 2 nodes x 2 devices: tp can only be 2
    p = plan(params=7 * B, dtype_bytes=2, optimizer="adam", device_memory_gb=79.6, devices=4, nodes=2, activation_gb=60, fsdp_units=32)
    assert (p.strategy, p.tensor_parallel_size) == ("tp", 2)
    one_per_node = plan(params=1 * B, dtype_bytes=2, optimizer="adam", device_memory_gb=80, devices=4, nodes=4)
    assert "tp" not in one_per_node.per_device_gb and "no tensor parallel group" in one_per_node.reasoning


def test_nothing_fits_says_what_would() -> None:
    shape = TransformerShape(layers=80, hidden=8192, heads=64, seq_len=4096)
    with pytest.raises(NothingFitsError, match=r"FSDP x TP \(tp=4\) would fit on 24 devices \(3 node\(s\) of 8\)") as err:
        plan(params=70 * B, dtype_bytes=2, optimizer="adam", device_memory_gb=79.6, devices=8, shape=shape)
    assert "DDP: 1258.5 GiB" in str(err.value)
    with pytest.raises(NothingFitsError, match="activations and gathered units alone exceed a device"):
        plan(params=70 * B, dtype_bytes=2, optimizer="adam", device_memory_gb=79.6, devices=8, nodes=8, shape=shape)


def test_invalid_arguments_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"optimizer='lion' must be one of \['adam', 'sgd'\]"):
        plan(params=B, dtype_bytes=2, optimizer="lion", device_memory_gb=80, devices=8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="nodes=3 must be >= 1 and divide devices=8"):
        plan(params=B, dtype_bytes=2, optimizer="adam", device_memory_gb=80, devices=8, nodes=3)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must be >= 2 and divide devices=8"):
        memory_per_device("tp", B, 2, "adam", 8, tensor_parallel_size=3)


def test_run_time_and_checkpoint_cost() -> None:
    cost = training_time(params=7 * B, tokens=1e12, devices=64, peak_tflops=989, mfu=0.4)
    assert cost.tokens_per_second == pytest.approx(64 * 989e12 * 0.4 / (6 * 7e9), rel=1e-15)
    assert cost.days == pytest.approx(1e12 / cost.tokens_per_second / 86400, rel=1e-15)
    assert checkpoint_gb(7 * B, 2, "adam") == 7e9 * 14 / GIB  # weights + master + 2 Adam states
    assert checkpoint_seconds(100.0, 5.0) == 20.0


def test_estimate_params_counts_tied_weights_once() -> None:
    from torch import nn

    emb = nn.Embedding(100, 8)
    head = nn.Linear(8, 100, bias=False)
    head.weight = emb.weight
    assert estimate_params(nn.Sequential(emb, nn.Linear(8, 8), head)) == 800 + 72
    with pytest.raises(TypeError, match="takes a torch.nn.Module, got int"):
        estimate_params(3)


def test_planner_imports_without_torch() -> None:
    code = "import sys, pipelines.planner; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
