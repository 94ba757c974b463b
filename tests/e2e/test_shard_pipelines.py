"""The two sharded pipelines the platform ships reach a champion from landing files through real Dagster runs.

- `language/stdlib_lm`: standard-library modules landed as documents; a BPE trained on
  the first delivery, token shards, a decoder-only transformer trained with FSDP2 on
  2 processes, promoted on test perplexity (lower is better) with the unigram baseline
  beaten; the served model continues a prompt in a fresh process. A second delivery
  retrains on the same frozen tokenizer and the champion is re-evaluated, served, on
  the new test split.
- `vision/digit_images`: the bundled digits landed as PNG files in label directories,
  image shards, a CNN trained with DDP on 2 processes, promoted on test accuracy; the
  served model classifies images sent as a client would send them.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pipelines.language.stdlib_lm import land_stdlib, stdlib_lm
from pipelines.vision.digit_images import digit_images, land_digit_images
from tests.pipelines.pipeline_fixtures import Harness


def _champion(harness: Harness, name: str) -> Any:
    champion = harness.resources["registry"].get_alias(name, "champion")
    assert champion is not None
    return champion


@pytest.mark.slow
def test_the_code_model_reaches_a_champion_that_continues_a_prompt_and_a_second_delivery_retrains(tmp_path: Path) -> None:
    spec = stdlib_lm
    landing = tmp_path / "store" / spec.source.prefix
    land_stdlib(landing, 40)
    harness = Harness(tmp_path, spec)
    first = harness.run_all()

    assert first["registered"]["created"] and first["registered"]["champion"], first["registered"]
    metrics = first["best"]["metrics"]
    assert metrics["test_perplexity"] == pytest.approx(math.exp(metrics["test_loss"]), rel=1e-6)
    assert metrics["test_perplexity"] < metrics["baseline_test_perplexity"], metrics  # better than the unigram model
    assert metrics["tokens_per_second"] > 0

    # The served champion continues a prompt in a process of its own, with only what serving needs: in the
    # registration's smoke test (the first test tokens), and from a text prompt here.
    champion = _champion(harness, spec.model_name)
    tags = harness.resources["registry"].get_version(spec.model_name, champion.version).tags
    smoke = {c["name"]: c for c in json.loads(tags["trainyard.promotion.checks"])}["serving_smoke_test"]
    assert smoke["passed"] and "continued a 8-token prompt with " in smoke["detail"], smoke
    script = (
        "import json, sys, mlflow\n"
        "from training.serving_model import generate\n"
        f"mlflow.set_tracking_uri({harness.resources['registry'].tracking_uri!r})\n"
        f"print(json.dumps(generate({champion.model_uri!r}, 'def ', 12)))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    text = json.loads(done.stdout.strip().splitlines()[-1])  # the continuation alone
    assert isinstance(text, str) and text, text

    # A second delivery: more modules, the same frozen tokenizer; the champion is re-evaluated on the new test split.
    land_stdlib(landing, 12, start=40)
    second = harness.run_all()
    assert second["registered"]["created"] and second["registered"]["version"] != first["registered"]["version"]
    assert second["best"]["lineage"]["data_version"] != first["best"]["lineage"]["data_version"]
    version = harness.resources["registry"].get_version(spec.model_name, second["registered"]["version"])
    checks = {c["name"]: c for c in json.loads(version.tags["trainyard.promotion.checks"])}
    assert "re-evaluated" in checks["beats_champion"]["detail"] or checks["beats_champion"]["passed"], checks


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
