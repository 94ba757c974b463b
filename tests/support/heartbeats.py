"""Time travel for Optuna trial heartbeats in a SQLite study database.

Optuna stamps heartbeats and judges their age with the database's own clock
(`CURRENT_TIMESTAMP`), so no Python clock can be injected; moving the recorded
stamps into the past makes a heartbeat stale without waiting out a grace period.
"""

from __future__ import annotations

import contextlib
import sqlite3
from datetime import datetime, timedelta
from pathlib import Path


def heartbeats(database: Path) -> dict[int, datetime]:
    """The recorded heartbeat of every trial that has one, by Optuna's internal trial id."""
    with contextlib.closing(sqlite3.connect(database)) as db:
        rows = db.execute("SELECT trial_id, heartbeat FROM trial_heartbeats").fetchall()
    return {trial_id: datetime.fromisoformat(beat) for trial_id, beat in rows}


def age_heartbeats(database: Path, seconds: float) -> int:
    """Move every recorded heartbeat `seconds` into the past; returns how many were moved.

    Args:
        database: The study's SQLite file (`sqlite:///<database>`).
        seconds: How far back; more than the grace period makes the trials stale.
    """
    beats = heartbeats(database)
    with contextlib.closing(sqlite3.connect(database)) as db, db:
        for trial_id, beat in beats.items():
            then = (beat - timedelta(seconds=seconds)).strftime("%Y-%m-%d %H:%M:%S.%f")
            db.execute("UPDATE trial_heartbeats SET heartbeat = ? WHERE trial_id = ?", (then, trial_id))
    return len(beats)
