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
  which is how removing a bad file unblocks the pipeline.

A file still being written changes the digest on every tick; the run it
starts skips it (`LandingFileChanged`) and the next tick, seeing it stable,
starts another.
"""

from __future__ import annotations

from typing import Optional, Sequence

from dagster import AssetKey, DefaultSensorStatus, RunRequest, SensorDefinition, SensorEvaluationContext, SkipReason, sensor

from resources.storage import ObjectStore
from trainyard import naming
from trainyard.data import ingest
from trainyard.naming import LANDING_DIGEST_TAG, NEW_FILES_TAG, PIPELINE_TAG
from trainyard.spec import PipelineSpec

MINIMUM_INTERVAL_SECONDS = 60


def evaluate_landing(spec: PipelineSpec, store: ObjectStore, cursor: str | None) -> tuple[RunRequest | SkipReason, str | None]:
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
        run_key=f"landing-{digest}",
        tags={
            PIPELINE_TAG: spec.key,
            LANDING_DIGEST_TAG: digest,
            NEW_FILES_TAG: str(len(pending)),
            "trainyard/removed_files": str(len(removed)),
            "trainyard/new_file_names": shown[:200],
        },
    )
    return request, digest


def build_landing_sensor(
    spec: PipelineSpec, job_name: str, minimum_interval_seconds: int = MINIMUM_INTERVAL_SECONDS,
    asset_selection: Optional[Sequence[AssetKey]] = None,
) -> SensorDefinition:
    """The landing sensor of one pipeline, targeting its `prepare` job (or `asset_selection` of it).

    With a drift-gated `RetrainPolicy` the selection is ingest and validation
    only; the drift sensor decides whether the new version is swept.

    It starts stopped: turn it on in the Dagster UI (Automation) or with
    `dagster sensor start <name>`, so nothing runs behind the back of
    `trainyard demo` or a test.
    """

    @sensor(
        name=naming.landing_sensor_name(spec),
        job_name=job_name,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=DefaultSensorStatus.STOPPED,
        description=f"New or changed files under {spec.source.prefix} ({spec.source.pattern}) -> {job_name}",
    )
    def landing(context: SensorEvaluationContext, store: ObjectStore):
        result, cursor = evaluate_landing(spec, store, context.cursor)
        if isinstance(result, RunRequest) and asset_selection is not None:
            result = result.with_replaced_attrs(asset_selection=list(asset_selection))
        if cursor is not None and cursor != context.cursor:
            context.update_cursor(cursor)
        if isinstance(result, RunRequest):
            context.log.info(f"{spec.key}: new landing data ({result.tags['trainyard/new_file_names']}), requesting {job_name}")
        return result

    return landing
