"""Sharded checkpoints (FSDP2, tensor parallel): who writes which file, and DTensors as plain data.

Every rank writes its own state, each DTensor as its local shard plus its global
shape and offset (`localize_dtensors`), so a rank resumes from its own file and
one process can reassemble the full state (`merge_shards`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Iterable

import torch

from training.checkpointing.errors import CheckpointError, CheckpointLayoutError, check, is_int

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
        check(
            is_int(self.rank) and 0 <= self.rank < self.world_size,
            "rank",
            self.rank,
            f"an integer in [0, {self.world_size})",
        )
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
        local = obj.to_local()
        shape, offset = region_of(obj)
        if tuple(local.shape) != tuple(shape):
            raise CheckpointError(
                f"DTensor local shard has shape {tuple(local.shape)}, its placements say {tuple(shape)}"
            )
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
        items = [
            merge_shards([s[i] if isinstance(s, (list, tuple)) and len(s) > i else first[i] for s in shards])
            for i in range(len(first))
        ]
        return items if isinstance(first, list) else tuple(items)
    return first


# -- resharding: a rank's new region of a tensor, assembled from the saved pieces -----------------


def elide_locals(obj: Any) -> Any:
    """`obj` with every DTensor marker's local shard dropped (an empty tensor of its dtype, `"elided": True`).

    What a rank keeps of another rank's shard while it reshards: the structure, the
    plain state and each marker's global shape, not the tensors (read again, one
    shard at a time, by `assemble_regions`).
    """
    if is_dtensor_marker(obj):
        return {**obj, "local": torch.empty(0, dtype=obj["local"].dtype), "elided": True}
    if isinstance(obj, dict):
        out = copy.copy(obj)
        out.clear()
        for k, v in obj.items():
            out[k] = elide_locals(v)
        return out
    if isinstance(obj, list):
        return [elide_locals(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(elide_locals(v) for v in obj)
    return obj


def region_of(like: Any) -> tuple[list[int], list[int]]:
    """(local shape, global offset) of the region this rank holds of DTensor `like`, as `localize_dtensors` records it.

    The one use of torch's private `torch.distributed.tensor._utils` (no public API gives the offset);
    `tests/training/test_checkpointing.py::test_region_of_reaches_torchs_private_helper` fails by name if it moves.
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    return [int(n) for n in shape], [int(o) for o in offset]


def fits_region(marker: dict[str, Any], shape: list[int], offset: list[int]) -> bool:
    """Whether a saved marker holds exactly the region `shape` at `offset` (same world size and mesh)."""
    return (
        not marker.get("elided")
        and list(marker["local"].shape) == list(shape)
        and list(marker["offset"]) == list(offset)
    )


class Region:
    """One tensor's new local region, filled from saved pieces (`localize_dtensors` markers) as they arrive.

    Pieces are copied where they intersect the region; a piece seen again at
    the same offset and shape (a replicated placement writes it on several
    ranks) is skipped, and pieces of a DTensor placement are otherwise disjoint,
    so the copied volume tells whether the region is covered.

    Args:
        global_shape: the tensor's full shape, which every saved piece must share.
        shape, offset: the region this rank holds now (from the live DTensor's
            mesh and placements, `compute_local_shape_and_global_offset`).
        dtype: the saved pieces' dtype.
        where: names the tensor in errors.

    Example:
        >>> r = Region([4], [2], [1], torch.float32, "w")
        >>> r.add({DTENSOR: 1, "local": torch.tensor([0.0, 1.0]), "global_shape": [4], "offset": [0]})
        >>> r.add({DTENSOR: 1, "local": torch.tensor([2.0, 3.0]), "global_shape": [4], "offset": [2]})
        >>> r.finish().tolist()
        [1.0, 2.0]
    """

    def __init__(
        self, global_shape: list[int], shape: list[int], offset: list[int], dtype: torch.dtype, where: str
    ) -> None:
        self.global_shape, self.offset, self.where = list(global_shape), list(offset), where
        self.tensor = torch.empty(list(shape), dtype=dtype)
        self.covered = 0
        self._seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()

    def add(self, marker: dict[str, Any]) -> None:
        """Copy the part of a saved piece that falls inside this region."""
        if list(marker["global_shape"]) != self.global_shape:
            raise CheckpointLayoutError(
                f"checkpoint's {self.where} has shape {list(marker['global_shape'])}, the model's {self.global_shape}"
            )
        local, offset = marker["local"], [int(o) for o in marker["offset"]]
        key = (tuple(offset), tuple(local.shape))
        if key in self._seen:
            return
        self._seen.add(key)
        lo = [max(o, m) for o, m in zip(offset, self.offset)]
        hi = [min(o + n, m + k) for o, n, m, k in zip(offset, local.shape, self.offset, self.tensor.shape)]
        if any(h <= b for b, h in zip(lo, hi)):
            return
        dst = tuple(slice(b - m, h - m) for b, h, m in zip(lo, hi, self.offset))
        src = tuple(slice(b - o, h - o) for b, h, o in zip(lo, hi, offset))
        self.tensor[dst] = local[src].to(self.tensor.dtype)
        self.covered += math.prod(h - b for b, h in zip(lo, hi))

    def finish(self) -> torch.Tensor:
        """The assembled region.

        Raises:
            CheckpointLayoutError: the saved pieces do not cover it.
        """
        if self.covered != self.tensor.numel():
            raise CheckpointLayoutError(
                f"the checkpoint's shards of {self.where} cover {self.covered} of the {self.tensor.numel()} values "
                f"this rank holds (shape {list(self.tensor.shape)} at offset {self.offset})"
            )
        return self.tensor


def assemble_regions(
    regions: dict[tuple[Any, ...], Region], shards: Iterable[Any]
) -> dict[tuple[Any, ...], torch.Tensor]:
    """Fill each region from the saved shards, read one at a time; returns `{path: tensor}`.

    `regions` is keyed by each marker's path in a shard's state (keys and list
    indices, e.g. `("state_dict", "fc.weight")`). Each shard is dropped before
    the next is read, so a rank holds its new regions plus one saved shard.

    Raises:
        CheckpointLayoutError: a shard lacks a path, or holds no DTensor there, or
            its global shape differs.
        (also when the shards do not cover a region).
    """
    for shard in shards:
        _add_shard(shard, regions)
        del shard  # before the next one is read
    return {path: region.finish() for path, region in regions.items()}


def _add_shard(shard: Any, regions: dict[tuple[Any, ...], Region]) -> None:
    for path, region in regions.items():
        obj = shard
        for key in path:
            try:
                obj = obj[key]
            except (KeyError, IndexError, TypeError) as e:
                raise CheckpointLayoutError(f"a shard of the checkpoint lacks {region.where}") from e
        if not is_dtensor_marker(obj):
            raise CheckpointLayoutError(f"a shard of the checkpoint holds {region.where} unsharded")
        region.add(obj)
