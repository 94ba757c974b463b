"""What ingest records: one entry per landing file (`FileRecord`), per snapshot (`SnapshotRecord`), the pipeline's
`Manifest` of both, the `IngestResult` of one call, and their Markdown tables. Split from `trainyard.data.ingest`,
which re-exports them."""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from pydantic import BaseModel, Field

from trainyard.data.landing import FileIssue
from trainyard.data.report import md_cell
from trainyard.store import FileInfo

MANIFEST_VERSION = 1


class FileRecord(BaseModel):
    """The manifest's entry for one landing file in one state (size, mtime, etag)."""

    uri: str
    size: int
    mtime: Optional[float]
    etag: Optional[str]
    status: Literal["accepted", "rejected", "duplicate"]
    rows: int = 0
    part: Optional[str] = None
    schema_key: str
    issues: list[FileIssue] = Field(default_factory=list)
    quarantine: Optional[str] = None
    ingested_at: str
    content_hash: Optional[str] = None
    duplicate_of: Optional[str] = None
    missing: dict[str, int] = Field(default_factory=dict)

    def same_state(self, info: FileInfo, schema_key: str) -> bool:
        """Whether `info` is this file unchanged, read for the same declared columns."""
        return (self.size, self.mtime, self.etag) == info.identity and self.schema_key == schema_key


class SnapshotRecord(BaseModel):
    """One snapshot: its md5 (the data version), where it is, and which files it was made of."""

    md5: str
    uri: str
    rows: int
    files: list[str]
    key: str
    dvc_file: str
    created_at: str
    missing: dict[str, int] = Field(default_factory=dict)


class Manifest(BaseModel):
    """Every landing file a pipeline ingested or rejected, and its latest snapshot."""

    version: int = MANIFEST_VERSION
    files: dict[str, FileRecord] = Field(default_factory=dict)
    snapshot: Optional[SnapshotRecord] = None


@dataclasses.dataclass
class IngestResult:
    """What one `ingest` call did.

    Attributes:
        snapshot: The snapshot now current (new or reused).
        reused_snapshot: No accepted file changed, so the previous snapshot stands.
        ingested: Files read in this call and accepted.
        rejected: Files rejected in this call or before and still in the landing area.
        skipped_changing: Files that changed while read (not ingested; picked up later).
        unchanged: Files already ingested in this exact state.
        removed: Files of the previous snapshot no longer in the landing area (left out of this one).
        duplicates: Files recorded in this call as byte-identical copies of an accepted file.
        warnings: One line per file issue accepted or skipped under "warn",
            per duplicate delivery and per removed file.
    """

    snapshot: SnapshotRecord
    reused_snapshot: bool
    ingested: list[FileRecord]
    rejected: list[FileRecord]
    skipped_changing: list[str]
    unchanged: int
    removed: list[str]
    warnings: list[str]
    duplicates: list[FileRecord] = dataclasses.field(default_factory=list)

    def files_markdown(self) -> str:
        """A Markdown table of the files read or rejected in this call."""
        removed = "".join(f"\n{_short(u)} left the landing area and the snapshot" for u in self.removed)
        if not self.ingested and not self.rejected and not self.skipped_changing and not self.duplicates:
            return f"no new or changed files; {self.unchanged} unchanged{removed}\n"
        table = records_markdown([*self.ingested, *self.duplicates, *self.rejected], self.skipped_changing)
        return table + f"\n{self.unchanged} file(s) unchanged since the last snapshot{removed}\n"


def records_markdown(records: list[FileRecord], changing: Optional[list[str]] = None) -> str:
    """A Markdown table of file records: file, status, rows, bytes, issues."""
    lines = ["| file | status | rows | bytes | issues |", "|---|---|---|---|---|"]
    for r in records:
        issues = "; ".join(f"{i.kind}: {i.message}" for i in r.issues)
        if r.duplicate_of:
            issues = f"same bytes as {_short(r.duplicate_of)}; adds nothing"
        lines.append(f"| {_short(r.uri)} | {r.status} | {r.rows} | {r.size} | {md_cell(issues, width=200)} |")
    lines += [f"| {_short(u)} | changed while read | | | ingested once it stops changing |" for u in changing or []]
    return "\n".join(lines) + "\n"


def _short(uri: str) -> str:
    return uri.rsplit("/", 2)[-1] if uri.count("/") > 2 else uri


# --------------------------------------------------------------------------- listing


def missing_counts(records: list[FileRecord], columns: list[str]) -> dict[str, int]:
    """Cells read as missing per stored column, summed over the files' records (every column named, 0 included)."""
    return {c: sum(r.missing.get(c, 0) for r in records) for c in columns}


def missing_markdown(missing: dict[str, int], rows: int) -> str:
    """A Markdown table of the cells read as missing per column, with their share of `rows`."""
    lines = ["| column | missing | share |", "|---|---|---|"]
    for column, n in missing.items():
        share = f"{100.0 * n / rows:.2f} %" if rows else ""
        lines.append(f"| {md_cell(column)} | {n} | {share} |")
    return "\n".join(lines) + "\n"
