"""The local launcher: real torchrun processes on CPU with gloo."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any, Optional

import pytest

from resources.launcher import (
    InfrastructureError,
    LaunchOutput,
    LocalLauncher,
    TrainingCodeError,
    TrainingConfigError,
    TrainingPreempted,
    WorkerExit,
    outcome_error,
    parse_worker_exits,
    read_failures,
    torchrun_command,
)
from resources.warm import warm_dir
from tests.support.train_specs import make_spec
from training.spec import (
    EXIT_INFRA,
    EXIT_PREEMPTED,
    SPEC_FILE,
    CheckpointPolicy,
    Distribution,
    FaultInjection,
    ImportTarget,
)


def test_torchrun_command_single_node(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, distribution=Distribution(procs_per_node=2, max_restarts=1))
    assert torchrun_command(spec, "/x/spec.json", python="py") == [
        "py", "-m", "training.gang", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=1",
        "--standalone", "-m", "training.entrypoint", "--spec", "/x/spec.json",
    ]


def test_torchrun_command_multi_node_needs_master(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, distribution=Distribution(nodes=2, procs_per_node=1))
    with pytest.raises(ValueError, match="needs master_addr and node_rank"):
        torchrun_command(spec, "s")
    cmd = torchrun_command(
        spec, "s", python="py", node_rank="$(JOB_COMPLETION_INDEX)", master_addr="job-0.svc", master_port=29400
    )
    assert cmd[5:9] == [
        "--max-restarts=2",
        "--node-rank=$(JOB_COMPLETION_INDEX)",
        "--master-addr=job-0.svc",
        "--master-port=29400",
    ]


def test_outcome_mapping() -> None:
    assert isinstance(outcome_error(1, [{"category": "config", "rank": 1, "error": "e"}], "", "t"), TrainingConfigError)
    user = outcome_error(1, [{"category": "user", "rank": 1, "error": "boom", "traceback": "TB"}], "", "t")
    assert (
        isinstance(user, TrainingCodeError)
        and not user.retryable
        and "rank 1 raised boom" in str(user)
        and "TB" in str(user)
    )
    infra = outcome_error(-9, [], "last line", "t")
    assert isinstance(infra, InfrastructureError) and infra.retryable and "last line" in str(infra)


# torchrun 2.13's summary after rank 1 was SIGKILLed and rank 0 then failed on the lost connection.
TORCHRUN_SUMMARY = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
training.entrypoint FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-01_00:47:09
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 75 (pid: 12283)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_00:47:02
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 12284)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 12284
============================================================"""

GLOO = "RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:19862: Connection reset by peer. GLHF!"


def test_torchrun_summary_names_the_root_cause_first() -> None:
    exits = parse_worker_exits("E1201 agent line\n" + TORCHRUN_SUMMARY)
    assert exits == [WorkerExit(rank=1, exitcode=-9, pid=12284), WorkerExit(rank=0, exitcode=75, pid=12283)]
    assert exits[0].signal_name == "SIGKILL" and exits[1].signal_name is None
    assert parse_worker_exits("[default0]:no summary here") == []


def test_killed_rank_is_blamed_before_the_peer_that_lost_it() -> None:
    """A SIGKILLed rank writes no record; its peer's 'lost a dependency' is a consequence, not the cause."""
    failures = [{"category": "infra", "rank": 0, "error": GLOO, "time": 2.0}]
    rank_tails = {0: ["rank 0 line"], 1: ["rank 1 warning", "rank 1 last words"]}
    err = outcome_error(1, failures, "combined tail", "t", torchrun_output=TORCHRUN_SUMMARY, rank_tails=rank_tails)
    assert isinstance(err, InfrastructureError) and err.retryable and err.rank == 1
    first = str(err).splitlines()[0]
    assert first.startswith("trial t: rank 1 was killed (signal 9, SIGKILL; pid 12284) without reporting an error")
    assert first.index("rank 1 was killed") < first.index("rank 0 then lost its peer (RuntimeError: [gloo")
    assert str(err).endswith("last 2 log lines of rank 1:\nrank 1 warning\nrank 1 last words")
    assert err.log_tail == "rank 1 warning\nrank 1 last words"


def test_peer_failure_without_a_summary_keeps_its_record_and_the_tail() -> None:
    err = outcome_error(1, [{"category": "infra", "rank": 0, "error": GLOO}], "agent said", "t")
    assert isinstance(err, InfrastructureError) and err.rank == 0
    assert str(err).splitlines()[0] == f"trial t: rank 0 lost a dependency: {GLOO}"
    assert str(err).endswith("last 1 log lines of the launch:\nagent said")


# torchrun 2.13's output (agent lines; the ChildFailedError block) of the 2-process launch of
# `test_rank_killed_from_outside_is_blamed_with_its_own_log_lines`, recorded: rank 1 SIGKILLed from outside;
# at its next poll (about 0.1 s later) torchrun SIGTERMed rank 0, which was still unwinding from the lost
# connection and had not written its failure record: rank 0 exited -15 and left no record, or an empty
# rank-0.json when the SIGTERM came during the write. (When rank 0 was quicker, it exited -15 right after
# its "infra" record, or 75.) Both exits were observed in the same second.
STOPPED_SURVIVOR = """\
W1202 16:02:24.484000 7991 .venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 8027 closing signal SIGTERM
E1202 16:02:24.782000 7991 .venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -9) local_rank: 1 (pid: 8028) of binary: /work/main/.venv/bin/python
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
======================================================
training.entrypoint FAILED
------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-02_16:02:24
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 8027)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 8027
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-02_16:02:24
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 8028)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 8028
======================================================
[trainyard.gang] torchrun exited 1; no worker recorded a cause: a worker died without a word (SIGKILL, out of memory, a lost node) \
or the rendezvous failed; exiting 75"""

_SUMMARY_ENTRIES = re.compile(r"\[\d+\]:\n(?:  .*\n)+")


def root_cause_swapped(summary: str) -> str:
    """`summary` with its two entries exchanged: the stopped rank printed as the root cause.

    torchrun names as root cause the failure with the smallest timestamp, in whole
    seconds, ties in the order it observed them: a survivor it stopped in the same
    second can come first whenever its exit was seen first.
    """
    other, root = _SUMMARY_ENTRIES.findall(summary)
    return (
        summary.replace(other, "\0")
        .replace(root, other.replace("[1]:", "[0]:", 1))
        .replace("\0", root.replace("[0]:", "[1]:", 1))
    )


# rank 0's records in those launches: the lost connection ("infra", a consequence), recorded before torchrun's
# SIGTERM; and the record of a rank that checkpointed on a SIGTERM (from the preemption drill below).
LOST_PEER = {
    "rank": 0,
    "category": "infra",
    "consequence": True,
    "time": 1796225701.5250297,
    "error": (
        "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
        "[127.0.0.1]:24999: "
        "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application."
    ),
}
PREEMPTED = {"rank": 0, "category": "preempted", "consequence": False, "time": 1796227382.2984104,
             "error": "Preempted: SIGTERM: checkpoint at step 9 committed in 0.03 s (deadline 60 s)"}
RANK_TAILS = {
    0: [
        "[rank 0] 2026-12-02 16:02:24,333 INFO: committed checkpoint /tmp/r/run/checkpoints/step-000000004 (47277 "
        "bytes)"
    ],
    1: [
        "/work/main/.venv/lib/python3.11/site-packages/lightning/pytorch/utilities/_pytree.py:21: deprecated",
        "`weights_only` was not set, defaulting to `False`.",
    ],
}


@pytest.mark.parametrize(
    "summary", [STOPPED_SURVIVOR, root_cause_swapped(STOPPED_SURVIVOR)], ids=["root-cause-rank-1", "root-cause-rank-0"]
)
@pytest.mark.parametrize("records", [[], [LOST_PEER]], ids=["no-record", "lost-peer-record"])
def test_a_rank_torchrun_stopped_after_its_peer_was_killed_is_not_blamed(
    summary: str, records: list[dict[str, Any]]
) -> None:
    exits = parse_worker_exits(summary)
    assert {e.rank: (e.exitcode, e.stopped) for e in exits} == {0: (-15, True), 1: (-9, False)}
    err = outcome_error(
        EXIT_INFRA, records, "combined tail", "trial-0000", torchrun_output=summary, rank_tails=RANK_TAILS
    )
    assert isinstance(err, InfrastructureError) and err.retryable and err.rank == 1
    first = str(err).splitlines()[0]
    assert first.startswith(
        "trial trial-0000: rank 1 was killed (signal 9, SIGKILL; pid 8028) without reporting an error ("
    )
    assert "rank 0 was killed" not in str(err) and first.count("rank 0 then lost its peer") == 1
    if records:
        assert first.endswith(
            "; rank 0 then lost its peer (RuntimeError: "
            "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] "
            "Read error [127.0.0.1]:24999: Connection reset by peer. This is typically caused by a remote worker "
            "hanging or bugs)"
        )
    else:
        assert first.endswith("; rank 0 then lost its peer (stopped by torchrun with SIGTERM after rank 1 died)")
    assert err.log_tail == "\n".join(RANK_TAILS[1]) and str(err).endswith(
        "last 2 log lines of rank 1:\n" + err.log_tail
    )


@pytest.mark.parametrize(
    "exit_line", ["exitcode  : -15 (pid: 8027)  (SIGTERM)", "exitcode  : 143 (pid: 8027)"], ids=["sigterm", "exit-143"]
)
@pytest.mark.parametrize("swap", [False, True], ids=["root-cause-rank-1", "root-cause-rank-0"])
def test_a_preemption_record_of_a_rank_torchrun_stopped_is_not_a_preemption(exit_line: str, swap: bool) -> None:
    """A survivor that checkpointed on torchrun's SIGTERM records "preempted" and `training.gang` exits 143; the launch
    was not preempted."""
    summary = STOPPED_SURVIVOR.replace("exitcode  : -15 (pid: 8027)  (SIGTERM)", exit_line)
    summary = root_cause_swapped(summary) if swap else summary
    err = outcome_error(
        EXIT_PREEMPTED, [PREEMPTED], "combined tail", "trial-0000", torchrun_output=summary, rank_tails=RANK_TAILS
    )
    assert isinstance(err, InfrastructureError) and err.retryable and err.rank == 1
    assert (
        str(err)
        .splitlines()[0]
        .startswith("trial trial-0000: rank 1 was killed (signal 9, SIGKILL; pid 8028) without reporting an error")
    )
    assert "rank 0 then lost its peer (stopped by torchrun with SIGTERM after rank 1 died)" in str(err).splitlines()[0]


# torchrun 2.13's last lines when the launch itself is stopped (`tests/training/test_gang.py`, SIGTERM to the
# process group): the agent forwards the signal and raises SignalException, printing no failure summary.
WHOLE_LAUNCH_PREEMPTED = """\
W1202 16:03:02.260000 8239 .venv/lib/python3.11/site-packages/torch/distributed/elastic/agent/server/api.py:753] Received 15 death signal, shutting down workers
W1202 16:03:02.261000 8239 .venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 8243 closing signal SIGTERM
W1202 16:03:02.261000 8239 .venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 8244 closing signal SIGTERM
    raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)
torch.distributed.elastic.multiprocessing.api.SignalException: Process 8239 got signal: 15
[trainyard.gang] torchrun exited 1; rank 1 failed first (preempted: Preempted: SIGTERM: checkpoint at step 9 committed in 0.02 s (deadline 60 s)); exiting 143"""


def test_a_whole_launch_preemption_is_still_a_preemption() -> None:
    records = [PREEMPTED, {**PREEMPTED, "rank": 1, "time": PREEMPTED["time"] - 0.01}]
    for failures in (
        records,
        [],
    ):  # the ranks' records, or none yet: the launch was stopped before they could write one
        err = outcome_error(
            EXIT_PREEMPTED,
            failures,
            WHOLE_LAUNCH_PREEMPTED,
            "t",
            torchrun_output=WHOLE_LAUNCH_PREEMPTED,
            rank_tails=RANK_TAILS,
        )
        assert isinstance(err, TrainingPreempted) and err.retryable
    assert "checkpoint at step 9 committed" in str(outcome_error(EXIT_PREEMPTED, records, WHOLE_LAUNCH_PREEMPTED, "t"))


def test_read_failures_skips_a_record_cut_short(tmp_path: Path) -> None:
    """torchrun's SIGTERM can stop a rank while it writes its record: an empty or partial file is no record."""
    failures = tmp_path / "failures"
    failures.mkdir()
    (failures / "rank-0.json").write_text("")
    (failures / "rank-1.json").write_text('{"rank": 1, "cat')
    (failures / "rank-2.json").write_text(json.dumps(LOST_PEER | {"rank": 2}))
    assert read_failures(str(tmp_path)) == [LOST_PEER | {"rank": 2}]


def test_launch_output_keeps_each_ranks_lines_apart() -> None:
    out = LaunchOutput(lines=2)
    for line in ["[default0]:a\n", "[default1]:b\n", "[default0]:c\n", "[default0]:d\n", "W1201 agent\n"]:
        out.add(line)
    assert {r: list(t) for r, t in out.ranks.items()} == {0: ["c", "d"], 1: ["b"]}
    assert list(out.agent) == ["W1201 agent"] and list(out.tail) == ["[default0]:d", "W1201 agent"]


def test_two_process_ddp_trains(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, distribution=Distribution(procs_per_node=2))
    outcome = LocalLauncher().launch(spec)
    assert outcome.result.world_size == 2
    assert outcome.result.train_samples == 2 * 210
    log = Path(outcome.log_uri).read_text()
    assert "[default0]" in log and "[default1]" in log


@pytest.mark.slow
def test_exception_on_one_rank_is_terminal_with_its_traceback(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, distribution=Distribution(procs_per_node=2), faults=FaultInjection(raise_at_step=2))
    with pytest.raises(TrainingCodeError) as err:
        LocalLauncher().launch(spec)
    assert "injected fault at step 2" in str(err.value)
    assert "Traceback" in str(err.value)


@pytest.mark.slow
def test_bad_import_path_is_config_error(tmp_path: Path) -> None:
    spec = make_spec(
        tmp_path,
        model=ImportTarget(path="pipelines.vision.models:NoSuchModel"),
        distribution=Distribution(procs_per_node=2),
    )
    with pytest.raises(TrainingConfigError, match="has no attribute 'NoSuchModel'"):
        LocalLauncher().launch(spec)


def test_timeout_stops_the_launch(tmp_path: Path) -> None:
    # 0.05 s per step, 1,000 steps: longer than the timeout on any machine (a plain digits trial on a warm worker
    # finished inside 1 s once its server preloaded what the trial imports).
    spec = make_spec(
        tmp_path,
        max_epochs=200,
        model=ImportTarget(
            path="tests.support.gang_models:SlowSteps", kwargs={"hidden": 16, "lr": 0.02, "step_seconds": 0.05}
        ),
    )
    with pytest.raises(InfrastructureError, match="no result after 1 s"):
        LocalLauncher(timeout_seconds=1).launch(spec)


def _workers_of(root: int) -> dict[int, int]:
    """rank -> pid of the `training.entrypoint` processes descended from process `root` (read from /proc):
    torchrun's."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    ranks = {}
    for pid in parents:
        ancestor = parents.get(pid)
        while ancestor not in (None, 0, 1, root):
            ancestor = parents.get(ancestor)
        if ancestor != root:
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = dict(
                kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in kv
            )
        except OSError:
            continue
        if b"training.entrypoint" in cmdline and b"RANK" in environ:
            ranks[int(environ[b"RANK"])] = pid
    return ranks


_WARM_WORKER = re.compile(r"\(spec (\S+)\): worker pid (\d+) started \(restart 0\) by .* \(rank (\d+) of \d+\)")


def _warm_workers_of(spec_uri: str) -> dict[int, int]:
    """rank -> pid of the first group of `spec_uri`'s warm workers, from the logs of this session's warm servers."""
    ranks = {}
    for log in warm_dir(os.environ).glob("*.log"):
        for m in _WARM_WORKER.finditer(log.read_text()):
            if m[1] == spec_uri:
                ranks[int(m[3])] = int(m[2])
    return ranks


def launch_and_kill(spec: Any, rank: int, warm: bool) -> tuple[Optional[Any], Optional[BaseException], float]:
    """Launch `spec` (on warm workers or torchrun), SIGKILL rank `rank` from outside once a checkpoint is committed;
    (outcome, error, kill time)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["outcome"] = LocalLauncher(warm_workers=warm).launch(spec)
        except BaseException as e:  # handed to the test thread
            box["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    checkpoints = Path(spec.output_uri, "checkpoints")
    deadline = time.monotonic() + 300
    while not (checkpoints.is_dir() and any(p.name.startswith("step-") for p in checkpoints.iterdir())):
        assert thread.is_alive() and time.monotonic() < deadline, "the launch ended before its first checkpoint"
        time.sleep(0.05)
    workers = _warm_workers_of(f"{spec.output_uri}/{SPEC_FILE}") if warm else _workers_of(os.getpid())
    pid = workers[rank]
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    thread.join()
    return box.get("outcome"), box.get("error"), killed_at


@pytest.mark.slow
@pytest.mark.parametrize("warm", [True, False], ids=["warm", "torchrun"])
def test_rank_killed_from_outside_is_blamed_with_its_own_log_lines(tmp_path: Path, warm: bool) -> None:
    """No restarts left: the launch fails, naming the killed rank first and showing that rank's lines."""
    spec = make_spec(
        tmp_path,
        distribution=Distribution(procs_per_node=2, max_restarts=0),
        checkpoint=CheckpointPolicy(every_n_steps=4),
        max_epochs=6,
        batch_size=16,
    )
    _, error, _ = launch_and_kill(spec, rank=1, warm=warm)
    assert isinstance(error, InfrastructureError) and error.retryable and error.rank == 1
    first = str(error).splitlines()[0]
    assert first.startswith("trial trial-0000: rank 1 was killed (signal 9, SIGKILL; pid ")
    assert "rank 0 then lost its peer" in first
    assert "last " in str(error) and " log lines of rank 1:" in str(error)
    rank1 = [line.split(":", 1)[1] for line in Path(spec.output_uri, "logs", "launcher.log").read_text().splitlines()
             if line.startswith("[default1]:")]
    assert error.log_tail and error.log_tail.splitlines() == rank1[-len(error.log_tail.splitlines()):]


@pytest.mark.slow
@pytest.mark.parametrize("warm", [True, False], ids=["warm", "torchrun"])
def test_rank_killed_from_outside_is_restarted_in_the_job_by_default(tmp_path: Path, warm: bool) -> None:
    """The default `max_restarts` lets torchrun restart the group; it resumes from the newest checkpoint."""
    spec = make_spec(
        tmp_path,
        distribution=Distribution(procs_per_node=2),
        checkpoint=CheckpointPolicy(every_n_steps=4),
        max_epochs=6,
        batch_size=16,
    )
    outcome, error, killed_at = launch_and_kill(spec, rank=1, warm=warm)
    assert error is None and outcome is not None
    result = outcome.result
    assert result.goodput["restarts"] == 1 and result.resumed_from and "step-" in result.resumed_from
    # the cause is the lost rank, not the connection error its surviving peer raised
    assert result.goodput["restart_causes"][0].startswith("lost (")
    attempts = sorted(Path(spec.output_uri, "attempts").glob("*.json"))
    resumed = [json.loads(p.read_text()) for p in attempts][-1]
    assert resumed["resumed_from_step"] >= 4 and resumed["first_step_at"] > killed_at
