"""A pool slot is held by one step at a time: the fix for Dagster's slot claim, which can give one slot to two steps.

A team's `gpu_pool_limit` is a Dagster concurrency pool: `trial_model` declares the pool, and
before a trial step starts, its run claims one of the pool's slot rows (`concurrency_slots`).
Dagster 1.13's `SqlEventLogStorage._claim_concurrency_slot` picks a free row with
`SELECT ... FOR UPDATE SKIP LOCKED` and then writes its run and step into that row by id. On
PostgreSQL the event log connection is in autocommit mode, so the row lock ends with the SELECT:
two runs claiming at once can pick the same free row, the second write overwrites the first,
both steps start, and a third run then finds the other row free. The pool then trains three
trials with two slots (CI caught it: `test_pool_limit_holds_with_more_concurrent_trial_runs_than_slots`;
`tests/instance/test_pool_slots.py` shows the stock claim over-claiming in most rounds of
eight threads racing for two slots).

The fix makes the write conditional on the row still being free (`step_key IS NULL`): in
PostgreSQL an UPDATE that waits on another's row lock re-checks its WHERE once that commits,
so exactly one claimer takes the row and the loser sees no row updated and tries the next free
one. SQLite serialises writers, and the same conditional write is correct there too.

`install()` puts the fixed claim on `SqlEventLogStorage` (the base of both the SQLite and the
PostgreSQL storage). `assets.factory` calls it on import, so every process that runs a trial
step, whatever the Dagster instance's configuration, claims slots this way: a run worker
imports the code location before it executes a step. Remove it once Dagster's own claim is
conditional (the test that shows the stock claim over-claiming will then fail and say so).
"""

from __future__ import annotations

from typing import Any

from dagster._core.storage.event_log.schema import ConcurrencySlotsTable
from dagster._core.storage.event_log.sql_event_log import SqlEventLogStorage
from dagster._core.storage.sqlalchemy_compat import db_select
from dagster._utils.concurrency import ConcurrencySlotStatus

MAX_ATTEMPTS = 64  # each lost write means another step took a slot row: a pool has fewer rows than this


def _claim_concurrency_slot(self: Any, concurrency_key: str, run_id: str, step_key: str) -> Any:
    """Claim a free slot row of `concurrency_key` for (`run_id`, `step_key`); CLAIMED only if this write took it."""
    table = ConcurrencySlotsTable
    free = (table.c.concurrency_key == concurrency_key) & (table.c.step_key == None) & (table.c.deleted == False)  # noqa: E711, E712
    with self.index_connection() as conn:
        for _ in range(MAX_ATTEMPTS):
            row = conn.execute(
                db_select([table.c.id]).select_from(table).where(free).with_for_update(skip_locked=True).limit(1)
            ).fetchone()
            if not row or not row[0]:
                return ConcurrencySlotStatus.BLOCKED
            taken = conn.execute(
                table.update().values(run_id=run_id, step_key=step_key).where(free & (table.c.id == row[0]))
            ).rowcount
            if taken:
                return ConcurrencySlotStatus.CLAIMED
        return ConcurrencySlotStatus.BLOCKED


# Dagster's own claim, kept for the test that shows its race. A Dagster without it fails here, at import: its claim
# changed, so check whether this fix still applies.
STOCK_CLAIM = SqlEventLogStorage._claim_concurrency_slot


def installed() -> bool:
    """Whether Dagster's SQL event log storage claims slots with the conditional write."""
    return SqlEventLogStorage._claim_concurrency_slot is _claim_concurrency_slot


def install() -> None:
    """Replace `SqlEventLogStorage._claim_concurrency_slot` with the conditional claim (idempotent)."""
    SqlEventLogStorage._claim_concurrency_slot = _claim_concurrency_slot  # type: ignore[method-assign]
