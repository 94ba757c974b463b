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

Every public call is retried when the registry is unavailable (transport errors,
5xx, a locked SQLite database): `retry_attempts` tries with exponential backoff
from `retry_backoff_s`, then `RegistryUnavailable` naming the registry and the
number of attempts. Registration is safe to retry because it is idempotent and
cleans up after itself.

Modules, bottom up:

- `errors`: the error hierarchy and `translate_errors`, the one mapping of
  MLflow/requests/SQLAlchemy errors onto it;
- `backend`: the cached `MlflowClient`, MLflow's process-global URIs under a lock,
  the retry decorator and name rules;
- `versions`: `ModelVersionInfo`; `registration`: creating a version, all or nothing;
- `lock`: the per-model critical section (a registered model that exists while held);
- `smoke` (the serving process, standard library only) and `serving` (runs it):
  the serving smoke test;
- `client`: the `ModelRegistry` resource and `tracking_server_command` for the
  cluster's MLflow server (PostgreSQL backend, artifacts on S3).

`import mlflow` is deferred to first use, so importing this package is cheap.

Example:
    >>> from trainyard.lineage import DATA_VERSION_TAG
    >>> registry = ModelRegistry(
    ...     tracking_uri="sqlite:////var/trainyard/mlflow.db",
    ...     artifact_root="/var/trainyard/mlartifacts",
    ... )
    >>> info = registry.register(
    ...     "vision-digits", "/runs/trial-0003/model", trial_key="vision/digits/ab12/trial-0003",
    ...     tags={DATA_VERSION_TAG: "ab12"}, metrics={"test_accuracy": 0.97},
    ...     description="best of sweep ab12", input_example=test_frame.head(5),
    ... )
    >>> registry.set_alias("vision-digits", "champion", info.version)
    >>> registry.evaluate_accuracy("models:/vision-digits@champion", test_frame, "label")
"""

from resources.registry.client import ModelRegistry, tracking_server_command
from resources.registry.errors import (
    RegistryConflict,
    RegistryError,
    RegistryNotFound,
    RegistryUnavailable,
    translate_errors,
)
from resources.registry.lock import LOCK_EXPIRES_TAG, LOCK_MODEL_SUFFIX, LOCK_OWNER_TAG, LOCK_PURPOSE_TAG
from resources.registry.registration import (
    INPUT_EXAMPLE_ROWS,
    LIGHTGBM_SERVING_REQUIREMENTS,
    MODEL_ARTIFACT_NAME,
    MODEL_DIR_ARTIFACT,
    SERVING_MODEL_PATH,
    SERVING_REQUIREMENTS,
)
from resources.registry.serving import TRAINING_ONLY_MODULES, SmokeResult
from resources.registry.versions import TRIAL_KEY_TAG, ModelVersionInfo

__all__ = [
    "INPUT_EXAMPLE_ROWS",
    "LIGHTGBM_SERVING_REQUIREMENTS",
    "LOCK_EXPIRES_TAG",
    "LOCK_MODEL_SUFFIX",
    "LOCK_OWNER_TAG",
    "LOCK_PURPOSE_TAG",
    "MODEL_ARTIFACT_NAME",
    "MODEL_DIR_ARTIFACT",
    "SERVING_MODEL_PATH",
    "SERVING_REQUIREMENTS",
    "TRAINING_ONLY_MODULES",
    "TRIAL_KEY_TAG",
    "ModelRegistry",
    "ModelVersionInfo",
    "RegistryConflict",
    "RegistryError",
    "RegistryNotFound",
    "RegistryUnavailable",
    "SmokeResult",
    "tracking_server_command",
    "translate_errors",
]
