"""A small `TrainSpec` for the digits Lightning model on real Parquet splits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.digits import features, write_splits
from training.spec import DataSpec, ImportTarget, TrainSpec


def make_spec(tmp: Path, **over: Any) -> TrainSpec:
    """Write 300 digits rows as splits under `tmp/data` and a spec training on them to `tmp/spec.json`.

    Args:
        tmp: Directory for the data, the run output (`tmp/run`) and the spec file.
        **over: `TrainSpec` fields that replace the defaults.

    Returns:
        The spec, as written to `tmp/spec.json`.
    """
    paths = write_splits(str(tmp / "data"), n=300)
    base: dict[str, Any] = dict(
        pipeline="vision/digits",
        trial_id="trial-0000",
        model=ImportTarget(path="pipelines.vision.models:DigitsMLP", kwargs={"hidden": 16, "lr": 0.02}),
        data=DataSpec(
            train_uri=paths["train"],
            val_uri=paths["val"],
            test_uri=paths["test"],
            features=features(),
            target="label",
            version="0" * 32,
        ),
        output_uri=str(tmp / "run"),
        max_epochs=2,
        batch_size=32,
    )
    base.update(over)
    spec = TrainSpec(**base)
    (tmp / "spec.json").write_text(spec.to_json())
    return spec
