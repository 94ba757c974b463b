"""Ingest of a sharded pipeline: landing files to a content-addressed set of litdata shards, split by document.

`ingest_shards` brings a pipeline's shard set up to date with its landing
area, the way `trainyard.data.ingest.ingest` does for tables:

1. list the landing files (`source.prefix` / `source.pattern`) with size,
   mtime and etag; a file the manifest knows in that exact state is not read;
2. read each new file once to find every problem in it (invalid UTF-8, a
   malformed JSON line, a truncated PNG or NPY, an image under a directory
   that names no label: `trainyard.data.shard_landing`); a file with problems
   is rejected and kept in quarantine with a report naming its lines; under
   `on_bad_data="reject"` the run fails with `IngestRejected` after every file
   was looked at, under "warn" it is left out. A file that changed while read
   is not taken (`LandingFileChanged`); one with the bytes of an accepted file
   is a duplicate and adds nothing; one removed leaves the next version;
3. text: the tokenizer is the pipeline's frozen one (`bpe`: trained on the
   first delivery's documents and stored at
   `data/<team>/<name>/ingest/tokenizer.json`; `bytes`: fixed). Each accepted
   file is tokenized once per (content, tokenizer) into a *part*
   (`ingest/shard_parts/<key>.arrow`), so a new delivery tokenizes only its
   new files;
4. every document (image) goes to train, val or test by a salted hash of its
   content (`spec.split` fractions and seed; the idea of
   `trainyard.data.splitting`), so a document keeps its part as deliveries
   add others and a copy of a document never straddles two parts. The
   documents are streamed, in landing-URI then line order, into three split
   directories (`training.shard_format`: litdata chunks, meta.json, tokenizer,
   counts, documents table);
5. the version is the md5 of a deterministic tar of the three split
   directories (chunks, index, meta, tokenizer, counts, documents table):
   pinned with DVC (`DataVersioning.pin`, the tar goes to the DVC remote) and
   the Dagster DataVersion. The splits are stored under
   `data/<team>/<name>/raw/<md5>/{train,val,test}/` with `shards.tar.dvc` and
   `manifest.json`. Equal landing files give equal bytes and an equal md5.

Memory: one document (or image) and one chunk per split being written, plus
the BPE's word counts when it is trained; it does not grow with the corpus.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tarfile
import tempfile
from typing import Any, Callable, Iterator, Optional

import numpy as np

from training import shard_format
from trainyard import naming
from trainyard.data.errors import MissingLandingData
from trainyard.data.ingest import (
    DataPinner,
    IngestRejected,
    LandingScan,
    _forget_removed,
    _save_manifest,
    content_hash,
    file_md5,
    landing_patterns,
    list_landing,
    load_manifest,
)
from trainyard.data.landing_parts import LandingFileChanged, schema_key, vanished
from trainyard.data.quarantine import quarantine_file, resolve_file_entry, utc_now
from trainyard.data.records import FileRecord, IngestResult, Manifest, SnapshotRecord
from trainyard.data.shard_landing import check_text_file, read_image_file, text_documents
from trainyard.data.tokenizer import Tokenizer, bytes_tokenizer_json, load_tokenizer, train_bpe
from trainyard.shardspec import ImageShards, TextShards
from trainyard.spec import PipelineSpec
from trainyard.store import FileInfo, FileStore, StorageError, local_writes

TAR_NAME = "shards.tar"
"""The file DVC pins: the three split directories as one deterministic tar."""
DAMAGED = "DAMAGED.json"
"""Written beside a version whose stored shards no longer match their checksums; the next ingest rewrites it."""
_TOKENIZE_BATCH = 256


@dataclasses.dataclass
class ShardIngestResult(IngestResult):
    """`IngestResult` of a sharded pipeline, with per-split counts (`items`, `tokens`) and the tokenizer's digest (""
    for images)."""

    splits: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    tokenizer: str = ""


# --------------------------------------------------------------------------- locations


def tokenizer_uri(store: FileStore, spec: PipelineSpec) -> str:
    """Where a `bpe` pipeline's frozen tokenizer is kept."""
    return store.uri(naming.DATA, spec.team, spec.name, "ingest", "tokenizer.json")


def _part_uri(store: FileStore, spec: PipelineSpec, digest: str, tokenizer: Tokenizer) -> str:
    assert isinstance(spec.shards, TextShards)
    key = f"{digest}\0{tokenizer.digest}\0{spec.shards.text_field}\0{spec.shards.tokens_field}"
    return store.uri(
        naming.DATA,
        spec.team,
        spec.name,
        "ingest",
        "shard_parts",
        hashlib.sha256(key.encode()).hexdigest()[:24] + ".arrow",
    )


def store_relative(store: FileStore, uri: str) -> str:
    """`uri` relative to the store's root when it lies under it (`landing/<team>/<name>/a.jsonl`), else as it is.

    Shards name their landing files this way, so equal landing files give an
    equal version in any store, and reports read like the example in
    docs/data.md ("landing/language/corpus/b.jsonl line 3: ...").
    """
    root = store.uri().rstrip("/") + "/"
    return uri[len(root):] if uri.startswith(root) else uri


def landing_root(store: FileStore, spec: PipelineSpec) -> str:
    """The landing prefix as a full URI (an image's id is its path below it)."""
    return landing_patterns(store, spec.source.model_copy(update={"pattern": "x"}))[0][: -len("/x")]


# --------------------------------------------------------------------------- scan


def _check_file(store: FileStore, spec: PipelineSpec, info: FileInfo, digest: str) -> FileRecord:
    """Read one new landing file for its problems; the record says accepted (with its documents) or rejected.

    Raises:
        LandingFileChanged: The file changed while it was read.
    """
    try:
        if isinstance(spec.shards, TextShards):
            issues, count = check_text_file(store, info.uri, spec.shards)
        else:
            assert isinstance(spec.shards, ImageShards)
            issues, image = read_image_file(store, info.uri, spec.shards)
            count = 0 if image is None else 1
    except StorageError as e:
        raise vanished(store, info, e) from e
    after = store.stat(info.uri) if store.exists(info.uri) else None
    if after is None or after.identity != info.identity:
        raise LandingFileChanged(f"{info.uri} changed while being read; it is ingested once it stops changing")
    status = "rejected" if issues else "accepted"
    record = FileRecord(
        uri=info.uri, size=info.size, mtime=info.mtime, etag=info.etag, status=status, rows=0 if issues else count,
        schema_key=schema_key(spec), issues=issues, ingested_at=utc_now(), content_hash=digest,
    )
    if issues:
        record.quarantine = quarantine_file(store, spec, info, [i.model_dump() for i in issues], status, digest)
    else:
        resolve_file_entry(store, spec, info.uri, "accepted without issues")
    return record


def _scan(store: FileStore, spec: PipelineSpec, files: list[FileInfo], manifest: Manifest) -> LandingScan:
    """Check every landing file the manifest does not know in its current state; updates `manifest.files`."""
    key = schema_key(spec)
    scan = LandingScan()
    landing = {f.uri: f for f in files}
    by_hash: dict[str, FileRecord] = {}
    for r in sorted(manifest.files.values(), key=lambda r: r.uri):
        if r.status == "accepted" and r.uri in landing and r.same_state(landing[r.uri], key) and r.content_hash:
            by_hash.setdefault(r.content_hash, r)
    for info in files:
        known = manifest.files.get(info.uri)
        if (
            known is not None
            and known.same_state(info, key)
            and (known.status != "duplicate" or known.duplicate_of in landing)
        ):
            scan.unchanged += 1
            if known.status == "rejected":
                scan.rejected.append(known)
                scan.warnings.append(f"{info.uri} was rejected before and has not changed; see {known.quarantine}")
            continue
        try:
            digest = content_hash(store, info.uri)
            original = by_hash.get(digest)
            if original is not None and original.uri != info.uri:
                scan.duplicate(manifest, info, key, digest, original)
                continue
            record = _check_file(store, spec, info, digest)
        except (LandingFileChanged, StorageError) as e:
            gone = e if isinstance(e, LandingFileChanged) else vanished(store, info, e)
            if not isinstance(gone, LandingFileChanged):
                raise
            scan.changing.append(info.uri)
            scan.warnings.append(str(gone))
            continue
        if known is not None and known.status == "accepted" and record.status == "rejected":
            scan.warnings.append(
                f"{info.uri} was replaced by content that is rejected; the version keeps what was accepted at "
                f"{known.ingested_at}"
            )
        else:
            manifest.files[info.uri] = record
            if record.status == "accepted":
                by_hash.setdefault(digest, record)
        (scan.ingested if record.status == "accepted" else scan.rejected).append(record)
        scan.warnings += [f"{i.kind}: {i.message}" for i in record.issues]
    return scan


# --------------------------------------------------------------------------- tokenizer and parts


def pipeline_tokenizer(
    store: FileStore, spec: PipelineSpec, accepted: list[FileRecord], log: Callable[[str], None]
) -> Tokenizer:
    """The pipeline's frozen tokenizer; a `bpe` one is trained on the accepted documents the first time and stored."""
    assert isinstance(spec.shards, TextShards)
    if spec.shards.tokenizer == "bytes":
        return load_tokenizer(bytes_tokenizer_json())
    uri = tokenizer_uri(store, spec)
    if store.exists(uri):
        return load_tokenizer(store.read_bytes(uri))
    shards = spec.shards
    texts = (d.text for r in accepted for d in text_documents(store, r.uri, shards) if d.text is not None)
    trained = train_bpe(texts, shards.vocab_size)
    store.write_bytes(uri, trained)
    tokenizer = load_tokenizer(trained)
    log(
        f"trained a byte-level BPE of {tokenizer.vocab_size} ids on {len(accepted)} file(s); frozen at {uri} (digest "
        f"{tokenizer.digest})"
    )
    return tokenizer


def _write_part(store: FileStore, spec: PipelineSpec, record: FileRecord, tokenizer: Tokenizer, uri: str) -> None:
    """Tokenize one landing file into a part: an Arrow IPC file of (record, sha1, ids), a batch of documents at a
    time."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    assert isinstance(spec.shards, TextShards)
    schema = pa.schema([("record", pa.int64()), ("sha1", pa.string()), ("ids", pa.list_(pa.int32()))])

    def flush(writer: Any, docs: list[Any]) -> None:
        texts = [d.text for d in docs if d.text is not None]
        encoded = iter(tokenizer.encode_batch(texts))
        ids = [np.asarray(d.ids, dtype=np.int32) if d.text is None else next(encoded) for d in docs]
        writer.write_batch(
            pa.record_batch(
                [
                    pa.array([d.record for d in docs], pa.int64()),
                    pa.array([d.sha1 for d in docs]),
                    pa.array(ids, pa.list_(pa.int32())),
                ],
                schema=schema,
            )
        )

    with tempfile.TemporaryDirectory(prefix="trainyard-shard-part-") as tmp:
        local = os.path.join(tmp, "part.arrow")
        with (
            local_writes("write the tokenized part of", local),
            ipc.new_file(local, schema, options=ipc.IpcWriteOptions(compression="lz4")) as writer,
        ):
            batch: list[Any] = []
            for doc in text_documents(store, record.uri, spec.shards):
                batch.append(doc)
                if len(batch) >= _TOKENIZE_BATCH:
                    flush(writer, batch)
                    batch = []
            if batch:
                flush(writer, batch)
        after = store.stat(record.uri)
        if (after.size, after.mtime, after.etag) != (record.size, record.mtime, record.etag):
            raise LandingFileChanged(
                f"{record.uri} changed while being tokenized; it is ingested once it stops changing"
            )
        store.put_file(local, uri)


def ensure_parts(store: FileStore, spec: PipelineSpec, accepted: list[FileRecord], tokenizer: Tokenizer) -> int:
    """Tokenize the accepted files that have no part for this tokenizer yet (new files only); returns how many were."""
    made = 0
    for record in accepted:
        assert record.content_hash is not None
        uri = _part_uri(store, spec, record.content_hash, tokenizer)
        if not store.exists(uri):
            _write_part(store, spec, record, tokenizer, uri)
            made += 1
        record.part = uri
    return made


def _part_documents(store: FileStore, uri: str) -> Iterator[tuple[int, str, np.ndarray]]:
    import pyarrow.ipc as ipc

    with store.open(uri, "rb") as f:
        reader = ipc.open_file(f)
        for i in range(reader.num_record_batches):
            batch = reader.get_batch(i)
            records = batch.column(0).to_numpy()
            sha1s = batch.column(1).to_pylist()
            lists = batch.column(2)
            offsets = lists.offsets.to_numpy()
            values = lists.values.to_numpy(zero_copy_only=False)
            for j in range(batch.num_rows):
                yield int(records[j]), sha1s[j], values[offsets[j]:offsets[j + 1]]


# --------------------------------------------------------------------------- the version


def split_of(sha1: str, spec: PipelineSpec) -> str:
    """The part of a document by its content: BLAKE2b-64 of its sha1 keyed with the split seed, to u in [0, 1)."""
    salt = f"trainyard.split:{spec.split.seed}".encode()
    h = int.from_bytes(hashlib.blake2b(sha1.encode(), digest_size=8, key=salt).digest(), "big")
    u = (h >> 11) * 2.0**-53
    t, v = spec.split.test_fraction, spec.split.val_fraction
    return "test" if u < t else "val" if u < t + v else "train"


def version_key(spec: PipelineSpec, accepted: list[FileRecord], tokenizer_digest: str) -> str:
    """What a version is made of: the accepted files (URI and content), the tokenizer, the shard kind and the split."""
    h = hashlib.sha256()
    assert spec.shards is not None
    h.update(
        json.dumps(
            {
                "format": shard_format.FORMAT_VERSION,
                "shards": spec.shards.model_dump(mode="json"),
                "split": spec.split.model_dump(mode="json"),
                "tokenizer": tokenizer_digest,
            },
            sort_keys=True,
        ).encode()
    )
    for r in accepted:
        h.update(f"{r.uri}\0{r.content_hash}\n".encode())
    return h.hexdigest()[:32]


def _write_text_splits(
    store: FileStore, spec: PipelineSpec, accepted: list[FileRecord], tokenizer: Tokenizer, tmp: str
) -> dict[str, dict[str, Any]]:
    assert isinstance(spec.shards, TextShards)
    writers = {
        name: shard_format.TextSplitWriter(
            os.path.join(tmp, name),
            vocab_size=spec.shards.vocabulary,
            eos_id=tokenizer.eos_id,
            tokenizer_json=tokenizer.json_bytes,
            shard_bytes=spec.shards.shard_bytes,
        )
        for name in shard_format.SPLITS
    }
    for record in accepted:
        assert record.part is not None
        for number, sha1, ids in _part_documents(store, record.part):
            writers[split_of(sha1, spec)].add(
                ids, shard_format.Provenance(store_relative(store, record.uri), number, sha1)
            )
    return {name: w.close() for name, w in writers.items()}


def _write_image_splits(
    store: FileStore, spec: PipelineSpec, accepted: list[FileRecord], tmp: str
) -> dict[str, dict[str, Any]]:
    shards = spec.shards
    assert isinstance(shards, ImageShards)
    writers = {
        name: shard_format.ImageSplitWriter(
            os.path.join(tmp, name),
            shape=shards.shape,
            dtype=shards.dtype,
            min=shards.min,
            max=shards.max,
            labels=shards.labels,
            shard_bytes=shards.shard_bytes,
        )
        for name in shard_format.SPLITS
    }
    root = landing_root(store, spec)
    for record in accepted:
        issues, image = read_image_file(store, record.uri, shards)
        after = store.stat(record.uri)
        if image is None or (after.size, after.mtime, after.etag) != (record.size, record.mtime, record.etag):
            raise LandingFileChanged(
                f"{record.uri} changed since it was checked ({'; '.join(i.message for i in issues) or 'other bytes'}); "
                "it is ingested once it stops changing"
            )
        relative = record.uri[len(root):].lstrip("/")
        writers[split_of(image.sha1, spec)].add(
            image.array,
            image.label,
            shard_format.image_id(relative),
            shard_format.Provenance(store_relative(store, record.uri), 0, image.sha1),
        )
    return {name: w.close() for name, w in writers.items()}


def deterministic_tar(local_root: str, out: str) -> None:
    """Tar every file under `local_root` in sorted path order, with zeroed times and owners: equal files give equal
    bytes."""
    paths = sorted(os.path.relpath(os.path.join(d, f), local_root) for d, _, fs in os.walk(local_root) for f in fs)
    with tarfile.open(out, "w", format=tarfile.GNU_FORMAT) as tar:
        for rel in paths:
            full = os.path.join(local_root, rel)
            info = tarfile.TarInfo(rel.replace(os.sep, "/"))
            info.size, info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = (
                os.path.getsize(full),
                0,
                0o644,
                0,
                0,
                "",
                "",
            )
            with open(full, "rb") as f:
                tar.addfile(info, f)


def _new_version(
    store: FileStore, spec: PipelineSpec, manifest: Manifest, accepted: list[FileRecord], key: str,
    tokenizer: Optional[Tokenizer], versioning: Optional[DataPinner],
) -> tuple[SnapshotRecord, dict[str, dict[str, int]]]:
    """Write the splits, pin their tar, store them under `raw/<md5>/` with the pin and a manifest, and make the version
    current."""
    with tempfile.TemporaryDirectory(prefix="trainyard-shards-") as tmp:
        splits_dir = os.path.join(tmp, "splits")
        with local_writes("write the shards", splits_dir):
            if tokenizer is not None:
                metas = _write_text_splits(store, spec, accepted, tokenizer, splits_dir)
            else:
                metas = _write_image_splits(store, spec, accepted, splits_dir)
            tar = os.path.join(tmp, TAR_NAME)
            deterministic_tar(splits_dir, tar)
        if versioning is not None:
            pin = versioning.pin(tar)
            md5, dvc_file = pin.md5, pin.dvc_file
        else:
            md5, dvc_file = file_md5(tar), ""
        base = naming.raw_dir(store, spec.team, spec.name, md5)
        for name in shard_format.SPLITS:
            store.put_dir(os.path.join(splits_dir, name), f"{base}/{name}")
    if dvc_file:
        store.write_bytes(f"{base}/{TAR_NAME}.dvc", dvc_file.encode())
    counts = {
        name: {"items": int(m["items"]), **({"tokens": int(m["tokens"])} if "tokens" in m else {})}
        for name, m in metas.items()
    }
    snapshot = SnapshotRecord(
        md5=md5, uri=base, rows=sum(c["items"] for c in counts.values()), files=[r.uri for r in accepted], key=key,
        dvc_file=dvc_file, created_at=utc_now(),
    )
    store.write_json(f"{base}/manifest.json", {
        "snapshot": snapshot.model_dump(), "splits": counts, "tokenizer": tokenizer.digest if tokenizer else "",
        "files": [manifest.files[r.uri].model_dump() for r in accepted],
    })
    if store.exists(f"{base}/{DAMAGED}"):
        store.delete(f"{base}/{DAMAGED}")
    manifest.snapshot = snapshot
    _save_manifest(store, spec, manifest)
    return snapshot, counts


def ingest_shards(
    store: FileStore,
    spec: PipelineSpec,
    versioning: Optional[DataPinner] = None,
    *,
    log: Optional[Callable[[str], None]] = None,
) -> ShardIngestResult:
    """Bring the pipeline's shard set up to date with its landing area (see the module docstring).

    Args:
        store: The object store (landing area, parts, tokenizer, versions, quarantine).
        spec: A sharded pipeline (`spec.shards` set).
        versioning: Pins each new version's tar (DVC); None: its md5 is
            computed here and nothing is pinned (the `.dvc` text is empty).
        log: Called with one line per warning.

    Returns:
        What happened; `.snapshot` is the current version (`uri` its
        directory, `md5`, `rows` its documents or images, `dvc_file`, `files`).

    Raises:
        MissingLandingData: No landing file matches, or none is usable.
        IngestRejected: Under "reject", a landing file was rejected (now or
            earlier, and it is still there unchanged).
        LandingFileChanged: Under "reject", a file changed while being read.
        DataVersioningError: DVC failed.
        StorageError: The object store failed.
    """
    if spec.shards is None:
        raise ValueError(
            f"{spec.key} is not a sharded pipeline (spec.shards is unset); use trainyard.data.ingest.ingest"
        )
    say = log or (lambda line: None)
    skipped: list[tuple[str, str]] = []
    files = list_landing(store, spec.source, skipped)
    manifest = load_manifest(store, spec)
    if not files:
        raise MissingLandingData(
            f"no landing files match prefix {spec.source.prefix!r} with pattern {spec.source.pattern!r} "
            f"(looked for {', '.join(landing_patterns(store, spec.source))})"
        )
    scan = _scan(store, spec, files, manifest)
    scan.warnings += [f"{uri} is not read: it is {why}" for uri, why in sorted(set(skipped))]
    landing = {f.uri for f in files}
    removed = _forget_removed(store, spec, manifest, landing)
    scan.warnings += [f"{u} left the landing area: its documents leave the next version" for u in removed]
    for line in scan.warnings:
        say(line)
    _save_manifest(store, spec, manifest)
    if spec.on_bad_data == "reject" and scan.rejected:
        reasons = "; ".join(i.message for r in scan.rejected for i in r.issues)
        raise IngestRejected(
            f"{len(scan.rejected)} landing file(s) rejected (on_bad_data='reject'); each is kept in quarantine with a "
            f"report: {reasons}",
            scan.rejected,
        )
    if spec.on_bad_data == "reject" and scan.changing:
        raise LandingFileChanged("; ".join(w for w in scan.warnings if "changed while being read" in w))
    accepted = sorted(
        (r for r in manifest.files.values() if r.status == "accepted" and r.uri in landing), key=lambda r: r.uri
    )
    if not accepted:
        raise MissingLandingData(
            f"no usable landing files under prefix {spec.source.prefix!r}: {len(scan.rejected)} rejected, "
            f"{len(scan.duplicates)} duplicate(s), {len(scan.changing)} still changing"
        )
    tokenizer = pipeline_tokenizer(store, spec, accepted, say) if isinstance(spec.shards, TextShards) else None
    if tokenizer is not None:
        made = ensure_parts(store, spec, accepted, tokenizer)
        if made:
            say(f"tokenized {made} new landing file(s); {len(accepted) - made} reused from earlier deliveries")
        _save_manifest(store, spec, manifest)
    key = version_key(spec, accepted, tokenizer.digest if tokenizer else "")
    current = manifest.snapshot
    reused = (current is not None and current.key == key and store.exists(f"{current.uri}/manifest.json")
              and not store.exists(f"{current.uri}/{DAMAGED}"))
    if reused:
        assert current is not None
        counts = store.read_json(f"{current.uri}/manifest.json")["splits"]
    else:
        current, counts = _new_version(store, spec, manifest, accepted, key, tokenizer, versioning)
    return ShardIngestResult(
        current,
        reused,
        scan.ingested,
        scan.rejected,
        scan.changing,
        scan.unchanged,
        removed,
        scan.warnings,
        scan.duplicates,
        splits=counts,
        tokenizer=tokenizer.digest if tokenizer else "",
    )


def markdown_splits(counts: dict[str, dict[str, int]]) -> str:
    """A Markdown table of items (and tokens) per split."""
    tokens = any("tokens" in c for c in counts.values())
    lines = ["| split | items |" + (" tokens |" if tokens else ""), "|---|---|" + ("---|" if tokens else "")]
    for name, c in counts.items():
        lines.append(f"| {name} | {c['items']} |" + (f" {c.get('tokens', 0)} |" if tokens else ""))
    return "\n".join(lines) + "\n"

