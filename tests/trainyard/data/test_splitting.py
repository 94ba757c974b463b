"""The deterministic train/val/test split by a salted hash of each row, in memory and streamed.

Stability across versions, ids, rare classes and batch sizes: test_split_stable.py.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainyard import data as dq
from trainyard.spec import ColumnSpec, SplitSpec


def assert_sizes_near(sizes, n, split, sigmas=4.0):
    """Part sizes (train, val, test) within `sigmas` binomial standard deviations of the fractions asked."""
    for size, fraction in zip(
        sizes, (1 - split.val_fraction - split.test_fraction, split.val_fraction, split.test_fraction)
    ):
        assert abs(size - n * fraction) <= sigmas * np.sqrt(n * fraction * (1 - fraction)), (sizes, n, split)


def test_split_is_deterministic_disjoint_and_stratified(digits, spec, digits_spec):
    train, val, test = dq.split(digits, spec)
    again = dq.split(digits, spec)
    for part, same in zip((train, val, test), again):
        pd.testing.assert_frame_equal(part, same)
    assert_sizes_near((len(train), len(val), len(test)), len(digits), spec.split)
    keys = [tuple(r) for part in (train, val, test) for r in part.itertuples(index=False)]
    assert sorted(keys) == sorted(tuple(r) for r in digits.itertuples(index=False))
    # stratified in expectation: every class reaches every part, in about its overall share
    overall = digits["label"].value_counts(normalize=True).sort_index()
    for part in (train, val, test):
        share = part["label"].value_counts(normalize=True).sort_index()
        assert list(share.index) == list(overall.index)
        assert (abs(share - overall) <= 4 * np.sqrt(overall * (1 - overall) / len(part))).all()
    other_seed = dq.split(digits, digits_spec(split=SplitSpec(val_fraction=0.2, test_fraction=0.2, seed=8)))
    assert not other_seed[2].equals(test)



def test_split_keeps_input_order(digits, spec):
    tagged = digits.assign(pixel_2_3=np.arange(len(digits), dtype="float64"))
    for part in dq.split(tagged, spec):
        assert part["pixel_2_3"].is_monotonic_increasing
        assert list(part.index) == list(range(len(part)))



def test_split_with_a_too_rare_class_names_the_counts(digits, spec):
    rare = pd.concat([digits[digits["label"] != 9], digits[digits["label"] == 9].head(1)], ignore_index=True)
    with pytest.raises(dq.SplitError, match=r"stratified on 'label'.*rows per class: \{0: \d+, .*9: 1\}"):
        dq.split(rare, spec)



def test_split_float_target_is_random(digits, digits_spec):
    spec = digits_spec(
        columns={"pixel_2_3": ColumnSpec(dtype="float"), "pixel_3_4": ColumnSpec(dtype="float")}, target="pixel_3_4"
    )
    train, val, test = dq.split(digits[["pixel_2_3", "pixel_3_4"]], spec)
    assert_sizes_near((len(train), len(val), len(test)), len(digits), spec.split)



def test_split_snapshot_streams_the_same_split_as_in_memory(store, digits, spec, tmp_path, monkeypatch):
    table = pa.Table.from_pandas(digits, preserve_index=False).replace_schema_metadata(None)
    dq.write_parquet_deterministic(table, store.uri("snap.parquet"))
    counts = dq.split_snapshot(store, store.uri("snap.parquet"), spec, str(tmp_path / "out"), batch_rows=50)
    in_memory = dq.split(digits, spec)
    assert counts == {name: len(part) for name, part in zip(("train", "val", "test"), in_memory)}
    for name, expected in zip(("train", "val", "test"), in_memory):
        pd.testing.assert_frame_equal(pq.read_table(tmp_path / "out" / f"{name}.parquet").to_pandas(), expected)
