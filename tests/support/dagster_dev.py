"""Running a real `dagster dev` in a test: a free port, bounded waits, and stopping everything it started."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from typing import Any, Callable

import pytest


def free_port() -> int:
    """A TCP port on the loopback address that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(
    check: Callable[[], Any], timeout: float, what: str, interval: float = 3.0, context: Callable[[], str] = lambda: ""
) -> Any:
    """Poll `check` until it returns something truthy; fail naming `what` (and `context()`, e.g. a log tail) after
    `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            found = check()
            if found:
                return found
        time.sleep(interval)
    pytest.fail(f"{what} not within {timeout:.0f} s{context()}")


def stop_group(proc: subprocess.Popen) -> None:
    """End `dagster dev` and everything it started (webserver, daemon, code server, runs, trials): its process group."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # runs and code servers outlive a stopped parent otherwise
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
