"""Writing one checkpoint file on any fsspec filesystem: staged under a temporary name, hashed on the way."""

from __future__ import annotations

import ctypes
import hashlib
import inspect
import logging
import os
import pickle
import sys
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractBufferedFile

from common.atomic import fsync_dir

log = logging.getLogger("trainyard.training.checkpointing")

LEAF = 16 * 2**20
"""A file's hash is a tree of sha256: the sha256 of each consecutive `LEAF` bytes (the last may be
shorter), then the sha256 of those digests concatenated. Leaves hash in parallel, on writing and on
loading, where one sha256 of the whole file (1.2 GB/s on one core) was slower than the disk; it is
as collision resistant as sha256 itself. Manifests written before it carry the file's plain sha256,
which is still verified as such (`digest_matches`)."""
_INLINE = 2**20  # writes smaller than this (headers, the pickle, manifests) are hashed in the caller's thread
_HASH_THREADS = max(1, min(4, os.cpu_count() or 1))


def _writeback_starter() -> Optional[Callable[[int], None]]:
    """`start(fd)`: ask the kernel to begin writing fd's dirty pages to the device now, without waiting (Linux only).

    A checkpoint smaller than the kernel's dirty threshold (10% of memory) would
    otherwise sit in the page cache until the closing fsync, which then waits for
    all of it; started slice by slice, the device writes while the CPU hashes.
    Durability still comes from the fsync; this only moves the work earlier.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        sync_file_range = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    sync_file_range.restype = ctypes.c_int
    write = 2  # SYNC_FILE_RANGE_WRITE: start write-out of dirty pages not already under write-out

    def start(fd: int) -> None:
        sync_file_range(fd, 0, 0, write)  # 0, 0: the whole file; a failure only leaves the work to the fsync

    return start


_start_writeback = _writeback_starter()


def _root(leaves: list[bytes]) -> str:
    return hashlib.sha256(b"".join(leaves)).hexdigest()


def tree_sha256(data: Any, leaf: int) -> str:
    """The tree hash (see `LEAF`) of `data` (bytes or a buffer), its leaves hashed in parallel."""
    view = memoryview(data).cast("B")
    pieces = [view[i:i + leaf] for i in range(0, view.nbytes, leaf)]
    if len(pieces) <= 1 or _HASH_THREADS == 1:
        return _root([hashlib.sha256(p).digest() for p in pieces])
    with ThreadPoolExecutor(
        max_workers=min(_HASH_THREADS, len(pieces)), thread_name_prefix="checkpoint-verify"
    ) as pool:
        return _root(list(pool.map(lambda p: hashlib.sha256(p).digest(), pieces)))


def digest_matches(data: bytes, meta: dict[str, Any]) -> bool:
    """Whether `data` hashes to what manifest entry `meta` records: `sha256_tree` (with its `leaf_bytes`), or,
    in manifests from before the tree hash, the plain `sha256` of the whole file."""
    if "sha256_tree" in meta:
        return bool(tree_sha256(data, meta["leaf_bytes"]) == meta["sha256_tree"])
    return bool(hashlib.sha256(data).hexdigest() == meta["sha256"])


class HashingWriter:
    """Passes bytes through to a file while counting and hashing them (`tree_sha256`), so the payload is read once.

    A large write is cut at `LEAF` boundaries of the file; helper threads hash
    the leaves while the caller writes them (hashlib and file writes both
    release the GIL). With `fd` (a local file's descriptor) each piece's
    write-out to the device starts at once. `write` returns only when every byte
    it was given is hashed and written, so the caller may free or reuse its
    buffer (torch.save frees temporaries). Call `close` (or use it as a context
    manager) to stop the helper threads.

    Attributes:
        size: Bytes written.
    """

    def __init__(self, f: Any, fd: Optional[int] = None, leaf: Optional[int] = None) -> None:
        self._f = f
        self._fd = fd
        self._leaf_bytes = LEAF if leaf is None else leaf
        self.size = 0
        self._leaves: list[Any] = []  # hashlib objects of the complete leaves, in order
        self._leaf = hashlib.sha256()  # the leaf being filled
        self._leaf_len = 0
        self._pool: Optional[ThreadPoolExecutor] = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        if n < _INLINE and self._leaf_len + n < self._leaf_bytes:
            self._leaf.update(view)
            self._leaf_len += n
            self._f.write(view)
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=_HASH_THREADS, thread_name_prefix="checkpoint-hash")
            # Each leaf gets at most one update per call (this call's pieces are disjoint leaves or
            # parts of them, and the next call waits for these), so updates never race.
            hashed: list[Future[None]] = []
            try:
                pos = 0
                while pos < n:
                    take = min(self._leaf_bytes - self._leaf_len, n - pos)
                    piece = view[pos:pos + take]
                    hashed.append(self._pool.submit(self._leaf.update, piece))
                    self._leaf_len += take
                    if self._leaf_len == self._leaf_bytes:
                        self._leaves.append(self._leaf)
                        self._leaf, self._leaf_len = hashlib.sha256(), 0
                    self._f.write(piece)
                    if self._fd is not None and _start_writeback is not None:
                        _start_writeback(self._fd)
                    pos += take
            finally:
                for h in hashed:  # even on a failed write: the buffer must outlive its hashing
                    h.result()
        self.size += n
        return n

    def flush(self) -> None:
        self._f.flush()

    def hexdigest(self) -> str:
        """The tree hash of everything written so far."""
        leaves = [h.digest() for h in self._leaves]
        if self._leaf_len:
            leaves.append(self._leaf.digest())
        return _root(leaves)

    def meta(self) -> dict[str, Any]:
        """The manifest's entry for the file written: its size and tree hash."""
        return {"size": self.size, "sha256_tree": self.hexdigest(), "leaf_bytes": self._leaf_bytes}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self) -> "HashingWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _crc_free_save() -> Optional[Callable[[Any, Any], None]]:
    """torch.save without its per-record crc32, through torch's internals, or None where they differ from 2.x's.

    torch offers only a process-wide switch (`torch.serialization.set_crc32_options`),
    which would change every other torch.save in the process, training's included.
    """
    save = getattr(torch.serialization, "_save", None)
    writer = getattr(torch._C, "PyTorchFileWriter", None)
    alignment = getattr(torch.serialization, "_get_storage_alignment", None)
    if save is None or writer is None or alignment is None:
        return None
    try:
        params = list(inspect.signature(save).parameters)
    except (TypeError, ValueError):
        return None
    if params != ["obj", "zip_file", "pickle_module", "pickle_protocol", "_disable_byteorder_record"]:
        return None

    def save_without_crc(obj: Any, f: Any) -> None:
        zip_file = writer(f, False, alignment())
        try:
            save(obj, zip_file, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
        except BaseException:
            # Finalise the writer now, as torch.save does on its way out: left to its
            # destructor, finishing the archive on a failed file throws from C++ and
            # aborts the process. The file is discarded anyway; the first error is kept.
            try:
                zip_file.write_end_of_file()
            except Exception as e:  # the original error is the one to report
                log.debug("finishing the abandoned checkpoint archive failed too: %s", e)
            raise
        zip_file.write_end_of_file()
        f.flush()

    return save_without_crc


_save_without_crc = _crc_free_save()


def save_payload(state: Any, f: Any) -> None:
    """`torch.save(state, f)`, the same file format, without torch's crc32 of every record where torch allows.

    The file's sha256 (`HashingWriter`), recorded in the manifest and checked on
    every load, already covers every byte; the crc32 pass cost as much CPU as
    the write itself (0.29 s of a 0.4 GB save). torch.load reads such files as
    any other (it skips the crc of records written without one).
    """
    if _save_without_crc is not None:
        _save_without_crc(state, f)
    else:
        torch.save(state, f)


class StagedFile:
    """A file written under `.tmp-<uuid>` and moved to its name on a clean close.

    The move is an atomic rename on local disks; on object stores it is a copy,
    which is why the manifest, not the move, is the commit. On a local disk the
    file is fsynced before the rename and its directory after, so a committed
    checkpoint survives a crash of the machine, not only of the process.
    """

    def __init__(self, fs: Any, directory: str, name: str) -> None:
        self.fs = fs
        self.tmp = f"{directory}/.tmp-{uuid.uuid4().hex}"
        self.final = f"{directory}/{name}"
        self.local = isinstance(fs, LocalFileSystem)
        self._f: Any = None

    @property
    def fd(self) -> Optional[int]:
        """The open file's descriptor on a local disk (for `HashingWriter`'s early write-out); None elsewhere."""
        return self._f.fileno() if self.local and self._f is not None else None

    def __enter__(self) -> Any:
        self._f = self.fs.open(self.tmp, "wb")
        return self._f

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if exc_type is None:
                if self.local:
                    self._f.flush()
                    os.fsync(self._f.fileno())
                self._f.close()
                self.fs.mv(self.tmp, self.final)
                if self.local:
                    fsync_dir(os.path.dirname(self.final))
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
