"""The one atomic-write helper for local files: readers see the old content or the new, never a part.

A file is written to a temporary name beside its destination (same directory,
so the same filesystem), flushed and fsynced, then moved into place with
`os.replace`; on any failure the temporary file is removed and the destination
is untouched. Callers that write through other means (pyarrow, shutil, torch)
use `atomic_path` and write to the path it yields.

It lives in `common/`, the bottom package every layer may import: the
orchestrator (data versions, the warm servers' locks) and the pod (results,
checkpoints) both write local files. Object stores (S3) need none of this: a
single PUT is already atomic (see `trainyard.store`).

Example:
    >>> import os, tempfile
    >>> target = os.path.join(tempfile.mkdtemp(), "sub", "value.json")
    >>> atomic_write_bytes(target, b"{}")
    >>> open(target, "rb").read()
    b'{}'
"""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import Iterator


def fsync_dir(directory: str) -> None:
    """Flush a directory's entries (a rename into it) to disk; a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. a platform without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str, *, fsync: bool = True) -> Iterator[str]:
    """Yield a temporary path beside `path`; on a clean exit move it into place.

    Args:
        path: The destination; its directory is created when missing.
        fsync: Flush the written file and its directory to disk, so a crash
            right after the rename cannot leave an empty file under the final name.

    Raises:
        FileNotFoundError: The body did not create the temporary file.
    """
    path = os.path.abspath(path)
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex}")
    try:
        yield tmp
        if fsync:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
        if fsync:
            fsync_dir(directory)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


@contextlib.contextmanager
def exclusive_lock(path: str) -> Iterator[None]:
    """Hold an exclusive `flock` on the file `path` (created when missing) for the body: one holder per machine at a
    time.

    Used where processes share a local resource: concurrent DVC pins in one
    repository (`resources.versioning`), the start of a warm worker server
    (`resources.warm`).
    """
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def atomic_write_bytes(path: str, data: bytes, *, fsync: bool = True) -> None:
    """Write `data` to `path` atomically (see `atomic_path`)."""
    with atomic_path(path, fsync=fsync) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
