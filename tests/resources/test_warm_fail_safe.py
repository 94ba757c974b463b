"""Warm workers that fail safe: a stopped server's trials checkpoint and are retried, a killed one's are retried too.

Real processes throughout: a real `python -m training.warm serve` started by `LocalLauncher`, a real trial of the
digits MLP forked from it, the server signalled by its pid as an operator or the system would.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from resources.launcher import InfrastructureError, LocalLauncher, TrainingPreempted
from resources.warm import (
    SERVER_THREAD_ENV,
    WARM_DIR_ENV,
    WARM_WORKERS_ENV,
    server_key,
    stop_servers,
    training_env,
    training_root,
)
from tests.support.train_specs import make_spec
from training.checkpointing import CheckpointStore
from training.spec import CheckpointPolicy, ImportTarget

WORKER_LINE = re.compile(
    r"\(spec (\S+)\): worker pid (\d+) started \(restart (\d+)\) by supervisor pid (\d+) of warm server pid (\d+)"
)


@pytest.fixture()
def warm_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A warm directory of the test's own (short: a socket path must stay under 108 bytes); its servers stop after the
    test."""
    directory = Path(tempfile.mkdtemp(prefix="tyf-"))
    monkeypatch.setenv(WARM_DIR_ENV, str(directory))
    yield directory
    stop_servers(directory)
    shutil.rmtree(directory, ignore_errors=True)


def running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def worker_of(directory: Path, spec_uri: str, timeout: float = 180.0) -> tuple[int, int]:
    """(worker pid, server pid) of `spec_uri`'s first worker, from the logs of the servers in `directory`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for log in directory.glob("*.log"):
            for m in WORKER_LINE.finditer(log.read_text()):
                if m[1] == spec_uri and m[3] == "0":
                    return int(m[2]), int(m[5])
        time.sleep(0.05)
    raise AssertionError(f"no worker of {spec_uri} in the server logs of {directory}")


def slow_spec(tmp_path: Path) -> Any:
    """A trial of 0.1 s steps (long enough to be signalled mid-training) until `tmp_path/fast` exists, then at full
    speed."""
    model = ImportTarget(path="tests.support.gang_models:SlowSteps",
                         kwargs={"hidden": 16, "lr": 0.02, "step_seconds": 0.1, "until": str(tmp_path / "fast")})
    return make_spec(tmp_path, model=model, checkpoint=CheckpointPolicy(every_n_steps=4), max_epochs=12, batch_size=16)


def launch_in_thread(spec: Any) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["outcome"] = LocalLauncher().launch(spec)
        except BaseException as e:  # handed to the test thread
            box["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    return thread, box


def launched_and_checkpointed(spec: Any, warm_dir: Path) -> tuple[threading.Thread, dict[str, Any], int, int]:
    """Launch `spec`, wait for its first committed checkpoint; (thread, outcome box, worker pid, server pid)."""
    thread, box = launch_in_thread(spec)
    checkpoints = Path(spec.output_uri, "checkpoints")
    deadline = time.monotonic() + 300
    while not any(checkpoints.glob("step-*/MANIFEST.json")):
        assert thread.is_alive() and time.monotonic() < deadline, f"the launch ended before its first checkpoint: {box}"
        time.sleep(0.05)
    worker, server = worker_of(warm_dir, str(Path(spec.output_uri) / "spec.json"))
    return thread, box, worker, server


def resume(spec: Any, tmp_path: Path, warm_dir: Path, old_server: int) -> tuple[int, int]:
    """Launch `spec` again at full speed, as the retry policy does; (the step it resumed from, its server's pid)."""
    (tmp_path / "fast").touch()
    outcome = LocalLauncher().launch(spec)
    [(server,)] = {(int(m[5]),) for m in WORKER_LINE.finditer(Path(outcome.log_uri).read_text())}
    assert server != old_server and running(server)
    assert outcome.result.resumed_from and "step-" in outcome.result.resumed_from
    return int(outcome.result.resumed_from.rstrip("/").rsplit("step-", 1)[1]), server


@pytest.mark.slow
def test_a_stopped_server_checkpoints_its_trials_which_are_retried_as_preempted_and_resume(
    warm_dir: Path, tmp_path: Path
) -> None:
    spec = slow_spec(tmp_path)
    thread, box, worker, server = launched_and_checkpointed(spec, warm_dir)
    os.kill(server, signal.SIGTERM)
    thread.join(timeout=120)
    assert not thread.is_alive()
    error = box.get("error")
    assert isinstance(error, TrainingPreempted) and error.retryable, box
    assert "will resume from its last checkpoint" in str(error)
    latest = CheckpointStore(spec.output_uri + "/checkpoints").latest()
    assert latest is not None and latest.step > 0
    deadline = time.monotonic() + 30
    while (running(server) or running(worker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(server) and not running(worker)
    log = "".join(p.read_text() for p in warm_dir.glob("*.log"))
    assert f"server pid {server}: SIGTERM; forwarding SIGTERM to 1 launch(es) in flight" in log
    assert f"server pid {server}: exiting after its launches stopped\n" in log  # none left to die with it
    resumed_from, _ = resume(spec, tmp_path, warm_dir, server)
    assert resumed_from == latest.step > 0  # the preemption's checkpoint, written after the server's SIGTERM


@pytest.mark.slow
def test_a_killed_server_leaves_an_infrastructure_error_and_the_next_launch_starts_a_fresh_server(
    warm_dir: Path, tmp_path: Path
) -> None:
    spec = slow_spec(tmp_path)
    thread, box, worker, server = launched_and_checkpointed(spec, warm_dir)
    os.kill(server, signal.SIGKILL)
    thread.join(timeout=120)
    assert not thread.is_alive()
    error = box.get("error")
    assert isinstance(error, InfrastructureError) and error.retryable, box
    assert f"(warm server pid {server}) died before the launch ended" in str(error)
    assert not running(worker)
    assert list(warm_dir.glob("*.sock")), "the killed server's socket is left behind, refusing connections"
    latest = CheckpointStore(spec.output_uri + "/checkpoints").latest()
    assert latest is not None and latest.step > 0
    resumed_from, _ = resume(spec, tmp_path, warm_dir, server)
    assert resumed_from == latest.step


def probe(tmp_path: Path, name: str, **over: Any) -> dict[str, Any]:
    """Launch a 1-epoch `ThreadProbe` trial; what its training process saw, and the warm server it ran on (None:
    cold)."""
    record = tmp_path / f"{name}.json"
    spec = make_spec(tmp_path / name, max_epochs=1, **over,
                     model=ImportTarget(path="tests.support.thread_probe:ThreadProbe", kwargs={"record": str(record)}))
    outcome = LocalLauncher().launch(spec)
    servers = {int(m[5]) for m in WORKER_LINE.finditer(Path(outcome.log_uri).read_text())}
    return {
        **json.loads(record.read_text()),
        "server": servers.pop() if servers else None,
        "log": Path(outcome.log_uri).read_text(),
    }


def environ_of(pid: int) -> dict[str, str]:
    """What process `pid` was started with (a forked worker keeps its server's)."""
    pairs = (e.split(b"=", 1) for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in e)
    return {k.decode(): v.decode(errors="replace") for k, v in pairs}


@pytest.mark.slow
def test_a_teams_thread_count_reaches_its_trial_on_both_paths(
    warm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OpenMP and OpenBLAS read OMP_NUM_THREADS when they load, which in a warm worker was in its server (started with
    one thread each: a fork server holds no thread pool): the worker gives every runtime its launch's count, so a trial
    sees the team's setting on the warm path as on torchrun's."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    default = probe(tmp_path, "default")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    team = probe(tmp_path, "team")
    monkeypatch.setenv(WARM_WORKERS_ENV, "0")
    cold = probe(tmp_path, "cold")
    assert default["server"] and team["server"] and cold["server"] is None, (team["log"][-2000:], cold["log"][-2000:])
    # One server serves both (thread counts are no part of its key: test_variables_read_when_a_library_loads_...),
    # unless
    # an edit to training/ or an install between the launches replaced it; either way it started with one thread each.
    assert environ_of(team["server"])["OMP_NUM_THREADS"] == "1"
    assert default["env"]["OMP_NUM_THREADS"] == "1" and default["torch"] == 1  # the local launcher's one thread a rank
    assert {r["threads"] for r in default["runtimes"]} == {1}, default["runtimes"]
    for seen in (team, cold):
        assert seen["env"]["OMP_NUM_THREADS"] == "2" and seen["torch"] == 2
        assert {r["threads"] for r in seen["runtimes"]} == {2}, seen["runtimes"]
    assert {r["api"] for r in team["runtimes"]} == {
        "openmp",
        "openblas",
    }  # torch's and LightGBM's OpenMP, numpy's and scipy's BLAS


def test_variables_read_when_a_library_loads_key_the_server_but_thread_counts_do_not() -> None:
    root = training_root()
    base = training_env({k: v for k, v in os.environ.items() if k not in SERVER_THREAD_ENV})
    key = server_key(sys.executable, root, base)
    for name, value in (
        ("OMP_PROC_BIND", "close"),
        ("ARROW_DEFAULT_MEMORY_POOL", "system"),
        ("KMP_AFFINITY", "compact"),
        ("TORCH_CPP_LOG_LEVEL", "INFO"),
        ("MALLOC_ARENA_MAX", "2"),
    ):
        assert server_key(sys.executable, root, {**base, name: value}) != key, name
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        assert server_key(sys.executable, root, {**base, name: "4"}) == key, name
    assert server_key(sys.executable, root, {**base, "UNRELATED": "x"}) == key


def test_lightgbm_gets_the_trials_thread_count_unless_the_spec_names_one(tmp_path: Path) -> None:
    from tests.support import gbt
    from training import gbt_inputs

    spec = gbt.make_spec(tmp_path, model=ImportTarget(path="lightgbm:train", kwargs={"num_leaves": 7}))
    splits = gbt_inputs.load_splits(spec, None)
    assert gbt_inputs.lightgbm_params(spec, splits, None, threads=3)[0]["num_threads"] == 3
    own = gbt.make_spec(tmp_path, out="own", model=ImportTarget(path="lightgbm:train", kwargs={"n_jobs": 2}))
    params = gbt_inputs.lightgbm_params(own, gbt_inputs.load_splits(own, None), None, threads=3)[0]
    assert params["n_jobs"] == 2 and "num_threads" not in params


def test_a_ranks_threads_are_its_omp_setting_else_its_cpus_shared_among_the_nodes_ranks(tmp_path: Path) -> None:
    from training.threads import available_cpus, trial_threads

    assert trial_threads({"OMP_NUM_THREADS": "3"}) == 3
    cpus = available_cpus()
    assert trial_threads({}) == cpus and trial_threads({"LOCAL_WORLD_SIZE": str(cpus * 2)}) == 1
    quota = tmp_path / "cpu.max"
    quota.write_text("150000 100000\n")  # a pod limited to 1.5 CPUs may run 2 threads at a time
    assert available_cpus(str(quota)) == min(2, len(os.sched_getaffinity(0)))
    quota.write_text("max 100000\n")
    assert available_cpus(str(quota)) == len(os.sched_getaffinity(0))


class TinyLib:
    """A throwaway distribution `tyw-tinylib-<id>` (module `tyw_tinylib_<id>`, holding `VALUE`) pip-installed into this
    interpreter's site-packages, as a team upgrades a library; uninstalled at the end."""

    def __init__(self, tmp: Path) -> None:
        self.module = f"tyw_tinylib_{os.getpid()}_{time.time_ns() % 10**6}"
        self.source = tmp / "tinylib"
        (self.source / self.module).mkdir(parents=True)

    def install(self, version: str, value: str) -> None:
        (self.source / "pyproject.toml").write_text(
            f'[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
            f'[project]\nname = "{self.module.replace("_", "-")}"\nversion = "{version}"\n'
            f'[tool.setuptools]\npackages = ["{self.module}"]\n')
        (self.source / self.module / "__init__.py").write_text(f"VALUE = {value!r}\n")
        shutil.rmtree(self.source / "build", ignore_errors=True)
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-build-isolation",
                "--no-index",
                "--no-deps",
                str(self.source),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-2000:]

    def uninstall(self) -> None:
        subprocess.run(
            [sys.executable, "-m", "pip", "uninstall", "-q", "-y", self.module.replace("_", "-")],
            capture_output=True,
            timeout=300,
        )


@pytest.fixture()
def tinylib(tmp_path: Path) -> Iterator[TinyLib]:
    lib = TinyLib(tmp_path)
    try:
        yield lib
    finally:
        lib.uninstall()


@pytest.mark.extended(reason="pip-installs into the shared venv: the warm servers' keys and the zygotes' install check "
                      "change for every test running beside it on other xdist workers; make test-all runs it")
def test_a_pip_install_between_two_trials_is_picked_up_by_the_second(
    warm_dir: Path, tmp_path: Path, tinylib: TinyLib
) -> None:
    seen = {}
    for version, value in (("1.0", "v1"), ("2.0", "v2")):
        tinylib.install(version, value)
        record = tmp_path / f"{value}.json"
        model = ImportTarget(
            path="tests.support.thread_probe:ImportProbe", kwargs={"module": tinylib.module, "record": str(record)}
        )
        outcome = LocalLauncher().launch(make_spec(tmp_path / value, max_epochs=1, model=model))
        [server] = {int(m[5]) for m in WORKER_LINE.finditer(Path(outcome.log_uri).read_text())}
        seen[value] = (json.loads(record.read_text())["value"], server)
    assert seen["v1"][0] == "v1" and seen["v2"][0] == "v2"
    assert (
        seen["v1"][1] != seen["v2"][1]
    )  # the install changed the server's key: a new server, with the new installation


def forked_run(location: Any, tries: int = 5) -> Any:
    """The first of up to `tries` runs that a zygote forked (on a loaded machine it may still be loading the
    location)."""
    for _ in range(tries):
        run = location.wait(location.launch())
        if "trainyard/run_worker" in run.tags:
            return run
        time.sleep(2.0)
    raise AssertionError(f"no run of {tries} was forked from a zygote:\n{location.log()}")


@pytest.mark.extended(reason="pip-installs into the shared venv: the warm servers' keys and the zygotes' install check "
                      "change for every test running beside it on other xdist workers; make test-all runs it")
def test_a_pip_install_between_two_runs_is_picked_up_by_the_run_worker_zygote(tmp_path: Path, tinylib: TinyLib) -> None:
    """The zygote imported the code location, which imports an installed library: a pip upgrade makes it stale."""
    from tests.instance.test_run_launcher import Location, forked, until

    tinylib.install("1.0", "v1")
    location_text = LIBRARY_LOCATION.format(module=tinylib.module)

    class LibraryLocation(Location):
        def write(self, value: str) -> None:
            (self.dir / "loc.py").write_text(location_text)

    location = LibraryLocation(tmp_path)
    try:
        location.wait(location.launch())  # the default way, while the zygote starts
        warm = forked_run(location)
        worker = forked(warm)
        assert location.recorded(warm.run_id)["value"] == "v1"
        tinylib.install("2.0", "v2")
        upgraded = location.wait(location.launch())
        assert "trainyard/run_worker" not in upgraded.tags and location.recorded(upgraded.run_id)["value"] == "v2"
        stale = re.compile(rf"{tinylib.module}-[12]\.0\.dist-info changed since the warm run worker process loaded it")
        assert any(stale.search(m) for m in location.events(upgraded.run_id)), location.events(upgraded.run_id)
        until(lambda: not running(worker["zygote"]))  # the stale zygote left
        after = forked_run(location)
        assert forked(after)["zygote"] != worker["zygote"] and location.recorded(after.run_id)["value"] == "v2"
    finally:
        location.stop()
        location.instance.dispose()


LIBRARY_LOCATION = '''
import json, os
from pathlib import Path
from dagster import Definitions, in_process_executor, job, op
import {module}


@op
def record(context):
    out = Path(os.environ["WARM_RUN_OUT"])
    out.mkdir(exist_ok=True)
    (out / f"{{context.run_id}}.json").write_text(json.dumps({{"value": {module}.VALUE, "pid": os.getpid()}}))


@job(executor_def=in_process_executor)
def hello():
    record()


defs = Definitions(jobs=[hello])
'''


def test_an_install_upgrade_or_removal_changes_the_installed_snapshot(tmp_path: Path) -> None:
    from common import installed

    site = tmp_path / "site-packages"
    (site / "lib-1.0.dist-info").mkdir(parents=True)
    (site / "lib").mkdir()
    paths = [str(site), str(tmp_path / "missing")]
    before, print_before = installed.snapshot(paths), installed.fingerprint(paths)
    assert list(before) == [str(site / "lib-1.0.dist-info")] and installed.changed(before, paths) is None
    (site / "lib" / "__init__.py").write_text(
        "VALUE = 1\n"
    )  # a file of a package, not its metadata: the module check's
    assert installed.changed(before, paths) is None
    shutil.rmtree(site / "lib-1.0.dist-info")
    (site / "lib-2.0.dist-info").mkdir()  # what pip does on an upgrade
    assert (
        installed.changed(before, paths) == str(site / "lib-1.0.dist-info")
        and installed.fingerprint(paths) != print_before
    )
    again = installed.snapshot(paths)
    shutil.rmtree(site / "lib-2.0.dist-info")
    time.sleep(0.05)  # a reinstall takes seconds; the kernel's file times advance in ticks of a few ms
    (site / "lib-2.0.dist-info").mkdir()  # a reinstall of the same version: a new directory
    assert installed.changed(again, paths) == str(site / "lib-2.0.dist-info")


THREADS_LOCATION = '''
import json, os
from pathlib import Path
import numpy, pyarrow
from threadpoolctl import threadpool_info
from dagster import Definitions, in_process_executor, job, op


@op
def record(context):
    out = Path(os.environ["WARM_RUN_OUT"])
    out.mkdir(exist_ok=True)
    seen = {"value": "", "pid": os.getpid(), "ppid": os.getppid(),
            "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "JE_ARROW_MALLOC_CONF")},
            "blas": sorted({i["num_threads"] for i in threadpool_info() if i["internal_api"] == "openblas"})}
    (out / f"{context.run_id}.json").write_text(json.dumps(seen))


@job(executor_def=in_process_executor)
def hello():
    record()


defs = Definitions(jobs=[hello])
'''


@pytest.mark.slow
def test_the_zygote_forks_with_one_thread_and_its_run_workers_get_the_environments_thread_counts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """numpy's OpenBLAS starts its threads as it loads, pyarrow's jemalloc its purger: the zygote starts them with none,
    checks the kernel's list of its threads, and gives each forked run worker the daemon's settings back."""
    from tests.instance.test_run_launcher import Location, forked

    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    monkeypatch.delenv("JE_ARROW_MALLOC_CONF", raising=False)

    class ThreadsLocation(Location):
        def write(self, value: str) -> None:
            (self.dir / "loc.py").write_text(THREADS_LOCATION)

    location = ThreadsLocation(tmp_path)
    try:
        spawned = location.wait(location.launch())  # the default way, while the zygote starts
        warm = forked_run(location)
        zygote = forked(warm)["zygote"]
        assert len(os.listdir(f"/proc/{zygote}/task")) == 1  # numpy and pyarrow loaded (the location imports them)
        assert {
            k: environ_of(zygote).get(k) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "JE_ARROW_MALLOC_CONF")
        } == {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "JE_ARROW_MALLOC_CONF": "background_thread:false"}
        seen, default = location.recorded(warm.run_id), location.recorded(spawned.run_id)
        assert seen["ppid"] == zygote
        expected = {"OMP_NUM_THREADS": "2", "OPENBLAS_NUM_THREADS": None, "JE_ARROW_MALLOC_CONF": None}
        assert seen["env"] == default["env"] == expected  # the daemon's environment, as a spawned run worker has it
        assert seen["blas"] == default["blas"] == [min(2, len(os.sched_getaffinity(0)))]
    finally:
        location.stop()
        location.instance.dispose()


def test_trials_of_several_gpu_ranks_start_cold_until_forked_nccl_is_proven(tmp_path: Path) -> None:
    """bench/gpu_forked_nccl.py is the GPU run that would prove NCCL from forked ranks; until then they take
    torchrun."""
    from training.spec import Distribution

    def spec(procs: int, accelerator: str) -> Any:
        return make_spec(
            tmp_path / f"{accelerator}{procs}", distribution=Distribution(procs_per_node=procs, accelerator=accelerator)
        )

    launcher = LocalLauncher()
    assert launcher._warm(spec(1, "gpu")) and launcher._warm(spec(2, "cpu"))
    assert not launcher._warm(spec(2, "gpu"))
    assert LocalLauncher(warm_multi_gpu=True)._warm(spec(2, "gpu"))
