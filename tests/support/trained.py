"""The small digits pipeline trained end to end once, and private copies of its home for tests.

Training `small_spec()` through every job takes most of a minute, so a session trains
it once (`train_once`, behind a file lock so xdist workers share one result) and each
test module works on its own copy (`copy_home`). Stored values, run records and
registry rows hold absolute paths into the home; a copy rewrites them to its own root
so nothing in it still points at the original.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import sqlite3
from pathlib import Path
from typing import Any

from filelock import FileLock

from tests.pipelines.pipeline_fixtures import Harness, small_spec, write_landing

SQLITE_MAGIC = b"SQLite format 3\x00"
# Write-ahead log and shared memory: sqlite3 applies them when it opens the database.
SQLITE_SIDE_FILES = ("-wal", "-shm", "-journal")


@dataclasses.dataclass(frozen=True)
class TrainedHome:
    """A trained TRAINYARD_HOME and what `Harness.run_all` returned for it.

    Attributes:
        home: The home's root.
        out: `run_all`'s output (sweep, best and registered values as JSON).
    """

    home: Path
    out: dict[str, Any]


def train_once(home: Path) -> TrainedHome:
    """Train `small_spec()` into `home` unless an earlier caller (any process) already did.

    The result is recorded in `<home>.json` only after a successful run; a failed
    run leaves no home behind, so the next caller trains again.
    """
    record = home.with_name(home.name + ".json")
    with FileLock(str(home.with_name(home.name + ".lock"))):
        if not record.exists():
            shutil.rmtree(home, ignore_errors=True)
            try:
                write_landing(home)
                harness = Harness(home, small_spec())
                out = harness.run_all()
                harness.instance.dispose()
            except BaseException:
                shutil.rmtree(home, ignore_errors=True)
                raise
            record.write_text(json.dumps(out))
    return TrainedHome(home=home, out=json.loads(record.read_text()))


def copy_home(trained: TrainedHome, destination: Path) -> TrainedHome:
    """Copy a trained home into `destination` (new or empty) with every stored path re-rooted there."""
    old, new = str(trained.home), str(destination)
    shutil.copytree(trained.home, destination, symlinks=True, dirs_exist_ok=True)
    for path in destination.rglob("*"):
        if path.is_symlink() or not path.is_file() or path.name.endswith(SQLITE_SIDE_FILES):
            continue
        with path.open("rb") as f:
            head = f.read(len(SQLITE_MAGIC))
        if head == SQLITE_MAGIC:
            _reroot_sqlite(path, old, new)
        else:
            _reroot_text(path, old, new)
    out = json.loads(json.dumps(trained.out).replace(old, new))
    return TrainedHome(home=destination, out=out)


def _reroot_text(path: Path, old: str, new: str) -> None:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return  # binary (Parquet, exported models, W&B records): holds no home path
    if old in text:
        path.write_text(text.replace(old, new), encoding="utf-8")


def _reroot_sqlite(path: Path, old: str, new: str) -> None:
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        tables = [
            row[0]
            for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")
        ]
        for table in tables:
            columns = [row[1] for row in db.execute(f'PRAGMA table_info("{table}")')]
            for column in columns:
                db.execute(
                    f'UPDATE "{table}" SET "{column}" = replace("{column}", ?, ?) WHERE typeof("{column}") = \'text\' '
                    f'AND instr("{column}", ?) > 0',
                    (old, new, old),
                )
