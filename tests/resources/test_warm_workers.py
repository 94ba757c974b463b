"""Warm workers: trials' processes forked from a server that has imported torch already, with torchrun's semantics.

Real processes throughout: the launcher starts a real `python -m training.warm serve`, whose forked workers train
the digits MLP; pids, exit statuses and log lines come from those processes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
import torch

from resources.launcher import (
    InfrastructureError,
    LaunchOutcome,
    LocalLauncher,
    TrainingCodeError,
    TrainingConfigError,
    TrainingPreempted,
)
from resources.warm import (
    WARM_DIR_ENV,
    WARM_WORKERS_ENV,
    connect,
    server_key,
    stop_servers,
    training_env,
    training_root,
)
from tests.support.train_specs import make_spec
from training.checkpointing import CheckpointStore
from training.spec import CheckpointPolicy, Distribution, FaultInjection, ImportTarget, TrackerSpec
from training.warm_protocol import Request

WORKER_LINE = re.compile(
    r"\(spec (\S+)\): worker pid (\d+) started \(restart (\d+)\) by supervisor pid (\d+) of warm server pid (\d+)"
)


def running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def new_warm_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="tyw-"))  # short: a socket path must stay under 108 bytes
    monkeypatch.setenv(WARM_DIR_ENV, str(directory))
    yield directory
    stop_servers(directory)
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture()
def warm_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A warm directory of the test's own: the first warm launch in it starts a server, stopped after the test."""
    yield from new_warm_dir(monkeypatch)


@pytest.fixture(scope="module")
def shared_dir() -> Iterator[Path]:
    """One warm directory for the module's tests that only need some server."""
    with pytest.MonkeyPatch.context() as patch:
        yield from new_warm_dir(patch)


@pytest.fixture()
def shared(shared_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(WARM_DIR_ENV, str(shared_dir))
    return shared_dir


def launches(outcome_log: str) -> list[tuple[str, int, int, int, int]]:
    """(spec, worker pid, restart, supervisor pid, server pid) of each worker start a launch log names."""
    return [(m[1], int(m[2]), int(m[3]), int(m[4]), int(m[5])) for m in WORKER_LINE.finditer(outcome_log)]


def worker_of(directory: Path, spec_uri: str, restart: int = 0, timeout: float = 120.0) -> tuple[int, int]:
    """(worker pid, server pid) of `spec_uri`'s worker `restart`, from the log of the servers in `directory`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for log in directory.glob("*.log"):
            for spec, pid, r, _, server in launches(log.read_text()):
                if spec == spec_uri and r == restart:
                    return pid, server
        time.sleep(0.05)
    raise AssertionError(f"no worker {restart} of {spec_uri} in the server logs of {directory}")


def weights(output_uri: str) -> dict[str, torch.Tensor]:
    latest = CheckpointStore(output_uri + "/checkpoints").latest()
    assert latest is not None
    return latest.state["state_dict"]


def launch_in_thread(spec: Any, launcher: Optional[LocalLauncher] = None) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["outcome"] = (launcher or LocalLauncher()).launch(spec)
        except BaseException as e:  # handed to the test thread
            box["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    return thread, box


def wait_for_checkpoint(spec: Any, thread: threading.Thread) -> None:
    """Return once a checkpoint of the launch is committed (its manifest written)."""
    checkpoints = Path(spec.output_uri, "checkpoints")
    deadline = time.monotonic() + 300
    while not any(checkpoints.glob("step-*/MANIFEST.json")):
        assert thread.is_alive() and time.monotonic() < deadline, "the launch ended before its first checkpoint"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def cold_and_warm(tmp_path_factory: pytest.TempPathFactory, shared_dir: Path) -> dict[str, Any]:
    """The same 1-epoch trial cold (torchrun), then warm twice: the first warm launch starts the server."""
    runs: dict[str, Any] = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(WARM_DIR_ENV, str(shared_dir))
        patch.setenv(WARM_WORKERS_ENV, "0")
        spec = make_spec(tmp_path_factory.mktemp("cold"), max_epochs=1)
        runs["cold"] = (spec, LocalLauncher().launch(spec))
        patch.delenv(WARM_WORKERS_ENV)
        for name in ("warm1", "warm2"):
            spec = make_spec(tmp_path_factory.mktemp(name), max_epochs=1)
            runs[name] = (spec, LocalLauncher().launch(spec))
    return runs


def log_of(outcome: LaunchOutcome) -> str:
    return Path(outcome.log_uri).read_text()


@pytest.mark.slow
def test_a_warm_trial_is_bitwise_the_cold_trial(cold_and_warm: dict[str, Any]) -> None:
    cold_spec, cold = cold_and_warm["cold"]
    warm_spec, warm = cold_and_warm["warm1"]
    assert "[trainyard.warm]" not in log_of(cold) and "[default0]:" in log_of(cold)
    assert launches(log_of(warm)), "the warm launch did not run on a warm worker"
    assert warm.result.metrics == cold.result.metrics
    assert warm.result.global_step == cold.result.global_step and warm.result.world_size == 1
    cold_weights, warm_weights = weights(cold_spec.output_uri), weights(warm_spec.output_uri)
    assert cold_weights.keys() == warm_weights.keys()
    for k in cold_weights:
        assert torch.equal(cold_weights[k], warm_weights[k]), k
    # the worker's own lines carry torchrun's rank prefix, the supervisor's do not
    assert "[default0]:[rank 0]" in log_of(warm) and "INFO: trial trial-0000: done" in log_of(warm)


def test_a_second_trial_reuses_the_server_and_starts_sooner(cold_and_warm: dict[str, Any]) -> None:
    """Sooner because the second launch starts no server: its worker forks from the server the first launch started.

    Asserted by which processes did the work (one server for both), not by comparing the two launches' wall
    times: the machine's other load decides those as much as the server does (`make bench` measures the gain).
    """
    (_, first), (_, second) = cold_and_warm["warm1"], cold_and_warm["warm2"]
    [(_, worker1, _, supervisor1, server1)] = launches(log_of(first))
    [(_, worker2, _, supervisor2, server2)] = launches(log_of(second))
    assert server1 == server2 and running(server1)
    assert len({worker1, worker2, supervisor1, supervisor2}) == 4
    assert not any(running(pid) for pid in (worker1, worker2, supervisor1, supervisor2))  # reaped, not left behind


@pytest.mark.slow
def test_a_two_process_trial_on_warm_workers_is_bitwise_the_torchrun_trial(shared: Path, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """DDP over gloo with two ranks forked from the server: torchrun's environment per rank, the same weights bit for
    bit."""
    runs = {}
    for name, switch in (("cold", "0"), ("warm", "1")):
        monkeypatch.setenv(WARM_WORKERS_ENV, switch)
        spec = make_spec(tmp_path / name, max_epochs=1, distribution=Distribution(procs_per_node=2))
        runs[name] = (spec, LocalLauncher().launch(spec))
    (cold_spec, cold), (warm_spec, warm) = runs["cold"], runs["warm"]
    assert "[trainyard.warm]" not in log_of(cold)
    started = launches(log_of(warm))
    assert len(started) == 2 and len({supervisor for *_, supervisor, _ in started}) == 1, started
    ranks = [int(m) for m in re.findall(r"started \(restart 0\) by .* \(rank (\d) of 2\)", log_of(warm))]
    assert sorted(ranks) == [0, 1]
    assert "[default1]:[rank 1]" in log_of(warm) and "[default1]:[rank 1]" in log_of(cold)
    assert warm.result.world_size == cold.result.world_size == 2
    assert warm.result.metrics == cold.result.metrics and warm.result.global_step == cold.result.global_step
    cold_weights, warm_weights = weights(cold_spec.output_uri), weights(warm_spec.output_uri)
    assert cold_weights.keys() == warm_weights.keys()
    for k in cold_weights:
        assert torch.equal(cold_weights[k], warm_weights[k]), k
    assert not any(running(pid) for _, pid, _, _, _ in started)


def test_a_rank_that_reaches_the_store_before_rank_0_is_queued_not_refused(shared: Path, tmp_path: Path) -> None:
    """Rank 1 connects to MASTER_PORT while rank 0 is still building its model: the port, which the supervisor listens
    on for rank 0's store, takes the connection. On a port rank 0 binds only later it was refused, and torch's store
    client retried after a backoff of 0.27-0.43 s: one warm two-process start in ten lost 0.7 s that way."""
    record = tmp_path / "probe.txt"
    spec = make_spec(tmp_path, max_epochs=1, distribution=Distribution(procs_per_node=2), model=ImportTarget(
        path="tests.support.gang_models:ProbesTheStorePort", kwargs={"hidden": 16, "lr": 0.02, "record": str(record)}))
    outcome = LocalLauncher().launch(spec)
    assert len(launches(log_of(outcome))) == 2
    assert record.read_text() == "accepted"
    assert outcome.result.world_size == 2 and outcome.result.global_step > 0


@pytest.mark.parametrize("nprocs", [0, 65, "2", True, 1.5])
def test_a_request_with_a_bad_process_count_is_refused_by_name(nprocs: Any) -> None:
    request = {"env": {}, "cwd": "/", "spec_uri": "s", "max_restarts": 0, "run_id": "r", "nprocs": nprocs}
    with pytest.raises(ValueError, match="request field 'nprocs' must be an integer from 1 to 64"):
        Request.parse(json.dumps(request).encode())


def test_user_error_is_terminal_with_its_traceback(shared: Path, tmp_path: Path) -> None:
    spec = make_spec(tmp_path, faults=FaultInjection(raise_at_step=2))
    with pytest.raises(TrainingCodeError) as err:
        LocalLauncher().launch(spec)
    assert not err.value.retryable
    assert (
        "rank 0 raised" in str(err.value)
        and "injected fault at step 2" in str(err.value)
        and "Traceback" in str(err.value)
    )
    log = Path(spec.output_uri, "logs", "launcher.log").read_text()
    assert launches(log)


def test_trials_after_the_first_keep_the_servers_temporary_directories(shared: Path, tmp_path: Path) -> None:
    """W&B makes its media directory when the server imports it; a worker's exit must not delete it for later trials.

    Each forked worker inherited the server's exit-time finalizers and ran them at its exit, so
    the first trial removed the directory and the next one's `wandb.Image` failed.
    """
    model = ImportTarget(path="tests.support.gang_models:MakesWandbImage", kwargs={"hidden": 16})
    outcomes = [LocalLauncher().launch(make_spec(tmp_path / f"trial-{n}", max_epochs=1, model=model)) for n in range(3)]
    servers = {launch[4] for outcome in outcomes for launch in launches(log_of(outcome))}
    assert len(servers) == 1, servers  # all three forked from one server
    assert all(o.result is not None for o in outcomes)


def test_config_error_is_terminal_and_never_trains_again(shared: Path, tmp_path: Path) -> None:
    spec = make_spec(tmp_path, model=ImportTarget(path="pipelines.vision.models:NoSuchModel"))
    with pytest.raises(TrainingConfigError, match="has no attribute 'NoSuchModel'") as err:
        LocalLauncher().launch(spec)
    assert not err.value.retryable
    log = Path(spec.output_uri, "logs", "launcher.log").read_text()
    # As under torchrun the worker is restarted, and each restart finds its launch's config failure and stops at once.
    assert [r for _, _, r, _, _ in launches(log)] == [0, 1, 2]
    assert log.count("bad config:") == 1 and log.count("not training again") == 2


@pytest.mark.slow
def test_killed_worker_is_restarted_and_resumes_from_its_checkpoint(shared: Path, tmp_path: Path) -> None:
    spec = make_spec(tmp_path, checkpoint=CheckpointPolicy(every_n_steps=4), max_epochs=6, batch_size=16)
    spec_uri = str(tmp_path / "run" / "spec.json")
    thread, box = launch_in_thread(spec)
    wait_for_checkpoint(spec, thread)
    pid, _ = worker_of(shared, spec_uri)
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    thread.join()
    assert "error" not in box, box.get("error")
    result = box["outcome"].result
    assert result.goodput["restarts"] == 1 and result.resumed_from and "step-" in result.resumed_from
    assert result.goodput["restart_causes"][0].startswith("lost (")
    log = log_of(box["outcome"])
    assert [r for _, _, r, _, _ in launches(log)] == [0, 1] and f"worker pid {pid} started (restart 0)" in log
    assert "worker group failed (rank 0 exited with status -9); restarting it (1 of 2)" in log
    restarted, _ = worker_of(shared, spec_uri, restart=1)
    assert restarted != pid and not running(pid)
    assert Path(spec.output_uri, "attempts").is_dir() and killed_at < time.time()


def test_preemption_reaches_the_warm_worker_and_checkpoints(shared: Path, tmp_path: Path) -> None:
    """The drill SIGTERMs the worker's parent, as it does torchrun's agent: the supervisor forwards it."""
    spec = make_spec(tmp_path, checkpoint=CheckpointPolicy(every_n_steps=4), faults=FaultInjection(sigterm_at_step=7),
                     max_epochs=3, batch_size=16)
    with pytest.raises(TrainingPreempted) as err:
        LocalLauncher().launch(spec)
    assert "checkpoint at step 8 committed" in str(err.value)  # read at the agreement after the signal's step
    assert CheckpointStore(spec.output_uri + "/checkpoints").latest().step == 8
    assert launches(Path(spec.output_uri, "logs", "launcher.log").read_text())


def test_timeout_stops_the_warm_worker(shared: Path, tmp_path: Path) -> None:
    # 0.05 s per step, 1,000 steps: longer than the timeout on any machine (plain digits steps took 200 epochs in < 8
    # s).
    spec = make_spec(
        tmp_path,
        max_epochs=200,
        model=ImportTarget(
            path="tests.support.gang_models:SlowSteps", kwargs={"hidden": 16, "lr": 0.02, "step_seconds": 0.05}
        ),
    )
    thread, box = launch_in_thread(spec, LocalLauncher(timeout_seconds=8))
    pid, _ = worker_of(shared, str(tmp_path / "run" / "spec.json"))
    thread.join()
    assert isinstance(box.get("error"), InfrastructureError) and "no result after 8 s" in str(box["error"])
    assert not running(pid)


@pytest.mark.slow
def test_server_killed_mid_trial_is_an_infrastructure_error_without_orphans(warm_dir: Path, tmp_path: Path) -> None:
    spec = make_spec(tmp_path, checkpoint=CheckpointPolicy(every_n_steps=4), max_epochs=200, batch_size=16)
    thread, box = launch_in_thread(spec)
    wait_for_checkpoint(spec, thread)
    worker, server = worker_of(warm_dir, str(tmp_path / "run" / "spec.json"))
    os.kill(server, signal.SIGKILL)
    thread.join(timeout=120)
    assert not thread.is_alive()
    error = box.get("error")
    assert isinstance(error, InfrastructureError) and error.retryable, error
    assert f"(warm server pid {server}) died before the launch ended" in str(error)
    assert not running(worker)


@pytest.mark.slow
def test_a_changed_training_tree_gets_a_new_server(shared: Path, tmp_path: Path) -> None:
    root = training_root()
    copy = tmp_path / "checkout"
    shutil.copytree(root / "training", copy / "training", ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "training" / "warm.py").write_text((copy / "training" / "warm.py").read_text() + "\n# changed\n")
    keys = [server_key(sys.executable, root), server_key(sys.executable, copy)]
    assert keys[0] != keys[1]
    for r in (root, copy):
        connect(shared, python=sys.executable, root=r, idle_seconds=60, start_timeout=300).close()
    pids = {p.stem: int(p.read_text()) for p in shared.glob("*.pid")}
    assert set(keys) <= pids.keys() and pids[keys[0]] != pids[keys[1]]
    assert all(running(pids[k]) for k in keys)
    assert Path(f"/proc/{pids[keys[1]]}/cwd").resolve() == copy.resolve()  # it imports the copy's `training`


def test_two_concurrent_launches_start_one_server(warm_dir: Path, tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    specs = [make_spec(tmp_path / name, max_epochs=1) for name in ("a", "b")]
    threads = [launch_in_thread(spec) for spec in specs]
    for thread, _ in threads:
        thread.join()
    outcomes = [box["outcome"] for _, box in threads]
    servers = {launches(log_of(o))[0][4] for o in outcomes}
    assert len(servers) == 1 and len(list(warm_dir.glob("*.pid"))) == 1
    assert all(o.result.world_size == 1 for o in outcomes)


def test_an_idle_server_exits_and_removes_its_socket(warm_dir: Path, tmp_path: Path) -> None:
    outcome = LocalLauncher(warm_idle_seconds=2).launch(make_spec(tmp_path, max_epochs=1))
    [(_, _, _, _, server)] = launches(log_of(outcome))
    deadline = time.monotonic() + 60
    while running(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(server)
    assert list(warm_dir.glob("*.sock")) == [] and list(warm_dir.glob("*.pid")) == []
    assert "idle for 2 s; exiting" in "".join(p.read_text() for p in warm_dir.glob("*.log"))


@pytest.mark.slow
def test_an_unusable_warm_dir_falls_back_to_torchrun_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    monkeypatch.setenv(WARM_DIR_ENV, str(not_a_dir))
    outcome = LocalLauncher().launch(make_spec(tmp_path, max_epochs=1))
    log = log_of(outcome)
    assert log.count("WARNING: warm workers unavailable, starting this trial cold with torchrun") == 1
    assert str(not_a_dir) in log and "[trainyard.warm]" not in log and "[default0]:" in log


def test_a_bad_switch_value_is_refused_by_name(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(WARM_WORKERS_ENV, "maybe")
    with pytest.raises(ValueError, match="TRAINYARD_WARM_WORKERS='maybe': expected one of"):
        LocalLauncher().launch(make_spec(tmp_path, max_epochs=1))


def test_same_interpreter_is_one_binary_in_one_environment(tmp_path: Path) -> None:
    """The run worker's `sys.executable` may be another name of the code server's interpreter; another venv is not
    it."""
    from resources.launcher import same_interpreter

    bin_dir = Path(sys.executable).parent
    names = [p for p in (bin_dir / "python", bin_dir / "python3") if p.exists()]
    assert names and all(same_interpreter(str(n), sys.executable) for n in names)
    other = tmp_path / "other-venv" / "bin"
    other.mkdir(parents=True)
    (other / "python").symlink_to(os.path.realpath(sys.executable))
    assert not same_interpreter(str(other / "python"), sys.executable)


@pytest.mark.slow
def test_a_warm_trial_records_the_installed_packages_as_a_cold_one_does(
    tmp_path: Path, shared: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The warm server lists the installed distributions once for W&B (it parses each one's metadata); the list is the
    same."""
    recorded = {}
    for how in ("cold", "warm"):
        monkeypatch.setenv(WARM_WORKERS_ENV, "0" if how == "cold" else "1")
        wandb_dir = tmp_path / how / "wandb"
        wandb_dir.mkdir(parents=True)
        outcome = LocalLauncher().launch(
            make_spec(tmp_path / how, max_epochs=1, tracker=TrackerSpec(mode="offline", dir=str(wandb_dir)))
        )
        assert bool(launches(log_of(outcome))) == (how == "warm")
        [requirements] = wandb_dir.rglob("requirements.txt")
        recorded[how] = requirements.read_text().splitlines()
    assert recorded["warm"] == recorded["cold"]
    assert f"torch=={torch.__version__}" in recorded["warm"] and len(recorded["warm"]) > 100


@pytest.mark.slow
def test_prestart_starts_one_server_in_the_background_that_a_launch_then_uses(warm_dir: Path, tmp_path: Path) -> None:
    """The sweep asset's prestart returns at once; a launch that comes before the server listens waits for it, no second
    one."""
    launcher = LocalLauncher()
    assert launcher.prestart_warm() is True
    socket_path = warm_dir / f"{server_key(sys.executable, training_root())}.sock"
    assert not socket_path.exists(), "prestart waited for the server's imports"
    outcome = launcher.launch(make_spec(tmp_path, max_epochs=1))  # at once: the server is still importing
    [(_, _, _, _, server)] = launches(log_of(outcome))
    assert [int(p.read_text()) for p in warm_dir.glob("*.pid")] == [server]
    assert "warm workers unavailable" not in log_of(outcome)
    assert launcher.prestart_warm() is False  # a server listens: nothing to start


def test_prestart_does_nothing_with_warm_workers_off(warm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WARM_WORKERS_ENV, "0")
    assert LocalLauncher().prestart_warm() is False
    assert LocalLauncher(warm_workers=False).prestart_warm() is False
    time.sleep(1.0)
    assert list(warm_dir.iterdir()) == []


@pytest.mark.slow
def test_a_launch_that_sets_a_start_time_variable_runs_on_a_server_started_with_it(
    shared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """glibc reads MALLOC_* when a process starts: a worker forked from a server started without it would not have
    it."""
    root = training_root()
    plain = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    arena = {**plain, "MALLOC_ARENA_MAX": "2"}
    assert server_key(sys.executable, root, plain) != server_key(sys.executable, root, arena)
    assert server_key(sys.executable, root, plain) == server_key(sys.executable, root, {**plain, "UNRELATED": "x"})
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    outcome = LocalLauncher().launch(make_spec(tmp_path, max_epochs=1))
    server = launches(log_of(outcome))[0][4]
    assert int((shared / f"{server_key(sys.executable, root, training_env(arena))}.pid").read_text()) == server
    assert b"MALLOC_ARENA_MAX=2" in Path(f"/proc/{server}/environ").read_bytes().split(
        b"\0"
    )  # what the server's exec had


def test_warm_trials_share_the_servers_wandb_service_which_stops_with_the_server(
    warm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's keeper sets W&B up once; its workers' runs connect to that service (W&B's own debug log says so)
    instead of starting one each; a launch that turns it off starts its own; stopping the server stops the service."""
    connected = "Connected to an existing wandb-core service via WANDB_SERVICE"

    def run_log(name: str, **env: str) -> str:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        wandb_dir = tmp_path / name / "wandb"
        wandb_dir.mkdir(parents=True)
        outcome = LocalLauncher().launch(
            make_spec(tmp_path / name, max_epochs=1, tracker=TrackerSpec(mode="offline", dir=str(wandb_dir)))
        )
        assert launches(log_of(outcome)), "the trial did not run on a warm worker"
        [debug] = wandb_dir.rglob("offline-run-*/logs/debug.log")
        return debug.read_text()

    assert connected in run_log("first") and connected in run_log("second")
    [server_log] = warm_dir.glob("*.log")
    service = re.search(r"W&B service \S+-unix-(\S+) \(keeper pid (\d+)\)", server_log.read_text())
    assert service, server_log.read_text()[:2000]
    socket_path, keeper = Path(service[1]), int(service[2])
    assert socket_path.exists() and running(keeper)
    assert connected not in run_log(
        "own", TRAINYARD_WARM_WANDB_SERVICE="0"
    )  # the launch's switch: a service of its own
    stop_servers(warm_dir)
    deadline = time.monotonic() + 30
    while (running(keeper) or socket_path.exists()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not running(keeper) and not socket_path.exists(), "the keeper or its service outlived the server"



@pytest.mark.slow
def test_a_run_id_left_open_in_the_shared_wandb_service_does_not_fail_the_next_trial_that_uses_it(
        warm_dir: Path, tmp_path: Path) -> None:
    """Found by CI: a trial killed mid-run leaves its W&B run open in the server's shared service, which then refused
    that
    run id ("run ID ... is in use") to a trial writing the same tracker run from another directory. The next trial now
    goes on with a service of its own; a trial whose training raises marks its run failed, which frees the id."""
    connected = "Connected to an existing wandb-core service via WANDB_SERVICE"

    def launch(name: str, run: str, **over: Any) -> tuple[str, list[str]]:
        """(the launch's log or its error, the W&B debug log of each of its attempts)."""
        wandb_dir = tmp_path / name / "wandb"
        wandb_dir.mkdir(parents=True)
        tracker = TrackerSpec(mode="offline", dir=str(wandb_dir), group="same-pipeline", name=run)
        try:
            log = log_of(LocalLauncher().launch(make_spec(tmp_path / name, max_epochs=1, tracker=tracker, **over)))
        except TrainingCodeError as e:
            log = str(e) + Path(e.log_uri).read_text() if getattr(e, "log_uri", None) else str(e)
        return log, [
            p.read_text()
            for p in sorted(wandb_dir.rglob("offline-run-*/logs/debug.log"), key=lambda p: p.stat().st_mtime)
        ]

    # SIGKILLed at step 2: the first attempt's run stays open in the shared service (the restart has a service of its
    # own).
    killed, debugs = launch("killed", "trial-0000", faults=FaultInjection(kill_rank=0, kill_at_step=2))
    assert launches(killed) and connected in debugs[0], (
        "the killed attempt did not use the shared service: this test proves nothing"
    )
    # The same run id from another directory: refused by the shared service, trained on a service of the trial's own.
    log, debugs = launch("after-kill", "trial-0000")
    assert "the shared W&B service refused run same-pipeline-trial-0000" in log, log[-3000:]
    assert (tmp_path / "after-kill" / "run" / "result.json").exists() and connected not in debugs[-1]
    # A trial whose training raises marks its run failed, which closes it in the shared service ...
    log, debugs = launch("raises", "trial-0001", faults=FaultInjection(raise_at_step=2))
    assert connected in debugs[0] and not (tmp_path / "raises" / "run" / "result.json").exists(), log[-3000:]
    # ... so the next trial with that run id keeps the shared service.
    log, debugs = launch("after-raise", "trial-0001")
    assert "refused run" not in log and connected in debugs[-1], log[-3000:]
    assert (tmp_path / "after-raise" / "run" / "result.json").exists()


@pytest.mark.slow
def test_training_processes_start_with_the_platforms_allocator_settings_unless_the_launch_sets_its_own(
    shared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`TRAINING_MALLOC_ENV` reaches what glibc read when the worker's server started (its exec environment)."""
    from training.spec import TRAINING_MALLOC_ENV

    def started_with(name: str) -> dict[str, str]:
        outcome = LocalLauncher().launch(make_spec(tmp_path / name, max_epochs=1))
        server = launches(log_of(outcome))[0][4]
        environ = Path(f"/proc/{server}/environ").read_bytes().split(b"\0")
        return {k.decode(): v.decode() for k, _, v in (e.partition(b"=") for e in environ) if k.startswith(b"MALLOC_")}

    for name in TRAINING_MALLOC_ENV:
        monkeypatch.delenv(name, raising=False)
    assert started_with("defaults") == TRAINING_MALLOC_ENV
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")  # a team's own setting wins
    assert started_with("own") == {**TRAINING_MALLOC_ENV, "MALLOC_TRIM_THRESHOLD_": "131072"}
