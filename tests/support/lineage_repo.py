"""A real git checkout with a dependency lock, and the lineage tags a trial trained from it records.

The promotion tests gate on recorded lineage; the lineage here comes from the
same functions a trial uses (`trainyard.lineage.code_version`, `lock_hash`) run
against a real repository, clean or with an uncommitted change.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Optional

from trainyard import lineage
from trainyard.lineage import LineageRecord

GIT = ["git", "-c", "user.name=trainyard-test", "-c", "user.email=test@trainyard.invalid", "-c", "commit.gpgsign=false"]


def checkout(root: Path, lock_text: Optional[str] = None) -> Path:
    """A git repository at `root` with one committed module and `constraints.txt` (default: the project's lock)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "model.py").write_text("WIDTH = 8\n")
    (root / "constraints.txt").write_text(lineage.lock_file().read_text() if lock_text is None else lock_text)
    for args in (["init", "-q"], ["add", "model.py", "constraints.txt"], ["commit", "-q", "-m", "model"]):
        subprocess.run([*GIT, *args], cwd=root, check=True, capture_output=True)
    return root


def make_dirty(root: Path) -> None:
    """An uncommitted change to a tracked file, as when someone trains from an edited checkout."""
    (root / "model.py").write_text("WIDTH = 16  # trying something\n")


def trained_tags(root: Path, pipeline: str = "test/gate", data_version: str = "md5a") -> dict[str, str]:
    """The lineage tags of a trial trained from the checkout at `root` as it is now."""
    commit, dirty = lineage.code_version.__wrapped__(str(root))  # not cached: the checkout changes between calls
    record = LineageRecord(
        pipeline=pipeline, data_version=data_version, code_version=commit, code_dirty=dirty,
        lock_hash=lineage.lock_hash(root / "constraints.txt"),
    )
    return record.to_tags()
