"""Model registry resource on MLflow: versions, aliases, lineage tags, serving checks.

`ModelRegistry` turns an exported model directory (`model.pt2` + `meta.json`,
written by the training process) into an MLflow model version that serves with
nothing but `mlflow.pyfunc` and torch: the pyfunc is the models-from-code file
`training/serving_model.py`, logged by path, so loading a version never imports
trainyard or Dagster.

Registration is idempotent on a *trial key*: the version carries the tag
`trainyard.trial_key`, and registering the same key again returns the existing
version. The tag is written in the same call that creates the version, so a
version that exists is always complete; a failure before that point deletes
any half-made version and marks the MLflow run FAILED.

All calls go through an `MlflowClient` built from `tracking_uri`. The few MLflow
APIs that only read process-global state (`mlflow.pyfunc.log_model`,
`mlflow.pyfunc.load_model`) run inside `_fluent_uris`, which sets and then
restores that state under a lock.

Every public call is retried when the registry is unavailable (transport errors,
5xx, a locked SQLite database): `retry_attempts` tries with exponential backoff
from `retry_backoff_s`, then `RegistryUnavailable` naming the registry and the
number of attempts. Registration is safe to retry because it is idempotent and
cleans up after itself.

Serving checks: `smoke_test` loads a version in a fresh Python process that can
import only the serving dependencies (training-only packages and trainyard
itself are blocked) and predicts on the logged input example and given rows.
`lock` is a per-model critical section across processes and hosts, built on the
registry's own atomic "create registered model", so promotions of one model
never interleave.

Cluster configuration: an MLflow tracking server backed by PostgreSQL with
artifacts on S3; `tracking_server_command` builds its command line.

`import mlflow` is deferred to first use, so importing this module is cheap.

Example:
    >>> registry = ModelRegistry(
    ...     tracking_uri="sqlite:////var/trainyard/mlflow.db",
    ...     artifact_root="/var/trainyard/mlartifacts",
    ... )
    >>> info = registry.register(
    ...     "vision-digits", "/runs/trial-0003/model", trial_key="vision/digits/ab12/trial-0003",
    ...     tags={"trainyard.data_version": "ab12"}, metrics={"test_accuracy": 0.97},
    ...     description="best of sweep ab12", input_example=test_frame.head(5),
    ... )
    >>> registry.set_alias("vision-digits", "champion", info.version)
    >>> registry.evaluate_accuracy("models:/vision-digits@champion", test_frame, "label")
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional, Sequence, TypeVar

import dagster as dg
from pydantic import Field, field_validator

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd
    from mlflow import MlflowClient
    from mlflow.entities.model_registry import ModelVersion

logger = logging.getLogger(__name__)

TRIAL_KEY_TAG = "trainyard.trial_key"
"""Model version (and run) tag that makes `ModelRegistry.register` idempotent."""

SERVING_MODEL_PATH = Path(__file__).resolve().parent.parent / "training" / "serving_model.py"
"""The models-from-code pyfunc logged with every version (a path, never imported here)."""

MODEL_ARTIFACT_NAME = "model"
MODEL_DIR_ARTIFACT = "model_dir"
# Packages the pyfunc imports; pinned to this process's versions in requirements.txt.
SERVING_REQUIREMENTS = ("mlflow", "torch", "numpy", "pandas")
LIGHTGBM_SERVING_REQUIREMENTS = ("mlflow", "lightgbm", "numpy", "pandas")
INPUT_EXAMPLE_ROWS = 5

# Same rule as MLflow's own (no '/' or ':'), plus characters that would need
# escaping in search filters and `models:/` URIs.
_MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,255}$")
# Trial keys are embedded in a quoted MLflow search filter.
_TRIAL_KEY_RE = re.compile(r"^[A-Za-z0-9._:/@=+-]{1,250}$")
_URI_SCHEME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")

# MLflow's fluent APIs read process-wide tracking/registry URIs; serialise the
# code that borrows them so two threads never see each other's URI.
_FLUENT_LOCK = threading.RLock()

LOCK_MODEL_SUFFIX = ".trainyard-lock"
"""A registered model named `<model><suffix>` exists exactly while `lock(model)` is held."""
LOCK_OWNER_TAG = "trainyard.lock.owner"
LOCK_EXPIRES_TAG = "trainyard.lock.expires_at"
LOCK_PURPOSE_TAG = "trainyard.lock.purpose"

TRAINING_ONLY_MODULES: tuple[str, ...] = (
    "assets", "resources", "pipelines", "training",  # trainyard itself
    "dagster", "dagster_pipes", "dagster_k8s", "dagster_webserver",
    "lightning", "pytorch_lightning", "optuna", "wandb",
    "great_expectations", "dvc", "kubernetes",
)
"""Top-level packages a serving image does not have; `smoke_test` makes them unimportable."""

# Error types that, raised inside the smoke-test process, mean the registry or
# artifact store could not be reached rather than that the model is broken.
_TRANSPORT_ERROR_NAMES = frozenset({
    "ConnectionError", "ConnectTimeout", "ReadTimeout", "Timeout", "RetryError",
    "MaxRetryError", "NewConnectionError", "EndpointConnectionError",
    "ConnectTimeoutError", "OperationalError", "TimeoutError", "ConnectionRefusedError",
})

_CREDENTIALS_RE = re.compile(r"(//[^/:@]+:)[^/@]+@")

# Tests replace this to observe backoff without sleeping.
_sleep: Callable[[float], None] = time.sleep

_T = TypeVar("_T")
_RETRY_STATE = threading.local()


class RegistryError(Exception):
    """A registry operation failed and retrying will not help (terminal)."""


class RegistryUnavailable(RegistryError):
    """The registry could not be reached or answered 5xx; retrying may succeed."""


class RegistryConflict(RegistryError):
    """The registry's state contradicts the request (e.g. a deleted experiment, a race)."""


class RegistryNotFound(RegistryError):
    """The registered model or model version does not exist."""


@dataclass(frozen=True)
class ModelVersionInfo:
    """One registered model version, as trainyard sees it.

    Attributes:
        name: Registered model name.
        version: Version number as a string (MLflow's own representation).
        run_id: MLflow run that logged the model.
        model_uri: `models:/<name>/<version>`, loadable by `mlflow.pyfunc.load_model`.
        source: Where MLflow says the artifacts live (the logged model's URI).
        tags: Version tags, including `trainyard.trial_key` when registered here.
        aliases: Aliases pointing at this version (e.g. `champion`).
        created: True only when the call that returned this created the version.
    """

    name: str
    version: str
    run_id: Optional[str]
    model_uri: str
    source: str
    tags: dict[str, str] = field(default_factory=dict)
    aliases: tuple[str, ...] = ()
    created: bool = False

    @property
    def trial_key(self) -> Optional[str]:
        """The trial this version was registered from, if it was registered by trainyard."""
        return self.tags.get(TRIAL_KEY_TAG)


@dataclass(frozen=True)
class SmokeResult:
    """What a fresh serving process did with a model.

    Attributes:
        model_uri: The URI the process loaded (e.g. `models:/vision.digits@challenger`).
        run_id: MLflow run of the model it actually loaded (None if loading failed).
        predictions: Per sample name, one prediction per row; `input_example` holds
            the predictions on the input example logged with the model.
        load_seconds: Time to load the model inside the process.
        seconds: Wall time of the whole process, start to exit.
        blocked_imports: Training-only modules something tried to import (each failed).
        error: Why the process failed to load or predict; None when it succeeded.
    """

    model_uri: str
    run_id: Optional[str]
    predictions: dict[str, list[Any]]
    load_seconds: Optional[float]
    seconds: float
    blocked_imports: tuple[str, ...] = ()
    error: Optional[str] = None

    @property
    def passed(self) -> bool:
        """True when the process loaded the model and predicted on every sample."""
        return self.error is None


def tracking_server_command(
    backend_store_uri: str,
    artifact_root: str,
    *,
    host: str = "0.0.0.0",
    port: int = 5000,
    workers: int = 2,
) -> list[str]:
    """The `mlflow server` command line of the cluster registry.

    Runs/registry live in `backend_store_uri` (PostgreSQL in the cluster); clients
    write artifacts straight to `artifact_root` (S3), so the server never proxies
    model bytes (`--no-serve-artifacts`).

    Args:
        backend_store_uri: SQLAlchemy URI, e.g. `postgresql://mlflow@db:5432/mlflow`.
        artifact_root: Default artifact root for experiments the server creates, e.g.
            `s3://bucket/mlflow-artifacts` (trainyard sets each experiment's own).
        host: Interface to bind.
        port: Port to listen on.
        workers: Server worker processes.

    Returns:
        The argv list, starting with `mlflow`.

    Raises:
        ValueError: An argument is malformed (names it and the value).

    Example:
        >>> tracking_server_command("postgresql://mlflow@db/mlflow", "s3://ml/artifacts", port=5001)[:4]
        ['mlflow', 'server', '--backend-store-uri', 'postgresql://mlflow@db/mlflow']
    """
    if not _URI_SCHEME_RE.match(backend_store_uri):
        raise ValueError(
            f"backend_store_uri={_redact(backend_store_uri)!r} must be a database URI such as "
            "'postgresql://user@host:5432/mlflow'"
        )
    if not _URI_SCHEME_RE.match(artifact_root):
        raise ValueError(f"artifact_root={artifact_root!r} must be a URI such as 's3://bucket/prefix'")
    if not 0 < port < 65536:
        raise ValueError(f"port={port} must be between 1 and 65535")
    if workers < 1:
        raise ValueError(f"workers={workers} must be at least 1")
    return [
        "mlflow", "server",
        "--backend-store-uri", backend_store_uri,
        "--default-artifact-root", artifact_root,
        "--no-serve-artifacts",
        "--host", host,
        "--port", str(port),
        "--workers", str(workers),
    ]


def _redact(uri: str) -> str:
    """`postgresql://user:secret@host/db` -> `postgresql://user:***@host/db`."""
    return _CREDENTIALS_RE.sub(r"\1***@", uri)


def _retrying(method: Callable[..., _T]) -> Callable[..., _T]:
    """Retries a `ModelRegistry` method on `RegistryUnavailable`, with exponential backoff.

    Nested calls (e.g. `register` -> `find_version`) retry only at the outermost
    level, so attempts do not multiply.
    """

    @functools.wraps(method)
    def wrapper(self: "ModelRegistry", *args: Any, **kwargs: Any) -> _T:
        if getattr(_RETRY_STATE, "active", False):
            return method(self, *args, **kwargs)
        _RETRY_STATE.active = True
        try:
            attempt = 1
            while True:
                try:
                    return method(self, *args, **kwargs)
                except RegistryUnavailable as e:
                    if attempt >= self.retry_attempts:
                        raise RegistryUnavailable(
                            f"registry {_redact(self.tracking_uri)} unavailable; gave up after "
                            f"{attempt} attempt(s): {e}"
                        ) from e
                    delay = self.retry_backoff_s * 2 ** (attempt - 1)
                    logger.warning(
                        "registry %s unavailable during %s (attempt %d of %d), retrying in %.1fs: %s",
                        _redact(self.tracking_uri), method.__name__, attempt, self.retry_attempts, delay, e,
                    )
                    _sleep(delay)
                    attempt += 1
        finally:
            _RETRY_STATE.active = False

    return wrapper


@functools.lru_cache(maxsize=None)
def _mlflow() -> Any:
    import mlflow
    import mlflow.pyfunc

    return mlflow


@functools.lru_cache(maxsize=16)
def _client(tracking_uri: str) -> "MlflowClient":
    # Building a client opens the backend store (for SQLite: schema checks); reuse it.
    return _mlflow().MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)


@contextlib.contextmanager
def _fluent_uris(tracking_uri: str) -> Iterator[None]:
    """Points MLflow's process-global tracking/registry URIs at `tracking_uri`, then restores.

    `mlflow.pyfunc.log_model`, `mlflow.start_run`/`end_run` and loading `models:/`
    URIs take no URI argument; this is the one place trainyard lets them see ours.
    """
    mlflow = _mlflow()
    with _FLUENT_LOCK:
        saved_env = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
        mlflow.set_tracking_uri(tracking_uri)
        mlflow.set_registry_uri(tracking_uri)
        try:
            yield
        finally:
            # MLflow mirrors the globals into these env vars; clearing the globals and
            # restoring the env leaves resolution exactly as the caller had it.
            mlflow.set_tracking_uri(None)
            mlflow.set_registry_uri(None)
            for key, value in saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def _iter_chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: Optional[BaseException] = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _is_retryable(exc: BaseException) -> bool:
    """True for transport failures, timeouts, 5xx/429 answers and locked databases."""
    import requests
    from mlflow.exceptions import MlflowException, RestException
    from mlflow.protos.databricks_pb2 import (
        REQUEST_LIMIT_EXCEEDED,
        TEMPORARILY_UNAVAILABLE,
        ErrorCode,
    )

    retryable_codes = {
        ErrorCode.Name(TEMPORARILY_UNAVAILABLE),
        ErrorCode.Name(REQUEST_LIMIT_EXCEEDED),
    }
    transport: tuple[type[BaseException], ...] = (
        requests.exceptions.ConnectionError,
        requests.exceptions.Timeout,
        requests.exceptions.RetryError,  # MLflow's own HTTP retries on 429/5xx ran out
        ConnectionError,
        TimeoutError,
    )
    try:
        import sqlalchemy.exc
    except ImportError:  # mlflow-skinny: no SQL backends, so no SQL errors either
        pass
    else:
        transport += (sqlalchemy.exc.OperationalError, sqlalchemy.exc.DisconnectionError)
    for e in _iter_chain(exc):
        if isinstance(e, transport):
            return True
        if isinstance(e, MlflowException):
            if e.error_code in retryable_codes:
                return True
            # A JSON error body from the server with a 5xx status.
            if isinstance(e, RestException) and e.get_http_status_code() >= 500:
                return True
    return False


def _error_code(exc: BaseException) -> Optional[str]:
    from mlflow.exceptions import MlflowException

    return exc.error_code if isinstance(exc, MlflowException) else None


def _translate(exc: BaseException, action: str) -> RegistryError:
    """Maps an exception raised while talking to MLflow onto the registry hierarchy."""
    message = _redact(f"{action}: {type(exc).__name__}: {exc}")
    if _is_retryable(exc):
        return RegistryUnavailable(message)
    code = _error_code(exc)
    if code == "RESOURCE_DOES_NOT_EXIST":
        return RegistryNotFound(message)
    if code == "RESOURCE_ALREADY_EXISTS":
        return RegistryConflict(message)
    return RegistryError(message)


def _is_missing(exc: BaseException) -> bool:
    return _error_code(exc) == "RESOURCE_DOES_NOT_EXIST"


def _check_model_name(model_name: str) -> None:
    if not isinstance(model_name, str) or not _MODEL_NAME_RE.match(model_name):
        raise ValueError(
            f"model_name={model_name!r} is not a valid registered model name: use 1-256 "
            "letters, digits, '.', '_' or '-', starting with a letter or digit "
            "(no '/' or ':', which MLflow reserves for URIs)"
        )


def _check_trial_key(trial_key: str) -> None:
    if not isinstance(trial_key, str) or not _TRIAL_KEY_RE.match(trial_key):
        raise ValueError(
            f"trial_key={trial_key!r} is not valid: use 1-250 characters from "
            "letters, digits and '._:/@=+-'"
        )


def _to_uri(location: str) -> str:
    """A local path becomes a `file://` URI; anything with a scheme is kept."""
    if _URI_SCHEME_RE.match(location):
        return location.rstrip("/")
    return Path(location).resolve().as_uri()


def _serving_requirements(meta: Optional[dict[str, Any]] = None) -> list[str]:
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    lightgbm = (meta or {}).get("format") == "lightgbm"
    requirements = []
    for package in LIGHTGBM_SERVING_REQUIREMENTS if lightgbm else SERVING_REQUIREMENTS:
        try:
            # Local version labels ("+cpu") name a wheel index, not a PyPI release.
            requirements.append(f"{package}=={Version(version(package)).public}")
        except PackageNotFoundError:
            requirements.append(package)
    return requirements


def _read_model_dir(model_dir: str) -> dict[str, Any]:
    """Validates a local exported model directory and returns its `meta.json`."""
    path = Path(model_dir)
    try:  # a LightGBM model (meta "format": "lightgbm", training/gbt.py) ships model.txt instead
        lightgbm = json.loads((path / "meta.json").read_text(encoding="utf-8")).get("format") == "lightgbm"
    except (OSError, ValueError, AttributeError):
        lightgbm = False  # a missing or malformed meta.json is reported below
    missing = [n for n in ("model.txt" if lightgbm else "model.pt2", "meta.json") if not (path / n).is_file()]
    if missing:
        raise ValueError(
            f"model_dir={model_dir!r} is not an exported model directory: missing {missing} "
            "(expected model.pt2 and meta.json written by the training process)"
        )
    try:
        meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"model_dir={model_dir!r}: meta.json is not valid JSON: {e}") from e
    features = meta.get("features") if isinstance(meta, dict) else None
    if not isinstance(features, list) or not features:
        raise ValueError(
            f"model_dir={model_dir!r}: meta.json field 'features' must be a non-empty list, "
            f"got {features!r}"
        )
    return meta


def _version_info(mv: "ModelVersion", *, created: bool = False) -> ModelVersionInfo:
    return ModelVersionInfo(
        name=mv.name,
        version=str(mv.version),
        run_id=mv.run_id,
        model_uri=f"models:/{mv.name}/{mv.version}",
        source=mv.source,
        tags=dict(mv.tags or {}),
        aliases=tuple(mv.aliases or ()),
        created=created,
    )


def _float_or_none(value: Optional[str]) -> Optional[float]:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


# Runs in the smoke-test process: stdlib first, then only what a serving image has.
_SMOKE_SCRIPT = r"""
import importlib.abc, json, sys, time, traceback

with open(sys.argv[1], encoding="utf-8") as f:
    request = json.load(f)
blocked = frozenset(request["blocked"])
attempts = []


class ServingImageOnly(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in blocked:
            attempts.append(fullname)
            raise ModuleNotFoundError(f"No module named {fullname!r} (not a serving dependency)", name=fullname)
        return None


sys.meta_path.insert(0, ServingImageOnly())
out = {"blocked_imports": attempts}
try:
    started = time.perf_counter()
    import mlflow.pyfunc
    import numpy as np
    import pandas as pd

    model = mlflow.pyfunc.load_model(request["model_uri"])
    out["load_seconds"] = time.perf_counter() - started
    out["run_id"] = model.metadata.run_id
    example = model.input_example
    if example is None:
        raise ValueError("the model was logged without an input example")
    predictions = {"input_example": np.asarray(model.predict(example)).tolist()}
    for name, sample in request["samples"].items():
        frame = pd.DataFrame(sample["data"], columns=sample["columns"])
        predictions[name] = np.asarray(model.predict(frame)).tolist()
    out["predictions"] = predictions
except BaseException as e:
    chain, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    out["error"] = f"{type(chain[0]).__name__}: {chain[0]}"[:4000]
    out["error_types"] = [type(x).__name__ for x in chain]
    out["traceback"] = traceback.format_exc()[-4000:]
with open(request["output"], "w", encoding="utf-8") as f:
    json.dump(out, f)
"""


class ModelRegistry(dg.ConfigurableResource):
    """MLflow model registry: idempotent registration, aliases and serving checks.

    Attributes:
        tracking_uri: MLflow tracking (and registry) URI: `sqlite:////abs/path/mlflow.db`
            for the embedded environment, `http(s)://host:port` for a tracking server.
        artifact_root: Local directory or `s3://bucket/prefix` under which each
            experiment gets `<experiment_prefix>/<model_name>/` as its artifact location
            when this resource creates it.
        experiment_prefix: Experiments are named `<experiment_prefix>/<model_name>`.
        retry_attempts: Tries per public call while the registry is unavailable.
        retry_backoff_s: Wait before the first retry; doubles on each further one.
    """

    tracking_uri: str = Field(description="MLflow tracking URI (sqlite:////abs/path.db or http(s)://...)")
    artifact_root: str = Field(description="Local directory or s3:// prefix for run artifacts")
    experiment_prefix: str = Field(default="trainyard", description="Prefix of experiment names")
    retry_attempts: int = Field(default=3, ge=1, le=20, description="Tries per call while the registry is unavailable")
    retry_backoff_s: float = Field(default=1.0, ge=0.0, le=60.0, description="First backoff; doubles per retry")

    @field_validator("tracking_uri")
    @classmethod
    def _check_tracking_uri(cls, value: str) -> str:
        if not _URI_SCHEME_RE.match(value):
            raise ValueError(
                f"tracking_uri={value!r} has no URI scheme; expected e.g. "
                "'sqlite:////abs/path/mlflow.db' or 'http://mlflow:5000'"
            )
        if value.startswith("sqlite:///") and not value.startswith("sqlite:////"):
            raise ValueError(
                f"tracking_uri={value!r} is a relative SQLite path, which changes with the "
                "working directory; use four slashes and an absolute path: 'sqlite:////abs/mlflow.db'"
            )
        return value

    @field_validator("artifact_root")
    @classmethod
    def _check_artifact_root(cls, value: str) -> str:
        if not _URI_SCHEME_RE.match(value) and not os.path.isabs(value):
            raise ValueError(
                f"artifact_root={value!r} must be an absolute local path or a URI such as "
                "'s3://bucket/prefix'"
            )
        return value

    @field_validator("experiment_prefix")
    @classmethod
    def _check_experiment_prefix(cls, value: str) -> str:
        if not value or value != value.strip("/ "):
            raise ValueError(
                f"experiment_prefix={value!r} must be non-empty without leading or trailing "
                "'/' or spaces"
            )
        return value

    # -- lookups -----------------------------------------------------------------

    @_retrying
    def find_version(self, model_name: str, trial_key: str) -> Optional[ModelVersionInfo]:
        """Finds the version registered from `trial_key`.

        Args:
            model_name: Registered model name.
            trial_key: Key the version was registered with.

        Returns:
            The lowest-numbered usable version tagged `trainyard.trial_key == trial_key`,
            or None when there is none (also when the model does not exist).

        Raises:
            ValueError: `model_name` or `trial_key` is malformed.
            RegistryUnavailable: The registry could not be reached.
            RegistryError: Any other registry failure.
        """
        _check_model_name(model_name)
        _check_trial_key(trial_key)
        matches = self._search_versions(
            f"name = '{model_name}' and tags.`{TRIAL_KEY_TAG}` = '{trial_key}'",
            action=f"find version of {model_name!r} for trial {trial_key!r}",
        )
        return _version_info(matches[0]) if matches else None

    @_retrying
    def get_version(self, model_name: str, version: str) -> ModelVersionInfo:
        """Returns one model version.

        Raises:
            RegistryNotFound: The model or version does not exist.
            RegistryUnavailable: The registry could not be reached.
        """
        _check_model_name(model_name)
        try:
            mv = _client(self.tracking_uri).get_model_version(model_name, str(version))
        except Exception as e:
            raise _translate(e, f"get version {version} of {model_name!r}") from e
        return _version_info(mv)

    @_retrying
    def list_versions(self, model_name: str) -> list[ModelVersionInfo]:
        """Returns all versions of a model, oldest first ([] when the model does not exist)."""
        _check_model_name(model_name)
        matches = self._search_versions(
            f"name = '{model_name}'",
            action=f"list versions of {model_name!r}",
            usable_only=False,
        )
        return [_version_info(mv) for mv in matches]

    @_retrying
    def get_alias(self, model_name: str, alias: str) -> Optional[ModelVersionInfo]:
        """Returns the version an alias points at.

        Returns:
            The version, or None when the model or the alias does not exist
            (e.g. before the first champion is promoted).

        Raises:
            RegistryUnavailable: The registry could not be reached.
            RegistryError: Any other registry failure.
        """
        _check_model_name(model_name)
        client = _client(self.tracking_uri)
        action = f"get alias {alias!r} of {model_name!r}"
        # Read the model's alias map rather than `get_model_version_by_alias`, which
        # reports a missing alias as INVALID_PARAMETER_VALUE, like a malformed request.
        try:
            registered = client.get_registered_model(model_name)
        except Exception as e:
            if _is_missing(e):
                return None
            raise _translate(e, action) from e
        version = (registered.aliases or {}).get(alias)
        if version is None:
            return None
        return self.get_version(model_name, version)

    @_retrying
    def set_alias(self, model_name: str, alias: str, version: str) -> ModelVersionInfo:
        """Points `alias` at `version` (moving it if it pointed elsewhere).

        Returns:
            The version now holding the alias.

        Raises:
            RegistryNotFound: The model or version does not exist.
            RegistryUnavailable: The registry could not be reached.
            RegistryError: Any other failure (e.g. an alias name MLflow rejects).
        """
        _check_model_name(model_name)
        client = _client(self.tracking_uri)
        action = f"set alias {alias!r} of {model_name!r} to version {version}"
        try:
            # MLflow's SQL store accepts an alias to a version that does not exist.
            client.get_model_version(model_name, str(version))
            client.set_registered_model_alias(model_name, alias, str(version))
            mv = client.get_model_version(model_name, str(version))
        except Exception as e:
            raise _translate(e, action) from e
        return _version_info(mv)

    @_retrying
    def set_version_tags(self, model_name: str, version: str, tags: dict[str, str]) -> None:
        """Sets tags on one version (e.g. the promotion decision and its evidence)."""
        _check_model_name(model_name)
        client = _client(self.tracking_uri)
        try:
            for key, value in tags.items():
                client.set_model_version_tag(model_name, str(version), key, str(value))
        except Exception as e:
            raise _translate(e, f"tag version {version} of {model_name!r}") from e

    @_retrying
    def get_model_tags(self, model_name: str) -> dict[str, str]:
        """Tags of the registered model itself ({} when the model does not exist)."""
        _check_model_name(model_name)
        try:
            registered = _client(self.tracking_uri).get_registered_model(model_name)
        except Exception as e:
            if _is_missing(e):
                return {}
            raise _translate(e, f"get tags of {model_name!r}") from e
        return dict(registered.tags or {})

    @_retrying
    def set_model_tags(self, model_name: str, tags: dict[str, str]) -> None:
        """Sets tags on the registered model (e.g. its champion history).

        Raises:
            RegistryNotFound: The model does not exist.
            RegistryUnavailable: The registry could not be reached.
        """
        _check_model_name(model_name)
        client = _client(self.tracking_uri)
        try:
            for key, value in tags.items():
                client.set_registered_model_tag(model_name, key, str(value))
        except Exception as e:
            raise _translate(e, f"tag registered model {model_name!r}") from e

    @_retrying
    def list_models(self) -> list[str]:
        """Names of all registered models, sorted (lock entries excluded)."""
        client = _client(self.tracking_uri)
        names: list[str] = []
        page_token: Optional[str] = None
        try:
            while True:
                page = client.search_registered_models(page_token=page_token)
                names.extend(m.name for m in page)
                page_token = page.token
                if not page_token:
                    break
        except Exception as e:
            raise _translate(e, "list registered models") from e
        return sorted(n for n in names if not n.endswith(LOCK_MODEL_SUFFIX))

    @_retrying
    def artifact_uri(self, model_name: str, version: str) -> str:
        """Where the artifacts of a version are stored (`s3://...`, `file://...`).

        This is the directory holding the version's `MLmodel`, the location a
        serving runtime that cannot resolve `models:/` URIs (KServe's storage
        initializer) is given.
        """
        _check_model_name(model_name)
        try:
            return str(_client(self.tracking_uri).get_model_version_download_uri(model_name, str(version)))
        except Exception as e:
            raise _translate(e, f"get artifact location of version {version} of {model_name!r}") from e

    @contextlib.contextmanager
    def lock(
        self,
        model_name: str,
        *,
        purpose: str,
        ttl_s: float = 900.0,
        wait_s: float = 900.0,
        poll_s: float = 0.5,
    ) -> Iterator[str]:
        """Holds the per-model critical section (e.g. moving aliases) across processes and hosts.

        The lock is the registered model `<model_name>.trainyard-lock`: creating a
        registered model is atomic in every MLflow backend (a second create fails
        with RESOURCE_ALREADY_EXISTS), and it is deleted on release. A holder that
        died leaves it behind; after `ttl_s` it counts as expired and the next
        caller removes it.

        Args:
            model_name: The model whose aliases are protected.
            purpose: Shown to whoever waits (e.g. "promote v3 (dagster run 1a2b)").
            ttl_s: How long the lock stays valid without being released.
            wait_s: How long to wait for a lock someone else holds.
            poll_s: Interval between attempts while waiting.

        Yields:
            The owner id written to the lock.

        Raises:
            RegistryUnavailable: The lock was still held by someone else after `wait_s`
                (retryable), or the registry could not be reached.
        """
        _check_model_name(model_name)
        lock_name = f"{model_name}{LOCK_MODEL_SUFFIX}"
        owner = f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident()}:{uuid.uuid4().hex[:8]}"
        deadline = time.monotonic() + wait_s
        while not self._try_lock(lock_name, owner, purpose, ttl_s):
            holder = self.get_model_tags(lock_name)
            if holder.get(LOCK_OWNER_TAG) == owner:
                break  # our create went through but its answer was lost; the retry saw it exists
            expires = _float_or_none(holder.get(LOCK_EXPIRES_TAG))
            if holder and (expires is None or expires < time.time()):
                logger.warning("removing expired lock %s held by %s", lock_name, holder.get(LOCK_OWNER_TAG))
                self._unlock(lock_name, holder.get(LOCK_OWNER_TAG))
                continue
            if time.monotonic() >= deadline:
                raise RegistryUnavailable(
                    f"{model_name!r} is locked by {holder.get(LOCK_OWNER_TAG, '?')} for "
                    f"{holder.get(LOCK_PURPOSE_TAG, '?')!r}; waited {wait_s:.0f}s (the lock expires at "
                    f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(expires or 0))})"
                )
            _sleep(poll_s)
        try:
            yield owner
        finally:
            try:
                self._unlock(lock_name, owner)
            except RegistryError as e:
                # The work under the lock is done (or has its own error); an unreleased
                # lock only delays the next holder until it expires.
                logger.warning("could not release lock %s (it expires after %.0fs): %s", lock_name, ttl_s, e)

    @_retrying
    def _try_lock(self, lock_name: str, owner: str, purpose: str, ttl_s: float) -> bool:
        tags = {LOCK_OWNER_TAG: owner, LOCK_PURPOSE_TAG: purpose, LOCK_EXPIRES_TAG: repr(time.time() + ttl_s)}
        try:
            _client(self.tracking_uri).create_registered_model(
                lock_name, tags=tags,
                description="Transient lock held while trainyard moves this model's aliases; deleted on release.",
            )
        except Exception as e:
            if _error_code(e) == "RESOURCE_ALREADY_EXISTS":
                return False
            raise _translate(e, f"acquire lock {lock_name!r}") from e
        return True

    @_retrying
    def _unlock(self, lock_name: str, owner: Optional[str]) -> None:
        """Deletes the lock if `owner` still holds it (a lock taken over after expiry is left alone)."""
        client = _client(self.tracking_uri)
        try:
            holder = dict(client.get_registered_model(lock_name).tags or {})
            if holder.get(LOCK_OWNER_TAG) == owner:
                client.delete_registered_model(lock_name)
        except Exception as e:
            if _is_missing(e):
                return
            raise _translate(e, f"release lock {lock_name!r}") from e

    @_retrying
    def smoke_test(
        self,
        model_uri: str,
        samples: Mapping[str, "pd.DataFrame"],
        *,
        timeout_s: float = 300.0,
        blocked_modules: Sequence[str] = TRAINING_ONLY_MODULES,
    ) -> SmokeResult:
        """Loads `model_uri` in a fresh Python process with only serving dependencies and predicts.

        The process is `python -I` (no working directory or PYTHONPATH on the
        path) with an import hook that makes `blocked_modules` unimportable, as in
        a serving image that has mlflow, torch, numpy and pandas and nothing of
        the training stack. It resolves `model_uri` through this registry, loads
        the pyfunc, predicts on the input example logged with the model and on
        each of `samples`.

        Args:
            model_uri: E.g. `models:/vision.digits@challenger`.
            samples: Named frames to predict on (e.g. `{"test": test_df}`); their
                values are passed exactly (JSON floats round-trip).
            timeout_s: Deadline for the whole process.
            blocked_modules: Top-level packages the process must do without.

        Returns:
            What happened; `passed` is False (with `error`) when the model could not
            be loaded or predict, or the process timed out.

        Raises:
            RegistryUnavailable: The process could not reach the registry or the
                artifact store (retryable; says nothing about the model).
        """
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="trainyard-smoke-") as scratch:
            request = {
                "model_uri": model_uri,
                "blocked": sorted(set(blocked_modules)),
                "output": os.path.join(scratch, "result.json"),
                "samples": {
                    name: {"columns": [str(c) for c in frame.columns], "data": frame.to_numpy().tolist()}
                    for name, frame in samples.items()
                },
            }
            request_path = os.path.join(scratch, "request.json")
            with open(request_path, "w", encoding="utf-8") as f:
                json.dump(request, f)
            env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
            env["MLFLOW_TRACKING_URI"] = self.tracking_uri
            env["MLFLOW_REGISTRY_URI"] = self.tracking_uri
            try:
                proc = subprocess.run(
                    [sys.executable, "-I", "-c", _SMOKE_SCRIPT, request_path],
                    cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout_s,
                )
            except subprocess.TimeoutExpired:
                return SmokeResult(
                    model_uri, None, {}, None, time.perf_counter() - started,
                    error=f"serving process did not finish within {timeout_s:.0f}s",
                )
            seconds = time.perf_counter() - started
            try:
                with open(request["output"], encoding="utf-8") as f:
                    out = json.load(f)
            except (OSError, json.JSONDecodeError):
                return SmokeResult(
                    model_uri, None, {}, None, seconds,
                    error=f"serving process exited with {proc.returncode} and wrote no result: "
                    f"{proc.stderr.strip()[-1500:]}",
                )
        error = out.get("error")
        if error and _TRANSPORT_ERROR_NAMES.intersection(out.get("error_types", [])):
            raise RegistryUnavailable(f"smoke test of {model_uri!r}: the serving process could not reach the registry: {error}")
        return SmokeResult(
            model_uri=model_uri,
            run_id=out.get("run_id"),
            predictions=out.get("predictions", {}),
            load_seconds=out.get("load_seconds"),
            seconds=seconds,
            blocked_imports=tuple(out.get("blocked_imports", ())),
            error=error,
        )

    # -- registration ------------------------------------------------------------

    @_retrying
    def register(
        self,
        model_name: str,
        model_dir: str,
        *,
        trial_key: str,
        tags: dict[str, str],
        metrics: dict[str, float],
        description: str,
        input_example: "pd.DataFrame",
    ) -> ModelVersionInfo:
        """Registers an exported model as a new version, once per trial.

        Steps: find an existing version for `trial_key` (return it, `created=False`);
        otherwise create a run in experiment `<experiment_prefix>/<model_name>` with
        `tags` and `metrics`, log the pyfunc (`training/serving_model.py` with
        `model_dir` as its `model_dir` artifact, signature inferred from
        `input_example`), create the version with `tags`, `trainyard.trial_key` and
        `description`, and finish the run. If any step after the run exists fails,
        a version created by this call is deleted and the run is marked FAILED.

        Args:
            model_name: Registered model name (letters, digits, '.', '_', '-').
            model_dir: Exported model directory (`model.pt2`, `meta.json`): a local
                path or a URI MLflow can download (`s3://...`).
            trial_key: Identity of the trial; registering it twice is a no-op.
            tags: Lineage tags for the run and the version (data version, git commit...).
            metrics: Metrics logged to the run.
            description: Version description.
            input_example: A few rows holding at least `meta["features"]`; the first
                rows of those columns become the input example and signature.

        Returns:
            The version, with `created` telling whether this call created it.

        Raises:
            ValueError: An argument is malformed (names the argument and value).
            RegistryUnavailable: The registry could not be reached; safe to retry.
            RegistryConflict: The experiment `<experiment_prefix>/<model_name>` is deleted.
            RegistryError: Any other failure; nothing half-written is left behind.
        """
        _check_model_name(model_name)
        _check_trial_key(trial_key)
        tags = {str(k): str(v) for k, v in tags.items()}
        if tags.get(TRIAL_KEY_TAG, trial_key) != trial_key:
            raise ValueError(
                f"tags[{TRIAL_KEY_TAG!r}]={tags[TRIAL_KEY_TAG]!r} contradicts trial_key={trial_key!r}"
            )
        tags[TRIAL_KEY_TAG] = trial_key
        try:
            metric_values = {str(k): float(v) for k, v in metrics.items()}
        except (TypeError, ValueError) as e:
            raise ValueError(f"metrics={metrics!r} must map names to numbers: {e}") from e

        existing = self.find_version(model_name, trial_key)
        if existing is not None:
            return existing

        with tempfile.TemporaryDirectory(prefix="trainyard-register-") as scratch:
            local_dir = self._localize(model_dir, scratch)
            meta = _read_model_dir(local_dir)
            example = self._input_example(input_example, meta["features"])
            experiment_id = self._ensure_experiment(model_name)
            self._ensure_registered_model(model_name)
            return self._register_new(
                model_name, local_dir,
                experiment_id=experiment_id, trial_key=trial_key, tags=tags,
                metrics=metric_values, description=description, example=example, meta=meta,
            )

    def _register_new(
        self,
        model_name: str,
        local_dir: str,
        *,
        experiment_id: str,
        trial_key: str,
        tags: dict[str, str],
        metrics: dict[str, float],
        description: str,
        example: "pd.DataFrame",
        meta: dict[str, Any],
    ) -> ModelVersionInfo:
        mlflow = _mlflow()
        from mlflow.entities import Metric, RunStatus

        client = _client(self.tracking_uri)
        action = f"register {model_name!r} for trial {trial_key!r}"
        run_tags = {**tags, "mlflow.note.content": description}
        try:
            run = client.create_run(experiment_id, run_name=trial_key, tags=run_tags)
        except Exception as e:
            raise _translate(e, action) from e
        run_id = run.info.run_id

        try:
            now = run.info.start_time
            client.log_batch(run_id, metrics=[Metric(k, v, now, 0) for k, v in metrics.items()])
            with _fluent_uris(self.tracking_uri), mlflow.start_run(run_id=run_id):
                logged = mlflow.pyfunc.log_model(
                    name=MODEL_ARTIFACT_NAME,
                    python_model=str(SERVING_MODEL_PATH),
                    artifacts={MODEL_DIR_ARTIFACT: local_dir},
                    input_example=example,
                    signature=None,  # inferred from input_example and the model's output
                    pip_requirements=_serving_requirements(meta),
                )
                mv = client.create_model_version(
                    model_name, source=logged.model_uri, run_id=run_id, tags=tags,
                    description=description, model_id=logged.model_id,
                )
                if mv.status != "READY":
                    raise RegistryError(
                        f"{action}: version {mv.version} ended in status {mv.status}: "
                        f"{mv.status_message}"
                    )
                winner = self.find_version(model_name, trial_key)
        except BaseException as e:
            self._abort(model_name, run_id, RunStatus.to_string(RunStatus.FAILED))
            if isinstance(e, Exception) and not isinstance(e, RegistryError):
                raise _translate(e, action) from e
            raise

        if winner is not None and winner.version != str(mv.version):
            # A concurrent register for the same trial created an older version; keep that one.
            self._abort(model_name, run_id, RunStatus.to_string(RunStatus.KILLED))
            return winner
        return _version_info(mv, created=True)

    def _abort(self, model_name: str, run_id: str, status: str) -> None:
        """Best-effort rollback so the registry never holds a half-written registration.

        Versions are found by run id rather than remembered, because
        `create_model_version` can fail after the version exists (e.g. it timed
        out waiting for READY).
        """
        client = _client(self.tracking_uri)
        try:
            for mv in client.search_model_versions(f"name = '{model_name}' and run_id = '{run_id}'"):
                client.delete_model_version(model_name, str(mv.version))
        except Exception:
            logger.exception("could not delete versions of %r from run %s during rollback", model_name, run_id)
        try:
            client.set_terminated(run_id, status)
        except Exception:
            logger.exception("could not mark run %s %s during rollback", run_id, status)

    def _localize(self, model_dir: str, scratch: str) -> str:
        if not _URI_SCHEME_RE.match(model_dir) or model_dir.startswith("file://"):
            path = model_dir[len("file://"):] if model_dir.startswith("file://") else model_dir
            if not os.path.isdir(path):
                raise ValueError(f"model_dir={model_dir!r} is not a directory")
            return os.path.abspath(path)
        from mlflow.artifacts import download_artifacts

        try:
            return download_artifacts(artifact_uri=model_dir, dst_path=scratch)
        except Exception as e:
            raise _translate(e, f"download model_dir={model_dir!r}") from e

    @staticmethod
    def _input_example(input_example: "pd.DataFrame", features: list[str]) -> "pd.DataFrame":
        import pandas as pd

        if not isinstance(input_example, pd.DataFrame) or input_example.empty:
            raise ValueError(
                f"input_example must be a pandas DataFrame with at least one row, got {input_example!r:.200}"
            )
        missing = [c for c in features if c not in input_example.columns]
        if missing:
            raise ValueError(
                f"input_example is missing feature columns {missing} listed in meta.json; "
                f"it has {list(input_example.columns)}"
            )
        # Integer columns stay int64 ("long" in the signature: int inputs pass, MLflow refuses
        # int64 -> double as unsafe), everything else becomes float64 ("double": float32 and
        # float64 pass); the pyfunc casts to the model's float32 itself.
        example = input_example[features].head(INPUT_EXAMPLE_ROWS).reset_index(drop=True)
        return example.astype({c: "int64" if pd.api.types.is_integer_dtype(example[c]) else "float64" for c in features})

    def _ensure_experiment(self, model_name: str) -> str:
        client = _client(self.tracking_uri)
        name = f"{self.experiment_prefix}/{model_name}"
        action = f"create experiment {name!r}"
        location = f"{_to_uri(self.artifact_root)}/{self.experiment_prefix}/{model_name}"
        try:
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                try:
                    return client.create_experiment(name, artifact_location=location)
                except Exception as e:
                    if _error_code(e) != "RESOURCE_ALREADY_EXISTS":
                        raise
                    experiment = client.get_experiment_by_name(name)  # lost a creation race
        except Exception as e:
            raise _translate(e, action) from e
        if experiment is None or experiment.lifecycle_stage != "active":
            raise RegistryConflict(
                f"{action}: experiment exists but is deleted; restore it "
                "(`mlflow experiments restore`) or purge it (`mlflow gc`) before registering"
            )
        return experiment.experiment_id

    def _ensure_registered_model(self, model_name: str) -> None:
        client = _client(self.tracking_uri)
        try:
            client.create_registered_model(model_name)
        except Exception as e:
            if _error_code(e) != "RESOURCE_ALREADY_EXISTS":
                raise _translate(e, f"create registered model {model_name!r}") from e

    def _search_versions(
        self, filter_string: str, *, action: str, usable_only: bool = True
    ) -> list["ModelVersion"]:
        client = _client(self.tracking_uri)
        results: list[ModelVersion] = []
        page_token: Optional[str] = None
        try:
            while True:
                page = client.search_model_versions(filter_string, page_token=page_token)
                results.extend(page)
                page_token = page.token
                if not page_token:
                    break
        except Exception as e:
            raise _translate(e, action) from e
        if usable_only:
            results = [mv for mv in results if mv.status != "FAILED_REGISTRATION"]
        return sorted(results, key=lambda mv: int(mv.version))

    # -- serving -----------------------------------------------------------------

    @_retrying
    def predict(self, model_uri: str, df: "pd.DataFrame") -> "np.ndarray":
        """Loads a model as MLflow serving would and predicts.

        Args:
            model_uri: `models:/<name>/<version>`, `models:/<name>@<alias>` or any
                URI `mlflow.pyfunc.load_model` accepts.
            df: Rows holding the model's feature columns (extra columns are ignored).

        Returns:
            One prediction per row.

        Raises:
            RegistryNotFound: The model or version does not exist.
            RegistryUnavailable: The registry or artifact store could not be reached.
            RegistryError: Loading or predicting failed (e.g. missing feature columns,
                or an alias that does not exist, which MLflow reports as a bad parameter).
        """
        import numpy as np

        mlflow = _mlflow()
        try:
            with _fluent_uris(self.tracking_uri):
                model = mlflow.pyfunc.load_model(model_uri)
            return np.asarray(model.predict(df))
        except Exception as e:
            raise _translate(e, f"predict with {model_uri!r}") from e

    @_retrying
    def evaluate_accuracy(self, model_uri: str, df: "pd.DataFrame", target: str) -> float:
        """Fraction of rows of `df` whose prediction equals `df[target]`.

        Raises:
            ValueError: `target` is not a column of `df`, or `df` has no rows.
            RegistryError: As for `predict`.
        """
        if target not in df.columns:
            raise ValueError(f"target={target!r} is not a column of df; columns: {list(df.columns)}")
        if len(df) == 0:
            raise ValueError("df has no rows; accuracy is undefined")
        predictions = self.predict(model_uri, df.drop(columns=[target]))
        return float((predictions == df[target].to_numpy()).mean())
