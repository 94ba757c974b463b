"""LightGBM trials (`task="gbt"`) on scikit-learn's bundled tables, run through the entrypoint in-process."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from training import entrypoint
from training.spec import LAUNCH_ID_ENV, DataSpec, ImportTarget, TrainResult, TrainSpec

FAST = {"num_threads": 1, "num_leaves": 7, "min_child_samples": 5}  # one thread: tiny data on a shared machine


def _frame(kind: str) -> tuple[pd.DataFrame, str]:
    from sklearn import datasets

    if kind == "binary":
        frame = datasets.load_breast_cancer(as_frame=True).frame
    elif kind == "multiclass":
        frame = datasets.load_wine(as_frame=True).frame
    else:
        frame = datasets.load_diabetes(as_frame=True).frame
        frame["target"] = frame["target"].astype("float64")
    frame.columns = [c.replace(" ", "_").replace("/", "_") for c in frame.columns]
    return frame.sample(frac=1.0, random_state=0).reset_index(drop=True), "target"


def write_data(directory: Path, kind: str) -> DataSpec:
    """Write a 70/15/15 train/val/test split of the `kind` table ("binary", "multiclass", "regression") as Parquet."""
    frame, target = _frame(kind)
    directory.mkdir(parents=True, exist_ok=True)
    n = len(frame)
    parts = {
        "train": frame.iloc[: int(n * 0.7)],
        "val": frame.iloc[int(n * 0.7) : int(n * 0.85)],
        "test": frame.iloc[int(n * 0.85) :],
    }
    for name, part in parts.items():
        pq.write_table(pa.Table.from_pandas(part, preserve_index=False), directory / f"{name}.parquet")
    return DataSpec(
        train_uri=str(directory / "train.parquet"),
        val_uri=str(directory / "val.parquet"),
        test_uri=str(directory / "test.parquet"),
        features=[c for c in frame.columns if c != target],
        target=target,
        version="0" * 32,
    )


def make_spec(tmp: Path, kind: str = "binary", out: str = "run", **over: Any) -> TrainSpec:
    """A LightGBM trial on the `kind` table writing to `tmp/<out>`; the spec is written to `tmp/<out>.json`.

    Args:
        tmp: Directory for the data, the run output and the spec file.
        kind: "binary", "multiclass" or "regression"; also picks the monitored metric.
        out: Name of the run folder and of the spec file.
        **over: `TrainSpec` fields that replace the defaults.
    """
    monitor = {"binary": ("val_acc", "max"), "multiclass": ("val_logloss", "min"), "regression": ("val_rmse", "min")}[
        kind
    ]
    base: dict[str, Any] = dict(
        pipeline="tabular/test",
        trial_id="trial-0000",
        task="gbt",
        model=ImportTarget(path="lightgbm:train", kwargs=dict(FAST)),
        data=write_data(tmp / f"data-{kind}", kind),
        output_uri=str(tmp / out),
        max_epochs=60,
        monitor=monitor[0],
        monitor_mode=monitor[1],
    )
    base.update(over)
    spec = TrainSpec(**base)
    (tmp / f"{out}.json").write_text(spec.to_json())
    return spec


def run(tmp: Path, out: str = "run", launch: str = "launch-1") -> int:
    """Run the entrypoint on `tmp/<out>.json` as launch `launch`; returns its exit code."""
    os.environ[LAUNCH_ID_ENV] = launch  # one id per launch, as launchers set it; names the attempt record
    try:
        return entrypoint.main(["--spec", str(tmp / f"{out}.json")])
    finally:
        del os.environ[LAUNCH_ID_ENV]


def result(tmp: Path, out: str = "run") -> TrainResult:
    """The `result.json` the run in `tmp/<out>` wrote."""
    return TrainResult.model_validate_json((tmp / out / "result.json").read_text())
