"""Process-group start-up that survives torchrun's in-job restarts.

torchrun (torch 2.13) restarts a failed worker group against the same agent
store, and gloo's full-mesh connect then reads peer addresses left by the
previous group ("Connection refused" to a dead worker; a restart that never
comes up). Each group therefore starts its process group on a store prefixed
with the launch and restart count, so every group sees only its own keys.
Lightning finds the group initialized and uses it. On warm workers rank 0's
store serves a socket its supervisor already listens on (`STORE_LISTEN_FD_ENV`),
so a rank that connects first waits in the queue, not in a retry backoff.

`lost_peer` tells the error a surviving rank raises when another rank died
(killed, out of memory) from an error of its own.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from common.settings import settings
from training.spec import STORE_LISTEN_FD_ENV


def init_process_group(backend: str, timeout_seconds: float = 600.0) -> bool:
    """Initialize the default process group from torchrun's environment; False when single-process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 or dist.is_initialized():
        return False
    rank = int(os.environ["RANK"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "False") == "True"
    is_master = not agent_store and rank == 0
    listen_fd = settings().store_listen_fd
    os.environ.pop(STORE_LISTEN_FD_ENV, None)  # consumed here: this process's children name no socket of theirs
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=is_master,
        timeout=timedelta(seconds=timeout_seconds),
        master_listen_fd=listen_fd if is_master else None,
    )
    launch = settings().launch_id
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"trainyard/{'direct' if launch is None else launch}/restart-{restart}"
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(prefix, store),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_seconds),
    )
    return True


_COMM_ERRORS = ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError")
_COMM_TEXT = ("connection closed by peer", "connection reset by peer", "gloo", "nccl")


def lost_peer(exc: BaseException) -> bool:
    """Whether `exc` is a collective or store failure: what a rank raises when a peer is gone.

    Such a rank is a casualty, not the cause: the cause is the peer, which may
    have died without a word (SIGKILL), and its launcher names it.
    """
    text = str(exc).lower()
    return type(exc).__name__ in _COMM_ERRORS or any(s in text for s in _COMM_TEXT)
