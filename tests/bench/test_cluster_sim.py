"""The cluster simulator on hand-made traces whose outcomes are worked out exactly, and the benchmark's statistics."""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
from typing import Iterator

import pytest

import bench.sim.engine as engine
from bench.cluster_sim import METRICS, aggregate, nominal_figures, policies, run, targets
from bench.sim import (
    Cluster,
    Failure,
    Job,
    Policy,
    TraceConfig,
    TraceError,
    node_failures,
    simulate,
    synthetic_jobs,
    young_daly_hours,
)
from bench.sim.result import _stats, nearest_rank
from bench.sim.stats import paired_difference, t_interval
from bench.sim.trace import offered_load

FIFO = Policy("fifo")


def platform(quotas: dict[str, int], **over) -> Policy:
    return dataclasses.replace(
        Policy("platform", order="priority", backfill=True, preemption=True, quotas=quotas), **over
    )


def job(id: str, submit: float, gpus: int, work: float, priority: str = "production", team: str = "t", **kw) -> Job:
    return Job(id, team, kw.pop("kind", "test"), priority, submit, gpus, work, **kw)


def test_a_job_pays_startup_and_saves_around_its_work() -> None:
    j = job("a", 0.0, 2, 2.0, checkpoint_every=0.5, checkpoint_cost=0.1, startup_hours=0.2)
    assert j.wall_hours(2.0) == pytest.approx(2.5)  # 0.2 startup + 2.0 work + 3 saves between the 4 intervals
    o = simulate([j], [], Cluster(1, 4), FIFO, 10.0).outcomes["a"]
    assert o.finished == pytest.approx(2.5) and o.first_start == 0.0
    assert (o.allocated, o.useful, o.overhead, o.lost) == pytest.approx((5.0, 4.0, 1.0, 0.0))


def _blocking_trace(c_work: float) -> list[Job]:
    return [job("a", 0.0, 4, 4.0), job("b", 1.0, 8, 1.0), job("c", 2.0, 2, c_work)]


def test_fifo_blocks_behind_the_head_and_backfill_does_not() -> None:
    cluster = Cluster(2, 4)
    fifo = simulate(_blocking_trace(1.0), [], cluster, FIFO, 20.0).outcomes
    assert (fifo["b"].first_start, fifo["c"].first_start) == (4.0, 5.0)
    no_backfill = simulate(
        _blocking_trace(1.0), [], cluster, platform({}, backfill=False, preemption=False), 20.0
    ).outcomes
    assert no_backfill["c"].first_start == 5.0
    backfill = simulate(_blocking_trace(1.0), [], cluster, platform({}, preemption=False), 20.0).outcomes
    assert (backfill["b"].first_start, backfill["c"].first_start) == (
        4.0,
        2.0,
    )  # c ends at 3, before b's reservation at 4


def test_backfill_never_delays_the_reserved_job() -> None:
    out = simulate(_blocking_trace(3.0), [], Cluster(2, 4), platform({}, preemption=False), 20.0).outcomes
    assert (out["b"].first_start, out["c"].first_start) == (4.0, 5.0)  # c would end at 5, after b's start
    unreserved = simulate(
        _blocking_trace(3.0), [], Cluster(2, 4), platform({}, preemption=False, reserve=False), 20.0
    ).outcomes
    assert (unreserved["c"].first_start, unreserved["b"].first_start) == (
        2.0,
        5.0,
    )  # without a reservation c goes first


def _preemption_trace() -> list[Job]:
    return [
        job("s", 0.0, 4, 10.0, "sweep", checkpoint_every=1.0, checkpoint_cost=0.1),
        job("i", 2.5, 4, 1.0, "interactive"),
    ]


def test_interactive_preempts_a_sweep_that_saves_first_and_resumes() -> None:
    result = simulate(_preemption_trace(), [], Cluster(1, 4), platform({"t": 4}), 20.0)
    s, i = result.outcomes["s"], result.outcomes["i"]
    # at 2.5 the sweep has committed 2.0 h and done 0.3 h more: it saves for 0.1 h, then i starts
    assert i.first_start == pytest.approx(2.6) and i.finished == pytest.approx(3.6)
    assert s.preemptions == 1 and s.starts == 2
    assert s.finished == pytest.approx(3.6 + 7.7 + 7 * 0.1)  # the remaining 7.7 h with 7 saves
    assert (s.useful, s.lost) == pytest.approx((40.0, 0.0))
    assert s.overhead == pytest.approx((2 + 1 + 7) * 0.1 * 4)  # saves before, the preemption save, saves after
    assert s.allocated == pytest.approx(s.useful + s.overhead)
    assert result.summary()["preemptions_by_reason"] == {"priority": 1}


def test_fifo_makes_the_interactive_job_wait_for_the_sweep() -> None:
    out = simulate(_preemption_trace(), [], Cluster(1, 4), FIFO, 20.0).outcomes
    assert out["i"].first_start == pytest.approx(10.9) and out["s"].preemptions == 0


def test_only_preemptible_classes_are_preempted() -> None:
    trace = [job("p", 0.0, 4, 10.0, "production", checkpoint_every=1.0), job("i", 2.5, 4, 1.0, "interactive")]
    assert simulate(trace, [], Cluster(1, 4), platform({"t": 4}), 20.0).outcomes["i"].first_start == 10.0
    anyone = platform({"t": 4}, preemptible=("sweep", "production"))
    assert simulate(trace, [], Cluster(1, 4), anyone, 20.0).outcomes["i"].first_start == 2.5  # its saves cost nothing


def test_a_team_reclaims_its_quota_from_a_borrowing_team() -> None:
    trace = [
        job("a", 0.0, 8, 10.0, "sweep", team="a", checkpoint_every=1.0),
        job("b", 1.0, 4, 1.0, "sweep", team="b"),
    ]
    result = simulate(trace, [], Cluster(1, 8), platform({"a": 4, "b": 4}), 20.0)
    out = result.outcomes
    assert out["b"].first_start == 1.0 and out["a"].preemptions == 1
    assert out["a"].finished == pytest.approx(2.0 + 9.0)  # back when b is done, 9 h of work left
    assert result.summary()["preemptions_by_reason"] == {"reclaim": 1}


def test_a_job_within_its_quota_is_not_reclaimed() -> None:
    trace = [job("a", 0.0, 4, 10.0, "sweep", team="a", checkpoint_every=1.0), job("b", 1.0, 8, 1.0, "sweep", team="b")]
    out = simulate(trace, [], Cluster(1, 8), platform({"a": 4, "b": 4}), 20.0).outcomes
    assert out["a"].preemptions == 0 and out["b"].first_start == 10.0


def test_a_node_failure_loses_work_since_the_last_checkpoint() -> None:
    g = job("g", 0.0, 4, 5.0, checkpoint_every=1.0, startup_hours=0.5)
    result = simulate([g], [Failure(3.2, 0)], Cluster(1, 4, repair_hours=1.0), FIFO, 20.0)
    o = result.outcomes["g"]
    # 0.5 h startup, 2.7 h of work of which 2.0 committed; back at 4.2, 3 h of work left after another startup
    assert o.failures == 1 and o.finished == pytest.approx(4.2 + 0.5 + 3.0)
    assert (o.useful, o.lost, o.overhead) == pytest.approx((20.0, 0.7 * 4, 1.0 * 4))
    assert o.allocated == pytest.approx(o.useful + o.lost + o.overhead)
    summary = result.summary()
    assert summary["down_gpu_hours"] == pytest.approx(4.0) and summary["node_failures"] == 1


def test_a_job_without_checkpoints_starts_over_after_a_failure() -> None:
    o = simulate([job("n", 0.0, 1, 5.0)], [Failure(3.0, 0)], Cluster(1, 4, repair_hours=1.0), FIFO, 20.0).outcomes["n"]
    assert o.lost == pytest.approx(3.0) and o.finished == pytest.approx(9.0)


def test_work_in_progress_at_the_horizon_counts_and_waits_are_censored() -> None:
    result = simulate([job("a", 0.0, 4, 10.0), job("b", 1.0, 4, 1.0)], [], Cluster(1, 4), FIFO, 5.0)
    a, b = result.outcomes["a"], result.outcomes["b"]
    assert a.finished is None and a.useful == pytest.approx(20.0)
    assert b.first_start is None and b.wait(5.0) == 4.0
    summary = result.summary()
    assert summary["never_started"] == 1 and summary["utilization"] == pytest.approx(1.0)
    assert summary["wait_hours"]["production"] == {"n": 2, "mean": 2.0, "p50": 0.0, "p95": 4.0, "max": 4.0}


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: simulate([job("g", 0, 6, 1.0)], [], Cluster(2, 4), FIFO, 1.0),
            "a gang of 6 gpus must use whole nodes of 4",
        ),
        (lambda: simulate([job("g", 0, 16, 1.0)], [], Cluster(2, 4), FIFO, 1.0), "needs 16 gpus, the cluster has 8"),
        (lambda: simulate([], [Failure(1.0, 5)], Cluster(2, 4), FIFO, 1.0), "node 5 is not in 0..1"),
        (lambda: job("x", 0, 1, 1.0, priority="urgent"), "priority 'urgent' is not one of"),
        (lambda: job("x", 0, 1, 0.0), "work must be > 0 hours"),
        (lambda: Policy("p", backfill=True), "backfill and preemption need order 'priority'"),
        (
            lambda: simulate([job("a", 0, 1, 1.0), job("a", 1, 1, 1.0)], [], Cluster(1, 4), FIFO, 1.0),
            "job id 'a' appears twice",
        ),
    ],
)
def test_malformed_traces_name_the_field(build, message: str) -> None:
    with pytest.raises(TraceError, match=message.replace("(", r"\(")):
        build()


def test_young_daly_interval_is_exact() -> None:
    assert young_daly_hours(0.05, 1500.0, 10) == pytest.approx(math.sqrt(15.0))


def test_stats_use_nearest_rank_percentiles() -> None:
    assert _stats([4.0, 1.0, 3.0, 2.0]) == {"n": 4, "mean": 2.5, "p50": 2.0, "p95": 4.0, "max": 4.0}


SMALL = TraceConfig(
    days=3,
    nodes=4,
    gpus_per_node=4,
    quotas={"language": 8, "vision": 4, "ranking": 2, "speech": 1, "tabular": 1},
    trials_per_sweep=(2, 4),
    gang_gpus=(8,),
    gang_days=(1.0, 1.0),
    node_mtbf_hours=50.0,
    repair_hours=2.0,
)


def test_synthetic_traces_are_deterministic_per_seed() -> None:
    assert synthetic_jobs(SMALL, 3) == synthetic_jobs(SMALL, 3) != synthetic_jobs(SMALL, 4)
    assert node_failures(4, 50.0, 72.0, 3) == node_failures(4, 50.0, 72.0, 3)
    kinds = {j.kind for j in synthetic_jobs(SMALL, 3)}
    assert kinds == {"gbt", "sweep", "interactive", "gang"}


def test_every_policy_accounts_for_every_gpu_hour() -> None:
    jobs, failures = synthetic_jobs(SMALL, 1), node_failures(SMALL.nodes, SMALL.node_mtbf_hours, SMALL.horizon, 1)
    assert failures
    for policy in [*policies(SMALL, ablations=True).values(), FIFO]:
        result = simulate(jobs, failures, SMALL.cluster(), policy, SMALL.horizon)
        for o in result.outcomes.values():
            assert o.allocated == pytest.approx(o.useful + o.lost + o.overhead, abs=1e-9), (policy.name, o.job.id)
        summary = result.summary()
        assert 0 < summary["effective_utilization"] <= summary["utilization"] <= 1.0
        assert summary["allocated_gpu_hours"] + summary["down_gpu_hours"] <= summary["capacity_gpu_hours"] + 1e-6


def test_windowed_accounting_counts_only_what_happens_after_the_warm_up() -> None:
    trace = [job("a", 0.0, 4, 10.0, checkpoint_every=1.0), job("b", 2.0, 4, 2.0), job("c", 7.0, 4, 5.0)]
    result = simulate(trace, [], Cluster(2, 4), FIFO, 10.0, warmup=4.0)
    a, b, c = (result.outcomes[k] for k in "abc")
    assert (a.allocated, a.allocated_window, a.useful_window) == pytest.approx((40.0, 24.0, 24.0))
    assert (b.allocated_window, b.useful_window) == (0.0, 0.0)  # ran 2 -> 4, all before the window
    assert (c.allocated_window, c.useful_window) == pytest.approx((12.0, 12.0))  # in progress at the horizon
    m = result.metrics()
    assert m["utilization"] == pytest.approx(36.0 / 48.0) and m["effective_utilization"] == pytest.approx(36.0 / 48.0)
    assert m["unfinished"] == 1.0  # only c was submitted after the warm-up; a and b are not measured
    assert m["p95_completion_hours"] == pytest.approx(3.0)  # c: censored at the horizon, 10 - 7
    with pytest.raises(TraceError, match="warmup=10.0 must be in"):
        simulate(trace, [], Cluster(2, 4), FIFO, 10.0, warmup=10.0)


# -- Kueue's queueing strategies -------------------------------------------------------------------

STRICT, BEST_EFFORT = Policy("strict", order="strict_fifo"), Policy("best_effort", order="best_effort_fifo")


def _head_of_line_trace() -> list[Job]:
    # `big` needs both nodes while `a` holds one; `small` fits on the other node at once.
    return [job("a", 0.0, 4, 4.0), job("big", 1.0, 8, 1.0), job("small", 2.0, 2, 10.0)]


def test_best_effort_fifo_lets_a_small_job_pass_a_blocked_big_one() -> None:
    out = simulate(_head_of_line_trace(), [], Cluster(2, 4), BEST_EFFORT, 30.0).outcomes
    assert out["small"].first_start == 2.0
    # no reservation: the small job's 10 hours keep the big one waiting until it ends
    assert out["big"].first_start == 12.0


def test_strict_fifo_blocks_the_small_job_behind_the_big_one() -> None:
    out = simulate(_head_of_line_trace(), [], Cluster(2, 4), STRICT, 30.0).outcomes
    assert (out["big"].first_start, out["small"].first_start) == (4.0, 5.0)


def test_kueue_strategies_order_by_priority_class_then_arrival() -> None:
    trace = [job("a", 0.0, 4, 4.0), job("s", 1.0, 4, 1.0, "sweep"), job("p", 2.0, 4, 1.0, "production"),
             job("i", 3.0, 4, 1.0, "interactive")]
    for policy in (STRICT, BEST_EFFORT):
        out = simulate(trace, [], Cluster(1, 4), policy, 30.0).outcomes
        assert [out[k].first_start for k in ("i", "p", "s")] == [4.0, 5.0, 6.0], policy.name


def test_strict_fifo_blocks_lower_classes_behind_a_blocked_higher_one() -> None:
    trace = [job("a", 0.0, 4, 4.0), job("big", 1.0, 8, 1.0, "interactive"), job("small", 2.0, 2, 1.0, "sweep")]
    strict = simulate(trace, [], Cluster(2, 4), STRICT, 30.0).outcomes
    best = simulate(trace, [], Cluster(2, 4), BEST_EFFORT, 30.0).outcomes
    assert (strict["big"].first_start, strict["small"].first_start) == (4.0, 5.0)
    assert (best["small"].first_start, best["big"].first_start) == (2.0, 4.0)


def test_a_preemption_never_places_the_preemptor_on_a_reserved_node() -> None:
    trace = [
        job("r", 0.0, 4, 10.0),  # node 0 until 10
        job("sw", 0.0, 4, 50.0, "sweep", team="u", checkpoint_every=1.0),  # node 1, borrowing: u has no quota
        job("y", 0.0, 2, 10.0, team="w"),  # node 2 until 10
        job("g", 1.0, 8, 5.0),  # a gang: reclaiming node 1 is not enough, so it reserves nodes 0 and 2 from 10
        job("late", 2.0, 2, 20.0),  # node 2 has room, but it would hold it past 10: it reclaims node 1 instead
    ]
    result = simulate(trace, [], Cluster(3, 4), platform({"t": 16}), 60.0)
    out = result.outcomes
    assert (out["late"].first_start, out["g"].first_start) == (2.0, 10.0)
    assert out["sw"].preemptions == 1 and result.preemptions == {"reclaim": 1}
    # late took node 1 from sw at 2, and sw waited until g freed a whole node at 15 (had late gone on reserved
    # node 2, g could only have started at 10 by reclaiming node 1 from sw then: sw would have waited 10 -> 15)
    assert out["sw"].queued == pytest.approx(13.0)


def _in_arrival_order(lists: list[list[tuple[float, str]]]) -> Iterator[str]:
    """Ids of the (submit, id) entries of the sorted `lists`, in order, while the caller takes entries out of them."""
    heap = [(q[0], i) for i, q in enumerate(lists) if q]
    heapq.heapify(heap)
    while heap:
        key, i = heapq.heappop(heap)
        yield key[1]
        nxt = bisect.bisect_right(lists[i], key)
        if nxt < len(lists[i]):
            heapq.heappush(heap, (lists[i][nxt], i))


def _reference_walk(self, lists, rank, now, st, can_preempt) -> bool:
    """The platform pass's walk over queues as the plain loop its shortcut must match: a look at every job in order."""
    for jid in _in_arrival_order([q for _, _, q in lists]):
        if jid in self._requeued:
            continue
        if st.blocked >= self.p.max_blocked or not self._consider(self.pending[jid], now, st, can_preempt):
            return False
    return True


MEDIUM = TraceConfig(
    days=5,
    nodes=16,
    quotas={"language": 64, "vision": 24, "ranking": 16, "speech": 16, "tabular": 8},
    gang_gpus=(16, 32, 64),
    node_mtbf_hours=300.0,
)


@pytest.mark.parametrize(
    ("cfg", "seed", "over"),
    [
        (dataclasses.replace(SMALL, load=1.2, days=4), 5, {}),
        (dataclasses.replace(SMALL, load=0.8, days=4), 7, {"backfill": False}),
        (dataclasses.replace(MEDIUM, load=0.7), 0, {}),
        (dataclasses.replace(MEDIUM, load=1.0), 2, {"max_blocked": 5}),
        (dataclasses.replace(MEDIUM, load=1.3), 1, {}),
        (dataclasses.replace(MEDIUM, load=1.1), 3, {"reserve": False}),
    ],
)
def test_the_pass_shortcut_decides_like_a_look_at_every_job(
    monkeypatch: pytest.MonkeyPatch, cfg: TraceConfig, seed: int, over: dict
) -> None:
    jobs, failures = synthetic_jobs(cfg, seed), node_failures(cfg.nodes, cfg.node_mtbf_hours, cfg.horizon, seed)
    policy = platform(dict(cfg.quotas), **over)
    fast = simulate(jobs, failures, cfg.cluster(), policy, cfg.horizon)
    monkeypatch.setattr(engine._Sim, "_walk", _reference_walk)
    slow = simulate(jobs, failures, cfg.cluster(), policy, cfg.horizon)
    starts = lambda r: [(o.job.id, o.first_start, o.finished, o.preemptions) for o in r.outcomes.values()]
    assert starts(fast) == starts(slow)
    assert sum(o.first_start is not None for o in fast.outcomes.values()) > len(jobs) // 2 and fast.preemptions


# -- the trace and the benchmark's statistics ------------------------------------------------------


def test_trace_rates_give_the_offered_load_asked_for() -> None:
    cfg = dataclasses.replace(SMALL, days=30, gang_days=(0.5, 1.0), exact_load=False)
    for load in (0.5, 1.0):
        c = dataclasses.replace(cfg, load=load)
        realised = [offered_load(synthetic_jobs(c, seed), c.cluster(), c.horizon) for seed in range(4)]
        assert sum(realised) / len(realised) == pytest.approx(load, rel=0.1)
        assert len({round(r, 6) for r in realised}) == 4
        exact = dataclasses.replace(c, exact_load=True)
        assert [
            offered_load(synthetic_jobs(exact, seed), c.cluster(), c.horizon) for seed in range(4)
        ] == pytest.approx([load] * 4)
    with pytest.raises(TraceError, match="mix must give a share"):
        TraceConfig(mix={"gang": 1.0})
    with pytest.raises(TraceError, match="no gang team"):
        TraceConfig(gang_gpus=(512,))


def test_t_interval_matches_the_t_table() -> None:
    ci = t_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    half = 2.776445 * math.sqrt(2.5) / math.sqrt(5)  # t(0.975, 4 degrees of freedom) from a t-table
    assert (ci["n"], ci["mean"], ci["sd"]) == (5, 3.0, pytest.approx(math.sqrt(2.5)))
    assert (ci["ci_low"], ci["ci_high"]) == pytest.approx((3.0 - half, 3.0 + half), abs=1e-5)
    wide = t_interval([1.0, 3.0], confidence=0.9)  # t(0.95, 1) = 6.313752
    assert (wide["ci_low"], wide["ci_high"]) == pytest.approx((2.0 - 6.313752, 2.0 + 6.313752), abs=1e-5)
    same = t_interval([0.5, 0.5, 0.5])
    assert same["ci_low"] == same["ci_high"] == 0.5
    with pytest.raises(ValueError, match="at least two values"):
        t_interval([1.0])


def test_paired_difference_cancels_what_the_seeds_share() -> None:
    a, b = [10.0, 20.0, 30.0], [9.0, 19.1, 28.9]  # seeds differ a lot; a - b hardly does
    d = paired_difference(a, b)
    assert d["mean"] == pytest.approx(1.0) and d == t_interval([10.0 - 9.0, 20.0 - 19.1, 30.0 - 28.9])
    assert d["ci_low"] > 0 > t_interval(a)["ci_low"] - t_interval(b)["ci_high"]
    with pytest.raises(ValueError, match="as many values"):
        paired_difference([1.0, 2.0], [1.0])


def test_nearest_rank_p95() -> None:
    assert nearest_rank(list(range(1, 21)), 0.95) == 19 and nearest_rank(list(range(1, 101)), 0.95) == 95
    assert nearest_rank([3.0], 0.95) == 3.0


def test_benchmark_on_a_tiny_cluster_with_two_seeds() -> None:
    runs = run(SMALL, [0.9], seeds=2, warmup=12.0)
    assert [(r["load"], r["seed"]) for r in runs] == [(0.9, 0), (0.9, 1)]
    again = run(SMALL, [0.9], seeds=2, warmup=12.0)
    assert [r["policies"] for r in runs] == [r["policies"] for r in again]  # a seed names a trace and its outcome
    by_load = aggregate(runs)
    at = by_load["0.9"]
    assert set(at["policies"]) == {"strict_fifo", "best_effort_fifo", "platform"}
    for name, stats in at["policies"].items():
        assert set(stats) == set(METRICS)
        for metric, s in stats.items():
            per_seed = [r["policies"][name][metric] for r in runs]
            assert s["per_seed"] == per_seed and s["mean"] == pytest.approx(t_interval(per_seed)["mean"])
            assert s["ci_low"] == pytest.approx(t_interval(per_seed)["ci_low"])
    diff = at["vs_best_effort_fifo"]["platform"]["effective_utilization"]
    assert diff == paired_difference(
        *[[r["policies"][p]["effective_utilization"] for r in runs] for p in ("platform", "best_effort_fifo")]
    )
    figures = nominal_figures(by_load)
    goals = targets(figures)
    assert [g["metric"] for g in goals] == [
        "details.nominal.platform_effective_utilization",
        "details.nominal.effective_utilization_gain_ci_low",
        "details.nominal.p95_gang_start_change_hours_ci_high",
    ]
    assert goals[1]["value"] == diff["ci_low"] and goals[1]["met"] == (diff["ci_low"] >= 0)
    assert goals[0]["met"] == (figures["platform_effective_utilization"] >= 0.9)
