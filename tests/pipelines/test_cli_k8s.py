"""`trainyard k8s render`: a catalogue pipeline's trial objects, strictly valid and equal to what its launcher would
create."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from pipelines import cli_k8s
from pipelines.catalog import find_pipeline, workspace_teams
from pipelines.cli import main
from pipelines.team import team_resources
from resources.k8s import manifests
from resources.k8s.launcher import KubernetesLauncher
from resources.storage import ObjectStore
from tests.support.k8s import load_crd_schemas, validate_any
from training.spec import TrackerSpec
from trainyard import naming
from trainyard.trainspec import TrialInputs, build_train_spec
from trainyard.values import ValidatedData

MD5 = "0123456789abcdef0123456789abcdef"
IMAGE = "registry.example/trainyard/trainer@sha256:" + "ab" * 32


@pytest.fixture
def cluster_env(monkeypatch: pytest.MonkeyPatch, s3_endpoint: Any) -> str:
    """The `cluster` environment's variables, as a run pod has them; returns the store root."""
    root = s3_endpoint.root("render")
    for name, value in {
        "TRAINYARD_S3_ROOT": root, "AWS_ENDPOINT_URL": s3_endpoint.url, "TRAINYARD_K8S_NAMESPACE": "platform-default",
        "TRAINYARD_TRAINER_IMAGE": IMAGE, "TRAINYARD_OPTUNA_URL": "postgresql://optuna@db.example/optuna",
        "MLFLOW_TRACKING_URI": "http://mlflow.example:5000", "TRAINYARD_K8S_SECRETS": "s3-credentials",
        "TRAINYARD_K8S_POD": '{"memory": "6Gi", "env": {"NCCL_DEBUG": "WARN"}}',
    }.items():
        monkeypatch.setenv(name, value)
    return root


def rendered(capsys: pytest.CaptureFixture[str], *args: str) -> list[dict[str, Any]]:
    assert main(["k8s", "render", *args]) == 0
    return list(yaml.safe_load_all(capsys.readouterr().out))


def launcher_objects(monkeypatch: pytest.MonkeyPatch, trial: int, kind: str) -> list[dict[str, Any]]:
    """What the launcher of vision's code location creates for trial `trial`, from the spec the trial asset builds."""
    monkeypatch.setenv("TRAINYARD_ENV", "cluster")
    pipeline = find_pipeline("vision/digits")
    team = next(t for t in workspace_teams() if t.name == "vision")
    resources = team_resources(team)
    launcher, store = resources["launcher"], resources["store"]
    assert isinstance(launcher, KubernetesLauncher)
    study = naming.study_name(pipeline, MD5)
    split = f"{resources['store'].root}/somewhere"
    spec = build_train_spec(
        pipeline,
        TrialInputs(naming.trial_key(trial), trial, study, params={"hidden": 48, "lr": 0.003}),
        ValidatedData(
            md5=MD5,
            split_id="s",
            train=f"{split}/train.parquet",
            val=f"{split}/val.parquet",
            test=f"{split}/test.parquet",
            rows={"train": 1, "val": 1, "test": 1},
        ),
        output_uri=naming.run_dir(store, pipeline.team, pipeline.name, study, naming.trial_key(trial)),
        distribution=pipeline.distribution,
        tracker=TrackerSpec(kind="none"),
        optuna_storage_url="postgresql://optuna@db.example/optuna",
        lineage={"pipeline": pipeline.key},
    )
    return launcher.trial_objects(spec, 0, kind)


@pytest.mark.parametrize("kind", ["job", "jobset"])
def test_render_prints_exactly_what_the_launcher_would_create(
    kind: str, cluster_env: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    objects = rendered(capsys, "vision/digits", "--trial", "3", "--kind", kind, "--data-version", MD5)
    assert [o["kind"] for o in objects] == (["Job", "Service"] if kind == "job" else ["JobSet"])
    schemas = load_crd_schemas()
    for obj in objects:
        validate_any(obj, schemas)  # strict: Kubernetes 1.29 and newest, the JobSet CRD
    gang = objects[0]  # the Job (its Service follows) or the JobSet
    pipeline = find_pipeline("vision/digits")
    spec_uri = f"{cluster_env}/runs/vision/digits/{naming.study_name(pipeline, MD5)}/trial-0003/spec.json"
    assert gang["metadata"]["annotations"] == {"trainyard.io/spec-uri": spec_uri}
    # The team's settings (queue, priority) over the platform's (namespace: vision's TeamSpec sets none), the platform's
    # pod settings too.
    assert (
        gang["metadata"]["namespace"] == "platform-default"
        and gang["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "trainyard"
    )
    pod = (
        gang["spec"]["template"] if kind == "job" else gang["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    )["spec"]
    container = pod["containers"][0]
    assert pod["priorityClassName"] == "trainyard-sweep" and container["image"] == IMAGE
    assert (
        container["resources"]["requests"]["memory"] == "6Gi"
        and {"name": "NCCL_DEBUG", "value": "WARN"} in container["env"]
    )
    assert container["command"][:3] == ["python", "-m", "training.gang"] and container["command"][-1] == spec_uri
    assert objects == launcher_objects(monkeypatch, 3, kind)


def test_the_data_version_defaults_to_the_newest_accepted_one(
    cluster_env: str, s3_endpoint: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    pipeline = find_pipeline("vision/digits")
    assert main(["k8s", "render", "vision/digits"]) == 2
    assert "vision/digits has no accepted data version in " in capsys.readouterr().err
    store = ObjectStore(root=cluster_env, endpoint_url=s3_endpoint.url)
    store.write_json(naming.validated_latest(store, "vision", "digits"), {"md5": "f" * 32, "split_id": "x"})
    (gang,) = rendered(capsys, "vision/digits")  # the launcher's default gang kind: one JobSet
    assert gang["kind"] == "JobSet"
    assert (
        f"/{naming.study_name(pipeline, 'f' * 32)}/trial-0000/spec.json"
        in gang["metadata"]["annotations"]["trainyard.io/spec-uri"]
    )
    assert gang["metadata"]["labels"]["trainyard.io/attempt"] == "0"


def test_bad_input_is_named(
    cluster_env: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert cli_k8s.GANG_KINDS == manifests.GANG_KINDS  # `--kind` offers what the builder takes
    assert main(["k8s", "render", "vision/nope", "--data-version", MD5]) == 2
    assert "no pipeline 'vision/nope'; known pipelines: [" in capsys.readouterr().err
    assert main(["k8s", "render", "vision/digits", "--trial", "-1", "--data-version", MD5]) == 2
    assert "--trial -1" in capsys.readouterr().err
    monkeypatch.delenv("TRAINYARD_TRAINER_IMAGE")
    assert main(["k8s", "render", "vision/digits", "--data-version", MD5]) == 2
    assert "needs TRAINYARD_TRAINER_IMAGE to be set" in capsys.readouterr().err


def test_a_new_user_is_told_every_missing_setting_at_once_and_a_storage_error_in_one_line(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "TRAINYARD_S3_ROOT",
        "TRAINYARD_K8S_NAMESPACE",
        "TRAINYARD_TRAINER_IMAGE",
        "TRAINYARD_OPTUNA_URL",
        "MLFLOW_TRACKING_URI",
        "TRAINYARD_K8S_POD",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_ENDPOINT_URL",
    ):
        monkeypatch.delenv(name, raising=False)
    assert main(["k8s", "render", "vision/digits"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for name in (
        "TRAINYARD_S3_ROOT",
        "TRAINYARD_OPTUNA_URL",
        "MLFLOW_TRACKING_URI",
        "TRAINYARD_K8S_NAMESPACE",
        "TRAINYARD_TRAINER_IMAGE",
    ):
        assert name in err, err
    # every setting there, but the object store refuses the read (no endpoint answers on a closed port)
    for name, value in {
        "TRAINYARD_S3_ROOT": "s3://nowhere-bucket/root",
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
        "TRAINYARD_K8S_NAMESPACE": "ns",
        "TRAINYARD_TRAINER_IMAGE": IMAGE,
        "TRAINYARD_OPTUNA_URL": "postgresql://optuna@db.example/optuna",
        "MLFLOW_TRACKING_URI": "http://mlflow.example:5000",
        "AWS_ACCESS_KEY_ID": "x",
        "AWS_SECRET_ACCESS_KEY": "y",
        "AWS_MAX_ATTEMPTS": "1",
        "AWS_RETRY_MODE": "standard",
    }.items():
        monkeypatch.setenv(name, value)
    assert main(["k8s", "render", "vision/digits"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert (
        "cannot read vision/digits's data versions from s3://nowhere-bucket/root" in err and "--data-version" in err
    ), err
