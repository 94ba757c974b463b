"""Platform overhead: training throughput through trainyard vs a bare Lightning script.

Same model (DigitsMLP, hidden 64), same data (all 1797 digits, same split),
same process count (2, DDP over gloo), same epochs and batch size. The two are
run alternately in one session, and the median of each is compared, so machine
noise hits both alike. Value: platform samples/s; baseline: bare samples/s.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.harness import write_result

ROOT = Path(__file__).resolve().parent.parent
EPOCHS, BATCH, REPEATS = 30, 32, 3


def _splits(directory: Path) -> list[str]:
    sys.path.insert(0, str(ROOT))
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.digits import digits_frame

    df = digits_frame()
    n = len(df)
    cuts = {"train": df.iloc[: int(n * 0.7)], "val": df.iloc[int(n * 0.7) : int(n * 0.85)], "test": df.iloc[int(n * 0.85) :]}
    for name, part in cuts.items():
        pq.write_table(pa.Table.from_pandas(part, preserve_index=False), directory / f"{name}.parquet")
    return [c for c in df.columns if c != "label"]


def bare(data: Path, out: Path) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(ROOT / "bench" / "bare_lightning.py"),
           str(data), str(EPOCHS), str(BATCH), str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    return json.loads(out.read_text())["samples_per_second"]


def platform(data: Path, features: list[str], out: Path) -> float:
    from resources.launcher import LocalLauncher
    from training.spec import DataSpec, Distribution, ImportTarget, TrackerSpec, TrainSpec

    spec = TrainSpec(
        pipeline="bench/overhead",
        trial_id="trial-0000",
        model=ImportTarget(path="pipelines.vision.models:DigitsMLP", kwargs={"hidden": 64, "lr": 0.01}),
        data=DataSpec(train_uri=str(data / "train.parquet"), val_uri=str(data / "val.parquet"), test_uri=str(data / "test.parquet"),
                      features=features, target="label", version="bench"),
        output_uri=str(out),
        max_epochs=EPOCHS,
        batch_size=BATCH,
        distribution=Distribution(procs_per_node=2),
        tracker=TrackerSpec(kind="wandb", mode="offline", project="bench", name="overhead", dir=str(out / "wandb")),
    )
    return LocalLauncher().launch(spec).result.samples_per_second


def main() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        features = _splits(tmp_path)
        bare_runs, platform_runs = [], []
        for i in range(REPEATS):
            bare_runs.append(bare(tmp_path, tmp_path / f"bare-{i}.json"))
            platform_runs.append(platform(tmp_path, features, tmp_path / f"platform-{i}"))
    value, baseline = statistics.median(platform_runs), statistics.median(bare_runs)
    return write_result(
        "platform_overhead",
        value,
        "samples/s",
        baseline,
        {"platform_runs": platform_runs, "bare_runs": bare_runs, "epochs": EPOCHS, "batch_size": BATCH, "processes": 2,
         "target": "ratio >= 0.95", "note": "platform run includes checkpointing, W&B offline logging and Pipes-ready reporting"},
    )


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
