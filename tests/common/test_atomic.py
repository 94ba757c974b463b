import os

import pytest

from common.atomic import atomic_path, atomic_write_bytes


def test_writes_and_replaces(tmp_path):
    target = tmp_path / "a" / "b.bin"
    atomic_write_bytes(str(target), b"one")
    atomic_write_bytes(str(target), b"two")
    assert target.read_bytes() == b"two"
    assert os.listdir(target.parent) == ["b.bin"]


def test_failure_keeps_the_old_content_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "v.json"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with atomic_path(str(target)) as tmp:
            with open(tmp, "wb") as f:
                f.write(b"half")
            raise RuntimeError("writer died")
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["v.json"]


def test_body_that_writes_nothing_fails_and_changes_nothing(tmp_path):
    target = tmp_path / "v.json"
    with pytest.raises(FileNotFoundError):
        with atomic_path(str(target)):
            pass
    assert not target.exists()
