"""A tiny in-memory token corpus that honours the language-model data module contract of `training.streaming`.

`TinyTextData` cuts a repetitive text into samples of `block_size + 1`
consecutive tokens (`x` the first `block_size`, `y` the last `block_size`), as
the streaming module cuts its shards, and has the attributes a causal_lm trial
reads: `vocab_size`, `block_size`, `eos_id`, `tokenizer_path`,
`train_token_counts()` and `example_input()`. Tokens are UTF-8 bytes (257 ids,
end-of-document 256), or the ids of a byte-level BPE (`train_bpe`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

SENTENCES = (
    "the quick brown fox jumps over the lazy dog. ",
    "pack my box with five dozen liquor jugs. ",
    "how vexingly quick daft zebras jump! ",
)
"""The corpus: these sentences, in this order, over and over (a test model memorises the cycle)."""
BYTES_TOKENIZER = {"type": "bytes", "vocab_size": 257, "eos_id": 256}


def corpus(repeats: int = 40) -> str:
    return "".join(SENTENCES) * repeats


def train_bpe(path: Path, vocab_size: int = 300) -> Path:
    """Train a byte-level BPE on the corpus and save the `tokenizers` JSON to `path` (end-of-document `<eos>`)."""
    from tokenizers import ByteLevelBPETokenizer

    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(list(SENTENCES) * 5, vocab_size=vocab_size, min_frequency=1, special_tokens=["<eos>"])
    tokenizer.save(str(path))
    return path


class TinyTextData(L.LightningDataModule):
    """Samples of a repeated text: 60 % train, 20 % val, 20 % test of the windows, in order.

    Args:
        train_uri, val_uri, test_uri, features, target: the platform's arguments, unused (the corpus is in memory).
        batch_size: rows per batch.
        block_size: tokens per sample's input.
        tokenizer_path: a `tokenizers` JSON (a byte-level BPE); None: UTF-8 bytes (written beside `workdir`).
        repeats: how many times the sentences are repeated.
        workdir: where the bytes tokenizer description is written (default: a temporary directory).
        seed: the train loader's shuffle.
    """

    def __init__(
        self,
        train_uri: str = "",
        val_uri: str = "",
        test_uri: str = "",
        features: Any = None,
        target: str = "tokens",
        batch_size: int = 16,
        block_size: int = 16,
        tokenizer_path: Optional[str] = None,
        repeats: int = 40,
        workdir: Optional[str] = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.batch_size, self.block_size, self.seed = batch_size, block_size, seed
        if tokenizer_path is None:
            import tempfile

            where = Path(workdir or tempfile.mkdtemp(prefix="tiny-lm-"))
            where.mkdir(parents=True, exist_ok=True)
            tokenizer_path = str(where / "tokenizer.json")
            Path(tokenizer_path).write_text(json.dumps(BYTES_TOKENIZER))
            ids = list(corpus(repeats).encode("utf-8"))
            self.vocab_size, self.eos_id = 257, 256
        else:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(tokenizer_path)
            ids = tok.encode(corpus(repeats)).ids
            self.vocab_size, self.eos_id = tok.get_vocab_size(), tok.token_to_id("<eos>")
        self.tokenizer_path = tokenizer_path
        stream = torch.tensor(ids + [self.eos_id], dtype=torch.int64)
        n = len(stream) // (block_size + 1)
        windows = stream[: n * (block_size + 1)].reshape(n, block_size + 1)
        cut = [0, int(n * 0.6), int(n * 0.8), n]
        cut[1] -= cut[1] % 2  # even train and val splits: 2 ranks read them without DistributedSampler's padding row
        cut[2] -= (cut[2] - cut[1]) % 2
        self.rows = {split: windows[cut[i]:cut[i + 1]] for i, split in enumerate(("train", "val", "test"))}

    def _loader(self, split: str, shuffle: bool = False) -> DataLoader:
        rows = self.rows[split]
        generator = torch.Generator().manual_seed(self.seed) if shuffle else None
        return DataLoader(
            TensorDataset(rows[:, :-1], rows[:, 1:]), batch_size=self.batch_size, shuffle=shuffle, generator=generator
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    def train_token_counts(self) -> np.ndarray:
        return np.bincount(self.rows["train"][:, 1:].reshape(-1).numpy(), minlength=self.vocab_size).astype(np.int64)

    def example_input(self) -> torch.Tensor:
        return self.rows["train"][:2, :-1].clone()
