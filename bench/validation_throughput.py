"""Rows per second ingesting and validating 10M rows, against a bare pyarrow read plus the same checks.

Data (generated here, seeded): 10 landing Parquet files of 1M rows, columns
f0..f2 (float, declared ranges), cat (text, 4-value domain), n (int, 50-value
domain), label (int, {0, 1}); a few planted bad values (out of range, unknown
category) and duplicate rows, so every check has something to find.

Platform, in this process (Great Expectations imported beforehand, as in a
running Dagster code server): `trainyard.data.ingest.ingest` (read the landing files,
cast, write parts, write the canonical zstd Parquet snapshot, md5) then
`trainyard.data.validate_snapshot` (the pipeline's GE suite of 26
expectations through `ArrowSuite`, 3 finite checks and the duplicate-row
check, the profile, Data Docs, and reading back the failing rows).

Baseline: `pq.read_table` of each landing file and the same checks written
directly with `pyarrow.compute` -- row count, columns and types, nulls, NaN
and +-inf, ranges, domains -- and duplicate rows through the same 64-bit row
hash and pandas' hash table, all in memory.

Each side runs twice, alternating, on a fresh store; each side reports the
median of its runs. Value: platform rows/s; baseline: bare rows/s; ratio =
platform / bare (higher is better), target >= 0.3. Both sides must find the
same bad values in every run. The DVC pin of the snapshot (what
`raw_data` adds) is timed once and reported, not counted in the rate.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import Target, write_result

ROOT = Path(__file__).resolve().parent.parent
ROWS = 10_000_000
FILES = 10
REPEATS = 2
FLOAT_RANGES = {"f0": (-10.0, 10.0), "f1": (0.0, 100.0), "f2": (0.0, None)}
CATS = ["a", "b", "c", "d"]


def _spec(landing: Path) -> Any:
    from trainyard.spec import ColumnSpec, ModelSpec, PipelineSpec, SourceSpec

    return PipelineSpec(
        team="bench",
        name="throughput",
        source=SourceSpec(prefix=str(landing), pattern="*.parquet", format="parquet"),
        columns={
            **{c: ColumnSpec(dtype="float", min=lo, max=hi) for c, (lo, hi) in FLOAT_RANGES.items()},
            "cat": ColumnSpec(dtype="str", domain=CATS),
            "n": ColumnSpec(dtype="int", domain=list(range(50))),
            "label": ColumnSpec(dtype="int", domain=[0, 1]),
        },
        target="label",
        min_rows=1,
        model=ModelSpec(path="pipelines.vision.models:DigitsMLP"),
    )


def generate(landing: Path) -> dict[str, int]:
    """Write the landing files; returns the planted problems."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    landing.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    per = ROWS // FILES
    for i in range(FILES):
        f1 = rng.uniform(0, 100, per)
        cat = np.array(CATS, dtype=object)[rng.integers(0, 4, per)]
        f0 = rng.normal(0, 1, per)
        f2 = rng.exponential(1, per)
        n = rng.integers(0, 50, per)
        label = rng.integers(0, 2, per)
        if i == 3:
            f1[[10, 500_000, 999_999]] = 150.0
            cat[[7, 8]] = "zz"
            for src, dst in ((1, 2), (100, 200), (300, 400)):  # exact copies of earlier rows
                f0[dst], f1[dst], f2[dst], cat[dst], n[dst], label[dst] = (
                    f0[src],
                    f1[src],
                    f2[src],
                    cat[src],
                    n[src],
                    label[src],
                )
        table = pa.table({"f0": f0, "f1": f1, "f2": f2, "cat": pa.array(cat, type=pa.string()), "n": n, "label": label})
        pq.write_table(table, landing / f"part-{i:03d}.parquet", row_group_size=128 * 1024)
    return {"out_of_range": 3, "unknown_category": 2, "duplicates": 3}


def platform(work: Path, spec: Any) -> tuple[float, dict[str, int], str, Any]:
    from resources.storage import ObjectStore
    from trainyard import data as dq
    from trainyard.data import ingest

    store_dir = work / "store"
    shutil.rmtree(store_dir, ignore_errors=True)
    store = ObjectStore(root=str(store_dir))
    started = time.perf_counter()
    snap = ingest.ingest(store, spec).snapshot
    ingested = time.perf_counter()
    report = dq.validate_snapshot(store, snap.uri, spec, run_name=snap.md5).report
    seconds = time.perf_counter() - started
    found = {
        "out_of_range": sum(
            r["unexpected_count"] or 0
            for r in report.failures()
            if r["expectation"] == "expect_column_values_to_be_between"
        ),
        "unknown_category": sum(
            r["unexpected_count"] or 0
            for r in report.failures()
            if r["expectation"] == "expect_column_values_to_be_in_set"
        ),
        # Found whether they fail the data (`duplicates="reject"`) or pass to be dropped (the default, `keep_first`).
        "duplicates": sum(
            r["unexpected_count"] or 0 for r in report.results if r["expectation"] == dq.UNIQUE_ROWS_EXPECTATION
        ),
        "rows": report.rows,
        "expectations": report.evaluated,
        "ingest_seconds": ingested - started,
    }
    return seconds, found, snap.uri, store


def baseline(landing: Path) -> tuple[float, dict[str, int]]:
    import numpy as np
    import pandas as pd
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from trainyard.data import row_hashes

    expected_schema = pa.schema(
        [
            *(pa.field(c, pa.float64()) for c in FLOAT_RANGES),
            ("cat", pa.string()),
            ("n", pa.int64()),
            ("label", pa.int64()),
        ]
    )
    domains = {"cat": pa.array(CATS), "n": pa.array(range(50)), "label": pa.array([0, 1])}
    started = time.perf_counter()
    rows = out_of_range = unknown = bad = 0
    hashes = []
    for path in sorted(landing.glob("*.parquet")):
        table = pq.read_table(path)
        if table.schema.remove_metadata() != expected_schema:
            bad += 1
        rows += table.num_rows
        for column, (lo, hi) in FLOAT_RANGES.items():
            col = table[column]
            bad += col.null_count + pc.sum(pc.is_nan(col)).as_py() + pc.sum(pc.is_inf(col)).as_py()
            outside = pc.less(col, lo)
            if hi is not None:
                outside = pc.or_(outside, pc.greater(col, hi))
            out_of_range += pc.sum(outside).as_py()
        for column, domain in domains.items():
            col = table[column]
            bad += col.null_count
            unknown += pc.sum(pc.invert(pc.is_in(col, value_set=domain))).as_py()
        hashes += [row_hashes(b) for b in table.to_batches()]
    duplicates = int(pd.Series(np.concatenate(hashes)).duplicated().sum())
    seconds = time.perf_counter() - started
    return seconds, {
        "out_of_range": out_of_range,
        "unknown_category": unknown,
        "duplicates": duplicates,
        "rows": rows,
        "other": bad,
    }


def main() -> dict:
    sys.path.insert(0, str(ROOT))
    from trainyard.data.expectations import great_expectations

    great_expectations()  # a running code server has imported it already
    with tempfile.TemporaryDirectory(prefix="trainyard-bench-validate-") as tmp:
        work = Path(tmp)
        spec = _spec(work / "landing")
        t0 = time.perf_counter()
        planted = generate(work / "landing")
        generate_s = time.perf_counter() - t0
        ours, bare = [], []
        for _ in range(REPEATS):
            seconds, found, snapshot, store = platform(work, spec)
            ours.append((seconds, found))
            seconds_b, found_b = baseline(work / "landing")
            bare.append((seconds_b, found_b))
        for (_, found), (_, found_b) in zip(ours, bare):
            for key, count in planted.items():
                if found[key] != count or found_b[key] != count:
                    raise RuntimeError(
                        f"{key}: planted {count}, platform found {found[key]}, baseline found {found_b[key]}"
                    )
            if found["rows"] != ROWS or found_b["rows"] != ROWS or found_b["other"]:
                raise RuntimeError(f"row counts or other checks disagree: platform {found}, baseline {found_b}")
        from resources.versioning import DataVersioning

        versioning = DataVersioning(repo_dir=str(work / "dvc"), remote_url=str(work / "remote"))
        t1 = time.perf_counter()
        versioning.pin(snapshot)
        pin_s = time.perf_counter() - t1
        snapshot_bytes = os.path.getsize(snapshot)
    rates, rates_b = [ROWS / s for s, _ in ours], [ROWS / s for s, _ in bare]
    return write_result(
        "validation_throughput",
        statistics.median(rates),
        "rows/s",
        statistics.median(rates_b),
        {
            "rows": ROWS,
            "columns": 6,
            "landing_files": FILES,
            "expectations_and_checks": found["expectations"],
            "platform_seconds": [round(s, 2) for s, _ in ours],
            "platform_ingest_seconds": [round(f["ingest_seconds"], 2) for _, f in ours],
            "baseline_seconds": [round(s, 2) for s, _ in bare],
            "planted_and_found": planted,
            "snapshot_mib": round(snapshot_bytes / 2**20, 1),
            "dvc_pin_seconds_not_counted": round(pin_s, 1),
            "generate_seconds": round(generate_s, 1),
            "note": f"median of {REPEATS} alternating runs per side; GE imported before timing; DVC pin timed "
                    "separately",
        },
        targets=[Target("ratio", ">=", 0.3)],
        better="higher",
        runs=rates,
        baseline_runs=rates_b,
    )


if __name__ == "__main__":
    import json

    print(json.dumps(main(), indent=2))
