"""`CheckpointStore`: writes, verifies, lists and prunes committed checkpoints under one root.

See `training.checkpointing` for the layout and the commit protocol.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
import warnings
from typing import Any, Callable, Iterator, Optional, TypeVar

import fsspec

from common.retry import RetriesExhausted, retry_call
from training.checkpointing.errors import (
    CheckpointError,
    CheckpointUnusable,
    CheckpointWriteError,
    SkippedCheckpointWarning,
    check,
    is_int,
)
from training.checkpointing.files import HashingWriter, StagedFile, save_payload
from training.checkpointing.layout import MANIFEST, PAYLOAD, STEP_DIR, manifest_bytes, step_dir
from training.checkpointing.reading import LoadedCheckpoint, iter_shards, load_checkpoint, read_manifest
from training.checkpointing.removal import BackgroundRemover
from training.checkpointing.safe_load import check_plain
from training.checkpointing.sharding import ShardSpec, shard_file, sidecar_file

log = logging.getLogger("trainyard.training.checkpointing")

# ConnectionError and TimeoutError are OSError subclasses; named for the reader.
_TRANSIENT = (OSError, ConnectionError, TimeoutError)

T = TypeVar("T")


@dataclasses.dataclass
class _Entry:
    name: str
    step: int
    committed: bool = False


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
        storage_options: Optional[dict[str, Any]] = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.time,
    ) -> None:
        check(isinstance(root_uri, str) and root_uri.strip("/") != "", "root_uri", root_uri, "a non-empty path or URI")
        check(is_int(keep_last) and keep_last >= 1, "keep_last", keep_last, "an integer >= 1")
        check(
            is_int(max_write_attempts) and max_write_attempts >= 1,
            "max_write_attempts",
            max_write_attempts,
            "an integer >= 1",
        )
        check(
            isinstance(retry_backoff_s, (int, float)) and not isinstance(retry_backoff_s, bool)
            and math.isfinite(retry_backoff_s) and retry_backoff_s >= 0,
            "retry_backoff_s", retry_backoff_s, "a finite number of seconds >= 0",
        )
        check(
            is_int(fail_next_writes) and fail_next_writes >= 0, "fail_next_writes", fail_next_writes, "an integer >= 0"
        )
        self.root_uri = root_uri.rstrip("/")
        self.keep_last = keep_last
        self.max_write_attempts = max_write_attempts
        self.retry_backoff_s = float(retry_backoff_s)
        self.fail_next_writes = fail_next_writes
        self._sleep = sleep
        self._clock = clock
        self.fs, path = fsspec.core.url_to_fs(self.root_uri, **(storage_options or {}))
        self._root = path.rstrip("/")
        self._remover = BackgroundRemover(self.fs, lambda p: f"{self.root_uri}{p[len(self._root):]}")

    # ---- naming -------------------------------------------------------------

    def uri(self, step: int) -> str:
        """The URI of the checkpoint directory for `step`."""
        return f"{self.root_uri}/{step_dir(step)}"

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

        Retention uncommits the checkpoints it drops before `save` returns and
        deletes their files on a background thread (`flush` waits for that).

        Args:
            step: Global step; names the directory. Saving a step again replaces it
                (it is uncommitted first, so readers fall back to the previous one
                until the new one is committed).
            state: Tensors, containers, numbers and strings only (`rng_state()`
                is), so it loads without unpickling code (`training.checkpointing.safe_load`).
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
            CheckpointStateError: `state` holds an object a resume could not load
                with torch's weights-only unpickler; nothing was written.
            CheckpointWriteError: A file could not be written within
                `max_write_attempts`, or (rank 0 of a sharded save) another rank's
                file did not arrive within `shard.commit_timeout_s`.
        """
        check(is_int(step) and step >= 0, "step", step, "an integer >= 0")
        check(is_int(epoch) and epoch >= 0, "epoch", epoch, "an integer >= 0")
        check(isinstance(state, dict), "state", type(state).__name__, "a dict")
        check_plain(state, self.uri(step))
        values = {str(k): float(v) for k, v in (metrics or {}).items()}
        name = step_dir(step)
        self._remover.drain()  # the previous retention may still be removing this step's directory
        if shard is None or shard.rank == 0:
            self._uncommit(name)
        files = self._write_state(name, state, shard)
        if shard is not None:
            if shard.rank != 0:
                return self.uri(step)
            files = self._await_shards(name, shard)
        body = manifest_bytes(
            step=step, epoch=epoch, created=self._clock(), metrics=values, best=best, files=files,
            world_size=None if shard is None else shard.world_size,
        )
        self._write_file(name, MANIFEST, body)
        log.info("committed checkpoint %s (%d bytes)", self.uri(step), sum(f["size"] for f in files.values()))
        # Other ranks may already be writing a later step: a sharded run abandons a
        # timeline once, when it resumes (`discard_after`), not at every commit.
        self._apply_retention(step, drop_superseded=shard is None)
        return self.uri(step)

    def _uncommit(self, name: str) -> None:
        """Remove the manifest of step directory `name`, so readers skip it while it is rewritten."""
        manifest_path = self._path(name, MANIFEST)

        def uncommit() -> None:
            if self.fs.exists(manifest_path):
                self.fs.rm(manifest_path)

        self._with_retries(f"{self.root_uri}/{name}/{MANIFEST}", uncommit)

    def _write_state(self, name: str, state: dict[str, Any], shard: Optional[ShardSpec]) -> dict[str, Any]:
        """Write this process's payload (and, sharded, its sidecar); returns `{file: {size, sha256_tree,
        leaf_bytes}}`."""
        directory = self._path(name)
        fname = PAYLOAD if shard is None else shard_file(shard.rank)

        def write_payload() -> dict[str, Any]:
            if self.fail_next_writes > 0:
                self.fail_next_writes -= 1
                raise OSError(f"injected transient write failure ({self.fail_next_writes} more to come)")
            self.fs.makedirs(directory, exist_ok=True)
            staged = StagedFile(self.fs, directory, fname)
            with staged as f, HashingWriter(f, fd=staged.fd) as writer:
                save_payload(state, writer)  # it has the write/flush torch.save uses
            return writer.meta()

        payload = self._with_retries(f"{self.root_uri}/{name}/{fname}", write_payload)
        if shard is not None:
            sidecar = json.dumps({**payload, "token": shard.token, "rank": shard.rank}).encode()
            self._write_file(name, sidecar_file(shard.rank), sidecar)
        return {fname: payload}

    def _write_file(self, name: str, fname: str, body: bytes) -> None:
        """Write `body` as file `fname` of step directory `name`, staged and retried."""
        directory = self._path(name)

        def write() -> None:
            with StagedFile(self.fs, directory, fname) as f:
                f.write(body)

        self._with_retries(f"{self.root_uri}/{name}/{fname}", write)

    def _await_shards(self, name: str, shard: ShardSpec) -> dict[str, Any]:
        """Rank 0 of a sharded save: every rank's file metadata once its sidecar carries `shard.token`."""
        found: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + shard.commit_timeout_s
        while True:
            for rank in range(shard.world_size):
                if rank in found:
                    continue
                try:
                    meta = json.loads(self.fs.cat_file(self._path(name, sidecar_file(rank))))
                except (FileNotFoundError, ValueError):
                    continue
                except OSError as e:
                    log.warning("reading %s/%s/%s failed: %s; retrying", self.root_uri, name, sidecar_file(rank), e)
                    continue
                if meta.get("token") == shard.token:
                    found[rank] = {k: v for k, v in meta.items() if k not in ("token", "rank")}
            if len(found) == shard.world_size:
                return {shard_file(r): found[r] for r in range(shard.world_size)}
            if time.monotonic() > deadline:
                missing = sorted(set(range(shard.world_size)) - set(found))
                raise CheckpointWriteError(
                    f"{self.root_uri}/{name}",
                    1,
                    TimeoutError(
                        f"rank(s) {missing} did not write their shard within {shard.commit_timeout_s:.0f} s; not "
                        "committed"
                    ),
                )
            time.sleep(shard.poll_s)

    def _with_retries(self, uri: str, op: Callable[[], T]) -> T:
        """`op()`, retried on transient storage errors with doubling waits from `retry_backoff_s`."""

        def warn(attempt: int, error: BaseException, delay: float) -> None:
            log.warning(
                "writing %s failed (attempt %d of %d): %s; retrying in %.2f s",
                uri,
                attempt,
                self.max_write_attempts,
                error,
                delay,
            )

        try:
            return retry_call(
                op, retry_on=_TRANSIENT, attempts=self.max_write_attempts, backoff_s=self.retry_backoff_s,
                max_backoff_s=math.inf, sleep=self._sleep, on_retry=warn, describe=f"writing {uri}",
            )
        except RetriesExhausted as e:
            raise CheckpointWriteError(uri, e.attempts, e.last) from e.last

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
            except CheckpointUnusable:
                continue
        doomed = superseded + [e for e in committed if e.step not in keep]
        doomed += [e for e in entries if not e.committed and e.step < saved_step]
        removable = []
        for e in doomed:
            try:
                if e.committed:
                    self._uncommit(e.name)  # first: no reader chooses it from here on
                removable.append(self._path(e.name))
            except (OSError, CheckpointWriteError) as err:
                # The new checkpoint is committed; a failed cleanup only costs space
                # and is retried after the next save.
                log.warning("could not delete old checkpoint %s/%s: %s", self.root_uri, e.name, err)
        self._remover.submit(removable)  # the bytes go in the background (`training.checkpointing.removal`)

    def flush(self) -> None:
        """Wait until the checkpoints retention dropped are deleted (saves return once they are uncommitted)."""
        self._remover.drain()

    @property
    def retention_seconds(self) -> list[float]:
        """Wall seconds each background deletion of dropped checkpoints took, oldest first."""
        return list(self._remover.seconds)

    # ---- reading ------------------------------------------------------------

    def _scan(self) -> list[_Entry]:
        """Step directories under the root, oldest first, from one listing (after any deletion in progress)."""
        self._remover.drain()
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
            m = STEP_DIR.fullmatch(parts[0])
            if not m:
                continue
            entry = entries.setdefault(int(m.group(1)), _Entry(parts[0], int(m.group(1))))
            if parts[1:] == [MANIFEST]:
                entry.committed = True
        return [entries[s] for s in sorted(entries)]

    def _read_manifest(self, entry: _Entry) -> dict[str, Any]:
        return read_manifest(self.fs, self._path(entry.name))

    def _load(self, entry: _Entry, rank: Optional[int] = None, world_size: Optional[int] = None) -> LoadedCheckpoint:
        return load_checkpoint(self.fs, self._path(entry.name), f"{self.root_uri}/{entry.name}", rank, world_size)

    def iter_shards(self, name: str) -> Iterator[dict[str, Any]]:
        """Every rank's state of the committed sharded checkpoint `name`, in rank order, each verified as it is read.

        One shard is read at a time: a caller that keeps only what it needs of
        each (`training.checkpointing.sharding.assemble_regions`) holds one saved
        shard at most.

        Raises:
            CheckpointUnusable: a shard is missing or does not match its checksum.
            CheckpointLayoutError: the checkpoint is not sharded.
        """
        m = STEP_DIR.fullmatch(name)
        if not m:
            raise CheckpointUnusable(f"{name!r} is not a checkpoint directory name (step-NNNNNNNNN)")
        yield from iter_shards(self.fs, self._path(name), f"{self.root_uri}/{name}")

    def committed(self) -> list[tuple[str, bool]]:
        """(directory name, saved as best) of every committed checkpoint, newest first; manifests unverified."""
        out = []
        for entry in reversed(self._scan()):
            if entry.committed:
                try:
                    out.append((entry.name, bool(self._read_manifest(entry).get("best"))))
                except CheckpointUnusable:
                    out.append((entry.name, False))
        return out

    def load(self, name: str, rank: Optional[int] = None, world_size: Optional[int] = None) -> LoadedCheckpoint:
        """Verify and load the committed checkpoint directory `name` (e.g. `step-000000012`).

        Args:
            rank: For a sharded checkpoint, load (and verify) only this rank's
                shard, DTensors left as `localize_dtensors` markers. None reads
                every shard and merges them into full tensors (`merge_shards`).
            world_size: The reading run's world size, with `rank`. When it differs
                from the checkpoint's, the rank verifies its share of the saved
                shards (`rank`, `rank + world_size`, ...) and gets saved rank 0's
                state with the DTensor shards elided; the strategy reshards from
                `iter_shards`.

        Raises:
            CheckpointUnusable: partial, corrupt or unreadable; the message says why.
            CheckpointLayoutError: a rank beyond the checkpoint's shards, at the same world size.
            UnsafeCheckpointError: a file holds pickled code or types outside the
                allow-list (`training.checkpointing.safe_load`); nothing in it ran.
        """
        m = STEP_DIR.fullmatch(name)
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
            except CheckpointUnusable as e:
                self._skip(entry, str(e))
        return None

    def latest(self) -> Optional[LoadedCheckpoint]:
        """The newest committed checkpoint whose files match their checksums, or None.

        Newer partial or corrupt checkpoints are skipped with a
        `SkippedCheckpointWarning` (also logged) that names the checkpoint and why.
        A committed one that holds pickled code is not skipped: it raises
        `UnsafeCheckpointError`, since a tampered store is not a storage fault.
        """
        return self._first_loadable(list(reversed(self._scan())))

    def _marked_best(self) -> Iterator[_Entry]:
        """Committed entries whose manifest says `best`, newest first (manifests only; no checksum verified)."""
        for entry in reversed(self._scan()):
            if not entry.committed:
                continue
            try:
                if self._read_manifest(entry).get("best"):
                    yield entry
            except CheckpointUnusable:
                continue

    def best(self) -> Optional[LoadedCheckpoint]:
        """The newest verified checkpoint saved with `best=True`, or None."""
        return self._first_loadable(list(self._marked_best()))

    def newest_best(self) -> Optional[tuple[str, int]]:
        """(URI, step) of the newest committed checkpoint saved with `best=True`, from manifests alone; None if none.

        Reads no checkpoint file and verifies no checksum: for a caller that
        holds those very weights already (the trained model at the step the
        checkpoint was saved) and needs only to name it. `best()` loads and verifies.
        """
        entry = next(self._marked_best(), None)
        return None if entry is None else (self.uri(entry.step), entry.step)

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
            except CheckpointUnusable:
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
