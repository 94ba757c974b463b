"""Small shard splits for tests, written with litdata as the shard writer writes them (docs/data.md "Shards").

A text split holds `n_docs` random documents (token ids below `vocab_size - 1`,
each ended by `eos_id = vocab_size - 1`); an image split holds the digits as
8x8 images (values 0..16) or generated ones. Each split has its `meta.json`.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import numpy as np
import torch
from litdata.streaming.item_loader import TokensLoader
from litdata.streaming.writer import BinaryWriter


def write_text_split(path: str, n_docs: int = 200, vocab_size: int = 64, block_size: int = 8, chunk_bytes: int = 2048,
                     seed: int = 0, doc_tokens: tuple[int, int] = (5, 60)) -> dict[str, Any]:
    """Write a text split under local directory `path`; returns its meta."""
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    eos = vocab_size - 1
    writer = BinaryWriter(cache_dir=path, chunk_bytes=chunk_bytes, item_loader=TokensLoader())
    counts = np.zeros(vocab_size, dtype=np.int64)
    tokens = 0
    for i in range(n_docs):
        doc = np.append(rng.integers(0, eos, size=int(rng.integers(*doc_tokens))), eos).astype(np.int32)
        writer[i] = torch.from_numpy(doc)
        counts += np.bincount(doc, minlength=vocab_size)
        tokens += len(doc)
    writer.done()
    writer.merge()
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        json.dump({"model": "test"}, f)
    np.save(os.path.join(path, "token_counts.npy"), counts)
    meta = {"kind": "text", "format_version": 1, "vocab_size": vocab_size, "eos_id": eos, "tokenizer": "tokenizer.json",
            "items": n_docs, "tokens": tokens, "block_size": block_size}
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump(meta, f)
    return meta


def write_image_split(path: str, n: Optional[int] = None, chunk_bytes: int = 4096, seed: int = 0, digits: bool = True,
                      shape: tuple[int, ...] = (8, 8)) -> dict[str, Any]:
    """Write an image split under `path`: scikit-learn's digits (the first `n`) or `n` random images of `shape`."""
    os.makedirs(path, exist_ok=True)
    if digits:
        from sklearn.datasets import load_digits

        d = load_digits()
        images, labels = d.images.astype(np.uint8), d.target.astype(int)
        if n is not None:
            images, labels = images[:n], labels[:n]
        low, high = 0, 16
    else:
        rng = np.random.default_rng(seed)
        assert n is not None
        images = rng.integers(0, 256, size=(n, *shape), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n)
        low, high = 0, 255
    writer = BinaryWriter(cache_dir=path, chunk_bytes=chunk_bytes)
    for i, (image, label) in enumerate(zip(images, labels)):
        writer[i] = {"image": image, "label": int(label), "id": i}
    writer.done()
    writer.merge()
    meta = {
        "kind": "image",
        "format_version": 1,
        "shape": list(images.shape[1:]),
        "dtype": "uint8",
        "min": low,
        "max": high,
        "labels": list(range(10)),
        "items": len(images),
    }
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump(meta, f)
    return meta


def write_splits(root: str, kind: str = "text", **kwargs: Any) -> dict[str, str]:
    """Train/val/test splits of `kind` under `root`; returns their paths by split."""
    paths = {}
    for i, split in enumerate(("train", "val", "test")):
        path = os.path.join(root, split)
        if kind == "text":
            write_text_split(path, seed=i, **kwargs)
        else:
            write_image_split(path, seed=i, **kwargs)
        paths[split] = path
    return paths
