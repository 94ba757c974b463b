"""Peak memory of ingesting a dataset three times larger than a memory cap.

Landing data: CSV files whose rows take `3 x CAP` bytes in Arrow's in-memory
form (the size pandas or `pq.read_table` would need just to hold them). A
child process runs what `raw_data` runs -- `trainyard.data.ingest.ingest`: stream
every file into canonical parts, write the snapshot as Parquet one row group
at a time, pin it with DVC and push it to a local remote -- and reports its
peak resident set size (`VmHWM`, see `bench.harness.peak_rss_bytes`); DVC runs in
its own processes. To show the peak does not follow the data size, the same is
first run on a third of the files (1 x CAP). Value: the ingesting process's
peak RSS in MiB on the whole dataset; baseline: the cap. Passing means
value < baseline (ratio < 1).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import Target, peak_rss_bytes, write_result

ROOT = Path(__file__).resolve().parent.parent
CAP_MIB = 512
FACTOR = 3
FILES = 6
FLOATS, INTS = 6, 2
BYTES_PER_ROW = 8 * (FLOATS + INTS)  # Arrow: 8 bytes per float64 / int64 value, no nulls


def _spec_kwargs(landing: str, pattern: str = "*.csv") -> dict:
    return {
        "team": "bench",
        "name": "memory",
        "source": {"prefix": landing, "pattern": pattern},
        "columns": {
            **{f"f{i}": {"dtype": "float", "min": -1000, "max": 1000} for i in range(FLOATS)},
            "n": {"dtype": "int"},
            "label": {"dtype": "int", "domain": [0, 1]},
        },
        "target": "label",
        "min_rows": 1,
        "model": {"path": "pipelines.vision.models:DigitsMLP"},
    }


def generate(landing: Path, rows: int) -> int:
    """Write `rows` rows as FILES CSV files, a million rows at a time; returns bytes written."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.csv as pacsv

    landing.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    per_file = -(-rows // FILES)
    written = 0
    for f in range(FILES):
        n_file = min(per_file, rows - f * per_file)
        path = landing / f"part-{f:02d}.csv"
        with pacsv.CSVWriter(
            str(path),
            pa.schema(
                [*(pa.field(f"f{i}", pa.float64()) for i in range(FLOATS)), ("n", pa.int64()), ("label", pa.int64())]
            ),
        ) as w:
            for start in range(0, n_file, 1_000_000):
                k = min(1_000_000, n_file - start)
                cols = [np.round(rng.normal(0, 100, k), 3) for _ in range(FLOATS)]
                w.write_table(
                    pa.table(
                        {
                            **{f"f{i}": c for i, c in enumerate(cols)},
                            "n": rng.integers(0, 1_000_000, k),
                            "label": rng.integers(0, 2, k),
                        }
                    )
                )
        written += path.stat().st_size
    return written


def child(work: str, pattern: str) -> None:
    """Runs in the measured process: ingest with a DVC pin, then print the peak RSS as JSON."""
    sys.path.insert(0, str(ROOT))
    from resources.storage import ObjectStore
    from resources.versioning import DataVersioning
    from trainyard.data import ingest
    from trainyard.spec import PipelineSpec

    spec = PipelineSpec(**_spec_kwargs(os.path.join(work, "landing"), pattern))
    run = "run-all" if pattern == "*.csv" else "run-third"
    store = ObjectStore(root=os.path.join(work, run, "store"))
    versioning = DataVersioning(repo_dir=os.path.join(work, run, "dvc"), remote_url=os.path.join(work, run, "remote"))
    started = time.perf_counter()
    result = ingest.ingest(store, spec, versioning)
    seconds = time.perf_counter() - started
    print(
        json.dumps(
            {
                "peak_rss_mib": peak_rss_bytes() / 2**20,
                # DVC's processes (ru_maxrss: an upper bound, each starts at this process's peak so far)
                "dvc_children_peak_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
                "rows": result.snapshot.rows,
                "snapshot_bytes": os.path.getsize(result.snapshot.uri),
                "seconds": seconds,
                "md5": result.snapshot.md5,
            }
        )
    )


def _measure(work: str, pattern: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.ingest_memory", "--child", work, pattern],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"ingest child failed with exit code {proc.returncode}:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> dict:
    cap = CAP_MIB * 1024 * 1024
    rows = FACTOR * cap // BYTES_PER_ROW + 1
    with tempfile.TemporaryDirectory(prefix="trainyard-bench-mem-") as work:
        t0 = time.perf_counter()
        csv_bytes = generate(Path(work) / "landing", rows)
        generate_s = time.perf_counter() - t0
        third = _measure(work, f"part-0[0-{FILES // FACTOR - 1}].csv")
        shutil.rmtree(os.path.join(work, "run-third"))  # its parts and snapshot: keep the disk footprint down
        measured = _measure(work, "*.csv")
    if measured["rows"] != rows:
        raise RuntimeError(f"ingested {measured['rows']} rows, expected {rows}")
    return write_result(
        "ingest_memory",
        round(measured["peak_rss_mib"], 1),
        "MiB peak RSS",
        float(CAP_MIB),
        {
            "cap_mib": CAP_MIB,
            "under_cap": measured["peak_rss_mib"] < CAP_MIB,
            "dataset_arrow_mib": round(rows * BYTES_PER_ROW / 2**20, 1),
            "dataset_over_cap": round(rows * BYTES_PER_ROW / cap, 2),
            "rows": rows,
            "columns": FLOATS + INTS,
            "landing_files": FILES,
            "landing_csv_mib": round(csv_bytes / 2**20, 1),
            "snapshot_parquet_mib": round(measured["snapshot_bytes"] / 2**20, 1),
            "ingest_seconds": round(measured["seconds"], 1),
            "generate_seconds": round(generate_s, 1),
            "peak_rss_mib_one_third_of_the_data": round(third["peak_rss_mib"], 1),
            "rows_one_third": third["rows"],
            "dvc_children_peak_rss_mib_upper_bound": round(measured["dvc_children_peak_rss_mib"], 1),
            "what": "trainyard.data.ingest.ingest in a fresh process: stream CSV -> Arrow parts -> canonical Parquet "
                    "snapshot -> DVC pin + push (local remote)",
        },
        targets=[Target("ratio", "<=", 1.0)],
        better="lower",
    )


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
    else:
        print(json.dumps(main(), indent=2))
