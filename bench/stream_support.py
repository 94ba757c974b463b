"""What the streaming benchmarks share: a text corpus written as the shard writer writes it, and a paired-ratio verdict.

`write_corpus` writes a `text` split (`training.streaming`'s format: litdata
chunks of one int32 tensor per document, end-of-document appended, and a
`meta.json`) of random documents of 200-2000 tokens over a vocabulary of
2048 tokens unless told otherwise. `paired_ratios` turns alternated platform/reference repetitions
into the per-pair ratios, their median and a 95% Student-t interval of their
mean, and says whether the interval resolves the target ("met" only when the
whole interval is on the right side; spanning it is "not resolved").
"""

from __future__ import annotations

import json
import os
import statistics
from typing import Any, Sequence

VOCAB = 2048


def write_corpus(
    path: str, tokens: int, seed: int = 0, chunk_bytes: int = 1 << 22, block_size: int = 128, vocab: int = VOCAB
) -> dict[str, Any]:
    """Write a text split of about `tokens` token ids (below `vocab`, the last one end-of-document) under `path`;
    returns its meta."""
    import numpy as np
    import torch
    from litdata.streaming.item_loader import TokensLoader
    from litdata.streaming.writer import BinaryWriter

    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    eos = vocab - 1
    writer = BinaryWriter(cache_dir=path, chunk_bytes=chunk_bytes, item_loader=TokensLoader())
    counts = np.zeros(vocab, dtype=np.int64)
    written, i = 0, 0
    while written < tokens:
        doc = np.append(rng.integers(0, eos, size=int(rng.integers(200, 2000))), eos).astype(np.int32)
        writer[i] = torch.from_numpy(doc)
        counts += np.bincount(doc, minlength=vocab)
        written += len(doc)
        i += 1
    writer.done()
    writer.merge()
    np.save(os.path.join(path, "token_counts.npy"), counts)
    meta = {
        "kind": "text",
        "format_version": 1,
        "vocab_size": vocab,
        "eos_id": eos,
        "items": i,
        "tokens": written,
        "block_size": block_size,
    }
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump(meta, f)
    return meta


def paired_ratios(ours: Sequence[float], theirs: Sequence[float], target: float, better: str) -> dict[str, Any]:
    """Per-pair `ours / theirs` (pair i ran one after the other), their median, a 95% t-interval of their mean, a
    verdict.

    `better` is "higher" (target is a floor) or "lower" (a ceiling). The verdict is "met" when the whole
    interval is on the target's good side, "missed" when all of it is on the other, else "not resolved".
    """
    from bench.sim.stats import t_interval

    ratios = [o / t for o, t in zip(ours, theirs, strict=True)]
    out: dict[str, Any] = {"pair_ratios": ratios, "median": statistics.median(ratios)}
    if len(ratios) < 2:
        return out | {"verdict": "not resolved (fewer than two pairs)"}
    interval = t_interval(ratios)
    good, bad = (interval["ci_low"] >= target, interval["ci_high"] < target) if better == "higher" else \
        (interval["ci_high"] <= target, interval["ci_low"] > target)
    verdict = "met" if good else "missed" if bad else "not resolved"
    op = ">=" if better == "higher" else "<="
    return out | {
        "mean": interval["mean"],
        "ci_low": interval["ci_low"],
        "ci_high": interval["ci_high"],
        "confidence": 0.95,
        "verdict": f"{verdict} (ratio {op} {target}, 95% t-interval of the mean of {len(ratios)} pair ratios)",
    }
