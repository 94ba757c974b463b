"""Incremental, streaming ingestion: landing files to parts to a canonical, DVC-pinned snapshot.

Every bad input of issue 6 has a test here with its outcome under both
policies: `on_bad_data="reject"` (the run fails, the file is kept in quarantine
with a report) and `"warn"` (unusable files are skipped, usable ones accepted
with a warning; nothing is lost either way).
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from resources.storage import ObjectStore
from trainyard import data as dq
from trainyard.data import ingest
from trainyard.data.landing import FileReader
from trainyard.spec import ColumnSpec, ModelSpec, PipelineSpec, SourceSpec

GOOD = "x,s,label\n1.5,a,0\n2.5,b,1\n"


def make_spec(**over) -> PipelineSpec:
    fields = dict(
        team="t",
        name="p",
        source=SourceSpec(prefix="landing", pattern=["*.csv", "*.parquet", "*.jsonl"], format="auto"),
        columns={
            "x": ColumnSpec(dtype="float", min=0, max=100),
            "s": ColumnSpec(dtype="str", domain=["a", "b", "c"]),
            "label": ColumnSpec(dtype="int", domain=[0, 1]),
        },
        target="label",
        min_rows=1,
        model=ModelSpec(path="pipelines.vision.models:DigitsMLP"),
    )
    fields.update(over)
    return PipelineSpec(**fields)


def land(store: ObjectStore, name: str, data: str | bytes, prefix: str = "landing") -> str:
    uri = store.uri(prefix, name)
    store.write_bytes(uri, data.encode() if isinstance(data, str) else data)
    return uri


def snapshot_rows(store: ObjectStore, result: ingest.IngestResult) -> dict:
    return pq.read_table(result.snapshot.uri).to_pydict()


# --------------------------------------------------------------------------- listing


def test_listing_takes_every_glob_recursive_globs_and_skips_markers(store, tmp_path):
    land(store, "a.csv", GOOD)
    land(store, "2024/05/b.csv", GOOD)
    land(store, "c.parquet", b"x")
    land(store, "_SUCCESS", b"")
    land(store, ".a.csv.crc", b"")
    land(store, "notes.txt", b"x")
    source = SourceSpec(prefix="landing", pattern=["*.csv", "**/*.csv", "*.parquet"])
    names = [f.uri[len(store.uri("landing")) + 1 :] for f in ingest.list_landing(store, source)]
    assert names == ["2024/05/b.csv", "a.csv", "c.parquet"]
    info = ingest.list_landing(store, source)[1]
    assert info.size == len(GOOD) and info.mtime is not None and info.etag
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "z.csv").write_text(GOOD)
    absolute = SourceSpec(prefix=str(outside))
    assert [f.uri for f in ingest.list_landing(store, absolute)] == [str(outside / "z.csv")]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_file_identity_changes_when_content_is_replaced(where, store, request):
    if where == "s3":
        endpoint = request.getfixturevalue("s3_endpoint")
        store = ObjectStore(root=endpoint.root("identity"), endpoint_url=endpoint.url)
    uri = land(store, "a.csv", GOOD)
    [listed] = store.list_files(store.uri("landing", "*.csv"))
    stat = store.stat(uri)
    assert listed == stat and stat.uri == uri and stat.size == len(GOOD) and stat.etag and stat.mtime
    land(store, "a.csv", GOOD.replace("1.5", "9.5"))  # same size, new content
    assert store.stat(uri).identity != stat.identity
    assert store.list_files(store.uri("landing", "*.txt")) == []


def test_missing_landing_data_names_prefix_and_pattern(store):
    spec = make_spec(source=SourceSpec(prefix="landing/none"))
    with pytest.raises(
        dq.MissingLandingData, match=r"no landing files match prefix 'landing/none' with pattern '\*.csv'"
    ):
        ingest.ingest(store, spec)


# --------------------------------------------------------------------------- formats and incremental ingestion


def test_csv_parquet_and_jsonl_become_one_canonical_snapshot(store):
    land(store, "a.csv", "label,s,x\n0,a,1\n1,b,2\n")  # column order may differ
    buf = io.BytesIO()
    pq.write_table(pa.table({"x": [3, 4], "s": ["c", "a"], "label": [1, 0]}), buf)  # int x is cast to float
    land(store, "b.parquet", buf.getvalue())
    land(store, "c.jsonl", '{"x": 5.5, "s": "b", "label": 1}\n{"label": 0, "s": "c", "x": 6}\n')
    result = ingest.ingest(store, make_spec())
    assert [r.rows for r in result.ingested] == [2, 2, 2] and not result.rejected and not result.warnings
    table = pq.read_table(result.snapshot.uri)
    assert table.schema == pa.schema([("x", pa.float64()), ("s", pa.string()), ("label", pa.int64())])
    assert table.to_pydict() == {
        "x": [1.0, 2.0, 3.0, 4.0, 5.5, 6.0],
        "s": ["a", "b", "c", "a", "b", "c"],
        "label": [0, 1, 1, 0, 1, 0],
    }
    assert result.snapshot.md5 == ingest.file_md5(result.snapshot.uri) and result.snapshot.rows == 6
    stored = json.loads(Path(result.snapshot.uri).with_name("manifest.json").read_text())
    assert [f["uri"] for f in stored["files"]] == result.snapshot.files


def test_only_new_files_are_read_and_the_snapshot_is_their_union(store, tmp_path, monkeypatch):
    spec = make_spec()
    land(store, "b.csv", "x,s,label\n2,b,1\n")
    first = ingest.ingest(store, spec)
    assert [r.uri.rsplit("/", 1)[1] for r in first.ingested] == ["b.csv"]

    read = []
    original = FileReader.batches

    def spy(self):
        read.append(self.info.uri.rsplit("/", 1)[1])
        return original(self)

    monkeypatch.setattr(FileReader, "batches", spy)
    again = ingest.ingest(store, spec)
    assert read == [] and again.reused_snapshot and again.snapshot.md5 == first.snapshot.md5 and again.unchanged == 1

    land(store, "a.csv", "x,s,label\n1,a,0\n")
    land(store, "c.csv", "x,s,label\n3,c,0\n")
    second = ingest.ingest(store, spec)
    assert read == ["a.csv", "c.csv"] and second.unchanged == 1 and not second.reused_snapshot
    assert snapshot_rows(store, second)["x"] == [1.0, 2.0, 3.0]  # landing URI order, not arrival order

    # the same landing files ingested in one go give the same bytes, hence the same data version
    fresh = ObjectStore(root=str(tmp_path / "fresh"))
    for name in ("a.csv", "b.csv", "c.csv"):
        land(fresh, name, Path(store.uri("landing", name)).read_text())
    assert ingest.ingest(fresh, spec).snapshot.md5 == second.snapshot.md5

    # a file that leaves the landing area leaves the snapshot (issue 15, item 4); coming back, it is not read again
    os.remove(store.uri("landing", "a.csv"))
    without = ingest.ingest(store, spec)
    assert without.removed == [store.uri("landing", "a.csv")] and snapshot_rows(store, without)["x"] == [2.0, 3.0]
    assert without.snapshot.md5 == first_md5_of(tmp_path, ("b.csv", "c.csv"), store, spec)


def first_md5_of(tmp_path: Path, names: tuple[str, ...], store: ObjectStore, spec: PipelineSpec) -> str:
    """The data version of a fresh store holding only `names` of `store`'s landing files."""
    fresh = ObjectStore(root=str(tmp_path / "-".join(names)))
    for name in names:
        land(fresh, name, Path(store.uri("landing", name)).read_text())
    return ingest.ingest(fresh, spec).snapshot.md5


def test_a_replaced_file_replaces_its_rows(store):
    spec = make_spec()
    land(store, "a.csv", "x,s,label\n1,a,0\n")
    first = ingest.ingest(store, spec)
    land(store, "a.csv", "x,s,label\n1,a,0\n7,b,1\n")
    second = ingest.ingest(store, spec)
    assert snapshot_rows(store, second)["x"] == [1.0, 7.0] and second.snapshot.md5 != first.snapshot.md5
    assert any("was replaced since it was ingested" in w for w in second.warnings)


def test_small_blocks_stream_many_batches_to_the_same_snapshot(store, tmp_path):
    rows = "".join(f"{i % 100}.25,{'abc'[i % 3]},{i % 2}\n" for i in range(5000))
    land(store, "big.csv", "x,s,label\n" + rows)
    streamed = ingest.ingest(store, make_spec(), block_bytes=4096)
    whole = ObjectStore(root=str(tmp_path / "whole"))
    land(whole, "big.csv", "x,s,label\n" + rows)
    assert ingest.ingest(whole, make_spec()).snapshot.md5 == streamed.snapshot.md5
    assert streamed.snapshot.rows == 5000


def test_a_latin1_source_is_read_with_its_encoding(store):
    land(store, "a.csv", "x,s,label\n1,a,0\n".encode("latin-1"))
    spec = make_spec(columns={**make_spec().columns, "s": ColumnSpec(dtype="str")})
    land(store, "b.csv", "x,s,label\n2,café,1\n".encode("latin-1"))
    result = ingest.ingest(store, spec.model_copy(update={"source": SourceSpec(prefix="landing", encoding="latin-1")}))
    assert snapshot_rows(store, result)["s"] == ["a", "café"]


def test_a_new_snapshot_is_pinned_by_the_pinner_given(store):
    pinned = []

    class Pinner:
        def pin(self, local_file: str) -> SimpleNamespace:
            pinned.append(pq.read_table(local_file).num_rows)
            return SimpleNamespace(md5="f" * 32, dvc_file="outs:\n- md5: " + "f" * 32 + "\n")

    land(store, "a.csv", GOOD)
    result = ingest.ingest(store, make_spec(), Pinner())
    assert pinned == [2] and result.snapshot.md5 == "f" * 32
    assert result.snapshot.uri == store.uri("data", "t", "p", "raw", "f" * 32, "data.parquet")
    assert (
        store.read_bytes(result.snapshot.uri + ".dvc").decode()
        == result.snapshot.dvc_file
        == "outs:\n- md5: " + "f" * 32 + "\n"
    )
    again = ingest.ingest(store, make_spec(), Pinner())
    assert again.reused_snapshot and pinned == [2]  # an unchanged snapshot is not pinned again


# --------------------------------------------------------------------------- bad inputs, file by file


def parquet_bytes(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


BAD_FILES = {
    # name: (file name, content, issue kind, usable under "warn")
    "corrupt parquet": (
        "bad.parquet",
        parquet_bytes(pa.table({"x": [1.0], "s": ["a"], "label": [0]}))[:-30] + b"garbage" * 4,
        "corrupt",
        False,
    ),
    "bad encoding": ("bad.csv", b"x,s,label\n1,caf\xe9,0\n", "encoding", False),
    "ragged rows": ("bad.csv", "x,s,label\n1,a,0\n2,b\n3,c,1,extra\n4,a,1\n", "ragged_rows", True),
    "empty file": ("bad.csv", b"", "empty", False),
    "header only": ("bad.csv", "x,s,label\n", "empty", True),
    "added column": ("bad.csv", "x,s,label,extra\n1,a,0,9\n", "columns_added", True),
    "removed column": ("bad.csv", "x,label\n1,0\n", "columns_missing", False),
    "renamed column": ("bad.csv", "x,S,label\n1,a,0\n", "columns_renamed", False),
    "type change": ("bad.csv", "x,s,label\n1,a,zero\n", "type", False),
    "type change in parquet": (
        "bad.parquet",
        parquet_bytes(pa.table({"x": ["one"], "s": ["a"], "label": [0]})),
        "type",
        False,
    ),
    "bad json": ("bad.jsonl", '{"x": 1, "s": "a", "label": 0}\n{"x": 2, "s": \n', "corrupt", False),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_file_is_rejected_and_kept_under_reject(store, case):
    name, content, kind, _ = BAD_FILES[case]
    land(store, "good.csv", GOOD)
    land(store, name, content)
    spec = make_spec()
    with pytest.raises(ingest.IngestRejected) as info:
        ingest.ingest(store, spec)
    [record] = info.value.records
    assert record.status == "rejected" and record.uri == store.uri("landing", name)
    assert kind in [i.kind for i in record.issues], record.issues
    assert name in str(info.value) and "kept in quarantine" in str(info.value)
    # nothing lost: the file's bytes and a report are in quarantine
    report = json.loads(Path(record.quarantine, "report.json").read_text())
    assert report["kind"] == "file" and report["status"] == "rejected" and report["policy"] == "reject"
    assert kind in [i["kind"] for i in report["issues"]]
    if content:
        assert Path(record.quarantine, name).read_bytes() == (
            content if isinstance(content, bytes) else content.encode()
        )
    [entry] = dq.list_quarantine(store, "t/p")
    assert entry.kind == "file" and entry.id == Path(record.quarantine).name
    # the manifest remembers the rejection: the unchanged file is not read again, and still rejects
    manifest = ingest.load_manifest(store, spec)
    assert manifest.files[record.uri].status == "rejected" and manifest.snapshot is None
    with pytest.raises(ingest.IngestRejected):
        ingest.ingest(store, spec)


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_file_under_warn_is_skipped_or_accepted_with_a_warning(store, case):
    name, content, kind, usable = BAD_FILES[case]
    land(store, "good.csv", GOOD)
    land(store, name, content)
    result = ingest.ingest(store, make_spec(on_bad_data="warn"))
    assert any(w.startswith(f"{kind}: ") for w in result.warnings), result.warnings
    rows = snapshot_rows(store, result)
    if usable:
        [record] = [r for r in result.ingested if r.uri.endswith(name)]
        assert record.status == "accepted" and kind in [i.kind for i in record.issues]
        assert result.snapshot.files == [store.uri("landing", name), store.uri("landing", "good.csv")]
    else:
        [record] = result.rejected
        assert result.snapshot.files == [store.uri("landing", "good.csv")]
        assert rows == {"x": [1.5, 2.5], "s": ["a", "b"], "label": [0, 1]}
    assert Path(record.quarantine, "report.json").exists()  # usable or not, the original is kept


def test_ragged_rows_under_warn_keep_the_good_rows(store):
    land(store, "r.csv", BAD_FILES["ragged rows"][1])
    result = ingest.ingest(store, make_spec(on_bad_data="warn"))
    assert snapshot_rows(store, result) == {"x": [1.0, 4.0], "s": ["a", "a"], "label": [0, 1]}
    [issue] = result.ingested[0].issues
    assert issue.message.endswith(
        "2 row(s) with the wrong number of fields at line(s) 3, 4; e.g. expected 3 fields, got 2: '2,b'; expected 3 "
        "fields, got 4: '3,c,1,extra'"
    )
    assert issue.lines == [3, 4] and any(w.endswith("(accepted without those rows)") for w in result.warnings)


def test_renamed_column_message_suggests_the_rename(store):
    land(store, "a.csv", "x,S,label\n1,a,0\n")
    with pytest.raises(
        ingest.IngestRejected,
        match=r"declared column\(s\) \['s'\] not found and undeclared column\(s\) \['S'\] found; renamed\? 'S' -> 's'",
    ):
        ingest.ingest(store, make_spec())


def test_castable_type_change_is_accepted(store):
    land(store, "a.csv", "x,s,label\n1,a,0\n")  # x written as an int
    land(store, "b.jsonl", '{"x": 2, "s": "b", "label": 1}\n')
    result = ingest.ingest(store, make_spec())
    assert snapshot_rows(store, result)["x"] == [1.0, 2.0] and not result.warnings


def test_a_bad_replacement_does_not_take_good_rows_out(store):
    spec = make_spec(on_bad_data="warn")
    land(store, "a.csv", GOOD)
    first = ingest.ingest(store, spec)
    land(store, "a.csv", b"x,s,label\n1,caf\xe9,0\n")
    second = ingest.ingest(store, spec)
    assert second.snapshot.md5 == first.snapshot.md5
    assert any("snapshot keeps the version ingested at" in w for w in second.warnings)


class _ChangingWhileRead:
    """Appends to a landing file after its first batch was read, as a writer still uploading would."""

    def __init__(self, monkeypatch, store: ObjectStore, name: str) -> None:
        self.done = False
        original = FileReader.batches

        def batches(reader):
            for batch in original(reader):
                yield batch
                if reader.info.uri.endswith(name) and not self.done:
                    self.done = True
                    with open(reader.info.uri, "a") as f:
                        f.write("9,c,1\n")

        monkeypatch.setattr(FileReader, "batches", batches)


GROWING = "x,s,label\n0.5,c,0\n"  # not GOOD: a copy of good.csv would be a duplicate delivery


def test_a_file_changing_while_read_is_not_ingested(store, monkeypatch):
    land(store, "good.csv", GOOD)
    land(store, "growing.csv", GROWING)
    _ChangingWhileRead(monkeypatch, store, "growing.csv")
    with pytest.raises(
        ingest.LandingFileChanged, match=r"growing.csv changed while being read .* ingested once it stops changing"
    ):
        ingest.ingest(store, make_spec())
    manifest = ingest.load_manifest(store, make_spec())
    assert store.uri("landing", "growing.csv") not in manifest.files  # not recorded: read again next time
    assert dq.list_quarantine(store) == []
    result = ingest.ingest(store, make_spec())  # stable now
    assert snapshot_rows(store, result)["x"] == [1.5, 2.5, 0.5, 9.0]


def test_a_file_changing_while_read_is_skipped_under_warn(store, monkeypatch):
    land(store, "good.csv", GOOD)
    land(store, "growing.csv", GROWING)
    _ChangingWhileRead(monkeypatch, store, "growing.csv")
    result = ingest.ingest(store, make_spec(on_bad_data="warn"))
    assert result.skipped_changing == [store.uri("landing", "growing.csv")]
    assert result.snapshot.files == [store.uri("landing", "good.csv")]
    assert "changed while read" in result.files_markdown()


# --------------------------------------------------------------------------- row-level bad input: validation decides


ROW_PROBLEMS = {
    "duplicate rows": ("x,s,label\n1,a,0\n2,b,1\n1,a,0\n", ("trainyard_rows_are_unique", None), [2]),
    "out of range": ("x,s,label\n1,a,0\n200,b,1\n", ("expect_column_values_to_be_between", "x"), [1]),
    "unknown category": ("x,s,label\n1,a,0\n2,zz,1\n", ("expect_column_values_to_be_in_set", "s"), [1]),
    "inf": ("x,s,label\n1,a,0\ninf,b,1\n", ("trainyard_values_are_finite", "x"), [1]),
    "nan": (None, ("trainyard_values_are_finite", "x"), [1]),
}


def _nan_parquet() -> bytes:
    return parquet_bytes(
        pa.table({"x": pa.array([1.0, float("nan")], from_pandas=False), "s": ["a", "b"], "label": [0, 1]})
    )


@pytest.mark.parametrize("case", sorted(ROW_PROBLEMS))
@pytest.mark.parametrize("policy", ["reject", "warn"])
def test_row_problems_are_rejected_or_set_aside_by_validation(store, case, policy):
    text, failing, rows = ROW_PROBLEMS[case]
    land(store, "ok.csv", "x,s,label\n" + "".join(f"{i},{'abc'[i % 3]},{i % 2}\n" for i in range(3, 23)))
    land(store, "z.parquet" if text is None else "z.csv", _nan_parquet() if text is None else text)
    # repeats as failing rows; the default drops them (test_repeated_rows_are_dropped_by_default)
    spec = make_spec(on_bad_data=policy, source=make_spec().source.model_copy(update={"duplicates": "reject"}))
    snap = ingest.ingest(store, spec).snapshot  # ingestion accepts: the values parse
    raw = {"uri": snap.uri, "md5": snap.md5, "rows": snap.rows, "dvc_file": ""}
    outcome = dq.validate_version(store, spec, raw)
    failed = {(r["expectation"], r["column"]) for r in outcome.validation.report.failures()}
    assert failing in failed
    offset = 20  # the rows of ok.csv come first
    result = next(r for r in outcome.validation.report.failures() if (r["expectation"], r["column"]) == failing)
    assert result["unexpected_index_list"] == [offset + r for r in rows]
    if policy == "reject":
        assert not outcome.verdict.accepted
        assert Path(outcome.quarantine, "data.parquet").read_bytes() == Path(snap.uri).read_bytes()
    else:
        assert outcome.verdict.accepted and outcome.value["set_aside"] == len(rows)
        kept = pq.read_table(Path(outcome.quarantine, "rows.parquet")).column("_row").to_pylist()
        assert kept == [offset + r for r in rows]
        assert sum(outcome.value["rows"].values()) == snap.rows - len(rows)


@pytest.mark.parametrize("policy", ["reject", "warn"])
def test_repeated_rows_are_dropped_by_default(store, policy):
    land(store, "a.csv", "x,s,label\n" + "".join(f"{i},{'abc'[i % 3]},{i % 2}\n" for i in range(20)))
    land(store, "b.csv", "x,s,label\n5,c,1\n30,a,0\n7,b,1\n")  # an overlapping re-delivery: two rows again, one new
    spec = make_spec(on_bad_data=policy)
    snap = ingest.ingest(store, spec).snapshot
    outcome = dq.validate_version(store, spec, {"uri": snap.uri, "md5": snap.md5, "rows": snap.rows, "dvc_file": ""})
    assert outcome.verdict.accepted and outcome.value["set_aside"] == 2
    assert (
        "2 repeated row(s) dropped, the first of each kept (source.duplicates='keep_first')" in outcome.verdict.warnings
    )
    assert sum(outcome.value["rows"].values()) == 21


# --------------------------------------------------------------------------- S3 and DVC


def test_incremental_ingest_and_validate_on_s3(s3_endpoint):
    store = ObjectStore(root=s3_endpoint.root("ingest"), endpoint_url=s3_endpoint.url)
    spec = make_spec(
        source=SourceSpec(
            prefix=s3_endpoint.root("ingest", "landing"), pattern=["**/*.csv", "*.parquet"], format="auto"
        )
    )
    land(store, "2024/01/a.csv", "x,s,label\n" + "".join(f"{i},a,{i % 2}\n" for i in range(12)))
    first = ingest.ingest(store, spec)
    assert first.snapshot.uri.startswith("s3://") and first.snapshot.rows == 12
    land(store, "2024/02/b.csv", "x,s,label\n" + "".join(f"{i},b,{i % 2}\n" for i in range(12, 24)))
    land(store, "c.parquet", parquet_bytes(pa.table({"x": [50.0], "s": ["c"], "label": [1]})))
    land(store, "d.parquet", b"not parquet at all")
    with pytest.raises(ingest.IngestRejected, match="d.parquet") as info:
        ingest.ingest(store, spec)
    assert [r.uri.rsplit("/", 1)[1] for r in info.value.records] == ["d.parquet"]
    manifest = ingest.load_manifest(store, spec)
    assert manifest.snapshot.md5 == first.snapshot.md5  # the rejection made no snapshot
    assert sorted(u.rsplit("/", 1)[1] for u, r in manifest.files.items() if r.status == "accepted") == [
        "a.csv",
        "b.csv",
        "c.parquet",
    ]
    warned = spec.model_copy(update={"on_bad_data": "warn"})
    second = ingest.ingest(store, warned)
    assert second.ingested == [] and second.unchanged == 4  # every file was read once, a.csv only in the first run
    assert second.snapshot.rows == 25 and second.snapshot.files[-1].endswith("c.parquet")
    [entry] = dq.list_quarantine(store, "t/p")
    assert entry.kind == "file" and store.exists(f"{entry.uri}/d.parquet")
    raw = {"uri": second.snapshot.uri, "md5": second.snapshot.md5, "rows": 25, "dvc_file": ""}
    outcome = dq.validate_version(store, warned, raw)
    assert outcome.verdict.accepted, outcome.verdict.reasons
    assert outcome.value["train"].startswith("s3://") and store.exists(outcome.value["train"])
    assert store.read_bytes(outcome.docs_uri).startswith(b"<!DOCTYPE html>") or b"<html" in store.read_bytes(
        outcome.docs_uri
    )


@pytest.mark.slow
def test_snapshots_pinned_to_an_s3_dvc_remote_restore_byte_identical(s3_endpoint, tmp_path):
    from resources.versioning import DataVersioning

    store = ObjectStore(root=s3_endpoint.root("dvc"), endpoint_url=s3_endpoint.url)
    versioning = DataVersioning(
        repo_dir=str(tmp_path / "work"),
        remote_url=s3_endpoint.root("dvc", "dvc-remote"),
        remote_endpoint_url=s3_endpoint.url,
    )
    spec = make_spec()
    land(store, "a.csv", GOOD)
    first = ingest.ingest(store, spec, versioning)
    land(store, "b.csv", "x,s,label\n3,c,1\n")
    second = ingest.ingest(store, spec, versioning)
    assert first.snapshot.md5 != second.snapshot.md5
    assert store.read_bytes(second.snapshot.uri + ".dvc").decode() == second.snapshot.dvc_file
    for n, snap in enumerate((first.snapshot, second.snapshot)):
        # another machine: only the .dvc text and the remote
        elsewhere = DataVersioning(
            repo_dir=str(tmp_path / f"other-{n}"), remote_url=versioning.remote_url, remote_endpoint_url=s3_endpoint.url
        )
        restored = elsewhere.restore(snap.dvc_file, "snapshots/data.parquet", str(tmp_path / f"fresh-{n}"))
        assert Path(restored).read_bytes() == store.read_bytes(snap.uri)
        assert ingest.file_md5(restored) == snap.md5


@pytest.mark.slow
def test_snapshot_pinned_to_a_local_dvc_remote_restores_byte_identical(store, tmp_path):
    from resources.versioning import DataVersioning, parse_dvc_file

    versioning = DataVersioning(repo_dir=str(tmp_path / "work"), remote_url=str(tmp_path / "remote"))
    land(store, "a.csv", GOOD)
    result = ingest.ingest(store, make_spec(), versioning)
    md5, size, path = parse_dvc_file(result.snapshot.dvc_file)
    assert md5 == result.snapshot.md5 and size == os.path.getsize(result.snapshot.uri)
    restored = versioning.restore(result.snapshot.dvc_file, f"snapshots/{path}", str(tmp_path / "fresh"))
    assert Path(restored).read_bytes() == Path(result.snapshot.uri).read_bytes()
    again = ingest.ingest(store, make_spec(), versioning)
    assert again.reused_snapshot and again.snapshot.dvc_file == result.snapshot.dvc_file


def test_rows_longer_than_a_block_are_read_with_bigger_blocks(store):
    long_text = "a" * 5000
    spec = make_spec(columns={**make_spec().columns, "s": ColumnSpec(dtype="str")})
    land(store, "a.csv", f"x,s,label\n1,{long_text},0\n2,b,1\n")
    land(store, "b.jsonl", json.dumps({"x": 3, "s": long_text, "label": 1}) + "\n")
    result = ingest.ingest(store, spec, block_bytes=1024)
    assert snapshot_rows(store, result)["s"] == [long_text, "b", long_text] and not result.warnings
