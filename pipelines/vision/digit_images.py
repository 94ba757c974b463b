"""The vision team's digit images: the same 8x8 digits as `digits`, landed as PNG files and streamed from image shards.

Each image is one PNG file under a directory named for its class
(`landing/vision/digit_images/<label>/<name>.png`), its grey values scaled from
scikit-learn's 0..16 to 0..255. The pipeline writes them as image shards,
validates every image's shape, type and range, splits by image, and streams
the shards to a small CNN (`pipelines.vision.models:DigitsCNN`) trained with
DDP on 2 processes. The registered model takes each image's pixel values
flattened row-major, as they landed, and returns the label and one
probability per class.
"""

from __future__ import annotations

from pathlib import Path

from trainyard import Distribution, FloatParam, ImageShards, ModelSpec, PipelineSpec, SearchSpec, SourceSpec

PREFIX = "landing/vision/digit_images"

digit_images = PipelineSpec(
    team="vision",
    name="digit_images",
    description="Handwritten digits as 8x8 PNG images streamed from shards, a small CNN on 2 processes.",
    source=SourceSpec(prefix=PREFIX, pattern="*/*.png"),
    shards=ImageShards(shape=[8, 8], dtype="uint8", min=0, max=255, labels=list(range(10)), max_duplicate_rate=0.05,
                       shard_bytes=1 << 16),
    min_rows=200,  # images
    model=ModelSpec(path="pipelines.vision.models:DigitsCNN", max_epochs=6, batch_size=32),
    search=SearchSpec(params={"lr": FloatParam(low=2e-3, high=1e-2, log=True)}, n_trials=2),
    distribution=Distribution(nodes=1, procs_per_node=2, strategy="ddp"),
)


def land_digit_images(landing: Path, count: int, *, start: int = 0) -> list[Path]:
    """Write `count` of scikit-learn's bundled digits (from the `start`-th) as PNG files into `landing/<label>/`."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    if start + count > len(digits.images):
        raise ValueError(f"scikit-learn ships {len(digits.images)} digits; {count} from the {start}-th asked")
    written = []
    for i in range(start, start + count):
        folder = landing / str(int(digits.target[i]))
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"digit-{i:05d}.png"
        Image.fromarray(np.round(digits.images[i] * 255 / 16).astype(np.uint8), mode="L").save(path)
        written.append(path)
    return written
