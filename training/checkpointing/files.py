"""Writing one checkpoint file on any fsspec filesystem: staged under a temporary name, hashed on the way."""

from __future__ import annotations

import hashlib
import logging
import os
import uuid
from typing import Any

from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractBufferedFile

from training.atomic import fsync_dir

log = logging.getLogger("trainyard.training.checkpointing")


class HashingWriter:
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
        self._f: Any = None

    def __enter__(self) -> Any:
        self._f = self.fs.open(self.tmp, "wb")
        return self._f

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if exc_type is None:
                local = isinstance(self.fs, LocalFileSystem)
                if local:
                    self._f.flush()
                    os.fsync(self._f.fileno())
                self._f.close()
                self.fs.mv(self.tmp, self.final)
                if local:
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
