"""The language team's code model reaches a champion from landing files through real Dagster runs.

`language/stdlib_lm`: standard-library modules landed as documents; a BPE trained on
the first delivery, token shards, a decoder-only transformer trained with FSDP2 on
2 processes, promoted on test perplexity (lower is better) with the unigram baseline
beaten; the served model continues a prompt in the registration's smoke test and in a
fresh process. A second delivery retrains on the same frozen tokenizer and the champion
is re-evaluated, served, on the new test split. (The image pipeline, the second consumer
of the same shard path: tests/e2e/test_shard_images.py.)
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
from tests.pipelines.pipeline_fixtures import Harness


def _champion(harness: Harness, name: str) -> Any:
    champion = harness.resources["registry"].get_alias(name, "champion")
    assert champion is not None
    return champion


@pytest.mark.slow
def test_the_code_model_reaches_a_champion_that_continues_a_prompt_and_a_second_delivery_retrains(
    tmp_path: Path,
) -> None:
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
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2]
    )
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
