"""One report with every problem of a bad landing file, by column name and line number (issue 15, item 5)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from resources.storage import ObjectStore
from tests.trainyard.data.test_ingest import GOOD, land, make_spec
from trainyard import data as dq
from trainyard.data import ingest
from trainyard.data.file_problems import line_numbers

# line 1 is the header; line 3 has a type error in x, line 4 is ragged,
# line 5 has a label outside the domain, line 6 an out-of-range x and a missing s,
# line 7 a category outside the domain and a second bad type (in label).
SEVERAL = (
    "x,s,label\n"
    "1.5,a,0\n"
    "one,b,1\n"
    "2,c\n"
    "3,a,7\n"
    "500,,1\n"
    "4,zz,x\n"
)


def test_a_file_with_several_kinds_of_error_is_reported_at_once(store: ObjectStore) -> None:
    land(store, "good.csv", GOOD)
    land(store, "bad.csv", SEVERAL)
    with pytest.raises(ingest.IngestRejected) as info:
        ingest.ingest(store, make_spec())
    [record] = info.value.records
    found = {(i.kind, i.column): i.lines for i in record.issues}
    assert found == {
        ("type", "x"): [3],
        ("type", "label"): [7],
        ("ragged_rows", None): [4],
        ("nulls", "s"): [6],
        ("range", "x"): [6],
        ("domain", "s"): [7],
        ("domain", "label"): [5],
    }
    first = record.issues[0]
    assert first.fatal and first.kind == "type" and first.column == "x"
    assert "column 'x': 1 value(s) that are not 'float' at line(s) 3; e.g. 'one'" in first.message
    assert "skipped" not in str(info.value)  # nothing of a rejected file is used, so nothing is "skipped"
    report = json.loads(Path(record.quarantine, "report.json").read_text())
    assert {(i["kind"], i["column"]) for i in report["issues"]} == set(found)
    assert len(dq.list_quarantine(store, "t/p")) == 1


def test_value_problems_alone_are_listed_with_lines_and_left_to_validation(store: ObjectStore) -> None:
    land(store, "good.csv", GOOD)
    land(store, "values.csv", "x,s,label\n1,a,0\n2,zz,1\n")
    result = ingest.ingest(store, make_spec())
    [record] = [r for r in result.ingested if r.uri.endswith("values.csv")]
    [issue] = record.issues
    assert (issue.kind, issue.column, issue.lines, issue.fatal) == ("domain", "s", [3], False)
    assert any(w.endswith("(the file is accepted; validation decides on these rows)") for w in result.warnings)
    assert dq.list_quarantine(store, "t/p") == []  # validation keeps the version, if it rejects it


def test_parquet_rows_are_numbered_from_one(store: ObjectStore) -> None:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.table({"x": [1.0, 250.0], "s": ["a", "b"], "label": [0, 1]}), buf)
    land(store, "v.parquet", buf.getvalue())
    [record] = ingest.ingest(store, make_spec()).ingested
    [issue] = record.issues
    assert issue.kind == "range" and issue.lines == [2] and "at row(s) 2" in issue.message


def test_line_numbers_count_the_header_and_skipped_lines() -> None:
    assert line_numbers([0, 1, 2], [], 2) == [2, 3, 4]
    assert line_numbers([0, 1, 2], [3], 2) == [2, 4, 5]
    assert line_numbers([1], [2, 3], 2) == [5]
