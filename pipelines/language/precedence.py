"""The language team's precedence classifier: which of four signal tokens comes first in a sequence.

Each row is a sequence of `LENGTH` tokens (`t00`..`t31`, ids 0..`VOCAB`-1).
Tokens 0-3 are signals and appear exactly once each, at random positions;
the other positions hold filler tokens 4..15 drawn uniformly. The label is the
signal that occurs first. Every sequence holds the same multiset of signals
and the fillers are independent of the label, so a bag-of-words model is at
chance (25 %); the label is in the order alone, which a one-block transformer
learns in a few epochs. The data is generated deterministically (no download).

A tiny transformer encoder (`pipelines.language.models:SequenceTransformer`),
trained with FSDP2 over 2 processes, a 2-trial sweep, promotion on test accuracy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainyard import (
    CategoricalParam,
    ColumnSpec,
    Distribution,
    FloatParam,
    ModelSpec,
    PipelineSpec,
    SearchSpec,
    SourceSpec,
)

if TYPE_CHECKING:
    import pandas as pd

LENGTH, VOCAB, SIGNALS = 32, 16, 4
TOKENS = [f"t{i:02d}" for i in range(LENGTH)]
TARGET = "first"

precedence = PipelineSpec(
    team="language",
    name="precedence",
    description="Which of four signal tokens occurs first in a 32-token sequence; a one-block transformer, FSDP2 on 2 "
                "processes.",
    source=SourceSpec(prefix="landing/language/precedence", pattern="*.csv"),
    columns={
        # Token ids are integers (the registered signature takes them as longs); the model
        # reads them as float32 features like every model on the platform and casts back.
        **{t: ColumnSpec(dtype="int", min=0, max=VOCAB - 1) for t in TOKENS},
        TARGET: ColumnSpec(dtype="int", domain=list(range(SIGNALS))),
    },
    target=TARGET,
    min_rows=1000,
    model=ModelSpec(
        path="pipelines.language.models:SequenceTransformer",
        hparams={"vocab": VOCAB, "heads": 4, "blocks": 1},
        max_epochs=12,
        batch_size=32,  # per process: 64 sequences per step over the 2 ranks
        monitor="val_acc",
    ),
    search=SearchSpec(
        params={"lr": FloatParam(low=3e-3, high=1e-2, log=True), "width": CategoricalParam(choices=[32, 64])},
        n_trials=2,
    ),
    distribution=Distribution(nodes=1, procs_per_node=2, strategy="fsdp"),
)


def landing_frame(rows: int = 2000, seed: int = 0) -> "pd.DataFrame":
    """`rows` sequences as this pipeline's landing columns (for demos, tests, benchmarks).

    Deterministic in (`rows`, `seed`) and balanced: labels cycle through the
    four signals (so each class has `rows / 4` rows, give or take one) before
    the rows are shuffled.

    Example:
        >>> landing_frame(8)[TARGET].value_counts().sort_index().to_dict()
        {0: 2, 1: 2, 2: 2, 3: 2}
    """
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(rows) % SIGNALS)
    tokens = rng.integers(SIGNALS, VOCAB, size=(rows, LENGTH))
    for row, label in enumerate(labels):
        places = np.sort(rng.choice(LENGTH, SIGNALS, replace=False))
        others = rng.permutation([s for s in range(SIGNALS) if s != label])
        tokens[row, places] = [label, *others]
    frame = pd.DataFrame(tokens, columns=TOKENS)
    frame[TARGET] = labels
    return frame
