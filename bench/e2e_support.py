"""Shared pieces of the end-to-end benchmarks: a real `dagster dev` on PostgreSQL run storage, and where a run's time
went.

- `fresh_database()`: a new PostgreSQL database on 127.0.0.1:5432 (trust auth)
  for one benchmark run, dropped afterwards.
- `dagster_home()`: a DAGSTER_HOME whose dagster.yaml is deploy/local/dagster.yaml
  (the run queue: QueuedRunCoordinator, default run launcher) plus
  `storage: postgres:` pointing at that database.
- `DagsterDev`: `dagster dev` (webserver, daemon, code server) on a workspace of
  one module, started in its own process group, with a warm worker directory of
  its own (no server left by an earlier benchmark); runs are launched through the
  webserver's GraphQL API, as the UI's Launchpad does.
- `run_phases()` (pure): a run's event timestamps -> queue wait, launch (run
  worker start-up and imports), up to the first step, steps, finish.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
POSTGRES_ADMIN_URL = "postgresql+psycopg2://postgres@127.0.0.1:5432/postgres"
REPOSITORY = "__repository__"  # the repository name Dagster gives a module's `Definitions`
LAUNCH_MUTATION = """
mutation ($params: ExecutionParams!) {
  launchRun(executionParams: $params) { __typename
    ... on LaunchRunSuccess { run { runId } }
    ... on PythonError { message }
    ... on RunConfigValidationInvalid { errors { message } }
  }
}"""
# The run events that mark a run's phases, in order.
ENQUEUED, STARTING, START, SUCCESS = "PIPELINE_ENQUEUED", "PIPELINE_STARTING", "PIPELINE_START", "PIPELINE_SUCCESS"
STEP_START, STEP_SUCCESS = "STEP_START", "STEP_SUCCESS"
DONE = {"SUCCESS", "FAILURE", "CANCELED"}


@contextlib.contextmanager
def fresh_database(prefix: str = "trainyard_bench") -> Iterator[str]:
    """A new, empty PostgreSQL database for one benchmark run; yields its SQLAlchemy URL (psycopg2) and drops it
    afterwards."""
    import sqlalchemy

    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    admin = sqlalchemy.create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as c:
            c.execute(sqlalchemy.text(f"CREATE DATABASE {name}"))
    except sqlalchemy.exc.OperationalError as e:
        raise RuntimeError(f"the end-to-end benchmarks need PostgreSQL at 127.0.0.1:5432 (trust auth): {e}") from e
    try:
        yield f"postgresql+psycopg2://postgres@127.0.0.1:5432/{name}"
    finally:
        with admin.connect() as c:
            c.execute(sqlalchemy.text(f"DROP DATABASE {name} WITH (FORCE)"))
        admin.dispose()


def dagster_yaml(postgres_url: str) -> str:
    """The shipped local instance config (run queue, team limits) with every storage on `postgres_url`."""
    shipped = (ROOT / "deploy" / "local" / "dagster.yaml").read_text()
    return f"{shipped.rstrip()}\nstorage:\n  postgres:\n    postgres_url: {postgres_url}\n"


def dagster_home(path: Path, postgres_url: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "dagster.yaml").write_text(dagster_yaml(postgres_url))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(
    check: Callable[[], Any], timeout: float, what: str, interval: float = 0.5, log: Optional[Path] = None
) -> Any:
    """Poll `check` until it returns something truthy; raise TimeoutError naming `what` (with the log's tail) after
    `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            found = check()
            if found:
                return found
        time.sleep(interval)
    tail = log.read_text(errors="replace")[-4000:] if log is not None and log.exists() else ""
    raise TimeoutError(f"{what} not within {timeout:.0f} s\n{tail}")


@dataclass
class DagsterDev:
    """A running `dagster dev`: its port, log, location name and process."""

    port: int
    log: Path
    location: str
    proc: subprocess.Popen

    def graphql(self, query: str, variables: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        body = json.dumps({"query": query, "variables": variables or {}}).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/graphql", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            answer = json.loads(resp.read())
        if answer.get("errors"):
            raise RuntimeError(f"GraphQL errors: {answer['errors']}")
        return dict(answer["data"])

    def launch(self, job: str, tags: Optional[dict[str, str]] = None) -> str:
        """Launch `job` as the Launchpad does (the run is queued; the daemon dequeues and launches it); its run id."""
        params = {
            "selector": {"repositoryLocationName": self.location, "repositoryName": REPOSITORY, "jobName": job},
            "runConfigData": {},
            "executionMetadata": {"tags": [{"key": k, "value": v} for k, v in (tags or {}).items()]},
        }
        result = self.graphql(LAUNCH_MUTATION, {"params": params})["launchRun"]
        if result["__typename"] != "LaunchRunSuccess":
            raise RuntimeError(f"launching {job} failed: {result}")
        return str(result["run"]["runId"])


@contextlib.contextmanager
def dagster_dev(
    module: str, location: str, env: dict[str, str], workdir: Path, expected_assets: int, timeout: float = 180
) -> Iterator[DagsterDev]:
    """`dagster dev` on a workspace of `module`, serving once the webserver lists `expected_assets` assets; stopped (its
    whole process group) afterwards.

    Warm worker servers (`resources.warm`) live in a directory of this run's own and are stopped with it: each
    benchmark starts as a machine with none running does, never on a server an earlier benchmark left warm.
    """
    from resources.warm import WARM_DIR_ENV, stop_servers

    warm = Path(tempfile.mkdtemp(prefix="tyw-"))  # short: a socket path must stay under 108 bytes
    env = {WARM_DIR_ENV: str(warm), **env}
    workspace = workdir / "workspace.yaml"
    workspace.write_text(
        f"load_from:\n  - python_module:\n      module_name: {module}\n      location_name: {location}\n      "
        f"working_directory: {ROOT}\n"
    )
    port, log = free_port(), workdir / "dagster-dev.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dagster", "dev", "-w", str(workspace), "-h", "127.0.0.1", "-p", str(port)],
            cwd=workdir,
            env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    dev = DagsterDev(port, log, location, proc)
    try:
        wait_for(
            lambda: len(dev.graphql("{ assetNodes { id } }")["assetNodes"]) >= expected_assets,
            timeout,
            "the webserver serving the assets",
            log=log,
        )
        yield dev
    finally:
        stop_group(proc)
        stop_servers(warm)
        shutil.rmtree(warm, ignore_errors=True)


def stop_group(proc: subprocess.Popen) -> None:
    """End `dagster dev` and everything it started (webserver, daemon, code server, run workers, trials)."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait)


def run_events(instance: Any, run_id: str) -> list[tuple[str, float, Optional[str]]]:
    """(event type, timestamp, step key) of every Dagster event of a run, in order."""
    out = []
    for record in instance.all_logs(run_id):
        event = record.dagster_event
        if event is not None:
            out.append((event.event_type_value, float(record.timestamp), event.step_key))
    return out


def wait_for_run(instance: Any, run_id: str, timeout: float, log: Optional[Path] = None) -> str:
    """Wait until the run ends; its status name. Raises RuntimeError when it did not succeed."""
    status = wait_for(
        lambda: (s := instance.get_run_by_id(run_id).status.value) in DONE and s, timeout, f"run {run_id}", log=log
    )
    if status != "SUCCESS":
        tail = log.read_text(errors="replace")[-4000:] if log is not None and log.exists() else ""
        raise RuntimeError(f"run {run_id} ended {status}\n{tail}")
    return str(status)


def first_event(events: Sequence[tuple[str, float, Optional[str]]], kind: str) -> float:
    """The timestamp of the first event of type `kind`; ValueError naming it when there is none."""
    for name, ts, _ in events:
        if name == kind:
            return ts
    raise ValueError(f"the run has no {kind} event (events: {sorted({e[0] for e in events})})")


def run_phases(
    events: Sequence[tuple[str, float, Optional[str]]], submitted: Optional[float] = None
) -> dict[str, float]:
    """Where one run's time went, from its events `(type, timestamp, step key)`.

    - queued: enqueued (or `submitted`, the caller's clock before it asked) -> the
      daemon dequeued it and called the run launcher (STARTING);
    - launch: STARTING -> the run worker process running the job (START): process
      start-up and the code's imports;
    - to_first_step: START -> the first STEP_START (resources and the plan; a
      step process too under Dagster's multiprocess executor, which the
      platform's jobs no longer use);
    - steps: the first STEP_START -> the last STEP_SUCCESS;
    - finish: the last STEP_SUCCESS -> the run's SUCCESS;
    - total: the start of `queued` -> SUCCESS.

    Raises:
        ValueError: an event a successful run has is missing, or they are out of order.
    """
    begin = submitted if submitted is not None else first_event(events, ENQUEUED)
    starting, start, success = first_event(events, STARTING), first_event(events, START), first_event(events, SUCCESS)
    step_starts = [ts for name, ts, _ in events if name == STEP_START]
    step_ends = [ts for name, ts, _ in events if name == STEP_SUCCESS]
    if not step_starts or not step_ends:
        raise ValueError("the run has no step that started and succeeded")
    marks = [begin, starting, start, min(step_starts), max(step_ends), success]
    if any(b < a for a, b in zip(marks, marks[1:])):
        raise ValueError(f"run events out of order: {marks}")
    names = ("queued", "launch", "to_first_step", "steps", "finish")
    return {**{n: b - a for n, a, b in zip(names, marks, marks[1:])}, "total": success - begin}
