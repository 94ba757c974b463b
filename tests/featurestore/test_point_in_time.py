"""A Feast source's training set: point-in-time correct, pinned like landing data, a new version when a definition
changes.

Real Feast in its own interpreter (`.venv-feast`), real files: the example
churn repository (`featurestore.example`), where a churned account is closed
(balance and transactions 0) the day after its label. The tests share one
repository and run in file order; the last one changes a feature view's ttl.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from pipelines.commerce.churn import LANDING, REPO, churn
from tests.featurestore.support import make_example
from trainyard import naming
from trainyard.data import feast
from trainyard.store import Store

FEATURES = ["balance", "txn_count_7d", "tickets_30d"]


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("feast") / "store"
    make_example(root, customers=120)
    store = Store(root=str(root))
    return root, store, feast.feast_snapshot(store, churn)


def _joins(root: Path) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(entity rows, expected point-in-time values, naive latest values), computed here with pandas from the raw
    files."""
    events = pd.read_csv(root / LANDING / "events.csv")
    events["t"] = pd.to_datetime(events["event_timestamp"], utc=True)
    stats = pd.read_parquet(root / REPO / "data" / "customer_stats.parquet")
    stats["event_timestamp"] = pd.to_datetime(stats["event_timestamp"], utc=True)
    ttl = pd.Timedelta(days=30)
    known = []
    for row in events.itertuples():
        rows = stats[
            (stats.customer_id == row.customer_id)
            & (stats.event_timestamp <= row.t)
            & (stats.event_timestamp >= row.t - ttl)
        ]
        known.append(rows.sort_values("event_timestamp").iloc[-1][FEATURES])
    latest = stats.sort_values("event_timestamp").groupby("customer_id").last()
    naive = latest.loc[events.customer_id, FEATURES].reset_index(drop=True)
    return events, pd.DataFrame(known).reset_index(drop=True), naive


@pytest.mark.slow
def test_no_row_sees_a_feature_value_written_after_its_label(made) -> None:
    root, store, result = made
    events, expected, naive = _joins(root)
    got = pq.read_table(result.snapshot.uri).to_pandas()
    assert list(got.columns) == list(churn.columns) and len(got) == len(events) == result.snapshot.rows
    # Rows come back in the entity files' order, labels untouched.
    assert got["churned"].tolist() == events["churned"].tolist()
    pd.testing.assert_frame_equal(got[FEATURES], expected.astype(got[FEATURES].dtypes.to_dict()), check_exact=True)
    # The naive latest-value join leaks: churners' closed accounts (balance 0) show up in their own rows.
    leaked = (naive["balance"] != got["balance"])
    churners = events["churned"] == 1
    assert leaked[churners].all() and (naive.loc[churners, "balance"] == 0).all()
    assert (got.loc[churners, "balance"] > 0).all()
    assert leaked.sum() >= churners.sum() > 10


def test_snapshot_is_pinned_with_what_it_was_retrieved_from(made) -> None:
    _, store, result = made
    footer = json.loads(pq.ParquetFile(result.snapshot.uri).metadata.metadata[feast.METADATA_KEY.encode()])
    assert footer["entity_md5"] == result.entities.snapshot.md5 != result.snapshot.md5
    assert footer["features"] == [f"customer_stats:{f}" for f in FEATURES]
    assert footer["feature_service"]["name"] == "churn_features"
    assert [v["name"] for v in footer["feature_views"]] == ["customer_stats"] and footer["feature_views"][0][
        "ttl_s"
    ] == 30 * 86400
    assert footer["time_range"][0].startswith("2024-") and footer["time_range"][0] < footer["time_range"][1]
    assert (
        feast.read_lineage(store, churn, result.snapshot.md5)["feature_views"][0]["definition"]
        == footer["feature_views"][0]["definition"]
    )
    # The entity rows went through ingestion: the landing manifest knows the file.
    assert result.entities.snapshot.files == [str(Path(store.root) / LANDING / "events.csv")]


def test_unchanged_store_gives_the_same_version(made) -> None:
    _, store, first = made
    again = feast.feast_snapshot(store, churn)
    assert again.reused and again.snapshot.md5 == first.snapshot.md5


@pytest.mark.slow
def test_changing_a_feature_view_definition_makes_a_new_data_version_and_study(made) -> None:
    root, store, first = made
    make_example(root, 120, "--apply-only", "--ttl-days", "45")  # same data, a longer ttl: a different definition
    changed = feast.feast_snapshot(store, churn)
    assert changed.snapshot.md5 != first.snapshot.md5 and not changed.reused
    assert changed.lineage["feature_views"][0]["ttl_s"] == 45 * 86400
    assert changed.lineage["feature_views"][0]["definition"] != first.lineage["feature_views"][0]["definition"]
    assert naming.study_name(churn, changed.snapshot.md5) != naming.study_name(churn, first.snapshot.md5)
