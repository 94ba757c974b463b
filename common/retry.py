"""The one retry utility: exponential backoff on the errors a caller names, with injected sleep and clock.

Every retrying caller on both sides of the boundary (registry, handoff webhook,
Kubernetes API calls, checkpoint writes) uses `retry_call`, so
backoff, give-up rules and logging are written once. Sleep and clock are
arguments: tests pass a recorder and a fake clock, never real time.

It lives in `common/` (stdlib, tenacity), the bottom package every layer may
import: the orchestrator's clients and the pod-side checkpoint store both retry.

Example:
    >>> calls = []
    >>> def flaky():
    ...     calls.append(1)
    ...     if len(calls) < 3:
    ...         raise ConnectionError("reset")
    ...     return "ok"
    >>> waits = []
    >>> retry_call(flaky, retry_on=ConnectionError, attempts=5, backoff_s=0.5, sleep=waits.append)
    'ok'
    >>> waits
    [0.5, 1.0]
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional, TypeVar, Union

import tenacity

_T = TypeVar("_T")
ErrorTypes = Union[type[BaseException], tuple[type[BaseException], ...]]

logger = logging.getLogger(__name__)


class RetriesExhausted(Exception):
    """A call kept failing with a retryable error; `last` is the final error."""

    def __init__(self, message: str, last: BaseException, attempts: int):
        super().__init__(message)
        self.last = last
        self.attempts = attempts


def _validate(attempts: Optional[int], backoff_s: float, max_backoff_s: float, deadline_s: Optional[float]) -> None:
    if attempts is not None and (not isinstance(attempts, int) or isinstance(attempts, bool) or attempts < 1):
        raise ValueError(f"attempts={attempts!r} must be a whole number of at least 1 (1 means no retry)")
    if attempts is None and deadline_s is None:
        raise ValueError("attempts=None needs a deadline_s, or retrying would never stop")
    if backoff_s < 0 or max_backoff_s < backoff_s:
        raise ValueError(
            f"backoff_s={backoff_s!r}, max_backoff_s={max_backoff_s!r}: need 0 <= backoff_s <= max_backoff_s"
        )
    if deadline_s is not None and deadline_s < 0:
        raise ValueError(f"deadline_s={deadline_s!r} must be 0 or more seconds")


def retry_call(
    fn: Callable[..., _T],
    *args: Any,
    retry_on: ErrorTypes,
    attempts: Optional[int] = 3,
    backoff_s: float = 1.0,
    max_backoff_s: float = 60.0,
    deadline_s: Optional[float] = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    on_retry: Optional[Callable[[int, BaseException, float], None]] = None,
    describe: str = "",
    **kwargs: Any,
) -> _T:
    """Call `fn(*args, **kwargs)`, retrying on `retry_on` with doubling waits.

    Waits are `backoff_s`, `2·backoff_s`, ... capped at `max_backoff_s`. It gives
    up after `attempts` calls, or when the next wait would pass `deadline_s`
    seconds since the first call (by `clock`), whichever comes first. Errors not
    in `retry_on` propagate at once, unchanged.

    Args:
        fn: What to call.
        retry_on: The error type(s) worth retrying (transient ones).
        attempts: Most calls in all; None for "until the deadline".
        backoff_s: First wait.
        max_backoff_s: Longest wait.
        deadline_s: Stop retrying once this much time has passed.
        sleep: Waits the given seconds (tests pass a recorder).
        clock: Monotonic seconds (tests pass a fake clock).
        on_retry: Called as `(attempt, error, wait)` before each wait; by default a warning is logged.
        describe: What is being done, for the log and the final error.

    Raises:
        RetriesExhausted: The last attempt failed with a retryable error (chained to it).
    """
    _validate(attempts, backoff_s, max_backoff_s, deadline_s)
    start = clock()
    what = describe or getattr(fn, "__qualname__", repr(fn))

    def wait(state: tenacity.RetryCallState) -> float:
        return min(backoff_s * 2 ** (state.attempt_number - 1), max_backoff_s)

    def stop(state: tenacity.RetryCallState) -> bool:
        if attempts is not None and state.attempt_number >= attempts:
            return True
        return deadline_s is not None and clock() - start + wait(state) > deadline_s

    def before_sleep(state: tenacity.RetryCallState) -> None:
        assert state.outcome is not None and state.next_action is not None
        error = state.outcome.exception()
        assert error is not None
        if on_retry is not None:
            on_retry(state.attempt_number, error, state.next_action.sleep)
        else:
            logger.warning(
                "%s failed (attempt %d), retrying in %.1fs: %s",
                what,
                state.attempt_number,
                state.next_action.sleep,
                error,
            )

    retryer = tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(retry_on),
        stop=stop,
        wait=wait,
        sleep=sleep,
        before_sleep=before_sleep,
        reraise=False,
    )
    try:
        return retryer(fn, *args, **kwargs)
    except tenacity.RetryError as e:
        last = e.last_attempt.exception()
        assert last is not None
        n = e.last_attempt.attempt_number
        raise RetriesExhausted(
            f"{what}: gave up after {n} attempt(s): {type(last).__name__}: {last}", last, n
        ) from last
