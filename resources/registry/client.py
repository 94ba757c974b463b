"""`ModelRegistry`: the Dagster resource over MLflow's model registry, and the cluster server's command line."""

from __future__ import annotations

import contextlib
import os
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional, Sequence

import dagster as dg
from pydantic import Field, PrivateAttr, field_validator

from resources.registry.backend import (
    URI_SCHEME_RE,
    check_model_name,
    check_trial_key,
    client,
    fluent_uris,
    mlflow_module,
    retried,
)
from resources.registry.errors import MISSING, translate_errors
from resources.registry.lock import LOCK_MODEL_SUFFIX, hold_lock
from resources.registry.registration import create_version
from resources.registry.serving import TRAINING_ONLY_MODULES, SmokeResult, run_smoke_test
from resources.registry.smoke import served_values
from resources.registry.versions import TRIAL_KEY_TAG, ModelVersionInfo, version_info
from trainyard.redact import redact_url

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd
    from mlflow.entities.model_registry import ModelVersion


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
    if not URI_SCHEME_RE.match(backend_store_uri):
        raise ValueError(
            f"backend_store_uri={redact_url(backend_store_uri)!r} must be a database URI such as "
            "'postgresql://user@host:5432/mlflow'"
        )
    if not URI_SCHEME_RE.match(artifact_root):
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


PICKLE_SWITCH = "MLFLOW_ALLOW_PICKLE_DESERIALIZATION"
"""MLflow's opt-in to unpickling models (cloudpickled pyfuncs, pickled flavours); off while trainyard loads one."""


@contextlib.contextmanager
def no_pickled_models() -> Iterator[None]:
    """MLflow refuses pickled models inside the block, whatever the environment says; trainyard logs none."""
    saved = os.environ.get(PICKLE_SWITCH)
    os.environ[PICKLE_SWITCH] = "false"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(PICKLE_SWITCH, None)
        else:
            os.environ[PICKLE_SWITCH] = saved


class ModelRegistry(dg.ConfigurableResource):
    """MLflow model registry: idempotent registration, aliases and serving checks.

    Every public call is retried while the registry is unavailable (see
    `backend.retried`). Tests replace `_sleep` on an instance to observe the
    backoff and lock polling without waiting.

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

    _sleep: Callable[[float], None] = PrivateAttr(default_factory=lambda: time.sleep)

    @field_validator("tracking_uri")
    @classmethod
    def _check_tracking_uri(cls, value: str) -> str:
        if not URI_SCHEME_RE.match(value):
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
        if not URI_SCHEME_RE.match(value) and not os.path.isabs(value):
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

    @retried
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
        check_model_name(model_name)
        check_trial_key(trial_key)
        matches = self._search_versions(
            f"name = '{model_name}' and tags.`{TRIAL_KEY_TAG}` = '{trial_key}'",
            action=f"find version of {model_name!r} for trial {trial_key!r}",
        )
        return version_info(matches[0]) if matches else None

    @retried
    def get_version(self, model_name: str, version: str) -> ModelVersionInfo:
        """Returns one model version.

        Raises:
            RegistryNotFound: The model or version does not exist.
            RegistryUnavailable: The registry could not be reached.
        """
        check_model_name(model_name)
        with translate_errors(f"get version {version} of {model_name!r}"):
            mv = client(self.tracking_uri).get_model_version(model_name, str(version))
        return version_info(mv)

    @retried
    def list_versions(self, model_name: str) -> list[ModelVersionInfo]:
        """Returns all versions of a model, oldest first ([] when the model does not exist)."""
        check_model_name(model_name)
        matches = self._search_versions(
            f"name = '{model_name}'",
            action=f"list versions of {model_name!r}",
            usable_only=False,
        )
        return [version_info(mv) for mv in matches]

    @retried
    def get_alias(self, model_name: str, alias: str) -> Optional[ModelVersionInfo]:
        """Returns the version an alias points at.

        Returns:
            The version, or None when the model or the alias does not exist
            (e.g. before the first champion is promoted).

        Raises:
            RegistryUnavailable: The registry could not be reached.
            RegistryError: Any other registry failure.
        """
        check_model_name(model_name)
        # Read the model's alias map rather than `get_model_version_by_alias`, which
        # reports a missing alias as INVALID_PARAMETER_VALUE, like a malformed request.
        registered = None
        with translate_errors(f"get alias {alias!r} of {model_name!r}", ignore={MISSING}):
            registered = client(self.tracking_uri).get_registered_model(model_name)
        version = None if registered is None else (registered.aliases or {}).get(alias)
        if version is None:
            return None
        return self.get_version(model_name, version)

    @retried
    def set_alias(self, model_name: str, alias: str, version: str) -> ModelVersionInfo:
        """Points `alias` at `version` (moving it if it pointed elsewhere).

        Returns:
            The version now holding the alias.

        Raises:
            RegistryNotFound: The model or version does not exist.
            RegistryUnavailable: The registry could not be reached.
            RegistryError: Any other failure (e.g. an alias name MLflow rejects).
        """
        check_model_name(model_name)
        mlflow_client = client(self.tracking_uri)
        with translate_errors(f"set alias {alias!r} of {model_name!r} to version {version}"):
            # MLflow's SQL store accepts an alias to a version that does not exist.
            mlflow_client.get_model_version(model_name, str(version))
            mlflow_client.set_registered_model_alias(model_name, alias, str(version))
            mv = mlflow_client.get_model_version(model_name, str(version))
        return version_info(mv)

    @retried
    def set_version_tags(self, model_name: str, version: str, tags: dict[str, str]) -> None:
        """Sets tags on one version (e.g. the promotion decision and its evidence)."""
        check_model_name(model_name)
        mlflow_client = client(self.tracking_uri)
        with translate_errors(f"tag version {version} of {model_name!r}"):
            for key, value in tags.items():
                mlflow_client.set_model_version_tag(model_name, str(version), key, str(value))

    @retried
    def get_model_tags(self, model_name: str) -> dict[str, str]:
        """Tags of the registered model itself ({} when the model does not exist)."""
        check_model_name(model_name)
        registered = None
        with translate_errors(f"get tags of {model_name!r}", ignore={MISSING}):
            registered = client(self.tracking_uri).get_registered_model(model_name)
        return {} if registered is None else dict(registered.tags or {})

    @retried
    def set_model_tags(self, model_name: str, tags: dict[str, str]) -> None:
        """Sets tags on the registered model (e.g. its champion history).

        Raises:
            RegistryNotFound: The model does not exist.
            RegistryUnavailable: The registry could not be reached.
        """
        check_model_name(model_name)
        mlflow_client = client(self.tracking_uri)
        with translate_errors(f"tag registered model {model_name!r}"):
            for key, value in tags.items():
                mlflow_client.set_registered_model_tag(model_name, key, str(value))

    @retried
    def list_models(self) -> list[str]:
        """Names of all registered models, sorted (lock entries excluded)."""
        mlflow_client = client(self.tracking_uri)
        names: list[str] = []
        page_token: Optional[str] = None
        with translate_errors("list registered models"):
            while True:
                page = mlflow_client.search_registered_models(page_token=page_token)
                names.extend(m.name for m in page)
                page_token = page.token
                if not page_token:
                    break
        return sorted(n for n in names if not n.endswith(LOCK_MODEL_SUFFIX))

    @retried
    def artifact_uri(self, model_name: str, version: str) -> str:
        """Where the artifacts of a version are stored (`s3://...`, `file://...`).

        This is the directory holding the version's `MLmodel`, the location a
        serving runtime that cannot resolve `models:/` URIs (KServe's storage
        initializer) is given.
        """
        check_model_name(model_name)
        with translate_errors(f"get artifact location of version {version} of {model_name!r}"):
            location = client(self.tracking_uri).get_model_version_download_uri(model_name, str(version))
        return str(location)

    def _search_versions(self, filter_string: str, *, action: str, usable_only: bool = True) -> list["ModelVersion"]:
        mlflow_client = client(self.tracking_uri)
        results: list[ModelVersion] = []
        page_token: Optional[str] = None
        with translate_errors(action):
            while True:
                page = mlflow_client.search_model_versions(filter_string, page_token=page_token)
                results.extend(page)
                page_token = page.token
                if not page_token:
                    break
        if usable_only:
            results = [mv for mv in results if mv.status != "FAILED_REGISTRATION"]
        return sorted(results, key=lambda mv: int(mv.version))

    # -- locking and serving checks ----------------------------------------------

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
        with hold_lock(self, model_name, purpose=purpose, ttl_s=ttl_s, wait_s=wait_s, poll_s=poll_s) as owner:
            yield owner

    @retried
    def smoke_test(
        self,
        model_uri: str,
        samples: Mapping[str, "pd.DataFrame"],
        *,
        timeout_s: float = 300.0,
        blocked_modules: Sequence[str] = TRAINING_ONLY_MODULES,
        params: Optional[Mapping[str, Mapping[str, Any]]] = None,
        generate: Optional[Mapping[str, Any]] = None,
    ) -> SmokeResult:
        """Loads `model_uri` in a fresh Python process with only serving dependencies and predicts.

        The process is `python -I` (no working directory or PYTHONPATH on the
        path) running `resources/registry/smoke.py`, with an import hook that
        makes `blocked_modules` unimportable, as in a serving image that has
        mlflow, torch, numpy and pandas and nothing of the training stack. It
        resolves `model_uri` through this registry, loads the pyfunc, predicts on
        the input example logged with the model and on each of `samples`.

        Args:
            model_uri: E.g. `models:/vision.digits@challenger`.
            samples: Named frames to predict on (e.g. `{"test": test_df}`). Each is
                sent as the JSON body a client would post (`dataframe_split`, values
                of each column's own type; JSON floats round-trip) and read as
                MLflow's scoring server reads it, cast to the model's signature.
            timeout_s: Deadline for the whole process.
            blocked_modules: Top-level packages the process must do without.
            params: Per sample, the predict params it is sent with (a language model's `{"output": "token_nll"}`).
            generate: A language model's prompt, `{"prompt_tokens": [...], "max_new_tokens": n}`: the process
                continues it greedily (`SmokeResult.generated`), as a user's process would.

        Returns:
            What happened; `passed` is False (with `error`) when the model could not
            be loaded or predict, or the process timed out.

        Raises:
            RegistryUnavailable: The process could not reach the registry or the
                artifact store (retryable; says nothing about the model).
        """
        return run_smoke_test(
            self.tracking_uri,
            model_uri,
            samples,
            timeout_s=timeout_s,
            blocked_modules=blocked_modules,
            params=params,
            generate=generate,
        )

    # -- registration ------------------------------------------------------------

    @retried
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
        model_metadata: Optional[Mapping[str, Any]] = None,
        params_example: Optional[Mapping[str, Any]] = None,
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
            model_metadata: Written as the MLflow model's `metadata` (the MLmodel
                file; `mlflow.models.get_model_info(uri).metadata`), e.g. the Feast
                feature reference of each input column. JSON values only.
            params_example: Predict params logged with the input example, so the signature
                declares them with these defaults (a language model's `{"output": "next_token_logits"}`).

        Returns:
            The version, with `created` telling whether this call created it.

        Raises:
            ValueError: An argument is malformed (names the argument and value).
            RegistryUnavailable: The registry could not be reached; safe to retry.
            RegistryConflict: The experiment `<experiment_prefix>/<model_name>` is deleted.
            RegistryError: Any other failure; nothing half-written is left behind.
        """
        check_model_name(model_name)
        check_trial_key(trial_key)
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
        return create_version(
            self, model_name, model_dir, trial_key=trial_key, tags=tags, metrics=metric_values,
            description=description, input_example=input_example, model_metadata=model_metadata,
            params_example=params_example,
        )

    # -- serving -----------------------------------------------------------------

    @retried
    def predict_output(self, model_uri: str, df: "pd.DataFrame", params: Optional[Mapping[str, Any]] = None) -> Any:
        """Loads a model as MLflow serving would and returns what its `predict` returns, as is.

        A current version returns a DataFrame: the kept id/timestamp columns, the
        target column (label or value) and, for a classification, `proba_<label>`
        per class; versions registered before return one prediction per row.
        The promotion re-evaluates a champion from it (`trainyard.promotion.served`);
        `params` go with the call (a language model's `{"output": "token_nll"}`).

        Raises:
            As for `predict`.
        """
        mlflow = mlflow_module()
        with translate_errors(f"predict with {model_uri!r}"):
            with fluent_uris(self.tracking_uri), no_pickled_models():
                model = mlflow.pyfunc.load_model(model_uri)
            return model.predict(df, params=dict(params)) if params else model.predict(df)

    @retried
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
                or an alias that does not exist, which MLflow reports as a bad parameter),
                or the model was refused because its files hold pickled code
                (`training/serving_model.py` checks them before loading; nothing in them ran).
        """
        import numpy as np

        mlflow = mlflow_module()
        with translate_errors(f"predict with {model_uri!r}"):
            with fluent_uris(self.tracking_uri), no_pickled_models():
                model = mlflow.pyfunc.load_model(model_uri)
            predictions = np.asarray(served_values(model.predict(df)))  # the target column of the served frame
        return predictions

    @retried
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
