"""One landing file read into its *part*: the file's rows cast to the declared columns, as an Arrow IPC file in the
store.

`ingest_file` streams a landing file (pyarrow readers, one block at a time),
writes its part, checks that the file did not change while it was read
(`LandingFileChanged` when it did) and records what it found, quarantining a
file with issues. A part is named by the file's URI, its state and `schema_key`
(how landing files are read), so a file already read in that state is not read
again. `trainyard.data.ingest` makes the snapshot from the parts.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from typing import Iterator, Optional

import pyarrow as pa

from trainyard import naming
from trainyard.data.canonical import canonical_schema
from trainyard.data.landing import READ_BLOCK_BYTES, BadFile, FileReader
from trainyard.data.quarantine import quarantine_file, resolve_file_entry, utc_now
from trainyard.data.records import FileRecord
from trainyard.data.sources import landing_spec
from trainyard.spec import PipelineSpec
from trainyard.store import FileInfo, FileStore, StorageError, local_writes


class LandingFileChanged(Exception):
    """A landing file changed while it was read. Retryable: it is taken as still being written."""


def schema_key(spec: PipelineSpec) -> str:
    """Hash of how landing files are read: the stored columns and types (a Feast source's: its entity columns), a
    sharded pipeline's reading settings, and the missing-value tokens when not the default; parts made for other
    declarations are re-read."""
    key = str(canonical_schema(landing_spec(spec)))
    if spec.shards is not None:
        # How a sharded pipeline's files are read: its kind, the JSON lines' fields, the labels
        # (trainyard.data.shard_landing).
        key += "\0shards=" + repr(spec.shards.model_dump(include={"kind", "text_field", "tokens_field", "labels"}))
    if spec.source.missing_values != [""]:
        key += f"\0missing={spec.source.missing_values!r}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _part_uri(store: FileStore, spec: PipelineSpec, info: FileInfo, key: str) -> str:
    digest = hashlib.sha256(f"{info.uri}\0{info.identity}\0{key}".encode()).hexdigest()[:24]
    return naming.ingest_part(store, spec.team, spec.name, digest)


def _write_part(reader: FileReader, schema: pa.Schema, path: str) -> None:
    """Write the file's canonical batches as an LZ4-compressed Arrow IPC file (fast to write and read back)."""
    import pyarrow.ipc as ipc

    with ipc.new_file(path, schema, options=ipc.IpcWriteOptions(compression="lz4")) as writer:
        for batch in reader.batches():
            writer.write_batch(batch)


def iter_part(store: FileStore, uri: str) -> Iterator[pa.RecordBatch]:
    """The record batches of a part, one at a time."""
    import pyarrow.ipc as ipc

    with store.open(uri, "rb") as f:
        reader = ipc.open_file(f)
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)


def ingest_file(
    store: FileStore,
    spec: PipelineSpec,
    info: FileInfo,
    block_bytes: int = READ_BLOCK_BYTES,
    digest: Optional[str] = None,
) -> FileRecord:
    """Read one landing file into a part in the object store, or decide why it cannot be.

    The file's state is checked after reading: if its size, mtime or etag
    moved, nothing is recorded and `LandingFileChanged` is raised. Under
    "reject" any issue rejects the file, but for values that parse and break
    a column rule (missing, out of range or domain, non-finite), which
    validation judges; under "warn" only fatal ones do. A file rejected or
    with such issues is copied to quarantine with a report of all of them.

    Raises:
        LandingFileChanged: The file changed while it was read.
    """
    key = schema_key(spec)
    part = _part_uri(store, spec, info, key)
    with tempfile.TemporaryDirectory(prefix="trainyard-ingest-") as tmp:
        local = os.path.join(tmp, "part.arrow")
        # Small blocks keep memory low; a row longer than a block needs bigger ones.
        for block in (block_bytes, block_bytes * 16, block_bytes * 256):
            reader = FileReader(store, info, spec, block)
            try:
                with local_writes("write the part of", local):
                    _write_part(reader, canonical_schema(spec), local)
                bad = None
            except BadFile as e:
                bad = e.issue
            except StorageError as e:
                raise vanished(store, info, e) from e
            if bad is None or "straddl" not in bad.message:
                break
        after = store.stat(info.uri) if store.exists(info.uri) else None
        if after is None or after.identity != info.identity:
            raise LandingFileChanged(
                f"{info.uri} changed while being read (size/mtime/etag {info.identity} before, "
                f"{None if after is None else after.identity} after); it is ingested once it stops changing"
            )
        issues = [*([bad] if bad else []), *reader.issues]
        # Values that parse but break a column rule are listed here with their lines; validation judges them.
        rejected = bad is not None or (spec.on_bad_data == "reject" and any(i.blocking for i in issues))
        if not rejected:
            store.put_file(local, part)
    record = FileRecord(
        uri=info.uri,
        size=info.size,
        mtime=info.mtime,
        etag=info.etag,
        status="rejected" if rejected else "accepted",
        rows=0 if rejected else reader.rows,
        part=None if rejected else part,
        schema_key=key,
        issues=issues,
        ingested_at=utc_now(),
        content_hash=digest,
        missing={} if rejected else dict(reader.missing),
    )
    if rejected or any(i.blocking for i in issues):
        record.quarantine = quarantine_file(store, spec, info, [i.model_dump() for i in issues], record.status, digest)
    else:
        resolve_file_entry(store, spec, info.uri, "accepted without issues")
    return record


def vanished(store: FileStore, info: FileInfo, error: StorageError) -> Exception:
    """`LandingFileChanged` (retryable) when the file was removed or replaced since it was listed; else `error`
    itself."""
    try:
        after = store.stat(info.uri) if store.exists(info.uri) else None
    except StorageError:
        after = None
    if after is None:
        return LandingFileChanged(
            f"{info.uri} changed while being read: it was removed after the landing area was listed; the next run "
            "sees the landing area without it"
        )
    if after.identity != info.identity:
        return LandingFileChanged(
            f"{info.uri} changed while being read ({error}); it is ingested once it stops changing"
        )
    return error
