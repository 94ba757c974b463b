"""Incremental ingestion of landing files into canonical Parquet snapshots, in bounded memory.

A pipeline's landing area is a local directory or `s3://` prefix with CSV,
Parquet or JSON-lines files matching its globs. `ingest` makes the pipeline's
next snapshot from it:

1. list the landing files with their size, mtime and etag;
2. for each file the manifest does not know in that exact state, stream it
   (pyarrow readers, one block at a time), cast it to the declared columns
   and write it as an Arrow IPC *part* in the object store; files already
   ingested are not read again;
3. check the file's size, mtime and etag after reading: a file that changed
   while being read is not ingested (it is taken as still being written);
4. the snapshot is the union of the accepted parts of the files now in the
   landing area, in order of landing URI, written as canonical Parquet one
   row group at a time. Equal landing files therefore give equal bytes and an
   equal DVC md5, however many runs they arrived over. A file removed from
   the landing area leaves the snapshot: removing a bad file is how a
   rejected data version is replaced (its part stays in the store, so the
   file coming back is not read again);
5. the snapshot is pinned (with DVC, pushed to the remote) and stored under
   `data/<team>/<name>/raw/<md5>/` with its `.dvc` file and the list of files
   it was made of.

The manifest (`data/<team>/<name>/ingest/manifest.json`) records every file
ingested or rejected, with size/mtime/etag, content hash, rows, its part and
its issues.

A file whose bytes equal those of an accepted file in the landing area (the
same delivery under a new name) is recorded as a `duplicate` of it and adds
nothing: no rows, no new snapshot, no new data version. Without this, every
row of the copy repeats a row of the original and the version fails the
duplicate-row check; with it, a re-delivery is harmless.

Bad files follow `PipelineSpec.on_bad_data`. With "reject" any issue rejects
the file and the run fails with `IngestRejected` after every file was looked
at. With "warn" unusable files are skipped and usable ones with issues (added
columns, ragged rows, no rows) are accepted; the snapshot is made of the rest.
Either way a file with issues is copied to
`quarantine/<team>/<name>/files/<id>/` with a `report.json` listing every
problem found in it at once (see `trainyard.data.landing`). The entry id
depends on the landing URI only, so fixing and re-landing a file supersedes
its entry instead of adding one per round; the entry is marked resolved once
the file is accepted or removed.

Memory: one block or batch of one file, plus at most two Parquet row groups
of the snapshot being written; it does not grow with the data.

Step 2, one landing file read into its part, is `trainyard.data.landing_parts`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
from typing import Callable, Optional, Protocol

import pyarrow as pa

from trainyard import naming
from trainyard.data.canonical import CanonicalParquetWriter, canonical_schema
from trainyard.data.errors import DataQualityError, MissingLandingData
from trainyard.data.landing import READ_BLOCK_BYTES, FileIssue
from trainyard.data.landing_parts import LandingFileChanged, ingest_file, iter_part, schema_key, vanished
from trainyard.data.quarantine import resolve_file_entry, utc_now
from trainyard.data.records import (
    MANIFEST_VERSION as MANIFEST_VERSION,
)  # re-exported: ingest's records and their tables
from trainyard.data.records import FileRecord, IngestResult, Manifest, SnapshotRecord, missing_counts
from trainyard.data.records import missing_markdown as missing_markdown
from trainyard.data.records import records_markdown as records_markdown
from trainyard.spec import PipelineSpec, SourceSpec
from trainyard.store import FileInfo, FileStore, StorageError, local_writes


class IngestRejected(DataQualityError):
    """At least one landing file was rejected under `on_bad_data="reject"`; `records` says which and why."""

    def __init__(self, message: str, records: list["FileRecord"]) -> None:
        super().__init__(message)
        self.records = records


def landing_patterns(store: FileStore, source: SourceSpec) -> list[str]:
    """The source's globs as full URIs.

    `source.prefix` is relative to the store root unless it is absolute
    (`s3://...` or `/...`).
    """
    prefix = source.prefix
    if prefix.startswith("s3://"):
        return [f"{prefix.rstrip('/')}/{g.lstrip('/')}" for g in source.globs]
    if prefix.startswith("/"):
        return [os.path.join(prefix, g.lstrip("/")) for g in source.globs]
    return [store.uri(prefix, g) for g in source.globs]


def list_landing(
    store: FileStore, source: SourceSpec, skipped: Optional[list[tuple[str, str]]] = None
) -> list[FileInfo]:
    """Landing files matching any of the source's globs, sorted by URI, with size/mtime/etag.

    Names starting with `.` or `_` (`.crc` files, `_SUCCESS` markers) are left out.
    A symbolic link to a regular file is a landing file (read through the
    link); other entries that are no regular file (dangling links, FIFOs...)
    are not read and, when `skipped` is given, appended to it with the reason
    (see `FileStore.list_files`).
    """
    found: dict[str, FileInfo] = {}
    for pattern in landing_patterns(store, source):
        for info in store.list_files(pattern, skipped):
            name = info.uri.rsplit("/", 1)[-1]
            if not name.startswith((".", "_")):
                found[info.uri] = info
    return [found[u] for u in sorted(found)]


def landing_digest(files: list[FileInfo]) -> str:
    """A digest of the landing area's state: changes when any file is added, removed or replaced."""
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.uri}\0{f.size}\0{f.mtime}\0{f.etag}\n".encode())
    return h.hexdigest()[:32]


def manifest_uri(store: FileStore, spec: PipelineSpec) -> str:
    return naming.ingest_manifest(store, spec.team, spec.name)


def load_manifest(store: FileStore, spec: PipelineSpec) -> Manifest:
    """The pipeline's manifest, or an empty one before the first ingest."""
    uri = manifest_uri(store, spec)
    return Manifest.model_validate(store.read_json(uri)) if store.exists(uri) else Manifest()


def pending_files(store: FileStore, spec: PipelineSpec, files: Optional[list[FileInfo]] = None) -> list[FileInfo]:
    """Landing files not yet ingested (or rejected) in their current state."""
    manifest = load_manifest(store, spec)
    key = schema_key(spec)
    files = list_landing(store, spec.source) if files is None else files
    return [f for f in files if f.uri not in manifest.files or not manifest.files[f.uri].same_state(f, key)]


def removed_files(store: FileStore, spec: PipelineSpec, files: Optional[list[FileInfo]] = None) -> list[str]:
    """Files the last ingest counted that have left the landing area since: in the snapshot, or rejected.

    Either way the next `ingest` changes something (a new snapshot without the
    file, or a rejection that no longer holds the pipeline), so sensors treat a
    removal like a new file.
    """
    files = list_landing(store, spec.source) if files is None else files
    return removed_files_of(load_manifest(store, spec), {f.uri for f in files})


def content_hash(store: FileStore, uri: str, block_bytes: int = READ_BLOCK_BYTES) -> str:
    """SHA-256 of a file's bytes, read one block at a time."""
    h = hashlib.sha256()
    with store.open(uri, "rb") as f:
        for block in iter(lambda: f.read(block_bytes), b""):
            h.update(block)
    return h.hexdigest()


# --------------------------------------------------------------------------- snapshot


def _snapshot_key(records: list[FileRecord]) -> str:
    h = hashlib.sha256()
    for r in records:
        h.update(f"{r.uri}\0{r.part}\n".encode())
    return h.hexdigest()[:32]


def file_md5(path: str) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_snapshot(store: FileStore, records: list[FileRecord], schema: pa.Schema, path: str) -> int:
    """Stream the parts of `records`, in order, into one canonical Parquet file at `path`; returns its rows."""
    with CanonicalParquetWriter(path, schema) as writer:
        for record in records:
            assert record.part is not None
            for batch in iter_part(store, record.part):
                writer.write(batch)
    return writer.rows


class PinnedFile(Protocol):
    """A local file pinned by a `DataPinner`: its md5 and the text that restores it (a `.dvc` file)."""

    @property
    def md5(self) -> str: ...

    @property
    def dvc_file(self) -> str: ...


class DataPinner(Protocol):
    """Pins a local file and pushes its bytes to a remote, e.g. the `DataVersioning` resource (DVC)."""

    def pin(self, local_file: str) -> PinnedFile: ...


@dataclasses.dataclass
class LandingScan:
    """What one pass over the landing files found (see `IngestResult` for the fields); tables' and shards' ingest."""

    ingested: list[FileRecord] = dataclasses.field(default_factory=list)
    rejected: list[FileRecord] = dataclasses.field(default_factory=list)
    duplicates: list[FileRecord] = dataclasses.field(default_factory=list)
    changing: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)
    unchanged: int = 0

    def duplicate(self, manifest: Manifest, info: FileInfo, key: str, digest: str, original: FileRecord) -> None:
        """Record `info`, which has the bytes of the already ingested `original`: a duplicate delivery that adds
        nothing."""
        record = FileRecord(
            uri=info.uri, size=info.size, mtime=info.mtime, etag=info.etag, status="duplicate", schema_key=key,
            ingested_at=utc_now(), content_hash=digest, duplicate_of=original.uri,
        )
        manifest.files[info.uri] = record
        self.duplicates.append(record)
        self.warnings.append(
            f"{info.uri} has the same bytes as {original.uri}, already ingested: a duplicate delivery, it adds nothing"
        )


def ingest(
    store: FileStore,
    spec: PipelineSpec,
    versioning: Optional[DataPinner] = None,
    *,
    block_bytes: int = READ_BLOCK_BYTES,
    log: Optional[Callable[[str], None]] = None,
) -> IngestResult:
    """Bring the pipeline's snapshot up to date with its landing area (see the module docstring).

    Args:
        store: The object store (landing area, parts, snapshots, quarantine).
        spec: The pipeline: source, declared columns, `on_bad_data`.
        versioning: Pins each new snapshot (with DVC, pushing it to the
            remote); when None the md5 is computed here and nothing is pinned
            (the `.dvc` text is then empty).
        block_bytes: Bytes of CSV/JSON parsed at a time.
        log: Called with one line per warning.

    Returns:
        What happened, with the current snapshot.

    Raises:
        MissingLandingData: No landing file matches and nothing was ever accepted.
        IngestRejected: Under "reject", a landing file was rejected (now or
            earlier, and it is still there unchanged).
        LandingFileChanged: Under "reject", a file changed while being read.
        DataVersioningError: DVC failed.
        StorageError: The object store failed.
    """
    skipped: list[tuple[str, str]] = []
    files = list_landing(store, spec.source, skipped)
    not_files = [
        f"{uri} is not read: it is {why} (only regular files, or symbolic links to them, are landing files)"
        for uri, why in sorted(set(skipped))
    ]
    manifest = load_manifest(store, spec)
    if not files:
        raise MissingLandingData(
            f"no landing files match prefix {spec.source.prefix!r} with pattern {spec.source.pattern!r} "
            f"(looked for {', '.join(landing_patterns(store, spec.source))})"
            + "".join(f"; {line}" for line in not_files)
        )
    scan = _scan_landing(store, spec, files, manifest, block_bytes)
    scan.warnings += not_files
    landing = {f.uri for f in files}
    removed = _forget_removed(store, spec, manifest, landing)
    scan.warnings += [f"{u} left the landing area: its rows leave the snapshot" for u in removed]
    if log is not None:
        for line in scan.warnings:
            log(line)
    _save_manifest(store, spec, manifest)
    if spec.on_bad_data == "reject" and (scan.rejected or scan.changing):
        if scan.rejected:
            reasons = "; ".join(i.message for r in scan.rejected for i in r.issues)
            raise IngestRejected(
                f"{len(scan.rejected)} landing file(s) rejected (on_bad_data='reject'); each is kept in quarantine "
                f"with a report: {reasons}",
                scan.rejected,
            )
        raise LandingFileChanged("; ".join(w for w in scan.warnings if "changed while being read" in w))
    accepted = sorted(
        (r for r in manifest.files.values() if r.status == "accepted" and r.uri in landing), key=lambda r: r.uri
    )
    if not accepted:
        raise MissingLandingData(
            f"no usable landing files under prefix {spec.source.prefix!r} with pattern {spec.source.pattern!r}: "
            f"{len(scan.rejected)} rejected, {len(scan.duplicates)} duplicate(s), {len(scan.changing)} still changing"
        )
    snapshot_key = _snapshot_key(accepted)
    current = manifest.snapshot
    reused = current is not None and current.key == snapshot_key and store.exists(current.uri)
    if current is None or not reused:
        current = _new_snapshot(store, spec, manifest, accepted, snapshot_key, versioning)
    return IngestResult(
        current,
        reused,
        scan.ingested,
        scan.rejected,
        scan.changing,
        scan.unchanged,
        removed,
        scan.warnings,
        scan.duplicates,
    )


def _outcome(record: FileRecord, issue: FileIssue) -> str:
    """What an issue led to, for the warning line: nothing for a rejected file, whose rows are all left out."""
    if record.status == "rejected":
        return ""
    if issue.kind == "missing_lookalike":
        return " (accepted as text)"
    if not issue.blocking:
        return " (the file is accepted; validation decides on these rows)"
    return " (accepted without those rows)" if issue.kind == "ragged_rows" else " (accepted)"


def _forget_removed(store: FileStore, spec: PipelineSpec, manifest: Manifest, landing: set[str]) -> list[str]:
    """Files of the last snapshot, or rejected, that left the landing area; rejections of removed files are forgotten.

    Accepted records stay in the manifest (with their parts), so a file that
    comes back unchanged is not read again.
    """
    removed = removed_files_of(manifest, landing)
    for uri in removed:
        resolve_file_entry(store, spec, uri, "removed from the landing area")
        if uri in manifest.files and manifest.files[uri].status != "accepted":
            del manifest.files[uri]
    return removed


def removed_files_of(manifest: Manifest, landing: set[str]) -> list[str]:
    """The files `removed_files` names, for a manifest and the set of landing URIs."""
    counted = set(manifest.snapshot.files if manifest.snapshot else []) | {
        u for u, r in manifest.files.items() if r.status == "rejected"
    }
    return sorted(counted - landing)


def _unchanged(
    store: FileStore, known: Optional[FileRecord], info: FileInfo, key: str, by_hash: dict[str, FileRecord]
) -> bool:
    """Whether the manifest's record of `info` still holds: same state, and its part (or its original) still there."""
    if known is None or not known.same_state(info, key):
        return False
    if known.status == "duplicate":
        original = by_hash.get(known.content_hash or "")
        return original is not None and original.uri == known.duplicate_of
    return known.status == "rejected" or _part_exists(store, known)


def _scan_landing(
    store: FileStore, spec: PipelineSpec, files: list[FileInfo], manifest: Manifest, block_bytes: int
) -> LandingScan:
    """Ingest every landing file the manifest does not know in its current state; updates `manifest.files`.

    Files are taken in URI order; a file with the bytes of an accepted file
    already in the landing area (or earlier in this order) is a duplicate.
    """
    key = schema_key(spec)
    scan = LandingScan()
    landing = {f.uri: f for f in files}
    by_hash: dict[str, FileRecord] = {}
    for r in sorted(manifest.files.values(), key=lambda r: r.uri):
        still = r.uri in landing and r.same_state(landing[r.uri], key)
        if r.status == "accepted" and still and r.content_hash and r.content_hash not in by_hash:
            by_hash[r.content_hash] = r
    for info in files:
        known = manifest.files.get(info.uri)
        if _unchanged(store, known, info, key, by_hash):
            assert known is not None
            scan.unchanged += 1
            if known.status == "rejected":
                scan.rejected.append(known)
                scan.warnings.append(f"{info.uri} was rejected before and has not changed; see {known.quarantine}")
            continue
        try:
            digest = content_hash(store, info.uri)
        except StorageError as e:
            gone = vanished(store, info, e)
            if not isinstance(gone, LandingFileChanged):
                raise
            scan.changing.append(info.uri)
            scan.warnings.append(str(gone))
            continue
        original = by_hash.get(digest)
        if original is not None and original.uri != info.uri:
            scan.duplicate(manifest, info, key, digest, original)
            continue
        try:
            record = ingest_file(store, spec, info, block_bytes, digest)
        except LandingFileChanged as e:
            scan.changing.append(info.uri)
            scan.warnings.append(str(e))
            continue
        was_accepted = known is not None and known.status == "accepted" and _part_exists(store, known)
        if known is not None and was_accepted and record.status == "accepted":
            scan.warnings.append(
                f"{info.uri} was replaced since it was ingested (size {known.size} -> {info.size}); the new content "
                "replaces the old in the snapshot"
            )
        if known is not None and was_accepted and record.status == "rejected":
            # Keep what was accepted: a bad replacement must not take good data out of the snapshot.
            scan.warnings.append(
                f"{info.uri} was replaced by content that is rejected; the snapshot keeps the version ingested at "
                f"{known.ingested_at}"
            )
        else:
            manifest.files[info.uri] = record
            if record.status == "accepted" and digest not in by_hash:
                by_hash[digest] = record
        (scan.ingested if record.status == "accepted" else scan.rejected).append(record)
        scan.warnings += [f"{i.kind}: {i.message}" + _outcome(record, i) for i in record.issues]
    return scan


def _new_snapshot(
    store: FileStore,
    spec: PipelineSpec,
    manifest: Manifest,
    accepted: list[FileRecord],
    snapshot_key: str,
    versioning: Optional[DataPinner],
) -> SnapshotRecord:
    """Write the accepted files' parts as the new snapshot, pin it, store it with its manifest, and make it current."""
    schema = canonical_schema(spec)
    with tempfile.TemporaryDirectory(prefix="trainyard-snapshot-") as tmp:
        local = os.path.join(tmp, "data.parquet")
        with local_writes("write the snapshot", local):
            rows = write_snapshot(store, accepted, schema, local)
        if versioning is not None:
            pin = versioning.pin(local)
            md5, dvc_file = pin.md5, pin.dvc_file
        else:
            md5, dvc_file = file_md5(local), ""
        base = naming.raw_dir(store, spec.team, spec.name, md5)
        store.put_file(local, f"{base}/data.parquet")
    if dvc_file:
        store.write_bytes(f"{base}/data.parquet.dvc", dvc_file.encode())
    snapshot = SnapshotRecord(
        md5=md5,
        uri=f"{base}/data.parquet",
        rows=rows,
        files=[r.uri for r in accepted],
        key=snapshot_key,
        dvc_file=dvc_file,
        created_at=utc_now(),
        missing=missing_counts(accepted, list(spec.stored_columns)),
    )
    store.write_json(
        f"{base}/manifest.json",
        {"snapshot": snapshot.model_dump(), "files": [manifest.files[u].model_dump() for u in snapshot.files]},
    )
    manifest.snapshot = snapshot
    _save_manifest(store, spec, manifest)
    return snapshot


def _part_exists(store: FileStore, record: FileRecord) -> bool:
    return record.part is not None and store.exists(record.part)


def _save_manifest(store: FileStore, spec: PipelineSpec, manifest: Manifest) -> None:
    store.write_json(manifest_uri(store, spec), manifest.model_dump(mode="json"))
