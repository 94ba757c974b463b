"""How the registry reaches MLflow: one cached client per URI, the fluent-URI lock, retries, name rules.

`import mlflow` is deferred to the first call (`mlflow_module`), so importing
the registry package stays cheap.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import re
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol, TypeVar

from common.retry import RetriesExhausted, retry_call
from resources.registry.errors import RegistryUnavailable
from trainyard.redact import redact_url

if TYPE_CHECKING:
    from mlflow import MlflowClient

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

# Same rule as MLflow's own (no '/' or ':'), plus characters that would need
# escaping in search filters and `models:/` URIs.
_MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,255}$")
# Trial keys are embedded in a quoted MLflow search filter.
_TRIAL_KEY_RE = re.compile(r"^[A-Za-z0-9._:/@=+-]{1,250}$")
URI_SCHEME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
"""Matches a location that is a URI (`s3://...`, `http://...`) rather than a local path."""

# MLflow's fluent APIs read process-wide tracking/registry URIs; serialise the
# code that borrows them so two threads never see each other's URI.
_FLUENT_LOCK = threading.RLock()

_RETRY_STATE = threading.local()


class RegistryConnection(Protocol):
    """What `retried` needs of the object whose method it wraps (`ModelRegistry`, a frozen resource: read-only
    members)."""

    @property
    def tracking_uri(self) -> str: ...
    @property
    def retry_attempts(self) -> int: ...
    @property
    def retry_backoff_s(self) -> float: ...
    @property
    def _sleep(self) -> Callable[[float], None]: ...


def retried(method: Callable[..., _T]) -> Callable[..., _T]:
    """Retries a registry method on `RegistryUnavailable`, with exponential backoff.

    `retry_attempts` tries, waiting `retry_backoff_s`, then twice that, and so
    on, through the registry's injected `_sleep`; then `RegistryUnavailable`
    naming the (redacted) registry and the number of attempts. Nested calls
    (e.g. `register` -> `find_version`) retry only at the outermost level, so
    attempts do not multiply.
    """

    @functools.wraps(method)
    def wrapper(self: RegistryConnection, *args: Any, **kwargs: Any) -> _T:
        if getattr(_RETRY_STATE, "active", False):
            return method(self, *args, **kwargs)
        _RETRY_STATE.active = True
        where = redact_url(self.tracking_uri)

        def log_retry(attempt: int, error: BaseException, wait: float) -> None:
            logger.warning(
                "registry %s unavailable during %s (attempt %d of %d), retrying in %.1fs: %s",
                where, method.__name__, attempt, self.retry_attempts, wait, error,
            )

        try:
            return retry_call(
                functools.partial(method, self, *args, **kwargs),
                retry_on=RegistryUnavailable,
                attempts=self.retry_attempts,
                backoff_s=self.retry_backoff_s,
                max_backoff_s=math.inf,
                sleep=self._sleep,
                on_retry=log_retry,
                describe=f"registry {where}: {method.__name__}",
            )
        except RetriesExhausted as e:
            raise RegistryUnavailable(
                f"registry {where} unavailable; gave up after {e.attempts} attempt(s): {e.last}"
            ) from e.last
        finally:
            _RETRY_STATE.active = False

    return wrapper


@functools.cache
def mlflow_module() -> Any:
    """`mlflow`, with `mlflow.pyfunc` loaded, imported on first use."""
    import mlflow
    import mlflow.pyfunc

    return mlflow


@functools.lru_cache(maxsize=16)
def client(tracking_uri: str) -> "MlflowClient":
    """The `MlflowClient` of `tracking_uri` (also its registry URI), one per URI in this process."""
    # Building a client opens the backend store (for SQLite: schema checks); reuse it.
    return mlflow_module().MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)


@contextlib.contextmanager
def fluent_uris(tracking_uri: str) -> Iterator[None]:
    """Points MLflow's process-global tracking/registry URIs at `tracking_uri`, then restores.

    `mlflow.pyfunc.log_model`, `mlflow.start_run`/`end_run` and loading `models:/`
    URIs take no URI argument; this is the one place trainyard lets them see ours.
    """
    mlflow = mlflow_module()
    with _FLUENT_LOCK:
        saved_env = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
        mlflow.set_tracking_uri(tracking_uri)
        mlflow.set_registry_uri(tracking_uri)
        try:
            yield
        finally:
            # MLflow mirrors the globals into these env vars; clearing the globals and
            # restoring the env leaves resolution exactly as the caller had it.
            mlflow.set_tracking_uri(None)
            mlflow.set_registry_uri(None)
            for key, value in saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def check_model_name(model_name: str) -> None:
    """Raises ValueError, naming the value and the rule, for a name MLflow or a filter would mangle."""
    if not isinstance(model_name, str) or not _MODEL_NAME_RE.match(model_name):
        raise ValueError(
            f"model_name={model_name!r} is not a valid registered model name: use 1-256 "
            "letters, digits, '.', '_' or '-', starting with a letter or digit "
            "(no '/' or ':', which MLflow reserves for URIs)"
        )


def check_trial_key(trial_key: str) -> None:
    """Raises ValueError, naming the value and the rule, for a key unsafe in a search filter."""
    if not isinstance(trial_key, str) or not _TRIAL_KEY_RE.match(trial_key):
        raise ValueError(
            f"trial_key={trial_key!r} is not valid: use 1-250 characters from "
            "letters, digits and '._:/@=+-'"
        )


def to_uri(location: str) -> str:
    """A local path becomes a `file://` URI; anything with a scheme is kept."""
    if URI_SCHEME_RE.match(location):
        return location.rstrip("/")
    return Path(location).resolve().as_uri()
