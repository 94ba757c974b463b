"""Retraining triggers besides new landing data: a cron schedule and a drift sensor.

A pipeline's `RetrainPolicy` (or its team's default) chooses them; see
`trainyard.spec.RetrainPolicy`. The rule they share: nothing retrains on a data
version that was already trained on. A data version is the DVC md5 of the raw
snapshot (`raw_data`'s `DataVersion`); a sweep is one Optuna study per pipeline
definition and data version (`trainyard.naming.study_name`), so "already trained
on" means the latest `sweep` materialization is that version's study.

- Schedule `<team>__<name>__retrain` (`RetrainPolicy.cron`): each tick lists the
  landing files. New or changed files -> one `prepare` run (ingest, validate and,
  unless drift gates retraining, sweep). Nothing new and the newest validated
  version already swept -> skip, saying which version and study. Nothing new but
  the newest version never swept (a failed run, a changed pipeline) -> a run.
- Sensor `<team>__<name>__drift` (`RetrainPolicy.drift_psi`): compares the rows
  the newest validated version added since the version the `champion` model was
  trained on (its registry tags `trainyard.data_version` and
  `trainyard.test_split`) with that version's data, with the same per-delivery
  drift as `validated_data` (`trainyard.data.delivery_drift`, PSI over the kept
  profile and sample of the champion's data), and requests the sweep only when the
  largest PSI exceeds `drift_psi`. The measured drift goes into the run's tags
  (`trainyard/drift_psi`, `trainyard/drift_column`, ...) or the skip reason.
  Without a champion the newest version is swept (the first model).

Both have the launcher start its warm worker server when they request a run
that sweeps (`pipelines.landing_sensor.prestart_for_sweep`): a drift run is the
sweep alone, whose first trials would otherwise wait for the server's imports.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import pyarrow.parquet as pq
from dagster import (
    AssetKey,
    DagsterInstance,
    DefaultScheduleStatus,
    DefaultSensorStatus,
    RunRequest,
    ScheduleDefinition,
    ScheduleEvaluationContext,
    SensorDefinition,
    SensorEvaluationContext,
    SkipReason,
    schedule,
    sensor,
)

from assets.factory import asset_key
from instance.storage_connections import evaluation_instance, evaluation_resources
from pipelines.landing_sensor import continuation_selection, prestart_for_sweep
from pipelines.sensor_timing import ticks_every
from pipelines.sensors import latest_study
from resources.launcher import Launcher
from resources.registry import ModelVersionInfo
from resources.storage import ObjectStore
from trainyard import naming
from trainyard.data import ingest
from trainyard.data.drift_detection import delivery_drift
from trainyard.lineage import DATA_VERSION_TAG, TEST_SPLIT_TAG
from trainyard.naming import LANDING_DIGEST_TAG, NEW_FILES_TAG, PIPELINE_TAG, TRIGGER_TAG
from trainyard.promotion import CHAMPION
from trainyard.spec import PipelineSpec

DRIFT_MINIMUM_INTERVAL_SECONDS = ticks_every(300)  # every 5 minutes (pipelines.sensor_timing)


def prepare_selection(spec: PipelineSpec) -> list[AssetKey]:
    """What a landing or scheduled run materializes: all of `prepare`, or ingest and validation only when drift gates
    retraining."""
    return [asset_key(spec, naming.RAW_DATA), *continuation_selection(spec)]


def latest_validated(store: ObjectStore, spec: PipelineSpec) -> Optional[dict[str, Any]]:
    """The newest accepted data version (`validated/latest.json`: md5, split_id, profile and sample URIs), or None."""
    uri = naming.validated_latest(store, spec.team, spec.name)
    return store.read_json(uri) if store.exists(uri) else None


def swept(instance: DagsterInstance, spec: PipelineSpec, md5: str) -> Optional[str]:
    """The study of the latest sweep when it is this data version's study (already trained on), else None."""
    study = naming.study_name(spec, md5)
    return study if latest_study(instance, spec) == study else None


def evaluate_schedule(spec: PipelineSpec, store: ObjectStore, instance: DagsterInstance) -> RunRequest | SkipReason:
    """One tick of the retrain schedule (see the module docstring), as a function of the store and the instance."""
    files = ingest.list_landing(store, spec.source)
    if not files:
        return SkipReason(
            f"{spec.key}: no landing files match {', '.join(ingest.landing_patterns(store, spec.source))}"
        )
    tags = {PIPELINE_TAG: spec.key, TRIGGER_TAG: "cron"}
    pending = ingest.pending_files(store, spec, files)
    if pending or ingest.removed_files(store, spec, files):
        digest = ingest.landing_digest(files)
        return RunRequest(
            asset_selection=prepare_selection(spec),
            tags={**tags, LANDING_DIGEST_TAG: digest, NEW_FILES_TAG: str(len(pending))},
        )
    latest = latest_validated(store, spec)
    if latest is None:
        return SkipReason(
            f"{spec.key}: {len(files)} landing file(s), all ingested, and no accepted data version (see `trainyard "
            "data quarantine`)"
        )
    md5 = latest["md5"]
    study = swept(instance, spec, md5)
    if study is not None:
        return SkipReason(
            f"{spec.key}: data version {md5} unchanged since the last sweep (study {study}); not retraining"
        )
    if spec.retrain_policy.drift_psi is not None:
        return SkipReason(
            f"{spec.key}: data version {md5} unchanged; whether it retrains is the drift sensor's decision"
        )
    return RunRequest(asset_selection=prepare_selection(spec), tags={**tags, "trainyard/data_version": md5})


def build_retrain_schedule(
    spec: PipelineSpec, job_name: str, default_status: DefaultScheduleStatus = DefaultScheduleStatus.STOPPED
) -> ScheduleDefinition:
    """The cron retraining schedule of one pipeline, targeting its `prepare` job; it starts stopped, like the
    sensors."""
    policy = spec.retrain_policy
    assert policy.cron is not None, f"{spec.key}: retrain.cron is unset"

    @schedule(
        name=naming.retrain_schedule_name(spec),
        cron_schedule=policy.cron,
        execution_timezone=policy.timezone,
        job_name=job_name,
        default_status=default_status,
        description=f"Retrain {spec.key} at '{policy.cron}' ({policy.timezone}) when its data version changed",
    )
    def retrain(context: ScheduleEvaluationContext, store: ObjectStore, launcher: Launcher):
        result = evaluate_schedule(spec, store, evaluation_instance(context))
        if isinstance(result, SkipReason):
            context.log.info(result.skip_message or "")
        else:
            prestart_for_sweep(spec, result, launcher, context.log)
        return result

    return retrain


def _profile(
    store: ObjectStore, profile_uri: Optional[str], sample_uri: Optional[str]
) -> Optional[tuple[dict[str, Any], Any]]:
    if not profile_uri or not sample_uri or not store.exists(profile_uri) or not store.exists(sample_uri):
        return None
    with store.open(sample_uri, "rb") as f:
        sample = pq.read_table(f)
    return store.read_json(profile_uri), sample


def max_psi(rows: list[dict[str, Any]]) -> tuple[float, str]:
    """The largest per-feature PSI of a drift report and its column ((0.0, '') when nothing was measured).

    PSI of a delivery too small to judge (`judged: False`, see `delivery_drift`) does not count.
    """
    measured = [(float(r["psi"]), r["column"]) for r in rows if r.get("psi") is not None and r.get("judged", True)]
    return max(measured) if measured else (0.0, "")


def evaluate_drift(
    spec: PipelineSpec,
    store: ObjectStore,
    instance: DagsterInstance,
    champion: Optional[ModelVersionInfo],
    cursor: Optional[str],
) -> tuple[RunRequest | SkipReason, Optional[str]]:
    """One tick of the drift sensor (see the module docstring).

    The cursor remembers the last (data version, champion version) pair measured
    and its result, so a pair is measured once.

    Returns:
        A run request for the sweep (tags carry the measured drift) or a skip
        reason, and the new cursor.
    """
    threshold = spec.retrain_policy.drift_psi
    assert threshold is not None, f"{spec.key}: retrain.drift_psi is unset"
    latest = latest_validated(store, spec)
    if latest is None:
        return SkipReason(f"{spec.key}: no validated data version yet"), cursor
    md5 = latest["md5"]
    study = swept(instance, spec, md5)
    if study is not None:
        return SkipReason(f"{spec.key}: data version {md5} already swept (study {study})"), cursor
    tags = {
        PIPELINE_TAG: spec.key,
        TRIGGER_TAG: "drift",
        "trainyard/data_version": md5,
        "trainyard/drift_threshold": str(threshold),
    }
    sweep = [asset_key(spec, naming.SWEEP)]
    if champion is None:
        request = RunRequest(
            run_key=f"drift-{md5}-first",
            asset_selection=sweep,
            tags={**tags, "trainyard/drift_reason": "no champion yet"},
        )
        return request, cursor
    trained_on = champion.tags.get(DATA_VERSION_TAG)
    if trained_on == md5:
        return SkipReason(
            f"{spec.key}: champion v{champion.version} was trained on the newest data version {md5}"
        ), cursor
    pair = f"{md5}:{champion.version}"
    last = json.loads(cursor) if cursor else {}
    if last.get("pair") == pair:
        return SkipReason(f"{spec.key}: {last['message']} (measured before)"), cursor
    split_id = champion.tags.get(TEST_SPLIT_TAG)
    base = naming.validated_dir(store, spec.team, spec.name, split_id) if split_id else None
    before = _profile(store, f"{base}/profile.json" if base else None, f"{base}/sample.parquet" if base else None)
    now = _profile(store, latest.get("profile_uri"), latest.get("sample_uri"))
    if before is None or now is None:
        which = (
            f"the champion's (v{champion.version}, split {split_id})"
            if before is None
            else f"the newest version's ({md5})"
        )
        return SkipReason(
            f"{spec.key}: {which} data profile is missing, so drift cannot be measured; run the sweep by hand"
        ), cursor
    # The rows added since the champion's data (its snapshot's files against the newest's), not the diluted whole.
    champion_raw = f"{naming.raw_dir(store, spec.team, spec.name, trained_on)}/data.parquet" if trained_on else None
    rows = delivery_drift(
        store,
        spec,
        before,
        champion_raw,
        latest.get("raw_uri"),
        now,
        reference_name=f"champion v{champion.version}'s data",
    )
    psi, column = max_psi(rows)
    measured = (
        f"max PSI {psi:.4f} ({column or 'no column'}) of data version {md5} against champion v{champion.version}'s "
        f"data {trained_on}"
    )
    state = {"pair": pair, "psi": psi, "column": column}
    if psi <= threshold:
        message = f"{measured} is within drift_psi {threshold}; not retraining"
        return SkipReason(f"{spec.key}: {message}"), json.dumps({**state, "message": message})
    message = f"{measured} exceeds drift_psi {threshold}; retraining"
    drifted = sorted((r for r in rows if r.get("psi") is not None and r["psi"] > threshold), key=lambda r: -r["psi"])
    request = RunRequest(
        run_key=f"drift-{md5}-{champion.version}",
        asset_selection=sweep,
        tags={
            **tags,
            "trainyard/drift_psi": f"{psi:.4f}",
            "trainyard/drift_column": column,
            "trainyard/drifted_columns": ",".join(r["column"] for r in drifted)[:200],
            "trainyard/champion_version": str(champion.version),
            "trainyard/champion_data_version": str(trained_on),
        },
    )
    return request, json.dumps({**state, "message": message})


def build_drift_sensor(
    spec: PipelineSpec, job_name: str, minimum_interval_seconds: int = DRIFT_MINIMUM_INTERVAL_SECONDS,
    default_status: DefaultSensorStatus = DefaultSensorStatus.STOPPED,
) -> SensorDefinition:
    """The drift sensor of one pipeline, targeting the `sweep` asset of its `prepare` job; it starts stopped."""
    @sensor(
        name=naming.drift_sensor_name(spec),
        job_name=job_name,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        description=f"Sweep {spec.key} when its newest data drifted (max PSI > {spec.retrain_policy.drift_psi}) from "
                    "the champion's",
    )
    def drift_sensor(context: SensorEvaluationContext):
        with evaluation_resources(context, "store", "registry", "launcher") as resources:
            champion = resources.registry.get_alias(spec.model_name, CHAMPION)
            result, cursor = evaluate_drift(
                spec, resources.store, evaluation_instance(context), champion, context.cursor
            )
            if cursor != context.cursor and cursor is not None:
                context.update_cursor(cursor)
            if isinstance(result, RunRequest):
                context.log.info(
                    f"{spec.key}: requesting a sweep ({result.tags.get('trainyard/drift_reason') or 'data drifted'})"
                )
                prestart_for_sweep(spec, result, resources.launcher, context.log)
        return result

    return drift_sensor
