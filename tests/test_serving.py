"""Training hands off to serving: handoff events, `trainyard registry`, serving-only processes, HTTP serving, the
cluster registry.

Fast tests cover the handoff publisher (with a webhook served by a thread) and
the CLI's input handling. Slow tests start real processes: the serving smoke
test, `mlflow models serve` over HTTP, an MLflow tracking server on PostgreSQL
with artifacts on S3, and the digits pipeline followed by `trainyard registry`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pandas as pd
import pydantic
import pytest

from pipelines import cli
from resources.handoff import HandoffDeliveryFailed, HandoffEvent, HandoffPublisher
from resources.registry import ModelRegistry
from resources.storage import ObjectStore
from tests.support.webhook import WebhookServer

ROOT = Path(__file__).resolve().parent.parent
FEATURES = ["f0", "f1", "f2", "f3"]
CLASSES = [10, 20, 30]


# -- handoff events --------------------------------------------------------------------


def event(version: str = "3", at: str = "2025-01-30T07:01:02.123456+00:00") -> HandoffEvent:
    return HandoffEvent(
        event_id=f"ev-{version}", model="vision.digits", version=version, alias_uri="models:/vision.digits@champion",
        model_uri=f"models:/vision.digits/{version}", artifact_uri="s3://ml/artifacts/m-1/artifacts",
        previous_version="2", action="promote", reason="policy passed", decided_by="dagster run abc", at=at,
        run_id="r1", lineage={"data_version": "md5a"}, checks=[{"name": "threshold", "passed": True, "detail": "ok"}],
    )


def test_handoff_record_in_store_and_webhook(tmp_path: Path, webhook: WebhookServer) -> None:
    store = ObjectStore(root=str(tmp_path))
    handoff = HandoffPublisher(store=store, webhook_url=webhook.url)
    receipt = handoff.publish(event())
    expected = tmp_path / "handoff" / "vision.digits" / "20250130T070102.123456Z-v3.json"
    assert receipt.uri == str(expected)
    assert (receipt.webhook, receipt.status, receipt.attempts) == ("delivered", 200, 1)
    record = json.loads(expected.read_text())
    assert record == event().model_dump(mode="json")
    assert record["schema_version"] == 1 and record["alias_uri"] == "models:/vision.digits@champion"
    headers, body, _ = webhook.received[0]
    assert headers["X-Trainyard-Event-Id"] == "ev-3" and headers["Content-Type"] == "application/json"
    assert body == {**record, "record_uri": str(expected)}
    assert handoff.read(receipt.uri) == event()
    handoff.publish(event("4", at="2025-01-31T00:00:00+00:00"))
    assert [Path(u).name for u in handoff.list_events("vision.digits")] == [
        "20250130T070102.123456Z-v3.json", "20250131T000000.000000Z-v4.json"
    ]


def test_handoff_webhook_retries_transient_answers_only(tmp_path: Path, webhook: WebhookServer) -> None:
    handoff = HandoffPublisher(store=ObjectStore(root=str(tmp_path)), webhook_url=webhook.url, webhook_backoff_s=0.0)
    webhook.statuses = [503, 429]
    receipt = handoff.publish(event())
    assert (receipt.webhook, receipt.attempts) == ("delivered", 3)

    webhook.statuses = [400]
    with pytest.raises(
        HandoffDeliveryFailed,
        match=r"did not accept handoff event ev-5 \(vision.digits v5\) after 1 attempt\(s\): HTTP 400: refused",
    ) as caught:
        handoff.publish(event("5"))
    assert caught.value.status == 400
    assert Path(caught.value.uri).is_file()  # the record is the source of truth; only the notification failed
    delivered = handoff.deliver(handoff.read(caught.value.uri), caught.value.uri)  # re-delivery, same event id
    assert delivered.webhook == "delivered" and webhook.received[-1][0]["X-Trainyard-Event-Id"] == "ev-5"


def test_handoff_unreachable_webhook_and_disabled(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    handoff = HandoffPublisher(store=ObjectStore(root=str(tmp_path)), webhook_url=f"http://127.0.0.1:{port}/x",
                               webhook_attempts=2, webhook_backoff_s=0.0, webhook_timeout_s=2)
    with pytest.raises(HandoffDeliveryFailed, match="after 2 attempt"):
        handoff.publish(event())
    quiet = HandoffPublisher(store=ObjectStore(root=str(tmp_path)))
    assert quiet.publish(event("6")).webhook == "disabled"


def test_handoff_validation_names_field_and_value(tmp_path: Path) -> None:
    with pytest.raises(pydantic.ValidationError, match="webhook_url='ftp://x' must start with http:// or https://"):
        HandoffPublisher(store=ObjectStore(root=str(tmp_path)), webhook_url="ftp://x")
    with pytest.raises(pydantic.ValidationError, match=r"at='2025-01-30T08:00:00\+01:00' must be in UTC"):
        event(at="2025-01-30T08:00:00+01:00")
    with pytest.raises(pydantic.ValidationError, match="at='yesterday' is not an ISO 8601 timestamp"):
        event(at="yesterday")


# -- the CLI's input handling ----------------------------------------------------------------


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_rejects_force_without_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path))
    monkeypatch.delenv("TRAINYARD_ENV", raising=False)
    code, _, err = run_cli(["registry", "promote", "vision.digits", "--force"], capsys)
    assert code == 2
    assert 'error: --force needs --reason "...": an override is recorded with its justification' in err
    code, _, err = run_cli(["registry", "rollback", "vision.digits", "--reason", "x"], capsys)
    assert (code, err.strip()) == (2, "trainyard registry: error: --reason is only used with --force")


def test_cli_names_unknown_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path))
    monkeypatch.delenv("TRAINYARD_ENV", raising=False)
    code, _, err = run_cli(["registry", "show", "digits"], capsys)
    assert code == 2
    assert "no registered model 'digits'; registered models: none yet" in err


def test_resolve_model_by_name_path_or_unique_suffix() -> None:
    from pipelines.cli_registry import resolve_model

    class Fake:
        def list_models(self) -> list[str]:
            return ["tabular.digits", "vision.digits", "vision.mnist"]

    assert resolve_model(Fake(), "vision.digits") == "vision.digits"
    assert resolve_model(Fake(), "vision/mnist") == "vision.mnist"
    assert resolve_model(Fake(), "mnist") == "vision.mnist"
    with pytest.raises(LookupError, match="model 'digits' is ambiguous: tabular.digits, vision.digits"):
        resolve_model(Fake(), "digits")
    with pytest.raises(
        LookupError, match="no registered model 'x'; registered models: tabular.digits, vision.digits, vision.mnist"
    ):
        resolve_model(Fake(), "x")


# -- real processes (slow) ---------------------------------------------------------------------


def stop(proc: subprocess.Popen) -> None:
    """Terminates a server started in its own session, with all its workers."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A registered tiny torch classifier, its training-side labels on a test frame, alias champion+challenger."""
    import torch

    from tests.support.models import export_model

    home = tmp_path_factory.mktemp("serving")
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)).eval()
    frame = pd.DataFrame(np.random.default_rng(3).normal(size=(50, 4)), columns=FEATURES)
    with torch.no_grad():  # the training-side evaluation: the eager torch model itself
        expected = np.asarray(CLASSES)[model(torch.tensor(frame.to_numpy(), dtype=torch.float32)).argmax(1).numpy()]
    registry = ModelRegistry(tracking_uri=f"sqlite:///{home / 'mlflow.db'}", artifact_root=str(home / "artifacts"))
    info = registry.register("tiny", str(export_model(model, home / "trial", FEATURES, CLASSES)), trial_key="t/0",
                             tags={}, metrics={}, description="", input_example=frame)
    registry.set_alias("tiny", "champion", info.version)
    registry.set_alias("tiny", "challenger", info.version)
    return {"registry": registry, "frame": frame, "expected": expected, "info": info, "home": home}


@pytest.mark.slow
def test_smoke_test_runs_in_a_serving_only_process(tiny: dict[str, Any]) -> None:
    registry = tiny["registry"]
    result = registry.smoke_test("models:/tiny@challenger", {"test": tiny["frame"]})
    assert result.passed, result.error
    assert result.run_id == tiny["info"].run_id
    assert result.predictions["test"] == tiny["expected"].tolist()
    assert result.predictions["input_example"] == tiny["expected"][:5].tolist()  # the logged example is the first rows
    # a serving image without the model's runtime cannot load it: the smoke test says so
    missing = registry.smoke_test("models:/tiny@challenger", {}, blocked_modules=["torch"])
    assert not missing.passed
    assert "No module named 'torch' (not a serving dependency)" in missing.error
    assert "torch" in missing.blocked_imports


@pytest.mark.slow
def test_served_over_http_equals_training_side_evaluation(tiny: dict[str, Any]) -> None:
    """`mlflow models serve` on `models:/tiny@champion`: POST /invocations returns the eager model's labels."""
    registry, frame = tiny["registry"], tiny["frame"]
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MLFLOW_REGISTRY_URI")}
    env["MLFLOW_TRACKING_URI"] = registry.tracking_uri
    # `mlflow models serve` execs `uvicorn` by name: the environment's scripts must be on PATH.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    mlflow_cli = str(Path(sys.executable).parent / "mlflow")
    log = tiny["home"] / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [mlflow_cli, "models", "serve", "-m", "models:/tiny@champion", "--env-manager", "local",
             "-h", "127.0.0.1", "-p", str(port), "-w", "1"],
            cwd=tiny["home"], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "server did not answer /ping within 180s:\n" + log.read_text()[-3000:]
            time.sleep(0.5)
        body = json.dumps({"dataframe_split": frame.to_dict(orient="split", index=False)}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as r:
            served = json.loads(r.read())["predictions"]
    finally:
        stop(proc)
    labels = [row if not isinstance(row, dict) else next(iter(row.values())) for row in served]
    assert labels == tiny["expected"].tolist()
    assert labels == registry.predict("models:/tiny@champion", frame).tolist()


@pytest.mark.slow
def test_lightgbm_version_serves(tmp_path: Path) -> None:
    """A `format: lightgbm` export (training/gbt.py) registers and serves with mlflow, lightgbm, numpy and pandas."""
    import lightgbm as lgb

    rng = np.random.default_rng(0)
    frame = pd.DataFrame(rng.normal(size=(200, 4)), columns=FEATURES)
    y = (frame["f0"] + frame["f1"] > 0).astype(int)
    booster = lgb.train({"objective": "binary", "verbose": -1, "num_leaves": 4}, lgb.Dataset(frame.to_numpy(), y), 10)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    booster.save_model(str(model_dir / "model.txt"))
    (model_dir / "meta.json").write_text(json.dumps({
        "format": "lightgbm", "features": FEATURES, "target": "label", "task": "classification",
        "classes": ["no", "yes"], "objective": "binary", "best_iteration": 10,
    }))
    expected = np.where(booster.predict(frame.to_numpy()) > 0.5, "yes", "no")
    registry = ModelRegistry(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", artifact_root=str(tmp_path / "a"))
    info = registry.register(
        "gbt", str(model_dir), trial_key="g/0", tags={}, metrics={}, description="", input_example=frame
    )
    np.testing.assert_array_equal(registry.predict(info.model_uri, frame), expected)
    result = registry.smoke_test(info.model_uri, {"test": frame})
    assert result.passed, result.error
    assert result.predictions["test"] == expected.tolist()


@pytest.fixture()
def postgres_db() -> Iterator[str]:
    """A fresh PostgreSQL database, dropped afterwards; skips outside CI when no server is reachable."""
    import uuid

    import sqlalchemy

    admin_url = "postgresql+psycopg2://postgres@127.0.0.1:5432/postgres"
    try:
        admin = sqlalchemy.create_engine(admin_url, isolation_level="AUTOCOMMIT")
        with admin.connect():
            pass
    except sqlalchemy.exc.OperationalError:
        if os.environ.get("CI"):
            pytest.fail("PostgreSQL at 127.0.0.1:5432 is required in CI")
        pytest.skip("no PostgreSQL reachable at 127.0.0.1:5432")
    name = f"trainyard_mlflow_{uuid.uuid4().hex[:8]}"
    with admin.connect() as c:
        c.execute(sqlalchemy.text(f"CREATE DATABASE {name}"))
    try:
        yield f"postgresql+psycopg2://postgres@127.0.0.1:5432/{name}"
    finally:
        with admin.connect() as c:
            c.execute(sqlalchemy.text(f"DROP DATABASE {name} WITH (FORCE)"))
        admin.dispose()


@pytest.mark.slow
def test_cluster_registry_tracking_server_on_postgres_with_s3_artifacts(
    postgres_db: str, s3_endpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cluster layout: `mlflow server` on PostgreSQL, artifacts on S3; register, gate and promote through it."""
    import sqlalchemy
    import torch

    from resources.registry import promotion, tracking_server_command
    from tests.support.models import export_model
    from trainyard.promotion import Candidate, ValidationEvidence
    from trainyard.spec import PromotionSpec

    monkeypatch.setenv("MLFLOW_S3_ENDPOINT_URL", s3_endpoint.url)
    port = free_port()
    argv = tracking_server_command(
        postgres_db, s3_endpoint.root("mlflow-artifacts"), host="127.0.0.1", port=port, workers=1
    )
    argv[0] = str(Path(sys.executable).parent / "mlflow")
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        server = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert server.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)

        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3).eval()
        frame = pd.DataFrame(np.random.default_rng(0).normal(size=(30, 4)), columns=FEATURES)
        with torch.no_grad():
            frame["label"] = np.asarray(CLASSES)[
                model(torch.tensor(frame[FEATURES].to_numpy(), dtype=torch.float32)).argmax(1).numpy()
            ]
        s3 = s3_endpoint.client()
        local = export_model(model, tmp_path / "trial", FEATURES, CLASSES)
        for name in ("model.pt2", "meta.json"):
            s3.upload_file(str(local / name), s3_endpoint.bucket, f"runs/trial-0000/model/{name}")

        registry = ModelRegistry(
            tracking_uri=f"http://127.0.0.1:{port}",
            artifact_root=s3_endpoint.root("mlflow-artifacts"),
            retry_backoff_s=0.2,
        )
        info = registry.register("cluster.digits", s3_endpoint.root("runs/trial-0000/model"), trial_key="s/trial-0000",
                                 tags={"trainyard.test_split": "split1"}, metrics={"test_acc": 1.0}, description="card",
                                 input_example=frame[FEATURES])
        again = registry.register("cluster.digits", s3_endpoint.root("runs/trial-0000/model"), trial_key="s/trial-0000",
                                  tags={}, metrics={"test_acc": 1.0}, description="card", input_example=frame[FEATURES])
        assert (info.created, again.created, again.version) == (True, False, info.version)
        assert registry.artifact_uri("cluster.digits", info.version).startswith(s3_endpoint.root("mlflow-artifacts"))

        handoff = HandoffPublisher(store=ObjectStore(root=s3_endpoint.root("store"), endpoint_url=s3_endpoint.url))
        validation = ValidationEvidence(True, "passed", "md5")
        candidate = Candidate(
            info, PromotionSpec(threshold=0.9), {"test_acc": 1.0}, "split1", frame, "label", validation
        )
        decision = promotion.decide(registry, handoff, candidate, action="register", decided_by="test")
        assert decision.outcome == "champion", decision.reason
        assert (decision.smoke["served_metric"], decision.smoke["served_value"]) == ("test_acc", 1.0)
        assert registry.get_alias("cluster.digits", "champion").version == info.version
        assert decision.handoff_uri.startswith(s3_endpoint.root("store", "handoff", "cluster.digits"))
        assert handoff.read(decision.handoff_uri).artifact_uri.startswith("s3://")
        with sqlalchemy.create_engine(postgres_db).connect() as c:
            rows = c.execute(sqlalchemy.text("SELECT name FROM registered_models")).scalars().all()
            aliases = c.execute(sqlalchemy.text("SELECT alias, version FROM registered_model_aliases")).all()
        assert rows == ["cluster.digits"]  # the promotion lock is gone
        assert sorted(aliases) == [("challenger", int(info.version)), ("champion", int(info.version))]
    finally:
        stop(server)


@pytest.mark.slow
def test_pipeline_champion_is_shown_with_lineage_and_evidence(
    trained, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """After a pipeline run, `trainyard registry show` prints the champion, its lineage and why it was promoted."""
    harness, out = trained
    assert out["registered"]["decision"] == "champion"
    md5 = out["best"]["lineage"]["data_version"]

    monkeypatch.setenv("TRAINYARD_HOME", str(harness.home))
    monkeypatch.delenv("TRAINYARD_ENV", raising=False)
    code, text, err = run_cli(["registry", "show", "digits"], capsys)
    assert code == 0, err
    assert text.startswith("test.digits champion: version 1  (models:/test.digits/1)")
    assert f"  data version     : {md5}" in text
    assert f"  trial            : {out['best']['trial']}" in text
    assert f"[pass] data_validation: expectations check passed for data version {md5}" in text
    assert "[pass] serving_smoke_test: loaded models:/test.digits@challenger in a serving-only process" in text
    acc = out["best"]["metrics"]["test_acc"]
    assert f"served test_acc {acc:.6f}, training-side {acc:.6f}" in text
    assert "handoff event      : " + str(harness.home / "store" / "handoff" / "test.digits") in text

    code, text, _ = run_cli(["registry", "show", "test/digits", "--json"], capsys)
    shown = json.loads(text)
    assert shown["is_champion"] and shown["promotion"]["decision"] == "champion"
    assert shown["lineage"]["validation"] == "passed"

    code, text, _ = run_cli(["registry", "promote", "test.digits"], capsys)
    assert (code, text.splitlines()[0]) == (0, "test.digits version 1 is already champion; nothing to do")
    code, _, err = run_cli(["registry", "rollback", "test.digits"], capsys)
    assert code == 2 and "v1 is the first champion on record; there is nothing to roll back to" in err

    card = harness.resources["registry"].get_version("test.digits", "1")
    from mlflow import MlflowClient

    description = (
        MlflowClient(tracking_uri=harness.resources["registry"].tracking_uri)
        .get_model_version("test.digits", "1")
        .description
    )
    assert "## Intended use" in description and "## Validation\n- result: passed" in description
    assert card.tags["trainyard.validation"] == "passed"
    events = harness.resources["handoff"].list_events("test.digits")
    assert len(events) == 1 and harness.resources["handoff"].read(events[0]).version == "1"
