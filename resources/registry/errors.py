"""The registry's error hierarchy and the one translation of MLflow errors into it.

Every call into MLflow runs inside `translate_errors`, which maps transport
failures, timeouts, 5xx/429 answers and locked databases to
`RegistryUnavailable` (retryable), MLflow's "does not exist" to
`RegistryNotFound`, "already exists" to `RegistryConflict`, and anything else to
`RegistryError`, always chained to the original and with credentials redacted.

Example:
    >>> with translate_errors("get version 3 of 'vision-digits'"):
    ...     client.get_model_version("vision-digits", "3")
"""

from __future__ import annotations

import contextlib
from typing import AbstractSet, Iterator, Optional

from resources.registry.smoke import exception_chain
from trainyard.redact import redact_url

MISSING = "RESOURCE_DOES_NOT_EXIST"
"""MLflow's error code for a model, version or experiment that does not exist."""
ALREADY_EXISTS = "RESOURCE_ALREADY_EXISTS"
"""MLflow's error code for creating something that exists."""



class RegistryError(Exception):
    """A registry operation failed and retrying will not help (terminal)."""


class RegistryUnavailable(RegistryError):
    """The registry could not be reached or answered 5xx; retrying may succeed."""


class RegistryConflict(RegistryError):
    """The registry's state contradicts the request (e.g. a deleted experiment, a race)."""


class RegistryNotFound(RegistryError):
    """The registered model or model version does not exist."""


def is_retryable(exc: BaseException) -> bool:
    """True for transport failures, timeouts, 5xx/429 answers and locked databases."""
    import requests
    from mlflow.exceptions import MlflowException, RestException
    from mlflow.protos.databricks_pb2 import (
        REQUEST_LIMIT_EXCEEDED,
        TEMPORARILY_UNAVAILABLE,
        ErrorCode,
    )

    retryable_codes = {
        ErrorCode.Name(TEMPORARILY_UNAVAILABLE),
        ErrorCode.Name(REQUEST_LIMIT_EXCEEDED),
    }
    transport: tuple[type[BaseException], ...] = (
        requests.exceptions.ConnectionError,
        requests.exceptions.Timeout,
        requests.exceptions.RetryError,  # MLflow's own HTTP retries on 429/5xx ran out
        ConnectionError,
        TimeoutError,
    )
    try:
        import sqlalchemy.exc
    except ImportError:  # mlflow-skinny: no SQL backends, so no SQL errors either
        pass
    else:
        transport += (sqlalchemy.exc.OperationalError, sqlalchemy.exc.DisconnectionError)
    for e in exception_chain(exc):
        if isinstance(e, transport):
            return True
        if isinstance(e, MlflowException):
            if e.error_code in retryable_codes:
                return True
            # A JSON error body from the server with a 5xx status.
            if isinstance(e, RestException) and e.get_http_status_code() >= 500:
                return True
    return False


def error_code(exc: BaseException) -> Optional[str]:
    """MLflow's error code of `exc` (e.g. `RESOURCE_DOES_NOT_EXIST`), None for other errors."""
    from mlflow.exceptions import MlflowException

    return exc.error_code if isinstance(exc, MlflowException) else None


def translate(exc: BaseException, action: str) -> RegistryError:
    """Maps an exception raised while talking to MLflow onto the registry hierarchy.

    Args:
        exc: What MLflow, requests or SQLAlchemy raised.
        action: What was being done, in words; it starts the message.

    Returns:
        The registry error to raise (the caller chains it to `exc`).
    """
    message = redact_url(f"{action}: {type(exc).__name__}: {exc}")
    if is_retryable(exc):
        return RegistryUnavailable(message)
    code = error_code(exc)
    if code == MISSING:
        return RegistryNotFound(message)
    if code == ALREADY_EXISTS:
        return RegistryConflict(message)
    return RegistryError(message)


@contextlib.contextmanager
def translate_errors(action: str, *, ignore: AbstractSet[str] = frozenset()) -> Iterator[None]:
    """Raises any error of the block as the registry error `translate` maps it to.

    Registry errors raised inside the block pass through unchanged, so blocks
    nest. An error whose MLflow code is in `ignore` is swallowed and the block
    simply ends there: callers set a result before the call that may fail
    and check it after the block.

    Args:
        action: What the block does, in words (e.g. "set alias 'champion' of 'm'").
        ignore: MLflow error codes that are an expected answer rather than a
            failure (`MISSING` for a lookup, `ALREADY_EXISTS` for a create).

    Raises:
        RegistryError: Or its subclasses, chained to the original error.

    Example:
        >>> registered = None
        >>> with translate_errors("get alias of 'm'", ignore={MISSING}):
        ...     registered = client.get_registered_model("m")
        >>> registered is None  # the model does not exist
        True
    """
    try:
        yield
    except RegistryError:
        raise
    except Exception as e:
        if ignore and error_code(e) in ignore:
            return
        raise translate(e, action) from e
