"""Names under a checkpoint root and the manifest format: what makes a step directory committed.

    <root>/step-000000012/state.pt        replicated state, or shard-<rank>.pt (+ .json sidecar) per rank
    <root>/step-000000012/MANIFEST.json   written last: the commit marker, with every file's hash and size

A file's hash is `sha256_tree` (format 2: sha256 of each `leaf_bytes` piece, then of
those digests; `training.checkpointing.files.LEAF`); manifests of format 1 carry the
plain `sha256` of the whole file instead, and still load.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Any, Optional

from training.checkpointing.sharding import shard_file

MANIFEST = "MANIFEST.json"
PAYLOAD = "state.pt"
FORMAT_VERSION = 2
STEP_DIR = re.compile(r"step-(\d{9,})")


def step_dir(step: int) -> str:
    """The directory name of the checkpoint of `step`, e.g. `step-000000012`."""
    return f"step-{step:09d}"


def manifest_bytes(
    *,
    step: int,
    epoch: int,
    created: float,
    metrics: dict[str, float],
    best: bool,
    files: dict[str, Any],
    world_size: Optional[int],
) -> bytes:
    """The manifest committing a checkpoint: its step, metrics and every file's hash and size.

    Args:
        created: Wall-clock seconds since the epoch, recorded as number and ISO time.
        world_size: Ranks that wrote a sharded checkpoint; None for replicated state.
    """
    manifest: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "epoch": epoch,
        "created_unix": created,
        "created": datetime.fromtimestamp(created, UTC).isoformat(),
        "metrics": metrics,
        "best": bool(best),
        "files": files,
    }
    if world_size is not None:
        manifest["world_size"] = world_size
    return json.dumps(manifest, indent=2, sort_keys=True).encode()


def parse_manifest(data: bytes) -> dict[str, Any]:
    """The manifest in `data`, checked to list the files its layout needs.

    Raises:
        ValueError: not JSON, or a field is missing or of the wrong type (also
            `KeyError`/`TypeError` from a malformed table); the message says which.
    """
    manifest = json.loads(data)
    files = manifest["files"]
    if not isinstance(manifest["step"], int) or not isinstance(files, dict):
        raise ValueError("needs an integer step and a files table")
    world = manifest.get("world_size")
    expected = {PAYLOAD} if world is None else {shard_file(r) for r in range(world)}
    if not expected <= set(files):
        raise ValueError(f"files must list {sorted(expected)[:3]}{'...' if len(expected) > 3 else ''}")
    for meta in files.values():
        if not isinstance(meta["size"], int):
            raise ValueError("each file needs an integer size")
        if "sha256_tree" in meta:
            leaf = meta.get("leaf_bytes")
            # A floor on the leaf keeps a doctored manifest from making verification slice a file byte by byte.
            if (
                not isinstance(meta["sha256_tree"], str)
                or not isinstance(leaf, int)
                or isinstance(leaf, bool)
                or leaf < 4096
            ):
                raise ValueError("a sha256_tree needs a string digest and an integer leaf_bytes >= 4096")
        elif not isinstance(meta["sha256"], str):
            raise ValueError("each file needs a sha256_tree (or, format 1, a sha256) string")
    return manifest
