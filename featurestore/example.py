"""`python -m featurestore.example`: the example team's Feast repository on local files, with generated data.

The `commerce/churn` pipeline (`pipelines/commerce/churn.py`) trains on it.
Customers have daily feature rows (`customer_stats`: balance, transactions in
the last 7 days, support tickets in the last 30 days) and labelled events (did
the customer churn?) in entity CSV files. A churned customer's account is
closed the day after the label: balance and transactions drop to 0. A join
that takes each customer's latest values therefore sees the future and
separates churners perfectly; the point-in-time join sees only what was known
at the label's time.

    python -m featurestore.example --repo DIR --landing DIR [--customers N] [--seed S] [--ttl-days D] [--apply-only]

writes `DIR/feature_store.yaml` (SQLite registry, file offline store), the
feature rows (`DIR/data/customer_stats.parquet`), the entity rows
(`LANDING/events.csv`), applies the definitions and prints one JSON line.
`--apply-only` applies the definitions again (e.g. with another ttl) and
leaves the data as it is.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import UTC, datetime, timedelta

import numpy as np
import pandas as pd
import yaml
from feast import Entity, FeatureService, FeatureView, Field, FileSource
from feast.types import Float64, Int64

from featurestore.repo import open_store

PROJECT = "commerce"
VIEW = "customer_stats"
SERVICE = "churn_features"
FEATURES = ["balance", "txn_count_7d", "tickets_30d"]
START = datetime(2024, 1, 1, tzinfo=UTC)
DAYS = 90


def write_config(repo: str) -> None:
    """`feature_store.yaml`: local provider, SQLite registry and online store, file (dask) offline store."""
    config = {
        "project": PROJECT,
        "provider": "local",
        "registry": {
            "registry_type": "sql",
            "path": f"sqlite:///{os.path.join(repo, 'data', 'registry.db')}",
            "cache_ttl_seconds": 0,
        },
        "offline_store": {"type": "dask"},
        "online_store": {"type": "sqlite", "path": os.path.join(repo, "data", "online.db")},
        "entity_key_serialization_version": 3,
    }
    with open(os.path.join(repo, "feature_store.yaml"), "w", encoding="utf-8") as f:
        yaml.safe_dump(config, f, sort_keys=True)


def generate(customers: int, seed: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(feature rows, entity rows): daily stats per customer, and one or two labelled events each."""
    rng = np.random.default_rng(seed)
    risk = rng.uniform(0, 1, customers)
    label_day = rng.integers(30, DAYS - 5, customers)
    churned = (rng.uniform(0, 1, customers) < 0.15 + 0.7 * risk).astype(int)
    stats = []
    for c in range(customers):
        balance = float(rng.uniform(500, 5000))
        for day in range(DAYS):
            balance = max(0.0, balance * (1 - 0.01 * risk[c]) + float(rng.normal(0, 20)))
            closed = churned[c] == 1 and day > label_day[c]
            stats.append({
                "customer_id": c,
                "event_timestamp": START + timedelta(days=day),
                "balance": 0.0 if closed else round(balance, 2),
                "txn_count_7d": 0 if closed else int(rng.poisson(12 * (1.2 - risk[c]))),
                "tickets_30d": 0 if closed else int(rng.poisson(4 * risk[c])),
            })
    events = [
        {
            "customer_id": c,
            "event_timestamp": START + timedelta(days=int(label_day[c]), hours=12),
            "churned": int(churned[c]),
        }
        for c in range(customers)
    ]
    # An earlier, negative event for every third customer: the same entity at two times.
    events += [
        {"customer_id": c, "event_timestamp": START + timedelta(days=int(label_day[c]) - 20, hours=6), "churned": 0}
        for c in range(0, customers, 3)
    ]
    frame = pd.DataFrame(events).sort_values(["event_timestamp", "customer_id"], kind="stable")
    frame["event_timestamp"] = frame["event_timestamp"].map(lambda t: t.strftime("%Y-%m-%dT%H:%M:%SZ"))
    return pd.DataFrame(stats), frame.reset_index(drop=True)


def definitions(repo: str, ttl_days: int) -> list:
    """The entity, the feature view over the generated file and the feature service."""
    customer = Entity(name="customer", join_keys=["customer_id"], description="a customer account")
    source = FileSource(
        name="customer_stats_file",
        path=os.path.join(repo, "data", "customer_stats.parquet"),
        timestamp_field="event_timestamp",
    )
    view = FeatureView(
        name=VIEW,
        entities=[customer],
        ttl=timedelta(days=ttl_days),
        schema=[
            Field(name="balance", dtype=Float64),
            Field(name="txn_count_7d", dtype=Int64),
            Field(name="tickets_30d", dtype=Int64),
        ],
        source=source,
        description="daily account statistics",
    )
    return [customer, view, FeatureService(name=SERVICE, features=[view])]


def main(argv: list[str] | None = None) -> int:
    """Create (or re-apply) the example repository; prints `{"repo", "landing", "entities", "feature_rows"}`."""
    parser = argparse.ArgumentParser(prog="python -m featurestore.example", description=__doc__.splitlines()[0])
    parser.add_argument("--repo", required=True)
    parser.add_argument("--landing", required=True)
    parser.add_argument("--customers", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ttl-days", type=int, default=30)
    parser.add_argument("--apply-only", action="store_true")
    args = parser.parse_args(argv)
    repo, landing = os.path.abspath(args.repo), os.path.abspath(args.landing)
    os.makedirs(os.path.join(repo, "data"), exist_ok=True)
    os.makedirs(landing, exist_ok=True)
    answer = {"repo": repo, "landing": landing}
    if not args.apply_only:
        write_config(repo)
        stats, events = generate(args.customers, args.seed)
        stats.to_parquet(os.path.join(repo, "data", "customer_stats.parquet"), index=False)
        events.to_csv(os.path.join(landing, "events.csv"), index=False)
        answer.update(entities=len(events), feature_rows=len(stats))
    open_store(repo).apply(definitions(repo, args.ttl_days))
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
