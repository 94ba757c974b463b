"""The tabular team's breast-cancer classifier: LightGBM (binary) on scikit-learn's bundled Wisconsin data.

569 biopsies, 30 non-negative measurements each (mean, standard error and worst
value of ten nucleus features); target `benign` is 1 for benign, 0 for malignant.
A 4-trial sweep over tree size, learning rate and leaf size, early stopping on
validation log-loss; promotion on test accuracy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainyard import ColumnSpec, FloatParam, IntParam, ModelSpec, PipelineSpec, SearchSpec, SourceSpec

if TYPE_CHECKING:
    import pandas as pd

MEASURES = [
    "radius",
    "texture",
    "perimeter",
    "area",
    "smoothness",
    "compactness",
    "concavity",
    "concave_points",
    "symmetry",
    "fractal_dimension",
]
FEATURES = [f"mean_{m}" for m in MEASURES] + [f"{m}_error" for m in MEASURES] + [f"worst_{m}" for m in MEASURES]
TARGET = "benign"

breast_cancer = PipelineSpec(
    team="tabular",
    name="breast_cancer",
    description="Breast-cancer diagnosis from 30 nucleus measurements, a LightGBM binary classifier.",
    source=SourceSpec(prefix="landing/tabular/breast_cancer", pattern="*.csv"),
    columns={**{f: ColumnSpec(dtype="float", min=0) for f in FEATURES}, TARGET: ColumnSpec(dtype="int", domain=[0, 1])},
    target=TARGET,
    min_rows=400,
    model=ModelSpec(
        task="gbt",
        hparams={"objective": "binary", "early_stopping_rounds": 30},
        max_epochs=300,
        monitor="val_logloss",
        monitor_mode="min",
    ),
    search=SearchSpec(
        params={
            "num_leaves": IntParam(low=4, high=32),
            "learning_rate": FloatParam(low=0.02, high=0.3, log=True),
            "min_child_samples": IntParam(low=5, high=40),
        },
        n_trials=4,
    ),
)


def landing_frame() -> "pd.DataFrame":
    """scikit-learn's bundled breast-cancer data as this pipeline's landing columns (for demos, tests, benchmarks)."""
    from sklearn.datasets import load_breast_cancer

    frame = load_breast_cancer(as_frame=True).frame
    frame.columns = [c.replace(" ", "_") for c in frame.columns[:-1]] + [TARGET]
    if list(frame.columns[:-1]) != FEATURES:
        raise RuntimeError(f"scikit-learn's breast-cancer columns changed: {list(frame.columns[:-1])}")
    return frame
