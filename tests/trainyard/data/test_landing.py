"""Reading one landing file: its format, canonical batches, and what is wrong with it."""

from __future__ import annotations

import pytest

from trainyard.data.landing import BadFile, FileReader, file_format
from trainyard.spec import ColumnSpec, ModelSpec, PipelineSpec, SourceSpec


def _spec(**source) -> PipelineSpec:
    return PipelineSpec(
        team="t",
        name="p",
        source=SourceSpec(prefix="landing", **source),
        columns={"x": ColumnSpec(dtype="float"), "label": ColumnSpec(dtype="int")},
        target="label",
        min_rows=1,
        model=ModelSpec(path="pipelines.vision.models:DigitsMLP"),
    )


def _reader(store, name: str, data: bytes, spec: PipelineSpec, block_bytes: int = 1 << 20) -> FileReader:
    uri = store.uri("landing", name)
    store.write_bytes(uri, data)
    return FileReader(store, store.stat(uri), spec, block_bytes)


def test_the_format_comes_from_the_source_or_the_extension():
    auto = _spec(format="auto").source
    assert [
        file_format(auto, f"s3://b/a{ext}") for ext in (".csv", ".PARQUET", ".pq", ".jsonl", ".ndjson", ".json", ".txt")
    ] == ["csv", "parquet", "parquet", "jsonl", "jsonl", "jsonl", None]
    assert file_format(_spec(format="csv").source, "s3://b/a.txt") == "csv"


def test_a_csv_streams_as_canonical_batches_and_notes_an_added_column(store):
    rows = "".join(f"{i % 2},{i}.5,extra\n" for i in range(1000))
    reader = _reader(store, "a.csv", ("label,x,note\n" + rows).encode(), _spec(format="auto"), block_bytes=4096)
    batches = list(reader.batches())
    assert len(batches) > 1 and reader.rows == 1000
    assert all(b.schema.names == ["x", "label"] for b in batches)
    assert batches[0].column("x").to_pylist()[:2] == [0.5, 1.5]
    [issue] = reader.issues
    assert issue.kind == "columns_added" and not issue.fatal and "['note']" in issue.message


@pytest.mark.parametrize(
    "name, data, kind",
    [
        ("a.txt", b"x,label\n1,0\n", "format"),
        ("a.csv", b"", "empty"),
        ("a.csv", b"x\n1\n", "columns_missing"),
    ],
)
def test_an_unusable_file_raises_its_fatal_issue(store, name, data, kind):
    reader = _reader(store, name, data, _spec(format="auto"))
    with pytest.raises(BadFile) as info:
        list(reader.batches())
    assert (
        info.value.issue.kind == kind
        and info.value.issue.fatal
        and store.uri("landing", name) in info.value.issue.message
    )
