"""The split by a salted hash of each row: stable across versions, by id, rare classes everywhere, any batching.

A row's part depends on its key (the id columns, else the whole stored row)
and the seed alone, so a second delivery never moves a row of the first
version's training part into the new test part (which would favour the
champion when promotion re-evaluates it on the new test split).
"""

from __future__ import annotations

import datetime as dt

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainyard import data as dq
from trainyard.spec import ColumnSpec, ModelSpec, PipelineSpec, SourceSpec, SplitSpec

NAMES = ("train", "val", "test")


def customers_spec(**over) -> PipelineSpec:
    fields = dict(
        team="churn",
        name="customers",
        source=SourceSpec(prefix="landing"),
        columns={
            "customer_id": ColumnSpec(dtype="str", role="id"),
            "tenure": ColumnSpec(dtype="int", min=0),
            "charges": ColumnSpec(dtype="float", nullable=True),
            "churned": ColumnSpec(dtype="str", domain=["no", "yes"]),
        },
        target="churned",
        min_rows=1,
        split=SplitSpec(val_fraction=0.15, test_fraction=0.15, seed=3),
        model=ModelSpec(task="gbt"),
    )
    fields.update(over)
    return PipelineSpec(**fields)


def customers(n: int, start: int = 0, positives: float = 0.05, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed + start)
    ids = np.arange(start, start + n)
    churned = np.where(ids % int(round(1 / positives)) == 0, "yes", "no")
    return pd.DataFrame(
        {
            "customer_id": [f"C{i:06d}" for i in ids],
            "tenure": rng.integers(0, 72, n),
            "charges": rng.normal(60, 20, n).round(2),
            "churned": churned,
        }
    )


def no_ids(spec: PipelineSpec) -> PipelineSpec:
    """The same pipeline without an id role: the whole stored row is hashed."""
    columns = {
        c: col.model_copy(update={"role": "feature"}) if col.role == "id" else col for c, col in spec.columns.items()
    }
    return spec.model_copy(update={"columns": columns})


def part_of(df: pd.DataFrame, spec: PipelineSpec, key: str = "customer_id") -> dict[str, str]:
    return {k: name for name, part in zip(NAMES, dq.split(df, spec)) for k in part[key]}


def assert_sizes_near(sizes, n, split, sigmas=4.0):
    for size, fraction in zip(
        sizes, (1 - split.val_fraction - split.test_fraction, split.val_fraction, split.test_fraction)
    ):
        assert abs(size - n * fraction) <= sigmas * np.sqrt(n * fraction * (1 - fraction)), (sizes, n, split)


@pytest.mark.parametrize("hashed", ["id", "whole row"])
def test_every_row_of_a_version_keeps_its_part_when_rows_arrive(hashed):
    spec = customers_spec() if hashed == "id" else no_ids(customers_spec())
    first = customers(2000)
    second = pd.concat([first, customers(1500, start=2000)], ignore_index=True).sample(frac=1.0, random_state=1)
    before, after = part_of(first, spec), part_of(second, spec)
    assert all(after[k] == part for k, part in before.items())
    # the promotion comparison is fair: no row the first version trained on is in the second's test part
    assert not {k for k, p in before.items() if p == "train"} & {k for k, p in after.items() if p == "test"}


def test_a_corrected_row_keeps_its_part_under_its_id():
    spec = customers_spec()
    data = customers(1000)
    corrected = data.assign(tenure=data["tenure"] + 1, charges=data["charges"] * 2)
    corrected.loc[::7, "churned"] = "yes"  # relabelled rows too
    assert part_of(data, spec) == part_of(corrected, spec)
    # without ids a corrected row is a different row: it may move (that is what the whole-row key means)
    assert part_of(data, no_ids(spec)) != part_of(corrected, no_ids(spec))


@pytest.mark.parametrize("n", [4000, 60])
def test_a_rare_class_reaches_every_part(n):
    spec = customers_spec()
    data = customers(n, positives=0.05)  # 200 positives of 4000; 3 of 60
    parts = dq.split(data, spec)
    for part in parts:
        assert (part["churned"] == "yes").any()
    if n == 4000:
        for part in parts:  # in about its overall share
            assert abs((part["churned"] == "yes").mean() - 0.05) <= 4 * np.sqrt(0.05 * 0.95 / len(part))


def test_a_class_of_three_rows_gets_one_row_per_part_moving_as_few_rows_as_possible():
    spec = customers_spec()
    data = customers(300, positives=0.5).assign(churned="no")
    data.loc[[10, 150, 299], "churned"] = "yes"
    table = pa.Table.from_pandas(data, preserve_index=False)
    parts = dq.split_table(table, spec)
    yes = (data["churned"] == "yes").to_numpy()
    assert sorted(parts[yes].tolist()) == [0, 1, 2]
    from trainyard.data.splitting import parts_of, split_hashes

    hashed = parts_of(split_hashes(table, ["customer_id"], spec), spec)
    assert (parts != hashed).sum() <= 2 and ((parts != hashed) <= yes).all()
    assert dq.split_table(table, spec).tolist() == parts.tolist()  # the fix-up is deterministic


def test_a_class_too_rare_for_every_part_or_too_few_rows_are_named():
    spec = customers_spec()
    data = customers(100).assign(churned="no")
    data.loc[5, "churned"] = "yes"
    with pytest.raises(
        dq.SplitError, match=r"class\(es\) \['yes'\] have fewer than 3 rows.*rows per class: \{'no': 99, 'yes': 1\}"
    ):
        dq.split(data, spec)
    with pytest.raises(dq.SplitError, match=r"cannot split 2 rows .*at least 3 rows"):
        dq.split(customers(2, positives=0.5), spec)
    with pytest.raises(dq.SchemaMismatch, match="id column"):
        dq.split(data.drop(columns=["customer_id"]), spec)


def test_fractions_are_honoured_approximately():
    spec = customers_spec(split=SplitSpec(val_fraction=0.1, test_fraction=0.25, seed=11))
    data = customers(20000)
    sizes = [len(p) for p in dq.split(data, spec)]
    assert_sizes_near(sizes, 20000, spec.split)
    other = customers_spec(split=SplitSpec(val_fraction=0.1, test_fraction=0.25, seed=12))
    assert part_of(data, spec) != part_of(data, other)  # the seed is the salt


def typed_spec() -> PipelineSpec:
    return PipelineSpec(
        team="t",
        name="typed",
        source=SourceSpec(prefix="landing"),
        columns={
            "day": ColumnSpec(dtype="date"),
            "at": ColumnSpec(dtype="datetime", role="timestamp"),
            "plan": ColumnSpec(dtype="category", nullable=True),
            "count": ColumnSpec(dtype="int", nullable=True),
            "x": ColumnSpec(dtype="float", nullable=True),
            "flag": ColumnSpec(dtype="bool"),
            "label": ColumnSpec(dtype="str", domain=["a", "b", "c"]),
        },
        target="label",
        min_rows=1,
        split=SplitSpec(val_fraction=0.2, test_fraction=0.2, seed=5),
        model=ModelSpec(task="gbt"),
    )


def typed_table(n: int) -> pa.Table:
    rng = np.random.default_rng(4)
    i = np.arange(n)
    label = np.where(i % 2 == 0, "a", "b")
    label[[2, 500, n - 1]] = "c"  # three rows, in different batches: the fix-up moves one (asserted below)
    start = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
    return dq.to_canonical(
        pa.table(
            {
                "day": pa.array([dt.date(2023, 1, 1) + dt.timedelta(days=int(d)) for d in i % 400], pa.date32()),
                "at": pa.array([start + dt.timedelta(minutes=int(m)) for m in i * 7], pa.timestamp("us", tz="UTC")),
                "plan": pa.array([None if k % 11 == 0 else ["basic", "pro"][k % 2] for k in i], pa.string()),
                "count": pa.array([None if k % 13 == 0 else int(k % 9) for k in i], pa.int64()),
                "x": pa.array(
                    [None if k % 17 == 0 else float(v) for k, v in zip(i, rng.normal(size=n).round(3))], pa.float64()
                ),
                "flag": pa.array(i % 3 == 0),
                "label": pa.array(label.tolist(), pa.string()),
            }
        ),
        typed_spec(),
    )


def test_the_streamed_split_is_the_in_memory_one_whatever_the_batch_size(store, tmp_path):
    spec = typed_spec()
    table = typed_table(1500)
    dq.write_parquet_deterministic(table, store.uri("snap.parquet"))
    in_memory = dq.split(
        pq.read_table(store.uri("snap.parquet")).to_pandas(), spec
    )  # ints with nulls come back as floats
    from trainyard.data.splitting import key_columns, parts_of, split_hashes

    hashed = parts_of(split_hashes(table, key_columns(spec, table.column_names), spec), spec)
    assert (dq.split_table(table, spec) != hashed).sum() == 1
    assert [len(p) for p in in_memory] == np.bincount(dq.split_table(table, spec), minlength=3).tolist()
    for batch_rows in (7, 100, 4096):
        out = tmp_path / f"out{batch_rows}"
        counts = dq.split_snapshot(store, store.uri("snap.parquet"), spec, str(out), batch_rows=batch_rows)
        assert counts == {name: len(part) for name, part in zip(NAMES, in_memory)}
        for name, expected in zip(NAMES, in_memory):
            got = pq.read_table(out / f"{name}.parquet").to_pandas()
            pd.testing.assert_frame_equal(got, expected)
        assert (out / "test.parquet").read_bytes() == (tmp_path / "out7" / "test.parquet").read_bytes()
    for part in in_memory:
        assert set(part["label"]) == {"a", "b", "c"}


def test_the_shuffled_split_of_earlier_versions_is_kept_with_their_fingerprint() -> None:
    """Versions validated before the hash split were split by a seeded stratified shuffle; `method="shuffle"` is that
    split,
    under the fingerprint those versions recorded (7c3c92a70c69: `small_spec()` before `SplitSpec.method` existed)."""
    from pipelines.reproduce import split_as_recorded
    from tests.pipelines.pipeline_fixtures import small_spec
    from trainyard.data.splitting import shuffle_positions
    from trainyard.spec import SplitSpec

    shuffled = small_spec(split=SplitSpec(method="shuffle"))
    assert shuffled.fingerprint() == "7c3c92a70c69" != small_spec().fingerprint()
    assert split_as_recorded(small_spec(), "7c3c92a70c69").split.method == "shuffle"
    assert split_as_recorded(small_spec(), small_spec().fingerprint()).split.method == "hash"
    # The parts the code before `method` (8f600ba's `split_positions`) gave these labels, printed by that code.
    parts = shuffle_positions(np.array([0, 1] * 50), 100, shuffled)
    assert np.flatnonzero(parts == 2).tolist() == [0, 1, 6, 11, 18, 35, 38, 42, 73, 77, 78, 81, 94, 98, 99]
    assert np.flatnonzero(parts == 1).tolist() == [9, 17, 24, 26, 27, 28, 36, 45, 48, 56, 57, 70, 83, 90, 93, 97]
