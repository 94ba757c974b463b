"""`make kind-e2e` (deploy/kind/e2e.sh): skipped with its reason where no Docker daemon runs; its driver's gang is two
nodes.

The end-to-end run itself needs Docker, kind and the internet, which no build machine
of this project has; what can be checked here is checked: the script's skip path
(run for real, with a `docker` that cannot reach a daemon), its syntax, and that the
driver builds the cluster environment's digits pipeline as a 2-node trial.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "kind" / "e2e.sh"
CLUSTER_ENV = {
    "TRAINYARD_ENV": "cluster",
    "TRAINYARD_S3_ROOT": "s3://trainyard/e2e",
    "TRAINYARD_OPTUNA_URL": "postgresql://postgres@db:5432/optuna",
    "MLFLOW_TRACKING_URI": "postgresql://postgres@db:5432/mlflow",
    "TRAINYARD_K8S_NAMESPACE": "vision",
    "TRAINYARD_TRAINER_IMAGE": "trainyard/trainer:kind",
}


def _run(path: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT)], env={**os.environ, "PATH": path}, capture_output=True, text=True, timeout=60
    )


def test_without_a_docker_daemon_it_says_so_and_exits_0(tmp_path: Path) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    docker = fake / "docker"
    docker.write_text("#!/bin/sh\necho 'Cannot connect to the Docker daemon' >&2\nexit 1\n")
    docker.chmod(0o755)
    done = _run(f"{fake}:/usr/bin:/bin")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "kind-e2e: skipped: no Docker daemon answers (docker info failed)"


def test_without_docker_at_all_it_says_so(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    bash_dir = Path(
        subprocess.run(["bash", "-c", "command -v dirname"], capture_output=True, text=True).stdout.strip()
    ).parent
    if (bash_dir / "docker").exists():
        pytest.skip(f"docker is installed next to bash in {bash_dir}: no PATH without docker but with bash")
    done = _run(f"{empty}:{bash_dir}")
    assert done.returncode == 0 and done.stdout.strip() == "kind-e2e: skipped: no docker command", (
        done.stdout + done.stderr
    )


def test_the_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)


def test_the_driver_trains_digits_as_one_trial_on_two_nodes_in_the_cluster_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key, value in CLUSTER_ENV.items():
        monkeypatch.setenv(key, value)
    spec = importlib.util.spec_from_file_location("run_gang", ROOT / "deploy" / "kind" / "run_gang.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    pipeline = module.gang_pipeline()
    assert (pipeline.distribution.nodes, pipeline.distribution.procs_per_node, pipeline.search.n_trials) == (2, 1, 1)
    assert pipeline.key == "vision/digits" and pipeline.columns == module.digits.columns
    from pipelines.team import team_definitions

    defs = team_definitions(module.team, pipeline)
    launcher = defs.resources["launcher"]
    assert type(launcher).__name__ == "KubernetesLauncher" and launcher.namespace == "vision"
