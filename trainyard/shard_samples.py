"""A shard split's samples as the promotion serves them: token blocks of a text split, images of an image split.

The registration of a sharded pipeline's model (`assets.registration`) sends
the test split to the served model, in its smoke test and to re-evaluate the
champion, as a table a serving client would post:

- text: one row per training sample of the split, exactly the samples the pod
  evaluated (`block_size + 1` consecutive tokens, cut per chunk as litdata's
  `TokensLoader` cuts them: a chunk's tokens in blocks, its last tokens short
  of a whole block dropped), in column `tokens`; column `predicted_tokens` is
  what each row predicts (`block_size`), the weight of its served loss;
- images: one row per image, column `image` its pixel values flattened in
  row-major order as they landed, column `label` its class.

Chunks are read through the object store by `training.shard_format`'s chunk
parsers: numpy alone for text; images decode with litdata's numpy serializer
(which imports litdata, and with it torch). A split larger than `cap` rows gives its first `cap` rows and says so
(`SplitSample.note`): the served metric then decides against the champion on
those rows only, as the training-side value covers the whole split.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from training import shard_format
from trainyard.store import FileStore

if TYPE_CHECKING:
    import pandas as pd  # imported where a frame is made: a code location loads without pandas

TEXT_CAP = 2048
"""At most this many token blocks of a test split are served (the first ones, in chunk order)."""
IMAGE_CAP = 5000
"""At most this many images of a test split are served (the first ones, in chunk order)."""
PREDICTED_TOKENS = "predicted_tokens"
"""The column of a text sample holding what each row predicts: the weight of its served loss."""


@dataclass(frozen=True)
class SplitSample:
    """Rows of a split as served, and what they are.

    Attributes:
        frame: The rows (`tokens` and `predicted_tokens`, or `image` and `label`).
        target: The column a served prediction is scored against.
        total: Rows the whole split has.
        note: None when `frame` is the whole split, else what part it is.
    """

    frame: pd.DataFrame
    target: str
    total: int
    note: Optional[str]


def _index(store: FileStore, uri: str) -> dict[str, Any]:
    with store.open(f"{uri}/{shard_format.INDEX_FILE}", "rb") as f:
        index: dict[str, Any] = json.load(f)
    return index


def text_sample(store: FileStore, uri: str, block_size: int, cap: int = TEXT_CAP) -> SplitSample:
    """The token blocks (`block_size + 1` tokens each) of the text split at `uri`, at most `cap` of them.

    Raises:
        shard_format.ShardFormatError: A chunk does not parse.
    """
    size = block_size + 1
    index = _index(store, uri)
    rows: list[list[int]] = []
    total = 0
    for chunk in index["chunks"]:
        blocks = int(chunk["dim"]) // size
        total += blocks
        if len(rows) >= cap or not blocks:
            continue
        name = chunk["filename"]
        data = store.read_bytes(f"{uri}/{name}")
        docs = list(shard_format.text_chunk_documents(data, name))
        tokens = np.concatenate(docs) if docs else np.zeros(0, dtype=np.int32)
        take = min(blocks, cap - len(rows))
        rows.extend(tokens[: take * size].reshape(take, size).astype(np.int64).tolist())
    import pandas as pd

    frame = pd.DataFrame({"tokens": rows, PREDICTED_TOKENS: [block_size] * len(rows)})
    note = None if len(rows) == total else f"the first {len(rows)} of the test split's {total} blocks"
    return SplitSample(frame, PREDICTED_TOKENS, total, note)


def image_sample(store: FileStore, uri: str, cap: int = IMAGE_CAP) -> SplitSample:
    """The images of the image split at `uri` (flattened, raw) with their labels (as named in meta.json), at most `cap`.

    Raises:
        shard_format.ShardFormatError: A chunk does not parse.
    """
    index = _index(store, uri)
    meta = json.loads(store.read_bytes(f"{uri}/{shard_format.META_FILE}"))
    labels = list(meta["labels"])
    images: list[list[float]] = []
    classes: list[Any] = []
    total = 0
    for chunk in index["chunks"]:
        total += int(chunk["chunk_size"])
        if len(images) >= cap:
            continue
        name = chunk["filename"]
        for image, label in shard_format.image_chunk_items(store.read_bytes(f"{uri}/{name}"), name, index["config"]):
            if len(images) < cap:
                images.append(np.asarray(image).reshape(-1).tolist())
                classes.append(labels[int(label)])
    import pandas as pd

    frame = pd.DataFrame({"image": images, "label": classes})
    note = None if len(images) == total else f"the first {len(images)} of the test split's {total} images"
    return SplitSample(frame, "label", total, note)
