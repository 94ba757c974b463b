"""Reading one landing file of a sharded pipeline into documents or an image, naming every problem by file and line.

A text landing file is a `.jsonl` file (one document a line: the text field,
or the tokens field with ids already made by this pipeline's tokenizer; blank
lines are no document) or any other file (one UTF-8 document). An image
landing file is a `.png` (decoded with Pillow) or a `.npy` array (loaded
without pickle), its label the name of its parent directory.

`check_text_file` and `read_image_file` never raise for bad content: they
collect every problem of the file as `FileIssue`s (each one fatal: the file
cannot be used), so a delivery's report lists all of them at once. A file
with issues yields no documents.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
from typing import Any, Iterator, Optional, Union

import numpy as np

from trainyard.data.landing import FileIssue
from trainyard.shardspec import ImageShards, TextShards
from trainyard.store import FileStore

MAX_LINES_NAMED = 20
"""Lines named in one issue's message; `FileIssue.count` has them all."""
INT32 = (-(2**31), 2**31 - 1)


@dataclasses.dataclass(frozen=True)
class Document:
    """One document: its 1-based line (JSON lines) or 0, its text or its token ids, and the sha1 of its content."""

    record: int
    text: Optional[str]
    ids: Optional[list[int]]
    sha1: str


@dataclasses.dataclass(frozen=True)
class Image:
    """One decoded image with its label's index, as stored: validation judges shape, dtype and range."""

    array: np.ndarray
    label: int
    sha1: str


class _Problems:
    """The issues of one file, grouped by kind and reason, with the lines where each occurs."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.by_reason: dict[tuple[str, str], list[int]] = {}

    def add(self, kind: str, reason: str, line: int = 0) -> None:
        self.by_reason.setdefault((kind, reason), []).append(line)

    def issues(self) -> list[FileIssue]:
        out = []
        for (kind, reason), lines in self.by_reason.items():
            named = [n for n in lines if n][:MAX_LINES_NAMED]
            where = f" line{'s' if len(named) > 1 else ''} {', '.join(map(str, named))}" if named else ""
            more = f" (and {len(lines) - len(named)} more)" if len(lines) > len(named) and named else ""
            out.append(
                FileIssue(
                    kind=kind, message=f"{self.uri}{where}{more}: {reason}", fatal=True, lines=named, count=len(lines)
                )
            )
        return out


def _sha1(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


def _line_document(line: bytes, number: int, shards: TextShards, problems: _Problems) -> Optional[Document]:
    try:
        value = json.loads(line)
    except UnicodeDecodeError as e:
        problems.add("encoding", f"not valid UTF-8 (byte {e.start})", number)
        return None
    except ValueError as e:
        problems.add("format", f"not a JSON object ({getattr(e, 'msg', e)})", number)
        return None
    if not isinstance(value, dict):
        problems.add(
            "format",
            f"a JSON {type(value).__name__}, not an object with {shards.text_field!r} or {shards.tokens_field!r}",
            number,
        )
        return None
    if isinstance(value.get(shards.text_field), str):
        text = value[shards.text_field]
        return Document(number, text, None, _sha1(text.encode("utf-8")))
    ids = value.get(shards.tokens_field)
    if isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        outside = [i for i in ids if not INT32[0] <= i <= INT32[1]]
        if outside:
            problems.add("type", f"token id {outside[0]} does not fit a 32-bit integer", number)
            return None
        return Document(number, None, ids, _sha1(b"ids:" + np.asarray(ids, dtype=np.int32).tobytes()))
    problems.add(
        "format",
        f"needs a text field {shards.text_field!r} (a string) or a tokens field {shards.tokens_field!r} (a list of "
        "integers)",
        number,
    )
    return None


def check_text_file(store: FileStore, uri: str, shards: TextShards) -> tuple[list[FileIssue], int]:
    """Every issue of a text landing file, and its number of documents, found by reading it once (one line at a
    time)."""
    problems = _Problems(uri)
    count = sum(1 for _ in _text_documents(store, uri, shards, problems))
    return problems.issues(), count


def text_documents(store: FileStore, uri: str, shards: TextShards) -> Iterator[Document]:
    """The documents of a text landing file, read one line (or the one whole-file document) at a time; lines with issues
    are skipped."""
    return _text_documents(store, uri, shards, _Problems(uri))


def _text_documents(store: FileStore, uri: str, shards: TextShards, problems: _Problems) -> Iterator[Document]:
    if uri.endswith(".jsonl"):
        with store.open(uri, "rb") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    doc = _line_document(line, number, shards, problems)
                    if doc is not None:
                        yield doc
        return
    data = store.read_bytes(uri)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        problems.add("encoding", f"not valid UTF-8 (byte {e.start})", line)
        return
    yield Document(0, text, None, _sha1(data))


def label_of(uri: str, shards: ImageShards) -> Optional[int]:
    """The index in `shards.labels` of the image's parent directory name, or None when it names no label."""
    parts = uri.rstrip("/").split("/")
    parent = parts[-2] if len(parts) > 1 else ""
    names = [str(label) for label in shards.labels]
    return names.index(parent) if parent in names else None


def decode_image(data: bytes, uri: str) -> Union[np.ndarray, str]:
    """The array of a `.png` or `.npy` file's bytes, or the reason it cannot be decoded."""
    if uri.endswith(".npy"):
        try:
            return np.load(io.BytesIO(data), allow_pickle=False)
        except (ValueError, EOFError, OSError) as e:
            return f"not a readable .npy array ({e})"
    from PIL import Image as PILImage
    from PIL import UnidentifiedImageError

    try:
        with PILImage.open(io.BytesIO(data)) as img:
            img.load()
            return np.asarray(img)
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        return f"not a readable PNG ({e})"


def read_image_file(store: FileStore, uri: str, shards: ImageShards) -> tuple[list[FileIssue], Optional[Image]]:
    """An image landing file decoded, or the issues that keep it from being used (undecodable, or a directory naming no
    label)."""
    problems = _Problems(uri)
    label = label_of(uri, shards)
    if label is None:
        problems.add(
            "format", f"its directory names no label; an image lies in a directory named for one of {shards.labels}"
        )
    data = store.read_bytes(uri)
    array = decode_image(data, uri)
    if isinstance(array, str):
        problems.add("corrupt", array)
    issues = problems.issues()
    if issues or label is None or isinstance(array, str):
        return issues, None
    return [], Image(array, label, _sha1(data))


def jsonable_issues(issues: list[FileIssue]) -> list[dict[str, Any]]:
    return [i.model_dump() for i in issues]
