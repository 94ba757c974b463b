"""Every name the platform derives from a pipeline, and the object store's layout.

One module so that a name is spelled once: the asset, sensor and job code, the
CLI and the tests all ask here. Names are plain strings (no Dagster types), so
the core and the pod side can use them too.

Names of one pipeline `<team>/<pipeline>`:

- asset keys `<team>/<pipeline>/<asset>` (`asset_path`), Dagster's op of each
  asset `<team>__<pipeline>__<asset>` (`node_name`), group `<team>_<pipeline>`;
- jobs `<team>__<pipeline>__{prepare,train,promote}` (`job_names`);
- sensors `__sweep`, `__landing`, `__drift` and the schedule `__retrain`;
- the dynamic partitions of `trial_model` `<team>__<pipeline>__trials`, one
  partition per trial keyed `trial-NNNN` (`trial_key`);
- the Optuna study `<team>.<pipeline>.<md5[:12]>.<fingerprint>` (`study_name`):
  one study per pipeline definition and data version, so the same inputs
  resume the same sweep.

Object store layout (under the store's root):

    runs/<team>/<pipeline>/<study>/<trial>/   a trial: spec.json, result.json, checkpoints, model
    reports/<team>/<pipeline>/<study>/         the sweep report
    data/<team>/<pipeline>/ingest/             the ingest manifest and cached parts
    data/<team>/<pipeline>/raw/<md5>/          a canonical raw snapshot and its DVC pin
    data/<team>/<pipeline>/validated/          latest.json and one folder per split id
    data_docs/<team>/<pipeline>/<md5>/         Great Expectations Data Docs
    quarantine/<team>/<pipeline>/...           rejected data, kept
    handoff/<model>/                           champion change events
    io/<team>/<pipeline>/<asset>/<partition or value>.json   asset values
    platform/gpu_usage/                        the usage report
    reproductions/<model>/                     `trainyard reproduce` outputs
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from trainyard.spec import PipelineSpec
    from trainyard.store import FileStore

RAW_DATA = "raw_data"
VALIDATED_DATA = "validated_data"
SWEEP = "sweep"
TRIAL_MODEL = "trial_model"
BEST_MODEL = "best_model"
REGISTERED_MODEL = "registered_model"
ASSETS = (RAW_DATA, VALIDATED_DATA, SWEEP, TRIAL_MODEL, BEST_MODEL, REGISTERED_MODEL)

# Tags on Dagster runs (not registry tags: those are the lineage record's).
TEAM_TAG = "trainyard/team"  # the key of the per-team run limit in dagster.yaml
STUDY_TAG = "trainyard/study"
PIPELINE_TAG = "trainyard/pipeline"
TRIGGER_TAG = "trainyard/trigger"
LANDING_DIGEST_TAG = "trainyard/landing_digest"
NEW_FILES_TAG = "trainyard/new_files"

TRIAL_PREFIX = "trial-"

# Top-level folders of the object store.
RUNS = "runs"
REPORTS = "reports"
DATA = "data"
DATA_DOCS = "data_docs"
QUARANTINE = "quarantine"
HANDOFF = "handoff"
IO = "io"
PLATFORM = "platform"
REPRODUCTIONS = "reproductions"


def _base(spec: "PipelineSpec") -> str:
    return f"{spec.team}__{spec.name}"


def asset_path(spec: "PipelineSpec", asset: str) -> list[str]:
    """The asset key's path `[team, pipeline, asset]` (wrap it in `dagster.AssetKey`)."""
    return [spec.team, spec.name, asset]


def node_name(spec: "PipelineSpec", asset: str) -> str:
    """The op Dagster names after an asset, `<team>__<pipeline>__<asset>` (as `output_for_node` wants it)."""
    return f"{_base(spec)}__{asset}"


def group_name(spec: "PipelineSpec") -> str:
    """The asset group of a pipeline in the Dagster UI."""
    return f"{spec.team}_{spec.name}"


def job_names(spec: "PipelineSpec") -> dict[str, str]:
    """The pipeline's jobs by role: `prepare`, `train` and `promote`."""
    base = _base(spec)
    return {"prepare": f"{base}__prepare", "train": f"{base}__train", "promote": f"{base}__promote"}


def trials_partitions_name(spec: "PipelineSpec") -> str:
    """The dynamic partitions definition of `trial_model`: one partition per trial."""
    return f"{_base(spec)}__trials"


def sweep_sensor_name(spec: "PipelineSpec") -> str:
    return f"{_base(spec)}__sweep"


def landing_sensor_name(spec: "PipelineSpec") -> str:
    return f"{_base(spec)}__landing"


def drift_sensor_name(spec: "PipelineSpec") -> str:
    return f"{_base(spec)}__drift"


def retrain_schedule_name(spec: "PipelineSpec") -> str:
    return f"{_base(spec)}__retrain"


def tracker_project(spec: "PipelineSpec") -> str:
    """The W&B project of a pipeline; its sweep's study is the run group."""
    return f"{spec.team}-{spec.name}"


def study_name(spec: "PipelineSpec", data_version: str) -> str:
    """One study per pipeline definition and data version: same inputs resume the same sweep."""
    return f"{spec.team}.{spec.name}.{data_version[:12]}.{spec.fingerprint()}"


def trial_key(number: int) -> str:
    """The partition key of trial `number`, e.g. `trial-0003`."""
    return f"{TRIAL_PREFIX}{number:04d}"


def trial_number(key: str) -> int:
    """The trial number of a partition key made by `trial_key`.

    Raises:
        ValueError: `key` is not a trial key.
    """
    prefix, _, num = key.partition("-")
    if prefix != TRIAL_PREFIX.rstrip("-") or not num.isdigit():
        raise ValueError(f"partition key {key!r} is not a trial key like 'trial-0003'")
    return int(num)


def is_trial_key(key: str) -> bool:
    try:
        trial_number(key)
    except ValueError:
        return False
    return True


# --------------------------------------------------------------------------- object store layout


def run_dir(store: "FileStore", team: str, pipeline: str, study: str, trial: str) -> str:
    """A trial's output directory (`TrainSpec.output_uri`)."""
    return store.uri(RUNS, team, pipeline, study, trial)


def trial_results_glob(store: "FileStore", team: str = "*", pipeline: str = "*") -> str:
    """A glob over the `result.json` of every trial (of one pipeline, or of all)."""
    return store.uri(RUNS, team, pipeline, "*", "*", "result.json")


def sweep_report_dir(store: "FileStore", team: str, pipeline: str, study: str) -> str:
    return store.uri(REPORTS, team, pipeline, study)


def ingest_manifest(store: "FileStore", team: str, pipeline: str) -> str:
    return store.uri(DATA, team, pipeline, "ingest", "manifest.json")


def ingest_part(store: "FileStore", team: str, pipeline: str, digest: str) -> str:
    return store.uri(DATA, team, pipeline, "ingest", "parts", f"{digest}.arrow")


def raw_dir(store: "FileStore", team: str, pipeline: str, md5: str) -> str:
    """A canonical raw snapshot: `data.parquet` and its DVC pin `data.parquet.dvc`."""
    return store.uri(DATA, team, pipeline, "raw", md5)


def validated_latest(store: "FileStore", team: str, pipeline: str) -> str:
    """`latest.json`: the newest accepted data version (md5, split id, profile and sample URIs)."""
    return store.uri(DATA, team, pipeline, "validated", "latest.json")


def validated_dir(store: "FileStore", team: str, pipeline: str, split_id: str) -> str:
    """One split: train/val/test Parquet, with the profile, sample and drift kept beside it."""
    return store.uri(DATA, team, pipeline, "validated", split_id)


def data_docs(store: "FileStore", team: str, pipeline: str, md5: str) -> str:
    return store.uri(DATA_DOCS, team, pipeline, md5, "index.html")


def quarantine_dir(store: "FileStore", *parts: str) -> str:
    """Under `quarantine/`: `(team, pipeline)` for a pipeline's, more parts for one entry."""
    return store.uri(QUARANTINE, *parts)


def handoff_dir(store: "FileStore", model: Optional[str] = None) -> str:
    return store.uri(HANDOFF, model) if model else store.uri(HANDOFF)


def asset_value_uri(store: "FileStore", path: list[str], partition: Optional[str] = None, prefix: str = IO) -> str:
    """Where the IO manager keeps an asset's value: `<prefix>/<asset path>/<partition or 'value'>.json`."""
    return store.uri(prefix, *path, f"{partition or 'value'}.json")


def usage_dir(store: "FileStore") -> str:
    return store.uri(PLATFORM, "gpu_usage")


def reproduction_dir(store: "FileStore", model: str, run: str) -> str:
    return store.uri(REPRODUCTIONS, model, run)
