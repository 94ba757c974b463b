"""The week-long 256-GPU run model on hand-made interruptions whose outcomes are worked out exactly, and the
benchmark."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from bench import long_run_sim
from bench.harness import RESULTS_ENV
from bench.sim.long_run import (
    LLAMA3_PER_GPU_HOUR,
    Interruption,
    LongRunError,
    Policy,
    RunConfig,
    interruptions,
    policies,
    simulate,
)
from bench.sim.trace import young_daly_hours

# 4 nodes, a day, round costs: save 0.1 h every 1 h of training, relaunch 0.2 h, load 0.1 h, reshard 0.05 h,
# a lost node noticed after 0.1 h, a hang timeout of 0.1 h (watchdog) or 600 s (process group).
SMALL = RunConfig(
    nodes=4,
    hours=24.0,
    checkpoint_hours=1.0,
    save_seconds=360,
    relaunch_seconds=720,
    in_job_restart_seconds=180,
    load_seconds=360,
    reshard_seconds=180,
    node_notready_seconds=360,
    hang_floor_seconds=360,
)
WAIT = Policy("wait_and_timeout", min_nodes=2, bound_seconds=360)
SMALLER = Policy("continue_smaller_only", continue_smaller=True, min_nodes=2, bound_seconds=360)
DETECT = Policy("hang_detection_only", hang_detection=True, min_nodes=2)


def accounted(result) -> float:
    return sum(result.hours.values())


def test_without_failures_the_ratio_is_one_minus_the_checkpoint_overhead() -> None:
    cfg = RunConfig()
    result = simulate(cfg, policies()["mechanisms_on"], events=[])
    tau = math.sqrt(2 * 60.0 * (1 / (8 * LLAMA3_PER_GPU_HOUR)) * 3600 / 32) / 3600  # Young/Daly at 32 nodes, hours
    assert tau == pytest.approx(2.569, abs=1e-3)
    cycle = tau + 60 / 3600
    full = math.floor(168.0 / cycle)
    expected = (full * tau + min(168.0 - full * cycle, tau)) / 168.0
    assert result.ratio == pytest.approx(expected, rel=1e-9)
    assert result.ratio == pytest.approx(1 - (60 / 3600) / cycle, abs=3e-4)  # 0.9936: the save share of each cycle
    assert result.counts["saves"] == full


def test_a_lost_node_worked_out_exactly_waiting_and_continuing_smaller() -> None:
    loss = [Interruption(5.35, "node_loss", strike=0.0, replacement_hours=3.0)]
    wait = simulate(SMALL, WAIT, events=loss)
    # 4 committed hours, 0.95 h lost at 5.35; noticed 5.45; waits to 8.35; restarts 0.3 h; then 13 cycles and 1 h from
    # 8.65
    assert wait.hours["progress"] == pytest.approx(18.0)
    assert (wait.hours["lost"], wait.hours["waiting"], wait.hours["restarting"]) == pytest.approx((0.95, 2.9, 0.3))
    smaller = simulate(SMALL, SMALLER, events=loss)
    # bound ends 5.55; resumes at 3 nodes (0.35 h with the reshard) at 5.90; at 3/4 (two saves) until the replacement
    # at 8.35, when a checkpoint is written (to 8.45) and the gang grows back (0.35 h) at 8.80; 13 cycles and 0.9 h to
    # 24
    assert smaller.hours["progress"] == pytest.approx(4 + 0.75 * 2.25 + 13.9)
    assert (smaller.hours["smaller"], smaller.hours["waiting"], smaller.hours["restarting"]) == pytest.approx(
        (0.25 * 2.25, 0.1, 0.7)
    )
    assert (smaller.counts["shrinks"], smaller.counts["grows"]) == (1, 1)
    assert [size for _, what, size, _ in smaller.log if what == "training"] == [3, 4]
    at_save = simulate(SMALL, dataclasses.replace(SMALLER, grow="next_save"), events=loss)
    # the same, but it grows back only after the scheduled save at 9.1-9.2, training at 3/4 until then; back at 9.55
    assert at_save.hours["progress"] == pytest.approx(4 + 0.75 * 3 + 13.15)
    assert [size for _, what, size, _ in at_save.log if what == "training"] == [3, 4]
    for r in (wait, smaller, at_save):
        assert accounted(r) == pytest.approx(24.0)


def test_checkpoints_follow_the_young_daly_interval_of_the_current_size() -> None:
    cfg = dataclasses.replace(SMALL, hours=168.0, checkpoint_hours=None, save_seconds=60.0)
    assert cfg.checkpoint_interval_hours(4) == pytest.approx(
        young_daly_hours(60 / 3600, cfg.node_mtbf_hours, 4)
    )  # 7.3 h
    assert cfg.checkpoint_interval_hours(2) == pytest.approx(cfg.checkpoint_interval_hours(4) * math.sqrt(2))
    # two nodes lost for good: 5 saves at 4 nodes before 40 h, then 3 nodes for an hour, then 2 nodes to the end
    loss = [
        Interruption(40.0, "node_loss", strike=0.0, replacement_hours=200.0),
        Interruption(41.0, "node_loss", strike=0.0, replacement_hours=200.0),
    ]
    result = simulate(cfg, SMALLER, events=loss)
    assert [size for _, what, size, _ in result.log if what == "training"] == [3, 2]
    for size in (4, 2):
        saves = [t for t, what, s, _ in result.log if what == "checkpoint committed" and s == size]
        gaps = [b - a for a, b in zip(saves, saves[1:])]
        assert len(gaps) >= 2
        assert gaps == pytest.approx([cfg.checkpoint_interval_hours(size) + 60 / 3600] * len(gaps))


def test_a_silent_hang_waits_for_a_person_without_detection_and_for_the_watchdog_with_it() -> None:
    hang = [Interruption(2.5, "hang", strike=0.0, silent=True, notice_hours=5.0)]
    wait, detect = simulate(SMALL, WAIT, events=hang), simulate(SMALL, DETECT, events=hang)
    assert wait.hours["hung"] == pytest.approx(5.0) and wait.hours["restarting"] == pytest.approx(0.3)  # a relaunch
    assert detect.hours["hung"] == pytest.approx(0.1) and detect.hours["restarting"] == pytest.approx(
        0.15
    )  # in the job
    assert wait.counts["silent_hangs"] == detect.counts["silent_hangs"] == 1
    assert detect.ratio - wait.ratio > 4.5 / 24
    loud = [dataclasses.replace(hang[0], silent=False)]
    assert simulate(SMALL, WAIT, events=loud).hours["hung"] == pytest.approx(600 / 3600)  # the process-group timeout


def test_with_instant_replacements_and_no_hangs_every_policy_agrees() -> None:
    cfg = RunConfig(
        per_gpu_hour=4 * LLAMA3_PER_GPU_HOUR,
        hang_share=0.0,
        free_node_share=1.0,
        free_node_minutes=0.0,
        hang_floor_seconds=340,
    )
    fired = 0
    for seed in range(30):
        ratios = {name: simulate(cfg, p, seed=seed).ratio for name, p in policies().items()}
        assert len(set(ratios.values())) == 1, (seed, ratios)
        fired += simulate(cfg, policies()["wait_and_timeout"], seed=seed).counts["node_losses"]
    assert fired > 30  # ~2.7 node losses a week at 4x the rate: the failures did fire


def test_continue_smaller_pays_off_when_replacements_wait_hours() -> None:
    cfg = RunConfig(per_gpu_hour=4 * LLAMA3_PER_GPU_HOUR, free_node_share=0.0)
    runs = long_run_sim.run_scenario(cfg, 40)
    summary = long_run_sim.summarize(runs)
    gain = summary["vs_wait_and_timeout"]["continue_smaller_only"]
    assert gain["ci_low"] > 0.0
    assert summary["policies"]["continue_smaller_only"]["mean_counts"]["shrinks"] > 1.0
    assert summary["policies"]["wait_and_timeout"]["mean_hours"]["waiting"] > 5.0
    for results in runs.values():
        for r in results:
            assert accounted(r) == pytest.approx(r.wall_hours)


def test_the_same_seed_reproduces_and_the_rate_is_the_published_one() -> None:
    cfg = RunConfig()
    streams = [interruptions(cfg, seed) for seed in range(10)]
    assert streams == [interruptions(cfg, seed) for seed in range(10)]
    assert len({tuple(s) for s in streams}) > 5  # most weeks differ (about 4 in 10 have no interruption)
    busiest = max(range(10), key=lambda seed: len(streams[seed]))
    a, b = (simulate(cfg, policies()["mechanisms_on"], seed=busiest) for _ in range(2))
    assert streams[busiest] and (a.ratio, a.hours, a.log) == (b.ratio, b.hours, b.log)
    assert LLAMA3_PER_GPU_HOUR == pytest.approx(1.973e-5, rel=1e-3)  # 419 / (54 x 24 x 16,384)
    counts = [len(interruptions(cfg, seed)) for seed in range(2000)]
    expected = 256 * LLAMA3_PER_GPU_HOUR * 168  # 0.849 a week
    assert abs(sum(counts) / len(counts) - expected) < 4 * math.sqrt(expected / len(counts))


def test_malformed_inputs_are_refused_with_the_field() -> None:
    with pytest.raises(LongRunError, match="node_loss_share"):
        RunConfig(node_loss_share=0.9, hang_share=0.2)
    with pytest.raises(LongRunError, match="kind"):
        Interruption(1.0, "meteor")  # type: ignore[arg-type]
    with pytest.raises(LongRunError, match="min_nodes"):
        simulate(SMALL, Policy("p", min_nodes=5), events=[])


def test_the_benchmark_writes_its_figures_and_targets(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(RESULTS_ENV, str(tmp_path))
    record = long_run_sim.main(["--seeds", "20"])
    assert json.loads((tmp_path / "long_run_effective_time.json").read_text())["value"] == record["value"]
    head = record["details"]["headline"]
    assert record["value"] == head["mechanisms_on"] and record["baseline"] == head["baseline"]
    assert head["mechanisms_on_ci_low"] <= head["mechanisms_on"] <= head["mechanisms_on_ci_high"]
    assert [t["metric"] for t in record["details"]["targets"]] == ["value", "details.headline.mechanisms_on_ci_low"]
    assert set(record["details"]["scenarios"]) == set(long_run_sim.scenarios())
