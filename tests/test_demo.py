"""`make demo`'s command on a fresh home: a champion with lineage, and no duplicate on a second run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_demo(home: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k != "DAGSTER_HOME"}
    env["TRAINYARD_HOME"] = str(home)
    proc = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "demo"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.slow
def test_demo_registers_champion_once(tmp_path: Path) -> None:
    first = run_demo(tmp_path)
    assert "registered model : vision.digits version 1 (new)" in first
    assert "champion         : True" in first
    assert first.count("vision__digits__train [trial-") == 4

    from resources.registry import ModelRegistry

    registry = ModelRegistry(
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", artifact_root=str(tmp_path / "store" / "mlflow-artifacts")
    )
    champion = registry.get_alias("vision.digits", "champion")
    assert champion is not None and champion.version == "1"
    for tag in ("trainyard.data_version", "trainyard.code_version", "trainyard.trial", "trainyard.lock_hash"):
        assert champion.tags.get(tag), tag
    accuracy = float(first.split("test accuracy    : ")[1].split()[0])
    assert accuracy > 0.85

    offline_runs = list((tmp_path / "wandb").rglob("offline-run-*"))
    assert len(offline_runs) == 4

    env = {k: v for k, v in os.environ.items() if k != "DAGSTER_HOME"}
    env["TRAINYARD_HOME"] = str(tmp_path)
    repro = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "reproduce", "vision.digits@champion"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert repro.returncode == 0, repro.stdout[-3000:] + repro.stderr[-3000:]
    assert "REPRODUCED" in repro.stdout and "bitwise identical" in repro.stdout

    second = run_demo(tmp_path)
    assert "version 1 (existing, no duplicate)" in second
    assert "vision__digits__train [" not in second
    assert len(registry.list_versions("vision.digits")) == 1
