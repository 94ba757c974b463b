"""Registering an exported model directory as a new MLflow model version, all or nothing.

The pyfunc logged with every version is the models-from-code file
`training/serving_model.py` (logged by path, never imported here) with the
model directory as its `model_dir` artifact, so loading a version needs only
`mlflow.pyfunc` and torch (or LightGBM). A failure after the MLflow run exists
deletes any version the run created and marks the run FAILED.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional, Protocol

from resources.registry.backend import URI_SCHEME_RE, RegistryConnection, client, fluent_uris, mlflow_module, to_uri
from resources.registry.errors import ALREADY_EXISTS, RegistryConflict, RegistryError, translate_errors
from resources.registry.versions import ModelVersionInfo, version_info
from trainyard.project import package_file

if TYPE_CHECKING:
    import pandas as pd

logger = logging.getLogger(__name__)

SERVING_MODEL_PATH = package_file("training", "serving_model.py")
"""The models-from-code pyfunc logged with every version: a file of `training` (a path, never imported here)."""
PREPROCESSING_PATH = package_file("training", "preprocessing.py")
"""The platform's preprocessing, shipped with every version (`code_paths`): the pyfunc imports it as `preprocessing`."""
SERVING_LM_PATH = package_file("training", "serving_lm.py")
"""A language model's serving (`CausalLM`, its tokenizer), shipped with every version (`code_paths`): the pyfunc imports
it as `serving_lm`."""
CODE_PATHS = (PREPROCESSING_PATH, SERVING_LM_PATH)
"""The files of `training` every version ships beside the pyfunc (MLflow `code_paths`)."""

MODEL_ARTIFACT_NAME = "model"
MODEL_DIR_ARTIFACT = "model_dir"
# Packages the pyfunc imports; pinned to this process's versions in requirements.txt.
SERVING_REQUIREMENTS = ("mlflow", "torch", "numpy", "pandas")
LIGHTGBM_SERVING_REQUIREMENTS = ("mlflow", "lightgbm", "numpy", "pandas")
INPUT_EXAMPLE_ROWS = 5


class RegisteringRegistry(RegistryConnection, Protocol):
    """What registration needs of the registry (`ModelRegistry`)."""

    @property
    def artifact_root(self) -> str: ...
    @property
    def experiment_prefix(self) -> str: ...

    def find_version(self, model_name: str, trial_key: str) -> Optional[ModelVersionInfo]: ...


def create_version(
    registry: RegisteringRegistry,
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
    """Validates the model directory, example and metadata, then registers a new version (see `ModelRegistry.register`).

    Arguments are already checked by the caller except `model_dir`,
    `input_example` and `model_metadata`, which are checked here.
    """
    metadata = model_metadata_of(model_metadata)
    with tempfile.TemporaryDirectory(prefix="trainyard-register-") as scratch:
        local_dir = localize(model_dir, scratch)
        meta = read_model_dir(local_dir)
        loose = loose_input_columns(meta, preprocessing_state(local_dir, meta))  # before anything is written
        example = input_example_of(input_example, meta["features"], meta.get("keep") or ())
        experiment_id = ensure_experiment(registry, model_name)
        ensure_registered_model(registry.tracking_uri, model_name)
        return _register_new(
            registry, model_name, local_dir,
            experiment_id=experiment_id, trial_key=trial_key, tags=tags,
            metrics=metrics, description=description, example=example, meta=meta, metadata=metadata, loose=loose,
            params=dict(params_example) if params_example else None,
        )


def _register_new(
    registry: RegisteringRegistry,
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
    metadata: Optional[dict[str, Any]],
    loose: list[str],
    params: Optional[dict[str, Any]] = None,
) -> ModelVersionInfo:
    mlflow = mlflow_module()
    from mlflow.entities import Metric, RunStatus

    mlflow_client = client(registry.tracking_uri)
    action = f"register {model_name!r} for trial {trial_key!r}"
    run_tags = {**tags, "mlflow.note.content": description}
    with translate_errors(action):
        run = mlflow_client.create_run(experiment_id, run_name=trial_key, tags=run_tags)
    run_id = run.info.run_id

    try:
        with translate_errors(action):
            now = run.info.start_time
            mlflow_client.log_batch(run_id, metrics=[Metric(k, v, now, 0) for k, v in metrics.items()])
            with fluent_uris(registry.tracking_uri), mlflow.start_run(run_id=run_id):
                logged = mlflow.pyfunc.log_model(
                    name=MODEL_ARTIFACT_NAME,
                    python_model=str(SERVING_MODEL_PATH),
                    artifacts={MODEL_DIR_ARTIFACT: local_dir},
                    # With params, MLflow infers their schema too (a language model's `output`), with these defaults.
                    input_example=(example, params) if params else example,
                    signature=None,  # inferred from input_example and the model's output
                    pip_requirements=serving_requirements(meta),
                    code_paths=[str(path) for path in CODE_PATHS],
                    metadata=metadata,
                )
                if loose:
                    relax_signature(logged.model_uri, loose)
                mv = mlflow_client.create_model_version(
                    model_name, source=logged.model_uri, run_id=run_id, tags=tags,
                    description=description, model_id=logged.model_id,
                )
                if mv.status != "READY":
                    raise RegistryError(
                        f"{action}: version {mv.version} ended in status {mv.status}: "
                        f"{mv.status_message}"
                    )
                winner = registry.find_version(model_name, trial_key)
    except BaseException:
        abort(registry.tracking_uri, model_name, run_id, RunStatus.to_string(RunStatus.FAILED))
        raise

    if winner is not None and winner.version != str(mv.version):
        # A concurrent register for the same trial created an older version; keep that one.
        abort(registry.tracking_uri, model_name, run_id, RunStatus.to_string(RunStatus.KILLED))
        return winner
    return version_info(mv, created=True)


LOOSE_INPUT_DTYPES = ("int", "bool", "date", "datetime")
"""Declared feature dtypes whose served inputs legitimately arrive in more than one pandas dtype: dates as text
(a CSV) or as dates (Parquet, a database driver); integers and booleans with gaps as floats or objects, without
gaps as int64 or bool. MLflow's schema enforcement would refuse all but the example's own dtype; the model's
preprocessing parses and checks them itself (`training/preprocessing.py`), naming the column when a value is wrong.
Kept id and timestamp columns are `Any` too: they are returned as given."""


def preprocessing_state(model_dir: str, meta: Optional[Mapping[str, Any]]) -> Optional[dict[str, Any]]:
    """The exported model's preprocessing state (`preprocessing.json`), or None when it has none.

    Raises:
        ValueError: meta.json names a state file that is missing or not a JSON object (the export is broken;
            the served model could not load it either).
    """
    name = (meta or {}).get("preprocessing")
    if not isinstance(name, str):
        return None
    path = Path(model_dir) / name
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(
            f"model_dir={model_dir!r}: meta.json names preprocessing state {name!r}, which cannot be read: {e}"
        ) from e
    if not isinstance(state, dict):
        raise ValueError(f"model_dir={model_dir!r}: {name} is not a JSON object")
    return state


def loose_input_columns(meta: Optional[Mapping[str, Any]], state: Optional[Mapping[str, Any]] = None) -> list[str]:
    """The input columns of a preprocessing model whose signature type becomes MLflow's `Any` (`LOOSE_INPUT_DTYPES`).

    A model whose table was numeric and complete (`passthrough` state: no parsing, the
    columns reach the model as they are) keeps MLflow's own types for its features.
    """
    if not meta or not meta.get("preprocessing"):
        return []
    passthrough = bool(state and state.get("passthrough"))
    loose = (
        []
        if passthrough
        else [c for c, dtype in (meta.get("feature_types") or {}).items() if dtype in LOOSE_INPUT_DTYPES]
    )
    # Id and timestamp columns are echoed back, never read by the model: whatever type the caller has passes.
    return loose + [c for c in meta.get("keep") or () if c not in loose]


def relax_signature(model_uri: str, columns: list[str]) -> None:
    """Retype `columns` of a logged model's inferred input signature as `Any` (kept required, same order)."""
    import mlflow.models
    from mlflow.models import ModelSignature
    from mlflow.types.schema import AnyType, ColSpec, Schema

    signature = mlflow.models.get_model_info(model_uri).signature
    if signature is None or signature.inputs is None:
        return
    inputs = [
        ColSpec(AnyType(), c.name, required=c.required) if c.name in columns else c for c in signature.inputs.inputs
    ]
    mlflow.models.set_signature(
        model_uri, ModelSignature(inputs=Schema(inputs), outputs=signature.outputs, params=signature.params)
    )


def abort(tracking_uri: str, model_name: str, run_id: str, status: str) -> None:
    """Best-effort rollback so the registry never holds a half-written registration.

    Versions are found by run id rather than remembered, because
    `create_model_version` can fail after the version exists (e.g. it timed
    out waiting for READY).
    """
    mlflow_client = client(tracking_uri)
    try:
        for mv in mlflow_client.search_model_versions(f"name = '{model_name}' and run_id = '{run_id}'"):
            mlflow_client.delete_model_version(model_name, str(mv.version))
    except Exception:
        logger.exception("could not delete versions of %r from run %s during rollback", model_name, run_id)
    try:
        mlflow_client.set_terminated(run_id, status)
    except Exception:
        logger.exception("could not mark run %s %s during rollback", run_id, status)


def localize(model_dir: str, scratch: str) -> str:
    """A local directory for `model_dir`: itself when local, else downloaded into `scratch`."""
    if not URI_SCHEME_RE.match(model_dir) or model_dir.startswith("file://"):
        path = model_dir[len("file://"):] if model_dir.startswith("file://") else model_dir
        if not os.path.isdir(path):
            raise ValueError(f"model_dir={model_dir!r} is not a directory")
        return os.path.abspath(path)
    from mlflow.artifacts import download_artifacts

    with translate_errors(f"download model_dir={model_dir!r}"):
        local = download_artifacts(artifact_uri=model_dir, dst_path=scratch)
    return local


def input_example_of(input_example: "pd.DataFrame", features: list[str], keep: Any = ()) -> "pd.DataFrame":
    """The first rows of the kept (id, timestamp) columns the example holds and of the feature columns,
    with the dtypes the logged signature should have: raw text and dates stay as they are (the model preprocesses
    them)."""
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
    columns = [c for c in keep if c in input_example.columns and c not in features] + list(features)
    example = input_example[columns].head(INPUT_EXAMPLE_ROWS).reset_index(drop=True)
    # MLflow infers no signature at all from a zone-aware datetime column (only a warning): the example carries UTC as
    # naive.
    for c in columns:
        if isinstance(example[c].dtype, pd.DatetimeTZDtype):
            example[c] = example[c].dt.tz_convert("UTC").dt.tz_localize(None)
    numeric = [
        c for c in columns if pd.api.types.is_numeric_dtype(example[c]) or pd.api.types.is_bool_dtype(example[c])
    ]
    return example.astype(
        {
            c: "int64"
            if pd.api.types.is_integer_dtype(example[c]) and not pd.api.types.is_bool_dtype(example[c])
            else "float64"
            for c in numeric
        }
    )


def model_metadata_of(model_metadata: Optional[Mapping[str, Any]]) -> Optional[dict[str, Any]]:
    """`model_metadata` as the plain dict the MLmodel file holds, or None.

    Raises:
        ValueError: It is not a mapping with string keys and JSON values.
    """
    if model_metadata is None:
        return None
    if not isinstance(model_metadata, Mapping) or not all(isinstance(k, str) for k in model_metadata):
        raise ValueError(f"model_metadata must be a mapping with string keys, got {model_metadata!r:.200}")
    try:
        return dict(json.loads(json.dumps(dict(model_metadata), allow_nan=False)))
    except (TypeError, ValueError) as e:
        raise ValueError(f"model_metadata must hold JSON values only (the MLmodel file stores it): {e}") from e


def ensure_experiment(registry: RegisteringRegistry, model_name: str) -> str:
    """The id of experiment `<experiment_prefix>/<model_name>`, created on first use.

    Raises:
        RegistryConflict: The experiment exists but is deleted.
    """
    mlflow_client = client(registry.tracking_uri)
    name = f"{registry.experiment_prefix}/{model_name}"
    action = f"create experiment {name!r}"
    location = f"{to_uri(registry.artifact_root)}/{registry.experiment_prefix}/{model_name}"
    with translate_errors(action):
        experiment = mlflow_client.get_experiment_by_name(name)
        if experiment is None:
            with translate_errors(action, ignore={ALREADY_EXISTS}):
                return mlflow_client.create_experiment(name, artifact_location=location)
            experiment = mlflow_client.get_experiment_by_name(name)  # lost a creation race
    if experiment is None or experiment.lifecycle_stage != "active":
        raise RegistryConflict(
            f"{action}: experiment exists but is deleted; restore it "
            "(`mlflow experiments restore`) or purge it (`mlflow gc`) before registering"
        )
    return experiment.experiment_id


def ensure_registered_model(tracking_uri: str, model_name: str) -> None:
    """Creates the registered model unless it exists."""
    with translate_errors(f"create registered model {model_name!r}", ignore={ALREADY_EXISTS}):
        client(tracking_uri).create_registered_model(model_name)


def serving_requirements(meta: Optional[dict[str, Any]] = None) -> list[str]:
    """The pip requirements of the logged pyfunc, pinned to this process's versions."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    lightgbm = (meta or {}).get("format") == "lightgbm"
    requirements = []
    packages: tuple[str, ...] = LIGHTGBM_SERVING_REQUIREMENTS if lightgbm else SERVING_REQUIREMENTS
    if (meta or {}).get("tokenizer"):  # a language model's `generate` reads its BPE tokenizer with `tokenizers`
        packages = (*packages, "tokenizers")
    for package in packages:
        try:
            # Local version labels ("+cpu") name a wheel index, not a PyPI release.
            requirements.append(f"{package}=={Version(version(package)).public}")
        except PackageNotFoundError:
            requirements.append(package)
    return requirements


def read_model_dir(model_dir: str) -> dict[str, Any]:
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
