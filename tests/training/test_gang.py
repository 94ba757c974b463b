"""`training.gang`: the wrapped torchrun command exits with the first failing worker's classified status.

The process tests run the real command `resources.launcher.torchrun_command`
builds (the one local launches and pods run): two CPU processes over gloo, a
tiny digits spec, model code that fails on rank 1, a SIGTERM to the command's
process group, a worker SIGKILLed by its PID. torchrun itself exits 1 in every
failing case (the wrapper says so on stderr); the statuses asserted are the
wrapper's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import pytest

from resources.launcher import torchrun_command
from tests.support.train_specs import make_spec
from training import gang
from training.checkpointing import CheckpointStore
from training.spec import (
    EXIT_BAD_CONFIG,
    EXIT_INFRA,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_USER_ERROR,
    LAUNCH_ID_ENV,
    CheckpointPolicy,
    Distribution,
    ImportTarget,
    TrainSpec,
)

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_SECONDS = 300


def record(rank: int, category: str, at: float, consequence: bool = False, launch: str = "L") -> dict[str, Any]:
    return {
        "rank": rank,
        "category": category,
        "time": at,
        "consequence": consequence,
        "launch": launch,
        "error": f"{category} on {rank}",
    }


# -- the rule ------------------------------------------------------------------------


def test_success_is_zero_whatever_was_recorded() -> None:
    assert gang.classify([record(0, "user", 1.0)], returncode=0).code == EXIT_OK


def test_the_earliest_cause_wins_and_consequences_are_looked_past() -> None:
    lost = record(0, "infra", 1.0, consequence=True)  # rank 0 only saw rank 1 go
    assert gang.classify([lost, record(1, "config", 2.0)], 1).code == EXIT_BAD_CONFIG
    assert gang.classify([lost, record(1, "user", 2.0)], 1).code == EXIT_USER_ERROR
    assert gang.classify([record(1, "preempted", 3.0), record(0, "infra", 2.0)], 1).code == EXIT_INFRA
    verdict = gang.classify([record(1, "preempted", 2.0), record(0, "preempted", 3.0)], 1)
    assert verdict.code == EXIT_PREEMPTED and verdict.reason.startswith("rank 1 failed first (preempted")


def test_a_terminal_error_outranks_an_earlier_retryable_cause() -> None:
    """torchrun restarted the group after a storage failure; the next group hit a bug, and the launch ended on it."""
    assert gang.classify([record(0, "infra", 1.0), record(1, "user", 5.0)], 1).code == EXIT_USER_ERROR


def test_no_cause_is_infrastructure_unless_this_process_was_stopped() -> None:
    assert gang.classify([], 1).code == EXIT_INFRA
    only_lost = gang.classify([record(0, "infra", 1.0, consequence=True)], 1)
    assert only_lost.code == EXIT_INFRA and "recorded only that they lost a peer" in only_lost.reason
    assert (
        gang.classify([record(0, "infra", 1.0, consequence=True)], 1, signalled=signal.SIGTERM).code == EXIT_PREEMPTED
    )
    assert gang.classify([], -9).code == EXIT_INFRA


def test_only_this_launchs_records_since_it_started_count(tmp_path: Path) -> None:
    failures = tmp_path / "failures"
    failures.mkdir()
    now = time.time()
    (failures / "rank-0.json").write_text(json.dumps(record(0, "user", now, launch="this")))
    (failures / "rank-1.json").write_text(json.dumps(record(1, "config", now, launch="other")))
    (failures / "rank-2.json").write_text(json.dumps(record(2, "config", now - 600, launch="this")))  # a replaced pod's
    (failures / "rank-3.json").write_text('{"rank": 3, "laun')  # half written
    assert [r["rank"] for r in gang.launch_records(str(tmp_path), "this", since=now - 1)] == [0]
    assert gang.launch_records(str(tmp_path / "nothing"), "this", since=now) == []


def test_the_spec_is_found_after_the_entrypoint_and_a_command_without_one_cannot_work(tmp_path: Path) -> None:
    assert (
        gang.spec_uri_of(["--nnodes=1", "--standalone", "-m", "training.entrypoint", "--spec", "s3://b/spec.json"])
        == "s3://b/spec.json"
    )
    with pytest.raises(ValueError, match="do not end in '-m training.entrypoint --spec URI'"):
        gang.spec_uri_of(["--nnodes=1", "-m", "training.entrypoint"])
    assert gang.main(["--standalone", "-m", "training.other"]) == EXIT_BAD_CONFIG
    spec = make_spec(tmp_path)
    assert gang.output_uri_of(str(tmp_path / "spec.json")) == spec.output_uri
    assert gang.output_uri_of(str(tmp_path / "missing" / "spec.json")) == str(
        tmp_path / "missing"
    )  # where the entrypoint writes then


# -- real launches -------------------------------------------------------------------


class Launch:
    """The wrapped command of `spec` running in its own session, as a pod's main process or the local launcher's
    child."""

    def __init__(
        self, spec: TrainSpec, tmp: Path, extra: tuple[str, ...] = (), env: Optional[dict[str, str]] = None, **kw: Any
    ) -> None:
        cmd = torchrun_command(spec, str(tmp / "spec.json"), python=sys.executable, **kw)
        at = cmd.index("training.entrypoint") - 1
        self.cmd = cmd[:at] + list(extra) + cmd[at:]
        self.log = tmp / "launch.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=LAUNCH_SECONDS)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise

    def said(self) -> str:
        return "\n".join(line for line in self.log.read_text().splitlines() if line.startswith("[trainyard.gang]"))

    def workers(self) -> dict[int, int]:
        """rank -> pid of the entrypoint processes below this launch (torchrun starts each in its own session)."""
        parents = {}
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
        ranks = {}
        for pid in parents:
            ancestor = parents.get(pid)
            while ancestor not in (None, 0, 1, self.proc.pid):
                ancestor = parents.get(ancestor)
            if ancestor != self.proc.pid:
                continue
            try:
                environ = dict(
                    kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in kv
                )
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"training.entrypoint" in cmdline and b"RANK" in environ and b"torch.distributed.run" not in cmdline:
                ranks[int(environ[b"RANK"])] = pid
        return ranks

    def wait_for_checkpoint(self, spec: TrainSpec) -> None:
        store = CheckpointStore(str(Path(spec.output_uri) / "checkpoints"))
        deadline = time.monotonic() + LAUNCH_SECONDS
        while not store.list_committed():
            assert self.proc.poll() is None, (
                f"the launch ended before its first checkpoint:\n{self.log.read_text()[-3000:]}"
            )
            assert time.monotonic() < deadline
            time.sleep(0.1)


def failing_spec(tmp: Path, model: str, restarts: int, **over: Any) -> TrainSpec:
    return make_spec(
        tmp,
        model=ImportTarget(path=f"tests.support.gang_models:{model}", kwargs={"hidden": 16, "lr": 0.02}),
        distribution=Distribution(procs_per_node=2, max_restarts=restarts),
        **over,
    )


def long_spec(tmp: Path) -> TrainSpec:
    """Trains far longer than any test waits: stopped from outside after its first checkpoint."""
    return make_spec(
        tmp,
        distribution=Distribution(procs_per_node=2, max_restarts=0),
        checkpoint=CheckpointPolicy(every_n_steps=4),
        max_epochs=200,
        batch_size=16,
    )


def recorded(spec: TrainSpec) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(Path(spec.output_uri, "failures").glob("rank-*.json"))]


@pytest.mark.slow
def test_a_config_error_on_rank_1_exits_78_after_a_restart(tmp_path: Path) -> None:
    """torchrun restarts the group once; the restarted ranks stop at once on the recorded config error."""
    spec = failing_spec(tmp_path, "ConfigErrorOnRank", restarts=1)
    launch = Launch(spec, tmp_path)
    assert launch.wait() == EXIT_BAD_CONFIG, launch.log.read_text()[-3000:]
    assert (
        "torchrun exited 1; rank 1 failed first (config: ConfigError: rank 1: hidden=16 does not fit this shard)"
        in launch.said()
    )
    assert "exitcode  : 78" in launch.log.read_text()  # the restarted group's ranks, stopped by the record


@pytest.mark.slow
def test_a_user_error_on_rank_1_exits_1_and_an_earlier_attempts_record_is_ignored(tmp_path: Path) -> None:
    spec = failing_spec(tmp_path, "UserErrorOnRank", restarts=0)
    # A pod replaced under the same Job name shares its launch id: its record is older than this launch.
    stale = Path(spec.output_uri, "failures", "rank-7.json")
    stale.parent.mkdir(parents=True)
    stale.write_text(json.dumps(record(7, "config", time.time() - 3600, launch="job-a0")))
    launch = Launch(spec, tmp_path, env={LAUNCH_ID_ENV: "job-a0"})
    assert launch.wait() == EXIT_USER_ERROR, launch.log.read_text()[-3000:]
    assert "rank 1 failed first (user: ZeroDivisionError: rank 1: division by zero in the loss)" in launch.said()
    assert {r["rank"]: r["launch"] for r in recorded(spec)}[1] == "job-a0"


@pytest.mark.slow
def test_sigterm_to_the_process_group_checkpoints_and_exits_143(tmp_path: Path) -> None:
    spec = long_spec(tmp_path)
    launch = Launch(spec, tmp_path)
    launch.wait_for_checkpoint(spec)
    os.killpg(launch.proc.pid, signal.SIGTERM)  # what stopping the pod's main process group does
    assert launch.wait() == EXIT_PREEMPTED, launch.log.read_text()[-3000:]
    records = recorded(spec)
    assert {r["rank"] for r in records} == {0, 1} and {r["category"] for r in records} == {"preempted"}
    step = int(records[0]["error"].split("checkpoint at step ")[1].split()[0])
    assert (
        CheckpointStore(str(Path(spec.output_uri) / "checkpoints")).latest().step == step
    )  # the preemption checkpoint


@pytest.mark.slow
def test_a_worker_sigkilled_by_pid_exits_75(tmp_path: Path) -> None:
    spec = long_spec(tmp_path)
    launch = Launch(spec, tmp_path)
    launch.wait_for_checkpoint(spec)
    os.kill(launch.workers()[1], signal.SIGKILL)
    assert launch.wait() == EXIT_INFRA, launch.log.read_text()[-3000:]
    assert "exitcode  : -9" in launch.log.read_text()  # torchrun saw rank 1 killed, and exited 1
    assert "torchrun exited 1; " in launch.said()
    assert all(r["consequence"] for r in recorded(spec))  # rank 0, if it said anything, only lost its peer


def test_a_rendezvous_that_never_happens_exits_75(tmp_path: Path) -> None:
    """Node 1 of a 2-node gang whose rank 0 never comes: torchrun gives up; no worker ever started."""
    spec = make_spec(tmp_path, distribution=Distribution(nodes=2, procs_per_node=1, max_restarts=0))
    launch = Launch(
        spec, tmp_path, extra=("--rdzv-conf=timeout=2",), node_rank="1", master_addr="127.0.0.1", master_port=1
    )
    assert launch.wait() == EXIT_INFRA, launch.log.read_text()[-3000:]
    assert "no worker recorded a cause" in launch.said() and not Path(spec.output_uri, "failures").exists()
