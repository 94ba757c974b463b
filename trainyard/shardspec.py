"""Sharded data kinds: a corpus of documents or a set of images, landed as files and trained from streaming shards.

A pipeline whose `PipelineSpec.shards` is set is not tabular: its landing
files (`source.prefix` / `source.pattern`) are documents or images, `raw_data`
writes them as a content-addressed set of shards (litdata chunks, see
docs/data.md "Shards"), `validated_data` checks every shard and splits at the
document (image) level, and the pod streams the shards through a bounded cache
(`training.streaming`). Such a pipeline declares no `columns` or `target`: the
kind fixes them (`TextShards`: the token stream; `ImageShards`: the image and
its label).

Example:
    >>> TextShards(vocab_size=512, block_size=64).block_size
    64
    >>> ImageShards(shape=[8, 8], labels=list(range(10)), max=16).channels
    1
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import Field, model_validator

from trainyard.search import StrictSpec

TEXT_SUFFIXES = (".txt", ".py", ".md", ".rst", ".jsonl")
"""Landing files a text corpus reads: a `.jsonl` file holds one document a line, any other one document."""
IMAGE_SUFFIXES = (".png", ".npy")
"""Landing files an image set reads: one image each, its class the name of its parent directory."""


class TextShards(StrictSpec):
    """A corpus of documents, tokenized at landing and trained as a causal language model's token stream.

    Landing files: a `.jsonl` file holds one document per line, either text
    (`{"<text_field>": "..."}`) or token ids already made with this pipeline's
    tokenizer (`{"<tokens_field>": [ids]}`); any other file matched by the
    source's pattern is one UTF-8 document.

    - `tokenizer`: `bpe`, a byte-level BPE (the `tokenizers` library) trained
      on the first accepted delivery and then frozen with the pipeline's data
      (its hash is part of every later version), or `bytes` (the 256 byte
      values; needs no training).
    - `vocab_size`: the BPE's size, special tokens included (`bytes`: 257,
      the 256 bytes and end-of-document).
    - `block_size`: tokens in one training sample (the model's context); a
      sample is `block_size + 1` consecutive tokens of the stream, the
      documents joined with the end-of-document token.
    - `min_tokens` / `max_tokens`: a document with fewer than `min_tokens`
      tokens counts as empty, one with more than `max_tokens` as over-long;
      `max_empty_rate`, `max_long_rate` and `max_duplicate_rate` bound their
      share of a delivery's documents (0: any one rejects the version).
    - `shard_bytes`: the size a shard (litdata chunk) is cut at.
    """

    kind: Literal["text"] = "text"
    tokenizer: Literal["bpe", "bytes"] = "bpe"
    vocab_size: int = Field(2048, ge=260, le=65536)
    text_field: str = "text"
    tokens_field: str = "tokens"
    block_size: int = Field(128, ge=2, le=65536)
    min_tokens: int = Field(1, ge=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_empty_rate: float = Field(0.0, ge=0, le=1)
    max_long_rate: float = Field(0.0, ge=0, le=1)
    max_duplicate_rate: float = Field(0.0, ge=0, le=1)
    shard_bytes: int = Field(1 << 22, ge=1 << 12)

    @model_validator(mode="after")
    def _lengths(self) -> "TextShards":
        if self.max_tokens is not None and self.max_tokens < self.min_tokens:
            raise ValueError(f"max_tokens {self.max_tokens} is below min_tokens {self.min_tokens}")
        return self

    @property
    def vocabulary(self) -> int:
        """The number of token ids: `vocab_size` for a BPE, 257 for bytes."""
        return 257 if self.tokenizer == "bytes" else self.vocab_size

    def model_inputs(self) -> dict[str, int]:
        """What the platform gives a model whose constructor takes them: `vocab_size` and `block_size`."""
        return {"vocab_size": self.vocabulary, "block_size": self.block_size}


class ImageShards(StrictSpec):
    """A set of images, one per landing file (`.png` or `.npy`), classified by the name of their parent directory.

    - `shape`: `[height, width]` (one channel) or `[height, width, channels]`;
      every image must have it.
    - `dtype`, `min`, `max`: the pixel type and value range every image must
      keep (a PNG decodes as uint8; an `.npy` array is taken as it is stored).
    - `labels`: the classes; a file under a directory not named for one is rejected.
    - `max_duplicate_rate`: the share of images identical to another that a delivery may hold.
    - `shard_bytes`: the size a shard (litdata chunk) is cut at.
    """

    kind: Literal["image"] = "image"
    shape: list[int] = Field(min_length=2, max_length=3)
    dtype: Literal["uint8", "uint16", "float32"] = "uint8"
    min: float = 0.0
    max: float = 255.0
    labels: list[Union[int, str]] = Field(min_length=2)
    max_duplicate_rate: float = Field(0.0, ge=0, le=1)
    shard_bytes: int = Field(1 << 22, ge=1 << 12)

    @model_validator(mode="after")
    def _sane(self) -> "ImageShards":
        if any(d < 1 for d in self.shape):
            raise ValueError(f"shape {self.shape} must hold positive sizes")
        if self.max <= self.min:
            raise ValueError(f"max {self.max} must be above min {self.min}")
        if len({str(label) for label in self.labels}) != len(self.labels):
            raise ValueError(f"labels {self.labels} repeat a name (a label is a directory name)")
        return self

    @property
    def channels(self) -> int:
        return self.shape[2] if len(self.shape) == 3 else 1

    @property
    def pixels(self) -> int:
        """Values an image holds (height x width x channels): a model's `n_features` when it takes them flat."""
        return self.shape[0] * self.shape[1] * self.channels

    def model_inputs(self) -> dict[str, int]:
        """What the platform gives a model whose constructor takes them (beside `n_features` and `n_classes`)."""
        return {"in_channels": self.channels, "height": self.shape[0], "width": self.shape[1]}


ShardSpec = Annotated[Union[TextShards, ImageShards], Field(discriminator="kind")]
"""`PipelineSpec.shards`: a text corpus or an image set."""

TEXT_FEATURE, TEXT_TARGET = "tokens", "tokens"
"""The names a text pipeline's model input and target go by (the target is the input shifted one token)."""
IMAGE_FEATURE, IMAGE_TARGET = "image", "label"
"""The names an image pipeline's model input and target go by."""
