"""Asynchronous checkpoints: training waits at most for a copy to host memory, one thread writes.

`AsyncCheckpointWriter` snapshots the state to CPU (`snapshot_to_cpu`, reusing
the previous snapshot's buffers) and hands it to `CheckpointStore.save` in a
background thread; `young_daly_interval` turns the measured save time into how
often to checkpoint.

Deferred copies: tensors that only the optimizer step changes (parameters and
optimizer state, named by `deferrable_storages`) need not be copied while
training waits. `submit(..., defer=keys)` copies everything else at once and
leaves those to the writer thread, which copies them while the next forward and
backward run; `fence()`, called before the next optimizer step, waits for that
copy. Each deferred tensor's version counter is read at `submit` and again at
the fence: a tensor changed in between (by code that updates weights outside the
optimizer step) means the copy may mix two states, so that checkpoint is
dropped with a warning, and later saves copy everything at once.
"""

from __future__ import annotations

import copy
import math
import threading
import time
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, Optional

import torch

from training.checkpointing.errors import check, is_int
from training.checkpointing.store import CheckpointStore


class HostBuffers:
    """CPU tensors of the previous snapshot, reused when the next one has the same layout.

    Copying into warm buffers avoids allocating (and page-faulting) the whole
    checkpoint's worth of host memory on every save. Safe because the writer
    keeps at most one write in flight and snapshots only after it finished.
    """

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self._next = 0

    def start(self) -> None:
        self._next = 0

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        src = t.detach()
        i, buf = self._previous(src, strides=False)
        if buf is not None and buf.layout == src.layout and src.layout == torch.strided:
            return buf.copy_(src)
        out = src.to("cpu", copy=True)
        self._keep(i, out)
        return out

    def reserve(self, t: torch.Tensor) -> torch.Tensor:
        """Host memory shaped like `t` (the previous snapshot's where the layout matches), not yet filled."""
        src = t.detach()
        i, buf = self._previous(src, strides=True)
        if buf is not None:
            return buf
        out = torch.empty_strided(src.shape, src.stride(), dtype=src.dtype, device="cpu")
        self._keep(i, out)
        return out

    def _previous(self, src: torch.Tensor, strides: bool) -> tuple[int, Optional[torch.Tensor]]:
        """This tensor's slot, and the previous snapshot's buffer there when its shape and dtype (and strides) match."""
        i = self._next
        self._next += 1
        buf = self.tensors[i] if i < len(self.tensors) else None
        if (
            buf is None
            or buf.shape != src.shape
            or buf.dtype != src.dtype
            or (strides and buf.stride() != src.stride())
        ):
            return i, None
        return i, buf

    def _keep(self, i: int, out: torch.Tensor) -> None:
        if i < len(self.tensors):
            self.tensors[i] = out
        else:
            self.tensors.append(out)


def storage_key(t: torch.Tensor) -> Optional[int]:
    """The address of the memory `t` lives in (a DTensor's local shard's), or None when it has none to name."""
    local = getattr(t, "_local_tensor", None)  # DTensor: its shard on this rank
    base = local if isinstance(local, torch.Tensor) else t
    try:
        return int(base.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # sparse, meta, fake tensors
        return None


def deferrable_storages(modules: Iterable[torch.nn.Module], optimizers: Iterable[Any]) -> frozenset[int]:
    """Storage keys of what only an optimizer step changes: the modules' parameters and the optimizers' state tensors.

    Buffers are not among them (BatchNorm's running statistics change in every
    forward), so a snapshot copies them at once.
    """
    keys: set[Optional[int]] = set()  # None (no storage) and 0 (empty) name nothing
    for module in modules:
        keys.update(storage_key(p) for p in module.parameters())
    for opt in optimizers:
        inner = getattr(opt, "optimizer", opt)  # Lightning's LightningOptimizer wraps the torch one
        for per_param in getattr(inner, "state", {}).values():
            if isinstance(per_param, dict):
                keys.update(storage_key(v) for v in per_param.values() if isinstance(v, torch.Tensor))
    return frozenset(k for k in keys if k)


class _Deferred:
    """The copies of one snapshot left to the writer thread, and what the fence found."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.copies: list[tuple[torch.Tensor, torch.Tensor, int, str]] = []  # source, host buffer, version, where
        self.copied = threading.Event()
        self.released = threading.Event()
        self.torn: list[str] = []
        self.error: Optional[BaseException] = None

    def copy_all(self) -> None:
        try:
            for src, dst, _, _ in self.copies:
                dst.copy_(src)
        except BaseException as e:  # reported by the write, which then fails
            self.error = e
        finally:
            self.copied.set()

    def check_versions(self) -> None:
        self.torn = [where for src, _, version, where in self.copies if src._version != version]


_WRITERS: "weakref.WeakSet[AsyncCheckpointWriter]" = weakref.WeakSet()


def _release_at_exit() -> None:
    """At the interpreter's exit, let every writer thread still waiting for a fence go on.

    The program ended without fencing (or closing): nothing changes its tensors
    any more, so a copy whose tensors did not change before stands, and is
    written as an undeferred save would have been. Runs before
    `concurrent.futures` joins its threads (threading's exit hooks run in
    reverse order of registration, and this one registers after it).
    """
    for writer in list(_WRITERS):
        deferred = writer._deferred
        if deferred is not None:
            deferred.copied.wait()
            deferred.check_versions()
            deferred.released.set()


threading._register_atexit(_release_at_exit)  # type: ignore[attr-defined]  # how concurrent.futures joins its threads


def snapshot_to_cpu(
    obj: Any, _memo: Optional[dict[int, Any]] = None, buffers: Optional[HostBuffers] = None,
    defer: Optional[Callable[[torch.Tensor], bool]] = None, _deferred: Optional[_Deferred] = None, _where: str = "",
) -> Any:
    """A deep copy of `obj` whose tensors are detached copies in CPU memory.

    Dicts (keeping their type), lists, tuples and namedtuples are copied
    recursively; an object reachable twice is copied once, so tied weights stay
    tied. Anything else is `copy.deepcopy`'d. With `buffers`, tensors are copied
    into the previous snapshot's host memory where the layout matches. With
    `defer` (and `buffers`), a strided tensor it accepts gets its host memory
    now and its copy later (`_Deferred`, the writer's).
    """
    memo: dict[int, Any] = {} if _memo is None else _memo
    key = id(obj)
    if key in memo:
        return memo[key]
    out: Any
    if isinstance(obj, torch.Tensor):
        if (buffers is not None and _deferred is not None and defer is not None
                and type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.layout == torch.strided and defer(obj)):
            out = buffers.reserve(obj)
            _deferred.copies.append((obj.detach(), out, obj._version, _where or "<root>"))
        else:
            # One copy whether the tensor is on CPU (where .cpu() would alias) or a device.
            out = buffers.copy(obj) if buffers is not None else obj.detach().to("cpu", copy=True)
    elif isinstance(obj, dict):
        out = copy.copy(obj)
        out.clear()
        for k, v in obj.items():
            where = (
                (f"{_where}.{k}" if _where else str(k)) if _deferred is not None else ""
            )  # named only for a tear warning
            out[k] = snapshot_to_cpu(v, memo, buffers, defer, _deferred, where)
    elif isinstance(obj, (list, tuple)):
        items = [snapshot_to_cpu(v, memo, buffers, defer, _deferred, f"{_where}[{i}]" if _deferred is not None else "")
                 for i, v in enumerate(obj)]
        if isinstance(obj, list):
            out = items
        else:
            out = type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    else:
        out = copy.deepcopy(obj)
    memo[key] = out
    return out


class AsyncCheckpointWriter:
    """Saves checkpoints in one background thread so training waits only for a CPU copy, or less.

    `submit` copies the state to CPU memory, then hands it to the writer thread.
    At most one write is in flight: a second `submit` first waits for the
    previous write. A checkpoint counts once its write has committed (the store
    writes the manifest last, so `latest()` never returns an in-flight one).

    With `submit(..., defer=keys)` the tensors in `keys` (`deferrable_storages`:
    parameters and optimizer state) are copied by the writer thread instead, and
    the caller must call `fence()` before anything changes them (the next
    optimizer step); `wait`, `close` and the next `submit` fence first.

    Attributes:
        blocking_seconds: Total time the caller was held (in `submit`, and in
            `fence` waiting for a deferred copy).
        save_seconds: Duration of each completed write, in order; the measured
            save time for `young_daly_interval`.
        last_uri: URI of the newest committed checkpoint written here.
        deferred_saves: How many submits left copies to the writer thread.
        dropped: Steps whose deferred copy was found torn at the fence (not written).

    Example:
        >>> with AsyncCheckpointWriter(store) as writer:  # doctest: +SKIP
        ...     for step in steps:
        ...         if step % every == 0:
        ...             writer.submit(step, state(), defer=deferrable_storages([model], [opt]))
        ...         loss = model(batch).sum(); loss.backward()
        ...         writer.fence()
        ...         opt.step()
    """

    def __init__(self, store: CheckpointStore) -> None:
        self.store = store
        self.blocking_seconds = 0.0
        self.save_seconds: list[float] = []
        self.last_uri: Optional[str] = None
        self.deferred_saves = 0
        self.dropped: list[int] = []
        self.defer_allowed = True
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._buffers = HostBuffers()
        self._pending: Optional[Future[Optional[str]]] = None
        self._deferred: Optional[_Deferred] = None
        self._lock = threading.Lock()
        self._closed = False
        _WRITERS.add(self)

    @property
    def in_flight(self) -> bool:
        """Whether a write has been submitted and not finished."""
        return self._pending is not None and not self._pending.done()

    def submit(
        self, step: int, state: dict[str, Any], *, defer: Optional[frozenset[int]] = None, **kwargs: Any
    ) -> None:
        """Copy `state` to CPU (`defer`'s storages later) and save it in the background as `store.save(step, state,
        **kwargs)`.

        Raises:
            CheckpointWriteError: The previous write failed; raised here so a
                failure is never silent (and then cleared). The new state was not submitted.
            RuntimeError: The writer is closed.
        """
        started = time.perf_counter()
        try:
            with self._lock:
                if self._closed:
                    raise RuntimeError("AsyncCheckpointWriter is closed; create a new one to write more checkpoints")
                self._fence()
                self._await_pending()
                self._buffers.start()
                deferred = _Deferred(step) if defer and self.defer_allowed else None
                snapshot = snapshot_to_cpu(
                    state,
                    buffers=self._buffers,
                    defer=(lambda t: storage_key(t) in defer) if defer else None,
                    _deferred=deferred,
                )
                if deferred is not None and not deferred.copies:
                    deferred = None
                self.deferred_saves += deferred is not None
                self._deferred = deferred
                self._pending = self._executor.submit(self._write, step, snapshot, kwargs, deferred)
        finally:
            self.blocking_seconds += time.perf_counter() - started

    def fence(self) -> None:
        """Wait until the deferred copies of the last `submit` are taken; call before the state it deferred changes.

        Cheap when nothing is deferred (a DDP rank that does not save, a step
        with no save in flight). A tensor changed since `submit` drops that
        checkpoint with a `RuntimeWarning` and turns deferring off.
        """
        if self._deferred is None:
            return
        started = time.perf_counter()
        try:
            with self._lock:
                self._fence()
        finally:
            self.blocking_seconds += time.perf_counter() - started

    def _fence(self) -> None:
        deferred, self._deferred = self._deferred, None
        if deferred is None:
            return
        deferred.copied.wait()
        deferred.check_versions()
        if deferred.torn:
            self.defer_allowed = False
            self.dropped.append(deferred.step)
            shown = ", ".join(deferred.torn[:5]) + (
                f" and {len(deferred.torn) - 5} more" if len(deferred.torn) > 5 else ""
            )
            warnings.warn(
                f"checkpoint of step {deferred.step} dropped: {shown} changed between the save and the next "
                "optimizer step (outside the optimizer's step), so its copy could mix two steps; later checkpoints "
                "copy the whole state before training goes on", RuntimeWarning, stacklevel=3,
            )
        deferred.released.set()

    def _write(
        self, step: int, state: dict[str, Any], kwargs: dict[str, Any], deferred: Optional[_Deferred]
    ) -> Optional[str]:
        if deferred is not None:
            deferred.copy_all()
            deferred.released.wait()  # set by the fence, or at the interpreter's exit (_release_at_exit)
            if deferred.error is not None:
                raise deferred.error
            if deferred.torn:
                return None
        started = time.perf_counter()
        uri = self.store.save(step, state, **kwargs)
        self.save_seconds.append(time.perf_counter() - started)
        self.last_uri = uri
        return uri

    def _await_pending(self, timeout: Optional[float] = None) -> Optional[str]:
        pending, self._pending = self._pending, None
        return pending.result(timeout) if pending is not None else None

    def wait(self, timeout: Optional[float] = None) -> Optional[str]:
        """Block until the last submitted write finishes; re-raise its error.

        Args:
            timeout: Give up after this many seconds (None: wait as long as it takes).

        Returns:
            The URI it committed, or None when nothing was pending or its
            checkpoint was dropped at the fence.

        Raises:
            TimeoutError: the write did not finish within `timeout`; it goes on in
                the background, and this writer no longer waits for it.
        """
        with self._lock:
            self._fence()
            return self._await_pending(timeout)

    def close(self) -> None:
        """Wait for the last write (re-raising its error) and stop the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._fence()
                self._await_pending()
            finally:
                self._executor.shutdown(wait=True)

    def __enter__(self) -> "AsyncCheckpointWriter":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close()


def young_daly_interval(save_seconds: float, node_mtbf_hours: float, nodes: int) -> float:
    """The Young/Daly checkpoint interval in seconds: `sqrt(2 * save_seconds * job_mtbf)`.

    The job fails when any node fails, so `job_mtbf = node_mtbf / nodes`.

    Example:
        >>> round(young_daly_interval(60.0, 1000.0, 100))  # job MTBF 10 h
        2078
    """
    for field, value in (("save_seconds", save_seconds), ("node_mtbf_hours", node_mtbf_hours)):
        check(
            isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0,
            field, value, "a finite number > 0",
        )
    check(is_int(nodes) and nodes >= 1, "nodes", nodes, "an integer >= 1")
    job_mtbf_seconds = node_mtbf_hours * 3600.0 / nodes
    return math.sqrt(2.0 * save_seconds * job_mtbf_seconds)
