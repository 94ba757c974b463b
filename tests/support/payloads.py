"""Malicious pickles for the safe-loading tests: unpickling one creates a marker file.

A loader that runs pickled code leaves the marker behind; a safe loader refuses
the file and the marker never appears. `run_payload` is the control: it loads
the same bytes the unsafe way, so a test shows its payload is live.
"""

from __future__ import annotations

import io
import os
import shlex
import zipfile
from pathlib import Path
from typing import Any

import torch


class TouchOnUnpickle:
    """Unpickling this runs `touch <marker>` through `os.system`."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


def torch_payload(marker: Path, state: Any = None) -> bytes:
    """`torch.save` bytes of `state` (a dict, default empty) with the payload under the key `"payload"`."""
    buffer = io.BytesIO()
    torch.save({**(state or {}), "payload": TouchOnUnpickle(marker)}, buffer)
    return buffer.getvalue()


def run_payload(data: bytes) -> None:
    """The control: load `data` as an unsafe loader would (`weights_only=False`), running any payload."""
    torch.load(io.BytesIO(data), weights_only=False)


def rewrite_zip(path: Path, replace: dict[str, bytes]) -> None:
    """Rewrite the zip archive at `path` with members (paths below its root folder) replaced or added."""
    with zipfile.ZipFile(path) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    root = next(iter(members)).split("/", 1)[0]
    members.update({f"{root}/{name}": body for name, body in replace.items()})
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for name, body in members.items():
            archive.writestr(name, body)
