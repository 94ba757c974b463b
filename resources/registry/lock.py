"""A per-model critical section across processes and hosts, built on the registry itself.

The lock of model `m` is the registered model `m.trainyard-lock`: creating a
registered model is atomic in every MLflow backend (a second create fails with
RESOURCE_ALREADY_EXISTS), and it is deleted on release. Its tags name the
holder, the purpose and when it expires, so a holder that died blocks others
only until then.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from typing import Iterator, Optional, Protocol

from resources.registry.backend import RegistryConnection, check_model_name, client, retried
from resources.registry.errors import ALREADY_EXISTS, MISSING, RegistryError, RegistryUnavailable, translate_errors
from trainyard.lineage import LOCK_EXPIRES_TAG, LOCK_OWNER_TAG, LOCK_PURPOSE_TAG

logger = logging.getLogger(__name__)

LOCK_MODEL_SUFFIX = ".trainyard-lock"
"""A registered model named `<model><suffix>` exists exactly while `lock(model)` is held."""


class LockingRegistry(RegistryConnection, Protocol):
    """What `hold_lock` needs of the registry (`ModelRegistry`)."""

    def get_model_tags(self, model_name: str) -> dict[str, str]: ...


@contextlib.contextmanager
def hold_lock(
    registry: LockingRegistry,
    model_name: str,
    *,
    purpose: str,
    ttl_s: float = 900.0,
    wait_s: float = 900.0,
    poll_s: float = 0.5,
) -> Iterator[str]:
    """Holds the lock of `model_name` while the block runs; see `ModelRegistry.lock`.

    Waiting polls every `poll_s` through the registry's injected `_sleep`: it
    is a wait for another holder, not a retry of a failed call, so it neither
    backs off nor counts attempts.

    Yields:
        The owner id written to the lock.

    Raises:
        RegistryUnavailable: The lock was still held by someone else after `wait_s`
            (retryable), or the registry could not be reached.
    """
    check_model_name(model_name)
    lock_name = f"{model_name}{LOCK_MODEL_SUFFIX}"
    owner = f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident()}:{uuid.uuid4().hex[:8]}"
    deadline = time.monotonic() + wait_s
    while not try_lock(registry, lock_name, owner, purpose, ttl_s):
        holder = registry.get_model_tags(lock_name)
        if holder.get(LOCK_OWNER_TAG) == owner:
            break  # our create went through but its answer was lost; the retry saw it exists
        expires = _float_or_none(holder.get(LOCK_EXPIRES_TAG))
        if holder and (expires is None or expires < time.time()):
            logger.warning("removing expired lock %s held by %s", lock_name, holder.get(LOCK_OWNER_TAG))
            unlock(registry, lock_name, holder.get(LOCK_OWNER_TAG))
            continue
        if time.monotonic() >= deadline:
            raise RegistryUnavailable(
                f"{model_name!r} is locked by {holder.get(LOCK_OWNER_TAG, '?')} for "
                f"{holder.get(LOCK_PURPOSE_TAG, '?')!r}; waited {wait_s:.0f}s (the lock expires at "
                f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(expires or 0))})"
            )
        registry._sleep(poll_s)
    try:
        yield owner
    finally:
        try:
            unlock(registry, lock_name, owner)
        except RegistryError as e:
            # The work under the lock is done (or has its own error); an unreleased
            # lock only delays the next holder until it expires.
            logger.warning("could not release lock %s (it expires after %.0fs): %s", lock_name, ttl_s, e)


@retried
def try_lock(registry: RegistryConnection, lock_name: str, owner: str, purpose: str, ttl_s: float) -> bool:
    """Creates the lock entry for `owner`; False when it already exists (someone holds it)."""
    tags = {LOCK_OWNER_TAG: owner, LOCK_PURPOSE_TAG: purpose, LOCK_EXPIRES_TAG: repr(time.time() + ttl_s)}
    created = False
    with translate_errors(f"acquire lock {lock_name!r}", ignore={ALREADY_EXISTS}):
        client(registry.tracking_uri).create_registered_model(
            lock_name, tags=tags,
            description="Transient lock held while trainyard moves this model's aliases; deleted on release.",
        )
        created = True
    return created


@retried
def unlock(registry: RegistryConnection, lock_name: str, owner: Optional[str]) -> None:
    """Deletes the lock if `owner` still holds it (a lock taken over after expiry is left alone)."""
    mlflow_client = client(registry.tracking_uri)
    with translate_errors(f"release lock {lock_name!r}", ignore={MISSING}):
        holder = dict(mlflow_client.get_registered_model(lock_name).tags or {})
        if holder.get(LOCK_OWNER_TAG) == owner:
            mlflow_client.delete_registered_model(lock_name)


def _float_or_none(value: Optional[str]) -> Optional[float]:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None
