"""The checkpoint store's errors, and the argument checks whose messages name field, value and rule."""

from __future__ import annotations

from typing import Any

from training.errors import ConfigError


class CheckpointError(Exception):
    """Base class of checkpoint store errors."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written after all attempts; earlier checkpoints are intact.

    Storage being unavailable is an infrastructure failure, so a run-level retry
    may succeed.

    Attributes:
        uri: The file that could not be written.
        attempts: How many times it was tried.
    """

    def __init__(self, uri: str, attempts: int, cause: BaseException) -> None:
        super().__init__(
            f"could not write checkpoint file {uri} after {attempts} attempts: {type(cause).__name__}: {cause}"
        )
        self.uri = uri
        self.attempts = attempts


class SkippedCheckpointWarning(UserWarning):
    """A partial or corrupt checkpoint was passed over in favour of an older one."""


class CheckpointUnusable(CheckpointError):
    """A checkpoint directory cannot be loaded (partial, corrupt, unreadable manifest); the message says why."""


class CheckpointLayoutError(ConfigError):
    """A sharded checkpoint does not fit the model resuming it (other global shapes, missing or unsharded tensors).

    A configuration problem (the model changed), not a storage one: the
    checkpoints are intact, and retrying cannot help. Another world size or
    mesh alone is resharded, not refused.
    """


def check(ok: bool, field: str, value: Any, rule: str) -> None:
    """Raise `ValueError` naming `field`, its `value` and the `rule` it breaks unless `ok`."""
    if not ok:
        raise ValueError(f"{field}={value!r} is invalid; it must be {rule}")


def is_int(v: Any) -> bool:
    """Whether `v` is an int and not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)
