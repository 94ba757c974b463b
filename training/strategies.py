"""Lightning Trainer arguments for a `Distribution`: DDP, FSDP2 and tensor parallel."""

from __future__ import annotations

from typing import Any

from training.spec import Distribution


class StrategyConfigError(ValueError):
    """The distribution cannot run in this process group."""


def trainer_kwargs(dist: Distribution, env_world_size: int) -> dict[str, Any]:
    """Trainer keyword arguments (accelerator, devices, num_nodes, strategy) for `dist`."""
    if env_world_size != dist.world_size:
        raise StrategyConfigError(
            f"distribution asks for world size {dist.world_size} ({dist.nodes} nodes x {dist.procs_per_node} "
            f"processes) but this process group has {env_world_size}; launch with torchrun --nproc-per-node {dist.procs_per_node}"
        )
    if dist.strategy != "ddp":
        raise StrategyConfigError(f"distribution.strategy {dist.strategy!r} is not available in this release; use 'ddp'")
    kwargs: dict[str, Any] = {"accelerator": dist.accelerator, "devices": dist.procs_per_node, "num_nodes": dist.nodes}
    if dist.world_size > 1:
        from lightning.pytorch.strategies import DDPStrategy

        kwargs["strategy"] = DDPStrategy(process_group_backend="gloo" if dist.accelerator == "cpu" else "nccl")
    return kwargs
