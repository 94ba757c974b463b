"""Hostile landing inputs never fail silently or unclearly (issue 49, item 10).

Each goes through the real ingest path (`ingest.ingest`, and `raw_data` in a
Dagster run where the pipeline's outcome matters): a repeated column name, a
symbolic link, an encoding error, a file removed between listing and reading,
a full disk during ingest and during the DVC push.
"""

from __future__ import annotations

import errno
import io
import os
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from resources.storage import ObjectStore
from resources.versioning import DataVersioning, DataVersioningError
from tests.trainyard.data.test_ingest import GOOD, land, make_spec, snapshot_rows
from trainyard import data as dq
from trainyard.data import ingest, landing_parts
from trainyard.spec import SourceSpec
from trainyard.store import PermanentStorageError, TransientStorageError, classify_error, no_space


def parquet_bytes(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


# --------------------------------------------------------------------------- repeated column names


def test_a_csv_with_a_repeated_column_name_is_rejected_naming_both_positions(store: ObjectStore) -> None:
    uri = land(store, "a.csv", "x,s,label,x\n1.5,a,0,9\n2.5,b,7,8\n")
    with pytest.raises(ingest.IngestRejected) as caught:
        ingest.ingest(store, make_spec())
    [record] = caught.value.records
    kinds = [i.kind for i in record.issues]
    assert kinds[0] == "columns_duplicated"
    assert record.issues[0].message.startswith(
        f"{uri}: the file names a column more than once (positions counted from 1): 'x' at positions 1 and 4;"
    )
    assert "domain" in kinds  # the other columns are still checked: label 7 is outside its domain
    [entry] = dq.list_quarantine(store, "t/p")
    assert entry.kind == "file" and entry.summary.startswith(f"{uri}: the file names a column more than once")


def test_a_parquet_file_with_repeated_column_names_is_rejected_and_quarantined_not_a_keyerror(
    store: ObjectStore,
) -> None:
    land(store, "a.csv", GOOD)
    t = pa.Table.from_arrays(
        [pa.array([1.5]), pa.array(["a"]), pa.array([0]), pa.array(["a"])], names=["x", "s", "label", "s"]
    )
    uri = land(store, "b.parquet", parquet_bytes(t))
    with pytest.raises(
        ingest.IngestRejected, match=r"b\.parquet: the file names a column more than once .*'s' at positions 2 and 4"
    ):
        ingest.ingest(store, make_spec())
    [entry] = dq.list_quarantine(store, "t/p")
    assert entry.kind == "file" and entry.summary.startswith(f"{uri}: the file names a column more than once")
    assert os.path.exists(os.path.join(entry.uri, "report.json"))
    # under "warn" the file is skipped with that reason, the rest goes on
    result = ingest.ingest(store, make_spec(on_bad_data="warn"))
    assert result.snapshot.files == [store.uri("landing", "a.csv")]
    assert any(w.startswith(f"{uri} was rejected before and has not changed") for w in result.warnings)
    # removing it unblocks the pipeline
    os.remove(uri)
    assert ingest.ingest(store, make_spec()).snapshot.rows == 2


# --------------------------------------------------------------------------- symbolic links


def test_a_symlink_to_a_regular_file_is_a_landing_file(store: ObjectStore) -> None:
    land(store, "a.csv", GOOD)
    spec = make_spec()
    ingest.ingest(store, spec)
    target = land(store, "b.csv", "x,s,label\n3.5,c,0\n", prefix="elsewhere")
    os.symlink(target, store.uri("landing", "b.csv"))
    result = ingest.ingest(store, spec)
    assert [r.uri for r in result.ingested] == [store.uri("landing", "b.csv")]
    assert "no new or changed files" not in result.files_markdown()
    assert snapshot_rows(store, result)["x"] == [1.5, 2.5, 3.5]
    assert ingest.ingest(store, spec).reused_snapshot  # unchanged: not read again
    # the link re-pointed to another file is a changed file
    other = land(store, "b2.csv", "x,s,label\n4.5,a,1\n", prefix="elsewhere")
    os.remove(store.uri("landing", "b.csv"))
    os.symlink(other, store.uri("landing", "b.csv"))
    again = ingest.ingest(store, spec)
    assert [r.uri for r in again.ingested] == [store.uri("landing", "b.csv")] and snapshot_rows(store, again)["x"] == [
        1.5,
        2.5,
        4.5,
    ]


def test_entries_that_are_no_regular_files_are_named_not_read(store: ObjectStore) -> None:
    land(store, "a.csv", GOOD)
    os.symlink(store.uri("nowhere.csv"), store.uri("landing", "dangling.csv"))
    os.mkfifo(store.uri("landing", "pipe.csv"))  # reading it would block for ever
    result = ingest.ingest(store, make_spec())
    assert result.snapshot.files == [store.uri("landing", "a.csv")]
    assert (
        f"{store.uri('landing', 'dangling.csv')} is not read: it is a symbolic link to {store.uri('nowhere.csv')!r}, "
        "which does not exist"
        in " ".join(result.warnings)
    )
    assert f"{store.uri('landing', 'pipe.csv')} is not read: it is a FIFO, not a regular file" in " ".join(
        result.warnings
    )
    os.remove(store.uri("landing", "a.csv"))
    with pytest.raises(dq.MissingLandingData, match="dangling.csv is not read: it is a symbolic link"):
        ingest.ingest(store, make_spec())


# --------------------------------------------------------------------------- encoding


def test_an_encoding_error_names_the_line_and_the_column_from_1_by_name(store: ObjectStore) -> None:
    uri = land(store, "a.csv", b"x,label,s\n1.5,0,a\n2.5,1,\xff\xfe\n")
    with pytest.raises(ingest.IngestRejected) as caught:
        ingest.ingest(store, make_spec())
    [issue] = caught.value.records[0].issues
    assert issue.kind == "encoding" and issue.column == "s" and issue.lines == [3]
    assert issue.message.startswith(f"{uri}: line 3, column 3 ('s') holds text that is not valid utf-8")
    assert "#" not in issue.message


# --------------------------------------------------------------------------- a file removed while ingesting


@pytest.mark.parametrize("when", ["hashing", "reading"])
def test_a_file_removed_between_listing_and_reading_is_retryable_and_named(
    store: ObjectStore, monkeypatch, when: str
) -> None:
    land(store, "a.csv", GOOD)
    gone = land(store, "b.csv", "x,s,label\n3.5,c,0\n")
    if when == "hashing":
        real = ingest.content_hash

        def hash_after_removal(s, uri, *a):
            if uri == gone and os.path.exists(gone):
                os.remove(gone)
            return real(s, uri, *a)

        monkeypatch.setattr(ingest, "content_hash", hash_after_removal)
    else:
        real_reader = landing_parts.FileReader  # the part of a landing file is read there

        class Vanishing(real_reader):  # type: ignore[misc, valid-type]
            def batches(self):
                if self.info.uri == gone and os.path.exists(gone):
                    os.remove(gone)
                return super().batches()

        monkeypatch.setattr(landing_parts, "FileReader", Vanishing)
    with pytest.raises(
        ingest.LandingFileChanged,
        match=f"{gone} changed while being read: it was removed after the landing area was listed",
    ):
        ingest.ingest(store, make_spec())
    assert dq.list_quarantine(store, "t/p") == []  # nothing blamed on the file
    result = ingest.ingest(store, make_spec())  # the next run: without it
    assert result.snapshot.files == [store.uri("landing", "a.csv")]


def test_a_removed_file_under_warn_is_skipped_with_a_warning(store: ObjectStore, monkeypatch) -> None:
    land(store, "a.csv", GOOD)
    gone = land(store, "b.csv", "x,s,label\n3.5,c,0\n")
    real = ingest.content_hash

    def hash_after_removal(s, uri, *a):
        if uri == gone and os.path.exists(gone):
            os.remove(gone)
        return real(s, uri, *a)

    monkeypatch.setattr(ingest, "content_hash", hash_after_removal)
    result = ingest.ingest(store, make_spec(on_bad_data="warn"))
    assert result.skipped_changing == [gone] and result.snapshot.files == [store.uri("landing", "a.csv")]


# --------------------------------------------------------------------------- a full disk


def test_no_space_is_named_and_permanent() -> None:
    assert no_space(OSError(errno.ENOSPC, "No space left on device"))
    assert no_space(
        OSError("Error writing bytes to file. Detail: [errno 28] No space left on device")
    )  # pyarrow's, no errno
    assert classify_error(OSError(errno.ENOSPC, "No space left on device")) is PermanentStorageError
    assert classify_error(OSError(errno.ETIMEDOUT, "timed out")) is TransientStorageError
    assert not no_space(FileNotFoundError(errno.ENOENT, "gone"))


def test_a_full_disk_while_writing_a_part_says_so_and_blames_no_file(store: ObjectStore, monkeypatch) -> None:
    land(store, "a.csv", GOOD)

    def full(*a, **k):
        raise OSError("Error writing bytes to file. Detail: [errno 28] No space left on device")

    monkeypatch.setattr(landing_parts, "_write_part", full)
    with pytest.raises(
        PermanentStorageError,
        match=r"cannot write the part of .*part\.arrow: no space left on device; .* bytes free on the filesystem of",
    ):
        ingest.ingest(store, make_spec())
    assert dq.list_quarantine(store, "t/p") == [] and ingest.load_manifest(store, make_spec()).files == {}
    monkeypatch.undo()
    assert ingest.ingest(store, make_spec()).snapshot.rows == 2  # once there is space: as if nothing happened


def test_a_full_disk_in_the_store_says_so(store: ObjectStore, monkeypatch) -> None:
    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(PermanentStorageError, match="no space left on device"):
        store.write_bytes(store.uri("x", "y.json"), b"{}")


def test_a_dvc_failure_shows_dvc_s_own_error_and_a_full_disk_first(tmp_path: Path, monkeypatch) -> None:
    source = tmp_path / "data.parquet"
    source.write_bytes(b"rows")
    (tmp_path / "remote").write_text("a file where the remote directory should be")
    versioning = DataVersioning(repo_dir=str(tmp_path / "repo"), remote_url=str(tmp_path / "remote" / "sub"))
    with pytest.raises(DataVersioningError) as caught:
        versioning.pin(str(source))
    assert "Not a directory" in str(caught.value)  # not only "exit code 255"

    real = subprocess.run

    def full(cmd, **kw):
        if "push" in cmd[-1]:
            return subprocess.CompletedProcess(
                cmd, 255, "", "ERROR: unexpected error - [Errno 28] No space left on device: '/remote/files'\n"
            )
        return real(cmd, **kw)

    monkeypatch.setattr(subprocess, "run", full)
    (tmp_path / "remote").unlink()
    with pytest.raises(DataVersioningError, match=r"^no space left on device; free space and run again\. `dvc "):
        versioning.pin(str(source))


# --------------------------------------------------------------------------- through Dagster


def test_raw_data_fails_naming_the_file_for_repeated_parquet_columns_and_plainly_for_a_full_disk(
    tmp_path: Path, monkeypatch
) -> None:
    """Real `raw_data` runs: the failure names the file and its quarantine entry; a full disk is said as such."""
    from tests.pipelines.pipeline_fixtures import Harness, failure_text
    from tests.trainyard.data.test_drift_delivery import PREFIX, batch, churn_spec
    from tests.trainyard.data.test_drift_delivery import land as land_csv

    harness = Harness(
        tmp_path, churn_spec(source=SourceSpec(prefix=PREFIX, pattern=["*.csv", "*.parquet"], format="auto"))
    )
    spec = harness.spec
    raw = [k for k in harness.defs.resolve_all_asset_keys() if k.path == [spec.team, spec.name, "raw_data"]]
    job = harness.defs.resolve_job_def(harness.names["prepare"])
    land_csv(tmp_path, "batch-0.csv", batch(0))
    table = pa.Table.from_pandas(batch(1), preserve_index=False)
    table = table.append_column("plan", table.column("plan"))
    bad = tmp_path / "store" / PREFIX / "batch-1.parquet"
    bad.write_bytes(parquet_bytes(table))
    run = job.execute_in_process(instance=harness.instance, asset_selection=raw, raise_on_error=False)
    assert not run.success
    text = failure_text(run)
    assert (
        f"{bad}: the file names a column more than once (positions counted from 1): 'plan' at positions 2 and 6" in text
    )
    assert "KeyError" not in text
    [entry] = dq.list_quarantine(harness.resources["store"], spec.key)
    assert entry.summary.startswith(str(bad))

    bad.unlink()
    land_csv(tmp_path, "batch-2.csv", batch(2))

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(landing_parts, "_write_part", full)
    run = job.execute_in_process(instance=harness.instance, asset_selection=raw, raise_on_error=False)
    assert not run.success
    text = failure_text(run)
    assert (
        "test/churn: ingest could not store the data: cannot write the part of" in text
        and "no space left on device" in text
    )


def test_a_rejected_symlinked_file_is_quarantined_with_its_content(store: ObjectStore) -> None:
    target = land(store, "bad.csv", "x,s,label\n1,a,zero\n", prefix="elsewhere")
    os.makedirs(store.uri("landing"), exist_ok=True)
    os.symlink(target, store.uri("landing", "bad.csv"))
    with pytest.raises(ingest.IngestRejected, match="bad.csv"):
        ingest.ingest(store, make_spec())
    [entry] = dq.list_quarantine(store, "t/p")
    copies = [p for p in Path(entry.uri).iterdir() if p.name != "report.json"]
    assert [p.read_text() for p in copies] == ["x,s,label\n1,a,zero\n"] and not any(p.is_symlink() for p in copies)


def test_text_not_utf8_in_json_lines_and_parquet_names_the_line_or_row_and_column(store: ObjectStore) -> None:
    land(store, "a.jsonl", b'{"x": 1.5, "s": "a", "label": 0}\n{"x": 2.5, "s": "\xff\xfe", "label": 1}\n')
    raw = pa.array([b"a", b"b", b"\xff\xfe"], pa.binary())
    text = pa.Array.from_buffers(
        pa.string(), 3, raw.buffers()
    )  # bytes declared as text, as a careless writer leaves them
    land(store, "b.parquet", parquet_bytes(pa.table({"x": [1.5, 2.5, 3.5], "s": text, "label": [0, 1, 0]})))
    with pytest.raises(ingest.IngestRejected) as caught:
        ingest.ingest(store, make_spec())
    messages = {r.uri.rsplit("/", 1)[-1]: r.issues[0].message for r in caught.value.records}
    assert messages == {
        "a.jsonl": f"{store.uri('landing', 'a.jsonl')}: line 2, column 2 ('s') holds text that is not valid UTF-8",
        "b.parquet": f"{store.uri('landing', 'b.parquet')}: row 3, column 2 ('s') holds text that is not valid UTF-8",
    }
