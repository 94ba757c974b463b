"""Quarantine entries: kept with their report, listed, read, and released once by a person with a reason."""

from __future__ import annotations

import pytest

from trainyard import data as dq


def _snapshot_entry(store, md5: str = "a" * 32) -> str:
    store.write_bytes(store.uri("snap.parquet"), b"bytes of a rejected snapshot")
    return dq.quarantine_snapshot(
        store, "vision", "digits", md5, store.uri("snap.parquet"), {"reasons": ["too few rows"]}
    )


def test_a_rejected_snapshot_is_copied_with_its_report_and_listed(store):
    where = _snapshot_entry(store)
    assert where == store.uri("quarantine", "vision", "digits", "a" * 32)
    assert store.read_bytes(f"{where}/data.parquet") == b"bytes of a rejected snapshot"
    [entry] = dq.list_quarantine(store, "vision/digits")
    assert (entry.pipeline, entry.id, entry.kind, entry.uri, entry.summary, entry.released) == (
        "vision/digits",
        "a" * 32,
        "snapshot",
        where,
        "too few rows",
        None,
    )
    assert dq.list_quarantine(store, "vision/other") == []
    report = dq.read_quarantine(store, "vision/digits", "a" * 32)
    assert (
        report["uri"] == where
        and report["release"] is None
        and report["kind"] == "snapshot"
        and report["reasons"] == ["too few rows"]
    )


def test_a_release_is_recorded_once_with_who_when_and_why(store):
    _snapshot_entry(store)
    assert dq.release_of(store, "vision", "digits", "a" * 32) is None
    record = dq.release_quarantine(
        store, "vision/digits", "a" * 32, " checked with the owner ", " ada ", at="2026-01-02T03:04:05+00:00"
    )
    assert record == {
        "pipeline": "vision/digits",
        "md5": "a" * 32,
        "released_by": "ada",
        "released_at": "2026-01-02T03:04:05+00:00",
        "reason": "checked with the owner",
    }
    assert dq.release_of(store, "vision", "digits", "a" * 32) == record
    assert dq.list_quarantine(store)[0].released == record
    with pytest.raises(
        dq.QuarantineError, match=r"already released by ada at 2026-01-02T03:04:05\+00:00: checked with the owner"
    ):
        dq.release_quarantine(store, "vision/digits", "a" * 32, "again", "bob")


@pytest.mark.parametrize(
    "pipeline, entry, reason, by, message",
    [
        ("vision/digits", "a" * 32, "  ", "ada", "release needs a reason"),
        ("vision/digits", "a" * 32, "ok", "", "release needs the name of who releases it"),
        ("digits", "a" * 32, "ok", "ada", "pipeline 'digits' must be '<team>/<name>'"),
        (
            "vision/digits",
            "b" * 32,
            "ok",
            "ada",
            f"no quarantine entry {'b' * 32!r} for pipeline 'vision/digits'; entries: \\['{'a' * 32}'\\]",
        ),
    ],
)
def test_a_release_that_cannot_be_done_says_why(store, pipeline, entry, reason, by, message):
    _snapshot_entry(store)
    with pytest.raises(dq.QuarantineError, match=message):
        dq.release_quarantine(store, pipeline, entry, reason, by)


def test_rows_set_aside_from_an_accepted_version_are_kept_apart_and_cannot_be_released(store, tmp_path):
    rows = tmp_path / "rows.parquet"
    rows.write_bytes(b"rows")
    where = dq.quarantine_rows(store, "vision", "digits", "c" * 32, str(rows), {"reasons": ["3 rows out of range"]})
    assert where == store.uri("quarantine", "vision", "digits", "rows", "c" * 32)
    [entry] = dq.list_quarantine(store, "vision/digits")
    assert (entry.kind, entry.id, entry.summary) == ("rows", "c" * 32, "3 rows out of range")
    with pytest.raises(dq.QuarantineError, match="holds rows set aside from an accepted version"):
        dq.release_quarantine(store, "vision/digits", "c" * 32, "fine", "ada")
