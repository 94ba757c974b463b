"""Committed checkpoints on any fsspec filesystem, an asynchronous writer, RNG capture.

Every layer of fault tolerance (torchrun, the Job, Dagster's retry) resumes from
the newest *committed* checkpoint. Layout under the root (a local path or
`s3://bucket/prefix`)::

    <root>/step-000000012/state.pt        payload, written as `.tmp-<uuid>` and moved into place
    <root>/step-000000012/MANIFEST.json   written last, the same way: the commit marker

A step directory without `MANIFEST.json` is partial and never loaded. A
committed one whose files do not match the sizes and sha256 in its manifest is
skipped with a warning and the previous one is used.

Replicated state (DDP, one process): rank 0 writes `state.pt`. Sharded state
(FSDP2, tensor parallel: parameters and optimizer states are DTensors) is
written by every rank at once, without gathering::

    <root>/step-000000012/shard-00001.pt    rank 1's own state: each DTensor as its local shard
    <root>/step-000000012/shard-00001.json  rank 1's sidecar: sha256, size and the save's token
    <root>/step-000000012/MANIFEST.json     rank 0 writes it once every rank's sidecar carries this save's token

Each DTensor is stored as its local tensor plus its global shape and offset
(`localize_dtensors`), so a rank resumes from its own file (same world size and
mesh) and one process can reassemble the full state (`merge_shards`) for
evaluation, export and tools. `load(name, rank=r)` verifies only rank r's file;
ranks agree on which checkpoint to use (see `training.entrypoint`).

Readers may be any number of processes.

Example:
    >>> import tempfile
    >>> store = CheckpointStore(tempfile.mkdtemp(), keep_last=2)
    >>> uri = store.save(100, {"weights": torch.zeros(2), "rng": rng_state()}, metrics={"val_acc": 0.9}, best=True)
    >>> resumed = store.latest()
    >>> resumed.step, resumed.metrics
    (100, {'val_acc': 0.9})
    >>> set_rng_state(resumed.state["rng"])
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import io
import json
import logging
import math
import random
import re
import threading
import time
import uuid
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any, Callable, Optional, TypeVar

import fsspec
from fsspec.spec import AbstractBufferedFile
import numpy as np
import torch

from training.errors import ConfigError

log = logging.getLogger("trainyard.training.checkpointing")

MANIFEST = "MANIFEST.json"
PAYLOAD = "state.pt"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"step-(\d{9,})")
# ConnectionError and TimeoutError are OSError subclasses; named for the reader.
_TRANSIENT = (OSError, ConnectionError, TimeoutError)

T = TypeVar("T")


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
        super().__init__(f"could not write checkpoint file {uri} after {attempts} attempts: {type(cause).__name__}: {cause}")
        self.uri = uri
        self.attempts = attempts


class SkippedCheckpointWarning(UserWarning):
    """A partial or corrupt checkpoint was passed over in favour of an older one."""


class CheckpointUnusable(CheckpointError):
    """A checkpoint directory cannot be loaded (partial, corrupt, unreadable manifest); the message says why."""


_Unusable = CheckpointUnusable


class CheckpointLayoutError(ConfigError):
    """A sharded checkpoint was written by a different number of ranks than the run resuming it.

    A configuration problem (the distribution changed), not a storage one: the
    checkpoints are intact, and retrying with the same distribution cannot help.
    """


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """Who writes which part of a sharded checkpoint.

    Attributes:
        rank: This process's global rank; it writes `shard-<rank>.pt`.
        world_size: Ranks writing the checkpoint; rank 0 commits once all have.
        token: Identifies this save on every rank (same value everywhere), so rank 0
            never commits a sidecar left by an earlier attempt at the same step.
        commit_timeout_s: How long rank 0 waits for the other ranks' files.
        poll_s: Listing interval while rank 0 waits.
    """

    rank: int
    world_size: int
    token: str
    commit_timeout_s: float = 600.0
    poll_s: float = 0.05

    def __post_init__(self) -> None:
        _check(_is_int(self.world_size) and self.world_size >= 1, "world_size", self.world_size, "an integer >= 1")
        _check(_is_int(self.rank) and 0 <= self.rank < self.world_size, "rank", self.rank, f"an integer in [0, {self.world_size})")
        _check(isinstance(self.token, str) and self.token != "", "token", self.token, "a non-empty string")


def shard_file(rank: int) -> str:
    return f"shard-{rank:05d}.pt"


def _sidecar(rank: int) -> str:
    return f"shard-{rank:05d}.json"


@dataclasses.dataclass(frozen=True)
class LoadedCheckpoint:
    """A verified, committed checkpoint and its deserialised state.

    Attributes:
        uri: The checkpoint directory, e.g. `s3://bucket/run/checkpoints/step-000000012`.
        step: Global step it was taken at.
        epoch: Epoch it was taken in.
        metrics: Metric values the caller recorded with it.
        state: The dict passed to `CheckpointStore.save`.
        best: Whether it was saved as the best so far.
        world_size: Ranks that wrote a sharded checkpoint; None for replicated state.
    """

    uri: str
    step: int
    epoch: int
    metrics: dict[str, float]
    state: dict[str, Any]
    best: bool = False
    world_size: Optional[int] = None


@dataclasses.dataclass
class _Entry:
    name: str
    step: int
    committed: bool = False


class _HashingWriter:
    """Passes bytes through to a file while counting and hashing them, so the payload is read once."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.sha256.update(view)
        self.size += view.nbytes
        self._f.write(view)
        return view.nbytes

    def flush(self) -> None:
        self._f.flush()


def _check(ok: bool, field: str, value: Any, rule: str) -> None:
    if not ok:
        raise ValueError(f"{field}={value!r} is invalid; it must be {rule}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class CheckpointStore:
    """Writes, verifies, lists and prunes committed checkpoints under one root.

    Args:
        root_uri: Directory for checkpoints: a local path or any fsspec URI (`s3://...`).
        keep_last: Committed checkpoints kept after each save, besides the best one.
        max_write_attempts: Tries per file before `CheckpointWriteError`; transient
            errors (`OSError`, `ConnectionError`, `TimeoutError`) are retried.
        retry_backoff_s: Sleep before the second attempt; doubles for each further one.
        fail_next_writes: Fault injection for tests and drills: the next this-many
            payload write attempts raise `OSError`. Also settable as an attribute.
        weights_only: Passed to `torch.load`. States made of tensors, containers,
            numbers and strings (including `rng_state()`) load with `True`; set
            `False` only for trusted checkpoints holding arbitrary objects.
        storage_options: Passed to fsspec, e.g.
            `{"client_kwargs": {"endpoint_url": "http://minio:9000"}}`.
        sleep: Called with the backoff in seconds; tests pass a recorder.
        clock: Wall-clock time in seconds for the manifest's creation time.

    Example:
        >>> store = CheckpointStore("s3://runs/trial-0001/checkpoints", keep_last=3)  # doctest: +SKIP
        >>> uri = store.save(1200, state, epoch=3, metrics={"val_acc": 0.91}, best=True)  # doctest: +SKIP
        >>> store.latest().step  # doctest: +SKIP
        1200
    """

    def __init__(
        self,
        root_uri: str,
        keep_last: int = 3,
        max_write_attempts: int = 3,
        retry_backoff_s: float = 0.2,
        *,
        fail_next_writes: int = 0,
        weights_only: bool = True,
        storage_options: Optional[dict[str, Any]] = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.time,
    ) -> None:
        _check(isinstance(root_uri, str) and root_uri.strip("/") != "", "root_uri", root_uri, "a non-empty path or URI")
        _check(_is_int(keep_last) and keep_last >= 1, "keep_last", keep_last, "an integer >= 1")
        _check(_is_int(max_write_attempts) and max_write_attempts >= 1, "max_write_attempts", max_write_attempts, "an integer >= 1")
        _check(
            isinstance(retry_backoff_s, (int, float)) and not isinstance(retry_backoff_s, bool)
            and math.isfinite(retry_backoff_s) and retry_backoff_s >= 0,
            "retry_backoff_s", retry_backoff_s, "a finite number of seconds >= 0",
        )
        _check(_is_int(fail_next_writes) and fail_next_writes >= 0, "fail_next_writes", fail_next_writes, "an integer >= 0")
        self.root_uri = root_uri.rstrip("/")
        self.keep_last = keep_last
        self.max_write_attempts = max_write_attempts
        self.retry_backoff_s = float(retry_backoff_s)
        self.fail_next_writes = fail_next_writes
        self.weights_only = weights_only
        self._sleep = sleep
        self._clock = clock
        self.fs, path = fsspec.core.url_to_fs(self.root_uri, **(storage_options or {}))
        self._root = path.rstrip("/")

    # ---- naming -------------------------------------------------------------

    def uri(self, step: int) -> str:
        """The URI of the checkpoint directory for `step`."""
        return f"{self.root_uri}/{self._name(step)}"

    @staticmethod
    def _name(step: int) -> str:
        return f"step-{step:09d}"

    def _path(self, *parts: str) -> str:
        return "/".join([self._root, *parts])

    # ---- writing ------------------------------------------------------------

    def save(
        self,
        step: int,
        state: dict[str, Any],
        *,
        epoch: int = 0,
        metrics: Optional[dict[str, float]] = None,
        best: bool = False,
        shard: Optional[ShardSpec] = None,
    ) -> str:
        """Write `state` as the checkpoint of `step`, commit it, then apply retention.

        Args:
            step: Global step; names the directory. Saving a step again replaces it
                (it is uncommitted first, so readers fall back to the previous one
                until the new one is committed).
            state: Anything `torch.save` can write; keep it to tensors, containers,
                numbers and strings so it loads with `weights_only=True`.
            epoch: Recorded in the manifest.
            metrics: Scalar values recorded in the manifest.
            best: Mark this checkpoint as the best so far; retention keeps the newest
                one marked best even when it is older than the last `keep_last`.
            shard: For sharded state: this rank's part. Every rank calls `save` with
                its own state; rank 0 commits once all ranks' files are written and
                applies retention; the others return after writing their shard.

        Returns:
            The URI of the checkpoint directory (committed, except on ranks other
            than 0 of a sharded save, which do not wait for the commit).

        Raises:
            CheckpointWriteError: A file could not be written within
                `max_write_attempts`, or (rank 0 of a sharded save) another rank's
                file did not arrive within `shard.commit_timeout_s`.
        """
        _check(_is_int(step) and step >= 0, "step", step, "an integer >= 0")
        _check(_is_int(epoch) and epoch >= 0, "epoch", epoch, "an integer >= 0")
        _check(isinstance(state, dict), "state", type(state).__name__, "a dict")
        values = {str(k): float(v) for k, v in (metrics or {}).items()}
        name = self._name(step)
        directory = self._path(name)
        manifest_path = self._path(name, MANIFEST)
        committer = shard is None or shard.rank == 0

        def uncommit() -> None:
            if self.fs.exists(manifest_path):
                self.fs.rm(manifest_path)

        if committer:
            self._with_retries(f"{self.root_uri}/{name}/{MANIFEST}", uncommit)
        fname = PAYLOAD if shard is None else shard_file(shard.rank)

        def write_payload() -> dict[str, Any]:
            if self.fail_next_writes > 0:
                self.fail_next_writes -= 1
                raise OSError(f"injected transient write failure ({self.fail_next_writes} more to come)")
            self.fs.makedirs(directory, exist_ok=True)
            with self._staged(directory, fname) as f:
                writer = _HashingWriter(f)
                torch.save(state, writer)
            return {"sha256": writer.sha256.hexdigest(), "size": writer.size}

        payload = self._with_retries(f"{self.root_uri}/{name}/{fname}", write_payload)
        files = {fname: payload}
        if shard is not None:
            sidecar = json.dumps({**payload, "token": shard.token, "rank": shard.rank}).encode()

            def write_sidecar() -> None:
                with self._staged(directory, _sidecar(shard.rank)) as f:
                    f.write(sidecar)

            self._with_retries(f"{self.root_uri}/{name}/{_sidecar(shard.rank)}", write_sidecar)
            if shard.rank != 0:
                return self.uri(step)
            files = self._await_shards(name, shard)
        created = self._clock()
        manifest = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "epoch": epoch,
            "created_unix": created,
            "created": datetime.fromtimestamp(created, timezone.utc).isoformat(),
            "metrics": values,
            "best": bool(best),
            "files": files,
        }
        if shard is not None:
            manifest["world_size"] = shard.world_size
        body = json.dumps(manifest, indent=2, sort_keys=True).encode()

        def write_manifest() -> None:
            with self._staged(directory, MANIFEST) as f:
                f.write(body)

        self._with_retries(f"{self.root_uri}/{name}/{MANIFEST}", write_manifest)
        log.info("committed checkpoint %s (%d bytes)", self.uri(step), sum(f["size"] for f in files.values()))
        # Other ranks may already be writing a later step: a sharded run abandons a
        # timeline once, when it resumes (`discard_after`), not at every commit.
        self._apply_retention(step, drop_superseded=shard is None)
        return self.uri(step)

    def _await_shards(self, name: str, shard: ShardSpec) -> dict[str, Any]:
        """Rank 0 of a sharded save: every rank's file metadata once its sidecar carries `shard.token`."""
        found: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + shard.commit_timeout_s
        while True:
            for rank in range(shard.world_size):
                if rank in found:
                    continue
                try:
                    meta = json.loads(self.fs.cat_file(self._path(name, _sidecar(rank))))
                except (FileNotFoundError, ValueError):
                    continue
                except OSError as e:
                    log.warning("reading %s/%s/%s failed: %s; retrying", self.root_uri, name, _sidecar(rank), e)
                    continue
                if meta.get("token") == shard.token:
                    found[rank] = {"sha256": meta["sha256"], "size": meta["size"]}
            if len(found) == shard.world_size:
                return {shard_file(r): found[r] for r in range(shard.world_size)}
            if time.monotonic() > deadline:
                missing = sorted(set(range(shard.world_size)) - set(found))
                raise CheckpointWriteError(
                    f"{self.root_uri}/{name}", 1,
                    TimeoutError(f"rank(s) {missing} did not write their shard within {shard.commit_timeout_s:.0f} s; not committed"),
                )
            time.sleep(shard.poll_s)

    def _staged(self, directory: str, name: str) -> "_StagedFile":
        return _StagedFile(self.fs, directory, name)

    def _with_retries(self, uri: str, op: Callable[[], T]) -> T:
        last: Optional[BaseException] = None
        for attempt in range(1, self.max_write_attempts + 1):
            try:
                return op()
            except _TRANSIENT as e:
                last = e
                if attempt == self.max_write_attempts:
                    break
                delay = self.retry_backoff_s * 2 ** (attempt - 1)
                log.warning(
                    "writing %s failed (attempt %d of %d): %s; retrying in %.2f s",
                    uri, attempt, self.max_write_attempts, e, delay,
                )
                self._sleep(delay)
        assert last is not None
        raise CheckpointWriteError(uri, self.max_write_attempts, last) from last

    def discard_after(self, step: int) -> list[str]:
        """Delete every checkpoint directory (committed or partial) above `step`.

        A run resuming from `step` (or -1 for a fresh start) abandons the timeline
        that went further; called once, before any rank writes, so a later save of
        the same step never meets an abandoned run's files.

        Returns:
            The URIs deleted.
        """
        gone = []
        for e in self._scan():
            if e.step > step:
                try:
                    self.fs.rm(self._path(e.name), recursive=True)
                    gone.append(f"{self.root_uri}/{e.name}")
                except FileNotFoundError:
                    pass
        if gone:
            log.info("discarded %d checkpoint(s) of an abandoned timeline above step %d: %s", len(gone), step, gone)
        return gone

    def _apply_retention(self, saved_step: int, drop_superseded: bool = True) -> None:
        """Keep the last `keep_last` committed plus the newest marked best; drop stale partials.

        Checkpoints with a higher step than the one just saved belong to a timeline
        the run abandoned (it resumed from an earlier one, e.g. because the newest
        was corrupt), so they go too (`drop_superseded`): the checkpoint just saved
        is always the newest.
        """
        entries = self._scan()
        superseded = [e for e in entries if e.step > saved_step] if drop_superseded else []
        entries = [e for e in entries if e.step <= saved_step]
        committed = [e for e in entries if e.committed]
        keep = {e.step for e in committed[-self.keep_last:]}
        for e in reversed(committed):
            try:
                if self._read_manifest(e).get("best"):
                    keep.add(e.step)
                    break
            except _Unusable:
                continue
        doomed = superseded + [e for e in committed if e.step not in keep]
        doomed += [e for e in entries if not e.committed and e.step < saved_step]
        for e in doomed:
            try:
                self.fs.rm(self._path(e.name), recursive=True)
            except OSError as err:
                # The new checkpoint is committed; a failed cleanup only costs space
                # and is retried after the next save.
                log.warning("could not delete old checkpoint %s/%s: %s", self.root_uri, e.name, err)

    # ---- reading ------------------------------------------------------------

    def _scan(self) -> list[_Entry]:
        """Step directories under the root, oldest first, from one listing."""
        self.fs.invalidate_cache(self._root)
        try:
            paths = self.fs.find(self._root, withdirs=True)
        except FileNotFoundError:
            return []
        prefix = self._root + "/"
        entries: dict[int, _Entry] = {}
        for p in paths:
            if not p.startswith(prefix):
                continue
            parts = p[len(prefix):].split("/")
            m = _STEP_DIR.fullmatch(parts[0])
            if not m:
                continue
            entry = entries.setdefault(int(m.group(1)), _Entry(parts[0], int(m.group(1))))
            if parts[1:] == [MANIFEST]:
                entry.committed = True
        return [entries[s] for s in sorted(entries)]

    def _read_manifest(self, entry: _Entry) -> dict[str, Any]:
        try:
            manifest = json.loads(self.fs.cat_file(self._path(entry.name, MANIFEST)))
            files = manifest["files"]
            if not isinstance(manifest["step"], int) or not isinstance(files, dict):
                raise ValueError("needs an integer step and a files table")
            world = manifest.get("world_size")
            expected = {PAYLOAD} if world is None else {shard_file(r) for r in range(world)}
            if not expected <= set(files):
                raise ValueError(f"files must list {sorted(expected)[:3]}{'...' if len(expected) > 3 else ''}")
            for meta in files.values():
                if not isinstance(meta["sha256"], str) or not isinstance(meta["size"], int):
                    raise ValueError("each file needs a sha256 string and an integer size")
        except FileNotFoundError as e:
            raise _Unusable("missing manifest (vanished while reading)") from e
        except (ValueError, KeyError, TypeError) as e:
            raise _Unusable(f"unreadable manifest: {type(e).__name__}: {e}") from e
        return manifest

    def _verified(self, entry: _Entry, fname: str, meta: dict[str, Any]) -> bytes:
        try:
            data = self.fs.cat_file(self._path(entry.name, fname))
        except FileNotFoundError as e:
            raise _Unusable(f"file {fname} listed in the manifest is missing") from e
        if len(data) != meta["size"]:
            raise _Unusable(f"size mismatch for file {fname}: manifest says {meta['size']} bytes, found {len(data)}")
        if hashlib.sha256(data).hexdigest() != meta["sha256"]:
            raise _Unusable(f"checksum mismatch for file {fname}")
        return data

    def _load(self, entry: _Entry, rank: Optional[int] = None, world_size: Optional[int] = None) -> LoadedCheckpoint:
        manifest = self._read_manifest(entry)
        world = manifest.get("world_size")
        uri = f"{self.root_uri}/{entry.name}"
        if world is None:
            # Replicated state: every file is checked, whoever reads it.
            payload = b""
            for fname, meta in sorted(manifest["files"].items()):
                data = self._verified(entry, fname, meta)
                if fname == PAYLOAD:
                    payload = data
            state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=self.weights_only)
        elif rank is not None:
            if world_size is not None and world_size != world:
                raise CheckpointLayoutError(
                    f"checkpoint {uri} is sharded over {world} ranks but this run has {world_size}; sharded checkpoints "
                    f"resume with the same distribution (world size and mesh): set it back to {world} ranks, or start a new trial"
                )
            if rank >= world:
                raise CheckpointLayoutError(f"checkpoint {uri} has {world} shards; there is none for rank {rank}")
            fname = shard_file(rank)
            data = self._verified(entry, fname, manifest["files"][fname])
            state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=self.weights_only)
        else:
            # One process reading a sharded checkpoint whole (evaluation, export, tools).
            shards = []
            for r in range(world):
                fname = shard_file(r)
                data = self._verified(entry, fname, manifest["files"][fname])
                shards.append(torch.load(io.BytesIO(data), map_location="cpu", weights_only=self.weights_only))
            state = merge_shards(shards)
        return LoadedCheckpoint(
            uri=uri,
            step=manifest["step"],
            epoch=int(manifest.get("epoch", 0)),
            metrics=dict(manifest.get("metrics", {})),
            state=state,
            best=bool(manifest.get("best", False)),
            world_size=world,
        )

    def committed(self) -> list[tuple[str, bool]]:
        """(directory name, saved as best) of every committed checkpoint, newest first; manifests unverified."""
        out = []
        for entry in reversed(self._scan()):
            if entry.committed:
                try:
                    out.append((entry.name, bool(self._read_manifest(entry).get("best"))))
                except _Unusable:
                    out.append((entry.name, False))
        return out

    def load(self, name: str, rank: Optional[int] = None, world_size: Optional[int] = None) -> LoadedCheckpoint:
        """Verify and load the committed checkpoint directory `name` (e.g. `step-000000012`).

        Args:
            rank: For a sharded checkpoint, load (and verify) only this rank's
                shard, DTensors left as `localize_dtensors` markers. None reads
                every shard and merges them into full tensors (`merge_shards`).
            world_size: The reading run's world size, checked against the
                checkpoint's when `rank` is given.

        Raises:
            CheckpointUnusable: partial, corrupt or unreadable; the message says why.
            CheckpointLayoutError: sharded over a different number of ranks.
        """
        m = _STEP_DIR.fullmatch(name)
        if not m:
            raise CheckpointUnusable(f"{name!r} is not a checkpoint directory name (step-NNNNNNNNN)")
        entry = _Entry(name, int(m.group(1)), committed=True)
        return self._load(entry, rank, world_size)

    def _skip(self, entry: _Entry, why: str) -> None:
        msg = f"skipping checkpoint {self.root_uri}/{entry.name}: {why}; trying the previous one"
        log.warning(msg)
        warnings.warn(msg, SkippedCheckpointWarning, stacklevel=4)

    def _first_loadable(self, entries: list[_Entry]) -> Optional[LoadedCheckpoint]:
        for entry in entries:
            if not entry.committed:
                self._skip(entry, "missing manifest (partial or in-flight write)")
                continue
            try:
                return self._load(entry)
            except _Unusable as e:
                self._skip(entry, str(e))
        return None

    def latest(self) -> Optional[LoadedCheckpoint]:
        """The newest committed checkpoint whose files match their checksums, or None.

        Newer partial or corrupt checkpoints are skipped with a
        `SkippedCheckpointWarning` (also logged) that names the checkpoint and why.
        """
        return self._first_loadable(list(reversed(self._scan())))

    def best(self) -> Optional[LoadedCheckpoint]:
        """The newest verified checkpoint saved with `best=True`, or None."""
        marked = []
        for entry in reversed(self._scan()):
            if not entry.committed:
                continue
            try:
                if self._read_manifest(entry).get("best"):
                    marked.append(entry)
            except _Unusable:
                continue
        return self._first_loadable(marked)

    def list_committed(self) -> list[dict[str, Any]]:
        """Manifests of committed checkpoints, newest first, each with its `uri` added.

        Checksums are not verified here; unreadable manifests are left out.
        """
        out = []
        for entry in reversed(self._scan()):
            if not entry.committed:
                continue
            try:
                manifest = self._read_manifest(entry)
            except _Unusable:
                continue
            out.append({**manifest, "uri": f"{self.root_uri}/{entry.name}"})
        return out

    # ---- fault injection ----------------------------------------------------

    def corrupt_latest(self) -> str:
        """Flip bytes in the middle of the newest committed payload (tests and drills only).

        The size is unchanged, so only the checksum catches it.

        Returns:
            The URI of the corrupted checkpoint.
        """
        committed = [e for e in self._scan() if e.committed]
        if not committed:
            raise CheckpointError(f"no committed checkpoint under {self.root_uri} to corrupt")
        entry = committed[-1]
        files = sorted(self._read_manifest(entry)["files"])
        path = self._path(entry.name, PAYLOAD if PAYLOAD in files else files[0])
        data = bytearray(self.fs.cat_file(path))
        mid = len(data) // 2
        for i in range(mid, min(mid + 16, len(data))):
            data[i] ^= 0xFF
        self.fs.pipe_file(path, bytes(data))
        return f"{self.root_uri}/{entry.name}"


class _StagedFile:
    """A file written under `.tmp-<uuid>` and moved to its name on a clean close.

    The move is an atomic rename on local disks; on object stores it is a copy,
    which is why the manifest, not the move, is the commit.
    """

    def __init__(self, fs: Any, directory: str, name: str) -> None:
        self.fs = fs
        self.tmp = f"{directory}/.tmp-{uuid.uuid4().hex}"
        self.final = f"{directory}/{name}"
        self._f: Any = None

    def __enter__(self) -> Any:
        self._f = self.fs.open(self.tmp, "wb")
        return self._f

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if exc_type is None:
                self._f.close()
                self.fs.mv(self.tmp, self.final)
                return
        except BaseException:
            self._discard()
            raise
        self._discard()

    def _discard(self) -> None:
        try:
            if not self._f.closed:
                # Abandon rather than close: closing an object-store file uploads it.
                if isinstance(self._f, AbstractBufferedFile):
                    self._f.discard()
                else:
                    self._f.close()
            self.fs.rm(self.tmp)
        except OSError as e:
            log.debug("could not remove temporary file %s: %s", self.tmp, e)


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


DTENSOR = "__trainyard_dtensor__"


def localize_dtensors(obj: Any) -> Any:
    """`obj` with every DTensor replaced by a marker holding its local shard and where it sits.

    Marker: `{DTENSOR: 1, "local": tensor, "global_shape": [...], "offset": [...]}`,
    plain data that loads with `weights_only=True`. Containers are rebuilt
    (dicts keep their type); other leaves are shared, not copied.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = obj.to_local()
        shape, offset = compute_local_shape_and_global_offset(obj.shape, obj.device_mesh, obj.placements)
        if tuple(local.shape) != tuple(shape):
            raise CheckpointError(f"DTensor local shard has shape {tuple(local.shape)}, its placements say {tuple(shape)}")
        return {DTENSOR: 1, "local": local, "global_shape": list(obj.shape), "offset": list(offset)}
    if isinstance(obj, dict):
        out = copy.copy(obj)
        out.clear()
        for k, v in obj.items():
            out[k] = localize_dtensors(v)
        return out
    if isinstance(obj, list):
        return [localize_dtensors(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(localize_dtensors(v) for v in obj)
    return obj


def is_dtensor_marker(obj: Any) -> bool:
    return isinstance(obj, dict) and obj.get(DTENSOR) == 1 and "local" in obj


def merge_shards(shards: list[Any]) -> Any:
    """One state from every rank's localized state: DTensor markers become full tensors.

    Each full tensor is assembled from the local shards at their offsets (a
    replicated dimension is written identically by several ranks). Everything
    else is taken from rank 0's state.

    Raises:
        CheckpointError: the shards do not have the same structure or do not cover a tensor.
    """
    first = shards[0]
    if is_dtensor_marker(first):
        parts = [s for s in shards if is_dtensor_marker(s)]
        if len(parts) != len(shards):
            raise CheckpointError("shards disagree: a DTensor on rank 0 is not a DTensor on every rank")
        full = torch.empty(first["global_shape"], dtype=first["local"].dtype)
        covered = torch.zeros(first["global_shape"], dtype=torch.bool) if full.dim() else None
        for part in parts:
            local = part["local"]
            index = tuple(slice(o, o + n) for o, n in zip(part["offset"], local.shape))
            full[index] = local
            if covered is not None:
                covered[index] = True
        if covered is not None and not bool(covered.all()):
            raise CheckpointError(f"shards of a tensor of shape {tuple(full.shape)} do not cover it")
        return full
    if isinstance(first, dict):
        out = copy.copy(first)
        out.clear()
        for k in first:
            out[k] = merge_shards([s[k] if isinstance(s, dict) and k in s else first[k] for s in shards])
        return out
    if isinstance(first, (list, tuple)) and not hasattr(first, "_fields"):
        items = [merge_shards([s[i] if isinstance(s, (list, tuple)) and len(s) > i else first[i] for s in shards]) for i in range(len(first))]
        return items if isinstance(first, list) else tuple(items)
    return first


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

    def _await_pending(self) -> Optional[str]:
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def wait(self) -> Optional[str]:
        """Block until the last submitted write finishes; re-raise its error.

        Returns:
            The URI it committed, or None when nothing was pending.
        """
        with self._lock:
            return self._await_pending()

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


def rng_state() -> dict[str, Any]:
    """Python, NumPy, torch CPU and (when available) CUDA RNG states, for exact resume.

    Plain tuples, lists, ints and tensors only, so it loads with `weights_only=True`.
    """
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "state": {"key": np_state["state"]["key"].tolist(), "pos": int(np_state["state"]["pos"])},
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the generators captured by `rng_state`; keys that are absent are left alone."""
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        s = state["numpy"]
        np.random.set_state(
            {
                "bit_generator": s["bit_generator"],
                "state": {"key": np.asarray(s["state"]["key"], dtype=np.uint32), "pos": s["state"]["pos"]},
                "has_gauss": s["has_gauss"],
                "gauss": s["gauss"],
            }
        )
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = list(state["cuda"])[: torch.cuda.device_count()]
        for device, s in enumerate(cuda_states):
            torch.cuda.set_rng_state(s, device)


def young_daly_interval(save_seconds: float, node_mtbf_hours: float, nodes: int) -> float:
    """The Young/Daly checkpoint interval in seconds: `sqrt(2 * save_seconds * job_mtbf)`.

    The job fails when any node fails, so `job_mtbf = node_mtbf / nodes`.

    Example:
        >>> round(young_daly_interval(60.0, 1000.0, 100))  # job MTBF 10 h
        2078
    """
    for field, value in (("save_seconds", save_seconds), ("node_mtbf_hours", node_mtbf_hours)):
        _check(
            isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0,
            field, value, "a finite number > 0",
        )
    _check(_is_int(nodes) and nodes >= 1, "nodes", nodes, "an integer >= 1")
    job_mtbf_seconds = node_mtbf_hours * 3600.0 / nodes
    return math.sqrt(2.0 * save_seconds * job_mtbf_seconds)
