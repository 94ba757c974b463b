"""The vision team's image pipeline reaches a champion from landing files through real Dagster runs.

`vision/digit_images`: the bundled digits landed as PNG files in label directories,
image shards, a CNN trained with DDP on 2 processes, promoted on test accuracy; the
served model classifies images sent as a client would send them. (The language model
on the same shard path: tests/e2e/test_shard_lm.py.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pipelines.vision.digit_images import digit_images, land_digit_images
from tests.pipelines.pipeline_fixtures import Harness


def _champion(harness: Harness, name: str) -> Any:
    champion = harness.resources["registry"].get_alias(name, "champion")
    assert champion is not None
    return champion


@pytest.mark.slow
def test_digit_images_reach_a_champion_that_classifies_served_images(tmp_path: Path) -> None:
    import mlflow
    import numpy as np
    import pandas as pd
    from PIL import Image

    spec = digit_images
    landing = tmp_path / "store" / spec.source.prefix
    land_digit_images(landing, 600)
    harness = Harness(tmp_path, spec)
    out = harness.run_all()

    assert out["registered"]["created"] and out["registered"]["champion"], out["registered"]
    metrics = out["best"]["metrics"]
    assert metrics["test_acc"] > 0.7 and metrics["test_acc"] > metrics["baseline_test_acc"], metrics

    # Images the model never saw, read back from PNG files and sent flattened as they are, 0..255.
    fresh = land_digit_images(tmp_path / "fresh", 50, start=1000)
    frame = pd.DataFrame({"image": [np.asarray(Image.open(p)).reshape(-1).tolist() for p in fresh]})
    truth = [int(p.parent.name) for p in fresh]
    mlflow.set_tracking_uri(harness.resources["registry"].tracking_uri)
    served = mlflow.pyfunc.load_model(_champion(harness, spec.model_name).model_uri).predict(frame)
    assert list(served.columns[:1]) == ["label"] and {f"proba_{d}" for d in range(10)} <= set(served.columns)
    assert np.mean(np.asarray(served["label"]) == np.asarray(truth)) > 0.7
