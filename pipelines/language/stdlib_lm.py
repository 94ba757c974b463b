"""The language team's code model: a decoder-only transformer pretrained on the Python standard library's own source.

The corpus ships on every machine: the `.py` files at the top of the running
interpreter's standard library (`stdlib_sources`), each landed as one
document. The pipeline trains a byte-level BPE on the first delivery
(`TextShards(tokenizer="bpe")`, then frozen with the data), cuts the token
stream into shards, validates and splits them by document, and streams them
to a `DecoderLM` trained with FSDP2 over 2 processes (`causal_lm`: promoted on
test perplexity, lower is better, against the champion on the same test split
and a unigram baseline). The registered model takes token ids and returns the
next token's logits; its tokenizer ships with it, so
`training.serving_model.generate("models:/language.stdlib_lm@champion", "def ", 20)`
continues a prompt.
"""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

from trainyard import Distribution, FloatParam, ModelSpec, PipelineSpec, SearchSpec, SourceSpec, TextShards

PREFIX = "landing/language/stdlib_lm"

stdlib_lm = PipelineSpec(
    team="language",
    name="stdlib_lm",
    description="A small decoder-only transformer pretrained on the Python standard library's source (causal LM, "
                "FSDP2 on 2 processes).",
    source=SourceSpec(prefix=PREFIX, pattern="*.py"),
    shards=TextShards(
        tokenizer="bpe",
        vocab_size=1024,
        block_size=64,
        max_duplicate_rate=0.05,
        max_empty_rate=0.02,
        shard_bytes=1 << 18,
    ),
    min_rows=20,  # documents
    model=ModelSpec(
        path="pipelines.language.models:DecoderLM",
        hparams={"width": 64, "heads": 4, "blocks": 2},
        max_epochs=2,
        batch_size=16,  # sequences per process: 32 per step over the 2 ranks
    ),
    search=SearchSpec(params={"lr": FloatParam(low=2e-3, high=6e-3, log=True)}, n_trials=2),
    distribution=Distribution(nodes=1, procs_per_node=2, strategy="fsdp"),
)


def stdlib_sources(count: int, *, start: int = 0, max_bytes: int = 40_000) -> list[Path]:
    """`count` source files of the standard library, in name order from the `start`-th: the top-level `.py` modules
    of at most `max_bytes` each (deterministic for one interpreter version)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file() and 0 < p.stat().st_size <= max_bytes)
    if start + count > len(files):
        raise ValueError(f"the standard library at {root} has {len(files)} modules of at most {max_bytes} bytes; "
                         f"{count} from the {start}-th asked")
    return files[start:start + count]


def land_stdlib(landing: Path, count: int, *, start: int = 0) -> list[Path]:
    """Copy `count` standard-library modules into the landing directory `landing`
    (`<store>/landing/language/stdlib_lm`)."""
    landing.mkdir(parents=True, exist_ok=True)
    landed = []
    for source in stdlib_sources(count, start=start):
        target = landing / source.name
        shutil.copyfile(source, target)
        landed.append(target)
    return landed
