"""The deterministic, stratified train/val/test split, in memory or streamed from a snapshot.

Every stored column goes into every part: features, the target, and the `id`
and `timestamp` columns (kept for tracing predictions back, never trained on).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Optional

import numpy as np
import pyarrow as pa

from trainyard.data.canonical import BATCH_ROWS, CanonicalParquetWriter, jsonable
from trainyard.data.errors import SchemaMismatch, SplitError
from trainyard.spec import PipelineSpec
from trainyard.store import FileStore

if TYPE_CHECKING:
    import pandas as pd


def split_positions(labels: Optional[np.ndarray], n: int, spec: PipelineSpec) -> np.ndarray:
    """Which part each of `n` rows goes to: 0 train, 1 val, 2 test (int8).

    The test share is taken first, then the validation share of the rest,
    both with `spec.split.seed`, stratified on `labels` when given. A rare
    class (5 % positives, say) gets rows in every part whenever it has at
    least three: where proportional rounding would leave a part without
    it, one of its rows moves there from the largest part holding it, in
    exchange for a row of the most common class (`_every_class_everywhere`),
    so the part sizes stay as asked.

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
    if labels is not None:
        _every_class_everywhere(parts, labels, fractions.seed)
    return parts


def _every_class_everywhere(parts: np.ndarray, labels: np.ndarray, seed: int) -> None:
    """Give every class with at least three rows a row in each part, in place, keeping the part sizes.

    A part missing a class takes one of its rows from the part holding most
    of them and gives back a row of the most common class it holds (chosen
    with `seed`). Splits where every class already reaches every part are
    left exactly as they were.
    """
    values, codes, counts = np.unique(labels, return_inverse=True, return_counts=True)
    if len(values) < 2:
        return
    rng = np.random.default_rng(seed)
    for cls in np.argsort(counts, kind="stable"):
        if counts[cls] < 3:
            continue
        for part in range(3):
            mine = (codes == cls)
            if (parts[mine] == part).any():
                continue
            holders = np.bincount(parts[mine], minlength=3)
            donor = int(np.argmax(holders))
            if holders[donor] < 2:
                continue
            give = rng.choice(np.flatnonzero(mine & (parts == donor)))
            others = (parts == part) & ~mine
            if not others.any():
                continue
            common = np.bincount(codes[others], minlength=len(values))
            common[cls] = -1
            back = rng.choice(np.flatnonzero(others & (codes == int(np.argmax(common)))))
            parts[give], parts[back] = part, donor


def _stratify(spec: PipelineSpec) -> bool:
    declared = spec.columns[spec.target]
    return declared.dtype in ("int", "str", "bool", "category") or declared.domain is not None


def split(df: pd.DataFrame, spec: PipelineSpec) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Deterministic train/val/test split, stratified on the target when it is a class label.

    The target is stratified on when its dtype is int, str, bool or category or it
    declares a domain; a float target without a domain is split at random
    (see `split_positions`). Each part keeps the input's row order and gets a
    fresh index, so the same input always gives the same rows in the same order.

    Returns:
        (train, val, test).

    Raises:
        SplitError: The rows cannot be split as asked, e.g. a class has too
            few rows to appear in every part.
    """
    target = spec.target
    if target not in df.columns:
        raise SchemaMismatch(f"target column {target!r} not found; the data has columns {list(df.columns)}")
    labels = df[target].to_numpy() if _stratify(spec) else None
    parts = split_positions(labels, len(df), spec)
    return tuple(df.iloc[np.flatnonzero(parts == k)].reset_index(drop=True) for k in range(3))


def split_snapshot(store: FileStore, uri: str, spec: PipelineSpec, out_dir: str, batch_rows: int = BATCH_ROWS) -> dict[str, int]:
    """Write the split of a Parquet snapshot to `out_dir/{train,val,test}.parquet` in canonical form.

    Only the target column is read whole (to stratify); rows then stream to
    the three writers, keeping their order.

    Returns:
        Rows per part.
    """
    import pyarrow.parquet as pq

    with store.open(uri, "rb") as f:
        pf = pq.ParquetFile(f)
        n = pf.metadata.num_rows
        schema = pf.schema_arrow.remove_metadata()
        if spec.target not in schema.names:
            raise SchemaMismatch(f"target column {spec.target!r} not found; the data has columns {schema.names}")
        labels = pf.read(columns=[spec.target]).column(0).to_numpy() if _stratify(spec) else None
        parts = split_positions(labels, n, spec)
        del labels
        names = ("train", "val", "test")
        writers = [CanonicalParquetWriter(os.path.join(out_dir, f"{name}.parquet"), schema) for name in names]
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
    return {name: w.rows for name, w in zip(names, writers)}
