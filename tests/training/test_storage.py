"""Whole small files at fsspec URIs: atomic local writes through `common.atomic`, one PUT elsewhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

from training.attempts import AttemptLog, read_attempts
from training.storage import join, read_text, write_atomic


def test_join_puts_one_slash_between_parts() -> None:
    assert join("s3://bucket/run/", "checkpoints", "model.txt") == "s3://bucket/run/checkpoints/model.txt"
    assert join("/runs/t", "a") == "/runs/t/a"


def test_local_write_replaces_the_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "deep" / "state.json"
    write_atomic(str(target), b"one")
    write_atomic(f"file://{target}", b"two")
    assert read_text(str(target)) == "two"
    assert os.listdir(target.parent) == ["state.json"]


def test_other_filesystems_get_the_whole_content_in_one_put() -> None:
    uri = f"memory://storage-test-{uuid.uuid4().hex}/sub/model.txt"
    write_atomic(uri, b"trees")
    write_atomic(uri, b"more trees")
    assert read_text(uri) == "more trees"


def test_missing_file_reads_as_none(tmp_path: Path) -> None:
    assert read_text(str(tmp_path / "absent.json")) is None


def test_attempt_heartbeat_is_one_whole_json_file(tmp_path: Path) -> None:
    log = AttemptLog(str(tmp_path), "launch-0", 100.0)
    log.update(force=True, last_step=3)
    log.update(force=True, last_step=7)
    assert [r["last_step"] for r in read_attempts(str(tmp_path))] == [7]
    assert os.listdir(tmp_path / "attempts") == ["launch-0.json"]
    assert json.loads((tmp_path / "attempts" / "launch-0.json").read_text())["attempt"] == "launch-0"


def test_gbt_trials_import_it_without_torch() -> None:
    code = (
        "import sys, training.gbt, training.entrypoint; assert 'torch' not in sys.modules and 'lightning' not in "
        "sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
