"""Small corpora and image sets for the shard tests: seeded, a few kilobytes, written as landing files."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path
from typing import Any

import numpy as np

from trainyard.shardspec import ImageShards, TextShards
from trainyard.spec import ModelSpec, PipelineSpec, SourceSpec, SplitSpec

WORDS = ("the model reads a stream of tokens and learns which one comes next from the documents it was given "
         "data versions are pinned shards are checked splits are stable").split()
TEXT_PREFIX = "landing/language/corpus"
IMAGE_PREFIX = "landing/vision/glyphs"


def text_spec(**shards: Any) -> PipelineSpec:
    """A text pipeline over `TEXT_PREFIX` (`*.jsonl` and `*.txt`), bytes tokenizer unless overridden, small shards."""
    fields: dict[str, Any] = {"tokenizer": "bytes", "block_size": 16, "shard_bytes": 1 << 12, **shards}
    top = {k: fields.pop(k) for k in ("on_drift", "on_bad_data", "min_rows") if k in fields}
    return PipelineSpec(
        team="language", name="corpus", source=SourceSpec(prefix=TEXT_PREFIX, pattern=["*.jsonl", "*.txt"]),
        shards=TextShards(**fields), split=SplitSpec(val_fraction=0.2, test_fraction=0.2, seed=3),
        model=ModelSpec(path="pipelines.language.models:DecoderLM"), **top,
    )


def image_spec(**over: Any) -> PipelineSpec:
    """An image pipeline of 8x8 uint8 digits under `IMAGE_PREFIX/<label>/*.png`."""
    return PipelineSpec(
        team="vision",
        name="glyphs",
        source=SourceSpec(prefix=IMAGE_PREFIX, pattern=["*/*.png", "*/*.npy"]),
        shards=ImageShards(shape=[8, 8], labels=list(range(10)), shard_bytes=1 << 12),
        split=SplitSpec(val_fraction=0.2, test_fraction=0.2, seed=3),
        model=ModelSpec(path="pipelines.vision.models:DigitsMLP"),
        **over,
    )


def sentences(n: int, seed: int, words: tuple[str, ...] = tuple(WORDS)) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 25))) for _ in range(n)]


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


def write_corpus(root: Path, files: int = 3, per_file: int = 20, seed: int = 0) -> list[Path]:
    """`files` JSON-lines files of `per_file` documents each, plus one plain-text document, under `root/TEXT_PREFIX`."""
    land = root / TEXT_PREFIX
    out = [write_jsonl(land / f"part-{i}.jsonl", sentences(per_file, seed * 100 + i)) for i in range(files)]
    readme = land / "readme.txt"
    readme.write_text("\n".join(sentences(5, seed * 100 + 99)), encoding="utf-8")
    return [*out, readme]


def digit_pngs(root: Path, count: int = 120) -> list[Path]:
    """scikit-learn's digits, scaled to 0..255 uint8, as 8x8 PNGs under `root/IMAGE_PREFIX/<label>/<i>.png`."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    out = []
    for i in range(count):
        pixels = np.round(digits.images[i] * (255.0 / 16.0)).astype(np.uint8)
        path = root / IMAGE_PREFIX / str(int(digits.target[i])) / f"{i:04d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        Image.fromarray(pixels, mode="L").save(buf, format="PNG")
        path.write_bytes(buf.getvalue())
        out.append(path)
    return out
