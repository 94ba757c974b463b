"""Lightning Trainer arguments for a `Distribution`: DDP, FSDP2 and tensor parallel.

- `ddp`: Lightning's `DDPStrategy`; every rank holds the whole model.
- `fsdp`: `ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)`,
  FSDP2 over all ranks.
- `tp`: `ModelParallelStrategy(data_parallel_size=world / tp, tensor_parallel_size=tp)`,
  tensor parallel inside groups of `tp` ranks and FSDP2 across them (2-D when both > 1).

Lightning's `strategy="fsdp"` (FSDP1) refuses CPUs; `ModelParallelStrategy`
(FSDP2 and DTensor) runs on CPU over gloo as well as on GPUs over NCCL, so the
same code path is tested locally and used on the cluster. The model must
inherit `training.parallel.ParallelizableModule` for `fsdp` and `tp`, and give
a tensor parallel plan for `tp`; `check_model_supports` says what is missing
before any compute is spent.

Checkpoints under `fsdp`/`tp` go through the same committed store as DDP
(`training.checkpointing`): with `committed_io` set, every rank writes its own
shard (DTensors as local shards, no gathering) and rank 0 commits; resuming
loads each rank's shard back into the sharded model and optimizer through
`torch.distributed.checkpoint.state_dict` (`restore_sharded`). At another world
size or mesh each rank reshards: it reads the saved shards one at a time and
assembles only its new region of every tensor from their recorded global
shapes and offsets. Without it
the strategy writes Lightning's distributed checkpoint directories, which
`full_state_dict` reads back in one process; `evaluation_model` turns the
trained module into an unsharded one for rank-0 evaluation and export.

A one-process `fsdp` run has nothing to shard and trains like one-process DDP.
"""

from __future__ import annotations

import logging
import pathlib
import time
import warnings
from fnmatch import fnmatch
from typing import IO, Any, Callable, Iterable, Optional, cast

import fsspec
import lightning as L
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    DictValueType,
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle
from typing_extensions import override

from training.checkpointing import (
    DTENSOR,
    CheckpointLayoutError,
    ShardSpec,
    UnsafeCheckpointError,
    is_dtensor_marker,
    load_payload,
    localize_dtensors,
    unpickle_plain,
)
from training.checkpointing.sharding import Region, assemble_regions, fits_region, region_of
from training.errors import StrategyConfigError
from training.parallel import ParallelizableModule
from training.spec import Distribution

log = logging.getLogger("trainyard.training")


def _backend(dist: Distribution) -> str:
    return "gloo" if dist.accelerator == "cpu" else "nccl"


def trainer_kwargs(dist: Distribution, env_world_size: int) -> dict[str, Any]:
    """Trainer keyword arguments (accelerator, devices, num_nodes, strategy) for `dist`.

    Raises:
        StrategyConfigError: the process group launched does not have `dist.world_size` ranks.
    """
    if env_world_size != dist.world_size:
        raise StrategyConfigError(
            f"distribution asks for world size {dist.world_size} ({dist.nodes} nodes x {dist.procs_per_node} "
            f"processes) but this process group has {env_world_size}; launch with torchrun --nproc-per-node "
            f"{dist.procs_per_node}"
        )
    kwargs: dict[str, Any] = {"accelerator": dist.accelerator, "devices": dist.procs_per_node, "num_nodes": dist.nodes}
    if dist.world_size == 1:
        return kwargs
    if dist.strategy == "ddp":
        kwargs["strategy"] = DDPStrategy(process_group_backend=_backend(dist))
    else:
        kwargs["strategy"] = CheckedModelParallelStrategy(dist, process_group_backend=_backend(dist))
    return kwargs


class CheckedModelParallelStrategy(ModelParallelStrategy):
    """`ModelParallelStrategy` for a `Distribution` that refuses a model unable to follow it.

    The check runs in `setup_environment`, on every rank and before the process
    group starts, so a misfit model costs no compute and every rank reports the
    same `StrategyConfigError`.

    Attributes:
        distribution: the distribution this strategy realises.
        data_parallel_size: ranks that see different data (the FSDP2 dimension).
        tensor_parallel_size: ranks that split each layer (the tensor parallel dimension).
    """

    def __init__(self, distribution: Distribution, **kwargs: Any) -> None:
        super().__init__(
            data_parallel_size=distribution.data_parallel_size,
            tensor_parallel_size=distribution.tensor_parallel_size,
            **kwargs,
        )
        self.distribution = distribution
        self.data_parallel_size = distribution.data_parallel_size
        self.tensor_parallel_size = distribution.tensor_parallel_size

        # Set by the entrypoint: checkpoints go through the committed store (one shard per rank).
        self.committed_io: Any = None
        self.shard_token = ""
        self._saves = 0

    @override
    def setup_environment(self) -> None:
        check_model_supports(self.lightning_module, self.distribution)
        super().setup_environment()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if self.committed_io is None:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        self._saves += 1  # saves are collective, so the count (and the token) agrees on every rank
        opts = dict(storage_options or {})
        opts["shard"] = ShardSpec(
            rank=self.global_rank, world_size=self.world_size, token=f"{self.shard_token}:{self._saves}"
        )
        self.committed_io.save_checkpoint(localize_dtensors(checkpoint), filepath, opts)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        if self.committed_io is None:
            return super().load_checkpoint(checkpoint_path, weights_only=True)  # data only, whatever the caller asked
        loaded = self.committed_io.loaded(checkpoint_path)
        state = dict(loaded.state)
        assert self.model is not None
        name = loaded.uri.rstrip("/").rsplit("/", 1)[-1]
        started = time.perf_counter()
        resharded = restore_sharded(self.model, [getattr(o, "_optimizer", o) for o in self.optimizers], state,
                                    lambda: self.committed_io.store.iter_shards(name))
        if resharded and self.global_rank == 0:
            log.info(
                "resharded %d tensors of checkpoint %s from %s ranks to %d in %.2f s (each rank read the %s saved "
                "shards one "
                "at a time and kept its own region)",
                resharded,
                loaded.uri,
                loaded.world_size,
                self.world_size,
                time.perf_counter() - started,
                loaded.world_size,
            )
        return state


def _place(saved: Any, like: Any, where: str, path: tuple[Any, ...], regions: dict[tuple[Any, ...], Region]) -> Any:
    """A saved value for the live `like`: a marker that holds exactly this rank's region as is; any other
    marker becomes a `Region` to assemble from every shard (another world size or mesh); plain values as saved."""
    if not is_dtensor_marker(saved):
        return saved
    if not isinstance(like, DTensor):
        raise CheckpointLayoutError(
            f"checkpoint holds a shard of {where} but the model's {where} is not sharded; resume with a sharded "
            "strategy (fsdp, tp)"
        )
    if list(like.shape) != list(saved["global_shape"]):
        raise CheckpointLayoutError(
            f"checkpoint's {where} has shape {saved['global_shape']}, the model's {list(like.shape)}"
        )
    shape, offset = region_of(like)
    if not fits_region(saved, shape, offset):
        regions[path] = Region(list(like.shape), shape, offset, saved["local"].dtype, where)
    return saved


def _as_dtensor(local: Tensor, like: DTensor) -> DTensor:
    return DTensor.from_local(local.to(like.to_local().device), like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


def restore_sharded(model: nn.Module, optimizers: list[Any], state: dict[str, Any],
                    shards: Optional[Callable[[], Iterable[Any]]] = None) -> int:
    """Load a committed sharded checkpoint into a sharded model and its optimizers, resharding where the layout changed.

    `state` is what `CheckpointStore.load(name, rank=r, world_size=w)` returned
    for this rank (DTensors as `localize_dtensors` markers). A marker that
    holds exactly the region this rank holds now (same world size and mesh) is
    used as it is. Any other (another world size or mesh: the markers of saved
    rank 0's state, elided) is resharded: this rank's new region of that
    tensor, from the live DTensor's mesh and placements (`region_of`), is
    assembled from the pieces of every saved shard at their recorded global
    offsets, reading `shards()` one shard at a time (`assemble_regions`), so a
    rank holds its own new shard plus one saved shard, never the whole model.
    Model weights and optimizer states are then rebuilt as DTensors placed like
    the live parameters and set through `torch.distributed.checkpoint.state_dict`;
    `state` keeps the rest (loops, schedulers, callbacks) and loses `state_dict`
    and `optimizer_states`.

    Returns:
        How many tensors were resharded (0 at the same layout).

    Raises:
        CheckpointLayoutError: the checkpoint does not fit this model (other global
            shapes, missing or unsharded tensors), or needs resharding and `shards` is None.
    """
    live = get_model_state_dict(model)
    saved = state.pop("state_dict")
    missing = sorted(set(live) - set(saved))
    if missing:
        raise CheckpointLayoutError(f"checkpoint lacks model weights {missing[:5]}")
    regions: dict[tuple[Any, ...], Region] = {}
    weights = {k: _place(v, live.get(k), f"weight {k!r}", ("state_dict", k), regions) for k, v in saved.items()}
    osds = state.pop("optimizer_states", [])
    per_optimizer = [
        {
            fqn: {
                k: _place(
                    v,
                    live.get(fqn),
                    f"optimizer {i} state {k!r} of {fqn!r}",
                    ("optimizer_states", i, "state", fqn, k),
                    regions,
                )
                for k, v in values.items()
            }
            for fqn, values in osd["state"].items()
        }
        for i, osd in enumerate(osds)
    ]
    if regions:
        if shards is None:
            raise CheckpointLayoutError(
                f"checkpoint's shards do not match this rank's placement of {next(iter(regions.values())).where} and "
                "no "
                "saved shards were given to reshard from"
            )
        for path, local in assemble_regions(regions, shards()).items():
            assembled = {DTENSOR: 1, "local": local}
            if path[0] == "state_dict":
                weights[path[1]] = assembled
            else:
                per_optimizer[path[1]][path[3]][path[4]] = assembled

    def placed(value: Any, like: Any) -> Any:
        return _as_dtensor(value["local"], like) if is_dtensor_marker(value) else value

    set_model_state_dict(
        model, {k: placed(v, live.get(k)) for k, v in weights.items()}, options=StateDictOptions(strict=True)
    )
    for optimizer, osd, per_param in zip(optimizers, osds, per_optimizer):
        values: DictValueType = {
            fqn: {k: placed(v, live.get(fqn)) for k, v in vs.items()} for fqn, vs in per_param.items()
        }
        set_optimizer_state_dict(model, optimizer, {"state": values, "param_groups": osd["param_groups"]})
    return len(regions)


def _matching_modules(root: nn.Module, fqn: str) -> list[nn.Module]:
    """Submodules `parallelize_module` would apply a plan key to: fnmatch per dotted atom."""
    level = [root]
    for token in fqn.split("."):
        level = [child for m in level for name, child in m.named_children() if fnmatch(name, token)]
    return level


def check_model_supports(model: Any, dist: Distribution) -> None:
    """Raise if `model` cannot be trained with `dist.strategy`.

    `ddp` takes any LightningModule. `fsdp` and `tp` need a subclass of
    `training.parallel.ParallelizableModule`; `tp` also needs a non-empty
    `tensor_parallel_plan()` whose keys name submodules and whose styles apply
    to `nn.Linear` or `nn.Embedding`.

    Raises:
        StrategyConfigError: naming the model class and what it must implement.
    """
    if dist.strategy == "ddp":
        return
    name = type(model).__name__
    if not isinstance(model, ParallelizableModule):
        plan_hint = " and implement tensor_parallel_plan() -> {submodule FQN: ColwiseParallel() | RowwiseParallel()}"
        raise StrategyConfigError(
            f"model {name} does not support strategy {dist.strategy!r}: inherit training.parallel.ParallelizableModule"
            f"{plan_hint if dist.strategy == 'tp' else ''}; or use strategy 'ddp'"
        )
    units = model.fsdp_units()
    members = {id(m) for m in model.modules()}
    for unit in units:
        if unit is model or id(unit) not in members:
            raise StrategyConfigError(
                f"model {name}: fsdp_units() must return proper submodules of the model, got {type(unit).__name__}"
            )
    if dist.strategy != "tp":
        return
    plan = model.tensor_parallel_plan()
    if not plan:
        raise StrategyConfigError(
            f"model {name} does not support strategy 'tp': tensor_parallel_plan() is empty; return "
            "{submodule FQN: ColwiseParallel() | RowwiseParallel()}, e.g. {'mlp.up': ColwiseParallel(), 'mlp.down': "
            "RowwiseParallel()}"
        )
    for fqn, style in plan.items():
        if not isinstance(style, ParallelStyle):
            raise StrategyConfigError(
                f"model {name}: tensor_parallel_plan()[{fqn!r}] is {style!r}, not a ParallelStyle"
            )
        targets = _matching_modules(model, fqn)
        if not targets:
            children = sorted(n for n, _ in model.named_modules() if n)
            raise StrategyConfigError(
                f"model {name}: tensor_parallel_plan() key {fqn!r} matches no submodule; submodules are {children[:20]}"
            )
        for target in targets:
            if not isinstance(target, (nn.Linear, nn.Embedding)):
                raise StrategyConfigError(
                    f"model {name}: tensor_parallel_plan() key {fqn!r} names a {type(target).__name__}; "
                    "ColwiseParallel/RowwiseParallel split nn.Linear or nn.Embedding"
                )


_DCP_METADATA_TYPES = (
    dcp_metadata.Metadata, dcp_metadata.MetadataIndex, dcp_metadata.StorageMeta, dcp_metadata.TensorStorageMetadata,
    dcp_metadata.BytesStorageMetadata, dcp_metadata.ChunkStorageMetadata, dcp_metadata.TensorProperties,
    dcp_metadata._MEM_FORMAT_ENCODING, dcp_filesystem._StorageInfo, pathlib.PurePosixPath, pathlib.PosixPath,
)
"""What a distributed checkpoint's `.metadata` holds: torch's own dataclasses of shapes, dtypes and file offsets."""


class PlainMetadataReader(dcp.FileSystemReader):
    """A distributed checkpoint reader that reads `.metadata` as data (`unpickle_plain`), not with `pickle.load`.

    The tensors themselves torch already reads with `weights_only=True`.
    """

    @override
    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = unpickle_plain(cast(IO[bytes], f), str(path), _DCP_METADATA_TYPES)
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise UnsafeCheckpointError(str(path), f"expected checkpoint metadata, found a {type(metadata).__name__}")
        storage_meta = getattr(metadata, "storage_meta", None) or dcp_metadata.StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


def full_state_dict(checkpoint_path: str) -> dict[str, Tensor]:
    """Full (unsharded, plain CPU tensors) model weights of a Lightning checkpoint.

    Reads a single-file checkpoint (DDP, one process) with `torch.load`, and a
    distributed checkpoint directory (`fsdp`/`tp`) with
    `torch.distributed.checkpoint.load(..., no_dist=True)`, which assembles every
    rank's shards in this process. No collectives: rank 0 may call it alone
    after the other ranks have finished. Both are read as data: a file holding
    pickled code raises `UnsafeCheckpointError` and none of it runs.
    """
    fs, path = fsspec.core.url_to_fs(checkpoint_path)
    if not fs.isdir(path):
        with fs.open(path, "rb") as f:
            return load_payload(f.read(), checkpoint_path)["state_dict"]
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if "file" not in protocols:
        raise ValueError(
            f"distributed checkpoint {checkpoint_path!r}: only local (or mounted) directories can be read back"
        )
    prefix = "state_dict."
    reader = PlainMetadataReader(path)
    metadata = reader.read_metadata()
    # Lightning saves {"state_dict": model weights, "optimizer_0": ...}; DCP flattens the
    # nesting into dotted keys. Allocate the weights only, at their full (global) shapes.
    state = {
        key[len(prefix) :]: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    if not state:
        raise ValueError(f"distributed checkpoint {checkpoint_path!r} holds no model weights (no 'state_dict.*' keys)")
    wrapped = {"state_dict": state}
    with warnings.catch_warnings():
        # "torch.distributed is ... uninitialized, assuming ... a single process": exactly the intent.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(wrapped, storage_reader=reader, no_dist=True)
    return wrapped["state_dict"]


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter of `model` is a DTensor (sharded by FSDP2 or tensor parallel)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def evaluation_model(
    model: L.LightningModule, checkpoint_path: str, rebuild: Callable[[], L.LightningModule]
) -> L.LightningModule:
    """An unsharded model holding the weights of `checkpoint_path`, for evaluation and export in one process.

    `model` itself when it is unsharded (DDP, one process); otherwise a fresh
    instance from `rebuild()` (same class and hyperparameters), since a module
    holding DTensors cannot run without its process group.

    Args:
        model: the module that was trained.
        checkpoint_path: a checkpoint written by `ModelCheckpoint` under any strategy.
        rebuild: builds an unsharded model like the trained one.
    """
    state = full_state_dict(checkpoint_path)
    target = rebuild() if is_sharded(model) else model
    target.load_state_dict(state)
    return target
