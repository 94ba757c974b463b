"""A text pipeline's tokenizer: the 256 bytes plus end-of-document, or a byte-level BPE trained once and then frozen.

`bytes` needs no training: a document's ids are its UTF-8 bytes and the
end-of-document id is 256. `bpe` is a byte-level BPE of the `tokenizers`
library, trained on the documents of the first delivery (`train_bpe`) and
stored with the pipeline's data; every later delivery is tokenized with those
same bytes, whose hash (`Tokenizer.digest`) is part of every data version
(the file `tokenizer.json` is written beside each split's shards).

Example:
    >>> tok = load_tokenizer(bytes_tokenizer_json())
    >>> tok.encode_batch(["hi"])[0].tolist(), tok.eos_id
    ([104, 105], 256)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Iterable

import numpy as np

EOS_TOKEN = "<|endoftext|>"
"""The BPE's end-of-document token (id 0: the first special token)."""
BYTES_VOCAB = 257
BYTES_EOS = 256


def bytes_tokenizer_json() -> bytes:
    """The description of the bytes tokenizer, as written to `tokenizer.json`."""
    return json.dumps({"type": "bytes", "vocab_size": BYTES_VOCAB, "eos_id": BYTES_EOS}, sort_keys=True).encode()


def train_bpe(texts: Iterable[str], vocab_size: int) -> bytes:
    """Train a byte-level BPE of at most `vocab_size` ids (end-of-document included) on `texts`; its JSON.

    Every byte is in the initial alphabet, so any later text encodes without
    unknown tokens. Training keeps word counts, not the texts.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok.to_str().encode()


@dataclasses.dataclass
class Tokenizer:
    """A loaded tokenizer: `encode_batch`, its end-of-document id, vocabulary size and the digest of its JSON."""

    json_bytes: bytes
    eos_id: int
    vocab_size: int
    _hf: Any = None

    @property
    def digest(self) -> str:
        """sha256 of the tokenizer's JSON (16 hex digits): what a cached tokenization and a data version depend on."""
        return hashlib.sha256(self.json_bytes).hexdigest()[:16]

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """The ids of each text (int32, without the end-of-document id)."""
        if self._hf is None:
            return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int32) for t in texts]
        return [np.asarray(e.ids, dtype=np.int32) for e in self._hf.encode_batch(texts, add_special_tokens=False)]


def load_tokenizer(json_bytes: bytes) -> Tokenizer:
    """A tokenizer from its `tokenizer.json` bytes (the bytes description, or a `tokenizers` BPE).

    Raises:
        ValueError: The bytes are neither.
    """
    try:
        doc = json.loads(json_bytes)
    except ValueError as e:
        raise ValueError(f"tokenizer.json is not JSON: {e}") from e
    if isinstance(doc, dict) and doc.get("type") == "bytes":
        return Tokenizer(json_bytes, BYTES_EOS, BYTES_VOCAB)
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer.from_str(json_bytes.decode())
    eos = hf.token_to_id(EOS_TOKEN)
    if eos is None:
        raise ValueError(f"tokenizer.json has no end-of-document token {EOS_TOKEN!r}")
    return Tokenizer(json_bytes, eos, hf.get_vocab_size(), hf)
