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

Checkpoints under `fsdp`/`tp` are distributed (a directory, one shard file per
rank, written without gathering); `full_state_dict` reads full weights back in
one process, and `evaluation_model` turns the trained module into an
unsharded one for rank-0 evaluation and export.

A one-process `fsdp` run has nothing to shard and trains like one-process DDP.
"""

from __future__ import annotations

import warnings
from fnmatch import fnmatch
from typing import TYPE_CHECKING, Any, Callable

from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from typing_extensions import override

from training.errors import ConfigError
from training.spec import Distribution

if TYPE_CHECKING:
    import lightning as L
    from torch import Tensor, nn


class StrategyConfigError(ConfigError):
    """The distribution cannot run in this process group or with this model; retrying cannot help.

    A `ConfigError`, so the entrypoint exits with `EXIT_BAD_CONFIG` wherever it is raised.
    """


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
            f"processes) but this process group has {env_world_size}; launch with torchrun --nproc-per-node {dist.procs_per_node}"
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

    @override
    def setup_environment(self) -> None:
        check_model_supports(self.lightning_module, self.distribution)
        super().setup_environment()


def _matching_modules(root: "nn.Module", fqn: str) -> list["nn.Module"]:
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
    from torch import nn
    from torch.distributed.tensor.parallel import ParallelStyle

    from training.parallel import ParallelizableModule

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
            raise StrategyConfigError(f"model {name}: fsdp_units() must return proper submodules of the model, got {type(unit).__name__}")
    if dist.strategy != "tp":
        return
    plan = model.tensor_parallel_plan()
    if not plan:
        raise StrategyConfigError(
            f"model {name} does not support strategy 'tp': tensor_parallel_plan() is empty; return "
            "{submodule FQN: ColwiseParallel() | RowwiseParallel()}, e.g. {'mlp.up': ColwiseParallel(), 'mlp.down': RowwiseParallel()}"
        )
    for fqn, style in plan.items():
        if not isinstance(style, ParallelStyle):
            raise StrategyConfigError(f"model {name}: tensor_parallel_plan()[{fqn!r}] is {style!r}, not a ParallelStyle")
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


def full_state_dict(checkpoint_path: str) -> dict[str, "Tensor"]:
    """Full (unsharded, plain CPU tensors) model weights of a Lightning checkpoint.

    Reads a single-file checkpoint (DDP, one process) with `torch.load`, and a
    distributed checkpoint directory (`fsdp`/`tp`) with
    `torch.distributed.checkpoint.load(..., no_dist=True)`, which assembles every
    rank's shards in this process. No collectives: rank 0 may call it alone
    after the other ranks have finished.
    """
    import fsspec
    import torch

    fs, path = fsspec.core.url_to_fs(checkpoint_path)
    if not fs.isdir(path):
        with fs.open(path, "rb") as f:
            return torch.load(f, map_location="cpu", weights_only=True)["state_dict"]
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if "file" not in protocols:
        raise ValueError(f"distributed checkpoint {checkpoint_path!r}: only local (or mounted) directories can be read back")
    prefix = "state_dict."
    metadata = dcp.FileSystemReader(path).read_metadata()
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
        dcp.load(wrapped, checkpoint_id=path, no_dist=True)
    return wrapped["state_dict"]


def is_sharded(model: "nn.Module") -> bool:
    """Whether any parameter of `model` is a DTensor (sharded by FSDP2 or tensor parallel)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def evaluation_model(model: "L.LightningModule", checkpoint_path: str, rebuild: Callable[[], "L.LightningModule"]) -> "L.LightningModule":
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
