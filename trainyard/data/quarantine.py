"""Quarantine: rejected data kept with its report (never deleted), listed, and released by a person."""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import os
from typing import Any, Optional

from trainyard import naming
from trainyard.data.errors import QuarantineError
from trainyard.spec import PipelineSpec
from trainyard.store import FileInfo, FileStore

_SUBDIRS = ("files", "rows")


def quarantine_root(store: FileStore, team: str, name: str) -> str:
    """`<store>/quarantine/<team>/<name>`: rejected versions under `<md5>/`, rejected landing
    files under `files/<id>/`, rows set aside from accepted versions under `rows/<md5>/`."""
    return naming.quarantine_dir(store, team, name)


def utc_now() -> str:
    """Now, in UTC, as ISO 8601 to the second (the time stamp of every quarantine and release record)."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def quarantine_snapshot(
    store: FileStore,
    team: str,
    name: str,
    md5: str,
    snapshot_uri: str,
    report: dict[str, Any],
    docs_uri: Optional[str] = None,
) -> str:
    """Keep a rejected snapshot: a copy of its data and its report under `quarantine/<team>/<name>/<md5>/`.

    Quarantining the same version again replaces the report (the data is
    the same bytes) and keeps any release record.

    Returns:
        The quarantine directory URI.
    """
    where = naming.quarantine_dir(store, team, name, md5)
    if not store.exists(f"{where}/data.parquet"):
        store.copy(snapshot_uri, f"{where}/data.parquet")
    store.write_json(
        f"{where}/report.json",
        {
            "kind": "snapshot",
            "pipeline": f"{team}/{name}",
            "md5": md5,
            "quarantined_at": utc_now(),
            "data": f"{where}/data.parquet",
            "data_docs": docs_uri,
            **report,
        },
    )
    return where


def quarantine_rows(store: FileStore, team: str, name: str, md5: str, rows_file: str, report: dict[str, Any]) -> str:
    """Keep rows set aside from an accepted snapshot under `quarantine/<team>/<name>/rows/<md5>/rows.parquet`.

    They live apart from rejected versions (`quarantine/<team>/<name>/<md5>/`):
    the version itself was accepted.
    """
    where = naming.quarantine_dir(store, team, name, "rows", md5)
    store.put_file(rows_file, f"{where}/rows.parquet")
    store.write_json(
        f"{where}/report.json",
        {
            "kind": "rows",
            "pipeline": f"{team}/{name}",
            "md5": md5,
            "quarantined_at": utc_now(),
            "data": f"{where}/rows.parquet",
            **report,
        },
    )
    return where


def file_entry_id(uri: str) -> str:
    """The quarantine id of a landing file: one entry per landing URI, whatever its content."""
    return hashlib.sha256(uri.encode()).hexdigest()[:16]


def quarantine_file(
    store: FileStore,
    spec: PipelineSpec,
    info: FileInfo,
    issues: list[dict[str, Any]],
    status: str,
    digest: Optional[str],
) -> str:
    """Keep a landing file with issues: its bytes and a report listing every issue, under `files/<id>/`.

    The id depends on the landing URI only: a later round for the same file
    supersedes the entry (the previous rounds are listed under `superseded`)
    rather than adding one, so fixing a file in several tries leaves one entry.

    Returns:
        The quarantine directory URI.
    """
    where = naming.quarantine_dir(store, spec.team, spec.name, "files", file_entry_id(info.uri))
    name = info.uri.rsplit("/", 1)[-1]
    report_uri = f"{where}/report.json"
    previous = store.read_json(report_uri) if store.exists(report_uri) else None
    if info.size and (
        previous is None or previous.get("content_hash") != digest or not store.exists(f"{where}/{name}")
    ):
        store.copy(info.uri, f"{where}/{name}")
    superseded = [] if previous is None else [
        *previous.get("superseded", []),
        {k: previous.get(k) for k in ("content_hash", "size", "quarantined_at", "reasons")},
    ]
    store.write_json(
        report_uri,
        {
            "kind": "file",
            "pipeline": spec.key,
            "file": info.uri,
            "size": info.size,
            "mtime": info.mtime,
            "etag": info.etag,
            "status": status,
            "policy": spec.on_bad_data,
            "issues": issues,
            "reasons": [
                i["message"] for i in sorted(issues, key=lambda i: not i["fatal"])
            ],  # every problem, fatal ones first
            "copy": f"{where}/{name}" if info.size else None,
            "content_hash": digest,
            "quarantined_at": utc_now(),
            "superseded": superseded,
        },
    )
    return where


def resolve_file_entry(store: FileStore, spec: PipelineSpec, uri: str, how: str) -> None:
    """Mark the quarantine entry of a landing file resolved (accepted since, or removed), if it has an open one."""
    report_uri = naming.quarantine_dir(store, spec.team, spec.name, "files", file_entry_id(uri), "report.json")
    if store.exists(report_uri):
        report = store.read_json(report_uri)
        if report.get("status") == "rejected" and not report.get("resolved"):
            store.write_json(report_uri, {**report, "resolved": {"at": utc_now(), "how": how}})



@dataclasses.dataclass(frozen=True)
class QuarantineEntry:
    """One quarantined item, as `trainyard data list` shows it.

    Attributes:
        pipeline: `<team>/<name>`.
        id: The snapshot md5 (kinds `snapshot` and `rows`) or the file id (kind `file`).
        kind: `snapshot` (a rejected version), `rows` (rows set aside from an
            accepted version) or `file` (a rejected landing file).
        uri: The entry's directory.
        quarantined_at: When (UTC, ISO 8601).
        summary: The first reason.
        released: The release record, if any.
        resolved: For a rejected landing file: when and how it stopped
            mattering (accepted after a fix, or removed), else None.
    """

    pipeline: str
    id: str
    kind: str
    uri: str
    quarantined_at: str
    summary: str
    released: Optional[dict[str, Any]]
    resolved: Optional[dict[str, Any]] = None


def list_quarantine(store: FileStore, pipeline: Optional[str] = None) -> list[QuarantineEntry]:
    """Every quarantine entry (of one `<team>/<name>` pipeline, or all), oldest first."""
    base = naming.quarantine_dir(store)
    pattern_parts = pipeline.split("/") if pipeline else ["*", "*"]
    reports = store.glob(naming.quarantine_dir(store, *pattern_parts, "*", "report.json"))
    for sub in _SUBDIRS:
        reports += store.glob(naming.quarantine_dir(store, *pattern_parts, sub, "*", "report.json"))
    entries = []
    for uri in reports:
        directory = uri.rsplit("/", 1)[0] if store.is_s3 else os.path.dirname(uri)
        rel = directory[len(base) :].strip("/").split("/")
        if len(rel) not in (3, 4) or (len(rel) == 3 and rel[2] in _SUBDIRS):
            continue
        report = store.read_json(uri)
        release_uri = f"{directory}/release.json"
        reasons = report.get("reasons") or [report.get("reason", "")]
        entries.append(
            QuarantineEntry(
                pipeline=f"{rel[0]}/{rel[1]}",
                id=rel[-1],
                kind=report.get("kind", "snapshot"),
                uri=directory,
                quarantined_at=report.get("quarantined_at", ""),
                summary=str(reasons[0] if reasons else ""),
                released=store.read_json(release_uri) if store.exists(release_uri) else None,
                resolved=report.get("resolved"),
            )
        )
    return sorted(entries, key=lambda e: (e.quarantined_at, e.pipeline, e.id))


def _entry_dir(store: FileStore, pipeline: str, entry_id: str) -> str:
    team, _, name = pipeline.partition("/")
    if not team or not name or "/" in name:
        raise QuarantineError(f"pipeline {pipeline!r} must be '<team>/<name>', e.g. 'vision/digits'")
    for where in [
        naming.quarantine_dir(store, team, name, entry_id),
        *(naming.quarantine_dir(store, team, name, sub, entry_id) for sub in _SUBDIRS),
    ]:
        if entry_id not in _SUBDIRS and store.exists(f"{where}/report.json"):
            return where
    known = [e.id for e in list_quarantine(store, pipeline)]
    raise QuarantineError(f"no quarantine entry {entry_id!r} for pipeline {pipeline!r}; entries: {known or 'none'}")


def read_quarantine(store: FileStore, pipeline: str, entry_id: str) -> dict[str, Any]:
    """The report of a quarantine entry, with `uri` and `release` (or None) added.

    Raises:
        QuarantineError: No such entry; the message lists the pipeline's entries.
    """
    where = _entry_dir(store, pipeline, entry_id)
    report = store.read_json(f"{where}/report.json")
    release_uri = f"{where}/release.json"
    return {**report, "uri": where, "release": store.read_json(release_uri) if store.exists(release_uri) else None}


def release_quarantine(
    store: FileStore, pipeline: str, md5: str, reason: str, by: str, at: Optional[str] = None
) -> dict[str, Any]:
    """Record that a person accepts a quarantined snapshot; the next `validated_data` run lets it through.

    The data stays in quarantine (nothing is moved or deleted); the release
    is written next to it as `release.json` with who, when and why.

    Args:
        store: The object store.
        pipeline: `<team>/<name>`.
        md5: The quarantined data version.
        reason: Why it may be used; required, not blank.
        by: Who releases it.
        at: When (ISO 8601); now when None.

    Returns:
        The release record.

    Raises:
        QuarantineError: The entry does not exist, is a rejected file (fix
            or replace the landing file instead), is rows already set aside
            from an accepted version, was already released, or the reason is blank.
    """
    if not reason or not reason.strip():
        raise QuarantineError(
            "release needs a reason: say why this data may be used (e.g. --reason 'outliers checked with the data "
            "owner')"
        )
    if not by or not by.strip():
        raise QuarantineError("release needs the name of who releases it")
    where = _entry_dir(store, pipeline, md5)
    report = store.read_json(f"{where}/report.json")
    kind = report.get("kind", "snapshot")
    if kind == "file":
        raise QuarantineError(
            f"{md5!r} is a rejected landing file, which cannot be used as it is; fix or replace the file in the "
            "landing area"
        )
    if kind != "snapshot":
        raise QuarantineError(
            f"{md5!r} holds rows set aside from an accepted version, not a rejected version; nothing to release"
        )
    release_uri = f"{where}/release.json"
    if store.exists(release_uri):
        previous = store.read_json(release_uri)
        raise QuarantineError(
            f"{pipeline} {md5} was already released by {previous['released_by']} at {previous['released_at']}: "
            f"{previous['reason']}"
        )
    record = {
        "pipeline": pipeline,
        "md5": md5,
        "released_by": by.strip(),
        "released_at": at or utc_now(),
        "reason": reason.strip(),
    }
    store.write_json(release_uri, record)
    return record


def release_of(store: FileStore, team: str, name: str, md5: str) -> Optional[dict[str, Any]]:
    """The release record of a quarantined snapshot, or None."""
    uri = naming.quarantine_dir(store, team, name, md5, "release.json")
    return store.read_json(uri) if store.exists(uri) else None
