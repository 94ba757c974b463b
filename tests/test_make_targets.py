"""The UI targets of the Makefile point where the platform writes, read from `make -n` (nothing starts)."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from pipelines.environments import resources_for

ROOT = Path(__file__).resolve().parent.parent
MLFLOW_MODELS_URL = "http://127.0.0.1:5000/#/models?workflowType=machine_learning"


def dry_run(target: str, env: dict[str, str]) -> list[list[str]]:
    """The commands `make <target>` would run, split into words (the install step is taken as done)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINYARD_", "DAGSTER_", "MLFLOW_"))}
    out = subprocess.run(
        ["make", "-s", "-n", "-o", ".venv/.installed", target],
        cwd=ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return [shlex.split(line) for line in out.splitlines() if line.strip()]


def command(target: str, program: str, env: dict[str, str]) -> list[str]:
    return next(words for words in dry_run(target, env) if any(w.endswith(program) for w in words))


def test_optuna_ui_opens_the_local_study_storage(tmp_path: Path) -> None:
    env = {"TRAINYARD_HOME": str(tmp_path)}
    words = command("optuna-ui", "/optuna-dashboard", env)
    assert words[-1] == resources_for(env=env)["sweeps"].storage_url == f"sqlite:///{tmp_path}/optuna.db"


def test_optuna_ui_opens_the_cluster_study_storage(tmp_path: Path) -> None:
    env = {
        "TRAINYARD_ENV": "cluster",
        "TRAINYARD_HOME": str(tmp_path),
        "TRAINYARD_OPTUNA_URL": "postgresql://optuna@db:5432/optuna",
        "TRAINYARD_S3_ROOT": "s3://bucket/trainyard",
        "MLFLOW_TRACKING_URI": "http://mlflow:5000",
        "TRAINYARD_K8S_NAMESPACE": "trainyard",
        "TRAINYARD_TRAINER_IMAGE": "registry/trainer:1",
    }
    words = command("optuna-ui", "/optuna-dashboard", env)
    assert words[-1] == resources_for(env=env)["sweeps"].storage_url == "postgresql://optuna@db:5432/optuna"


def test_mlflow_ui_prints_the_registered_models_page(tmp_path: Path) -> None:
    lines = dry_run("mlflow-ui", {"TRAINYARD_HOME": str(tmp_path)})
    assert ["echo", f"Registered models: {MLFLOW_MODELS_URL}"] in lines
    assert MLFLOW_MODELS_URL in (ROOT / "README.md").read_text()
    assert f"sqlite:///{tmp_path}/mlflow.db" in command("mlflow-ui", "/mlflow", {"TRAINYARD_HOME": str(tmp_path)})


def test_ui_runs_dagster_dev_with_interrupts_at_their_defaults(tmp_path: Path) -> None:
    # A shell that starts `make ui` in the background hands it SIGINT ignored; Dagster
    # then ignores SIGTERM too, so the recipe must reset both for dagster dev.
    words = command("ui", "/dagster", {"TRAINYARD_HOME": str(tmp_path)})
    assert words[:3] == ["exec", "env", "--default-signal=INT,TERM"]
    assert words[4:] == ["dev", "-w", "workspace.yaml", "-p", "3000"]


def test_the_instance_config_lives_only_in_dagster_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pipelines.cli import ensure_dagster_home

    # dagster dev warns about a dagster.yaml in its working folder that is not DAGSTER_HOME's.
    assert not (ROOT / "dagster.yaml").exists() and not (ROOT / "dagster.yml").exists()
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    home = ensure_dagster_home()
    assert (home / "dagster.yaml").read_text() == (ROOT / "deploy" / "local" / "dagster.yaml").read_text()
    assert "tag_concurrency_limits" in (home / "dagster.yaml").read_text()
