"""Platform checks run beside the suite: finite floats, duplicate rows and repeated ids (by 64-bit row hashes).

The checks go by Arrow type, never by guessing: only float columns are
checked for NaN and infinities; text, categories, dates and times are hashed
as what they are (text by its UTF-8 value, dates and times by their integer
value).
"""

from __future__ import annotations

import math
import os
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trainyard.data.canonical import SAMPLE_VALUES, jsonable
from trainyard.data.report import PLATFORM_CHECK
from trainyard.spec import PipelineSpec

DEDUP_MEMORY_BYTES = 64 * 1024 * 1024
"""Memory for row hashes in the duplicate check; beyond it hashes are spilled to disk in buckets."""

FINITE_EXPECTATION = "trainyard_values_are_finite"
UNIQUE_ROWS_EXPECTATION = "trainyard_rows_are_unique"
UNIQUE_IDS_EXPECTATION = "trainyard_ids_are_unique"
WARNING = "warning"
"""`severity` of a platform result that never fails the version, only warns (repeated ids)."""


def id_key_columns(spec: PipelineSpec) -> list[str]:
    """The columns that identify a row: the `id` columns and, with them, the `timestamp` columns (none without ids)."""
    ids = [c for c, col in spec.stored_columns.items() if col.role == "id"]
    return [*ids, *(c for c, col in spec.stored_columns.items() if col.role == "timestamp")] if ids else []


def warnings_of(results: Sequence[dict[str, Any]]) -> list[str]:
    """One line per warning-only platform result that found something (repeated ids)."""
    return [
        f"{r['unexpected_count']} row(s) repeat the {r['observed_value']['key']} of an earlier row (a warning; e.g. "
        f"{', '.join(map(str, r['unexpected_values']))})"
        for r in results
        if r.get("severity") == WARNING and r["unexpected_count"]
    ]


def duplicate_policy(spec: PipelineSpec) -> str:
    """What repeated rows do: `source.duplicates`, or `allow` when `allow_duplicate_rows` is set."""
    return "allow" if spec.allow_duplicate_rows else spec.source.duplicates


def dropped_duplicates(results: Sequence[dict[str, Any]]) -> int:
    """Rows the duplicate check found under `keep_first`: repeats to drop, not failures."""
    return sum(
        r["unexpected_count"] or 0
        for r in results
        if r["expectation"] == UNIQUE_ROWS_EXPECTATION and r["success"] and r["unexpected_count"]
    )


class FiniteCheck:
    """NaN and +-inf in the float columns that must be finite."""

    def __init__(self, columns: Sequence[str]) -> None:
        self.columns = list(columns)
        self.counts = {c: {"nan": 0, "+inf": 0, "-inf": 0} for c in columns}
        self.samples: dict[str, list[tuple[int, Any]]] = {c: [] for c in columns}

    @staticmethod
    def mask(col: pa.Array) -> pa.Array:
        """Which values of `col` are NaN or +-inf (never null)."""
        return pc.fill_null(pc.or_(pc.is_nan(col), pc.is_inf(col)), False)

    def update(self, batch: pa.RecordBatch, offset: int) -> None:
        """Count the batch's non-finite values; `offset` is the global position of its first row."""
        for name in self.columns:
            col = batch.column(name)
            bad = self.mask(col)
            if not pc.any(bad).as_py():
                continue
            counts = self.counts[name]
            counts["nan"] += pc.sum(pc.fill_null(pc.is_nan(col), False)).as_py() or 0
            counts["+inf"] += pc.sum(pc.fill_null(pc.equal(col, math.inf), False)).as_py() or 0
            counts["-inf"] += pc.sum(pc.fill_null(pc.equal(col, -math.inf), False)).as_py() or 0
            if len(self.samples[name]) < SAMPLE_VALUES:
                where = pc.indices_nonzero(bad).slice(0, SAMPLE_VALUES - len(self.samples[name]))
                values = pc.take(col, where).to_pylist()
                self.samples[name].extend((offset + i, v) for i, v in zip(where.to_pylist(), values))

    def results(self) -> list[dict[str, Any]]:
        """One platform result per column, in column order."""
        out = []
        for name in self.columns:
            counts = self.counts[name]
            total = sum(counts.values())
            out.append(
                platform_result(
                    FINITE_EXPECTATION,
                    name,
                    success=total == 0,
                    observed=counts,
                    unexpected=total,
                    samples=[("nan" if isinstance(v, float) and math.isnan(v) else v) for _, v in self.samples[name]],
                    positions=[p for p, _ in self.samples[name]],
                )
            )
        return out


def platform_result(
    name: str,
    column: Optional[str],
    success: bool,
    observed: Any,
    unexpected: int,
    samples: list[Any],
    positions: list[int],
) -> dict[str, Any]:
    """A platform check's result, in the shape of `ValidationReport.results`; its failing rows can be set aside."""
    return {
        "expectation": name,
        "column": column,
        "kwargs": {} if column is None else {"column": column},
        "success": success,
        "observed_value": jsonable(observed),
        "unexpected_count": unexpected,
        "unexpected_values": jsonable(samples),
        "unexpected_index_list": positions,
        "exception": None,
        "source": PLATFORM_CHECK,
        "row_level": True,
        "sample_rows": [],
    }


_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _mix(h: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, vectorised: spreads every input bit over the 64-bit hash."""
    h = h ^ (h >> np.uint64(30))
    h = h * _MIX1
    h = h ^ (h >> np.uint64(27))
    h = h * _MIX2
    return h ^ (h >> np.uint64(31))


def _column_hash(col: pa.Array) -> np.ndarray:
    """A uint64 per value; equal values (null with null, NaN with NaN, 0.0 with -0.0) hash equal."""
    import pandas as pd

    n = len(col)
    if _is_text_type(col.type):
        encoded = col.dictionary_encode()
        words = pd.util.hash_array(np.asarray(encoded.dictionary.to_pylist(), dtype=object), categorize=False)
        indices = encoded.indices.fill_null(0).to_numpy(zero_copy_only=False)
        values = words[indices] if len(words) else np.zeros(n, dtype=np.uint64)
    elif pa.types.is_floating(col.type):
        floats = col.fill_null(0.0).to_numpy(zero_copy_only=False).astype(np.float64, copy=True)
        floats[floats == 0.0] = 0.0  # -0.0 == 0.0
        floats[np.isnan(floats)] = np.nan  # one NaN bit pattern
        values = floats.view(np.uint64)
    elif pa.types.is_boolean(col.type):
        values = col.fill_null(False).to_numpy(zero_copy_only=False).astype(np.uint64)
    elif pa.types.is_integer(col.type) or pa.types.is_temporal(col.type):
        # Dates and times by their integer value (days, or units since the epoch); date32 casts to int32 only.
        ints = col.cast(pa.int32()) if pa.types.is_date32(col.type) else col
        values = ints.cast(pa.int64()).fill_null(0).to_numpy(zero_copy_only=False).view(np.uint64)
    else:  # nested and other types never appear in canonical data; hash their text form
        values = pd.util.hash_array(np.asarray([repr(v) for v in col.to_pylist()], dtype=object), categorize=False)
    if col.null_count:
        values = values ^ (pc.is_null(col).to_numpy(zero_copy_only=False).astype(np.uint64) * _NULL_TAG)
    return values


_NULL_TAG = np.uint64(0x9E3779B97F4A7C15)
_ODD = np.uint64(0xD6E8FEB86659FD93)


def row_hashes(batch: pa.RecordBatch) -> np.ndarray:
    """A 64-bit hash of every row over all columns, in column order.

    Each column's value bits are folded in by xor and multiplication with an
    odd constant (a bijection, so rows differing in one column differ in the
    running hash), then splitmix64's finaliser spreads the bits.
    """
    h = np.full(batch.num_rows, np.uint64(0x243F6A8885A308D3), dtype=np.uint64)
    for col in batch.columns:
        h ^= _column_hash(col)
        h *= _ODD
        h ^= h >> np.uint64(29)
    return _mix(h)


def _is_text_type(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


class DuplicateRows:
    """Rows equal to an earlier row, found by 64-bit row hashes in bounded memory.

    Hashes and row positions stay in memory when they fit `memory_bytes`;
    otherwise they are spilled to 2^bits bucket files on disk, partitioned
    by the hash's top bits, and each bucket is then sorted on its own. A hash
    collision between different rows (probability about rows^2 / 2^65)
    would count as a duplicate.
    """

    def __init__(self, total_rows: int, workdir: str, memory_bytes: int = DEDUP_MEMORY_BYTES) -> None:
        needed = max(1, total_rows) * 16
        self.bits = max(0, math.ceil(math.log2(needed / memory_bytes))) if needed > memory_bytes else 0
        self.workdir = workdir
        self._hashes: list[np.ndarray] = []
        self._positions: list[np.ndarray] = []
        self.count = 0
        self.positions = np.zeros(0, dtype=np.int64)
        self.samples: list[tuple[int, int]] = []  # (duplicate row, first row with the same values)

    def _bucket_path(self, b: int, kind: str) -> str:
        return os.path.join(self.workdir, f"dedup-{b:05d}.{kind}")

    def update(self, batch: pa.RecordBatch, offset: int) -> None:
        """Add the batch's row hashes; `offset` is the global position of its first row."""
        h = row_hashes(batch)
        pos = np.arange(offset, offset + batch.num_rows, dtype=np.int64)
        if not self.bits:
            self._hashes.append(h)
            self._positions.append(pos)
            return
        bucket = (h >> np.uint64(64 - self.bits)).astype(np.uint16 if self.bits <= 16 else np.int64)
        order = np.argsort(bucket, kind="stable")  # a radix sort for 16-bit keys
        bucket, h, pos = bucket[order], h[order], pos[order]
        bounds = np.searchsorted(bucket, np.arange((1 << self.bits) + 1))
        for b in np.unique(bucket):
            lo, hi = bounds[b], bounds[b + 1]
            with open(self._bucket_path(int(b), "h"), "ab") as f:
                h[lo:hi].tofile(f)
            with open(self._bucket_path(int(b), "p"), "ab") as f:
                pos[lo:hi].tofile(f)

    def _buckets(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        if not self.bits:
            if self._hashes:
                yield np.concatenate(self._hashes), np.concatenate(self._positions)
            return
        for b in range(1 << self.bits):
            hp, pp = self._bucket_path(b, "h"), self._bucket_path(b, "p")
            if os.path.exists(hp):
                yield np.fromfile(hp, dtype=np.uint64), np.fromfile(pp, dtype=np.int64)
                os.remove(hp)
                os.remove(pp)

    def finish(self) -> None:
        """Find the duplicates once every batch was added: sets `count`, `positions` and `samples`."""
        import pandas as pd

        dups: list[np.ndarray] = []
        samples: list[tuple[int, int]] = []
        for h, pos in self._buckets():
            # Within a bucket rows arrive in position order, so "first" is the earliest row.
            repeat = pd.Series(h, copy=False).duplicated(keep="first").to_numpy()
            if not repeat.any():
                continue
            dups.append(pos[repeat])
            for i in np.flatnonzero(repeat)[:SAMPLE_VALUES]:
                samples.append((int(pos[i]), int(pos[np.flatnonzero(h == h[i])[0]])))
        self._hashes, self._positions = [], []
        self.positions = np.sort(np.concatenate(dups)) if dups else np.zeros(0, dtype=np.int64)
        self.count = int(len(self.positions))
        self.samples = sorted(samples)[:SAMPLE_VALUES]

    def result(self, keep_first: bool = False) -> dict[str, Any]:
        """The platform result (after `finish`); with `keep_first` repeats pass, to be dropped, and are counted."""
        observed: dict[str, Any] = {"duplicate_rows": self.count}
        if keep_first and self.count:
            observed["policy"] = "keep_first: dropped, the first of each kept"
        return platform_result(
            UNIQUE_ROWS_EXPECTATION,
            None,
            success=self.count == 0 or keep_first,
            observed=observed,
            unexpected=self.count,
            samples=[f"row {d} repeats row {f}" for d, f in self.samples],
            positions=[d for d, _ in self.samples],
        )


class RepeatedIds:
    """Rows whose id (the `id` columns, with the `timestamp` columns when there are any) repeats an earlier row's.

    A warning, never a failure: a customer exported twice, or once per month
    without a timestamp column, is common and not wrong by itself; rows that
    repeat a whole earlier row are the duplicate check's and are not counted
    here. Bounded memory, like `DuplicateRows` (it is one, over the key columns).
    """

    def __init__(self, columns: Sequence[str], total_rows: int, workdir: str) -> None:
        self.columns = list(columns)
        os.makedirs(os.path.join(workdir, "ids"), exist_ok=True)
        self._rows = DuplicateRows(total_rows, os.path.join(workdir, "ids"))
        self.count = 0
        self.samples: list[tuple[int, int]] = []

    def update(self, batch: pa.RecordBatch, offset: int) -> None:
        """Add the batch's key hashes; `offset` is the global position of its first row."""
        self._rows.update(batch.select(self.columns), offset)

    def finish(self, whole_row_repeats: np.ndarray) -> None:
        """Count the repeats, leaving out rows that repeat a whole earlier row (positions sorted)."""
        self._rows.finish()
        repeats = np.setdiff1d(self._rows.positions, whole_row_repeats, assume_unique=True)
        self.count = int(len(repeats))
        whole = set(whole_row_repeats.tolist())
        self.samples = [(d, f) for d, f in self._rows.samples if d not in whole]

    def result(self) -> dict[str, Any]:
        """The platform result (after `finish`): always a success, with `severity` "warning"."""
        key = " + ".join(self.columns)
        samples = [f"row {d} repeats row {f}" for d, f in self.samples]
        out = platform_result(
            UNIQUE_IDS_EXPECTATION,
            None,
            success=True,
            observed={"key": key, "repeated_rows": self.count},
            unexpected=self.count,
            samples=samples,
            positions=[d for d, _ in self.samples],
        )
        out["kwargs"] = {"columns": self.columns}
        out["row_level"] = False
        out["severity"] = WARNING
        return out
