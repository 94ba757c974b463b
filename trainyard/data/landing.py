"""Reading one landing file (CSV, Parquet or JSON lines) as canonical record batches, in bounded memory.

`FileReader` streams a file one block (CSV/JSON text) or batch (Parquet) at a
time, casts it to the declared columns and collects what is wrong with it as
`FileIssue`s: a fatal one (`BadFile`) means the file cannot be used at all.
Every problem of a file is collected in the same pass, with column names and
line numbers (see `trainyard.data.file_problems`): a CSV file with a value
that does not fit its type is read once more as text to find all of them,
so one report lists the bad types, ragged rows, missing values, values out of
range or domain and non-finite floats together. A declared column missing
from the file (or renamed) does not hide the rest: the columns that are there
are read and checked all the same, and the report lists both.

Cells read as missing are counted per column (`FileReader.missing`): in CSV
the cells whose text is one of `SourceSpec.missing_values` (default: the
empty cell only), in Parquet and JSON lines the nulls.
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterator, Literal, Optional

import pyarrow as pa
from pydantic import BaseModel

from trainyard.data.canonical import ARROW_TYPES, reading_type
from trainyard.data.file_problems import VALUE_KINDS, ProblemCollector, describe, line_numbers
from trainyard.spec import PipelineSpec, SourceSpec
from trainyard.store import FileInfo, FileStore

READ_BLOCK_BYTES = 1024 * 1024
"""Bytes of CSV/JSON text parsed at a time."""

PARQUET_BATCH_ROWS = 64 * 1024
"""Rows read at a time from a landing Parquet file."""

MISSING_LOOKALIKES = frozenset({"n/a", "na", "nan", "null", "none", "nil", "-", "--", "?", "missing", "#n/a", "n.a."})
"""Texts that often mean "missing" in exports; a value among them that does not fit its column's type gets a hint."""

EXTENSIONS = {
    ".csv": "csv",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
}

IssueKind = Literal[
    "corrupt",
    "encoding",
    "ragged_rows",
    "empty",
    "columns_added",
    "columns_missing",
    "columns_renamed",
    "columns_duplicated",
    "type",
    "format",
    "nulls",
    "range",
    "domain",
    "non_finite",
    "missing_lookalike",
]


class FileIssue(BaseModel):
    """Something wrong with one landing file.

    Attributes:
        kind: What kind of problem.
        message: What exactly, naming columns, rows and values.
        fatal: The file cannot be used at all (else it can, e.g. with the
            added column dropped or the ragged rows left out).
        column: The column concerned, when there is one.
        lines: The first lines (rows, for Parquet) where it occurs, 1-based as in the file.
        count: How many rows or values (0 when not counted).
    """

    kind: IssueKind
    message: str
    fatal: bool
    column: Optional[str] = None
    lines: list[int] = []
    count: int = 0

    @property
    def blocking(self) -> bool:
        """Whether `on_bad_data="reject"` rejects the file for it; values that parse are left to validation."""
        return self.fatal or self.kind not in VALUE_KINDS


def file_format(source: SourceSpec, uri: str) -> Optional[str]:
    """The format to parse `uri` as: the source's, or by extension for `auto` (None when unknown)."""
    if source.format != "auto":
        return source.format
    return EXTENSIONS.get(os.path.splitext(uri)[1].lower())


class BadFile(Exception):
    """The landing file cannot be used at all; `issue` says why."""

    def __init__(self, issue: FileIssue) -> None:
        super().__init__(issue.message)
        self.issue = issue


_CSV_CELL = re.compile(r"In CSV column #(\d+): Row #(\d+): ")


def _classify(
    e: BaseException, uri: str, fmt: str, header: Optional[list[str]] = None, encoding: str = "utf8"
) -> FileIssue:
    text = str(e)
    if isinstance(e, UnicodeDecodeError) or "UTF8" in text or "UTF-8" in text:
        where = _CSV_CELL.search(text)
        if where is not None and header is not None:
            # pyarrow counts CSV columns from 0 and rows as lines from 1 (the header is line 1).
            index, line = int(where.group(1)), int(where.group(2))
            name = header[index] if index < len(header) else "?"
            return FileIssue(
                kind="encoding",
                message=f"{uri}: line {line}, column {index + 1} ({name!r}) holds text that is not valid {encoding} "
                f"(source.encoding={encoding!r}; re-export the file as {encoding}, or declare its encoding)",
                fatal=True,
                column=name,
                lines=[line],
            )
        return FileIssue(kind="encoding", message=f"{uri} is not valid in the declared encoding: {text}", fatal=True)
    if "conversion error" in text or "Failed to convert" in text or "changed from" in text:
        return FileIssue(kind="type", message=f"{uri}: a value does not fit its declared type: {text}", fatal=True)
    if text.startswith("Empty") or "size is 0 bytes" in text:
        return FileIssue(kind="empty", message=f"{uri} is empty: {text}", fatal=True)
    return FileIssue(kind="corrupt", message=f"cannot parse {uri} as {fmt}: {type(e).__name__}: {text}", fatal=True)


def _valid_utf8(value: pa.Array) -> bool:
    try:
        value.validate(full=True)
    except pa.ArrowInvalid:
        return False
    return True


class FileReader:
    """Streams one landing file as canonical record batches, collecting its issues."""

    def __init__(self, store: FileStore, info: FileInfo, spec: PipelineSpec, block_bytes: int) -> None:
        self.store = store
        self.info = info
        self.spec = spec
        self.block_bytes = block_bytes
        self.issues: list[FileIssue] = []
        self.rows = 0
        self.fmt = file_format(spec.source, info.uri)
        self._ragged: list[str] = []
        self._ragged_count = 0
        self._ragged_lines: list[int] = []
        self.problems = ProblemCollector(spec)
        self.missing: dict[str, int] = {}
        # The stored columns the file has (set once its header is read), and why the file lacks the others.
        self.columns: list[str] = list(spec.stored_columns)
        self._columns_issue: Optional[FileIssue] = None
        self._header: Optional[list[str]] = None  # the file's column names, in its order

    def _types(self) -> dict[str, pa.DataType]:
        """The canonical type of each stored column the file has."""
        return {c: ARROW_TYPES[self.spec.columns[c].dtype] for c in self.columns}

    def batches(self) -> Iterator[pa.RecordBatch]:
        """Canonical batches; raises `BadFile` when the file cannot be used.

        Nothing is yielded once a column is found missing or a value that
        does not fit its type; the file is read to its end all the same, so
        the `BadFile` raised at the end comes with every other problem in
        `issues`.
        """
        uri = self.info.uri
        if self.fmt is None:
            raise BadFile(
                FileIssue(
                    kind="format",
                    message=f"{uri}: cannot tell the format from the extension; use one of {sorted(EXTENSIONS)}",
                    fatal=True,
                )
            )
        if self.info.size == 0:
            raise BadFile(FileIssue(kind="empty", message=f"{uri} is empty (0 bytes)", fatal=True))
        readers = {"csv": self._csv, "parquet": self._parquet, "jsonl": self._jsonl}
        try:
            for batch in readers[self.fmt]():
                typed = self._typed(batch)
                if self._columns_issue is None and not self.problems.has_type_problems():
                    yield typed
        except (pa.ArrowException, OSError, UnicodeDecodeError) as e:
            issue = _classify(e, uri, self.fmt, self._header, self.spec.source.encoding)
            if issue.kind == "type" and self.fmt == "csv":
                self._diagnose_csv()
            elif self.fmt == "jsonl" and isinstance(e, pa.ArrowInvalid):
                self._diagnose_jsonl()
            raise BadFile(self._fatal() or issue) from e
        fatal = self._fatal()
        if fatal is not None:
            raise BadFile(fatal)
        if self.rows == 0:
            self.issues.append(FileIssue(kind="empty", message=f"{uri} has a header but no rows", fatal=False))

    def _fatal(self) -> Optional[FileIssue]:
        """Report what was collected; the issue that makes the file unusable (a missing column, else a bad value), if
        any."""
        first = self._report_problems()
        if self._columns_issue is None:
            return first
        if first is not None:
            self.issues.insert(0, first)
        return self._columns_issue

    def _typed(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """One batch of the file's stored columns in their canonical types; counts missing cells and records every
        problem."""
        batch = batch.select(self.columns)
        if self.fmt != "csv":  # CSV text is checked by its reader, which names the line
            self._check_utf8(batch)
        for name in self.columns:
            self.missing[name] = self.missing.get(name, 0) + batch.column(name).null_count
        typed, bad = self.problems.check_types(batch, self._types(), self.rows)
        self.problems.check_values(typed, self.rows, ignore=bad)
        if self.fmt == "csv":
            self._lookalikes(typed)
        self.rows += batch.num_rows
        return typed

    def _lookalikes(self, batch: pa.RecordBatch) -> None:
        """Note text cells that look like a missing-value token (`n/a`) but are kept as text: open text columns, CSV
        only."""
        import numpy as np
        import pyarrow.compute as pc

        tokens = pa.array(sorted(MISSING_LOOKALIKES - {t.strip().lower() for t in self.spec.source.missing_values}))
        for name in self.columns:
            column = self.spec.columns[name]
            if not column.categorical or column.domain is not None:
                continue  # a closed domain judges such values itself
            values = batch.column(name)
            mask = pc.fill_null(pc.is_in(pc.utf8_lower(pc.utf8_trim_whitespace(values)), value_set=tokens), False)
            what = (
                f"text value(s) that often mean missing, kept as text (only {self.spec.source.missing_values!r} are "
                "missing; "
                "list them in source.missing_values if they mean missing)"
            )
            self.problems.add(
                "missing_lookalike",
                name,
                what,
                np.asarray(mask.to_numpy(zero_copy_only=False), dtype=bool),
                values,
                self.rows,
            )

    def _where(self) -> tuple[str, int]:
        """The unit rows are counted in and the line of the first row: CSV has a header line, Parquet no lines."""
        return {"csv": ("line", 2), "jsonl": ("line", 1)}.get(self.fmt or "", ("row", 1))

    def _report_problems(self) -> Optional[FileIssue]:
        """Turn what was collected into issues: ragged rows, then every type and value problem.

        Returns the first value that does not fit its type as a fatal issue
        (the file's reason to be rejected), left out of `issues`; None when
        every value fits.
        """
        uri = self.info.uri
        first: Optional[FileIssue] = None
        if self._ragged_count:
            shown = "; ".join(self._ragged)
            lines = sorted(self._ragged_lines)[:10]
            at = f" at line(s) {', '.join(map(str, lines))}" if lines else ""
            self.issues.append(
                FileIssue(
                    kind="ragged_rows",
                    message=f"{uri}: {self._ragged_count} row(s) with the wrong number of fields{at}; e.g. {shown}",
                    fatal=False,
                    lines=lines,
                    count=self._ragged_count,
                )
            )
        unit, start = self._where()
        for p in self.problems.problems():
            lines = line_numbers(p.rows, self._ragged_lines, start)
            message = describe(p, uri, lines, unit)
            if p.kind == "type" and self.fmt == "csv":
                message += self._missing_hint(p.values)
            elif p.kind == "type" and self.fmt == "jsonl":
                message += " (in JSON lines a missing value is null; source.missing_values applies to CSV text only)"
            if p.kind == "non_finite" and self.fmt == "csv":
                message += (
                    " (CSV text 'NaN'/'inf' is the float; if 'NaN' means missing, add it to source.missing_values)"
                )
            issue = FileIssue(
                kind=p.kind, message=message, fatal=p.kind == "type", column=p.column, lines=lines, count=p.count
            )
            if p.kind == "type" and first is None:
                first = issue
            else:
                self.issues.append(issue)
        return first

    def _missing_hint(self, values: list[Any]) -> str:
        """A hint when values that do not fit look like a missing-value token the source does not list."""
        tokens = [v for v in values if isinstance(v, str) and v.strip().lower() in MISSING_LOOKALIKES]
        if not tokens:
            return ""
        return (
            f" ({', '.join(repr(t) for t in tokens)} read as text: only {self.spec.source.missing_values!r} mean "
            "missing; "
            "if these mean missing too, add them to source.missing_values)"
        )

    def _convert_options(self, types: dict[str, pa.DataType]) -> Any:
        """CSV conversion: the given column types, and exactly the source's missing-value tokens as nulls (text columns
        too)."""
        import pyarrow.csv as pacsv

        return pacsv.ConvertOptions(
            column_types=types,
            include_columns=self.columns,
            null_values=list(self.spec.source.missing_values),
            strings_can_be_null=True,
        )

    def _diagnose_csv(self) -> None:
        """Read the CSV again as text to find every value that does not fit its type, and every other problem.

        The problems are collected afresh for `_report_problems`.
        """
        import pyarrow.csv as pacsv

        self.problems = ProblemCollector(self.spec)
        self._ragged, self._ragged_count, self._ragged_lines, self.rows, self.missing = [], 0, [], 0, {}
        with self.store.open(self.info.uri, "rb") as f:
            reader = pacsv.open_csv(
                f,
                read_options=pacsv.ReadOptions(
                    block_size=self.block_bytes, encoding=self.spec.source.encoding, use_threads=False
                ),
                parse_options=pacsv.ParseOptions(invalid_row_handler=self._invalid_row),
                convert_options=self._convert_options({c: pa.string() for c in self.columns}),
            )
            for batch in reader:
                self._typed(batch)

    def _diagnose_jsonl(self) -> None:
        """Read the JSON lines again, as text, to name each value that does not fit its declared type by line and
        column.

        pyarrow's JSON reader stops at the first value whose JSON type differs from the
        column's (a string in a number column), naming a 0-based row of its block;
        here every line is parsed by Python, each value turned into the text a CSV
        cell would hold, and checked like CSV text (`_typed`), so the report names
        1-based lines, the column and the values. A line that is not JSON is itself
        the problem. Called on the error path only.
        """
        import json

        self.problems = ProblemCollector(self.spec)
        self.rows, self.missing = 0, {}
        chunk: dict[str, list[Optional[str]]] = {c: [] for c in self.columns}

        def text(value: Any) -> Optional[str]:
            if value is None:
                return None
            if isinstance(value, bool):
                return "true" if value else "false"
            return value if isinstance(value, str) else json.dumps(value)

        def flush() -> None:
            if chunk[self.columns[0]] if self.columns else False:
                self._typed(
                    pa.record_batch([pa.array(chunk[c], pa.string()) for c in self.columns], names=self.columns)
                )
                for c in self.columns:
                    chunk[c].clear()

        with self.store.open(self.info.uri, "rb") as f:
            for number, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue
                try:
                    record = json.loads(raw)
                except ValueError as e:
                    raise BadFile(
                        FileIssue(
                            kind="corrupt",
                            message=f"{self.info.uri}: line {number} is not valid JSON ({e})",
                            fatal=True,
                            lines=[number],
                        )
                    ) from e
                if not isinstance(record, dict):
                    record = {}
                for c in self.columns:
                    chunk[c].append(text(record.get(c)))
                if len(chunk[self.columns[0]]) >= 8192:
                    flush()
        flush()

    def _check_utf8(self, batch: pa.RecordBatch) -> None:
        """Raise `BadFile` naming the line (row) and the column, by name and from 1, of the first text that is not
        UTF-8."""
        for index, (name, column) in enumerate(zip(batch.schema.names, batch.columns)):
            if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
                try:
                    column.validate(full=True)
                except pa.ArrowInvalid as e:
                    bad = next((i for i in range(len(column)) if not _valid_utf8(column.slice(i, 1))), None)
                    unit, start = self._where()
                    at = f"{unit} {self.rows + bad + start}, " if bad is not None else ""
                    position = (self._header or []).index(name) + 1 if name in (self._header or []) else index + 1
                    raise BadFile(
                        FileIssue(
                            kind="encoding",
                            message=f"{self.info.uri}: {at}column {position} ({name!r}) holds text that is not valid "
                                    "UTF-8",
                            fatal=True,
                            column=name,
                            lines=[] if bad is None else [self.rows + bad + start],
                        )
                    ) from e

    def _columns(self, found: list[str]) -> list[str]:
        """Check the file's columns against the declared ones; returns the stored columns to read.

        Columns with role `ignore` may be in the file or not and are not
        read. A stored column the file lacks makes the file unusable, but the
        columns it has are still read and checked, so the rejection lists
        their problems too (`batches`).
        """
        self._header = list(found)
        stored = list(self.spec.stored_columns)
        missing = [c for c in stored if c not in found]
        extra = [c for c in dict.fromkeys(found) if c not in self.spec.columns]
        uri = self.info.uri
        repeated = {
            c: [i + 1 for i, f in enumerate(found) if f == c] for c in dict.fromkeys(found) if found.count(c) > 1
        }
        self.columns = [c for c in stored if c in found and c not in repeated]
        checked = " (the file's other columns are checked all the same; see the other issues)" if self.columns else ""
        duplicated = None
        if repeated:
            names = "; ".join(
                f"{c!r} at positions {', '.join(map(str, at[:-1]))} and {at[-1]}" for c, at in repeated.items()
            )
            duplicated = FileIssue(
                kind="columns_duplicated",
                message=f"{uri}: the file names a column more than once (positions counted from 1): {names}; which "
                        "one is meant "
                f"cannot be told, so neither is read and the file is not used: rename or drop the copies{checked}",
                fatal=True,
                column=next(iter(repeated)),
            )
        if missing and extra:
            lowered = {c.lower().strip(): c for c in extra}
            hints = [f"{lowered[m.lower()]!r} -> {m!r}" for m in missing if m.lower() in lowered]
            hint = f"; renamed? {', '.join(hints)}" if hints else ""
            self._columns_issue = FileIssue(
                kind="columns_renamed",
                message=f"{uri}: declared column(s) {missing} not found and undeclared column(s) {extra} found{hint}; "
                        f"the file has {found}{checked}",
                fatal=True,
            )
        elif missing:
            self._columns_issue = FileIssue(
                kind="columns_missing",
                message=f"{uri}: declared column(s) {missing} not found; the file has {found}{checked}",
                fatal=True,
            )
        if duplicated is not None:
            if self._columns_issue is None:
                self._columns_issue = duplicated
            else:
                self.issues.append(duplicated)
        if self._columns_issue is not None and not self.columns:
            raise BadFile(self._columns_issue)
        if extra and self._columns_issue is None:
            self.issues.append(
                FileIssue(
                    kind="columns_added",
                    message=f"{uri}: undeclared column(s) {extra} are not ingested (declare them in columns to keep "
                            "them)",
                    fatal=False,
                )
            )
        return self.columns

    def _invalid_row(self, row: Any) -> str:
        self._ragged_count += 1
        if row.number is not None and len(self._ragged_lines) < 10_000:
            self._ragged_lines.append(int(row.number))
        if len(self._ragged) < 3:
            self._ragged.append(f"expected {row.expected_columns} fields, got {row.actual_columns}: {row.text[:80]!r}")
        return "skip"

    def _csv(self) -> Iterator[pa.RecordBatch]:
        import pyarrow.csv as pacsv

        encoding = self.spec.source.encoding
        parse = pacsv.ParseOptions(invalid_row_handler=self._invalid_row)
        with self.store.open(self.info.uri, "rb") as f:
            head = pacsv.open_csv(
                f,
                read_options=pacsv.ReadOptions(block_size=min(self.block_bytes, 1 << 20), encoding=encoding),
                parse_options=pacsv.ParseOptions(invalid_row_handler=lambda row: "skip"),
            )
            found = head.schema.names
        columns = self._columns(found)
        types = {c: reading_type(self.spec.columns[c].dtype) for c in columns}
        with self.store.open(self.info.uri, "rb") as f:
            reader = pacsv.open_csv(
                f,
                # One thread: the reader then knows the line number of each ragged row.
                read_options=pacsv.ReadOptions(block_size=self.block_bytes, encoding=encoding, use_threads=False),
                parse_options=parse,
                convert_options=self._convert_options(types),
            )
            yield from reader

    def _parquet(self) -> Iterator[pa.RecordBatch]:
        import pyarrow.parquet as pq

        with self.store.open(self.info.uri, "rb") as f:
            pf = pq.ParquetFile(f)
            columns = self._columns(pf.schema_arrow.names)
            yield from pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns, use_threads=True)

    def _jsonl(self) -> Iterator[pa.RecordBatch]:
        import pyarrow.json as pajson

        with self.store.open(self.info.uri, "rb") as f:
            found = pajson.open_json(
                f, read_options=pajson.ReadOptions(block_size=min(self.block_bytes, 1 << 20))
            ).schema.names
        columns = self._columns(found)
        schema = pa.schema([pa.field(c, reading_type(self.spec.columns[c].dtype)) for c in columns])
        with self.store.open(self.info.uri, "rb") as f:
            reader = pajson.open_json(
                f,
                read_options=pajson.ReadOptions(block_size=self.block_bytes),
                parse_options=pajson.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore"),
            )
            for batch in reader:
                yield batch.select(columns)

