"""The commerce team's churn classifier: LightGBM on customer features retrieved from Feast as of each label's time.

Entity rows (`landing/commerce/churn/*.csv`: customer, event time, churned)
are joined with the feature view `customer_stats` of the Feast repository
`feast/commerce` (under the store root) by the feature service
`churn_features`: balance, transactions in the last 7 days, support tickets in
the last 30 days, each as known at the event time. `make demo` creates the
repository and generated data (`python -m featurestore.example`); a churned
account is closed the day after its label, so a join on the latest values
would leak the label (see docs/data.md, "Feature store sources (Feast)").
"""

from __future__ import annotations

from trainyard import (
    ColumnSpec,
    FeastSourceSpec,
    FloatParam,
    IntParam,
    ModelSpec,
    PipelineSpec,
    PromotionSpec,
    SearchSpec,
)

REPO = "feast/commerce"
"""The Feast repository, relative to the object store root (`<TRAINYARD_HOME>/store/feast/commerce` locally)."""
LANDING = "landing/commerce/churn"
FEATURE_SERVICE = "churn_features"
TARGET = "churned"

churn = PipelineSpec(
    team="commerce",
    name="churn",
    description="Customer churn from account statistics as known at each label's time (Feast), a LightGBM binary "
                "classifier.",
    source=FeastSourceSpec(
        prefix=LANDING,
        pattern="*.csv",
        repo=REPO,
        keys={"customer_id": ColumnSpec(dtype="int", min=0)},
        timestamp="event_timestamp",
        feature_service=FEATURE_SERVICE,
    ),
    columns={
        "balance": ColumnSpec(dtype="float", min=0),
        "txn_count_7d": ColumnSpec(
            dtype="int", min=0
        ),  # Feast Int64: served as JSON integers (`long` in the signature)
        "tickets_30d": ColumnSpec(dtype="int", min=0),
        TARGET: ColumnSpec(dtype="int", domain=[0, 1]),
    },
    target=TARGET,
    min_rows=200,
    model=ModelSpec(
        task="gbt",
        hparams={"objective": "binary", "early_stopping_rounds": 20},
        max_epochs=200,
        monitor="val_logloss",
        monitor_mode="min",
    ),
    search=SearchSpec(
        params={"num_leaves": IntParam(low=4, high=16), "learning_rate": FloatParam(low=0.03, high=0.3, log=True)},
        n_trials=2,
    ),
    # Ranked by churn risk: accuracy is matched by always answering "stays" (the trivial baseline the policy checks).
    promotion=PromotionSpec(metric="test_roc_auc"),
)
