"""What is installed on a set of import paths, cheaply: one entry per distribution's metadata, for warm processes to key
on.

A warm process (the trial server, the run-worker zygote) keeps the code it imported; after a `pip install` or `uv pip
install` of a changed library it would go on forking old code. The installers always replace a distribution's
metadata directory (`<name>-<version>.dist-info`, or an `.egg-info`/`.egg-link` for older ones) and `.pth` files
as they replace its files, so the name, inode and modification time of those entries in each directory on the path
change with every install, upgrade, reinstall or removal: `snapshot` lists them (a directory listing per path
entry, ~1 ms for a virtualenv of 400 distributions), `changed` names the first that differs.
"""

from __future__ import annotations

import hashlib
import os
from typing import Iterable, Optional

METADATA_SUFFIXES = (".dist-info", ".egg-info", ".egg-link", ".pth")

Snapshot = dict[str, tuple[int, int]]


def snapshot(paths: Iterable[str]) -> Snapshot:
    """(inode, mtime_ns) of every distribution metadata entry in the directories `paths` (missing ones skipped), by
    path."""
    entries: Snapshot = {}
    for directory in dict.fromkeys(os.path.realpath(p) for p in paths if p):
        try:
            with os.scandir(directory) as it:
                for entry in it:
                    if entry.name.endswith(METADATA_SUFFIXES):
                        try:
                            st = entry.stat()
                        except OSError:
                            continue
                        entries[entry.path] = (st.st_ino, st.st_mtime_ns)
        except (NotADirectoryError, FileNotFoundError, PermissionError):
            continue
    return entries


def changed(before: Snapshot, paths: Iterable[str]) -> Optional[str]:
    """The first metadata entry installed, removed or replaced on `paths` since `before` was taken; None when none."""
    now = snapshot(paths)
    for path in sorted(before.keys() | now.keys()):
        if before.get(path) != now.get(path):
            return path
    return None


def fingerprint(paths: Iterable[str]) -> str:
    """A short hash of `snapshot(paths)`: equal while nothing was installed, upgraded or removed there."""
    h = hashlib.sha256()
    for path, (ino, mtime) in sorted(snapshot(paths).items()):
        h.update(f"{path}\0{ino}\0{mtime}\0".encode())
    return h.hexdigest()[:16]
