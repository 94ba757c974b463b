"""Hung and slow ranks: the watchdog's rules, its agent half on a real blocked process, and the drills under
torchrun."""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from resources.k8s.config import K8sJobConfig
from resources.k8s.supervisor import avoid_reported_nodes
from resources.launch_errors import nodes_to_avoid, outcome_error, read_watchdog_events
from resources.launcher import LocalLauncher
from tests.support.train_specs import make_spec
from training.attempts import read_attempts
from training.spec import (
    HANG_ACTION_SECONDS,
    LAUNCH_ID_ENV,
    CheckpointPolicy,
    Distribution,
    FaultInjection,
    WatchdogPolicy,
)
from training.watchdog import (
    BACKWARD,
    FORWARD,
    STEP_END,
    GangWatchdog,
    Progress,
    culprit,
    innermost_frames,
    read_progress,
    stragglers,
)

# What the drill test allows from the hang to the first resumed step beyond the hang timeout: the agent's poll
# (0.5 s), the stack dumps (at most 3 s), torchrun noticing the kill (0.1 s) and a fresh worker group's start to its
# first step (imports, process group, checkpoint load): 35 s measured with two cores shared by five test runs. A bound
# for a loaded machine, far below the 1,800 s collective timeout that would end an unhandled hang; how fast a hang is
# recovered is `make bench`'s hang_detect_seconds, not this test's verdict.
RESTART_BOUND_SECONDS = 300.0


def test_the_hang_timeout_scales_with_the_step_time_above_a_floor_and_below_the_collective_timeout() -> None:
    policy = WatchdogPolicy(hang_floor_seconds=300, hang_step_multiple=20, collective_timeout_seconds=1800)
    assert policy.hang_timeout(0.5) == 300  # the floor
    assert policy.hang_timeout(30.0) == 600  # 20 steps
    assert policy.hang_timeout(120.0) == 1800 - HANG_ACTION_SECONDS  # capped: the collective must not time out first
    assert policy.hang_timeout(None) is None  # before the first step: unbounded by default
    assert WatchdogPolicy(hang_startup_seconds=900).hang_timeout(None) == 900
    with pytest.raises(
        ValueError, match=r"collective_timeout_seconds=300 must be at least hang_floor_seconds \(300\) \+ 60 s"
    ):
        WatchdogPolicy(collective_timeout_seconds=300)


def test_a_straggler_is_slower_than_the_others_median_by_the_factor_and_by_a_share_of_the_step() -> None:
    assert stragglers({0: 0.010, 1: 0.012, 2: 0.011, 3: 0.030}, step_seconds=0.05, factor=1.5) == {3: 0.011}
    assert stragglers({0: 0.010, 1: 0.014}, step_seconds=0.05, factor=1.5) == {}  # 1.4x: within the factor
    # 3x slower, but 0.2 ms of a 1 s step: nobody waits for it in a way that matters
    assert stragglers({0: 0.0001, 1: 0.0003}, step_seconds=1.0, factor=1.5) == {}
    assert stragglers({0: 0.3}, step_seconds=0.3, factor=1.5) == {}  # nothing to compare with


def _progress(rank: int, step: int, phase: int, at: float) -> Progress:
    return Progress(rank, 100 + rank, 0, step, phase, step, step, at, 0.0, 0.0, 0.0)


def test_the_rank_furthest_behind_is_blamed_and_its_main_thread_frames_are_read_from_a_real_dump(
    tmp_path: Path,
) -> None:
    waiting = {0: _progress(0, 7, BACKWARD, 10.0), 1: _progress(1, 7, FORWARD, 10.2), 2: _progress(2, 7, BACKWARD, 9.0)}
    assert culprit(waiting) == 1  # never reached the all-reduce the others wait in
    assert culprit({0: _progress(0, 7, STEP_END, 10.0), 1: _progress(1, 6, BACKWARD, 10.0)}) == 1  # a step behind
    path = tmp_path / "dump.txt"
    with open(path, "w") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
    frames = innermost_frames(path.read_text())
    assert (
        frames
        and "test_hang.py" in frames[0]
        and frames[0].endswith(
            "in test_the_rank_furthest_behind_is_blamed_and_its_main_thread_frames_are_read_from_a_real_dump"
        )
    )


BLOCKED_WORKER = textwrap.dedent(
    """
    import os, sys, threading, time
    from training.watchdog import STEP_END, ProgressRecord, arm_stack_dump
    directory, rank, step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    arm_stack_dump(directory, rank)
    record = ProgressRecord(directory, rank)
    record.values[ProgressRecord.STEPS] = record.values[ProgressRecord.TIMED_STEPS] = step
    record.values[ProgressRecord.GLOBAL_STEP], record.values[ProgressRecord.SUM_STEP] = step, 0.01 * step
    record.set(STEP_END, time.time())
    def stuck_in_the_data_loader():
        threading.Event().wait()
    threading.Timer(0.3, print, ("ready",), {"flush": True}).start()  # once the main thread is blocked below
    stuck_in_the_data_loader()
    """
)


def test_the_agent_names_the_hung_rank_with_its_stack_and_kills_every_worker(tmp_path: Path) -> None:
    progress, out = tmp_path / "progress", tmp_path / "trial"
    progress.mkdir()
    workers = {}
    for rank, step in ((0, 12), (1, 11)):  # rank 1 is a step behind
        workers[rank] = subprocess.Popen(
            [sys.executable, "-c", BLOCKED_WORKER, str(progress), str(rank), str(step)],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
            cwd=Path(__file__).resolve().parents[2],
        )
    try:
        for w in workers.values():
            assert w.stdout is not None and w.stdout.readline().strip() == "ready"
        said: list[str] = []
        policy = WatchdogPolicy(hang_floor_seconds=5, collective_timeout_seconds=100)
        started = time.time()
        watchdog = GangWatchdog(str(progress), policy, str(out), "launch-x", said.append, clock=lambda: started + 1)
        assert watchdog.poll() is None  # silent for about a second: not yet
        watchdog.clock = lambda: time.time() + 6
        record = watchdog.poll()
        assert record is not None
        codes = {r: w.wait(timeout=10) for r, w in workers.items()}
    finally:
        for w in workers.values():
            if w.poll() is None:
                w.kill()
    assert codes == {0: -signal.SIGKILL, 1: -signal.SIGKILL}  # the agent killed both; the test never did
    written = json.loads(next((out / "failures").glob("rank-1-hang-*.json")).read_text())
    assert written["rank"] == 1 and written["category"] == "infra" and written["launch"] == "launch-x"
    assert written["pod"] == (os.environ.get("HOSTNAME") or socket.gethostname())
    assert written["node"] == (os.environ.get("NODE_NAME") or socket.gethostname())
    assert any(f.endswith("in stuck_in_the_data_loader") for f in written["stack"])
    assert written["positions"] == {"0": "step 12 (step end, loading data)", "1": "step 11 (step end, loading data)"}
    assert "rank 1 on pod" in said[0] and "hung at step 11" in said[0]
    # what the orchestrator makes of it when the launch ends on it
    error = outcome_error(75, [written], "", "trial-0000")
    assert (
        type(error).__name__ == "InfrastructureError" and error.rank == 1 and "stuck_in_the_data_loader" in str(error)
    )
    events = read_watchdog_events(str(out))
    assert [e["kind"] for e in events] == ["hang"] and nodes_to_avoid(events) == [written["node"]]
    assert read_progress(str(progress / "rank-1.progress"), 1) is None  # the group's records are gone with it
    # and what a Dagster run of the trial shows: a warning naming the rank, pod, node and frames, and the metadata
    # summary
    logs, summary = _dagster_run_of(str(out), started - 10)
    assert any(
        "trial-0000: rank 1 on pod" in m
        and f"(node {written['node']}) hung at step 11" in m
        and "stuck_in_the_data_loader" in m
        for m in logs
    ), logs
    assert summary["hangs"] == 1 and summary["avoid_nodes"] == [written["node"]] and summary["events"][0]["rank"] == 1
    # and the trial's next gang (attempt or resized generation) prefers other nodes than the one its rank hung on
    cfg = avoid_reported_nodes(
        make_spec(tmp_path / "spec", output_uri=str(out)), K8sJobConfig(namespace="team", image="t:1"), _Said(said)
    )
    assert cfg.avoid_nodes == (written["node"],) and f"prefers nodes other than {written['node']}" in said[-1]


class _Said:
    def __init__(self, said: list[str]) -> None:
        self.info = said.append


def _dagster_run_of(output_uri: str, since: float) -> tuple[list[str], dict]:
    """A real (in-process) Dagster run of a trial partition that surfaces the agent's events as `train_trial` does."""
    from dagster import DagsterInstance, StaticPartitionsDefinition, asset, materialize

    from assets.sweeps.trials import log_watchdog_events

    @asset(partitions_def=StaticPartitionsDefinition(["trial-0000"]))
    def trial_model(context) -> dict:  # unannotated: Dagster cannot resolve a string annotation of a local import
        return log_watchdog_events(context, output_uri, since)

    instance = DagsterInstance.ephemeral()
    result = materialize([trial_model], partition_key="trial-0000", instance=instance)
    return [e.message for e in instance.all_logs(result.run_id)], result.output_for_node("trial_model")


@pytest.mark.slow
def test_drill_hang_is_named_with_its_stack_and_restarted_and_drill_slow_is_reported_with_its_node(
    tmp_path: Path,
) -> None:
    policy = WatchdogPolicy(hang_floor_seconds=3, straggler_window_steps=4)
    spec = make_spec(
        tmp_path, distribution=Distribution(procs_per_node=2, max_restarts=1), max_epochs=3, batch_size=16,
        checkpoint=CheckpointPolicy(every_n_steps=4, keep_last=2, watchdog=policy),
        faults=FaultInjection(slow_rank=0, slow_seconds=0.2, hang_rank=1, hang_at_step=15),
    )
    result = LocalLauncher(warm_workers=False).launch(spec).result  # through training.gang, the agent that watches
    out = Path(spec.output_uri)
    node = os.environ.get("NODE_NAME") or socket.gethostname()

    # drill_hang: the hang record names rank 1, its pod and node, and the drill's own frame in its stack
    (path,) = (out / "failures").glob("rank-1-hang-*.json")
    hang = json.loads(path.read_text())
    assert hang["rank"] == 1 and hang["node"] == node and hang["step"] == 15
    assert any(f.endswith("in _drill_hang_blocks_forever") for f in hang["stack"]), hang["stack"]
    assert any("callbacks.py" in f and "on_train_batch_start" in f for f in hang["stack"]), hang["stack"]
    # detected within the timeout of the moment the drill recorded, and the gang resumed in-job within the bound
    hung_at = float((out / "faults" / "hang").read_text())
    # Not before the timeout; after it by one 0.5 s poll on a quiet machine, and the upper bound leaves room for a
    # loaded one.
    assert hang["timeout_seconds"] - 0.5 <= hang["time"] - hung_at <= hang["timeout_seconds"] + 15.0
    attempts = read_attempts(str(out))
    assert len(attempts) == 2 and attempts[0]["status"].startswith("hung: rank 1 on pod")
    assert attempts[1]["first_step_at"] - hung_at <= hang["timeout_seconds"] + RESTART_BOUND_SECONDS
    assert result.goodput["restarts"] == 1 and result.goodput["restart_causes"][0].startswith("hung: rank 1")
    assert (
        0 < attempts[1]["resumed_from_step"] <= 15 and result.global_step == attempts[1]["last_step"] > 15
    )  # from a checkpoint, to the end

    # drill_slow: rank 0, which slept 0.2 s in every step of the first attempt, was reported with its node
    events = read_watchdog_events(str(out))
    slow = [e for e in events if e["kind"] == "straggler"]
    assert [e["rank"] for e in slow] == [0] and slow[0]["node"] == node and slow[0]["local_seconds"] >= 0.2
    assert slow[0]["time"] < hang["time"]
    assert node in nodes_to_avoid(events)


@pytest.mark.slow
def test_drill_hang_on_warm_workers_is_named_and_restarted_by_their_supervisor(tmp_path: Path) -> None:
    """The local launcher's default path: the warm supervisor watches its forks as training.gang watches torchrun's."""
    spec = make_spec(
        tmp_path, distribution=Distribution(procs_per_node=2, max_restarts=1), max_epochs=2, batch_size=16,
        checkpoint=CheckpointPolicy(every_n_steps=4, keep_last=2, watchdog=WatchdogPolicy(hang_floor_seconds=3)),
        faults=FaultInjection(hang_rank=0, hang_at_step=5),
    )
    launcher = LocalLauncher()
    result = launcher.launch(spec).result
    out = Path(spec.output_uri)
    (path,) = (out / "failures").glob("rank-0-hang-*.json")
    hang = json.loads(path.read_text())
    assert hang["rank"] == 0 and any(f.endswith("in _drill_hang_blocks_forever") for f in hang["stack"]), hang["stack"]
    assert result.goodput["restarts"] == 1 and result.goodput["restart_causes"][0].startswith("hung: rank 0")
    assert "[trainyard.warm]" in (out / "logs" / "launcher.log").read_text()  # it ran warm, not on torchrun


def test_hang_and_slow_drills_reach_the_spec_from_the_run_config_and_refuse_what_cannot_fire() -> None:
    from dagster import Failure

    from assets.sweeps.trials import TrialConfig, check_drill

    config = TrialConfig(drill_hang_rank=1, drill_hang_at_step=50, drill_slow_rank=0, drill_slow_seconds=0.5)
    assert (
        config.drill() == {"hang_rank": 1, "hang_at_step": 50, "slow_rank": 0, "slow_seconds": 0.5}
        and config.restarts_expected()
    )
    with pytest.raises(Failure) as refused:
        check_drill(
            "trial-0000",
            TrialConfig(drill_hang_rank=2, drill_hang_at_step=50, drill_slow_rank=0, drill_slow_seconds=0.5),
            1,
            {"global_step": 40},
        )
    assert refused.value.description == (
        "trial-0000: the drill cannot run: drill_hang_rank=2 names no rank of a 1-process trial (ranks 0..0); "
        "drill_slow_rank needs a "
        "trial of 2 or more processes: a straggler is slower than the others; drill_hang_at_step=50 is past the "
        "trial's last step "
        "(it trained 40 steps); use a step in 1..40"
    )
    with pytest.raises(ValueError, match="hang_rank and hang_at_step are set together"):
        FaultInjection(hang_rank=1)
    with pytest.raises(ValueError, match=r"slow_rank and slow_seconds \(> 0\) are set together"):
        FaultInjection(slow_rank=1)


@pytest.mark.slow
def test_drill_slow_on_another_node_is_reported_by_node_0s_agent_with_that_rank_s_pod_and_node(tmp_path: Path) -> None:
    """Two nodes (two `training.gang` agents on this machine, one process each, as two pods would run): each agent sees
    only its own rank, so the straggler on node 1 is found from the gang-wide window the ranks share, by node 0's
    agent."""
    from tests.support.dagster_dev import free_port

    policy = WatchdogPolicy(straggler_window_steps=4)
    spec = make_spec(
        tmp_path,
        distribution=Distribution(nodes=2, procs_per_node=1),
        max_epochs=2,
        batch_size=16,
        checkpoint=CheckpointPolicy(every_n_steps=100, watchdog=policy),
        faults=FaultInjection(slow_rank=1, slow_seconds=0.2),
    )
    port, root = free_port(), Path(__file__).resolve().parents[2]
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "training.gang",
                "--nnodes=2",
                "--nproc-per-node=1",
                f"--node-rank={i}",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                "--max-restarts=0",
                "-m",
                "training.entrypoint",
                "--spec",
                str(tmp_path / "spec.json"),
            ],
            cwd=root,
            env={**os.environ, "NODE_NAME": f"node-{'ab'[i]}", "HOSTNAME": f"pod-{'ab'[i]}", LAUNCH_ID_ENV: "gang-1"},
            stdout=(tmp_path / f"agent-{i}.log").open("w"),
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    try:
        for a in agents:
            a.wait(timeout=120)
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    outputs = [(tmp_path / f"agent-{i}.log").read_text() for i in range(2)]
    assert [a.returncode for a in agents] == [0, 0], outputs
    events = read_watchdog_events(spec.output_uri)
    slow = [e for e in events if e["kind"] == "straggler"]
    assert [(e["rank"], e["pod"], e["node"]) for e in slow] == [(1, "pod-b", "node-b")], events  # once, by one agent
    assert slow[0]["local_seconds"] >= 0.2 and slow[0]["others_median_seconds"] < 0.2
    assert "rank 1 on pod pod-b (node node-b) is a straggler" in outputs[0] and "is a straggler" not in outputs[1]
    assert nodes_to_avoid(events) == ["node-b"]
