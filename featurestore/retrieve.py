"""`python -m featurestore.retrieve`: a point-in-time training set from a Feast repository.

Reads one JSON request on stdin:

    {"repo": "/abs/feature_repo", "registry": null, "offline_store": null, "project": null,
     "entities": "/tmp/entities.parquet", "keys": ["customer_id"], "timestamp": "event_timestamp",
     "features": ["customer_stats:balance"], "feature_service": null, "out": "/tmp/retrieved.parquet"}

checks every feature reference against the registry, parses the event times,
joins each entity row with the newest feature values written at or before its
time (Feast's `get_historical_features`), writes the rows to `out` in the
entity file's order, and prints one JSON line: the rows, the feature views
with a hash of each one's definition, the feature service, the references
and the time range. A request that cannot be served prints
`{"error": {"kind": ..., "message": ...}}` and exits 2.
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from feast import FeatureStore, FeatureView

from featurestore.errors import RetrievalRefused
from featurestore.repo import open_store

ROW = "__trainyard_row"
"""Position of each entity row: Feast's join does not keep the entity frame's order, the snapshot must."""

SHOWN = 10


def definition_hash(message: Any) -> str:
    """sha256 of a Feast object's spec proto, serialized deterministically: changes with any change of its
    definition."""
    return hashlib.sha256(message.to_proto().spec.SerializeToString(deterministic=True)).hexdigest()


def resolve(
    store: FeatureStore, features: list[str], service: str | None
) -> tuple[list[str], list[FeatureView], dict[str, Any] | None]:
    """The feature references to retrieve and their views, checked against the registry.

    Raises:
        RetrievalRefused: A view, feature or service is not in the registry;
            the message lists what is.
    """
    project = store.project
    described: dict[str, Any] | None = None
    if service is not None:
        names = [s.name for s in store.list_feature_services()]
        if service not in names:
            raise RetrievalRefused(
                "unknown_feature_service",
                f"feature service {service!r} is not in project {project!r}; its services are {sorted(names)}",
            )
        fs = store.get_feature_service(service)
        features = [f"{p.name_to_use()}:{f.name}" for p in fs.feature_view_projections for f in p.features]
        described = {"name": service, "definition": definition_hash(fs)}
    views: dict[str, FeatureView] = {}
    known = {v.name: v for v in store.list_feature_views()}
    for ref in features:
        view_name, _, feature = ref.partition(":")
        if view_name not in known:
            raise RetrievalRefused(
                "unknown_feature_view",
                f"feature reference {ref!r}: no feature view {view_name!r} in project {project!r}; its views are "
                f"{sorted(known)}",
            )
        view = known[view_name]
        names = [f.name for f in view.features]
        if feature not in names:
            raise RetrievalRefused(
                "unknown_feature",
                f"feature reference {ref!r}: feature view {view_name!r} has no feature {feature!r}; its features are "
                f"{names}",
            )
        views[view_name] = view
    return features, list(views.values()), described


def _rows(mask: pd.Series) -> str:
    """'n row(s) at 1, 5, 9 ...' for the entity rows where `mask` holds (1-based, as in the entity snapshot)."""
    where = [int(i) + 1 for i in mask[mask].index[:SHOWN]]
    more = f" and {int(mask.sum()) - SHOWN} more" if mask.sum() > SHOWN else ""
    return f"{int(mask.sum())} row(s) at {where}{more}"


def entity_frame(path: str, keys: list[str], timestamp: str) -> pd.DataFrame:
    """The entity rows with parsed UTC event times and their position.

    Raises:
        RetrievalRefused: A key or the event-time column is missing, or rows
            have no key, no event time or one that is not a time.
    """
    frame = pq.read_table(path).to_pandas()
    missing = [c for c in [*keys, timestamp] if c not in frame.columns]
    if missing:
        raise RetrievalRefused(
            "entity_rows", f"entity rows have no column(s) {missing}; they have {list(frame.columns)}"
        )
    problems = [f"entity key {k!r} is missing in {_rows(frame[k].isna())}" for k in keys if frame[k].isna().any()]
    raw = frame[timestamp]
    absent = raw.isna() | (raw.astype("string").str.strip() == "")
    if absent.any():
        problems.append(f"event time {timestamp!r} is missing in {_rows(absent)}")
    numeric = pd.to_numeric(raw, errors="coerce")
    if numeric[~absent].notna().all():
        times = pd.to_datetime(numeric, unit="s", utc=True)
    else:
        times = pd.to_datetime(raw, utc=True, errors="coerce", format="ISO8601")
    unparsable = times.isna() & ~absent
    if unparsable.any():
        examples = [str(v) for v in raw[unparsable].head(3)]
        problems.append(
            f"event time {timestamp!r} is not ISO 8601 or epoch seconds in {_rows(unparsable)}, e.g. {examples}"
        )
    if problems:
        raise RetrievalRefused("entity_rows", "; ".join(problems))
    frame[timestamp] = times
    frame[ROW] = range(len(frame))
    return frame


def retrieve(request: dict[str, Any]) -> dict[str, Any]:
    """Serve one request (see the module docstring); returns the answer.

    Raises:
        RetrievalRefused: The request cannot be served as asked.
    """
    try:
        repo, entities, keys, timestamp, out = (request[k] for k in ("repo", "entities", "keys", "timestamp", "out"))
    except KeyError as e:
        raise RetrievalRefused("request", f"request misses {e}") from e
    store = open_store(repo, request.get("registry"), request.get("offline_store"), request.get("project"))
    refs, views, service = resolve(store, list(request.get("features") or []), request.get("feature_service"))
    frame = entity_frame(entities, list(keys), timestamp)
    join_keys = {k for v in views for k in v.join_keys}
    if not join_keys <= set(keys):
        raise RetrievalRefused(
            "entity_rows",
            f"feature views {[v.name for v in views]} join on {sorted(join_keys)}, but the entity keys are "
            f"{list(keys)}",
        )
    job = store.get_historical_features(entity_df=frame.rename(columns={timestamp: "event_timestamp"}), features=refs)
    result = (
        job.to_df().sort_values(ROW, kind="stable").drop(columns=[ROW]).rename(columns={"event_timestamp": timestamp})
    )
    pq.write_table(pa.Table.from_pandas(result.reset_index(drop=True), preserve_index=False), out)
    times = frame[timestamp]
    return {
        "rows": len(result),
        "project": store.project,
        "features": refs,
        "feature_service": service,
        "feature_views": [
            {
                "name": v.name,
                "definition": definition_hash(v),
                "version": v.version,
                "version_number": v.current_version_number,
                "ttl_s": v.ttl.total_seconds() if v.ttl else None,
                "updated": v.last_updated_timestamp.isoformat() if v.last_updated_timestamp else None,
            }
            for v in sorted(views, key=lambda v: v.name)
        ],
        "time_range": [times.min().isoformat(), times.max().isoformat()] if len(frame) else [None, None],
    }


def main() -> int:
    """Read the request, print the answer; exit 2 with an error answer when it is refused."""
    try:
        request = json.loads(sys.stdin.read())
    except json.JSONDecodeError as e:
        print(json.dumps({"error": {"kind": "request", "message": f"request is not JSON: {e}"}}))
        return 2
    try:
        answer = retrieve(request)
    except RetrievalRefused as e:
        print(json.dumps({"error": {"kind": e.kind, "message": str(e)}}))
        return 2
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
