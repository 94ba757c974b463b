"""Committed checkpoints on any fsspec filesystem, an asynchronous writer, RNG capture.

Every layer of fault tolerance (torchrun, the Job, Dagster's retry) resumes from
the newest *committed* checkpoint. Layout under the root (a local path or
`s3://bucket/prefix`)::

    <root>/step-000000012/state.pt        payload, written as `.tmp-<uuid>` and moved into place
    <root>/step-000000012/MANIFEST.json   written last, the same way: the commit marker

A step directory without `MANIFEST.json` is partial and never loaded. A
committed one whose files do not match the sizes and hashes in its manifest is
skipped with a warning and the previous one is used. Every byte is hashed as it is
written and verified on every load: a tree of sha256 over 16 MiB leaves, hashed in
parallel (`files.LEAF`; manifests of format 1 carry a plain sha256, still verified).

Replicated state (DDP, one process): rank 0 writes `state.pt`. Sharded state
(FSDP2, tensor parallel: parameters and optimizer states are DTensors) is
written by every rank at once, without gathering::

    <root>/step-000000012/shard-00001.pt    rank 1's own state: each DTensor as its local shard
    <root>/step-000000012/shard-00001.json  rank 1's sidecar: hash, size and the save's token
    <root>/step-000000012/MANIFEST.json     rank 0 writes it once every rank's sidecar carries this save's token

Each DTensor is stored as its local tensor plus its global shape and offset
(`localize_dtensors`), so a rank resumes from its own file (same world size and
mesh) and one process can reassemble the full state (`merge_shards`) for
evaluation, export and tools. `load(name, rank=r)` verifies only rank r's file;
ranks agree on which checkpoint to use (see `training.entrypoint`).

Readers may be any number of processes.

Modules: `store` (`CheckpointStore`), `layout` (names and the manifest),
`files` (staged, hashed writes), `sharding` (`ShardSpec`, DTensors as plain
data), `writer` (`AsyncCheckpointWriter`, `young_daly_interval`), `rng`
(`rng_state`), `safe_load` (checkpoint files are read as data, never as code:
torch's weights-only unpickler, `UnsafeCheckpointError` for anything else), `errors`.

Example:
    >>> import tempfile
    >>> store = CheckpointStore(tempfile.mkdtemp(), keep_last=2)
    >>> uri = store.save(100, {"weights": torch.zeros(2), "rng": rng_state()}, metrics={"val_acc": 0.9}, best=True)
    >>> resumed = store.latest()
    >>> resumed.step, resumed.metrics
    (100, {'val_acc': 0.9})
    >>> set_rng_state(resumed.state["rng"])
"""

from training.checkpointing.errors import (
    CheckpointError,
    CheckpointLayoutError,
    CheckpointUnusable,
    CheckpointWriteError,
    SkippedCheckpointWarning,
)
from training.checkpointing.layout import FORMAT_VERSION, MANIFEST, PAYLOAD
from training.checkpointing.reading import LoadedCheckpoint
from training.checkpointing.rng import rng_state, set_rng_state
from training.checkpointing.safe_load import CheckpointStateError, UnsafeCheckpointError, load_payload, unpickle_plain
from training.checkpointing.sharding import (
    DTENSOR,
    ShardSpec,
    is_dtensor_marker,
    localize_dtensors,
    merge_shards,
    shard_file,
)
from training.checkpointing.store import CheckpointStore
from training.checkpointing.writer import (
    AsyncCheckpointWriter,
    HostBuffers,
    deferrable_storages,
    snapshot_to_cpu,
    storage_key,
    young_daly_interval,
)

__all__ = [
    "DTENSOR",
    "FORMAT_VERSION",
    "MANIFEST",
    "PAYLOAD",
    "AsyncCheckpointWriter",
    "CheckpointError",
    "CheckpointLayoutError",
    "CheckpointStateError",
    "CheckpointStore",
    "CheckpointUnusable",
    "CheckpointWriteError",
    "HostBuffers",
    "LoadedCheckpoint",
    "ShardSpec",
    "SkippedCheckpointWarning",
    "UnsafeCheckpointError",
    "deferrable_storages",
    "is_dtensor_marker",
    "load_payload",
    "localize_dtensors",
    "merge_shards",
    "rng_state",
    "set_rng_state",
    "shard_file",
    "snapshot_to_cpu",
    "storage_key",
    "unpickle_plain",
    "young_daly_interval",
]
