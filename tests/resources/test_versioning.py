"""DataVersioning against real DVC with a local-directory remote."""

from __future__ import annotations

import hashlib
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from resources.versioning import DataVersioning, DataVersioningError, Pin, parse_dvc_file


def _md5(path) -> str:
    with open(path, "rb") as f:
        return hashlib.md5(f.read()).hexdigest()


@pytest.fixture
def versioning(tmp_path) -> DataVersioning:
    return DataVersioning(repo_dir=str(tmp_path / "work"), remote_url=str(tmp_path / "remote"))


@pytest.fixture
def parquet_file(tmp_path) -> str:
    path = tmp_path / "in" / "data.parquet"
    path.parent.mkdir()
    pq.write_table(pa.table({"x": [1.5, 2.5, 3.5], "label": [0, 1, 0]}), path)
    return str(path)


def test_pin_records_dvc_md5_and_restores_identical_bytes(versioning, parquet_file, tmp_path):
    pin = versioning.pin(parquet_file)

    assert pin.md5 == _md5(parquet_file)
    assert pin.size == os.path.getsize(parquet_file)
    assert pin.path == "snapshots/data.parquet"
    assert parse_dvc_file(pin.dvc_file) == (pin.md5, pin.size, "data.parquet")
    # DVC 3 remotes are content-addressed under files/md5/<2 chars>/<rest>.
    assert os.path.isfile(tmp_path / "remote" / "files" / "md5" / pin.md5[:2] / pin.md5[2:])

    # Another machine: its own resource, a fresh directory, only the pin text and the remote.
    elsewhere = DataVersioning(repo_dir=str(tmp_path / "other-work"), remote_url=str(tmp_path / "remote"))
    restored = elsewhere.restore(pin.dvc_file, pin.path, str(tmp_path / "fresh"))
    assert restored == str(tmp_path / "fresh" / "snapshots" / "data.parquet")
    with open(restored, "rb") as a, open(parquet_file, "rb") as b:
        assert a.read() == b.read()
    assert not os.path.exists(tmp_path / "other-work")


def test_repinning_identical_content_gives_the_same_pin_and_old_pins_stay_restorable(versioning, tmp_path):
    src = tmp_path / "rows.csv"
    src.write_text("x,label\n1,0\n2,1\n")
    first = versioning.pin(str(src))
    again = versioning.pin(str(src))
    assert again == first
    assert first.md5 == hashlib.md5(b"x,label\n1,0\n2,1\n").hexdigest()

    src.write_text("x,label\n1,0\n2,1\n3,1\n")
    second = versioning.pin(str(src))
    assert second.md5 != first.md5
    assert second.path == first.path  # the snapshot of that name moved on...

    restored = versioning.restore(first.dvc_file, first.path, str(tmp_path / "old"))
    with open(restored, "rb") as f:
        assert f.read() == b"x,label\n1,0\n2,1\n"  # ...but the first pin still restores its bytes


def test_file_inside_the_repo_is_tracked_in_place(versioning, tmp_path):
    inside = tmp_path / "work" / "datasets" / "d.csv"
    inside.parent.mkdir(parents=True)
    inside.write_bytes(b"a,b\n1,2\n")
    pin = versioning.pin(str(inside))
    assert pin == Pin(md5=_md5(inside), size=8, dvc_file=pin.dvc_file, path="datasets/d.csv")
    assert os.path.isfile(tmp_path / "work" / "datasets" / "d.csv.dvc")
    assert not os.path.exists(tmp_path / "work" / "snapshots")


def test_missing_file_is_an_error(versioning, tmp_path):
    with pytest.raises(DataVersioningError, match="cannot pin '.*nope.csv': no such file"):
        versioning.pin(str(tmp_path / "nope.csv"))


def test_restore_of_data_not_in_the_remote_carries_dvc_output(versioning, tmp_path):
    (tmp_path / "remote").mkdir()
    text = "outs:\n- md5: 0123456789abcdef0123456789abcdef\n  size: 3\n  hash: md5\n  path: gone.csv\n"
    with pytest.raises(DataVersioningError) as info:
        versioning.restore(text, "gone.csv", str(tmp_path / "fresh"))
    message = str(info.value)
    assert "`dvc pull" in message and "failed with exit code" in message
    assert "gone.csv" in message


def test_restore_rejects_paths_outside_dest_and_the_working_repo(versioning, tmp_path):
    text = "outs:\n- md5: 0123456789abcdef0123456789abcdef\n  size: 3\n  path: a.csv\n"
    with pytest.raises(DataVersioningError, match="rel_path '../a.csv' must be a relative path inside dest_dir"):
        versioning.restore(text, "../a.csv", str(tmp_path / "fresh"))
    with pytest.raises(DataVersioningError, match="is the working repo_dir"):
        versioning.restore(text, "a.csv", str(tmp_path / "work"))
    with pytest.raises(
        DataVersioningError, match=r"rel_path 'b.csv' does not end with the file the .dvc text records \('a.csv'\)"
    ):
        versioning.restore(text, "b.csv", str(tmp_path / "fresh"))


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("outs: [", "not a valid .dvc file"),
        ("foo: 1\n", "exactly one output"),
        ("outs:\n- path: a\n  size: 1\n", "needs md5, size and path"),
        ("outs:\n- md5: abc.dir\n  size: 1\n  path: d\n", "tracks a directory"),
    ],
)
def test_parse_dvc_file_rejects_malformed_text(text, match):
    with pytest.raises(DataVersioningError, match=match):
        parse_dvc_file(text)


def test_s3_remote_round_trip(s3_endpoint, tmp_path, parquet_file):
    dv = DataVersioning(
        repo_dir=str(tmp_path / "work"), remote_url=s3_endpoint.root("dvc"), remote_endpoint_url=s3_endpoint.url
    )
    pin = dv.pin(parquet_file)
    assert pin.md5 == _md5(parquet_file)
    restored = dv.restore(pin.dvc_file, pin.path, str(tmp_path / "fresh"))
    with open(restored, "rb") as a, open(parquet_file, "rb") as b:
        assert a.read() == b.read()
