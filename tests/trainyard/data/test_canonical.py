"""Canonical form: declared columns and types, and Parquet bytes that depend only on the data."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainyard import data as dq
from trainyard.spec import ColumnSpec


def test_to_canonical_selects_orders_and_casts(digits_spec):
    spec = digits_spec(
        columns={
            "x": ColumnSpec(dtype="float"),
            "n": ColumnSpec(dtype="str"),
            "ok": ColumnSpec(dtype="bool"),
            "label": ColumnSpec(dtype="int"),
        }
    )
    raw = pa.table({"label": ["1", "0"], "extra": [9, 9], "ok": ["true", "false"], "n": [10, 20], "x": [1, 2]})
    table = dq.to_canonical(raw, spec)
    assert table.schema == pa.schema(
        [("x", pa.float64()), ("n", pa.string()), ("ok", pa.bool_()), ("label", pa.int64())]
    )
    assert table.to_pydict() == {"x": [1.0, 2.0], "n": ["10", "20"], "ok": [True, False], "label": [1, 0]}
    assert table.schema.metadata is None



def test_to_canonical_missing_column_names_it_and_the_columns_found(spec, digits):
    table = pa.Table.from_pandas(digits.drop(columns=["source"]), preserve_index=False)
    with pytest.raises(dq.SchemaMismatch) as info:
        dq.to_canonical(table, spec)
    assert str(info.value).startswith("declared column(s) ['source'] not found; the data has columns ['pixel_2_3',")



def test_to_canonical_uncastable_values_are_named(digits_spec):
    spec = digits_spec(columns={"x": ColumnSpec(dtype="float"), "label": ColumnSpec(dtype="int")})
    raw = pa.table({"x": [1.0, 2.0, 3.0, 4.0], "label": ["1", "two", None, "three"]})
    expected = (
        r"column 'label' cannot be cast from string to declared dtype 'int' \(int64\); offending values: \['two', "
        r"'three'\]"
    )
    with pytest.raises(dq.SchemaMismatch, match=expected):
        dq.to_canonical(raw, spec)
    fractional = pa.table({"x": [1.0], "label": [1.5]})
    with pytest.raises(dq.SchemaMismatch, match=r"offending values: \[1.5\]"):
        dq.to_canonical(fractional, spec)

    nested = pa.table({"x": [1.0], "label": pa.array([[1, 2]])})
    with pytest.raises(
        dq.SchemaMismatch, match=r"column 'label' cannot be cast from list<item: int64> .*Arrow has no cast"
    ):
        dq.to_canonical(nested, spec)



def test_parquet_bytes_depend_only_on_the_data(tmp_path, digits):
    table = pa.Table.from_pandas(digits, preserve_index=False)  # carries pandas metadata
    rechunked = pa.Table.from_batches(table.to_batches(max_chunksize=37)).replace_schema_metadata(None)
    paths = [str(tmp_path / n) for n in ("a.parquet", "b.parquet", "c.parquet")]
    dq.write_parquet_deterministic(table, paths[0])
    dq.write_parquet_deterministic(table, paths[1])
    dq.write_parquet_deterministic(rechunked, paths[2])
    contents = [open(p, "rb").read() for p in paths]
    assert contents[0] == contents[1] == contents[2]
    assert pq.read_table(paths[0]).equals(table.replace_schema_metadata(None))
    assert sorted(os.listdir(tmp_path)) == ["a.parquet", "b.parquet", "c.parquet"]

    dq.write_parquet_deterministic(table.slice(1), str(tmp_path / "d.parquet"))
    assert open(tmp_path / "d.parquet", "rb").read() != contents[0]



def test_canonical_writer_bytes_do_not_depend_on_batch_sizes(tmp_path, digits, monkeypatch):
    monkeypatch.setitem(dq.PARQUET_OPTIONS, "row_group_size", 64)  # several row groups from 300 rows
    table = pa.Table.from_pandas(digits, preserve_index=False).replace_schema_metadata(None)
    paths = []
    for i, size in enumerate((1, 37, 64, 300)):
        path = str(tmp_path / f"{i}.parquet")
        with dq.CanonicalParquetWriter(path, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=size):
                writer.write(batch)
        assert writer.rows == 300
        paths.append(path)
    contents = {open(p, "rb").read() for p in paths}
    assert len(contents) == 1
    meta = pq.ParquetFile(paths[0]).metadata
    assert [meta.row_group(g).num_rows for g in range(meta.num_row_groups)] == [64, 64, 64, 64, 44]
    assert pq.read_table(paths[0]).equals(table)
    # a float column is written without a dictionary, the others with one
    encodings = {meta.schema.column(c).name: meta.row_group(0).column(c).encodings for c in range(meta.num_columns)}
    assert "RLE_DICTIONARY" not in encodings["pixel_2_3"] and "RLE_DICTIONARY" in encodings["source"]



def test_canonical_writer_leaves_nothing_on_error(tmp_path, digits):
    table = pa.Table.from_pandas(digits, preserve_index=False).replace_schema_metadata(None)
    with pytest.raises(ValueError, match="differs from the writer's schema"):
        with dq.CanonicalParquetWriter(str(tmp_path / "x.parquet"), table.schema) as writer:
            writer.write(table.to_batches()[0])
            writer.write(table.drop_columns(["label"]).to_batches()[0])
    assert os.listdir(tmp_path) == []


def test_canonical_writer_shows_the_file_only_once_closed(tmp_path, digits):
    table = pa.Table.from_pandas(digits, preserve_index=False)
    path = tmp_path / "out" / "x.parquet"
    writer = dq.CanonicalParquetWriter(str(path), table.schema)
    writer.write(table)
    assert not path.exists()
    assert writer.close() == str(path) and pq.read_table(path).num_rows == len(digits)
    assert writer.close() == str(path)  # closing again, or aborting once closed, changes nothing
    writer.abort()
    aborted = dq.CanonicalParquetWriter(str(tmp_path / "out" / "y.parquet"), table.schema)
    aborted.write(table)
    aborted.abort()
    assert os.listdir(tmp_path / "out") == ["x.parquet"]
