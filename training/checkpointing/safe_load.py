"""Checkpoint files are data: read with torch's weights-only unpickler, never by running pickled code.

Every checkpoint the platform reads (resume, the best weights after training,
`trainyard reproduce`'s weight comparison, distributed-checkpoint metadata) goes
through `load_payload` or `unpickle_plain`. They accept tensors, containers
(dict, OrderedDict, list, tuple, set), numbers, strings, bytes, None and torch's
own dtypes, devices and sizes, plus `SAFE_GLOBALS`; anything else in the file
(a class, a function, `os.system` behind a `__reduce__`) makes them raise
`UnsafeCheckpointError` naming the file, before any of it runs.

Lightning's checkpoint dict is plain data of that kind (weights, optimizer and
scheduler states, loop progress, callback states, hyperparameters given as JSON
values), and so is everything trainyard adds (`rng_state`, the sampler position,
DTensor markers). `plain_data_problem` checks a state before it is saved, so a
state that could not be resumed safely fails at its first save, with the key
that holds the offending object, instead of at a resume hours later.
"""

from __future__ import annotations

import collections
import io
import pickle
import re
from typing import IO, Any, Iterable, Optional

import torch

from training.checkpointing.errors import CheckpointError
from training.errors import ConfigError

SAFE_GLOBALS: tuple[Any, ...] = ()
"""Types allowed beyond torch's weights-only defaults. None is needed: every state trainyard
and Lightning write is made of the default types (see the module docstring)."""

_LEAF_TYPES: tuple[type, ...] = (
    str, bytes, bytearray, int, float, bool, complex, type(None),
    torch.dtype, torch.device, torch.layout, torch.Size,
)
_CONTAINERS: tuple[type, ...] = (dict, collections.OrderedDict, collections.Counter, list, tuple, set)
_DETAIL = re.compile(r"^.*[Uu]nsupported.*$", re.MULTILINE)


class UnsafeCheckpointError(CheckpointError, ConfigError):
    """A checkpoint file holds pickled code or types outside the allow-list; it was refused, nothing in it ran.

    A `ConfigError` too, so a trial that meets one fails at once (`EXIT_BAD_CONFIG`)
    instead of being retried against the same file.

    Attributes:
        source: The file that was refused.
        detail: What in it was refused, as torch's unpickler reported it.
    """

    def __init__(self, source: str, detail: str) -> None:
        super().__init__(
            f"checkpoint file {source} contains pickled code or types outside the allow-list ({detail}); refused "
            "without running any of it. trainyard writes only tensors, containers, numbers and strings: this file "
            "was written by something else or has been tampered with"
        )
        self.source = source
        self.detail = detail

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (type(self), (self.source, self.detail))


class CheckpointStateError(ConfigError, TypeError):
    """A state to be saved holds an object that a resume could not load without unpickling code."""


def _detail(error: BaseException) -> str:
    found = _DETAIL.search(str(error))
    return (
        found.group(0).strip()
        if found
        else f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    )


def load_payload(data: bytes, source: str) -> Any:
    """`torch.load` of `data` (a checkpoint file's bytes) on the CPU, weights only.

    Args:
        data: The file's bytes (already verified against its manifest).
        source: The file's URI, for the error.

    Raises:
        UnsafeCheckpointError: the file references a global outside the allow-list.
    """
    try:
        with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(source, _detail(e)) from None


class _PlainUnpickler(pickle.Unpickler):
    """`pickle.Unpickler` that resolves only allow-listed globals (the "restricting globals" recipe of the pickle docs).

    Every way a pickle reaches code (GLOBAL, STACK_GLOBAL, INST, OBJ, EXT*) goes
    through `find_class`; persistent ids (torch storages) are refused by default.
    """

    def __init__(self, f: IO[bytes], allowed: dict[str, Any]) -> None:
        super().__init__(f)
        self.allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        found = self.allowed.get(f"{module}.{name}")
        if found is None:
            raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name} is not on the allow-list")
        return found


def _plain_globals(extra: Iterable[Any]) -> dict[str, Any]:
    types = [collections.OrderedDict, set, frozenset, complex, bytearray, torch.Size, *SAFE_GLOBALS, *extra]
    allowed = {f"{t.__module__}.{t.__qualname__}": t for t in types}
    allowed["torch.serialization._get_layout"] = torch.serialization._get_layout
    allowed.update({f"torch.{n}": v for n, v in vars(torch).items() if isinstance(v, torch.dtype)})
    return allowed


def unpickle_plain(f: IO[bytes], source: str, allowed: Iterable[Any] = ()) -> Any:
    """A raw pickle (not a `torch.save` archive) holding only plain data and the `allowed` classes.

    For files other libraries write with `pickle.dump`, such as a distributed
    checkpoint's `.metadata` (its dataclasses of shapes, dtypes and offsets).
    Torch's weights-only unpickler cannot read pickle protocol 4 and later, so
    this is Python's unpickler with every global checked against the allow-list.

    Args:
        f: The open file.
        source: Its path or URI, for the error.
        allowed: Classes the file may hold besides builtin containers, numbers,
            strings and torch sizes and dtypes.

    Raises:
        UnsafeCheckpointError: the file references a global outside the allow-list.
    """
    try:
        return _PlainUnpickler(f, _plain_globals(allowed)).load()
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(source, _detail(e)) from None


def plain_data_problem(obj: Any, where: str = "state") -> Optional[str]:
    """Where in `obj` (a state about to be saved) the first object a weights-only load refuses sits, or None.

    Exact types are checked: a subclass (a named tuple, a DTensor, a NumPy
    scalar) pickles by its class, which the loader refuses.
    """
    t = type(obj)
    if isinstance(obj, torch.Tensor):
        return (
            None
            if t in (torch.Tensor, torch.nn.Parameter)
            else f"{where} is a {t.__module__}.{t.__qualname__} (a tensor subclass)"
        )
    if t in _LEAF_TYPES or t in SAFE_GLOBALS:
        return None
    if t in _CONTAINERS:
        if isinstance(obj, dict):
            for k, v in obj.items():
                problem = plain_data_problem(k, f"{where} key {k!r}") or plain_data_problem(v, f"{where}[{k!r}]")
                if problem:
                    return problem
            return None
        for i, v in enumerate(obj):
            problem = plain_data_problem(v, f"{where}[{i}]")
            if problem:
                return problem
        return None
    return f"{where} is a {t.__module__}.{t.__qualname__}"


def check_plain(state: Any, uri: str) -> None:
    """Raise `CheckpointStateError` unless `state` is plain data a resume can load without unpickling code."""
    problem = plain_data_problem(state)
    if problem:
        raise CheckpointStateError(
            f"cannot save checkpoint {uri}: {problem}, which a resume could not load (torch.load(weights_only=True) "
            "refuses pickled objects other than tensors, containers, numbers and strings); keep checkpoint state "
            "plain, "
            "e.g. pass JSON values to save_hyperparameters and store objects as their state_dict()"
        )
