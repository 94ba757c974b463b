"""Reading one shard version for its validation: every shard checked, every item's problems named, a tally of the rest.

`read_version` reads each split (`trainyard.data.shards`) once, one shard
(litdata chunk) at a time: each shard's sha256 against `meta.json`, its layout,
and every item (text: end-of-document id, vocabulary, length bounds; images:
shape, dtype, value range, label), then litdata's own reader over the split.
Problems are lines naming landing file and line (`Problems`, `where`); the
per-shard statistics, content hashes and the counts drift needs are tallied
(`Tally`). `trainyard.data.shard_validation` judges them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from typing import Any, Iterator, Optional

import numpy as np

from training import shard_format
from trainyard.shardspec import ImageShards, TextShards
from trainyard.spec import PipelineSpec
from trainyard.store import FileStore

MAX_PROBLEMS_KEPT = 2000
"""Problem lines kept in a report (the count covers them all)."""
_SAMPLE = 10000


class Problems:
    """Problem lines, one per problem naming file and line: the first `MAX_PROBLEMS_KEPT` kept, all counted."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.count = 0

    def add(self, line: str) -> None:
        self.count += 1
        if len(self.lines) < MAX_PROBLEMS_KEPT:
            self.lines.append(line)


def where(file: str, record: int) -> str:
    """`<file> line <n>`, or the file alone for a whole-file document (record 0)."""
    return f"{file} line {record}" if record else file


# --------------------------------------------------------------------------- reading a split


def _provenance(local: str) -> Iterator[tuple[int, str, int, str]]:
    """(index, file, record, sha1) of each item of a split, in order, a batch at a time."""
    import pyarrow.parquet as pq

    for batch in pq.ParquetFile(os.path.join(local, shard_format.DOCUMENTS_FILE)).iter_batches(
        columns=["index", "file", "record", "sha1"]
    ):
        yield from zip(*(batch.column(i).to_pylist() for i in range(4)))


@dataclasses.dataclass
class Tally:
    """Accumulated over the splits: per-shard rows, content hashes for duplicates, counts for drift."""

    shards: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    hashes: list[np.ndarray] = dataclasses.field(default_factory=list)
    places: list[tuple[str, str, int]] = dataclasses.field(
        default_factory=list
    )  # (split, file, record) per item, only of kept items
    shard_of: list[int] = dataclasses.field(default_factory=list)
    items: int = 0
    empty: list[str] = dataclasses.field(default_factory=list)
    long: list[str] = dataclasses.field(default_factory=list)
    counts: Optional[np.ndarray] = None
    new_counts: Optional[np.ndarray] = None
    new_items: int = 0
    means: list[float] = dataclasses.field(default_factory=list)
    new_means: list[float] = dataclasses.field(default_factory=list)
    labels: Optional[np.ndarray] = None
    new_labels: Optional[np.ndarray] = None


def _hash64(sha1: str) -> int:
    return int(sha1[:16], 16)


def _checked_chunks(
    local: str, split: str, meta: dict[str, Any], problems: Problems
) -> Iterator[tuple[str, int, Optional[bytes]]]:
    """(name, items, bytes or None when damaged) of each shard of the split, in index order, checksums verified."""
    index_path = os.path.join(local, shard_format.INDEX_FILE)
    if not meta["items"]:
        return
    try:
        with open(index_path) as f:
            chunks = json.load(f)["chunks"]
    except (OSError, ValueError, KeyError) as e:
        problems.add(f"{split}/{shard_format.INDEX_FILE}: unreadable ({e}); no shard of the split can be located")
        return
    recorded = meta.get("chunks", {})
    for extra in sorted(set(recorded) - {c["filename"] for c in chunks}):
        problems.add(f"{split}/{extra}: written at ingest but missing from {shard_format.INDEX_FILE}")
    for chunk in chunks:
        name, size = chunk["filename"], int(chunk["chunk_size"])
        path = os.path.join(local, name)
        expected = recorded.get(name, {}).get("sha256")
        if not os.path.exists(path):
            problems.add(f"{split}/{name}: missing from the store")
            yield name, size, None
            continue
        with open(path, "rb") as f:
            data = f.read()
        actual = hashlib.sha256(data).hexdigest()
        if expected != actual:
            problems.add(
                f"{split}/{name}: sha256 {actual[:16]} is not the {str(expected)[:16]} written at ingest: the shard "
                "was altered in the store"
            )
            yield name, size, None
            continue
        yield name, size, data


def _damaged_items(
    split: str, name: str, prov: Iterator[tuple[int, str, int, str]], size: int, problems: Problems
) -> None:
    files = sorted({next(prov)[1] for _ in range(size)})
    problems.add(
        f"{split}/{name}: holds {size} item(s) from {', '.join(files[:5])}{' and more' if len(files) > 5 else ''}"
    )


def _text_split(
    local: str, split: str, shards: TextShards, tally: Tally, new_files: Optional[set[str]], problems: Problems
) -> None:
    meta = shard_format.read_meta(local)
    vocab, eos = shards.vocabulary, int(meta["eos_id"])
    prov = _provenance(local)
    for name, size, data in _checked_chunks(local, split, meta, problems):
        row: dict[str, Any] = {
            "split": split,
            "shard": name,
            "items": size,
            "tokens": 0,
            "mean_tokens": 0.0,
            "max_tokens": 0,
            "empty": 0,
            "long": 0,
            "duplicates": 0,
            "out_of_vocab": 0,
            "checksum_ok": data is not None,
            "decodes": data is not None,
        }
        tally.shards.append(row)
        if data is None:
            _damaged_items(split, name, prov, size, problems)
            continue
        lengths = []
        try:
            documents = list(shard_format.text_chunk_documents(data, f"{split}/{name}"))
        except shard_format.ShardFormatError as e:
            row["decodes"] = False
            problems.add(str(e))
            _damaged_items(split, name, prov, size, problems)
            continue
        for ids in documents:
            _, file, record, sha1 = next(prov)
            tally.hashes.append(np.array([_hash64(sha1)], dtype=np.uint64))
            tally.places.append((split, file, record))
            tally.shard_of.append(len(tally.shards) - 1)
            n = len(ids) - 1
            lengths.append(n)
            if not len(ids) or ids[-1] != eos:
                problems.add(f"{where(file, record)}: the document does not end with the end-of-document id {eos}")
            bad = ids[(ids < 0) | (ids >= vocab)]
            if len(bad):
                row["out_of_vocab"] += len(bad)
                more = f" ({len(bad)} ids outside it)" if len(bad) > 1 else ""
                problems.add(f"{where(file, record)}: token id {int(bad[0])} outside the vocabulary ({vocab}){more}")
            if n < shards.min_tokens:
                row["empty"] += 1
                tally.empty.append(
                    f"{where(file, record)}: empty document ({n} tokens, fewer than min_tokens {shards.min_tokens})"
                )
            if shards.max_tokens is not None and n > shards.max_tokens:
                row["long"] += 1
                tally.long.append(f"{where(file, record)}: {n} tokens, more than max_tokens {shards.max_tokens}")
            inside = ids[(ids >= 0) & (ids < vocab)]
            counts = np.bincount(inside, minlength=vocab)
            tally.counts = counts if tally.counts is None else tally.counts + counts
            if new_files is None or file in new_files:
                tally.new_counts = counts if tally.new_counts is None else tally.new_counts + counts
                tally.new_items += 1
        row.update(
            tokens=int(sum(lengths)),
            mean_tokens=float(np.mean(lengths)) if lengths else 0.0,
            max_tokens=int(max(lengths, default=0)),
        )
    tally.items += int(meta["items"])


def _index_config(local: str) -> dict[str, Any]:
    try:
        with open(os.path.join(local, shard_format.INDEX_FILE)) as f:
            return dict(json.load(f).get("config") or {})
    except (OSError, ValueError):
        return {}


def _image_split(
    local: str, split: str, shards: ImageShards, tally: Tally, new_files: Optional[set[str]], problems: Problems
) -> None:
    meta = shard_format.read_meta(local)
    config = _index_config(local)
    prov = _provenance(local)
    labels = len(shards.labels)
    for name, size, data in _checked_chunks(local, split, meta, problems):
        row: dict[str, Any] = {
            "split": split,
            "shard": name,
            "items": size,
            "bad_shape": 0,
            "bad_dtype": 0,
            "out_of_range": 0,
            "bad_label": 0,
            "duplicates": 0,
            "mean": 0.0,
            "std": 0.0,
            "min": 0.0,
            "max": 0.0,
            "checksum_ok": data is not None,
            "decodes": data is not None,
        }
        tally.shards.append(row)
        if data is None:
            _damaged_items(split, name, prov, size, problems)
            continue
        try:
            items = shard_format.image_chunk_items(data, f"{split}/{name}", config)
        except shard_format.ShardFormatError as e:
            row["decodes"] = False
            problems.add(str(e))
            _damaged_items(split, name, prov, size, problems)
            continue
        stats = []
        for image, label in items:
            _, file, record, sha1 = next(prov)
            tally.hashes.append(np.array([_hash64(sha1)], dtype=np.uint64))
            tally.places.append((split, file, record))
            tally.shard_of.append(len(tally.shards) - 1)
            if list(image.shape) != list(shards.shape) and not (
                len(shards.shape) == 2 and list(image.shape) == [*shards.shape, 1]
            ):
                row["bad_shape"] += 1
                problems.add(f"{where(file, record)}: shape {list(image.shape)}, not the declared {shards.shape}")
            if str(image.dtype) != shards.dtype:
                row["bad_dtype"] += 1
                problems.add(f"{where(file, record)}: dtype {image.dtype}, not the declared {shards.dtype}")
            lo, hi = (float(image.min()), float(image.max())) if image.size else (0.0, 0.0)
            if lo < shards.min or hi > shards.max:
                row["out_of_range"] += 1
                problems.add(
                    f"{where(file, record)}: values {lo:g}..{hi:g} outside the declared range "
                    f"{shards.min:g}..{shards.max:g}"
                )
            if not 0 <= label < labels:
                row["bad_label"] += 1
                problems.add(f"{where(file, record)}: label index {label} outside the {labels} declared labels")
            mean = float(image.mean()) if image.size else 0.0
            stats.append((mean, float(image.std()) if image.size else 0.0, lo, hi))
            one = np.bincount([min(max(label, 0), labels - 1)], minlength=labels)
            tally.labels = one if tally.labels is None else tally.labels + one
            if len(tally.means) < _SAMPLE:
                tally.means.append(mean)
            if new_files is None or file in new_files:
                tally.new_labels = one if tally.new_labels is None else tally.new_labels + one
                tally.new_items += 1
                if len(tally.new_means) < _SAMPLE:
                    tally.new_means.append(mean)
        if stats:
            s = np.array(stats)
            row.update(
                mean=float(s[:, 0].mean()),
                std=float(s[:, 1].mean()),
                min=float(s[:, 2].min()),
                max=float(s[:, 3].max()),
            )
    tally.items += int(meta["items"])


def _litdata_reads(local: str, split: str, spec: PipelineSpec, problems: Problems) -> bool:
    """Whether litdata's own reader gives every sample of the split (the pod's path); a failure is a problem."""
    meta = shard_format.read_meta(local)
    if not meta["items"]:
        return True
    sample = spec.shards.block_size + 1 if isinstance(spec.shards, TextShards) else None
    try:
        dataset = shard_format.open_split(local, sample_tokens=sample)
        for i in range(len(dataset)):
            dataset[i]
    # litdata raises what its decoders raise on bad bytes (no error type of its own): each is this split's problem.
    except (ValueError, RuntimeError, OSError, IndexError, KeyError, TypeError, EOFError) as e:
        problems.add(f"{split}: litdata cannot read the split ({type(e).__name__}: {e})")
        return False
    return True


def read_version(
    store: FileStore, spec: PipelineSpec, raw_uri: str, new_files: Optional[set[str]], problems: Problems
) -> Tally:
    """Read every split of the version at `raw_uri` once, one shard at a time: its problems into `problems`, the rest
    tallied
    (`new_files`: the delivery's new landing files, whose items drift is measured on; None: every file)."""
    tally = Tally()
    with tempfile.TemporaryDirectory(prefix="trainyard-shard-check-") as tmp:
        for split in shard_format.SPLITS:
            local = os.path.join(tmp, split)
            store.get_dir(f"{raw_uri}/{split}", local)
            before = problems.count
            if isinstance(spec.shards, TextShards):
                _text_split(local, split, spec.shards, tally, new_files, problems)
            else:
                assert isinstance(spec.shards, ImageShards)
                _image_split(local, split, spec.shards, tally, new_files, problems)
            if not shard_format.read_meta(local)["items"]:
                problems.add(f"{split}: the split holds no item (deliver more documents, or change spec.split)")
            if problems.count == before and not _litdata_reads(local, split, spec, problems):
                for row in tally.shards:
                    if row["split"] == split:
                        row["decodes"] = False
    return tally
