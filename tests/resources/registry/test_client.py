"""ModelRegistry on a real MLflow: SQLite tracking/registry, artifacts in a temp dir."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pydantic
import pytest
import torch

from resources.registry import (
    TRIAL_KEY_TAG,
    ModelRegistry,
    RegistryError,
    RegistryNotFound,
    RegistryUnavailable,
)
from tests.support.models import export_model

REPO = Path(__file__).resolve().parents[2]
FEATURES = ["f0", "f1", "f2", "f3"]
CLASSES = [10, 20, 30]  # not 0..n-1, so the argmax -> label mapping is exercised
MODEL = "tiny"


def torch_labels(model: torch.nn.Module, df: pd.DataFrame) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor(df[FEATURES].to_numpy(), dtype=torch.float32))
    return np.asarray(CLASSES)[logits.argmax(dim=1).numpy()]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("registry")


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(len(FEATURES), len(CLASSES)).eval()


@pytest.fixture(scope="module")
def model_dir(workdir: Path, model: torch.nn.Module) -> Path:
    return export_model(model, workdir / "trial-0000", FEATURES, CLASSES)


@pytest.fixture(scope="module")
def frame(model: torch.nn.Module) -> pd.DataFrame:
    """64 rows whose label is the model's own prediction, with an extra column."""
    rng = np.random.default_rng(0)
    df = pd.DataFrame(rng.normal(size=(64, len(FEATURES))), columns=FEATURES)
    df["label"] = torch_labels(model, df)
    df["note"] = "ignored"
    return df


@pytest.fixture(scope="module")
def registry(workdir: Path) -> ModelRegistry:
    return ModelRegistry(
        tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}",
        artifact_root=str(workdir / "mlartifacts"),
    )


def _register(registry: ModelRegistry, model_dir: Path, frame: pd.DataFrame, trial_key: str, name: str = MODEL):
    return registry.register(
        name,
        str(model_dir),
        trial_key=trial_key,
        tags={"trainyard.data_version": "md5-abc", "trainyard.git_commit": "deadbeef"},
        metrics={"test_accuracy": 0.5, "val_loss": 1.25},
        description="tiny linear model",
        input_example=frame,
    )


def no_waiting(registry: ModelRegistry) -> ModelRegistry:
    """The same registry, with backoff and lock polling that return at once."""
    quick = ModelRegistry(tracking_uri=registry.tracking_uri, artifact_root=registry.artifact_root)
    quick._sleep = lambda seconds: None
    return quick


@pytest.fixture(scope="module")
def registered(registry: ModelRegistry, model_dir: Path, frame: pd.DataFrame):
    return _register(registry, model_dir, frame, "tiny/md5-abc/trial-0000")


def test_register_creates_version_with_lineage(registry: ModelRegistry, registered) -> None:
    assert registered.created is True
    assert registered.name == MODEL
    assert registered.version == "1"
    assert registered.model_uri == "models:/tiny/1"
    assert registered.tags[TRIAL_KEY_TAG] == "tiny/md5-abc/trial-0000"
    assert registered.tags["trainyard.data_version"] == "md5-abc"

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=registry.tracking_uri)
    run = client.get_run(registered.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics == {"test_accuracy": 0.5, "val_loss": 1.25}
    assert run.data.tags[TRIAL_KEY_TAG] == "tiny/md5-abc/trial-0000"
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.name == "trainyard/tiny"
    assert experiment.artifact_location.startswith(Path(registry.artifact_root).as_uri())
    assert client.get_model_version(MODEL, "1").description == "tiny linear model"


def test_registered_version_predicts_like_torch(
    registry: ModelRegistry, registered, model: torch.nn.Module, frame: pd.DataFrame
) -> None:
    predicted = registry.predict(registered.model_uri, frame[FEATURES])
    np.testing.assert_array_equal(predicted, torch_labels(model, frame))
    assert registry.evaluate_accuracy(registered.model_uri, frame, "label") == 1.0
    flipped = frame.assign(label=np.where(np.arange(len(frame)) < 16, -1, frame["label"]))
    assert registry.evaluate_accuracy(registered.model_uri, flipped, "label") == 0.75


def test_register_same_trial_is_idempotent(
    registry: ModelRegistry, registered, model_dir: Path, frame: pd.DataFrame
) -> None:
    again = _register(registry, model_dir, frame, "tiny/md5-abc/trial-0000")
    assert again.created is False
    assert (again.version, again.run_id) == (registered.version, registered.run_id)
    assert [v.version for v in registry.list_versions(MODEL)] == ["1"]
    assert registry.find_version(MODEL, "tiny/md5-abc/trial-0000").version == "1"
    assert registry.find_version(MODEL, "tiny/md5-abc/trial-9999") is None


def test_alias_set_and_get(registry: ModelRegistry, registered) -> None:
    assert registry.get_alias(MODEL, "challenger") is None
    moved = registry.set_alias(MODEL, "champion", registered.version)
    assert "champion" in moved.aliases
    champion = registry.get_alias(MODEL, "champion")
    assert champion is not None and champion.version == registered.version
    assert registry.get_version(MODEL, registered.version).aliases == champion.aliases
    with pytest.raises(RegistryNotFound):
        registry.set_alias(MODEL, "champion", "99")


def test_missing_model(registry: ModelRegistry, registered) -> None:
    assert registry.get_alias("no-such-model", "champion") is None
    assert registry.list_versions("no-such-model") == []
    assert registry.find_version("no-such-model", "t") is None
    with pytest.raises(RegistryNotFound):
        registry.get_version("no-such-model", "1")


@pytest.mark.slow
def test_smoke_test_serves_the_version_in_an_isolated_process(
    registry: ModelRegistry, registered, model: torch.nn.Module, frame: pd.DataFrame
) -> None:
    """What serving does: a fresh `python -I` process (no working directory, no PYTHONPATH) without the training
    stack loads the champion by its alias through the tracking server and predicts the same labels as the model."""
    registry.set_alias(MODEL, "champion", registered.version)
    result = registry.smoke_test(f"models:/{MODEL}@champion", {"test": frame[FEATURES].head(8)})
    assert result.passed, result.error
    assert result.run_id == registered.run_id
    assert result.predictions["test"] == torch_labels(model, frame.head(8)).tolist()
    assert len(result.predictions["input_example"]) == 5
    assert result.blocked_imports == ()  # serving needs nothing of the training stack
    assert result.load_seconds is not None and result.seconds >= result.load_seconds


def test_failure_after_run_created_leaves_no_version(
    registry: ModelRegistry, model_dir: Path, frame: pd.DataFrame, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    original = MlflowClient.create_model_version

    def create_then_fail(self, *args, **kwargs):
        original(self, *args, **kwargs)  # the version exists, then the call still fails
        raise MlflowException("simulated failure after the version was created")

    monkeypatch.setattr(MlflowClient, "create_model_version", create_then_fail)
    with pytest.raises(RegistryError, match="simulated failure") as caught:
        _register(registry, model_dir, frame, "rollback/trial-0001", name="tiny-rollback")
    assert not isinstance(caught.value, RegistryUnavailable)
    assert isinstance(caught.value.__cause__, MlflowException)

    assert registry.list_versions("tiny-rollback") == []
    client = MlflowClient(tracking_uri=registry.tracking_uri)
    experiment = client.get_experiment_by_name("trainyard/tiny-rollback")
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.status for r in runs] == ["FAILED"]

    monkeypatch.undo()
    retried = _register(registry, model_dir, frame, "rollback/trial-0001", name="tiny-rollback")
    assert retried.created is True
    assert [v.version for v in registry.list_versions("tiny-rollback")] == [retried.version]


def test_fluent_state_is_restored(
    registry: ModelRegistry, registered, frame: pd.DataFrame, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlflow

    other = "sqlite:////nonexistent/other.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", other)
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    registry.predict(registered.model_uri, frame.head(3))
    assert os.environ["MLFLOW_TRACKING_URI"] == other
    assert "MLFLOW_REGISTRY_URI" not in os.environ
    assert mlflow.get_tracking_uri() == other


def test_unreachable_tracking_server_is_retryable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    registry = ModelRegistry(tracking_uri="http://127.0.0.1:1", artifact_root=str(tmp_path), retry_backoff_s=0.1)
    waits: list[float] = []
    registry._sleep = waits.append
    with pytest.raises(RegistryUnavailable):
        registry.get_alias(MODEL, "champion")
    with pytest.raises(RegistryUnavailable):
        registry.list_versions(MODEL)
    assert waits == [0.1, 0.2, 0.1, 0.2]  # each call retried with backoff (three attempts), none waiting for real


def test_invalid_arguments_name_field_and_value(
    registry: ModelRegistry, workdir: Path, model_dir: Path, frame: pd.DataFrame
) -> None:
    with pytest.raises(pydantic.ValidationError, match="tracking_uri='sqlite:///rel.db'"):
        ModelRegistry(tracking_uri="sqlite:///rel.db", artifact_root="/tmp/a")
    with pytest.raises(pydantic.ValidationError, match="artifact_root='relative/dir'"):
        ModelRegistry(tracking_uri="sqlite:////tmp/a.db", artifact_root="relative/dir")
    with pytest.raises(ValueError, match="model_name='vision/digits'"):
        registry.list_versions("vision/digits")
    with pytest.raises(ValueError, match="trial_key=\"it's\""):
        registry.find_version(MODEL, "it's")
    empty = workdir / "not-a-model"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"missing \['model.pt2', 'meta.json'\]"):
        _register(registry, empty, frame, "bad/trial-0000")
    with pytest.raises(ValueError, match=r"missing feature columns \['f3'\]"):
        _register(registry, model_dir, frame.drop(columns=["f3"]), "bad/trial-0001")


def test_import_is_cheap() -> None:
    code = "import sys, resources.registry; assert 'mlflow' not in sys.modules and 'torch' not in sys.modules"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_s3_artifact_root_and_model_dir(
    registry: ModelRegistry,
    s3_endpoint,
    model_dir: Path,
    model: torch.nn.Module,
    frame: pd.DataFrame,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cluster layout: artifacts and the trial's exported model both on S3."""
    monkeypatch.setenv("MLFLOW_S3_ENDPOINT_URL", s3_endpoint.url)
    s3 = s3_endpoint.client()
    for name in ("model.pt2", "meta.json"):
        s3.upload_file(str(model_dir / name), s3_endpoint.bucket, f"runs/trial-0000/model/{name}")
    on_s3 = ModelRegistry(
        tracking_uri=registry.tracking_uri,
        artifact_root=s3_endpoint.root("mlartifacts"),
        experiment_prefix="cluster",
    )
    info = _register(on_s3, s3_endpoint.root("runs/trial-0000/model"), frame, "s3/trial-0000", name="tiny-s3")
    assert info.created is True
    stored = s3.list_objects_v2(Bucket=s3_endpoint.bucket, Prefix="mlartifacts/cluster/tiny-s3/")
    assert any(o["Key"].endswith("/model.pt2") for o in stored.get("Contents", []))
    np.testing.assert_array_equal(on_s3.predict(info.model_uri, frame), torch_labels(model, frame))


# -- retries, locks and the cluster server command ---------------------------------


def test_unreachable_registry_is_retried_then_fails_clearly(
    tmp_path: Path, model_dir: Path, frame: pd.DataFrame, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    waits: list[float] = []
    down = ModelRegistry(
        tracking_uri="http://user:secret@127.0.0.1:1", artifact_root=str(tmp_path / "artifacts"),
        retry_attempts=3, retry_backoff_s=0.5,
    )
    down._sleep = waits.append
    with pytest.raises(
        RegistryUnavailable, match=r"registry http://user:\*\*\*@127.0.0.1:1 unavailable; gave up after 3 attempt\(s\)"
    ) as caught:
        _register(down, model_dir, frame, "down/trial-0000", name="tiny-down")
    assert "secret" not in str(caught.value)
    assert waits == [0.5, 1.0]  # exponential backoff, outermost call only (register -> find_version does not multiply)
    assert not (tmp_path / "artifacts").exists()  # nothing half-written


def test_transient_failure_mid_registration_is_retried_to_exactly_one_version(
    registry: ModelRegistry, model_dir: Path, frame: pd.DataFrame, monkeypatch: pytest.MonkeyPatch
) -> None:
    import requests
    from mlflow import MlflowClient

    registry = no_waiting(registry)
    original = MlflowClient.create_model_version
    calls = {"n": 0}

    def create_then_lose_the_answer(self, *args, **kwargs):
        calls["n"] += 1
        mv = original(self, *args, **kwargs)
        if calls["n"] == 1:
            raise requests.exceptions.ConnectionError("connection reset while reading the answer")
        return mv

    monkeypatch.setattr(MlflowClient, "create_model_version", create_then_lose_the_answer)
    info = _register(registry, model_dir, frame, "flaky/trial-0000", name="tiny-flaky")
    assert calls["n"] == 2
    assert info.created is True
    assert [v.version for v in registry.list_versions("tiny-flaky")] == [info.version]
    client = MlflowClient(tracking_uri=registry.tracking_uri)
    experiment = client.get_experiment_by_name("trainyard/tiny-flaky")
    statuses = sorted(r.info.status for r in client.search_runs([experiment.experiment_id]))
    assert statuses == ["FAILED", "FINISHED"]


def test_concurrent_registration_of_one_trial_gives_one_version(
    registry: ModelRegistry, model_dir: Path, frame: pd.DataFrame
) -> None:
    import threading

    results, errors = [], []

    def go() -> None:
        try:
            results.append(_register(registry, model_dir, frame, "race/trial-0000", name="tiny-race"))
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=go) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert {r.version for r in results} == {"1"}
    assert [v.version for v in registry.list_versions("tiny-race") if v.tags.get(TRIAL_KEY_TAG)] == ["1"]


def test_lock_is_exclusive_expires_and_names_its_holder(registry: ModelRegistry) -> None:
    import resources.registry as registry_module

    registry = no_waiting(registry)
    with registry.lock("locked", purpose="first holder") as owner:
        assert (
            registry.get_model_tags(f"locked{registry_module.LOCK_MODEL_SUFFIX}")[registry_module.LOCK_OWNER_TAG]
            == owner
        )
        with pytest.raises(RegistryUnavailable, match="'locked' is locked by .* for 'first holder'; waited 0s"):
            with registry.lock("locked", purpose="second", wait_s=0):
                pass
    assert registry.get_model_tags(f"locked{registry_module.LOCK_MODEL_SUFFIX}") == {}
    assert "locked.trainyard-lock" not in registry.list_models()
    # a holder that died: its lock expires and the next caller takes over
    with registry.lock("stale", purpose="crashed", ttl_s=-1):
        with registry.lock("stale", purpose="next", wait_s=0) as second:
            tags = registry.get_model_tags(f"stale{registry_module.LOCK_MODEL_SUFFIX}")
            assert tags[registry_module.LOCK_OWNER_TAG] == second
    assert registry.get_model_tags(f"stale{registry_module.LOCK_MODEL_SUFFIX}") == {}


def test_model_tags_and_artifact_uri(registry: ModelRegistry, registered) -> None:
    registry.set_model_tags(MODEL, {"trainyard.note": "x"})
    assert registry.get_model_tags(MODEL)["trainyard.note"] == "x"
    assert registry.get_model_tags("no-such-model") == {}
    location = registry.artifact_uri(MODEL, registered.version)
    assert location.startswith(Path(registry.artifact_root).as_uri())
    assert (Path(location.removeprefix("file://")) / "MLmodel").is_file()


def test_tracking_server_command_exact() -> None:
    from resources.registry import tracking_server_command

    assert tracking_server_command("postgresql://mlflow@db:5432/mlflow", "s3://ml/artifacts", port=5001, workers=4) == [
        "mlflow", "server",
        "--backend-store-uri", "postgresql://mlflow@db:5432/mlflow",
        "--default-artifact-root", "s3://ml/artifacts",
        "--no-serve-artifacts",
        "--host", "0.0.0.0",
        "--port", "5001",
        "--workers", "4",
    ]
    with pytest.raises(ValueError, match="backend_store_uri='db' must be a database URI such as"):
        tracking_server_command("db", "s3://ml")
    with pytest.raises(ValueError, match="artifact_root='/local' must be a URI"):
        tracking_server_command("postgresql://db/x", "/local")
    with pytest.raises(ValueError, match="port=0 must be between 1 and 65535"):
        tracking_server_command("postgresql://db/x", "s3://ml", port=0)
