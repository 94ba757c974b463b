"""Pool slots on PostgreSQL: one slot row is held by one step, however many claim at once (instance.pool_slots).

Eight threads, each its own connection, claim a two-slot pool at the same instant through the
storage's real claim. CLAIMED must go to exactly as many claimers as there are slots, and the
slot rows must name exactly those claimers. The stock Dagster claim is run through the same
harness to show it can catch the race (it over-claims in most rounds here).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable

import pytest
from dagster import DagsterInstance
from dagster._core.storage.event_log.sql_event_log import SqlEventLogStorage

from instance import pool_slots

CLAIMERS, SLOTS, ROUNDS = 8, 2, 20


def race(storage: Any, claim: Callable[..., Any], pool: str) -> tuple[set[str], set[str]]:
    """Every claimer calls `claim` at once; returns (runs told CLAIMED, runs the slot rows hold)."""
    storage.set_concurrency_slots(pool, SLOTS)
    start, results = threading.Barrier(CLAIMERS), {}

    def claimer(i: int) -> None:
        start.wait()
        results[f"run-{i}"] = claim(storage, pool, f"run-{i}", "trial")

    threads = [threading.Thread(target=claimer, args=(i,)) for i in range(CLAIMERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    told = {run for run, status in results.items() if status.name == "CLAIMED"}
    held = {c.run_id for c in storage.get_concurrency_info(pool).claimed_slots}
    return told, held


def open_storage(tmp_path: Path, postgres_url: str | None) -> Any:
    """An instance's event log storage: PostgreSQL at `postgres_url`, or the default SQLite one under `tmp_path`
    (None)."""
    storage = f"storage:\n  postgres:\n    postgres_url: {postgres_url}\n" if postgres_url else ""
    (tmp_path / "dagster.yaml").write_text(f"telemetry:\n  enabled: false\n{storage}")
    return DagsterInstance.from_config(str(tmp_path))


@pytest.fixture
def storage(tmp_path: Path, pg_databases) -> Any:
    with open_storage(tmp_path, pg_databases[0]) as instance:
        yield instance.event_log_storage


def test_the_fixed_claim_holds_on_the_local_sqlite_instance_too(tmp_path: Path) -> None:
    """`trainyard init`'s local instance keeps slots in SQLite: the same conditional write, the same result."""
    pool_slots.install()
    with open_storage(tmp_path, None) as instance:
        for n in range(5):
            told, held = race(instance.event_log_storage, SqlEventLogStorage._claim_concurrency_slot, f"local_gpu_{n}")
            assert len(told) == SLOTS and told == held, (
                f"round {n}: told CLAIMED {sorted(told)}, slot rows hold {sorted(held)}"
            )


def test_every_slot_goes_to_exactly_one_of_many_simultaneous_claimers(storage: Any) -> None:
    pool_slots.install()
    assert pool_slots.installed()
    for n in range(ROUNDS):
        told, held = race(storage, SqlEventLogStorage._claim_concurrency_slot, f"team_gpu_{n}")
        assert len(told) == SLOTS and told == held, (
            f"round {n}: told CLAIMED {sorted(told)}, slot rows hold {sorted(held)}"
        )


def test_the_stock_claim_gives_one_slot_to_two_steps(storage: Any) -> None:
    """The harness catches the race the fix closes; if this fails, Dagster's claim no longer races: drop
    instance/pool_slots.py."""
    stock = pool_slots.STOCK_CLAIM
    over = [n for n in range(ROUNDS) if len(race(storage, stock, f"stock_gpu_{n}")[0]) > SLOTS]
    assert over, f"the stock claim never over-claimed in {ROUNDS} rounds of {CLAIMERS} claimers for {SLOTS} slots"


def test_assets_install_the_fix_on_import() -> None:
    import assets.factory  # noqa: F401

    assert pool_slots.installed()
