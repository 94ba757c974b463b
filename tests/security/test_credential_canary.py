"""The canary scan: canary credentials in every configurable URL and key, a real pipeline run, and no trace of them.

Locally the whole chain runs through Dagster (prepare, one trial, promote) with
the Optuna study in PostgreSQL behind a canary password, a canary W&B key (W&B
offline), canary AWS keys and a canary MLflow password in the environment.
Then every place a credential could land is read: every file under
TRAINYARD_HOME (object store, specs, results, checkpoints and models opened
as archives, launcher logs, W&B offline runs, the DVC repository, SQLite
databases row by row, Dagster's compressed snapshots and compute logs), the
Dagster event log and run records through the instance, MLflow's runs and
versions through its client, every row of the Optuna database, and what the
run printed. The cluster side cannot run here; its rendered objects are
scanned instead: the cluster code location's job snapshots (resource
configuration included), the trial Job and JobSet the launcher would submit,
and the deploy/ objects and Helm values.
"""

from __future__ import annotations

import importlib.util
import json
import uuid
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from dagster._serdes import serialize_value

from pipelines.environments import cluster_resources
from pipelines.factory import build_definitions
from resources.k8s.manifests import job_manifest, jobset_manifest, service_manifest
from tests.pipelines.pipeline_fixtures import Harness, small_spec, write_landing
from tests.support import train_specs
from tests.support.canary import CanaryScan, postgres_database, postgres_rows
from training.spec import OPTUNA_URL_ENV, SPEC_FILE, OptunaSpec, PrunerSpec, TrainSpec
from trainyard.search import FloatParam, SearchSpec
from trainyard.spec import ModelSpec

ROOT = Path(__file__).resolve().parents[2]


def canaries() -> dict[str, str]:
    tag = uuid.uuid4().hex[:12]
    return {
        "optuna_password": f"CANARY-PW-{tag}",
        "wandb_key": f"canarywandb{tag}{'0' * 17}",  # 40 characters, like a W&B key
        "aws_access_key_id": f"AKIACANARY{tag.upper()}",
        "aws_secret_access_key": f"CANARY-AWS-{tag}/secret",
        "mlflow_password": f"CANARY-MLFLOW-{tag}",
        "pg_password": f"CANARY-PG-{tag}",
    }


def set_canary_environment(monkeypatch: pytest.MonkeyPatch, secrets: dict[str, str], optuna_url: str) -> None:
    for name, value in {
        OPTUNA_URL_ENV: optuna_url,
        "WANDB_API_KEY": secrets["wandb_key"],
        "WANDB_MODE": "offline",
        "AWS_ACCESS_KEY_ID": secrets["aws_access_key_id"],
        "AWS_SECRET_ACCESS_KEY": secrets["aws_secret_access_key"],
        "MLFLOW_TRACKING_USERNAME": "canary",
        "MLFLOW_TRACKING_PASSWORD": secrets["mlflow_password"],
        "PGPASSWORD": secrets["pg_password"],
    }.items():
        monkeypatch.setenv(name, value)


def scan_dagster(scan: CanaryScan, instance: Any) -> int:
    """Every run's record, config, tags, snapshots and every event (messages and metadata); returns the number of
    events."""
    events = 0
    for run in instance.get_runs():
        scan.text(f"dagster run {run.run_id}", serialize_value(run))
        scan.text(
            f"dagster job snapshot of {run.run_id}", serialize_value(instance.get_job_snapshot(run.job_snapshot_id))
        )
        scan.text(
            f"dagster plan snapshot of {run.run_id}",
            serialize_value(instance.get_execution_plan_snapshot(run.execution_plan_snapshot_id)),
        )
        for entry in instance.all_logs(run.run_id):
            scan.text(f"dagster event of {run.run_id}", serialize_value(entry))
            scan.text(f"dagster message of {run.run_id}", entry.user_message)
            events += 1
    return events


def scan_mlflow(scan: CanaryScan, tracking_uri: str) -> int:
    """Every registered version (tags, description, source) and every run (params, tags, metrics); returns the versions
    read."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    versions = 0
    for model in client.search_registered_models():
        scan.text(f"mlflow model {model.name}", (model.tags, model.description, model.aliases))
        for version in client.search_model_versions(f"name='{model.name}'"):
            scan.text(
                f"mlflow version {model.name}/{version.version}",
                (version.tags, version.description, version.source, version.run_id),
            )
            versions += 1
    experiments = [e.experiment_id for e in client.search_experiments()]
    for run in client.search_runs(experiments):
        scan.text(
            f"mlflow run {run.info.run_id}", (run.data.params, run.data.tags, run.data.metrics, run.info.artifact_uri)
        )
    return versions


@pytest.mark.slow  # a whole pipeline: prepare, one Lightning trial under torchrun, registration and its serving check
def test_canary_credentials_appear_nowhere_after_a_local_pipeline_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> None:
    secrets = canaries()
    with postgres_database(secrets["optuna_password"]) as optuna_url:
        set_canary_environment(monkeypatch, secrets, optuna_url)
        home = tmp_path / "home"
        write_landing(home)
        spec = small_spec(
            model=ModelSpec(path="pipelines.vision.models:DigitsMLP", max_epochs=2, batch_size=64),
            search=SearchSpec(
                params={"lr": FloatParam(low=5e-3, high=5e-2, log=True)}, n_trials=1, pruner=PrunerSpec(kind="median")
            ),
        )
        harness = Harness(home, spec)
        assert harness.resources["sweeps"].storage_url_env == OPTUNA_URL_ENV  # the study is the one behind the password
        out = harness.run_all()
        assert int(out["registered"]["version"]) >= 1

        # The trial trained against the study behind the password: its pod reported each epoch there.
        study = optuna.load_study(study_name=out["sweep"]["study"], storage=optuna_url)
        assert [t.state.name for t in study.trials] == ["COMPLETE"] and sorted(study.trials[0].intermediate_values) == [
            0,
            1,
        ]

        scan = CanaryScan(secrets)
        files = scan.tree(home)
        names = [p.name for p in files]
        assert SPEC_FILE in names and "result.json" in names and "launcher.log" in names and "runs.db" in names
        assert any(p.suffix == ".wandb" for p in files), "W&B wrote no offline run"
        written = next(p for p in files if p.name == SPEC_FILE).read_text()
        assert OPTUNA_URL_ENV in written  # the spec names the credentials by reference
        events = scan_dagster(scan, harness.instance)
        versions = scan_mlflow(scan, harness.resources["registry"].tracking_uri)
        scan.rows("optuna database row", postgres_rows(optuna_url))
        printed = capfd.readouterr()
        scan.text("printed output", printed.out + printed.err)
        harness.instance.dispose()

        # The scan reads what it says: what may be shown (the role, the study) is found where it is written.
        probe = CanaryScan({"role": optuna_url.split("://", 1)[1].split(":", 1)[0], "study": out["sweep"]["study"]})
        probe.tree(home)
    assert any(SPEC_FILE in h and h.endswith(": role") for h in probe.hits)
    assert any(
        "runs.db" in h and "[zlib]" in h and h.endswith(": role") for h in probe.hits
    )  # Dagster's compressed job snapshot
    assert any(".wandb" in h and h.endswith(": study") for h in probe.hits)
    assert events > 50 and versions >= 1 and scan.places > len(files)
    assert scan.hits == []


def load_render() -> Any:
    """deploy/render.py, the script that renders the cluster's objects and the Helm values."""
    module_spec = importlib.util.spec_from_file_location("deploy_render", ROOT / "deploy" / "render.py")
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def test_cluster_objects_rendered_with_canary_credentials_hold_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secrets = canaries()
    optuna_url = f"postgresql+psycopg2://optuna:{secrets['optuna_password']}@optuna-db.platform.svc:5432/optuna"
    set_canary_environment(monkeypatch, secrets, optuna_url)
    env = {
        "TRAINYARD_S3_ROOT": "s3://trainyard-canary/store",
        "AWS_ENDPOINT_URL": "http://minio.platform.svc:9000",
        OPTUNA_URL_ENV: optuna_url,
        "MLFLOW_TRACKING_URI": "http://mlflow.platform.svc:5000",
        "TRAINYARD_HOME": str(tmp_path),
        "TRAINYARD_K8S_NAMESPACE": "team-vision",
        "TRAINYARD_TRAINER_IMAGE": "registry.example/trainyard-trainer@sha256:" + "0" * 64,
        "TRAINYARD_K8S_SECRETS": "vision-credentials",
        "WANDB_API_KEY": secrets["wandb_key"],
        "AWS_ACCESS_KEY_ID": secrets["aws_access_key_id"],
        "AWS_SECRET_ACCESS_KEY": secrets["aws_secret_access_key"],
        "MLFLOW_TRACKING_PASSWORD": secrets["mlflow_password"],
        "PGPASSWORD": secrets["pg_password"],
    }
    scan = CanaryScan(secrets)

    # The cluster code location: what Dagster stores of its jobs, resource configuration included.
    resources = cluster_resources(env)
    defs = build_definitions(small_spec(), resources=resources)
    snapshots = [serialize_value(job.get_job_snapshot()) for job in defs.resolve_all_job_defs()]
    assert snapshots and all(OPTUNA_URL_ENV in s for s in snapshots)  # the storage is configured by reference
    scan.rows("cluster job snapshot", snapshots)

    # The objects the Kubernetes launcher submits for a trial of that study.
    spec: TrainSpec = train_specs.make_spec(
        tmp_path, optuna=OptunaSpec.by_reference(resources["sweeps"].connect_url(), study_name="s", trial_number=0),
    )
    scan.text("trial spec", spec.to_json())
    cfg = resources["launcher"].job_config()
    spec_uri = f"{env['TRAINYARD_S3_ROOT']}/runs/trial-0000/{SPEC_FILE}"
    manifests = [
        job_manifest(spec, spec_uri, 0, cfg),
        jobset_manifest(spec, spec_uri, 0, cfg),
        service_manifest("trial-0000", cfg),
    ]
    rendered = [yaml.safe_dump(m) for m in manifests]
    assert any("vision-credentials" in text for text in rendered)  # pods take the credentials from the team's Secret
    scan.rows("trial manifest", rendered)

    # The cluster's objects and the Dagster chart's values (deploy/).
    deploy = load_render().render()
    assert deploy
    scan.rows("deploy object", [f"{path}\n{text}" for path, text in sorted(deploy.items())])
    scan.text("resource config", json.dumps({k: repr(v) for k, v in resources.items()}))
    assert scan.hits == []
