"""The deterministic train/val/test split by a salted hash of each row, in memory or streamed from a snapshot.

A row's part depends on the row alone, never on the other rows of the
version: its key (the values of the pipeline's `id` columns when it declares
any, else every stored column: the whole canonical row) is hashed with
`spec.split.seed` as the salt (BLAKE2b, 64 bits) to a number u in [0, 1);
the row is in test when u < test_fraction, in val when u < test_fraction +
val_fraction, else in train. So the split is **stable across versions**: when
a new delivery joins the data, every row of the earlier version keeps its
part, and a row corrected under the same id keeps it too. A test row of a
version never was a training row of an earlier one, which is what makes
re-evaluating an earlier version's champion on the new test split (promotion)
fair: the champion has not seen those rows. (A positional, shuffled split of
the union, as `train_test_split` makes, moves rows of earlier training parts
into the new test part, in favour of the incumbent.)

Part sizes and per-class proportions are the fractions in expectation, not
exactly. One deterministic fix-up keeps the old guarantee that a class with
at least three rows (a target that is a class label) reaches every part, and
that every part gets a row (at least three rows): where the hash leaves a
part without the class, the one row of the class whose u lies nearest that
part's interval moves there from the part holding most of the class
(`_every_class_everywhere`). It rarely triggers with enough rows; rows it
moves are the only ones whose part may change when the data grows.

Every stored column goes into every part: features, the target, and the `id`
and `timestamp` columns (kept for tracing predictions back, never trained on).
"""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trainyard.data.canonical import ARROW_TYPES, BATCH_ROWS, CanonicalParquetWriter, cast_values, jsonable
from trainyard.data.errors import SchemaMismatch, SplitError
from trainyard.spec import PipelineSpec
from trainyard.store import FileStore

if TYPE_CHECKING:
    import pandas as pd

PART_NAMES = ("train", "val", "test")
"""The parts, by number: 0 train, 1 val, 2 test."""

_NULL = "N"  # a missing key value; a present one is "<length>:<text>", so the two never meet


def key_columns(spec: PipelineSpec, available: Sequence[str]) -> list[str]:
    """The columns a row's part is hashed from: the `id` columns when the pipeline declares any, else the stored
    columns.

    Raises:
        SchemaMismatch: A declared id column is not in the data.
    """
    ids = [c for c, col in spec.columns.items() if col.role == "id"]
    if ids:
        missing = [c for c in ids if c not in available]
        if missing:
            raise SchemaMismatch(
                f"id column(s) {missing} not found; the split hashes them; the data has columns {list(available)}"
            )
        return ids
    stored = [c for c in spec.stored_columns if c in available]
    return stored or list(available)


def _key_text(values: pa.Array | pa.ChunkedArray, dtype: Optional[str]) -> pa.Array:
    """Each value as `<length>:<text>` of its canonical type (nulls `N`), so equal values encode equally in memory and
    on disk."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if dtype is not None:
        target = ARROW_TYPES[dtype]
        try:
            values = cast_values(values, target)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
            pass  # not castable: hashed as it is (consistently within one data set)
    if pa.types.is_dictionary(values.type):
        values = values.cast(values.type.value_type)
    text = values.cast(pa.string())
    tagged = pc.binary_join_element_wise(pc.utf8_length(text).cast(pa.string()), text, ":")
    return pc.fill_null(tagged, _NULL)


def split_hashes(table: pa.Table | pa.RecordBatch, columns: Sequence[str], spec: PipelineSpec) -> np.ndarray:
    """u in [0, 1) per row (float64): BLAKE2b-64 of the row's key values, keyed with `spec.split.seed`.

    Rows are hashed independently of one another, so any batching gives the same values.
    """
    parts = [_key_text(table.column(c), spec.columns[c].dtype if c in spec.columns else None) for c in columns]
    keys = parts[0] if len(parts) == 1 else pc.binary_join_element_wise(*parts, "|")
    salt = f"trainyard.split:{spec.split.seed}".encode()
    digests = b"".join(
        hashlib.blake2b(k.encode(), digest_size=8, key=salt).digest() for k in keys.to_numpy(zero_copy_only=False)
    )
    h = np.frombuffer(digests, dtype=">u8").astype(np.uint64)
    return (h >> np.uint64(11)).astype(np.float64) * 2.0**-53


def parts_of(u: np.ndarray, spec: PipelineSpec) -> np.ndarray:
    """The part of each hash value: 2 test below test_fraction, 1 val below test_fraction + val_fraction, else 0 train
    (int8)."""
    t, v = spec.split.test_fraction, spec.split.val_fraction
    parts = np.zeros(len(u), dtype=np.int8)
    parts[u < t + v] = 1
    parts[u < t] = 2
    return parts


def _intervals(spec: PipelineSpec) -> list[tuple[float, float]]:
    t, v = spec.split.test_fraction, spec.split.val_fraction
    return [(t + v, 1.0), (t, t + v), (0.0, t)]  # train, val, test


class _Classes:
    """Class codes of the target, numbered in order of first appearance, batch by batch."""

    def __init__(self) -> None:
        self.values: list[Any] = []
        self._code: dict[Any, int] = {}

    def codes(self, labels: pa.Array | pa.ChunkedArray) -> np.ndarray:
        if isinstance(labels, pa.ChunkedArray):
            labels = labels.combine_chunks()
        if pa.types.is_dictionary(labels.type):
            labels = labels.cast(labels.type.value_type)
        encoded = pc.dictionary_encode(labels, null_encoding="encode")
        local = np.array(
            [self._code.setdefault(v, len(self._code)) for v in encoded.dictionary.to_pylist()], dtype=np.int64
        )
        self.values = list(self._code)
        return local[encoded.indices.to_numpy(zero_copy_only=False)] if len(local) else np.zeros(0, dtype=np.int64)


def _every_class_everywhere(parts: np.ndarray, u: np.ndarray, codes: np.ndarray, spec: PipelineSpec) -> int:
    """Give every class with at least three rows a row in each part, in place, moving as few rows as possible.

    For each part a class misses, the row of the class whose u lies nearest
    that part's interval (ties: the earliest row) moves there from the part
    holding most of the class. Rows are never exchanged, so the moved rows
    are the only ones not where their hash puts them. Returns the rows moved.
    """
    if not len(codes):
        return 0
    n_classes = int(codes.max()) + 1
    counts = np.bincount(codes * 3 + parts, minlength=3 * n_classes).reshape(n_classes, 3)
    lacking = np.flatnonzero((counts.sum(axis=1) >= 3) & (counts == 0).any(axis=1))
    intervals = _intervals(spec)
    moved = 0
    for cls in lacking:
        for part in range(3):
            if counts[cls, part]:
                continue
            donor = int(np.argmax(counts[cls]))
            rows = np.flatnonzero((codes == cls) & (parts == donor))
            lo, hi = intervals[part]
            near = np.where(u[rows] < lo, lo - u[rows], u[rows] - hi)
            row = rows[np.lexsort((rows, near))[0]]
            parts[row] = part
            counts[cls, donor] -= 1
            counts[cls, part] += 1
            moved += 1
    return moved


def _assign(u: np.ndarray, codes: np.ndarray, classes: Optional[_Classes], spec: PipelineSpec) -> np.ndarray:
    """The parts of all rows from their hashes and class codes (all zero when not stratified), with the fix-up.

    Raises:
        SplitError: Too few rows for a row in every part, or a class too rare to reach every part.
    """
    n = len(u)
    fractions = spec.split
    how = f"stratified on {spec.target!r}" if classes is not None else "at random"
    asked = f"val_fraction={fractions.val_fraction}, test_fraction={fractions.test_fraction}"
    if n < 3:
        raise SplitError(
            f"cannot split {n} rows {how} with {asked}: train, val and test each need at least one row, so at least 3 "
            "rows"
        )
    if classes is not None:
        freq = np.bincount(codes, minlength=len(classes.values))
        if (freq < 3).any():
            counts = dict(zip(jsonable(classes.values), freq.tolist()))
            try:
                counts = dict(sorted(counts.items()))
            except TypeError:
                pass
            rare = [v for v, c in counts.items() if c < 3]
            raise SplitError(
                f"cannot split {n} rows {how} with {asked}: class(es) {rare} have fewer than 3 rows, "
                f"too few to reach each of train, val and test; rows per class: {counts}"
            )
    parts = parts_of(u, spec)
    _every_class_everywhere(parts, u, codes, spec)
    return parts


def _stratify(spec: PipelineSpec) -> bool:
    declared = spec.columns[spec.target]
    return declared.dtype in ("int", "str", "bool", "category") or declared.domain is not None


def shuffle_positions(labels: Optional[np.ndarray], n: int, spec: PipelineSpec) -> np.ndarray:
    """The parts of `SplitSpec(method="shuffle")`: the split of versions validated before the hash split (0 train, 1
    val, 2 test).

    The test share is taken first, then the validation share of the rest, both
    shuffled with `spec.split.seed` and stratified on `labels` when given:
    exactly the split those versions were trained on, kept so that they can be
    reproduced. A row's part depends on every other row of the version.

    Raises:
        SplitError: The rows cannot be split as asked.
    """
    from sklearn.model_selection import train_test_split

    fractions = spec.split
    positions = np.arange(n)
    try:
        rest, test = train_test_split(
            positions, test_size=fractions.test_fraction, random_state=fractions.seed, shuffle=True, stratify=labels
        )
        train, val = train_test_split(
            rest,
            test_size=fractions.val_fraction / (1.0 - fractions.test_fraction),
            random_state=fractions.seed,
            shuffle=True,
            stratify=labels[rest] if labels is not None else None,
        )
    except ValueError as e:
        how = f"stratified on {spec.target!r}" if labels is not None else "at random"
        counts = ""
        if labels is not None:
            values, freq = np.unique(labels, return_counts=True)
            counts = f"; rows per class: {dict(zip(jsonable(values.tolist()), freq.tolist()))}"
        raise SplitError(
            f"cannot split {n} rows {how} with val_fraction={fractions.val_fraction}, "
            f"test_fraction={fractions.test_fraction}: {e}{counts}"
        ) from e
    parts = np.zeros(n, dtype=np.int8)
    parts[val] = 1
    parts[test] = 2
    return parts


def _stratify_shuffled(spec: PipelineSpec) -> bool:
    """The shuffled split stratified on int, str and bool targets and declared domains (not `category`, which came
    later)."""
    declared = spec.columns[spec.target]
    return declared.dtype in ("int", "str", "bool") or declared.domain is not None


def split_table(table: pa.Table | pa.RecordBatch, spec: PipelineSpec) -> np.ndarray:
    """Which part each row of `table` goes to: 0 train, 1 val, 2 test (int8); see the module docstring.

    Raises:
        SplitError: The rows cannot be split as asked.
    """
    if spec.split.method == "shuffle":
        labels = table.column(spec.target).to_numpy(zero_copy_only=False) if _stratify_shuffled(spec) else None
        return shuffle_positions(labels, table.num_rows, spec)
    names = table.column_names if isinstance(table, pa.Table) else table.schema.names
    u = split_hashes(table, key_columns(spec, names), spec)
    classes = _Classes() if _stratify(spec) else None
    codes = classes.codes(table.column(spec.target)) if classes is not None else np.zeros(len(u), dtype=np.int64)
    return _assign(u, codes, classes, spec)


def split(df: pd.DataFrame, spec: PipelineSpec) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Deterministic train/val/test split by a salted hash of each row's id (or whole row), stable across versions.

    Each row's part is fixed by its key alone (module docstring), so rows
    keep their parts when the data grows; part sizes and, when the target is
    a class label (dtype int, str, bool or category, or a declared domain),
    class proportions are the fractions in expectation, and every class with
    at least three rows reaches every part. Each part keeps the input's row
    order and gets a fresh index. `split_snapshot` gives the same rows the
    same parts.

    Returns:
        (train, val, test).

    Raises:
        SplitError: The rows cannot be split as asked: fewer than three rows,
            or a class with fewer than three rows (it cannot appear in every part).
    """
    target = spec.target
    if target not in df.columns:
        raise SchemaMismatch(f"target column {target!r} not found; the data has columns {list(df.columns)}")
    columns = key_columns(spec, list(df.columns))
    wanted = list(dict.fromkeys(columns + [target]))
    table = pa.Table.from_pandas(df[wanted], preserve_index=False)
    parts = split_table(table, spec)
    return tuple(df.iloc[np.flatnonzero(parts == k)].reset_index(drop=True) for k in range(3))


def split_snapshot(
    store: FileStore, uri: str, spec: PipelineSpec, out_dir: str, batch_rows: int = BATCH_ROWS
) -> dict[str, int]:
    """Write the split of a Parquet snapshot to `out_dir/{train,val,test}.parquet` in canonical form.

    Two passes over record batches of `batch_rows`: the first reads the key
    columns and the target and keeps a hash (8 bytes), a class code (8) and a
    part (1) per row; the second streams the rows to the three writers,
    keeping their order. The parts are those `split` gives the same rows.

    Returns:
        Rows per part.
    """
    import pyarrow.parquet as pq

    with store.open(uri, "rb") as f:
        pf = pq.ParquetFile(f)
        schema = pf.schema_arrow.remove_metadata()
        if spec.target not in schema.names:
            raise SchemaMismatch(f"target column {spec.target!r} not found; the data has columns {schema.names}")
        if spec.split.method == "shuffle":
            labels = pf.read(columns=[spec.target]).column(0).to_numpy() if _stratify_shuffled(spec) else None
            parts = shuffle_positions(labels, pf.metadata.num_rows, spec)
            del labels
            return _write_parts(pf, schema, parts, out_dir, batch_rows)
        columns = key_columns(spec, schema.names)
        classes = _Classes() if _stratify(spec) else None
        hashes, codes = [], []
        for batch in pf.iter_batches(
            batch_size=batch_rows, columns=list(dict.fromkeys(columns + [spec.target])), use_threads=True
        ):
            hashes.append(split_hashes(batch, columns, spec))
            if classes is not None:
                codes.append(classes.codes(batch.column(spec.target)))
        u = np.concatenate(hashes) if hashes else np.zeros(0)
        del hashes
        code = np.concatenate(codes) if codes else np.zeros(len(u), dtype=np.int64)
        del codes
        parts = _assign(u, code, classes, spec)
        del u, code
        return _write_parts(pf, schema, parts, out_dir, batch_rows)


def _write_parts(pf: Any, schema: pa.Schema, parts: np.ndarray, out_dir: str, batch_rows: int) -> dict[str, int]:
    """Stream the rows of Parquet file `pf` to `out_dir/{train,val,test}.parquet` by `parts`, keeping their order."""
    writers = [CanonicalParquetWriter(os.path.join(out_dir, f"{name}.parquet"), schema) for name in PART_NAMES]
    try:
        offset = 0
        for batch in pf.iter_batches(batch_size=batch_rows, use_threads=True):
            batch = batch.replace_schema_metadata(None)
            which = parts[offset : offset + batch.num_rows]
            for k, writer in enumerate(writers):
                writer.write(batch.filter(pa.array(which == k)))
            offset += batch.num_rows
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
    for writer in writers:
        writer.close()
    return {name: w.rows for name, w in zip(PART_NAMES, writers)}
