"""The smoke test's serving process (`resources/registry/smoke.py`), run as the registry runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from resources.registry import RegistryUnavailable, smoke
from resources.registry.serving import run_smoke_test, smoke_request


def test_blocker_refuses_training_packages_and_records_each_attempt() -> None:
    attempts: list[str] = []
    finder = smoke.ServingImageOnly(frozenset({"dagster", "training"}), attempts)
    with pytest.raises(ModuleNotFoundError, match=r"No module named 'training.spec' \(not a serving dependency\)"):
        finder.find_spec("training.spec")
    assert finder.find_spec("trainingwheels") is None  # a prefix is not the package
    assert finder.find_spec("mlflow.pyfunc") is None
    assert attempts == ["training.spec"]


def test_failure_description_names_the_whole_chain() -> None:
    try:
        try:
            raise ConnectionRefusedError("refused")
        except ConnectionRefusedError as e:
            raise OSError("could not download artifacts") from e
    except OSError as e:
        described = smoke.describe_failure(e)
    assert described["error"] == "OSError: could not download artifacts"
    assert described["error_types"] == ["OSError", "ConnectionRefusedError"]
    assert "ConnectionRefusedError: refused" in described["traceback"]


def test_request_carries_samples_exactly_as_a_json_client_sends_them(tmp_path: Path) -> None:
    frame = pd.DataFrame({"a": [0.1, 2.5], "b": [3, 4]})
    request = smoke_request(
        "models:/m@challenger", {"test": frame}, ["wandb", "dagster", "wandb"], str(tmp_path / "out.json")
    )
    assert request == {
        "model_uri": "models:/m@challenger",
        "blocked": ["dagster", "wandb"],
        "output": str(tmp_path / "out.json"),
        "samples": {"test": {"columns": ["a", "b"], "data": [[0.1, 3], [2.5, 4]]}},
    }
    # An int column stays JSON integers beside a float column (a float array would send 3.0).
    assert json.dumps(request["samples"]) == '{"test": {"columns": ["a", "b"], "data": [[0.1, 3], [2.5, 4]]}}'


def test_isolated_process_reports_a_blocked_import_as_the_error(tmp_path: Path) -> None:
    """Run as the registry runs it: `python -I smoke.py request.json`, outside the repository."""
    request = smoke_request("models:/m/1", {}, ["mlflow"], str(tmp_path / "out.json"))
    (tmp_path / "request.json").write_text(json.dumps(request))
    proc = subprocess.run(
        [sys.executable, "-I", smoke.__file__, str(tmp_path / "request.json")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["error"] == "ModuleNotFoundError: No module named 'mlflow' (not a serving dependency)"
    assert out["blocked_imports"] == ["mlflow"]
    assert "predictions" not in out and "load_seconds" not in out


def test_blocked_serving_dependency_fails_the_smoke_test(tmp_path: Path) -> None:
    result = run_smoke_test(
        f"sqlite:///{tmp_path / 'mlflow.db'}", "models:/m/1", {}, timeout_s=120, blocked_modules=["mlflow"]
    )
    assert not result.passed
    assert result.error == "ModuleNotFoundError: No module named 'mlflow' (not a serving dependency)"
    assert (result.run_id, result.predictions, result.blocked_imports) == (None, {}, ("mlflow",))


def test_unreachable_registry_is_retryable_not_a_broken_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    with pytest.raises(
        RegistryUnavailable, match="smoke test of 'models:/m/1': the serving process could not reach the registry"
    ):
        run_smoke_test("http://127.0.0.1:1", "models:/m/1", {}, timeout_s=120, blocked_modules=["dagster"])
