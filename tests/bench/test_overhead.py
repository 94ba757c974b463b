"""`bench.overhead`'s reading of a step clock: steady periods, and the platform hooks' time charged to them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench.overhead import PHASES, STEPS, WARMUP, _clock


def test_hooks_are_charged_to_the_steady_periods_they_fall_in(tmp_path: Path) -> None:
    n = STEPS
    ends = [0.1 * k for k in range(n)]
    writing = [WARMUP + 5 <= k <= WARMUP + 6 for k in range(n)]  # a write in flight at two batch ends
    # 1 ms of FaultTolerance per step, 100 ms at the step whose end saw the write start, 5 ms of logging every 50 steps
    hooks = [
        {"FaultTolerance": 0.1 if k == WARMUP + 5 else 0.001, **({"logger:WandbLogger": 0.005} if k % 50 == 0 else {})}
        for k in range(n)
    ]
    path = tmp_path / "clock.json"
    path.write_text(
        json.dumps(
            {
                "first_step_start_wall": 1.0,
                "last_step_end_wall": 2.0,
                "batch_end": ends,
                "writing": writing,
                "hooks": hooks,
                "world_size": 2,
            }
        )
    )
    clock = _clock(path)
    steady = n - 1 - WARMUP - 3  # periods touching batch ends WARMUP+5 and WARMUP+6 are a write's
    assert clock["steady_periods"] == steady
    assert abs(clock["hooks_ms_by_class"]["FaultTolerance"] - 1.0) < 1e-9  # the 100 ms step is a write period's
    logged = sum(1 for k in range(WARMUP + 1, n) if k % 50 == 0)
    assert abs(clock["hooks_ms_by_class"]["logger:WandbLogger"] - 5.0 * logged / steady) < 1e-9
    assert abs(clock["hooks_ms"] - (1.0 + 5.0 * logged / steady)) < 1e-9


def test_a_clock_without_hooks_reads_as_none_spent(tmp_path: Path) -> None:
    path = tmp_path / "clock.json"
    path.write_text(
        json.dumps(
            {
                "first_step_start_wall": 1.0,
                "last_step_end_wall": 2.0,
                "batch_end": [0.1 * k for k in range(STEPS)],
                "writing": [False] * STEPS,
                "world_size": 2,
            }
        )
    )
    assert _clock(path)["hooks_ms"] == 0.0


def test_cpu_and_phases_are_read_from_the_steady_periods_only(tmp_path: Path) -> None:
    n = STEPS
    ends = [0.1 * k for k in range(n)]
    writing = [k == WARMUP + 5 for k in range(n)]
    # per step (wall, main-thread cpu) at batch start, before backward, after backward, before optimizer step, batch
    # end:
    # the main thread runs half the wall time, 50 ms a 100 ms step, 10x that in the write's step
    phases, main = [], 0.0
    for k in range(n):
        start = ends[k] - 0.097
        w = [start, start + 0.010, start + 0.060, start + 0.0601, ends[k]]
        c = [main + 0.5 * (x - start) for x in w]
        main = c[-1] + 0.5 * 0.003 + (0.45 if k == WARMUP + 4 else 0.0)
        phases.append([v for pair in zip(w, c) for v in pair])
    # cumulative [process cpu, gc s, busy jiffies, total jiffies]: 20 ms of other threads' CPU, 0.1 ms of GC and 1.5
    # busy cores of 2 per 100 ms step
    cpu = [[phases[k][-1] + 0.02 * k, 0.0001 * k, 15.0 * k, 20.0 * k] for k in range(n)]
    path = tmp_path / "clock.json"
    path.write_text(
        json.dumps(
            {
                "first_step_start_wall": 1.0,
                "last_step_end_wall": 2.0,
                "batch_end": ends,
                "writing": writing,
                "cpu": cpu,
                "phases": phases,
                "world_size": 2,
            }
        )
    )
    c = _clock(path)["cpu"]
    assert abs(c["rank0_main_thread_cpu_ms_per_step"] - 50.0) < 1e-6  # the write's step is not a steady one
    assert abs(c["rank0_other_threads_cpu_ms_per_step"] - 20.0) < 1e-6
    assert abs(c["rank0_gc_ms_per_step"] - 0.1) < 1e-6
    hz = os.sysconf("SC_CLK_TCK")
    assert abs(c["machine_busy_cores"] - 15 / hz / 0.1) < 1e-6
    wall = c["phase_wall_ms_per_step"]
    assert [round(wall[p], 6) for p in PHASES] == [3.0, 10.0, 50.0, 0.1, 36.9]
    assert abs(sum(wall.values()) - 100.0) < 1e-6  # the phases tile the step period
    assert abs(c["phase_cpu_ms_per_step"]["backward"] - 25.0) < 1e-6


def test_a_real_lightning_fit_stamps_phases_that_tile_its_step_periods(tmp_path: Path) -> None:
    """`StepClock` in a real Trainer: its hooks fire in the order `_phases` assumes, so every phase is >= 0."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from bench.steady_model import TimedMLP

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4 * STEPS, 8), torch.arange(4 * STEPS) % 3)
    path = tmp_path / "clock.json"
    model = TimedMLP(clock_path=str(path), n_features=8, n_classes=3, width=16, blocks=1, expansion=2)
    L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(model, DataLoader(data, batch_size=4))
    clock = _clock(path)
    wall, cpu = clock["cpu"]["phase_wall_ms_per_step"], clock["cpu"]["phase_cpu_ms_per_step"]
    assert all(wall[p] >= 0 and cpu[p] >= 0 for p in PHASES), (wall, cpu)
    assert abs(sum(wall.values()) - clock["mean"] * 1e3) < 1e-6
    assert wall["backward"] > 0 and wall["optimizer"] > 0 and clock["cpu"]["rank0_main_thread_cpu_ms_per_step"] > 0
    # The process trained between the two snapshots, so it used CPU; faults and switches are counted, never negative.
    assert clock["cpu"]["ranks_cores"] > 0 and clock["cpu"]["other_processes_cores"] >= 0
    assert all(
        clock["cpu"][f"rank0_{n}_per_step"] >= 0
        for n in ("minor_faults", "involuntary_switches", "main_thread_voluntary_switches")
    )


def test_the_cores_other_processes_used_are_told_apart_from_the_ranks(tmp_path: Path) -> None:
    """`_processes`: between the snapshots, ranks' ticks and everyone else's, per second of the window."""
    hz = os.sysconf("SC_CLK_TCK")
    before = {
        "10": [0, "python rank"],
        "11": [0, "python rank"],
        "12": [5, "wandb-core"],
        "13": [7, "launcher"],
        "14": [1, "gone"],
    }
    after = {
        "10": [2 * hz, "python rank"],
        "11": [2 * hz, "python rank"],
        "12": [5 + hz // 10, "wandb-core"],
        "13": [7, "launcher"],
        "15": [hz, "born in the window"],
    }
    n, steps = STEPS, WARMUP
    path = tmp_path / "clock.json"
    path.write_text(
        json.dumps(
            {
                "first_step_start_wall": 1.0,
                "last_step_end_wall": 2.0,
                "batch_end": [0.1 * k for k in range(n)],
                "writing": [False] * n,
                "world_size": 2,
                "rank_pids": [10, 11],
                "processes": {str(steps): {"wall": 100.0, "ticks": before}, str(n): {"wall": 102.0, "ticks": after}},
            }
        )
    )
    c = _clock(path)["cpu"]
    assert c["ranks_cores"] == pytest.approx(2.0)
    # wandb-core's tenth of a second over 2 s; the idle launcher and the processes not in both snapshots count nothing
    assert c["other_processes_cores"] == pytest.approx((hz // 10) / hz / 2)
    assert c["other_processes_top"] == [["wandb-core", pytest.approx((hz // 10) / hz / 2, abs=1e-4)]]


def test_the_paired_added_time_says_whether_the_repetitions_resolve_the_target() -> None:
    from bench.overhead import _paired_added

    def runs(*ms: float) -> list[dict[str, float]]:
        return [{"step_ms_mean": m} for m in ms]

    steady = _paired_added(runs(100.2, 101.3, 99.4), runs(100.0, 101.0, 99.0))
    assert steady["differences_ms"] == pytest.approx([0.2, 0.3, 0.4])
    assert steady["mean"] == pytest.approx(0.3) and steady["ci_high"] < 1.0
    assert steady["verdict"].startswith("met")
    slow = _paired_added(runs(104.0, 105.1, 103.9), runs(100.0, 101.0, 100.0))
    assert slow["ci_low"] > 1.0 and slow["verdict"].startswith("missed")
    # A mean under 1 ms whose repetitions spread over several: the median difference could pass, the pairs do not say.
    noisy = _paired_added(runs(103.0, 97.0, 101.5, 99.0), runs(100.0, 100.0, 100.0, 100.0))
    assert noisy["mean"] == pytest.approx(0.125) and noisy["ci_low"] < 0 < 1.0 < noisy["ci_high"]
    assert noisy["verdict"].startswith("not resolved")
    assert _paired_added(runs(100.5), runs(100.0))["verdict"].startswith("not resolved")


def test_the_four_sides_rotate_and_the_a_a_control_compares_two_copies_of_the_same_side(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each side runs in each position equally often; the A/A control reads bare_allocator against its second copy."""
    import bench.overhead as overhead

    order: list[str] = []
    step = {"bare": 100.0, "platform": 97.0, "bare_allocator": 95.0, "bare_allocator_again": 96.0}

    def run(side: str, out: Path) -> dict[str, float]:
        order.append(side)
        assert out.name == f"{side}-{(len(order) - 1) // len(overhead.SIDES)}"
        return {
            "step_ms_mean": step[side],
            "samples_per_second": 32e3 / step[side],
            "other_callbacks_and_loggers_ms_per_step": 0.5,
            "step_ms_mean_incl_writes": step[side],
            "launch_to_first_step_s": 1.0,
            "last_step_to_result_s": 1.0,
            "wall_s": 10.0,
        }

    monkeypatch.setattr(overhead, "_data", lambda directory: ["f0"])
    monkeypatch.setattr(overhead, "platform", lambda data, features, out: run("platform", out))
    monkeypatch.setattr(
        overhead,
        "bare",
        lambda data, out, allocator=False: run(
            "bare_allocator"
            if allocator and "again" not in out.name
            else "bare_allocator_again"
            if allocator
            else "bare",
            out,
        ),
    )
    monkeypatch.setattr(overhead, "write_result", lambda name, value, unit, baseline, details, **kw: details)
    details = overhead.main()
    n = len(overhead.SIDES)
    assert len(order) == overhead.REPEATS * n
    for position in range(n):
        placed = [order[i * n + position] for i in range(overhead.REPEATS)]
        assert sorted(placed) == sorted(list(overhead.SIDES) * (overhead.REPEATS // n))  # each side equally often here
    like = details["like_for_like"]
    assert like["added_ms_per_step"] == pytest.approx(2.0)
    assert like["a_a_control"]["added_ms_per_step"] == pytest.approx(1.0)
    assert like["a_a_control"]["added_ms_per_step_paired"]["differences_ms"] == pytest.approx([1.0] * overhead.REPEATS)
    assert like["a_a_control"]["added_ms_per_step_paired"]["what"].startswith(
        "per repetition, bare_allocator_again - bare_allocator"
    )
