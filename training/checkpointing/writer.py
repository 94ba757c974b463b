"""Asynchronous checkpoints: training waits only for a copy to host memory, one thread writes.

`AsyncCheckpointWriter` snapshots the state to CPU (`snapshot_to_cpu`, reusing
the previous snapshot's buffers) and hands it to `CheckpointStore.save` in a
background thread; `young_daly_interval` turns the measured save time into how
often to checkpoint.
"""

from __future__ import annotations

import copy
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

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
        i = self._next
        self._next += 1
        if i < len(self.tensors):
            buf = self.tensors[i]
            if buf.shape == src.shape and buf.dtype == src.dtype and buf.layout == src.layout and src.layout == torch.strided:
                return buf.copy_(src)
        out = src.to("cpu", copy=True)
        if i < len(self.tensors):
            self.tensors[i] = out
        else:
            self.tensors.append(out)
        return out


def snapshot_to_cpu(obj: Any, _memo: Optional[dict[int, Any]] = None, buffers: Optional[HostBuffers] = None) -> Any:
    """A deep copy of `obj` whose tensors are detached copies in CPU memory.

    Dicts (keeping their type), lists, tuples and namedtuples are copied
    recursively; an object reachable twice is copied once, so tied weights stay
    tied. Anything else is `copy.deepcopy`'d. With `buffers`, tensors are copied
    into the previous snapshot's host memory where the layout matches.
    """
    memo: dict[int, Any] = {} if _memo is None else _memo
    key = id(obj)
    if key in memo:
        return memo[key]
    out: Any
    if isinstance(obj, torch.Tensor):
        # One copy whether the tensor is on CPU (where .cpu() would alias) or a device.
        out = buffers.copy(obj) if buffers is not None else obj.detach().to("cpu", copy=True)
    elif isinstance(obj, dict):
        out = copy.copy(obj)
        out.clear()
        for k, v in obj.items():
            out[k] = snapshot_to_cpu(v, memo, buffers)
    elif isinstance(obj, list):
        out = [snapshot_to_cpu(v, memo, buffers) for v in obj]
    elif isinstance(obj, tuple):
        items = [snapshot_to_cpu(v, memo, buffers) for v in obj]
        out = type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    else:
        out = copy.deepcopy(obj)
    memo[key] = out
    return out


class AsyncCheckpointWriter:
    """Saves checkpoints in one background thread so training waits only for a CPU copy.

    `submit` copies the state to CPU memory, then hands it to the writer thread.
    At most one write is in flight: a second `submit` first waits for the
    previous write. A checkpoint counts once its write has committed (the store
    writes the manifest last, so `latest()` never returns an in-flight one).

    Attributes:
        blocking_seconds: Total time `submit` held the caller (waiting + copying).
        save_seconds: Duration of each completed write, in order; the measured
            save time for `young_daly_interval`.
        last_uri: URI of the newest committed checkpoint written here.

    Example:
        >>> with AsyncCheckpointWriter(store) as writer:  # doctest: +SKIP
        ...     for step in steps:
        ...         if step % every == 0:
        ...             writer.submit(step, {"model": model.state_dict(), "rng": rng_state()})
    """

    def __init__(self, store: CheckpointStore) -> None:
        self.store = store
        self.blocking_seconds = 0.0
        self.save_seconds: list[float] = []
        self.last_uri: Optional[str] = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._buffers = HostBuffers()
        self._pending: Optional[Future[str]] = None
        self._lock = threading.Lock()
        self._closed = False

    @property
    def in_flight(self) -> bool:
        """Whether a write has been submitted and not finished."""
        return self._pending is not None and not self._pending.done()

    def submit(self, step: int, state: dict[str, Any], **kwargs: Any) -> None:
        """Copy `state` to CPU now and save it in the background as `store.save(step, state, **kwargs)`.

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
                self._await_pending()
                self._buffers.start()
                snapshot = snapshot_to_cpu(state, buffers=self._buffers)
                self._pending = self._executor.submit(self._write, step, snapshot, kwargs)
        finally:
            self.blocking_seconds += time.perf_counter() - started

    def _write(self, step: int, state: dict[str, Any], kwargs: dict[str, Any]) -> str:
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
            The URI it committed, or None when nothing was pending.

        Raises:
            TimeoutError: the write did not finish within `timeout`; it goes on in
                the background, and this writer no longer waits for it.
        """
        with self._lock:
            return self._await_pending(timeout)

    def close(self) -> None:
        """Wait for the last write (re-raising its error) and stop the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
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
