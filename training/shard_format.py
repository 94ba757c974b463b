"""The on-disk format of a split of shards, shared by ingest (the orchestrator) and the pod's streaming loader.

A split directory (a local path or `s3://bucket/prefix`) is a litdata dataset,
written with litdata's `BinaryWriter`, plus four files of ours:

- `index.json` and `chunk-0-<n>.bin`: litdata's own. The index is written
  without litdata's `updated_at` stamp, so equal documents give equal bytes.
- `meta.json`: `{"kind": "text"|"image", "format_version": 1, "items": ...,
  "chunks": {filename: {"sha256", "bytes"}}}` and, for text, `vocab_size`,
  `eos_id`, `tokenizer` (the file name beside it), `dtype` (of the stored
  ids, always `int32` so an id outside the vocabulary is stored as it came
  and validation can name it) and `tokens`; for images `shape`, `dtype`,
  `min`, `max` and `labels`.
- `tokenizer.json` (text): the `tokenizers` library's JSON of a byte-level
  BPE, or `{"type": "bytes", "vocab_size": 257, "eos_id": 256}`.
- `token_counts.npy` (text): the split's unigram counts, `int64[vocab_size]`.
- `documents.parquet`: one row per item, in item order: `index`, `file` (the
  landing file, relative to the object store's root when under it), `record` (its 1-based line for JSON lines, else 0),
  `tokens` (text, end-of-document included) or `bytes` (images), `sha1` of the
  content, and `label` (images).

Items: a text item is one document, a 1-D int32 tensor of token ids ending
with `eos_id`, written with `TokensLoader()`; read it back with
`open_split(uri, sample_tokens=block_size + 1)`, where one sample is
`block_size + 1` consecutive tokens of the concatenated stream (within one
chunk: litdata's `TokensLoader` drops a chunk's last tokens short of a whole
sample). An image item is `{"image": ndarray[shape] of dtype, "label": int
(index into meta's labels), "id": int (stable per landing file)}`.

S3: litdata talks to S3 with boto3 and passes `storage_options` to
`boto3.client("s3", **storage_options)`. `storage_options_for(uri)` returns
`{"endpoint_url": $AWS_ENDPOINT_URL}` for an `s3://` URI when that variable
is set (MinIO, a loopback endpoint), else `{}` (AWS). Credentials come from
the usual AWS environment. litdata fetches chunks with obstore when that is
installed, which refuses a plain `http://` endpoint unless told otherwise:
`open_split` does so (`allow_plain_http`); a reader that builds its own
`StreamingDataset` calls `allow_plain_http(storage_options)` first.

torch and litdata are imported inside the functions that need them: the
orchestrator imports this module.

Example:
    >>> meta = read_meta("/data/language/corpus/validated/abc/train")  # doctest: +SKIP
    >>> ds = open_split("/data/language/corpus/validated/abc/train", sample_tokens=meta_block + 1)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import warnings
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

import numpy as np

if TYPE_CHECKING:
    from litdata import StreamingDataset

FORMAT_VERSION = 1
INDEX_FILE = "index.json"
META_FILE = "meta.json"
TOKENIZER_FILE = "tokenizer.json"
TOKEN_COUNTS_FILE = "token_counts.npy"
DOCUMENTS_FILE = "documents.parquet"
TOKEN_DTYPE = "int32"
"""Stored token ids: int32 whatever the vocabulary, so an id outside it survives to be reported."""
SPLITS = ("train", "val", "test")
_DOC_BATCH = 8192
_HEADER = np.dtype("<u4")


class ShardFormatError(Exception):
    """A split directory is not in this format (a missing or unreadable file, a chunk whose layout does not parse)."""


# --------------------------------------------------------------------------- locations


def storage_options_for(uri: str) -> dict[str, Any]:
    """The `storage_options` litdata (boto3) needs for `uri`: the endpoint of `$AWS_ENDPOINT_URL` for s3://, else
    `{}`."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL")
    return {"endpoint_url": endpoint} if uri.startswith("s3://") and endpoint else {}


def allow_plain_http(storage_options: dict[str, Any]) -> None:
    """Let litdata's obstore downloads reach an `http://` endpoint (MinIO, a loopback S3) named in `storage_options`.

    When the `obstore` package is installed (litdata's own requirement; the
    trainer image has it), litdata fetches chunks with obstore, building its
    S3 store from the boto3 client's endpoint but with fixed client options
    (`litdata.streaming.downloader._OBSTORE_CLIENT_OPTIONS`) that refuse plain
    HTTP ("HTTP error: builder error"). This is the one place that reaches
    into litdata for it: `allow_http` is added to those options, in this
    process, only for an `http://` endpoint. A litdata without that constant
    fails here by name (tests/trainyard/data/test_shards.py pins it).

    Raises:
        ShardFormatError: litdata no longer has the options this adapts.
    """
    endpoint = str(storage_options.get("endpoint_url") or "")
    if not endpoint.startswith("http://"):
        return
    from litdata.streaming import downloader

    options = getattr(downloader, "_OBSTORE_CLIENT_OPTIONS", None)
    if not isinstance(options, dict):
        raise ShardFormatError(
            "litdata.streaming.downloader._OBSTORE_CLIENT_OPTIONS is gone: litdata changed how it builds obstore "
            f"stores; reading from the plain-HTTP endpoint {endpoint} needs a new adapter in training/shard_format.py"
        )
    if options.get("allow_http") != "true":
        downloader._OBSTORE_CLIENT_OPTIONS = {**options, "allow_http": "true"}


def _split_s3(uri: str) -> tuple[str, str]:
    bucket, _, key = uri[len("s3://"):].partition("/")
    return bucket, key


def _s3_client(storage_options: Optional[dict[str, Any]]) -> Any:
    import boto3

    return boto3.client("s3", **(storage_options or {}))


def read_file_bytes(uri: str, name: str, storage_options: Optional[dict[str, Any]] = None) -> bytes:
    """The bytes of file `name` of split `uri` (local or s3://).

    Raises:
        ShardFormatError: The file is missing or cannot be read.
    """
    if uri.startswith("s3://"):
        bucket, key = _split_s3(f"{uri.rstrip('/')}/{name}")
        options = storage_options if storage_options is not None else storage_options_for(uri)
        try:
            return _s3_client(options).get_object(Bucket=bucket, Key=key)["Body"].read()
        except Exception as e:  # botocore's errors are many; each is "cannot read" here and chained
            raise ShardFormatError(f"cannot read {uri.rstrip('/')}/{name}: {e}") from e
    path = os.path.join(uri, name)
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ShardFormatError(f"cannot read {path}: {e.strerror or e}") from e


def read_meta(uri: str, storage_options: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The split's `meta.json` (see the module docstring for its fields).

    Raises:
        ShardFormatError: It is missing, not JSON, or of another format version.
    """
    raw = read_file_bytes(uri, META_FILE, storage_options)
    try:
        meta = json.loads(raw)
    except ValueError as e:
        raise ShardFormatError(f"{uri}/{META_FILE} is not JSON: {e}") from e
    if (
        not isinstance(meta, dict)
        or meta.get("format_version") != FORMAT_VERSION
        or meta.get("kind") not in ("text", "image")
    ):
        raise ShardFormatError(
            f"{uri}/{META_FILE} is not a shard split of format version {FORMAT_VERSION} (kind text or image): "
            f"{str(meta)[:200]}"
        )
    return meta


def read_token_counts(uri: str, storage_options: Optional[dict[str, Any]] = None) -> np.ndarray:
    """The split's unigram counts (`token_counts.npy`), int64 of length `vocab_size`."""
    import io

    return np.load(io.BytesIO(read_file_bytes(uri, TOKEN_COUNTS_FILE, storage_options)), allow_pickle=False)


def open_split(
    uri: str,
    *,
    sample_tokens: Optional[int] = None,
    cache_dir: Optional[str] = None,
    max_cache_size: Optional[str] = None,
    storage_options: Optional[dict[str, Any]] = None,
    **dataset_kwargs: Any,
) -> "StreamingDataset":
    """The split as a litdata `StreamingDataset`.

    Args:
        uri: The split directory (local or s3://).
        sample_tokens: Text: tokens per item (`block_size + 1` for training;
            1 reads every token). Required for text, unused for images.
        cache_dir: Where chunks read from S3 are kept (litdata's default when None).
        max_cache_size: Bound of that cache, e.g. "2GB".
        storage_options: For boto3; `storage_options_for(uri)` when None.
        **dataset_kwargs: Passed to `StreamingDataset` (shuffle, seed, drop_last, ...).
    """
    from litdata import StreamingDataset
    from litdata.streaming.item_loader import TokensLoader

    meta = read_meta(uri, storage_options)
    options = storage_options if storage_options is not None else storage_options_for(uri)
    kwargs: dict[str, Any] = dict(dataset_kwargs)
    if meta["kind"] == "text":
        if sample_tokens is None or sample_tokens < 1:
            raise ValueError(
                f"open_split({uri!r}): a text split needs sample_tokens >= 1 (block_size + 1), got {sample_tokens!r}"
            )
        kwargs["item_loader"] = TokensLoader(block_size=sample_tokens)
    if cache_dir is not None:
        kwargs["cache_dir"] = cache_dir
    if max_cache_size is not None:
        kwargs["max_cache_size"] = max_cache_size
    if options:
        kwargs["storage_options"] = options
        allow_plain_http(options)
    return StreamingDataset(uri, **kwargs)


# --------------------------------------------------------------------------- chunks


def chunk_items(data: bytes, name: str = "chunk") -> list[memoryview]:
    """The items of one litdata chunk's bytes, by its header (`num_items`, `uint32[num_items + 1]` absolute offsets).

    Raises:
        ShardFormatError: The header does not describe the bytes (a truncated or altered chunk).
    """
    if len(data) < 8:
        raise ShardFormatError(f"{name}: {len(data)} bytes, shorter than a chunk header")
    count = int(np.frombuffer(data, _HEADER, count=1)[0])
    header = 4 * (count + 2)
    if header > len(data):
        raise ShardFormatError(f"{name}: header says {count} items, more than {len(data)} bytes can hold")
    offsets = np.frombuffer(data, _HEADER, count=count + 1, offset=4).astype(np.int64)
    if count and (offsets[0] != header or np.any(np.diff(offsets) < 0) or offsets[-1] != len(data)):
        raise ShardFormatError(
            f"{name}: item offsets {offsets[:3].tolist()}..{offsets[-1:].tolist()} do not fit its {len(data)} bytes"
        )
    view = memoryview(data)
    return [view[offsets[i]:offsets[i + 1]] for i in range(count)]


def text_chunk_documents(data: bytes, name: str = "chunk") -> Iterator[np.ndarray]:
    """The token ids (int32, end-of-document included) of each document in one text chunk, in order."""
    for item in chunk_items(data, name):
        if len(item) % 4:
            raise ShardFormatError(f"{name}: a document of {len(item)} bytes is not whole int32 token ids")
        yield np.frombuffer(item, dtype=np.int32)


def image_chunk_items(data: bytes, name: str, config: dict[str, Any]) -> list[tuple[np.ndarray, int]]:
    """(image, label) of each item of one image chunk, decoded with litdata's numpy serializer.

    `config` is the `config` of the split's index.json: its `data_format`
    (`numpy`, `int`, `int`) and the key order of its `data_spec`.

    Raises:
        ShardFormatError: The chunk or an item does not parse.
    """
    import struct

    from litdata.streaming.serializers import NumpySerializer

    try:
        keys = json.loads(json.loads(config["data_spec"])[1]["context"])
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise ShardFormatError(f"{name}: the index's data_spec does not name the item's keys ({e})") from e
    if sorted(keys) != ["id", "image", "label"] or config.get("data_format") is None or len(config["data_format"]) != 3:
        raise ShardFormatError(f"{name}: items are {keys} of {config.get('data_format')}, not image/label/id")
    numpy = NumpySerializer()
    out = []
    for item in chunk_items(data, name):
        try:
            sizes = struct.unpack_from("<3I", item, 0)
            leaves: dict[str, Any] = {}
            at = 12
            for key, fmt, size in zip(keys, config["data_format"], sizes):
                blob = bytes(item[at:at + size])
                leaves[key] = numpy.deserialize(blob) if fmt == "numpy" else int(np.frombuffer(blob, "<i8")[0])
                at += size
            if at != len(item):
                raise ValueError(f"{len(item)} bytes, the sizes add up to {at}")
        except (struct.error, ValueError, TypeError, IndexError) as e:
            raise ShardFormatError(f"{name}: an item does not decode as image/label/id ({e})") from e
        out.append((leaves["image"], leaves["label"]))
    return out


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# --------------------------------------------------------------------------- writing


@dataclasses.dataclass(frozen=True)
class Provenance:
    """Where one item came from: its landing file, the 1-based line (JSON lines) or 0, and the sha1 of its content."""

    file: str
    record: int
    sha1: str


class _DocumentsTable:
    """`documents.parquet`, written a batch at a time so memory does not grow with the items."""

    def __init__(self, path: str, size_column: str, with_label: bool) -> None:
        import pyarrow as pa

        fields = [
            ("index", pa.int64()),
            ("file", pa.string()),
            ("record", pa.int64()),
            (size_column, pa.int64()),
            ("sha1", pa.string()),
        ]
        if with_label:
            fields.append(("label", pa.int64()))
        self.schema = pa.schema(fields)
        self.path = path
        self.rows: list[tuple[Any, ...]] = []
        self.writer: Any = None

    def add(self, row: tuple[Any, ...]) -> None:
        self.rows.append(row)
        if len(self.rows) >= _DOC_BATCH:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if self.writer is None:
            self.writer = pq.ParquetWriter(self.path, self.schema, compression="zstd")
        columns: list[Any] = list(zip(*self.rows)) if self.rows else [[] for _ in self.schema]
        self.writer.write_table(
            pa.table([pa.array(c, f.type) for c, f in zip(columns, self.schema)], schema=self.schema)
        )
        self.rows = []

    def close(self) -> None:
        if self.rows or self.writer is None:
            self._flush()
        self.writer.close()


class _SplitWriter:
    """The litdata writer of one split directory, its documents table and its checksums; `close()` writes meta.json."""

    def __init__(self, local_dir: str, shard_bytes: int, size_column: str, with_label: bool, tokens: bool) -> None:
        from litdata.streaming.item_loader import TokensLoader
        from litdata.streaming.writer import BinaryWriter

        os.makedirs(local_dir, exist_ok=True)
        if os.listdir(local_dir):
            raise ShardFormatError(f"{local_dir} is not empty; a split is written into an empty directory")
        self.dir = local_dir
        self.items = 0
        self._writer = BinaryWriter(local_dir, chunk_bytes=shard_bytes, item_loader=TokensLoader() if tokens else None)
        self._documents = _DocumentsTable(os.path.join(local_dir, DOCUMENTS_FILE), size_column, with_label)

    def _add(self, item: Any, row: tuple[Any, ...]) -> None:
        with warnings.catch_warnings():
            # A document longer than a shard is a shard of its own: litdata warns, nothing is wrong.
            warnings.filterwarnings("ignore", message="An item was larger than the target chunk size")
            self._writer.add_item(self.items, item)
        self._documents.add((self.items, *row))
        self.items += 1

    def _finish(self, meta: dict[str, Any]) -> dict[str, Any]:
        if self.items:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="An item was larger than the target chunk size")
                self._writer.done()
            self._writer.merge()
            _canonical_index(os.path.join(self.dir, INDEX_FILE))
        self._documents.close()
        chunks = sorted(n for n in os.listdir(self.dir) if n.startswith("chunk-") and n.endswith(".bin"))
        meta = {
            **meta,
            "format_version": FORMAT_VERSION,
            "items": self.items,
            "chunks": {
                n: {
                    "sha256": file_sha256(os.path.join(self.dir, n)),
                    "bytes": os.path.getsize(os.path.join(self.dir, n)),
                }
                for n in chunks
            },
        }
        with open(os.path.join(self.dir, META_FILE), "w") as f:
            json.dump(meta, f, sort_keys=True, indent=1)
        return meta


def _canonical_index(path: str) -> None:
    """Rewrite litdata's index.json without its `updated_at` time stamp: equal chunks give an equal index."""
    with open(path) as f:
        index = json.load(f)
    index.pop("updated_at", None)
    with open(path, "w") as f:
        json.dump(index, f, sort_keys=True)


class TextSplitWriter(_SplitWriter):
    """Writes one text split: documents as token-id items, their unigram counts, the tokenizer beside them.

    Example:
        >>> w = TextSplitWriter("/tmp/train", vocab_size=257, eos_id=256,  # doctest: +SKIP
        ...                     tokenizer_json=b'{"type": "bytes"}', shard_bytes=1 << 22)
        >>> w.add(np.frombuffer(b"hello", np.uint8), Provenance("landing/a.txt", 0, "..."))  # doctest: +SKIP
        >>> meta = w.close()  # doctest: +SKIP
    """

    def __init__(
        self, local_dir: str, *, vocab_size: int, eos_id: int, tokenizer_json: bytes, shard_bytes: int
    ) -> None:
        super().__init__(local_dir, shard_bytes, "tokens", with_label=False, tokens=True)
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.tokens = 0
        self.counts = np.zeros(vocab_size, dtype=np.int64)
        with open(os.path.join(local_dir, TOKENIZER_FILE), "wb") as f:
            f.write(tokenizer_json)

    def add(self, ids: Sequence[int] | np.ndarray, provenance: Provenance) -> None:
        """Append one document (its ids without the end-of-document id, which is added here)."""
        import torch

        doc = np.empty(len(ids) + 1, dtype=np.int32)
        doc[:-1] = ids
        doc[-1] = self.eos_id
        inside = doc[(doc >= 0) & (doc < self.vocab_size)]
        self.counts += np.bincount(inside, minlength=self.vocab_size)
        self.tokens += len(doc)
        self._add(torch.from_numpy(doc), (provenance.file, provenance.record, len(doc), provenance.sha1))

    def close(self) -> dict[str, Any]:
        """Write the chunks, index, counts and meta.json; returns the meta."""
        np.save(os.path.join(self.dir, TOKEN_COUNTS_FILE), self.counts, allow_pickle=False)
        return self._finish({
            "kind": "text", "vocab_size": self.vocab_size, "eos_id": self.eos_id, "tokenizer": TOKENIZER_FILE,
            "dtype": TOKEN_DTYPE, "tokens": self.tokens,
        })


class ImageSplitWriter(_SplitWriter):
    """Writes one image split: `{"image", "label", "id"}` items of a declared shape and dtype."""

    def __init__(
        self,
        local_dir: str,
        *,
        shape: list[int],
        dtype: str,
        min: float,
        max: float,
        labels: list[Any],
        shard_bytes: int,
    ) -> None:
        super().__init__(local_dir, shard_bytes, "bytes", with_label=True, tokens=False)
        self.meta = {
            "kind": "image",
            "shape": list(shape),
            "dtype": dtype,
            "min": min,
            "max": max,
            "labels": list(labels),
        }

    def add(self, image: np.ndarray, label: int, item_id: int, provenance: Provenance) -> None:
        """Append one image (stored as given: validation judges shape, dtype and range) with its label index and id."""
        self._add({"image": np.ascontiguousarray(image), "label": int(label), "id": int(item_id)},
                  (provenance.file, provenance.record, int(image.nbytes), provenance.sha1, int(label)))

    def close(self) -> dict[str, Any]:
        """Write the chunks, index and meta.json; returns the meta."""
        return self._finish(dict(self.meta))


def image_id(relative_path: str) -> int:
    """A stable id of an image: 60 bits of the sha1 of its landing path relative to the source prefix."""
    return int(hashlib.sha1(relative_path.encode()).hexdigest()[:15], 16)
