"""The profile of a snapshot (per-column statistics and a seeded sample), and a suite drafted from it."""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trainyard.data.canonical import BATCH_ROWS, jsonable
from trainyard.data.suite import GX_TYPE_NAMES
from trainyard.store import FileStore

PROFILE_SAMPLE_ROWS = 20_000
"""Rows kept (seeded, uniform) in a profile's sample, from which numeric drift is measured."""

PROFILE_DOMAIN_LIMIT = 50
"""A column with at most this many distinct values gets them listed in its profile (and a generated suite)."""

CATEGORY_LIMIT = 1000
"""Most categories whose counts a profile keeps; past that, categorical drift of the column is not measured."""


class Profiler:
    """Per-column statistics of a snapshot, gathered while it streams by.

    For each column: rows, nulls (null or NaN), NaN and +-inf counts, finite
    min and max (dates and times as ISO text), the distinct values when there
    are at most `PROFILE_DOMAIN_LIMIT`, and category counts (up to
    `CATEGORY_LIMIT`) for text, bool, int, date and time columns. A seeded uniform sample of about
    `PROFILE_SAMPLE_ROWS` rows (all rows of smaller data) is kept for numeric
    drift; the same rows in the same order always give the same sample.
    """

    def __init__(self, schema: pa.Schema, total_rows: int, seed: int = 0) -> None:
        self.schema = schema
        self.total = total_rows
        self.seed = seed
        self.rows = 0
        self.batches = 0
        self.stats: dict[str, dict[str, Any]] = {
            f.name: {"type": str(f.type), "nulls": 0, "nan": 0, "posinf": 0, "neginf": 0, "min": None, "max": None}
            for f in schema
        }
        self._distinct: dict[str, Optional[set]] = {f.name: set() for f in schema if not pa.types.is_floating(f.type)}
        self._counts: dict[str, Optional[dict]] = {f.name: {} for f in schema if not pa.types.is_floating(f.type)}
        self._sample: list[pa.RecordBatch] = []

    def update(self, batch: pa.RecordBatch) -> None:
        """Add one batch to the statistics and the sample."""
        for f in self.schema:
            col = batch.column(f.name)
            st = self.stats[f.name]
            floating = pa.types.is_floating(f.type)
            st["nulls"] += (pc.sum(pc.is_null(col, nan_is_null=True)).as_py() or 0) if floating else col.null_count
            present = col.drop_null()
            if floating:
                nan = pc.is_nan(present)
                inf = pc.is_inf(present)
                st["nan"] += pc.sum(nan).as_py() or 0
                st["posinf"] += pc.sum(pc.equal(present, math.inf)).as_py() or 0
                st["neginf"] += pc.sum(pc.equal(present, -math.inf)).as_py() or 0
                present = pc.filter(present, pc.invert(pc.or_(nan, inf)))
            if len(present):
                bounds = pc.min_max(present)
                lo, hi = bounds["min"].as_py(), bounds["max"].as_py()
                st["min"] = lo if st["min"] is None else min(st["min"], lo)
                st["max"] = hi if st["max"] is None else max(st["max"], hi)
            counts = self._counts.get(f.name)
            if counts is not None and len(present):
                vc = pc.value_counts(present)
                for value, n in zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist()):
                    counts[value] = counts.get(value, 0) + n
                if len(counts) > CATEGORY_LIMIT:
                    self._counts[f.name] = None
        share = min(1.0, PROFILE_SAMPLE_ROWS / max(1, self.total))
        if share >= 1.0:
            self._sample.append(batch)
        else:
            rng = np.random.default_rng([self.seed, self.batches])
            keep = rng.random(batch.num_rows) < share
            self._sample.append(batch.filter(pa.array(keep)))
        self.rows += batch.num_rows
        self.batches += 1

    def profile(self) -> dict[str, Any]:
        """The profile: `rows` and per column its statistics, `counts` and `distinct` (None past their limits)."""
        columns = {}
        for f in self.schema:
            st = dict(self.stats[f.name])
            counts = self._counts.get(f.name)
            if counts is not None:
                st["counts"] = sorted(
                    ([jsonable(k), v] for k, v in counts.items()), key=lambda kv: (-kv[1], str(kv[0]))
                )
                st["distinct"] = sorted(jsonable(k) for k in counts) if len(counts) <= PROFILE_DOMAIN_LIMIT else None
            else:
                st["counts"] = None
                st["distinct"] = None
            st["min"], st["max"] = jsonable(st["min"]), jsonable(st["max"])
            columns[f.name] = st
        return {"rows": self.rows, "columns": columns}

    def sample(self) -> pa.Table:
        """The sampled rows, in snapshot order."""
        return pa.Table.from_batches(self._sample, schema=self.schema) if self._sample else self.schema.empty_table()


def profile_to_suite(
    profile: dict[str, Any], name: str, *, row_margin: float = 0.5, range_margin: float = 0.0
) -> dict[str, Any]:
    """A Great Expectations suite describing a trusted snapshot's profile, to be reviewed and edited.

    Expectations: the row count within `row_margin` (a share) of the
    profiled count, the exact ordered columns; per column its type, not null
    (when it had no nulls), its observed range widened by `range_margin` of
    its width (numeric columns), and its set of values (when it had at most
    `PROFILE_DOMAIN_LIMIT` distinct ones and is text, bool or int).

    Args:
        profile: A profile from `profile_snapshot` or `validate_snapshot`.
        name: The suite's name (e.g. the pipeline key).
        row_margin: Allowed relative change of the row count (0.5: half to 1.5 times).
        range_margin: Share of each range's width added on both sides.

    Returns:
        The suite as GE 1.x JSON: `{"name", "expectations": [{"type", "kwargs", "meta"}], "meta"}`.
    """
    rows = profile["rows"]
    expectations: list[dict[str, Any]] = [
        {
            "type": "expect_table_row_count_to_be_between",
            "kwargs": {
                "min_value": max(1, math.floor(rows * (1 - row_margin))),
                "max_value": math.ceil(rows * (1 + row_margin)),
            },
        },
        {"type": "expect_table_columns_to_match_ordered_list", "kwargs": {"column_list": list(profile["columns"])}},
    ]
    kinds = {
        "int64": "int", "double": "float", "string": "str", "large_string": "str", "bool": "bool",
        "date32[day]": "date", "timestamp[us, tz=UTC]": "datetime",
    }
    for column, st in profile["columns"].items():
        kind = kinds.get(st["type"])
        if kind is not None:
            expectations.append(
                {
                    "type": "expect_column_values_to_be_in_type_list",
                    "kwargs": {"column": column, "type_list": GX_TYPE_NAMES[kind]},
                }
            )
        if st["nulls"] == 0:
            expectations.append({"type": "expect_column_values_to_not_be_null", "kwargs": {"column": column}})
        if kind in ("int", "float") and st["min"] is not None and st["max"] is not None:
            pad = (st["max"] - st["min"]) * range_margin
            low, high = st["min"] - pad, st["max"] + pad
            if kind == "int":
                low, high = math.floor(low), math.ceil(high)
            expectations.append(
                {
                    "type": "expect_column_values_to_be_between",
                    "kwargs": {"column": column, "min_value": low, "max_value": high},
                }
            )
        if kind in ("int", "str", "bool") and st.get("distinct") is not None:
            expectations.append(
                {"type": "expect_column_values_to_be_in_set", "kwargs": {"column": column, "value_set": st["distinct"]}}
            )
    for e in expectations:
        e["meta"] = {"generated_from": "profile"}
    return {"name": name, "expectations": expectations, "meta": {"profiled_rows": rows}}


def profile_snapshot(store: FileStore, uri: str, batch_rows: int = BATCH_ROWS) -> tuple[dict[str, Any], pa.Table]:
    """The profile and sample of a Parquet snapshot (one streaming pass, no suite)."""
    import pyarrow.parquet as pq

    with store.open(uri, "rb") as f:
        pf = pq.ParquetFile(f)
        profiler = Profiler(pf.schema_arrow.remove_metadata(), pf.metadata.num_rows)
        for batch in pf.iter_batches(batch_size=batch_rows, use_threads=True):
            profiler.update(batch)
    return profiler.profile(), profiler.sample()
