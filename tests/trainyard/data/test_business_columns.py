"""Business tables at ingest and validation: roles, category/date/datetime, explicit missing values, renamed columns.

Real landing files (CSV with text dates, quoted strings, `n/a` and empty
cells; Parquet with date and timestamp columns) go through `ingest` and real
Great Expectations runs (`validate_snapshot`, `validate_version`).
"""

from __future__ import annotations

import datetime as dt
import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainyard import data as dq
from trainyard.data import ingest
from trainyard.data.checks import UNIQUE_IDS_EXPECTATION
from trainyard.data.splitting import key_columns, parts_of, split_hashes, split_table
from trainyard.data.validation import decide, validate_snapshot, validate_version
from trainyard.spec import ColumnSpec, ModelSpec, PipelineSpec, SourceSpec

HEADER = "customer_id,plan,country,signup_date,last_seen,tenure,charges,churned,note\n"


def churn_spec(**over) -> PipelineSpec:
    fields = dict(
        team="churn",
        name="customers",
        source=SourceSpec(prefix="landing", pattern=["*.csv", "*.parquet"], format="auto"),
        columns={
            "customer_id": ColumnSpec(dtype="str", role="id"),
            "plan": ColumnSpec(dtype="category", domain=["basic", "plus", "pro"]),
            "country": ColumnSpec(dtype="category", nullable=True),
            "signup_date": ColumnSpec(dtype="date"),
            "last_seen": ColumnSpec(dtype="datetime", role="timestamp"),
            "tenure": ColumnSpec(dtype="int", min=0),
            "charges": ColumnSpec(dtype="float", nullable=True),
            "churned": ColumnSpec(dtype="str", domain=["no", "yes"]),
            "note": ColumnSpec(dtype="str", role="ignore"),
        },
        target="churned",
        min_rows=1,
        model=ModelSpec(task="gbt"),
    )
    fields.update(over)
    return PipelineSpec(**fields)


def land(store, name: str, data: str | bytes) -> str:
    uri = store.uri("landing", name)
    store.write_bytes(uri, data.encode() if isinstance(data, str) else data)
    return uri


def rows(n: int, start: int = 0, positives: float = 0.1) -> str:
    """`n` good CSV rows: quoted text with commas in the ignored note, a text date, ISO times with and without a
    zone."""
    out = []
    for i in range(start, start + n):
        plan = ["basic", "plus", "pro"][i % 3]
        zone = "Z" if i % 2 else ""
        churned = "yes" if (i % int(1 / positives)) == 0 else "no"
        out.append(
            f"C{i:05d},{plan},DE,2022-05-{1 + i % 28:02d},2024-01-02T10:{i % 60:02d}:00{zone},"
            f'{i % 70},{50 + i % 9}.5,{churned},"a, quoted note"\n'
        )
    return "".join(out)


def parquet_bytes(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


# --------------------------------------------------------------------------- canonical types and roles


def test_csv_and_parquet_land_as_the_stored_columns_in_canonical_types(store):
    land(store, "a.csv", HEADER + rows(4))
    land(
        store,
        "b.parquet",
        parquet_bytes(
            pa.table(
                {
                    "customer_id": ["C90000", "C90001"],
                    "plan": ["pro", "basic"],
                    "country": ["FR", None],
                    # a timestamp column for a date (its UTC day), naive times for a datetime (UTC)
                    "signup_date": pa.array(
                        [dt.datetime(2022, 5, 4, 23, 0), dt.datetime(2021, 1, 1)], pa.timestamp("ns")
                    ),
                    "last_seen": pa.array([dt.datetime(2024, 1, 2, 8, 0), dt.datetime(2024, 1, 3)], pa.timestamp("ms")),
                    "tenure": [3, 4],
                    "charges": [10.0, None],
                    "churned": ["no", "yes"],
                    # no `note`: an ignored column need not be there
                }
            )
        ),
    )
    result = ingest.ingest(store, churn_spec())
    assert not result.rejected and not result.warnings
    table = pq.read_table(result.snapshot.uri)
    assert table.schema == pa.schema(
        [
            ("customer_id", pa.string()),
            ("plan", pa.string()),
            ("country", pa.string()),
            ("signup_date", pa.date32()),
            ("last_seen", pa.timestamp("us", tz="UTC")),
            ("tenure", pa.int64()),
            ("charges", pa.float64()),
            ("churned", pa.string()),
        ]
    )
    data = table.to_pydict()
    assert data["signup_date"][:2] == [dt.date(2022, 5, 1), dt.date(2022, 5, 2)]
    assert data["signup_date"][4:] == [dt.date(2022, 5, 4), dt.date(2021, 1, 1)]
    utc = dt.UTC
    # naive text is UTC, `Z` is UTC, naive Parquet times are UTC
    assert data["last_seen"][:2] == [
        dt.datetime(2024, 1, 2, 10, 0, tzinfo=utc),
        dt.datetime(2024, 1, 2, 10, 1, tzinfo=utc),
    ]
    assert data["last_seen"][4] == dt.datetime(2024, 1, 2, 8, 0, tzinfo=utc)
    assert result.snapshot.missing == {
        "customer_id": 0,
        "plan": 0,
        "country": 1,
        "signup_date": 0,
        "last_seen": 0,
        "tenure": 0,
        "charges": 1,
        "churned": 0,
    }


def test_datetime_text_with_an_offset_is_converted_to_utc(store):
    spec = churn_spec()
    land(store, "a.csv", HEADER + "C1,pro,DE,2022-05-04,2024-01-02 10:00:00+02:00,1,1.5,no,x\n")
    table = pq.read_table(ingest.ingest(store, spec).snapshot.uri)
    assert table.column("last_seen").to_pylist() == [dt.datetime(2024, 1, 2, 8, 0, tzinfo=dt.UTC)]


def test_uncastable_dates_reject_the_file_naming_line_column_and_values(store):
    spec = churn_spec()
    body = rows(3).replace("2022-05-02", "04/05/2022").replace("2024-01-02T10:02:00", "yesterday")
    uri = land(store, "a.csv", HEADER + body)
    with pytest.raises(ingest.IngestRejected) as e:
        ingest.ingest(store, spec)
    [record] = e.value.records
    by_column = {i.column: i for i in record.issues if i.kind == "type"}
    assert set(by_column) == {"signup_date", "last_seen"}
    assert by_column["signup_date"].lines == [3] and by_column["signup_date"].fatal
    assert (
        f"{uri}: column 'signup_date': 1 value(s) that are not 'date' at line(s) 3; e.g. '04/05/2022'"
        in by_column["signup_date"].message
    )
    assert "at line(s) 4; e.g. 'yesterday'" in by_column["last_seen"].message


def test_uncastable_dates_in_parquet_name_the_row_and_column(store):
    table = pa.table(
        {c: ["C1", "C2"] if c == "customer_id" else None for c in []}
        or {
            "customer_id": ["C1", "C2"],
            "plan": ["pro", "pro"],
            "country": ["DE", "DE"],
            "signup_date": ["2022-05-04", "not a date"],
            "last_seen": ["2024-01-02T10:00:00Z", "2024-01-02T10:00:00Z"],
            "tenure": [1, 2],
            "charges": [1.0, 2.0],
            "churned": ["no", "yes"],
        }
    )
    land(store, "a.parquet", parquet_bytes(table))
    with pytest.raises(ingest.IngestRejected) as e:
        ingest.ingest(store, churn_spec())
    [issue] = [i for i in e.value.records[0].issues if i.kind == "type"]
    assert (
        issue.column == "signup_date"
        and issue.lines == [2]
        and "'not a date'" in issue.message
        and "row(s) 2" in issue.message
    )


# --------------------------------------------------------------------------- missing values


def test_na_text_in_a_number_column_is_a_type_error_with_a_hint_under_the_default_tokens(store):
    body = rows(3).replace(",50.5,", ",n/a,", 1)
    land(store, "a.csv", HEADER + body)
    with pytest.raises(ingest.IngestRejected) as e:
        ingest.ingest(store, churn_spec())
    [issue] = [i for i in e.value.records[0].issues if i.kind == "type"]
    assert issue.column == "charges" and issue.lines == [2]
    assert "'n/a'" in issue.message and "add them to source.missing_values" in issue.message


def test_declared_missing_tokens_are_read_as_missing_and_counted(store):
    spec = churn_spec(source=SourceSpec(prefix="landing", pattern="*.csv", missing_values=["", "n/a", "NULL"]))
    body = rows(4).replace(",50.5,", ",n/a,", 1).replace(",DE,", ",NULL,", 1).replace(",DE,", ",,", 1)
    land(store, "a.csv", HEADER + body)
    result = ingest.ingest(store, spec)
    assert result.snapshot.missing["charges"] == 1 and result.snapshot.missing["country"] == 2
    assert result.ingested[0].missing["charges"] == 1
    assert pq.read_table(result.snapshot.uri).column("charges").null_count == 1


def test_na_text_in_a_text_column_is_text_under_the_default(store):
    land(store, "a.csv", HEADER + rows(2).replace(",DE,", ",n/a,", 1))
    result = ingest.ingest(store, churn_spec())
    assert pq.read_table(result.snapshot.uri).column("country").to_pylist()[0] == "n/a"
    assert result.snapshot.missing["country"] == 0


def test_an_empty_cell_in_a_text_column_is_missing_and_fails_not_null(store):
    # customer_id (an id) and churned (not nullable) empty, plain and quoted: neither becomes "".
    body = rows(3)
    body = body.replace("C00001,", ",", 1).replace(",no,", ',"",', 1)
    land(store, "a.csv", HEADER + body)
    spec = churn_spec()
    result = ingest.ingest(store, spec)
    table = pq.read_table(result.snapshot.uri)
    assert table.column("customer_id").to_pylist()[1] is None
    assert "" not in table.column("churned").to_pylist() and table.column("churned").null_count == 1
    assert {i.column for i in result.ingested[0].issues if i.kind == "nulls"} == {"customer_id", "churned"}
    report = validate_snapshot(store, result.snapshot.uri, spec).report
    failed = {(r["expectation"], r["column"]) for r in report.failures()}
    assert ("expect_column_values_to_not_be_null", "customer_id") in failed
    assert ("expect_column_values_to_not_be_null", "churned") in failed
    assert report.missing["customer_id"] == 1 and report.missing["churned"] == 1
    assert "**missing values** per column" in report.to_markdown()


# --------------------------------------------------------------------------- a renamed column hides nothing


def test_a_renamed_column_is_reported_with_the_other_columns_problems(store):
    header = HEADER.replace("charges", "monthly_charges")
    body = rows(4).replace("2022-05-02", "bad-date").replace(",plus,", ",gold,", 1).replace(",DE,", ",,", 1)
    body = body.replace("C00003,", ",", 1)
    uri = land(store, "a.csv", header + body)
    with pytest.raises(ingest.IngestRejected) as e:
        ingest.ingest(store, churn_spec())
    [record] = e.value.records
    kinds = {(i.kind, i.column) for i in record.issues}
    assert ("columns_renamed", None) in kinds
    assert ("type", "signup_date") in kinds  # types, nulls and domains of the other columns, in the same round
    assert ("domain", "plan") in kinds
    assert ("nulls", "customer_id") in kinds
    renamed = next(i for i in record.issues if i.kind == "columns_renamed")
    assert (
        "['charges'] not found" in renamed.message and "'monthly_charges'" in renamed.message and uri in renamed.message
    )
    assert record.status == "rejected" and record.quarantine


def test_a_missing_column_of_a_parquet_file_is_reported_with_the_other_problems(store):
    table = pa.table(
        {
            "customer_id": ["C1", None],
            "plan": ["pro", "gold"],
            "country": ["DE", "DE"],
            "signup_date": [dt.date(2022, 5, 4), dt.date(2022, 5, 5)],
            "last_seen": ["2024-01-02T10:00:00Z", "2024-01-02T10:00:00Z"],
            "tenure": [1, 2],
            "churned": ["no", "yes"],
        }
    )
    land(store, "a.parquet", parquet_bytes(table))
    with pytest.raises(ingest.IngestRejected) as e:
        ingest.ingest(store, churn_spec())
    kinds = {(i.kind, i.column) for i in e.value.records[0].issues}
    assert {("columns_missing", None), ("nulls", "customer_id"), ("domain", "plan")} <= kinds


# --------------------------------------------------------------------------- validation


def test_the_suite_types_domains_ids_and_ignored_columns(store, failed):
    spec = churn_spec()
    land(store, "a.csv", HEADER + rows(30))
    snap = ingest.ingest(store, spec).snapshot
    report = validate_snapshot(store, snap.uri, spec).report
    assert report.success, report.to_markdown()
    suite = dq.expectation_configs(spec)
    assert suite[1]["kwargs"]["column_list"] == list(spec.stored_columns)  # no `note`
    types = {
        e["kwargs"]["column"]: e["kwargs"]["type_list"]
        for e in suite
        if e["type"] == "expect_column_values_to_be_in_type_list"
    }
    assert types["signup_date"] == ["datetime64[s]"] and types["plan"] == ["str", "StringDtype"]
    domains = {e["kwargs"]["column"] for e in suite if e["type"] == "expect_column_values_to_be_in_set"}
    assert domains == {"plan", "churned"}  # the open category `country` has none
    # a date where a datetime is declared, and the other way round, fail the type expectations
    swapped = churn_spec(
        columns={
            **spec.columns,
            "signup_date": ColumnSpec(dtype="datetime"),
            "last_seen": ColumnSpec(dtype="date", role="timestamp"),
        }
    )
    bad = validate_snapshot(store, snap.uri, swapped).report
    assert {
        ("expect_column_values_to_be_in_type_list", "signup_date"),
        ("expect_column_values_to_be_in_type_list", "last_seen"),
    } <= failed(bad)


def test_an_id_is_never_null_even_when_declared_nullable(store, failed):
    spec = churn_spec(
        columns={**churn_spec().columns, "customer_id": ColumnSpec(dtype="str", role="id", nullable=True)}
    )
    land(store, "a.csv", HEADER + rows(3).replace("C00001,", ",", 1))
    snap = ingest.ingest(store, spec).snapshot
    assert ("expect_column_values_to_not_be_null", "customer_id") in failed(
        validate_snapshot(store, snap.uri, spec).report
    )


def test_repeated_ids_are_a_warning_not_a_failure(store):
    spec = churn_spec(
        columns={**churn_spec().columns, "last_seen": ColumnSpec(dtype="datetime")}
    )  # no timestamp role: the id alone
    body = rows(5)
    body += body.splitlines(keepends=True)[0].replace(
        "2024-01-02T10:00:00", "2024-02-02T10:00:00"
    )  # same customer, later
    land(store, "a.csv", HEADER + body)
    snap = ingest.ingest(store, spec).snapshot
    report = validate_snapshot(store, snap.uri, spec).report
    assert report.success
    [ids] = [r for r in report.results if r["expectation"] == UNIQUE_IDS_EXPECTATION]
    assert (
        ids["unexpected_count"] == 1 and ids["severity"] == "warning" and ids["observed_value"]["key"] == "customer_id"
    )
    verdict = decide(report, [], spec)
    assert verdict.accepted and any("repeat the customer_id" in w for w in verdict.warnings)
    # with the timestamp role, (id, time) identifies a row: a later export of the customer is no repeat
    timed = churn_spec()
    report = validate_snapshot(store, snap.uri, timed).report
    [ids] = [r for r in report.results if r["expectation"] == UNIQUE_IDS_EXPECTATION]
    assert ids["unexpected_count"] == 0 and ids["observed_value"]["key"] == "customer_id + last_seen"


def test_the_split_carries_ids_and_timestamps_and_every_part_gets_positives(store):
    spec = churn_spec()
    land(store, "a.csv", HEADER + rows(200, positives=0.05))
    raw = ingest.ingest(store, spec).snapshot
    outcome = validate_version(store, spec, {"uri": raw.uri, "md5": raw.md5})
    assert outcome.verdict.accepted, outcome.verdict.reasons
    seen = []
    for part in ("train", "val", "test"):
        table = pq.read_table(outcome.value[part])
        assert table.column_names == list(spec.stored_columns)
        assert table.schema.field("last_seen").type == pa.timestamp("us", tz="UTC")
        assert "yes" in table.column("churned").to_pylist()
        seen += table.column("customer_id").to_pylist()
    assert sorted(seen) == [f"C{i:05d}" for i in range(200)]
    profile = outcome.validation.profile["columns"]
    assert profile["signup_date"]["type"] == "date32[day]" and profile["signup_date"]["min"] == "2022-05-01"


def _ids_and_labels(labels: np.ndarray) -> pa.Table:
    return pa.table({"customer_id": [f"C{i:05d}" for i in range(len(labels))], "churned": labels.tolist()})


@pytest.mark.parametrize("n, positives", [(40, 3), (60, 3), (100, 5), (1000, 55)])
def test_rare_positives_reach_every_part(churn_positions_spec, n, positives):
    labels = np.array(["no"] * (n - positives) + ["yes"] * positives, dtype=object)
    table = _ids_and_labels(labels)
    parts = split_table(table, churn_positions_spec)
    assert all(((parts == k) & (labels == "yes")).any() for k in range(3))
    hashed = parts_of(split_hashes(table, ["customer_id"], churn_positions_spec), churn_positions_spec)
    moved = np.flatnonzero(parts != hashed)
    assert (
        len(moved) <= 2 and (labels[moved] == "yes").all()
    )  # only rows of the lacking class move, one per part it lacked


def test_a_split_that_already_has_every_class_everywhere_is_unchanged(churn_positions_spec):
    labels = np.array(["no", "yes"] * 100, dtype=object)
    table = _ids_and_labels(labels)
    parts = split_table(table, churn_positions_spec)
    assert key_columns(churn_positions_spec, table.column_names) == ["customer_id"]
    hashed = parts_of(split_hashes(table, ["customer_id"], churn_positions_spec), churn_positions_spec)
    assert all(((hashed == k) & (labels == c)).any() for k in range(3) for c in ("no", "yes"))
    assert np.array_equal(parts, hashed)


@pytest.fixture
def churn_positions_spec() -> PipelineSpec:
    return churn_spec()


def test_nan_text_in_a_float_column_is_the_float_reported_with_a_hint_unless_listed(store):
    land(store, "a.csv", HEADER + rows(3).replace(",50.5,", ",NaN,", 1))
    result = ingest.ingest(store, churn_spec())
    [issue] = [i for i in result.ingested[0].issues if i.kind == "non_finite"]
    assert issue.column == "charges" and issue.lines == [2] and "add it to source.missing_values" in issue.message
    listed = churn_spec(source=SourceSpec(prefix="landing", pattern="*.csv", missing_values=["", "NaN"]))
    again = ingest.ingest(store, listed)  # the tokens are part of the parts' key: the file is read again
    assert again.ingested and again.snapshot.missing["charges"] == 1 and not again.ingested[0].issues


def test_jsonl_dates_and_times_are_parsed_and_bad_ones_named_by_line(store):
    spec = churn_spec(source=SourceSpec(prefix="landing", pattern="*.jsonl", format="jsonl"))
    good = (
        '{"customer_id": "C1", "plan": "pro", "country": null, "signup_date": "2022-05-04", "last_seen": '
        '"2024-01-02T10:00:00+01:00",'
        ' "tenure": 1, "charges": 2.5, "churned": "no", "note": "x"}\n'
    )
    land(store, "a.jsonl", good)
    table = pq.read_table(ingest.ingest(store, spec).snapshot.uri)
    assert table.column("signup_date").to_pylist() == [dt.date(2022, 5, 4)]
    assert table.column("last_seen").to_pylist() == [dt.datetime(2024, 1, 2, 9, 0, tzinfo=dt.UTC)]
    land(store, "b.jsonl", good + good.replace("2022-05-04", "2022-02-30"))
    with pytest.raises(ingest.IngestRejected) as e:
        ingest.ingest(store, spec)
    [issue] = [i for i in e.value.records[0].issues if i.kind == "type"]
    assert issue.column == "signup_date" and issue.lines == [2] and "'2022-02-30'" in issue.message


def test_platform_checks_hash_dates_and_times_as_themselves_and_check_only_floats_for_finiteness(store, failed):
    from trainyard.data.checks import row_hashes

    days = pa.array([dt.date(2022, 5, 4), dt.date(2022, 5, 4), dt.date(2022, 5, 5), None])
    times = pa.array([dt.datetime(2024, 1, 2, tzinfo=dt.UTC)] * 2 + [None, None], pa.timestamp("us", tz="UTC"))
    hashes = row_hashes(pa.record_batch([days, times, pa.array(["a", "a", "a", None])], names=["d", "t", "s"]))
    assert hashes[0] == hashes[1] and len(set(hashes.tolist())) == 3
    spec = churn_spec(source=SourceSpec(prefix="landing", pattern="*.csv", duplicates="reject"))
    land(store, "a.csv", HEADER + rows(4) + rows(1))  # the first row once more
    report = validate_snapshot(store, ingest.ingest(store, spec).snapshot.uri, spec).report
    assert failed(report) == {("trainyard_rows_are_unique", None)}
    assert {r["column"] for r in report.results if r["expectation"] == "trainyard_values_are_finite"} == {"charges"}


def test_a_zoned_parquet_timestamp_in_a_date_column_keeps_its_own_calendar_day():
    from trainyard.data.canonical import cast_values

    berlin = pa.array(
        [dt.datetime(2022, 5, 3, 22, 0), dt.datetime(2022, 1, 1, 22, 30)], pa.timestamp("us", tz="UTC")
    ).cast(pa.timestamp("us", tz="Europe/Berlin"))  # midnight and 23:30 on the Berlin calendar
    assert cast_values(berlin, pa.date32()).to_pylist() == [dt.date(2022, 5, 4), dt.date(2022, 1, 1)]


def test_missing_lookalikes_in_an_open_text_column_are_kept_as_text_with_a_warning(store):
    land(store, "a.csv", HEADER + rows(3).replace(",DE,", ",N/A,", 1).replace(",DE,", ",none,", 1))
    result = ingest.ingest(store, churn_spec())
    [issue] = [i for i in result.ingested[0].issues if i.kind == "missing_lookalike"]
    assert issue.column == "country" and issue.lines == [2, 3] and issue.count == 2 and not issue.blocking
    assert any(w.startswith("missing_lookalike:") and w.endswith("(accepted as text)") for w in result.warnings)
    assert pq.read_table(result.snapshot.uri).column("country").to_pylist()[:2] == ["N/A", "none"]


def test_pandas_categoricals_and_zoned_times_in_parquet_land_as_text_and_utc(store):
    import pandas as pd

    frame = pd.DataFrame(
        {
            "customer_id": ["C1", "C2"],
            "plan": pd.Categorical(["pro", "basic"]),  # Parquet dictionary columns
            "country": pd.Categorical(["DE", None]),
            "signup_date": pd.to_datetime(["2022-05-04", "2022-05-05"]).date,
            "last_seen": pd.to_datetime(["2024-01-02 10:00", "2024-01-02 11:00"]).tz_localize("Europe/Berlin"),
            "tenure": [1, 2],
            "charges": [1.0, None],
            "churned": pd.Categorical(["no", "yes"]),
        }
    )
    land(store, "a.parquet", parquet_bytes(pa.Table.from_pandas(frame, preserve_index=False)))
    table = pq.read_table(ingest.ingest(store, churn_spec()).snapshot.uri)
    assert table.schema.field("plan").type == pa.string() and table.column("country").to_pylist() == ["DE", None]
    assert table.column("last_seen").to_pylist()[0] == dt.datetime(2024, 1, 2, 9, 0, tzinfo=dt.UTC)
