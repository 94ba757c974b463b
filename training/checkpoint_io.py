"""`StoreCheckpointIO`: a Lightning CheckpointIO plugin that commits checkpoints through `CheckpointStore`.

The store gives a temp name, checksums, the manifest last and retention; the
writes go through `AsyncCheckpointWriter` when asked. `training.fault_tolerance`
decides when to save; this plugin is how the Trainer's checkpoints reach the store.
"""

from __future__ import annotations

import time
from typing import Any, Optional, TypedDict

from lightning.fabric.plugins import CheckpointIO
from typing_extensions import override

from training.checkpointing import AsyncCheckpointWriter, CheckpointStore, LoadedCheckpoint, ShardSpec


class _SaveOptions(TypedDict, total=False):
    """Keyword arguments of `CheckpointStore.save` that `StoreCheckpointIO` passes on."""

    epoch: int
    metrics: dict[str, float]
    best: bool
    shard: ShardSpec


class StoreCheckpointIO(CheckpointIO):
    """Lightning checkpoint IO backed by the committed-checkpoint store.

    `storage_options` of `trainer.save_checkpoint` carries `best`, `metrics` and
    `sync` (wait for the write, e.g. on preemption) and `defer` (storages the
    writer may copy after training goes on, `deferrable_storages`; the caller
    then fences before the next optimizer step); the sharded strategy adds
    `shard` (a `ShardSpec`). Under DDP only rank 0 saves; under fsdp/tp every rank does.
    """

    def __init__(self, store: CheckpointStore, async_save: bool = True) -> None:
        self.store = store
        self.writer = AsyncCheckpointWriter(store) if async_save else None
        self.blocking_seconds = 0.0
        self.sync_save_seconds: list[float] = []
        self.saves = 0
        self._loaded: dict[str, LoadedCheckpoint] = {}

    def remember(self, loaded: LoadedCheckpoint) -> str:
        """Make a checkpoint loaded (and verified) by the store available to `load_checkpoint`."""
        self._loaded[loaded.uri] = loaded
        return loaded.uri

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        opts = dict(storage_options or {})
        step, epoch = int(checkpoint["global_step"]), int(checkpoint["epoch"])
        kwargs: _SaveOptions = {
            "epoch": epoch,
            "metrics": opts.get("metrics") or {},
            "best": bool(opts.get("best", False)),
        }
        if opts.get("shard") is not None:
            kwargs["shard"] = opts["shard"]  # sharded state: every rank writes its part, rank 0 commits
        started = time.perf_counter()
        if self.writer is not None and not opts.get("sync"):
            self.writer.submit(step, checkpoint, defer=opts.get("defer"), **kwargs)
        else:
            if self.writer is not None:
                self.writer.wait()
            self.store.save(step, checkpoint, **kwargs)
            self.sync_save_seconds.append(time.perf_counter() - started)
        self.blocking_seconds += time.perf_counter() - started
        self.saves += 1

    def loaded(self, path: Any) -> LoadedCheckpoint:
        """The checkpoint `remember` made available under `path`."""
        if str(path) not in self._loaded:
            raise FileNotFoundError(
                f"checkpoint {path} was not selected by the store; resume through CheckpointStore.latest()"
            )
        return self._loaded[str(path)]

    @override
    def load_checkpoint(
        self, path: Any, map_location: Optional[Any] = None, weights_only: Optional[bool] = None
    ) -> dict[str, Any]:
        return self.loaded(path).state

    @override
    def remove_checkpoint(self, path: Any) -> None:
        """Retention belongs to the store (last K plus best)."""

    def last_save_seconds(self) -> Optional[float]:
        if self.writer is not None and self.writer.save_seconds:
            return self.writer.save_seconds[-1]
        return self.sync_save_seconds[-1] if self.sync_save_seconds else None

    @override
    def teardown(self) -> None:
        if self.writer is not None:
            self.writer.close()
