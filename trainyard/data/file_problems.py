"""Every problem of one landing file at once, by column name and line number.

A bad file used to be reported one problem per run: the first value that did
not fit its type stopped the read, ragged rows came to light on the next
run, values outside a range or domain only in validation after that.
`ProblemCollector` gathers them all in one pass instead -- values that do not
fit the declared type, missing values, values outside `min`/`max` or the
`domain`, NaN and infinities -- each with the column's name, how many, the
first `LINES_SHOWN` line numbers and a few of the values.

Line numbers are 1-based as in the file: for CSV the header is line 1 and
rows skipped as ragged are counted, for JSON lines the first record is line
1; Parquet has no lines, so Parquet rows are numbered from 1. Blank lines,
which the CSV reader skips, are not counted.

The value checks mirror the suite built from `columns`; a pipeline with its
own suite file (`PipelineSpec.suite`) gets only the type checks here, and its
suite judges the values in validation.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trainyard.data.canonical import cast_values
from trainyard.spec import ColumnSpec, PipelineSpec

LINES_SHOWN = 10
"""Line numbers kept and shown per problem (the count is always complete)."""

VALUES_SHOWN = 3
"""Offending values shown per problem."""

VALUE_KINDS = ("nulls", "range", "domain", "non_finite", "missing_lookalike")
"""Problems of values that parse: validation judges them too, so alone they do not reject a file at ingest.

`missing_lookalike` (text such as `n/a` kept as text in a CSV text column
without a domain, because `SourceSpec.missing_values` does not list it) is a
warning only."""


@dataclasses.dataclass
class Problem:
    """One kind of problem in one column: how many, where (row indices, 0-based among parsed rows) and examples."""

    kind: str
    column: Optional[str]
    what: str
    count: int = 0
    rows: list[int] = dataclasses.field(default_factory=list)
    values: list[Any] = dataclasses.field(default_factory=list)


def line_numbers(rows: Sequence[int], skipped_lines: Sequence[int], first_line: int) -> list[int]:
    """File line numbers of parsed rows.

    Args:
        rows: 0-based indices among the rows parsed.
        skipped_lines: 1-based lines the reader skipped (ragged rows), any order.
        first_line: The line of the first row when nothing is skipped (2 after a CSV header).
    """
    skipped = sorted(skipped_lines)
    out = []
    for r in rows:
        line = r + first_line
        for s in skipped:
            if s <= line:
                line += 1
        out.append(line)
    return out


class ProblemCollector:
    """Collects the problems of one file batch by batch; `problems()` lists them with line numbers."""

    def __init__(self, spec: PipelineSpec) -> None:
        self.spec = spec
        self._problems: dict[tuple[str, Optional[str]], Problem] = {}

    def add(self, kind: str, column: Optional[str], what: str, mask: np.ndarray, values: pa.Array, offset: int) -> None:
        """Record the rows of a batch where `mask` is True; `offset` is the index of the batch's first row."""
        where = np.flatnonzero(mask)
        if not len(where):
            return
        problem = self._problems.setdefault((kind, column), Problem(kind, column, what))
        problem.count += len(where)
        room = LINES_SHOWN - len(problem.rows)
        if room > 0:
            problem.rows += [offset + int(i) for i in where[:room]]
        if len(problem.values) < VALUES_SHOWN:
            for v in values.take(pa.array(where[: VALUES_SHOWN * 4])).to_pylist():
                if v not in problem.values and len(problem.values) < VALUES_SHOWN:
                    problem.values.append(v)

    def check_types(
        self, batch: pa.RecordBatch, types: dict[str, pa.DataType], offset: int
    ) -> tuple[pa.RecordBatch, dict[str, np.ndarray]]:
        """Cast text columns to their declared types, recording the cells that do not fit; those become null.

        Returns:
            The cast batch, and per column the mask of cells that did not fit.
        """
        arrays, masks = [], {}
        for name in batch.schema.names:
            text = batch.column(name)
            target = types[name]
            try:
                arrays.append(cast_values(text, target))  # the usual case: every value fits
                continue
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
                pass
            bad = _uncastable_mask(text, target)
            masks[name] = bad
            if bad.any():
                what = f"value(s) that are not {self.spec.columns[name].dtype!r}"
                self.add("type", name, what, bad, text, offset)
                text = pc.if_else(pa.array(bad), pa.nulls(len(text), text.type), text)
            arrays.append(cast_values(text, target))
        return pa.RecordBatch.from_arrays(arrays, names=batch.schema.names), masks

    def has_type_problems(self) -> bool:
        """Whether a value that does not fit its type was found."""
        return any(kind == "type" for kind, _ in self._problems)

    def check_values(self, batch: pa.RecordBatch, offset: int, ignore: Optional[dict[str, np.ndarray]] = None) -> None:
        """Record missing values, values out of range or domain, and non-finite floats (the `columns` suite's rules)."""
        if self.spec.suite is not None:
            return
        for name, column in self.spec.columns.items():
            if name not in batch.schema.names:
                continue
            values = batch.column(name)
            skip = (ignore or {}).get(name)
            for kind, what, test in _value_rules(column):
                mask = np.asarray(test(values).to_numpy(zero_copy_only=False), dtype=bool)
                if skip is not None:
                    mask &= ~skip
                self.add(kind, name, what, mask, values, offset)

    def problems(self) -> list[Problem]:
        """Every problem found, by kind then column order."""
        order = {c: i for i, c in enumerate(self.spec.columns)}
        kinds = {k: i for i, k in enumerate(("type", *VALUE_KINDS))}
        return sorted(self._problems.values(), key=lambda p: (kinds.get(p.kind, 99), order.get(p.column or "", -1)))


def _value_rules(column: ColumnSpec) -> list[tuple[str, str, Callable[[pa.Array], pa.Array]]]:
    """(kind, description, mask function) for each rule a column declares."""
    rules: list[tuple[str, str, Callable[[pa.Array], pa.Array]]] = []
    floating = column.dtype == "float"
    if not column.nullable:
        rules.append(("nulls", "missing value(s) in a column that is not nullable", lambda a: pc.is_null(a)))
    if column.min is not None and column.dtype in ("int", "float"):
        low = column.min
        rules.append(("range", f"value(s) below min {low}", lambda a: pc.fill_null(pc.less(a, low), False)))
    if column.max is not None and column.dtype in ("int", "float"):
        high = column.max
        rules.append(("range", f"value(s) above max {high}", lambda a: pc.fill_null(pc.greater(a, high), False)))
    if column.domain is not None:
        domain = pa.array(column.domain).cast(pa.string()) if column.categorical else None
        allowed = column.domain

        def outside(a: pa.Array) -> pa.Array:
            value_set = domain if domain is not None else pa.array(allowed).cast(a.type)
            return pc.and_(pc.invert(pc.is_in(a, value_set=value_set)), pc.is_valid(a))

        rules.append(("domain", f"value(s) outside the domain {allowed}", outside))
    if floating and column.finite:
        rules.append(
            (
                "non_finite",
                "NaN or infinite value(s)",
                lambda a: pc.fill_null(pc.or_(pc.is_nan(a), pc.is_inf(a)), False),
            )
        )
    return rules


def _uncastable_mask(text: pa.Array, target: pa.DataType) -> np.ndarray:
    """Which non-null cells of a text column do not cast to `target`."""
    try:
        cast_values(text, target)
        return np.zeros(len(text), dtype=bool)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        pass
    unique = pc.unique(text).drop_null()
    bad = []
    for i in range(len(unique)):
        try:
            cast_values(unique.slice(i, 1), target)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
            bad.append(unique[i].as_py())
    mask = pc.is_in(text, value_set=pa.array(bad, type=text.type))
    return np.asarray(pc.fill_null(mask, False).to_numpy(zero_copy_only=False), dtype=bool)


def describe(problem: Problem, uri: str, lines: list[int], unit: str) -> str:
    """One line naming the column, the count, the first lines and a few values."""
    where = f"column {problem.column!r}: " if problem.column else ""
    shown = ", ".join(str(n) for n in lines)
    more = f" (first {len(lines)} of {problem.count})" if problem.count > len(lines) else ""
    values = f"; e.g. {', '.join(repr(v) for v in problem.values)}" if problem.values else ""
    return f"{uri}: {where}{problem.count} {problem.what} at {unit}(s) {shown}{more}{values}"
