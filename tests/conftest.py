from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, Iterator

import pytest

from tests.s3_server import s3_endpoint  # noqa: F401
from tests.support.webhook import WebhookServer

if TYPE_CHECKING:
    from tests.pipelines.pipeline_fixtures import Harness
    from tests.support.trained import TrainedHome

os.environ.setdefault("GX_ANALYTICS_ENABLED", "False")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("DO_NOT_TRACK", "1")

POSTGRES_URL = "postgresql+psycopg2://postgres@127.0.0.1:5432/postgres"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow", action="store_true", help="also run tests marked slow (always on when CI is set)")
    parser.addoption("--extended", action="store_true",
                     help="also run tests marked extended, and slow ones (`make test-all`; not in .ci/run)")


EXTENDED_ENV = "TRAINYARD_TEST_EXTENDED"  # set to 1: as --extended


# The longest files (minutes each with slow tests on), collected first, longest first.
# xdist's loadfile hands out files with the most tests first and keeps this order only
# among equals, so the one-test journey still starts late. `--no-loadscope-reorder` would
# apply this order fully (each worker takes the next file when fewer than two are queued:
# a longest-first schedule), but in a full CI=true run with it four Dagster and emulated-
# cluster tests failed that pass alone and passed in CI under the default order, so the
# default stays until that pairing is understood. Worker seconds per file, --durations.
# Tried again at 68d695d with 3 workers (a `pytest_xdist_make_scheduler` keeping this
# order): 1,221 s and 1 failure, against 1,102 s and none in xdist's order; the longest
# files together (journey, drills, demo) slowed each other by 30-140%. Not kept.
LONGEST_FIRST = (
    "tests/e2e/test_first_contact.py",
    "tests/e2e/test_shard_lm.py",
    "tests/training/test_fault_tolerance.py",
    "tests/pipelines/test_sensors.py",
    "tests/deploy/test_trainer_image.py",
    "tests/resources/test_launcher.py",
    "tests/resources/test_warm_workers.py",
    "tests/test_demo.py",
    "tests/pipelines/test_team.py",
    "tests/resources/test_k8s_emulated.py",
    "tests/resources/test_k8s_emulated_retries.py",
    "tests/test_serving.py",
    "tests/resources/registry/test_client.py",
    "tests/pipelines/test_language.py",
    "tests/e2e/test_shard_images.py",
    "tests/training/test_causal_lm.py",
    "tests/resources/test_promotion.py",
    "tests/resources/test_promotion_metrics.py",
    "tests/assets/test_trials.py",
    "tests/training/test_safe_loading.py",
    "tests/pipelines/test_recovery.py",
    "tests/training/test_strategies.py",
    "tests/training/test_gang.py",
    "tests/security/test_credential_canary.py",
    "tests/featurestore/test_churn_pipeline.py",
    "tests/pipelines/test_regression_pipeline.py",
    "tests/trainyard/data/test_ingest.py",
)


def _longest_first(items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}

    def key(item: pytest.Item) -> int:
        return rank.get(item.nodeid.split("::", 1)[0], len(rank))

    items.sort(key=key)  # stable: the order inside a file and among the rest stays


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    extended = config.getoption("--extended") or os.environ.get(EXTENDED_ENV) == "1"
    if not extended:
        skip_extended = pytest.mark.skip(reason="extended: run with --extended or `make test-all` (not in .ci/run)")
        for item in items:
            if "extended" in item.keywords:
                item.add_marker(skip_extended)
    if extended or config.getoption("--slow") or os.environ.get("CI"):
        _longest_first(items)
        return
    skip = pytest.mark.skip(reason="slow: run with --slow, `make test SLOW=1`, or CI=true (.ci/run)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


CPU_LOG_ENV = "TRAINYARD_TEST_CPU_LOG"
"""A file to append each test's CPU seconds to (its own and its reaped child processes'), its wall time, xdist worker
and end time: one JSON line a test."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Iterator[None]:
    path = os.environ.get(CPU_LOG_ENV)
    if not path:
        yield
        return
    import json
    import resource
    import time

    def cpu() -> tuple[float, float]:
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime

    before, started = cpu(), time.monotonic()
    yield
    after = cpu()
    with open(path, "a") as f:
        f.write(
            json.dumps(
                {
                    "test": item.nodeid,
                    "wall": round(time.monotonic() - started, 2),
                    "own": round(after[0] - before[0], 2),
                    "children": round(after[1] - before[1], 2),
                    "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
                    "end": round(time.time(), 1),
                }
            )
            + "\n"
        )


@pytest.fixture(scope="session", autouse=True)
def _warm_worker_servers() -> Iterator[None]:
    """Warm worker servers (`resources.warm`) of this session (an xdist worker's own) live in a directory of its own and
    stop with it.

    A short directory under /tmp: a unix socket path must stay under 108 bytes.
    """
    import shutil
    import tempfile
    from pathlib import Path

    from resources.warm import WARM_DIR_ENV, stop_servers

    directory = Path(tempfile.mkdtemp(prefix="tyw-"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(WARM_DIR_ENV, str(directory))
        yield
    stop_servers(directory)
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(autouse=True)
def _no_dangling_dagster_instance() -> Iterator[None]:
    """Clear Dagster's current defs-state storage after each test.

    Entering a `DagsterInstance` sets it in a context variable that only the
    instance's exit resets; an instance a test enters and never exits leaves it
    set, holding a weak reference, and once that instance is collected the next
    test that resolves a `Definitions` in this worker fails with "Attempted to
    resolve undefined DagsterInstance weakref". None is the variable's default.
    Never imports Dagster: a session that has not loaded it has nothing to clear.
    """
    yield
    base = sys.modules.get("dagster._core.storage.defs_state.base")
    if base is not None:
        base._current_storage.set(None)


def postgres_available() -> bool:
    """Whether the PostgreSQL server of the tests answers at 127.0.0.1:5432."""
    import sqlalchemy

    try:
        with sqlalchemy.create_engine(POSTGRES_URL).connect():
            return True
    except Exception:  # any connection failure means "not here"
        return False


@pytest.fixture()
def pg_databases():
    """Two fresh PostgreSQL databases (Optuna and MLflow each keep their own alembic version).

    Skips, outside CI only, when no server is reachable.
    """
    if not postgres_available():
        if os.environ.get("CI"):
            pytest.fail("PostgreSQL at 127.0.0.1:5432 is required in CI")
        pytest.skip("no PostgreSQL reachable at 127.0.0.1:5432")
    import uuid

    import sqlalchemy

    names = [f"trainyard_test_{uuid.uuid4().hex[:8]}" for _ in range(2)]
    admin = sqlalchemy.create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        for name in names:
            c.execute(sqlalchemy.text(f"CREATE DATABASE {name}"))
    yield [f"postgresql+psycopg2://postgres@127.0.0.1:5432/{name}" for name in names]
    with admin.connect() as c:
        for name in names:
            c.execute(sqlalchemy.text(f"DROP DATABASE {name} WITH (FORCE)"))


@pytest.fixture(scope="session")
def trained_home(tmp_path_factory: pytest.TempPathFactory) -> TrainedHome:
    """The small digits pipeline (`small_spec()`) trained end to end once per test run.

    Under xdist each worker is its own session: the home lives in the directory the
    workers share and a file lock lets the first worker train it while the others wait
    and reuse it. Never change it; take a copy with the `trained` fixture.
    """
    # Imported here: Dagster and the pipeline load only in sessions that train.
    from tests.support.trained import train_once

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    return train_once(root / "trained-digits-home")


@pytest.fixture(scope="module")
def trained(trained_home: TrainedHome, tmp_path_factory: pytest.TempPathFactory) -> tuple[Harness, dict[str, Any]]:
    """This module's own copy of the trained home: a `Harness` on it and `run_all`'s output (paths re-rooted).

    A copy per module, so a module may register versions, rerun jobs or change files
    without another module (or another xdist worker) seeing it.
    """
    # Imported here for the same reason as in `trained_home`.
    from tests.pipelines.pipeline_fixtures import Harness, small_spec
    from tests.support.trained import copy_home

    copy = copy_home(trained_home, tmp_path_factory.mktemp("home"))
    return Harness(copy.home, small_spec()), copy.out


@pytest.fixture()
def webhook() -> Iterator[WebhookServer]:
    """A loopback webhook endpoint of its own for each test (see `tests.support.webhook`)."""
    hook = WebhookServer()
    yield hook
    hook.close()
