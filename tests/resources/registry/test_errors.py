"""`translate_errors` maps MLflow, requests and SQLAlchemy errors onto the registry's hierarchy."""

from __future__ import annotations

import pytest
import requests
import sqlalchemy.exc
from mlflow.exceptions import MlflowException, RestException
from mlflow.protos import databricks_pb2 as codes

from resources.registry.errors import (
    ALREADY_EXISTS,
    MISSING,
    RegistryConflict,
    RegistryError,
    RegistryNotFound,
    RegistryUnavailable,
    translate_errors,
)
from trainyard.redact import redact_url


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (MlflowException("no model 'm'", error_code=codes.RESOURCE_DOES_NOT_EXIST), RegistryNotFound),
        (MlflowException("model 'm' exists", error_code=codes.RESOURCE_ALREADY_EXISTS), RegistryConflict),
        (MlflowException("bad alias", error_code=codes.INVALID_PARAMETER_VALUE), RegistryError),
        (MlflowException("slow down", error_code=codes.REQUEST_LIMIT_EXCEEDED), RegistryUnavailable),
        (RestException({"error_code": "INTERNAL_ERROR", "message": "db down"}), RegistryUnavailable),
        (requests.exceptions.ConnectionError("refused"), RegistryUnavailable),
        (requests.exceptions.ReadTimeout("slow"), RegistryUnavailable),
        (sqlalchemy.exc.OperationalError("UPDATE", {}, Exception("database is locked")), RegistryUnavailable),
        (ValueError("odd"), RegistryError),
    ],
)
def test_each_error_maps_to_its_registry_error_chained_to_the_original(raised: Exception, expected: type) -> None:
    with pytest.raises(RegistryError) as caught:
        with translate_errors("get version 3 of 'm'"):
            raise raised
    assert type(caught.value) is expected
    assert caught.value.__cause__ is raised
    assert str(caught.value) == f"get version 3 of 'm': {type(raised).__name__}: {raised}"


def test_a_transport_error_anywhere_in_the_chain_is_retryable() -> None:
    with pytest.raises(RegistryUnavailable):
        with translate_errors("log model"):
            try:
                raise ConnectionResetError("reset by peer")
            except ConnectionResetError as e:
                raise MlflowException("upload failed") from e


def test_credentials_are_redacted_from_messages() -> None:
    with pytest.raises(RegistryUnavailable) as caught:
        with translate_errors("list models at http://user:secret@mlflow:5000"):
            raise requests.exceptions.ConnectionError("http://user:secret@mlflow:5000/api refused")
    assert "secret" not in str(caught.value) and "user:***@mlflow" in str(caught.value)
    assert redact_url("postgresql://mlflow:pw@db/mlflow") == "postgresql://mlflow:***@db/mlflow"


def test_registry_errors_and_non_exceptions_pass_through_unchanged() -> None:
    inner = RegistryNotFound("inner")
    with pytest.raises(RegistryNotFound) as caught:
        with translate_errors("outer"):
            with translate_errors("inner"):
                raise inner
    assert caught.value is inner
    with pytest.raises(KeyboardInterrupt):
        with translate_errors("interrupted"):
            raise KeyboardInterrupt


def test_ignored_codes_end_the_block_quietly() -> None:
    found = None
    reached_after_the_call = False
    with translate_errors("get model 'm'", ignore={MISSING}):
        raise_missing()
        found = "model"
        reached_after_the_call = True
    assert (found, reached_after_the_call) == (None, False)
    with translate_errors("create model 'm'", ignore={ALREADY_EXISTS}):
        raise MlflowException("exists", error_code=codes.RESOURCE_ALREADY_EXISTS)
    with pytest.raises(RegistryConflict):  # only the named codes are ignored
        with translate_errors("get model 'm'", ignore={MISSING}):
            raise MlflowException("exists", error_code=codes.RESOURCE_ALREADY_EXISTS)


def raise_missing() -> None:
    raise MlflowException("no model 'm'", error_code=codes.RESOURCE_DOES_NOT_EXIST)
