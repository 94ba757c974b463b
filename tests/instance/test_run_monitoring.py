"""Run monitoring of the local instance (issue 49, item 10): a killed run worker is marked failed, its temp folder
removed.

A real `dagster-daemon` over deploy/local/dagster.yaml's launcher and monitoring
(polling every second here): a run held in its op has its worker SIGKILLed; the
daemon's monitoring marks the run FAILURE, naming the worker, for a run spawned
the default way and for a forked one, whose temporary folder goes too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from instance.run_launcher import WORKER_TAG, WarmRunLauncher, _process_state, _worker_pid, run_temp_dir
from tests.instance import test_run_launcher as launcher_tests

ROOT = Path(__file__).resolve().parents[2]

LOCATION = '''
import json, os, tempfile, time
from pathlib import Path
from dagster import Definitions, in_process_executor, job, op


@op
def record(context):
    out = Path(os.environ["WARM_RUN_OUT"])
    out.mkdir(exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="trainyard-ingest-")  # what ingest makes, in the run's temp folder when forked
    (out / f"{context.run_id}.json").write_text(json.dumps({"pid": os.getpid(), "scratch": scratch}))
    while (out.parent / "hold").exists():
        time.sleep(0.2)


@job(executor_def=in_process_executor)
def hello():
    record()


defs = Definitions(jobs=[hello])
'''


def test_the_local_instance_enables_run_monitoring_with_a_launcher_that_checks_workers() -> None:
    config = yaml.safe_load((ROOT / "deploy" / "local" / "dagster.yaml").read_text())
    assert config["run_monitoring"] == {"enabled": True, "poll_interval_seconds": 30, "max_resume_run_attempts": 0}
    assert WarmRunLauncher().supports_check_run_worker_health


def test_a_dead_worker_is_told_from_a_live_one() -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert _process_state(sleeper.pid, time.time()) == "alive"
        assert _process_state(sleeper.pid, time.time() - 3600) == "reused"  # started long after the run did
        os.kill(sleeper.pid, signal.SIGKILL)
        time.sleep(0.3)
        assert _process_state(sleeper.pid, None) == "zombie"  # not reaped yet: dead all the same
    finally:
        sleeper.wait()
    assert _process_state(sleeper.pid, None) == "gone"


@pytest.mark.slow
def test_a_sigkilled_run_is_marked_failed_and_leaves_no_temp_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monitored = (
        launcher_tests.INSTANCE_YAML
        + "run_monitoring:\n  enabled: true\n  poll_interval_seconds: 1\n  max_resume_run_attempts: 0\n"
    )
    monkeypatch.setattr(launcher_tests, "INSTANCE_YAML", monitored)
    monkeypatch.setattr(launcher_tests, "LOCATION", LOCATION.replace("{", "{{").replace("}", "}}"))
    location = launcher_tests.Location(tmp_path)
    try:
        (tmp_path / "hold").touch()

        def killed(run_id: str) -> Any:
            launcher_tests.until(lambda: (tmp_path / "out" / f"{run_id}.json").exists(), timeout=120)
            seen = json.loads((tmp_path / "out" / f"{run_id}.json").read_text())
            run = location.wait(run_id, ("STARTED",))
            assert _worker_pid(location.instance, run)[0] == seen["pid"]
            os.kill(seen["pid"], signal.SIGKILL)
            failed = None
            deadline = time.time() + 60
            while time.time() < deadline:
                failed = location.instance.get_run_by_id(run_id)
                if failed is not None and failed.status.value == "FAILURE":
                    break
                time.sleep(0.5)
            assert failed is not None and failed.status.value == "FAILURE", (
                f"{failed and failed.status}\n{location.log()}"
            )
            return failed, seen, [e.message for e in location.instance.all_logs(run_id)]

        # Spawned the default way (the warm process is starting): its code server notices the exit, or else monitoring.
        first, _, said = killed(location.launch())
        assert WORKER_TAG not in first.tags
        assert any("Run execution process" in m or "without recording the run's end" in m for m in said), said[-5:]
        # Forked: only run monitoring can tell, through WarmRunLauncher.check_run_worker_health.
        second, seen, said = killed(location.launch())
        assert WORKER_TAG in second.tags
        assert any(
            f"the run worker (pid {seen['pid']}) " in m and "without recording the run's end" in m for m in said
        ), said[-5:]
        assert seen["scratch"].startswith(run_temp_dir(second.run_id) + os.sep)
        assert not os.path.exists(run_temp_dir(second.run_id))
    finally:
        (tmp_path / "hold").unlink(missing_ok=True)
        location.stop()
        location.instance.dispose()


def test_the_private_dagster_names_run_monitoring_relies_on_still_exist() -> None:
    """`WarmRunLauncher` answers Dagster's run monitoring through private launcher names (Dagster 1.13);
    an upgrade that moves or renames one fails here, by name, before any run stays STARTED for ever."""
    import inspect

    from dagster import DefaultRunLauncher
    from dagster._core.launcher import base

    assert {s.name for s in base.WorkerStatus} >= {"RUNNING", "FAILED"}
    assert list(inspect.signature(base.CheckRunHealthResult).parameters)[:2] == ["status", "msg"]
    assert hasattr(base, "LaunchRunContext")
    # The hooks the daemon calls, and that the launcher overrides.
    assert "supports_check_run_worker_health" in dir(DefaultRunLauncher) and "check_run_worker_health" in dir(
        DefaultRunLauncher
    )
    assert WarmRunLauncher.check_run_worker_health is not DefaultRunLauncher.check_run_worker_health
