"""Whole small files at fsspec URIs (local paths, `s3://`, `memory://`), for pod-side records.

Writes are atomic for readers, who see the old content or the new, never a part:
a local file goes through `common.atomic` (temporary name, fsync, rename); any
other filesystem gets the whole content in one PUT, which object stores already
make atomic. Stdlib and fsspec only, so GBT trials import it without torch.

Example:
    >>> write_atomic("memory://trial/state.json", b"{}")
    >>> read_text("memory://trial/state.json")
    '{}'
"""

from __future__ import annotations

from typing import Optional

import fsspec
from fsspec.implementations.local import LocalFileSystem

from common.atomic import atomic_write_bytes


def join(uri: str, *parts: str) -> str:
    """`uri` with `parts` appended, one `/` between each (no normalisation, works for any scheme)."""
    return "/".join([uri.rstrip("/"), *parts])


def write_atomic(uri: str, data: bytes, *, fsync: bool = True) -> None:
    """Replace the content of `uri` with `data`, atomically for readers; parent folders are created.

    Args:
        uri: A local path or any fsspec URI.
        data: The whole new content.
        fsync: For local files, flush to disk before the rename (see `common.atomic.atomic_path`).
    """
    fs, path = fsspec.core.url_to_fs(uri)
    if isinstance(fs, LocalFileSystem):
        atomic_write_bytes(path, data, fsync=fsync)
        return
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(path, data)


def read_text(uri: str) -> Optional[str]:
    """The content of `uri` as text, or None when it does not exist."""
    fs, path = fsspec.core.url_to_fs(uri)
    if not fs.exists(path):
        return None
    with fs.open(path, "r") as f:
        return f.read()
