"""A scanner for canary credentials: every place a secret could end up, read the way a person or a tool would read it.

Bytes are searched as they are and, where they hide text, opened: zip archives
(checkpoints, exported models) member by member, gzip and zlib streams (Dagster
keeps its snapshots zlib-compressed inside SQLite), SQLite databases row by row.
A hit names the place and which canary it found.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import os
import sqlite3
import uuid
import zipfile
import zlib
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import pytest

SQLITE_MAGIC = b"SQLite format 3\x00"
_MAX_DEPTH = 3


class CanaryScan:
    """Collects where any of `canaries` (name -> secret value) appears.

    Attributes:
        hits: `'<place>: <canary name>'`, one per place and canary.
        places: how many places (files, rows, events, objects) were read.
    """

    def __init__(self, canaries: Mapping[str, str]) -> None:
        self.canaries = {name: value.encode() for name, value in canaries.items()}
        self.hits: list[str] = []
        self.places = 0

    def text(self, where: str, text: Any) -> None:
        """Scan `text` (anything: it is read as `str(text)`)."""
        self.data(where, str(text).encode("utf-8", "surrogateescape"))

    def data(self, where: str, raw: bytes, depth: int = 0) -> None:
        """Scan `raw`, and the text inside it when it is compressed or an archive."""
        self.places += 1
        for name, value in self.canaries.items():
            if value in raw:
                self.hits.append(f"{where}: {name}")
        if depth >= _MAX_DEPTH:
            return
        for inner, label in _opened(raw):
            self.data(f"{where} [{label}]", inner, depth + 1)

    def file(self, path: Path) -> None:
        raw = path.read_bytes()
        self.data(str(path), raw)
        if raw.startswith(SQLITE_MAGIC):
            self.sqlite(path)

    def tree(self, root: Path) -> list[Path]:
        """Scan every file under `root`; returns them."""
        files = sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink())
        for path in files:
            self.file(path)
        return files

    def sqlite(self, path: Path) -> None:
        """Scan every value of every table of the SQLite database at `path` (read-only)."""
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
            tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
            for table in tables:
                for number, row in enumerate(conn.execute(f'SELECT * FROM "{table}"')):
                    for value in row:
                        where = f"{path}:{table}[{number}]"
                        if isinstance(value, bytes):
                            self.data(where, value)
                        elif isinstance(value, str):
                            self.text(where, value)

    def rows(self, where: str, rows: Iterable[Any]) -> None:
        for number, row in enumerate(rows):
            self.text(f"{where}[{number}]", row)


def _opened(raw: bytes) -> list[tuple[bytes, str]]:
    """The contents hidden in `raw`: zip members, a gzip or zlib stream; [] for plain bytes."""
    out: list[tuple[bytes, str]] = []
    if raw[:4] == b"PK\x03\x04":
        try:
            with zipfile.ZipFile(io.BytesIO(raw)) as archive:
                out += [
                    (archive.read(info), f"zip:{info.filename}") for info in archive.infolist() if not info.is_dir()
                ]
        except (zipfile.BadZipFile, OSError, ValueError):
            pass
    elif raw[:2] == b"\x1f\x8b":
        try:
            out.append((gzip.decompress(raw), "gzip"))
        except (OSError, EOFError, ValueError):
            pass
    elif raw[:1] == b"\x78" and len(raw) > 2 and (raw[0] * 256 + raw[1]) % 31 == 0:
        try:
            out.append((zlib.decompress(raw), "zlib"))
        except zlib.error:
            pass
    return out


@contextlib.contextmanager
def postgres_database(password: str) -> Iterator[str]:
    """A fresh PostgreSQL database owned by a fresh role; yields its URL with `password` in it.

    The test server trusts local connections, so any password works for an
    existing role; the URL still carries one, as a production URL would.
    Skips, outside CI only, when no server is reachable.
    """
    from tests.conftest import POSTGRES_URL, postgres_available

    if not postgres_available():
        if os.environ.get("CI"):
            pytest.fail("PostgreSQL at 127.0.0.1:5432 is required in CI")
        pytest.skip("no PostgreSQL reachable at 127.0.0.1:5432")
    import sqlalchemy

    name = f"canary_{uuid.uuid4().hex[:10]}"
    admin = sqlalchemy.create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(sqlalchemy.text(f"CREATE ROLE {name} LOGIN"))
        c.execute(sqlalchemy.text(f"CREATE DATABASE {name} OWNER {name}"))
    try:
        yield f"postgresql+psycopg2://{name}:{password}@127.0.0.1:5432/{name}"
    finally:
        with admin.connect() as c:
            c.execute(sqlalchemy.text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
            c.execute(sqlalchemy.text(f"DROP ROLE IF EXISTS {name}"))
        admin.dispose()


def postgres_rows(url: str) -> list[str]:
    """Every row of every table of the database at `url`, as PostgreSQL's text form of the row."""
    import sqlalchemy

    engine = sqlalchemy.create_engine(url)
    try:
        with engine.connect() as c:
            tables = [
                r[0] for r in c.execute(sqlalchemy.text("SELECT tablename FROM pg_tables WHERE schemaname = 'public'"))
            ]
            return [r[0] for t in tables for r in c.execute(sqlalchemy.text(f'SELECT t::text FROM "{t}" t'))]
    finally:
        engine.dispose()
