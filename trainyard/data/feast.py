"""Training data from a Feast feature store: the point-in-time join, through the same canonical snapshot as landing
files.

For a pipeline whose `source` is a `FeastSourceSpec`, `feast_snapshot`:

1. ingests the entity landing files (keys, event time, label) with
   `trainyard.data.ingest`: the same manifest, quarantine and DVC pin as any
   landing file; the entity snapshot's md5 names the entity rows;
2. runs `python -m featurestore.retrieve` in the Feast interpreter
   (`TRAINYARD_FEAST_PYTHON`, default `.venv-feast/bin/python` in the project
   directory, `trainyard.project`; Feast needs pandas < 3, so it has its own
   virtual environment and lock), which imports the platform's own
   `featurestore` package wherever it is installed (`run_featurestore`).
   It checks every feature reference against the registry, joins each entity
   row with the feature values known at its event time
   (`get_historical_features`) and answers with the feature views, a hash
   of each one's definition (its spec in the registry), the feature service
   and the time range;
3. casts the rows to the declared columns (`to_canonical`) and writes them
   with `CanonicalParquetWriter`, recording in the file's footer (key
   `trainyard.feast`) the entity snapshot's md5, the references, the
   definitions' hashes and the time range. The DVC md5 of that file is the
   data version: it changes with the entity rows, with any feature view's
   definition (ttl, schema, source...) and with the retrieved values, even
   when the values alone came out equal. A changed definition therefore
   makes a new data version and a new study;
4. pins it with DVC and stores it under `data/<team>/<name>/raw/<md5>/` with
   `feast.json` (the lineage: views, versions, service, time range), where
   validation, drift and the split take it as they take any snapshot.

The registry and offline store are the repository's (`feature_store.yaml`)
unless `TRAINYARD_FEAST_REGISTRY` (a path or URI, never with a password:
database drivers read it from their own variables, e.g. `PGPASSWORD`) or
`TRAINYARD_FEAST_OFFLINE_STORE` (a JSON offline store configuration) name
others, as the cluster environment does.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import tempfile
from typing import Any, Callable, Mapping, Optional, Sequence

import pyarrow.parquet as pq

from common.settings import Settings, SettingsError, settings
from trainyard import naming
from trainyard.data.canonical import CanonicalParquetWriter, canonical_schema, to_canonical
from trainyard.data.errors import DataQualityError
from trainyard.data.ingest import DataPinner, IngestResult, SnapshotRecord, file_md5, ingest
from trainyard.data.quarantine import utc_now
from trainyard.data.sources import landing_spec
from trainyard.feast_source import FeastSourceSpec
from trainyard.project import package_dir, project_dir
from trainyard.redact import redact_url, url_has_credentials
from trainyard.spec import PipelineSpec
from trainyard.store import FileStore

PYTHON_ENV = "TRAINYARD_FEAST_PYTHON"
REGISTRY_ENV = "TRAINYARD_FEAST_REGISTRY"
OFFLINE_STORE_ENV = "TRAINYARD_FEAST_OFFLINE_STORE"
METADATA_KEY = "trainyard.feast"
"""Footer key of a Feast snapshot: what it was retrieved from (entity md5, references, definitions, time range)."""
LINEAGE_FILE = "feast.json"
RETRIEVE_TIMEOUT_S = 900.0


class FeastUnavailable(Exception):
    """The Feast interpreter or its configuration is missing or unusable: a setup problem, terminal."""


def _settings(env: Optional[Mapping[str, str]]) -> Settings:
    """The `TRAINYARD_*` settings in `env` (default: this process's); a value that does not parse is `FeastUnavailable`
    (naming it)."""
    try:
        return settings(env)
    except SettingsError as e:
        raise FeastUnavailable(str(e)) from None


class FeastRefused(DataQualityError):
    """The feature store refused the request: an unknown view, feature or service, or bad entity rows.

    Attributes:
        kind: `unknown_feature_view`, `unknown_feature`, `unknown_feature_service`, `entity_rows`, `repo` or `request`.
    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class FeastFailed(Exception):
    """The Feast process failed unexpectedly (a crash, a deadline); the message carries its output."""


@dataclasses.dataclass
class FeastSnapshot:
    """What `feast_snapshot` made.

    Attributes:
        snapshot: The retrieved, canonical snapshot (its md5 is the data version).
        entities: The ingestion of the entity landing files.
        lineage: Feature views (name, definition hash, version), references,
            feature service, time range and the entity snapshot's md5.
        reused: The same bytes were retrieved and pinned before.
    """

    snapshot: SnapshotRecord
    entities: IngestResult
    lineage: dict[str, Any]
    reused: bool


def feast_python(env: Optional[Mapping[str, str]] = None) -> str:
    """The Feast interpreter: `TRAINYARD_FEAST_PYTHON`, or `.venv-feast/bin/python` in the project directory.

    Raises:
        FeastUnavailable: It does not exist; the message names the variable and `make install`.
    """
    python = _settings(env).feast_python or str(project_dir(env) / ".venv-feast" / "bin" / "python")
    if not os.path.isfile(python) or not os.access(python, os.X_OK):
        raise FeastUnavailable(
            f"no Feast interpreter at {python}: run `make install` (it creates .venv-feast from "
            "deploy/feast/constraints.txt) "
            f"or set {PYTHON_ENV} to a Python with feast installed"
        )
    return python


def store_config(env: Optional[Mapping[str, str]] = None) -> dict[str, Any]:
    """The registry and offline store the environment names (`registry`, `offline_store`), each None when unset.

    Raises:
        FeastUnavailable: The registry URI carries a password, or the offline store is not a JSON object.
    """
    s = _settings(env)
    registry = s.feast_registry
    if registry and url_has_credentials(registry):
        raise FeastUnavailable(
            f"{REGISTRY_ENV}={redact_url(registry)} carries a password, which would be kept in run configuration and "
            "logs; "
            "set it without one and give the password to the database driver by its own variable (PGPASSWORD for "
            "PostgreSQL)"
        )
    return {
        "registry": registry,
        "offline_store": s.feast_offline_store,
    }  # a JSON object with a 'type' (common.settings)


def repo_path(store: FileStore, source: FeastSourceSpec) -> str:
    """The Feast repository's local directory: `source.repo` if absolute, else under the store root.

    Raises:
        FeastUnavailable: A relative repository on an object store that is not local.
    """
    if os.path.isabs(source.repo):
        return source.repo
    if store.is_s3:
        raise FeastUnavailable(
            f"source.repo {source.repo!r} is relative to an s3:// store; a Feast repository is a local directory, "
            "give its absolute path"
        )
    return store.uri(source.repo)


def run_featurestore(
    module: str, args: Sequence[str] = (), *, input: Optional[str] = None, env: Optional[Mapping[str, str]] = None,
    timeout_s: float = RETRIEVE_TIMEOUT_S,
) -> subprocess.CompletedProcess[str]:
    """Run `python -m featurestore.<module> *args` in the Feast interpreter (warnings off); the finished process.

    The platform's `featurestore` package is wherever trainyard is installed (the checkout, or
    site-packages beside pandas 3), which the Feast interpreter must not see whole; so the
    process starts in a temporary folder holding only a link to that package, which `-m`
    puts first on its `sys.path`.

    Raises:
        FeastUnavailable: No Feast interpreter, or trainyard is installed without `featurestore`.
        subprocess.TimeoutExpired: The process ran past `timeout_s`.
    """
    python = feast_python(env)
    try:
        package = package_dir("featurestore")
    except ModuleNotFoundError as e:
        raise FeastUnavailable(f"the featurestore package is not installed with trainyard: {e}") from e
    child_env = {**(os.environ if env is None else env), "PYTHONWARNINGS": "ignore"}
    with tempfile.TemporaryDirectory(prefix="trainyard-featurestore-") as cwd:
        os.symlink(package, os.path.join(cwd, "featurestore"), target_is_directory=True)
        return subprocess.run([python, "-m", f"featurestore.{module}", *args], input=input, capture_output=True,
                              text=True, cwd=cwd, env=child_env, timeout=timeout_s)


def run_retrieve(
    request: dict[str, Any], env: Optional[Mapping[str, str]] = None, timeout_s: float = RETRIEVE_TIMEOUT_S
) -> dict[str, Any]:
    """Run `python -m featurestore.retrieve` in the Feast interpreter with `request`; its answer.

    Raises:
        FeastUnavailable: No Feast interpreter.
        FeastRefused: The request was refused (exit 2 with an error answer).
        FeastFailed: The process crashed, printed no answer, or passed its deadline.
    """
    try:
        proc = run_featurestore("retrieve", input=json.dumps(request), env=env, timeout_s=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise FeastFailed(f"featurestore.retrieve did not finish within {timeout_s:.0f} s") from e
    lines = proc.stdout.strip().splitlines()
    try:
        answer: dict[str, Any] = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError) as e:
        raise FeastFailed(
            f"featurestore.retrieve exited {proc.returncode} without an answer: {proc.stderr[-3000:]}"
        ) from e
    if "error" in answer:
        raise FeastRefused(answer["error"]["kind"], answer["error"]["message"])
    if proc.returncode != 0:
        raise FeastFailed(f"featurestore.retrieve exited {proc.returncode}: {proc.stderr[-3000:]}")
    return answer


def provenance(answer: dict[str, Any], entity_md5: str) -> dict[str, Any]:
    """What the snapshot's footer records: everything that decides the rows, nothing that changes without changing them
    (apply times)."""
    return {
        "entity_md5": entity_md5,
        "project": answer["project"],
        "features": answer["features"],
        "feature_service": answer["feature_service"],
        "feature_views": [{k: v for k, v in view.items() if k != "updated"} for view in answer["feature_views"]],
        "time_range": answer["time_range"],
    }


def feast_snapshot(
    store: FileStore,
    spec: PipelineSpec,
    versioning: Optional[DataPinner] = None,
    *,
    env: Optional[Mapping[str, str]] = None,
    log: Optional[Callable[[str], None]] = None,
    timeout_s: float = RETRIEVE_TIMEOUT_S,
) -> FeastSnapshot:
    """Ingest the entity files, retrieve their features as of each row's time and pin the canonical result (module
    docstring).

    Raises:
        MissingLandingData, IngestRejected, LandingFileChanged: As `ingest` does for the entity files.
        FeastUnavailable: No Feast interpreter, or a bad store configuration.
        FeastRefused: An unknown feature reference, view or service; entity rows without keys or event times.
        FeastFailed: The Feast process failed.
        SchemaMismatch: A retrieved feature cannot be cast to its declared column's type, or is missing.
    """
    source = spec.source
    if not isinstance(source, FeastSourceSpec):
        raise TypeError(f"{spec.key}: source is not a FeastSourceSpec")
    entities = ingest(store, landing_spec(spec), versioning, log=log)  # the landing files are the entity rows
    with tempfile.TemporaryDirectory(prefix="trainyard-feast-") as tmp:
        entity_file, retrieved, local = (
            os.path.join(tmp, n) for n in ("entities.parquet", "retrieved.parquet", "data.parquet")
        )
        store.get_file(entities.snapshot.uri, entity_file)
        request = {
            "repo": repo_path(store, source), "project": source.project, **store_config(env),
            "entities": entity_file, "keys": list(source.keys), "timestamp": source.timestamp,
            "features": source.features, "feature_service": source.feature_service, "out": retrieved,
        }
        answer = run_retrieve(request, env, timeout_s)
        footer = provenance(answer, entities.snapshot.md5)
        with CanonicalParquetWriter(local, canonical_schema(spec)) as writer:
            for batch in pq.ParquetFile(retrieved).iter_batches():
                writer.write(to_canonical(batch, spec))
            writer.add_metadata({METADATA_KEY: json.dumps(footer, sort_keys=True)})
        rows = writer.rows
        md5 = file_md5(local)
        base = naming.raw_dir(store, spec.team, spec.name, md5)
        reused = store.exists(f"{base}/{LINEAGE_FILE}")
        if not reused:
            dvc_file = ""
            if versioning is not None:
                pin = versioning.pin(local)
                md5, dvc_file = pin.md5, pin.dvc_file
                base = naming.raw_dir(store, spec.team, spec.name, md5)
            store.put_file(local, f"{base}/data.parquet")
            if dvc_file:
                store.write_bytes(f"{base}/data.parquet.dvc", dvc_file.encode())
    lineage = {
        **footer,
        "entity_uri": entities.snapshot.uri,
        "updated": {v["name"]: v.get("updated") for v in answer["feature_views"]},
    }
    if reused:
        existing = SnapshotRecord.model_validate(store.read_json(f"{base}/manifest.json")["snapshot"])
        return FeastSnapshot(existing, entities, lineage, True)
    snapshot = SnapshotRecord(
        md5=md5,
        uri=f"{base}/data.parquet",
        rows=rows,
        files=entities.snapshot.files,
        key=f"feast:{entities.snapshot.md5}",
        dvc_file=dvc_file,
        created_at=utc_now(),
    )
    store.write_json(f"{base}/manifest.json", {"snapshot": snapshot.model_dump(), "feast": lineage})
    store.write_json(f"{base}/{LINEAGE_FILE}", lineage)
    return FeastSnapshot(snapshot, entities, lineage, False)


def read_lineage(store: FileStore, spec: PipelineSpec, md5: str) -> Optional[dict[str, Any]]:
    """The Feast lineage of data version `md5` (`feast.json`), or None for a snapshot of landing files."""
    if not isinstance(spec.source, FeastSourceSpec):
        return None  # no store round trip per trial for a file source
    uri = f"{naming.raw_dir(store, spec.team, spec.name, md5)}/{LINEAGE_FILE}"
    return store.read_json(uri) if store.exists(uri) else None
