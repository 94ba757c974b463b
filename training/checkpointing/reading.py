"""Reading one committed checkpoint directory: its manifest, its files verified against it, and its state.

The state is read whole (replicated state, or every shard merged), as one
rank's shard, or, for a rank of a run at another world size, as that rank's
share of the shards verified with saved rank 0's state elided. `CheckpointStore`
chooses the directory; these functions read it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Optional

from training.checkpointing.errors import CheckpointLayoutError, CheckpointUnusable
from training.checkpointing.files import digest_matches
from training.checkpointing.layout import MANIFEST, PAYLOAD, parse_manifest
from training.checkpointing.safe_load import load_payload
from training.checkpointing.sharding import elide_locals, merge_shards, shard_file


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


def read_manifest(fs: Any, directory: str) -> dict[str, Any]:
    """The parsed manifest of the checkpoint directory at `directory` (an fsspec path on `fs`).

    Raises:
        CheckpointUnusable: the manifest is missing or unreadable.
    """
    try:
        manifest = parse_manifest(fs.cat_file(f"{directory}/{MANIFEST}"))
    except FileNotFoundError as e:
        raise CheckpointUnusable("missing manifest (vanished while reading)") from e
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointUnusable(f"unreadable manifest: {type(e).__name__}: {e}") from e
    return manifest


def verified(fs: Any, directory: str, fname: str, meta: dict[str, Any]) -> bytes:
    """The bytes of file `fname` of the checkpoint directory, checked against its manifest entry `meta`.

    Raises:
        CheckpointUnusable: the file is missing, or its size or checksum differs.
    """
    try:
        data = fs.cat_file(f"{directory}/{fname}")
    except FileNotFoundError as e:
        raise CheckpointUnusable(f"file {fname} listed in the manifest is missing") from e
    if len(data) != meta["size"]:
        raise CheckpointUnusable(
            f"size mismatch for file {fname}: manifest says {meta['size']} bytes, found {len(data)}"
        )
    if not digest_matches(data, meta):
        raise CheckpointUnusable(f"checksum mismatch for file {fname}")
    return data


def load_checkpoint(
    fs: Any, directory: str, uri: str, rank: Optional[int] = None, world_size: Optional[int] = None
) -> LoadedCheckpoint:
    """Verify and load the committed checkpoint at `directory` (URI `uri`); see `CheckpointStore.load` for `rank` and
    `world_size`."""
    manifest = read_manifest(fs, directory)
    world = manifest.get("world_size")
    if world is None:
        # Replicated state: every file is checked, whoever reads it.
        payload = b""
        for fname, meta in sorted(manifest["files"].items()):
            data = verified(fs, directory, fname, meta)
            if fname == PAYLOAD:
                payload = data
        state = load_payload(payload, f"{uri}/{PAYLOAD}")
    elif rank is not None and world_size is not None and world_size != world:
        state = _reshard_view(fs, directory, uri, manifest, rank, world_size)
    elif rank is not None:
        if rank >= world:
            raise CheckpointLayoutError(f"checkpoint {uri} has {world} shards; there is none for rank {rank}")
        fname = shard_file(rank)
        data = verified(fs, directory, fname, manifest["files"][fname])
        state = load_payload(data, f"{uri}/{fname}")
    else:
        # One process reading a sharded checkpoint whole (evaluation, export, tools).
        shards = []
        for r in range(world):
            fname = shard_file(r)
            data = verified(fs, directory, fname, manifest["files"][fname])
            shards.append(load_payload(data, f"{uri}/{fname}"))
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


def _reshard_view(
    fs: Any, directory: str, uri: str, manifest: dict[str, Any], rank: int, world_size: int
) -> dict[str, Any]:
    """A rank of a run at another world size: verify its share of the saved shards, return rank 0's state elided.

    Rank `r` of `world_size` verifies saved shards `r, r + world_size, ...`
    (one file in memory at a time), so together the ranks verify every
    shard before they agree on the checkpoint. The state returned is saved
    rank 0's (loops, schedulers, callbacks) with its DTensor shards dropped
    (`elide_locals`); the strategy reads the tensors again, one shard at a
    time (`iter_shards`), and keeps only its own new region of each.
    """
    world = int(manifest["world_size"])
    state: Optional[dict[str, Any]] = None
    for r in sorted({0, *range(rank, world, world_size)}):
        fname = shard_file(r)
        data = verified(fs, directory, fname, manifest["files"][fname])
        if r == 0:
            state = elide_locals(load_payload(data, f"{uri}/{fname}"))
        del data
    assert state is not None
    return state


def iter_shards(fs: Any, directory: str, uri: str) -> Iterator[dict[str, Any]]:
    """Every rank's state of the sharded checkpoint at `directory`, in rank order, each verified as it is read (one at a
    time).

    Raises:
        CheckpointUnusable: a shard is missing or does not match its checksum.
        CheckpointLayoutError: the checkpoint is not sharded.
    """
    manifest = read_manifest(fs, directory)
    world = manifest.get("world_size")
    if world is None:
        raise CheckpointLayoutError(f"checkpoint {uri} holds replicated state, not shards")
    for r in range(int(world)):
        fname = shard_file(r)
        data = verified(fs, directory, fname, manifest["files"][fname])
        state = load_payload(data, f"{uri}/{fname}")
        del data
        yield state
        del state  # before the next one is read
