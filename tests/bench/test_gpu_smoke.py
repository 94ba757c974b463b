"""The GPU smoke benchmark: its steady-state window on synthetic clocks, and its code path on CPU (never needs a
GPU)."""

from __future__ import annotations

from typing import Any

import pytest

from bench.gpu_smoke import WindowClock, peak_flops, steady_window


def _clock(
    n: int, writing: tuple[int, ...] = (), epoch_at: int | None = None, sync_every: int = 1, period: float = 1.0
) -> dict[str, Any]:
    """A clock of `n` stamps `period` apart; writes in flight at `writing`; epoch 1 from `epoch_at`; synced every
    `sync_every`."""
    return {
        "batch_end": [k * period for k in range(n)],
        "writing": [k in writing for k in range(n)],
        "epoch": [0 if epoch_at is None or k < epoch_at else 1 for k in range(n)],
        "synced": [k % sync_every == 0 for k in range(n)],
    }


def test_the_window_starts_after_warmup_and_spans_the_quiet_steps() -> None:
    window = steady_window(_clock(50), warmup=10)
    assert window == {"start": 10, "end": 49, "steps": 39, "seconds": 39.0}


def test_a_checkpoint_write_in_flight_is_never_inside_the_window() -> None:
    # a write in flight from step 12 to 30: the longest quiet stretch is after it
    window = steady_window(_clock(60, writing=tuple(range(12, 31))), warmup=5)
    assert (window["start"], window["end"]) == (31, 59)
    # a write late in the run: the stretch before it is the longer one
    window = steady_window(_clock(60, writing=(50, 51)), warmup=5)
    assert (window["start"], window["end"]) == (5, 49)


def test_the_window_stays_within_one_epoch_and_on_synchronized_stamps() -> None:
    window = steady_window(_clock(100, epoch_at=70), warmup=10)
    assert (window["start"], window["end"]) == (10, 69)  # validation runs between epochs: never inside
    window = steady_window(_clock(100, writing=(13,), sync_every=25), warmup=10)
    assert (window["start"], window["end"]) == (25, 75)  # only synchronized stamps bound it; 99 is not one
    assert window["seconds"] == 50.0


def test_no_window_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no steady-state window"):
        steady_window(_clock(30, writing=tuple(range(10, 30))), warmup=10)
    with pytest.raises(ValueError, match="no steady-state window"):
        steady_window(_clock(15), warmup=20)
    bad = _clock(10)
    bad["writing"] = bad["writing"][:-1]
    with pytest.raises(ValueError, match="differ in length"):
        steady_window(bad, warmup=0)


def test_the_clock_stamps_in_order_and_marks_sync_points_on_cuda_only() -> None:
    clock = WindowClock(sync_every=3)
    for k in range(7):
        clock.stamp(writing=k == 4, epoch=0, cuda=False)
    dump = clock.dump()
    assert dump["batch_end"] == sorted(dump["batch_end"]) and dump["writing"] == [k == 4 for k in range(7)]
    assert all(dump["synced"])  # on CPU every stamp is exact
    with pytest.raises(ValueError, match="sync_every"):
        WindowClock(sync_every=0)


@pytest.mark.slow
def test_gpu_smoke_dry_run_on_cpu() -> None:
    from bench.gpu_smoke import DRY_EPOCHS, DRY_STEPS, WARMUP, main

    record = main(dry_run=True)
    assert record["name"] == "gpu_smoke_dry_run"
    details = record["details"]
    for side in ("ddp", "fsdp", "bare_single_device", "bare_lightning"):
        window = details[side]["window"]
        assert details[side]["samples_per_second"] > 0 and window["start"] >= WARMUP and window["steps"] > 0
    for side in ("ddp", "fsdp"):  # the platform's window lies within one epoch
        assert details[side]["window"]["end"] < details[side]["steps"] and details[side]["window"]["steps"] < DRY_STEPS
    assert details["ddp"]["steps"] == DRY_STEPS * DRY_EPOCHS and details["parameters"] > 0 and 0 < details["ddp"]["mfu"]
    # the baseline is bare Lightning (issue 16's reference); the bare loop rides along
    assert (
        record["baseline"] == details["bare_lightning"]["samples_per_second"]
        and details["bare_lightning"]["steps"] == DRY_STEPS
    )
    assert record["ratio"] == pytest.approx(record["value"] / record["baseline"])
    assert set(details["ddp"]["finish_seconds"]) == {"load_best", "evaluate", "export"}


def test_peak_flops_lookup() -> None:
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12


@pytest.mark.slow
def test_gpu_step_breakdown_dry_run_on_cpu() -> None:
    from bench.gpu_step_breakdown import WARMUP, main

    out = main(dry_run=True, steps=WARMUP + 20)
    variants = ("bare_resident", "bare_loader", "bare_loader_pinned", "lightning_pageable", "lightning_pinned")
    assert all(out[v] > 0 for v in variants)
    assert set(out["excess_ms_over_bare_resident"]) == set(variants[1:])
    assert out["excess_ms_over_bare_resident"]["lightning_pageable"] == pytest.approx(
        out["lightning_pageable"] - out["bare_resident"]
    )
