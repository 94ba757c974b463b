"""Pipes messages through the trial's store: what a cluster trial's rank 0 sends reaches the Dagster run.

The external side is the real pod code (`training.reporting.Reporter`, which opens
Pipes with `training.pipes_store.StoreOrDefaultMessageWriter`) in real processes
started with the session's bootstrap environment, as the Kubernetes launcher puts
it into the pods. Two processes one after the other stand for a gang restarted
after a lost node: the first reports and dies with an error, the second reports
and finishes. The store is a local folder and a real S3 endpoint (moto).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from dagster import DagsterInstance, MaterializeResult, PipesEnvContextInjector, asset, materialize, open_pipes_session

from resources.pipes_store import PipesStoreMessageReader

ROOT = Path(__file__).resolve().parents[2]
BURST = 1500  # log lines the second process writes at once, more than a pod log read used to return

POD = """
import sys
from training.reporting import Reporter

incarnation, fail, burst = sys.argv[1], sys.argv[2] == "fail", int(sys.argv[3])
with Reporter(0) as reporter:
    assert reporter.active, "Pipes did not open"
    for epoch in range(3):
        reporter.progress({"epoch": epoch, "step": 10 * (epoch + 1), "metrics": {"val_loss": 1.0 / (epoch + 1)},
                           "incarnation": incarnation})
    for n in range(burst):
        reporter.info(f"burst line {n}")
    if fail:
        raise RuntimeError("node lost")
"""


def run_pod(env: dict[str, str], incarnation: str, fail: bool, burst: int = 0) -> int:
    return subprocess.run(
        [sys.executable, "-c", POD, incarnation, "fail" if fail else "ok", str(burst)], env=env, cwd=ROOT, timeout=120,
        capture_output=True,
    ).returncode


def wait_for(predicate: Any, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def materialize_restarted_gang(uri: str, extra_env: dict[str, str]) -> tuple[dict[str, Any], list[str]]:
    out: dict[str, Any] = {}

    @asset
    def trial(context):  # type: ignore[no-untyped-def]  # Dagster reads the annotation, a string here
        reader = PipesStoreMessageReader(uri, interval=0.2)
        with open_pipes_session(
            context=context, context_injector=PipesEnvContextInjector(), message_reader=reader
        ) as session:
            env = {**os.environ, **extra_env, **session.get_bootstrap_env_vars(), "PYTHONPATH": str(ROOT)}
            env.pop("DAGSTER_PIPES_MESSAGES_PATH", None)
            first = run_pod(env, "1", fail=True)
            # Delivered while the session is open, not only when it closes.
            live = wait_for(lambda: len(session.get_custom_messages()) >= 3)
            second = run_pod(env, "2", fail=False, burst=BURST)
        out.update(first=first, second=second, live=live, messages=list(session.get_custom_messages()))
        return MaterializeResult()

    instance = DagsterInstance.ephemeral()
    result = materialize([trial], instance=instance)
    assert result.success
    logs = [e.user_message for e in instance.all_logs(result.run_id)]
    return out, logs


def check(out: dict[str, Any], logs: list[str]) -> None:
    assert out["first"] == 1 and out["second"] == 0
    assert out["live"], "the first process's progress did not reach the run while the session was open"
    progress = [(m["incarnation"], m["epoch"]) for m in out["messages"] if m.get("type") == "progress"]
    assert progress == [("1", 0), ("1", 1), ("1", 2), ("2", 0), ("2", 1), ("2", 2)]  # both incarnations, in order
    burst = [line for line in logs if line.startswith("burst line ")]
    assert burst == [f"burst line {n}" for n in range(BURST)]  # every line, in order
    assert sum("epoch 2 step 30: val_loss=0.3333" in line for line in logs) == 2
    assert not any("unexpected message received after closed" in line for line in logs)


def test_a_restarted_gangs_messages_all_reach_the_run_from_a_local_store(tmp_path: Path) -> None:
    out, logs = materialize_restarted_gang(str(tmp_path / "pipes" / "run-0"), {})
    check(out, logs)
    incarnations = sorted(p.name for p in (tmp_path / "pipes" / "run-0").iterdir())
    assert len(incarnations) == 2 and all((tmp_path / "pipes" / "run-0" / i / "1.json").exists() for i in incarnations)


def test_a_restarted_gangs_messages_all_reach_the_run_from_s3(s3_endpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint.url)
    out, logs = materialize_restarted_gang(
        s3_endpoint.root("trials", "t0", "pipes", "run-0"), {"AWS_ENDPOINT_URL": s3_endpoint.url}
    )
    check(out, logs)


def test_the_local_launchers_file_channel_is_unchanged(tmp_path: Path) -> None:
    """Without a store in the params the same pod code writes to the file a local launch gives it."""
    from dagster import PipesTempFileMessageReader

    out: list[Any] = []

    @asset
    def local(context):  # type: ignore[no-untyped-def]
        with open_pipes_session(
            context=context, context_injector=PipesEnvContextInjector(), message_reader=PipesTempFileMessageReader()
        ) as session:
            env = {**os.environ, **session.get_bootstrap_env_vars(), "PYTHONPATH": str(ROOT)}
            assert run_pod(env, "1", fail=False) == 0
        out.extend(session.get_custom_messages())
        return MaterializeResult()

    assert materialize([local], instance=DagsterInstance.ephemeral()).success
    assert [m["epoch"] for m in out] == [0, 1, 2]
