"""The file barrier the concurrency tests rely on: it holds until two are in, counts the peak, and times out."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tests.support.barrier import BarrierTimeout, FileBarrier


def test_opens_when_two_are_inside_and_counts_the_peak(tmp_path: Path) -> None:
    barrier = FileBarrier(tmp_path, parties=2, timeout=30)
    entered: list[int] = []
    second_inside = threading.Event()

    def first() -> None:
        with barrier.inside("a") as count:
            entered.append(count)
            assert second_inside.wait(30)

    thread = threading.Thread(target=first)
    thread.start()
    for _ in range(3000):  # "a" counted itself in before "b" arrives, so the counts are 1 then 2
        if barrier.peak() == 1:
            break
        time.sleep(0.01)
    with barrier.inside("b") as count:
        entered.append(count)
        second_inside.set()
        thread.join(30)
    assert sorted(entered) == [1, 2] and barrier.is_open() and barrier.peak() == 2
    with barrier.inside("c") as count:  # open for good: a later trial passes alone
        assert count == 1
    assert barrier.inside_now() == [] and barrier.peak() == 2


def test_a_lone_trial_times_out_on_the_injected_clock(tmp_path: Path) -> None:
    now = [0.0]
    barrier = FileBarrier(
        tmp_path, parties=2, timeout=5, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s)
    )
    with pytest.raises(BarrierTimeout, match=r"a: barrier .* waited 5 s for 2 trials at once; inside: \['a'\]"):
        with barrier.inside("a"):
            pass
    assert barrier.inside_now() == [] and not barrier.is_open()
    with pytest.raises(ValueError, match="parties=0"):
        FileBarrier(tmp_path, parties=0)
