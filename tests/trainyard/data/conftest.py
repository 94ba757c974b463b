"""Fixtures of the data engine's tests: a few hundred rows of scikit-learn's digits, their pipeline, a store."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from resources.storage import ObjectStore
from trainyard import data as dq
from trainyard.spec import ColumnSpec, ModelSpec, PipelineSpec, SourceSpec, SplitSpec

PIXELS = ["pixel_2_3", "pixel_3_4", "pixel_4_4", "pixel_5_2"]


def _digits_spec(**overrides: Any) -> PipelineSpec:
    fields: dict[str, Any] = dict(
        team="vision",
        name="digits",
        source=SourceSpec(prefix="landing/digits"),
        columns={
            **{p: ColumnSpec(dtype="float", min=0, max=16) for p in PIXELS},
            "source": ColumnSpec(dtype="str", domain=["scan", "tablet", "web"]),
            "checked": ColumnSpec(dtype="bool"),
            "label": ColumnSpec(dtype="int", domain=list(range(10))),
        },
        target="label",
        min_rows=50,
        max_rows=1000,
        split=SplitSpec(val_fraction=0.2, test_fraction=0.2, seed=7),
        model=ModelSpec(path="pipelines.vision.models:DigitsMLP"),
        allow_duplicate_rows=True,  # four pixels of 300 digits repeat; the duplicate check has its own tests
    )
    fields.update(overrides)
    return PipelineSpec(**fields)


@pytest.fixture
def digits_spec() -> Callable[..., PipelineSpec]:
    """The digits pipeline with fields overridden: `digits_spec(on_bad_data="warn")`."""
    return _digits_spec


@pytest.fixture(scope="module")
def digits() -> pd.DataFrame:
    """300 digits rows in canonical form, read back the way the assets read them (Parquet -> pandas)."""
    from sklearn.datasets import load_digits

    frame = load_digits(as_frame=True).frame.iloc[:300].reset_index(drop=True)
    df = pd.DataFrame({p: frame[p].astype("float64") for p in PIXELS})
    df["source"] = np.array(["scan", "tablet", "web"])[np.arange(300) % 3]
    df["checked"] = np.arange(300) % 4 == 0
    df["label"] = frame["target"].astype("int64")
    return pa.Table.from_pandas(df, preserve_index=False).to_pandas()


@pytest.fixture(scope="module")
def spec() -> PipelineSpec:
    return _digits_spec()


@pytest.fixture
def store(tmp_path) -> ObjectStore:
    return ObjectStore(root=str(tmp_path / "store"))


@pytest.fixture
def failed() -> Callable[[dq.ValidationReport], set[tuple[str, str | None]]]:
    """`failed(report)`: the (expectation, column) pairs that did not pass."""

    def pairs(report: dq.ValidationReport) -> set[tuple[str, str | None]]:
        return {(r["expectation"], r["column"]) for r in report.failures()}

    return pairs
