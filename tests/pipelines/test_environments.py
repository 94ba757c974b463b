"""Every environment builds; the cluster one talks to a real PostgreSQL and S3 endpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines.environments import EnvironmentError_, cluster_resources, local_resources, resources_for
from trainyard.search import FloatParam, SearchSpec

RESOURCE_KEYS = {"store", "versioning", "tracking", "launcher", "sweeps", "registry", "handoff", "io_manager"}


def test_local_environment(tmp_path: Path) -> None:
    res = local_resources(tmp_path)
    assert set(res) == RESOURCE_KEYS
    assert res["store"].root == str(tmp_path / "store")
    assert res["sweeps"].storage_url == f"sqlite:///{tmp_path / 'optuna.db'}"
    assert res["registry"].tracking_uri == f"sqlite:///{tmp_path / 'mlflow.db'}"


def test_a_local_code_location_does_not_import_the_kubernetes_client(tmp_path: Path) -> None:
    """Every run worker and code server imports its location: the client's seconds are paid only on a cluster."""
    import subprocess
    import sys

    code = (
        "import sys, pipelines.vision.definitions; print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('kubernetes', 'dagster_k8s')))"
    )
    env = {"PATH": "/usr/bin:/bin", "TRAINYARD_HOME": str(tmp_path), "TRAINYARD_ENV": "local"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_unknown_environment() -> None:
    with pytest.raises(EnvironmentError_, match="TRAINYARD_ENV='staging' is not an environment; use one of"):
        resources_for("staging")


def test_cluster_environment_names_missing_settings() -> None:
    with pytest.raises(EnvironmentError_, match="needs TRAINYARD_S3_ROOT, TRAINYARD_OPTUNA_URL, MLFLOW_TRACKING_URI, "
                                                "TRAINYARD_K8S_NAMESPACE, TRAINYARD_TRAINER_IMAGE to be set"):
        cluster_resources({})  # every one at once
    rest = {
        "TRAINYARD_OPTUNA_URL": "postgresql://o@db/o",
        "MLFLOW_TRACKING_URI": "http://m:5000",
        "TRAINYARD_K8S_NAMESPACE": "ns",
        "TRAINYARD_TRAINER_IMAGE": "trainer:1",
    }
    with pytest.raises(EnvironmentError_, match="must be an s3:// URI"):
        cluster_resources({"TRAINYARD_S3_ROOT": "/data", **rest})


def test_cluster_environment_against_postgres_and_s3(s3_endpoint, pg_databases, tmp_path: Path) -> None:
    optuna_db, mlflow_db = pg_databases
    env = {
        "TRAINYARD_S3_ROOT": s3_endpoint.root("trainyard"),
        "AWS_ENDPOINT_URL": s3_endpoint.url,
        "TRAINYARD_OPTUNA_URL": optuna_db,
        "MLFLOW_TRACKING_URI": mlflow_db,
        "TRAINYARD_HOME": str(tmp_path),
        "TRAINYARD_K8S_NAMESPACE": "team-vision",
        "TRAINYARD_TRAINER_IMAGE": "registry.example/trainyard-trainer:1.0",
    }
    res = cluster_resources(env)
    assert set(res) == RESOURCE_KEYS
    assert type(res["launcher"]).__name__ == "KubernetesLauncher"
    store = res["store"]
    store.write_json(store.uri("probe.json"), {"ok": True})
    assert store.read_json(store.uri("probe.json")) == {"ok": True}
    sweeps = res["sweeps"]
    search = SearchSpec(params={"lr": FloatParam(low=0.01, high=0.1)}, n_trials=3)
    study = sweeps.load_or_create("cluster.probe", "max", search)
    assert sweeps.ensure_trials(study, search) == [0, 1, 2]
    again = sweeps.load_or_create("cluster.probe", "max", search)
    assert sweeps.ensure_trials(again, search) == [0, 1, 2]  # resumed, no duplicates
    sweeps.tell("cluster.probe", 1, 0.5, {"result_uri": "x"})
    assert sweeps.trial("cluster.probe", 1).value == 0.5
    assert res["registry"].list_versions("cluster.probe") == []
