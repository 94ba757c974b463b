"""`bench.overhead`'s reading of a step clock: steady periods, and the platform hooks' time charged to them."""

from __future__ import annotations

import json
from pathlib import Path

from bench.overhead import STEPS, WARMUP, _clock


def test_hooks_are_charged_to_the_steady_periods_they_fall_in(tmp_path: Path) -> None:
    n = STEPS
    ends = [0.1 * k for k in range(n)]
    writing = [WARMUP + 5 <= k <= WARMUP + 6 for k in range(n)]  # a write in flight at two batch ends
    # 1 ms of FaultTolerance per step, 100 ms at the step whose end saw the write start, 5 ms of logging every 50 steps
    hooks = [{"FaultTolerance": 0.1 if k == WARMUP + 5 else 0.001, **({"logger:WandbLogger": 0.005} if k % 50 == 0 else {})}
             for k in range(n)]
    path = tmp_path / "clock.json"
    path.write_text(json.dumps({"first_step_start_wall": 1.0, "last_step_end_wall": 2.0, "batch_end": ends, "writing": writing,
                                "hooks": hooks, "world_size": 2}))
    clock = _clock(path)
    steady = n - 1 - WARMUP - 3  # periods touching batch ends WARMUP+5 and WARMUP+6 are a write's
    assert clock["steady_periods"] == steady
    assert abs(clock["hooks_ms_by_class"]["FaultTolerance"] - 1.0) < 1e-9  # the 100 ms step is a write period's
    logged = sum(1 for k in range(WARMUP + 1, n) if k % 50 == 0)
    assert abs(clock["hooks_ms_by_class"]["logger:WandbLogger"] - 5.0 * logged / steady) < 1e-9
    assert abs(clock["hooks_ms"] - (1.0 + 5.0 * logged / steady)) < 1e-9


def test_a_clock_without_hooks_reads_as_none_spent(tmp_path: Path) -> None:
    path = tmp_path / "clock.json"
    path.write_text(json.dumps({"first_step_start_wall": 1.0, "last_step_end_wall": 2.0, "batch_end": [0.1 * k for k in range(STEPS)],
                                "writing": [False] * STEPS, "world_size": 2}))
    assert _clock(path)["hooks_ms"] == 0.0
