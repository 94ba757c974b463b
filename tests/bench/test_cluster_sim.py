"""The cluster simulator on hand-made traces whose outcomes are worked out exactly."""

from __future__ import annotations

import dataclasses
import math

import pytest

from bench.cluster_sim import policies, run
from bench.sim import Cluster, Failure, Job, Policy, TraceConfig, TraceError, node_failures, simulate, synthetic_jobs, young_daly_hours
from bench.sim.engine import _stats

FIFO = Policy("fifo")


def platform(quotas: dict[str, int], **over) -> Policy:
    return dataclasses.replace(Policy("platform", order="priority", backfill=True, preemption=True, quotas=quotas), **over)


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
    no_backfill = simulate(_blocking_trace(1.0), [], cluster, platform({}, backfill=False, preemption=False), 20.0).outcomes
    assert no_backfill["c"].first_start == 5.0
    backfill = simulate(_blocking_trace(1.0), [], cluster, platform({}, preemption=False), 20.0).outcomes
    assert (backfill["b"].first_start, backfill["c"].first_start) == (4.0, 2.0)  # c ends at 3, before b's reservation at 4


def test_backfill_never_delays_the_reserved_job() -> None:
    out = simulate(_blocking_trace(3.0), [], Cluster(2, 4), platform({}, preemption=False), 20.0).outcomes
    assert (out["b"].first_start, out["c"].first_start) == (4.0, 5.0)  # c would end at 5, after b's start


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
        (lambda: simulate([job("g", 0, 6, 1.0)], [], Cluster(2, 4), FIFO, 1.0), "a gang of 6 gpus must use whole nodes of 4"),
        (lambda: simulate([job("g", 0, 16, 1.0)], [], Cluster(2, 4), FIFO, 1.0), "needs 16 gpus, the cluster has 8"),
        (lambda: simulate([], [Failure(1.0, 5)], Cluster(2, 4), FIFO, 1.0), "node 5 is not in 0..1"),
        (lambda: job("x", 0, 1, 1.0, priority="urgent"), "priority 'urgent' is not one of"),
        (lambda: job("x", 0, 1, 0.0), "work must be > 0 hours"),
        (lambda: Policy("p", backfill=True), "backfill and preemption need order 'priority'"),
        (lambda: simulate([job("a", 0, 1, 1.0), job("a", 1, 1, 1.0)], [], Cluster(1, 4), FIFO, 1.0), "job id 'a' appears twice"),
    ],
)
def test_malformed_traces_name_the_field(build, message: str) -> None:
    with pytest.raises(TraceError, match=message.replace("(", r"\(")):
        build()


def test_young_daly_interval_is_exact() -> None:
    assert young_daly_hours(0.05, 1500.0, 10) == pytest.approx(math.sqrt(15.0))


def test_stats_use_nearest_rank_percentiles() -> None:
    assert _stats([4.0, 1.0, 3.0, 2.0]) == {"n": 4, "mean": 2.5, "p50": 2.0, "p95": 4.0, "max": 4.0}


SMALL = TraceConfig(days=3, nodes=4, gpus_per_node=4, quotas={"language": 8, "vision": 4, "ranking": 2, "speech": 1, "tabular": 1},
                    gbt_per_day=20, sweeps_per_day=3, trials_per_sweep=(2, 4), interactive_per_day=6, gangs=1, gang_nodes=(2, 2),
                    gang_days=(1.0, 1.0), node_mtbf_hours=50.0, repair_hours=2.0)


def test_synthetic_traces_are_deterministic_per_seed() -> None:
    assert synthetic_jobs(SMALL, 3) == synthetic_jobs(SMALL, 3) != synthetic_jobs(SMALL, 4)
    assert node_failures(4, 50.0, 72.0, 3) == node_failures(4, 50.0, 72.0, 3)
    kinds = {j.kind for j in synthetic_jobs(SMALL, 3)}
    assert kinds == {"gbt", "sweep", "interactive", "gang"}


def test_every_policy_accounts_for_every_gpu_hour() -> None:
    jobs, failures = synthetic_jobs(SMALL, 1), node_failures(SMALL.nodes, SMALL.node_mtbf_hours, SMALL.horizon, 1)
    assert failures
    for policy in policies(SMALL).values():
        result = simulate(jobs, failures, SMALL.cluster(), policy, SMALL.horizon)
        for o in result.outcomes.values():
            assert o.allocated == pytest.approx(o.useful + o.lost + o.overhead, abs=1e-9), (policy.name, o.job.id)
        summary = result.summary()
        assert 0 < summary["effective_utilization"] <= summary["utilization"] <= 1.0
        assert summary["allocated_gpu_hours"] + summary["down_gpu_hours"] <= summary["capacity_gpu_hours"] + 1e-6


def test_benchmark_run_reports_every_policy_and_interval() -> None:
    first, again = run(SMALL, 2), run(SMALL, 2)
    for details in (first, again):
        for summary in details["policies"].values():
            summary.pop("seconds")
    assert first == again
    assert set(first["policies"]) == {"fifo", "platform", "platform_no_preemption", "platform_preempt_all_classes"}
    assert set(first["gang_checkpoint_interval"]) == {"young_daly", "1h", "12h"}
