"""Sharded checkpoints (FSDP2, tensor parallel): who writes which file, and DTensors as plain data.

Every rank writes its own state, each DTensor as its local shard plus its global
shape and offset (`localize_dtensors`), so a rank resumes from its own file and
one process can reassemble the full state (`merge_shards`).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from training.checkpointing.errors import CheckpointError, check, is_int

DTENSOR = "__trainyard_dtensor__"


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
        check(is_int(self.world_size) and self.world_size >= 1, "world_size", self.world_size, "an integer >= 1")
        check(is_int(self.rank) and 0 <= self.rank < self.world_size, "rank", self.rank, f"an integer in [0, {self.world_size})")
        check(isinstance(self.token, str) and self.token != "", "token", self.token, "a non-empty string")


def shard_file(rank: int) -> str:
    """The name of the file holding `rank`'s state in a sharded checkpoint."""
    return f"shard-{rank:05d}.pt"


def sidecar_file(rank: int) -> str:
    """The name of `rank`'s sidecar: its shard's hash, size and the save's token."""
    return f"shard-{rank:05d}.json"


def localize_dtensors(obj: Any) -> Any:
    """`obj` with every DTensor replaced by a marker holding its local shard and where it sits.

    Marker: `{DTENSOR: 1, "local": tensor, "global_shape": [...], "offset": [...]}`,
    plain data that loads with `weights_only=True`. Containers are rebuilt
    (dicts keep their type); other leaves are shared, not copied.
    """
    # Imported here: torch.distributed.tensor adds about a second to the import, and
    # only sharded (fsdp/tp) saves need it, not the replicated store's users.
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
    """Whether `obj` is a marker `localize_dtensors` put in place of a DTensor."""
    return isinstance(obj, dict) and obj.get(DTENSOR) == 1 and "local" in obj


def _merge_tensor(parts: list[dict[str, Any]]) -> torch.Tensor:
    first = parts[0]
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
        return _merge_tensor(parts)
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
