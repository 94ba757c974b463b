"""The streaming benchmarks (`bench.stream_throughput`, `bench.data_memory`, `bench.lm_throughput`): their verdicts,
clocks and tiny runs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench import __main__ as runner
from bench.harness import RESULTS_ENV
from bench.stream_support import paired_ratios

NEW = ("bench.stream_throughput", "bench.data_memory", "bench.lm_throughput")


def test_the_three_are_registered() -> None:
    assert set(NEW) <= set(runner.BENCHMARKS)


def test_an_interval_spanning_the_target_is_not_resolved() -> None:
    spans = paired_ratios([0.97, 0.99, 0.93, 1.01], [1.0] * 4, 0.98, "higher")
    assert spans["pair_ratios"] == pytest.approx([0.97, 0.99, 0.93, 1.01]) and spans["median"] == pytest.approx(0.98)
    assert spans["ci_low"] < 0.98 < spans["ci_high"] and spans["verdict"].startswith("not resolved")
    assert paired_ratios([1.0, 1.01, 1.0], [1.0] * 3, 0.98, "higher")["verdict"].startswith("met")
    assert paired_ratios([0.9, 0.91, 0.9], [1.0] * 3, 0.98, "higher")["verdict"].startswith("missed")
    assert paired_ratios([1.0, 1.02, 1.01], [1.0] * 3, 1.2, "lower")["verdict"].startswith("met")
    assert paired_ratios([1.0], [1.0], 1.2, "lower")["verdict"].startswith("not resolved")


def test_steady_periods_skip_the_warm_up_and_checkpoint_writes(tmp_path: Path) -> None:
    from bench.lm_throughput import BATCH, BLOCK, steady

    ends = [0.0, 1.0, 2.0, 2.1, 2.2, 2.3, 2.8, 2.9, 3.0]
    writing = [False] * 6 + [True] + [False] * 2  # the write in flight at the 7th end: periods 6 and 7 are its
    (tmp_path / "clock.json").write_text(json.dumps({"batch_end": ends, "writing": writing}))
    s = steady(str(tmp_path / "clock.json"), warmup=2)
    assert s["steady_periods"] == 4 and s["write_periods"] == 2 and s["step_ms_mean"] == pytest.approx(100.0)
    assert s["tokens_per_s"] == pytest.approx(BATCH * BLOCK / 0.1) and s["step_ms_mean_incl_writes"] == pytest.approx(
        1e3 / 6
    )


def test_stream_throughput_tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.stream_throughput import main

    monkeypatch.setenv(RESULTS_ENV, str(tmp_path))
    r = main(["--tokens", "100000", "--pairs", "2"])
    assert r["name"] == "stream_throughput" and r["value"] > 0 and r["baseline"] > 0
    assert len(r["details"]["paired"]["pair_ratios"]) == 2 and r["details"]["targets"][0]["metric"] == "ratio"
    assert (
        len(set(r["details"]["samples_per_epoch"].values())) == 1
        and len(r["details"]["like_for_like"]["pair_ratios"]) == 2
    )
    assert json.loads((tmp_path / "stream_throughput.json").read_text())["ratio"] == pytest.approx(r["ratio"])


@pytest.mark.slow
@pytest.mark.skipif(
    bool(os.environ.get("CI")),
    reason="four fresh training processes (~1 min): run with --slow or `make bench`, not in CI",
)
def test_data_memory_tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.data_memory import main

    monkeypatch.setenv(RESULTS_ENV, str(tmp_path))
    r = main(["--tokens", "20000", "--pairs", "1"])
    runs = r["details"]["runs"]
    assert r["value"] > r["details"]["rss_before_fit_mib"] > 0 and runs["x10"][0]["steps"] > runs["x1"][0]["steps"] > 0


@pytest.mark.slow
@pytest.mark.skipif(
    bool(os.environ.get("CI")),
    reason="two pairs of training processes (~1 min): run with --slow or `make bench`, not in CI",
)
def test_lm_throughput_tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.lm_throughput import main

    monkeypatch.setenv(RESULTS_ENV, str(tmp_path))
    r = main(["--steps", "12", "--warmup", "3", "--pairs", "1"])
    for side in ("platform", "bare"):
        run = r["details"]["runs"][side][0]
        assert run["steps"] == 12 and run["tokens_per_s"] > 0 and run["steady_periods"] >= 4
    assert r["ratio"] == pytest.approx(r["value"] / r["baseline"])
