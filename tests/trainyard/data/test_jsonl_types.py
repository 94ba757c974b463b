"""JSON lines whose values do not fit their declared types are named by 1-based line, column and value.

pyarrow's JSON reader stops at the first value of another JSON type ("Column(/age) changed from
number to string in row 4": a 0-based row of its block, no value, and for a conflict it blames the
later row, not the odd one). The file is then read again line by line and checked like CSV text.
"""

from __future__ import annotations

import json

import pytest

from trainyard.data import ingest
from trainyard.spec import ColumnSpec, PipelineSpec, SourceSpec


def claims_spec(**source) -> PipelineSpec:
    from tests.pipelines.pipeline_fixtures import small_spec

    return small_spec(
        name="claims",
        source=SourceSpec(prefix="landing", pattern="*.jsonl", format="jsonl", **source),
        columns={
            "claim_id": ColumnSpec(dtype="str", role="id"),
            "age": ColumnSpec(dtype="int", nullable=True),
            "commercial": ColumnSpec(dtype="bool"),
            "amount": ColumnSpec(dtype="float"),
            "outcome": ColumnSpec(dtype="str", domain=["approved", "denied"]),
        },
        target="outcome",
        min_rows=1,
    )


def lines(n: int, **odd: dict) -> str:
    records = [
        {"claim_id": f"K{i}", "age": i, "commercial": i % 2 == 0, "amount": 10.5 + i, "outcome": "approved"}
        for i in range(n)
    ]
    for index, values in odd.items():
        records[int(index.removeprefix("line")) - 1].update(values)
    return "".join(json.dumps(r) + "\n" for r in records)


def land(store, name: str, text: str) -> None:
    store.write_bytes(store.uri("landing", name), text.encode())


def test_a_text_value_in_a_number_column_is_named_by_its_line_column_and_value(store) -> None:
    land(store, "a.jsonl", lines(10, line5={"age": "n/a"}, line8={"age": "seven"}))
    with pytest.raises(ingest.IngestRejected) as e:
        ingest.ingest(store, claims_spec())
    [issue] = [i for i in e.value.records[0].issues if i.kind == "type"]
    assert issue.column == "age" and issue.lines == [5, 8], issue
    assert "'n/a'" in issue.message and "'seven'" in issue.message and "a missing value is null" in issue.message
    assert "row 4" not in issue.message


def test_the_odd_value_is_blamed_not_the_row_after_it(store) -> None:
    # An epoch number on line 1 of a text column, then text: pyarrow blames line 2.
    land(store, "a.jsonl", lines(4, line1={"outcome": 1700000000}))
    with pytest.raises(ingest.IngestRejected) as e:
        ingest.ingest(store, claims_spec())
    problems = [(i.column, i.lines) for i in e.value.records[0].issues if i.kind in ("type", "domain")]
    assert ("outcome", [1]) in problems, e.value.records[0].issues


def test_a_broken_line_is_named(store) -> None:
    land(store, "a.jsonl", lines(6, line3={"age": None}))  # null is missing in JSON
    assert ingest.ingest(store, claims_spec()).snapshot.rows == 6
    land(store, "b.jsonl", lines(3, line2={"age": "x"}) + '{"claim_id": "K9", "age": \n')
    with pytest.raises(ingest.IngestRejected) as e:
        ingest.ingest(store, claims_spec())
    [issue] = [i for r in e.value.records for i in r.issues if i.fatal]
    assert issue.lines == [4] and "line 4 is not valid JSON" in issue.message
