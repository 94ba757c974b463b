"""Bad input to a Feast source fails with an error naming what is wrong, never a silent join.

Real Feast in its own interpreter against the example repository (a small one).
"""

from __future__ import annotations

import pytest

from pipelines.commerce.churn import churn
from tests.featurestore.support import make_example
from trainyard.data import feast
from trainyard.feast_source import FeastSourceSpec
from trainyard.spec import ColumnSpec, PipelineSpec
from trainyard.store import Store


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    root = tmp_path_factory.mktemp("feast-bad") / "store"
    make_example(root, customers=30)
    return Store(root=str(root))


def _with_features(refs: list[str]) -> PipelineSpec:
    source = churn.source.model_dump() | {"feature_service": None, "features": refs}
    columns = {ref.split(":")[1]: ColumnSpec(dtype="float") for ref in refs} | {"churned": churn.columns["churned"]}
    return churn.model_copy(update={"source": FeastSourceSpec(**source), "columns": columns})


@pytest.mark.slow
@pytest.mark.parametrize(
    ("refs", "kind", "message"),
    [
        (
            ["customer_stats:balance", "customer_stats:refunds"],
            "unknown_feature",
            "feature reference 'customer_stats:refunds': feature view 'customer_stats' has no feature 'refunds'; its "
            "features are ['balance', 'txn_count_7d', 'tickets_30d']",
        ),
        (
            ["orders:refunds"],
            "unknown_feature_view",
            "feature reference 'orders:refunds': no feature view 'orders' in project 'commerce'; its views are "
            "['customer_stats']",
        ),
    ],
)
def test_unknown_feature_reference_is_refused_by_name(store: Store, refs: list[str], kind: str, message: str) -> None:
    with pytest.raises(feast.FeastRefused) as info:
        feast.feast_snapshot(store, _with_features(refs))
    assert info.value.kind == kind and str(info.value) == message


def test_entity_rows_missing_keys_or_times_are_named(store: Store) -> None:
    landing = f"{store.root}/landing/commerce/churn/events.csv"
    lines = open(landing, encoding="utf-8").read().splitlines()
    lines[2] = ",2024-02-01T00:00:00Z,0"  # no key (entity row 2)
    lines[4] = "7,,1"  # no event time (row 4)
    lines[5] = "8,yesterday,0"  # not a time (row 5)
    with open(landing, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    with pytest.raises(feast.FeastRefused) as info:
        feast.feast_snapshot(store, churn.model_copy(update={"on_bad_data": "warn"}))
    assert info.value.kind == "entity_rows"
    assert str(info.value) == (
        "entity key 'customer_id' is missing in 1 row(s) at [2]; event time 'event_timestamp' is missing in 1 row(s) "
        "at [4]; "
        "event time 'event_timestamp' is not ISO 8601 or epoch seconds in 1 row(s) at [5], e.g. ['yesterday']"
    )


def test_no_feast_interpreter_names_the_variable_and_make_install(tmp_path) -> None:
    with pytest.raises(feast.FeastUnavailable) as info:
        feast.feast_python({feast.PYTHON_ENV: str(tmp_path / "nowhere" / "python")})
    assert f"no Feast interpreter at {tmp_path / 'nowhere' / 'python'}: run `make install`" in str(info.value)
    assert feast.PYTHON_ENV in str(info.value)


def test_registry_with_a_password_is_refused_without_showing_it() -> None:
    with pytest.raises(feast.FeastUnavailable) as info:
        feast.store_config({feast.REGISTRY_ENV: "postgresql://feast:s3cret@db:5432/registry"})
    assert "s3cret" not in str(info.value) and "PGPASSWORD" in str(info.value)
    assert feast.store_config(
        {feast.REGISTRY_ENV: "postgresql://feast@db/registry", feast.OFFLINE_STORE_ENV: '{"type": "duckdb"}'}
    ) == {
        "registry": "postgresql://feast@db/registry",
        "offline_store": {"type": "duckdb"},
    }
