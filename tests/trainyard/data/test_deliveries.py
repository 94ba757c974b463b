"""Landing that survives real deliveries (issue 15, items 4 and 11).

A bad file removed from the landing area leaves the snapshot, so the pipeline
gets past a rejected version; a byte-identical re-delivery under a new name is
recognised and changes nothing; re-landing a fixed file supersedes its
quarantine entry instead of piling up stale ones.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from resources.storage import ObjectStore
from tests.trainyard.data.test_ingest import GOOD, land, make_spec, snapshot_rows
from trainyard import data as dq
from trainyard.data import ingest


def test_removing_a_bad_file_gives_the_snapshot_without_it(store: ObjectStore) -> None:
    spec = make_spec()
    land(store, "a.csv", GOOD)
    good = ingest.ingest(store, spec)
    # values that parse but fail validation later: the file is part of a new snapshot that is then rejected
    land(store, "b.csv", "x,s,label\n3.5,a,1\n")
    bad = ingest.ingest(store, spec)
    assert bad.snapshot.md5 != good.snapshot.md5
    os.remove(store.uri("landing", "b.csv"))
    assert ingest.removed_files(store, spec) == [store.uri("landing", "b.csv")]
    back = ingest.ingest(store, spec)
    assert back.snapshot.md5 == good.snapshot.md5 and back.removed == [store.uri("landing", "b.csv")]
    assert snapshot_rows(store, back)["x"] == [1.5, 2.5]
    assert ingest.removed_files(store, spec) == []


def test_removing_a_rejected_file_unblocks_ingest_and_resolves_its_entry(store: ObjectStore) -> None:
    spec = make_spec()
    land(store, "a.csv", GOOD)
    land(store, "bad.csv", "x,s,label\n1,a,zero\n")
    with pytest.raises(ingest.IngestRejected):
        ingest.ingest(store, spec)
    os.remove(store.uri("landing", "bad.csv"))
    assert ingest.removed_files(store, spec) == [store.uri("landing", "bad.csv")]  # the sensor sees it
    result = ingest.ingest(store, spec)
    assert result.snapshot.files == [store.uri("landing", "a.csv")] and ingest.removed_files(store, spec) == []
    [entry] = dq.list_quarantine(store, "t/p")
    assert entry.resolved is not None and entry.resolved["how"] == "removed from the landing area"


def test_a_byte_identical_file_under_a_new_name_changes_nothing(store: ObjectStore) -> None:
    spec = make_spec()
    land(store, "a.csv", GOOD)
    first = ingest.ingest(store, spec)
    land(store, "a-copy.csv", GOOD)
    again = ingest.ingest(store, spec)
    assert again.reused_snapshot and again.snapshot.md5 == first.snapshot.md5 and again.ingested == []
    [dup] = again.duplicates
    assert dup.status == "duplicate" and dup.duplicate_of == store.uri("landing", "a.csv") and dup.rows == 0
    assert any("duplicate delivery" in w for w in again.warnings)
    assert dq.list_quarantine(store, "t/p") == []
    quiet = ingest.ingest(store, spec)
    assert quiet.reused_snapshot and quiet.duplicates == [] and quiet.unchanged == 2  # the copy is not read again
    # removing the original: the copy now carries those rows, the data is the same
    os.remove(store.uri("landing", "a.csv"))
    moved = ingest.ingest(store, spec)
    assert [r.uri for r in moved.ingested] == [store.uri("landing", "a-copy.csv")]
    assert snapshot_rows(store, moved) == snapshot_rows(store, first)


def test_a_copy_delivered_with_its_original_counts_once(store: ObjectStore) -> None:
    land(store, "a.csv", GOOD)
    land(store, "b.csv", GOOD)
    result = ingest.ingest(store, make_spec())
    assert result.snapshot.files == [store.uri("landing", "a.csv")] and result.snapshot.rows == 2
    assert [d.uri for d in result.duplicates] == [store.uri("landing", "b.csv")]


def test_refixing_a_file_supersedes_its_quarantine_entry(store: ObjectStore) -> None:
    spec = make_spec()
    land(store, "a.csv", GOOD)
    for content in ("x,s,label\n1,a,zero\n", "x,s,label\n1,a\n"):
        land(store, "bad.csv", content)
        with pytest.raises(ingest.IngestRejected):
            ingest.ingest(store, spec)
    [entry] = dq.list_quarantine(store, "t/p")
    report = dq.read_quarantine(store, "t/p", entry.id)
    assert Path(report["copy"]).read_text() == "x,s,label\n1,a\n" and len(report["superseded"]) == 1
    land(store, "bad.csv", "x,s,label\n3.5,c,1\n")
    ingest.ingest(store, spec)
    [entry] = dq.list_quarantine(store, "t/p")
    assert entry.resolved is not None and entry.resolved["how"] == "accepted without issues"
