"""One W&B service per warm worker server, shared by the trials its workers train.

`wandb.init` in a process with no W&B service starts one (the `wandb-core`
process) and waits for it: about 0.23 s of each one-epoch digits trial on a
warm worker here, a third of the trial's launch (0.69 -> 0.46 s per launch with
a shared service, measured with `LocalLauncher` on this 2-core machine). W&B's
own answer for many processes is one service that they all connect to, named
by the `WANDB_SERVICE` variable (what `wandb.setup()` in a parent process sets
for its children).

The fork server itself must stay single-threaded and `wandb.setup()` starts a
thread, so the server forks a *keeper* once: the keeper sets W&B up, sends the
service's `WANDB_SERVICE` value back through a pipe and then only waits; it
dies with the server (`PR_SET_PDEATHSIG`), and the service exits when the
keeper does. Workers get the value in their environment
(`training.warm_supervisor.service_env`) unless
their launch names a service of its own, or the service's socket is gone, in
which case `wandb.init` starts one as before. `TRAINYARD_WARM_WANDB_SERVICE=0`
turns the shared service off.
"""

from __future__ import annotations

import os
import select
import signal
import time
from typing import Optional

from common.settings import settings
from training.warm_supervisor import SERVICE, SERVICE_VAR, SWITCH_ENV, UNIX_TOKEN, die_with_parent

START_TIMEOUT_SECONDS = 20.0


def start_keeper(timeout: float = START_TIMEOUT_SECONDS) -> tuple[Optional[int], str]:
    """Fork the keeper and wait for its service; (the keeper's pid or None, the service's `WANDB_SERVICE` value or why
    none).

    Sets `SERVICE` for the workers forked after it.
    """
    if not settings().warm_wandb_service:
        return None, f"{SWITCH_ENV}=0"
    server = os.getpid()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the keeper: never returns
        os.close(read)
        _keep(server, write)
    os.close(write)
    token = b""
    deadline = time.monotonic() + timeout
    try:
        while not token.endswith(b"\n") and time.monotonic() < deadline:
            ready, _, _ = select.select([read], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            chunk = os.read(read, 4096)
            if not chunk:
                break
            token += chunk
    finally:
        os.close(read)
    value = token.decode(errors="replace").strip()
    if not value.startswith("token "):
        os.kill(pid, signal.SIGKILL)
        return pid, value.removeprefix("error ") or f"the W&B service keeper gave no service within {timeout:.0f} s"
    SERVICE[SERVICE_VAR] = value.removeprefix("token ")
    return pid, SERVICE[SERVICE_VAR]


def _keep(server: int, write: int) -> None:
    """In the keeper: set W&B up, report its service, then wait until the server dies (and this process with it)."""
    try:
        stopping: list[int] = []
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, lambda signum, frame: stopping.append(signum))
        die_with_parent(server, signal.SIGTERM)  # SIGTERM, not SIGKILL: the keeper stops its service and reaps it
        try:
            import wandb

            wandb.setup()
            value = os.environ.get(SERVICE_VAR, "")
            message = (
                f"token {value}"
                if UNIX_TOKEN.fullmatch(value)
                else f"error W&B set up no unix-socket service ({value!r})"
            )
        except Exception as e:  # W&B missing or broken: trials start their own service, as without a keeper
            message = f"error {type(e).__name__}: {e}"
        os.write(write, (message.replace("\n", " ") + "\n").encode())
        os.close(write)
        while not stopping and os.getppid() == server:
            time.sleep(1.0)
        if message.startswith("token "):
            wandb.teardown()  # stops the service and waits for it: no orphaned wandb-core, no zombie
    finally:
        os._exit(0)
