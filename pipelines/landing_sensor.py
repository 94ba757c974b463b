"""A sensor per pipeline that starts the `prepare` job when new landing files arrive.

Each tick lists the landing files (size, mtime, etag; no content is read) and
compares the listing's digest with the sensor's cursor:

- same digest: nothing changed since the last tick -> skip;
- different digest, but every file is already in the ingest manifest in
  its current state and no counted file was removed (e.g. a manual run
  ingested them) -> move the cursor, skip;
- otherwise -> one `RunRequest` for the `prepare` job, keyed by the digest,
  so the same landing state never starts two runs; `raw_data` then ingests
  only the new or changed files. A removed file that was in the snapshot,
  or was rejected, counts as a change: the run makes a snapshot without it,
  which is how removing a bad file unblocks the pipeline. Removing the bad
  file brings the listing back to the state before it landed, whose run key
  Dagster has already used, so a run for a removal is keyed by the state it
  came from as well.

A tick that requests the whole `prepare` job (which sweeps the new data) also
has the launcher start its warm worker server (`prestart_for_sweep`, as the
drift sensor and the retrain schedule do), so that server's imports run beside
the prepare run instead of in the first trial's step; a drift-gated pipeline's
ingest-only run starts nothing.

A file still being written changes the digest on every tick; the run it
starts skips it (`LandingFileChanged`) and the next tick, seeing it stable,
starts another.

`evaluate_raw_data` is the other way data enters: a person materializes
`raw_data` alone (the UI's Materialize on the first asset). The sweep sensor
calls it each tick and requests the rest of `prepare` for such a run, so the
first asset is all a user has to start.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from dagster import (
    AssetKey,
    AssetRecordsFilter,
    DagsterEventType,
    DagsterInstance,
    DefaultSensorStatus,
    RunRequest,
    SensorDefinition,
    SensorEvaluationContext,
    SkipReason,
    sensor,
)

from assets.factory import asset_key
from instance.storage_connections import evaluation_resources
from pipelines.sensor_timing import ticks_every
from resources.launcher import Launcher
from resources.storage import ObjectStore
from trainyard import naming
from trainyard.data import ingest
from trainyard.naming import LANDING_DIGEST_TAG, NEW_FILES_TAG, PIPELINE_TAG, TRIGGER_TAG
from trainyard.spec import PipelineSpec

MINIMUM_INTERVAL_SECONDS = ticks_every(60)  # a tick a minute (60 s gave one every 65 s: pipelines.sensor_timing)
MAX_RAW_DATA_PER_TICK = 100
RAW_DATA_RUN_TAG = "trainyard/raw_data_run"


def continuation_selection(spec: PipelineSpec) -> list[AssetKey]:
    """What follows `raw_data` in `prepare`: validation and the sweep, or validation only when drift gates
    retraining."""
    names = [naming.VALIDATED_DATA] + ([] if spec.retrain_policy.drift_psi is not None else [naming.SWEEP])
    return [asset_key(spec, n) for n in names]


def _planned(instance: DagsterInstance, run_id: str, key: AssetKey) -> bool:
    """Whether the run planned to materialize `key` (Dagster records the plan when the run is created)."""
    records = instance.get_records_for_run(run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION_PLANNED).records
    return any(
        r.event_log_entry.dagster_event is not None and r.event_log_entry.dagster_event.asset_key == key
        for r in records
    )


def evaluate_raw_data(
    spec: PipelineSpec, instance: DagsterInstance, after: Optional[int], prepare_job: str
) -> tuple[list[RunRequest], Optional[int], str]:
    """Carry a `raw_data` materialized on its own through the rest of `prepare` (`continuation_selection`).

    Looks at the `raw_data` materializations after storage id `after` (on the
    first tick, None, only the newest, so an old instance does not replay its
    history). One whose run also planned `validated_data` (a `prepare`,
    landing or scheduled run) or that a later `validated_data` already
    followed needs nothing. Of the rest only the newest gets a run, keyed
    `raw_data/<storage id>`: `validated_data` reads the newest raw snapshot, so
    that run follows the older ones too, and Dagster drops a repeated key.

    Returns:
        The run requests (none or one), the new cursor (the newest storage
        id looked at) and a note for the tick's message.
    """
    raw, validated = asset_key(spec, naming.RAW_DATA), asset_key(spec, naming.VALIDATED_DATA)
    if after is None:
        records = list(instance.fetch_materializations(raw, limit=1).records)
    else:
        records = list(
            instance.fetch_materializations(
                AssetRecordsFilter(asset_key=raw, after_storage_id=after), limit=MAX_RAW_DATA_PER_TICK
            ).records
        )
    if not records:
        return [], after, ""
    newest = max(records, key=lambda r: r.storage_id)
    followed = instance.fetch_materializations(validated, limit=1).records
    followed_id = followed[0].storage_id if followed else -1
    alone = [r for r in records if r.storage_id > followed_id and not _planned(instance, r.run_id, validated)]
    if not alone:
        return [], newest.storage_id, ""
    last = max(alone, key=lambda r: r.storage_id)
    request = RunRequest(
        run_key=f"raw_data/{last.storage_id}",
        job_name=prepare_job,
        asset_selection=continuation_selection(spec),
        tags={PIPELINE_TAG: spec.key, TRIGGER_TAG: "raw_data materialized", RAW_DATA_RUN_TAG: last.run_id},
    )
    names = ", ".join(k.path[-1] for k in continuation_selection(spec))
    return [request], newest.storage_id, f"; raw_data of run {last.run_id} was materialized alone, requested {names}"


def evaluate_landing(
    spec: PipelineSpec, store: ObjectStore, cursor: str | None
) -> tuple[RunRequest | SkipReason, str | None]:
    """One tick of the landing sensor, as a pure function of the store and the cursor.

    Returns:
        The run request or skip reason, and the new cursor (the landing
        listing's digest; unchanged when nothing is listed).
    """
    files = ingest.list_landing(store, spec.source)
    if not files and not ingest.removed_files(store, spec, files):
        patterns = ", ".join(ingest.landing_patterns(store, spec.source))
        return SkipReason(f"no landing files match {patterns}"), cursor
    digest = ingest.landing_digest(files)
    if digest == cursor:
        return SkipReason(f"{len(files)} landing file(s), unchanged since the last tick"), cursor
    pending = ingest.pending_files(store, spec, files)
    removed = ingest.removed_files(store, spec, files)
    if not pending and not removed:
        return SkipReason(f"{len(files)} landing file(s), all already ingested in their current state"), digest
    names = [f.uri.rsplit("/", 1)[-1] for f in pending] + [f"{u.rsplit('/', 1)[-1]} (removed)" for u in removed]
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    request = RunRequest(
        run_key=f"landing-{digest}" + (f"-after-{cursor}" if removed else ""),
        tags={
            PIPELINE_TAG: spec.key,
            LANDING_DIGEST_TAG: digest,
            NEW_FILES_TAG: str(len(pending)),
            "trainyard/removed_files": str(len(removed)),
            "trainyard/new_file_names": shown[:200],
        },
    )
    return request, digest


def prestart_for_sweep(spec: PipelineSpec, request: RunRequest, launcher: Launcher, log: Any) -> bool:
    """If `request`'s run sweeps (the whole job, or a selection with the `sweep` asset), start the warm worker server
    now.

    Trials are coming: the server's imports (8 s here, 15-24 s on a loaded host)
    then overlap the run's queue, launch, ingest and validation rather than the
    first trial's step (`raw_data` and the `sweep` ask again; a server that
    already listens is left alone). Used by the landing and drift sensors and
    the retrain schedule. Returns whether a start was begun.
    """
    selection = request.asset_selection
    if selection is not None and asset_key(spec, naming.SWEEP) not in selection:
        return False  # an ingest-only run (drift gates retraining): no trials follow it
    if not launcher.prestart_warm():
        return False
    log.info(f"{spec.key}: starting the warm worker server for the trials this run will sweep")
    return True


def build_landing_sensor(
    spec: PipelineSpec, job_name: str, minimum_interval_seconds: int = MINIMUM_INTERVAL_SECONDS,
    asset_selection: Optional[Sequence[AssetKey]] = None,
) -> SensorDefinition:
    """The landing sensor of one pipeline, targeting its `prepare` job (or `asset_selection` of it).

    With a drift-gated `RetrainPolicy` the selection is ingest and validation
    only; the drift sensor decides whether the new version is swept.

    With `RetrainPolicy.automatic` (the default) it starts running, so a file
    landing is all it takes; otherwise it starts stopped: turn it on in the
    Dagster UI (Automation) or with `dagster sensor start <name>`. A sensor only
    ticks under the daemon, so `trainyard demo` and in-process tests run
    nothing behind one's back.
    """

    @sensor(
        name=naming.landing_sensor_name(spec),
        job_name=job_name,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=DefaultSensorStatus.RUNNING if spec.retrain_policy.automatic else DefaultSensorStatus.STOPPED,
        description=f"New or changed files under {spec.source.prefix} ({spec.source.pattern}) -> {job_name}",
    )
    def landing(context: SensorEvaluationContext):
        with evaluation_resources(context, "store", "launcher") as resources:
            result, cursor = evaluate_landing(spec, resources.store, context.cursor)
            if isinstance(result, RunRequest) and asset_selection is not None:
                result = result.with_replaced_attrs(asset_selection=list(asset_selection))
            if cursor is not None and cursor != context.cursor:
                context.update_cursor(cursor)
            if isinstance(result, RunRequest):
                context.log.info(
                    f"{spec.key}: new landing data ({result.tags['trainyard/new_file_names']}), requesting {job_name}"
                )
                prestart_for_sweep(spec, result, resources.launcher, context.log)
        return result

    return landing
