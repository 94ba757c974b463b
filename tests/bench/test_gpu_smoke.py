"""The GPU smoke benchmark's code path, run on CPU with tiny sizes (never needs a GPU)."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_gpu_smoke_dry_run_on_cpu() -> None:
    from bench.gpu_smoke import main

    record = main(dry_run=True)
    assert record["name"] == "gpu_smoke_dry_run"
    details = record["details"]
    assert details["ddp"]["samples_per_second"] > 0 and details["fsdp"]["samples_per_second"] > 0
    assert details["parameters"] > 0 and 0 < details["ddp"]["mfu"]


def test_peak_flops_lookup() -> None:
    from bench.gpu_smoke import peak_flops

    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
