"""ObjectStore against a local directory and a real S3 endpoint (moto server on loopback)."""

from __future__ import annotations

import errno
import os
import socket

import pytest

from resources.storage import (
    ObjectStore,
    PermanentStorageError,
    StorageError,
    TransientStorageError,
    classify_error,
)


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path) -> ObjectStore:
    if request.param == "local":
        return ObjectStore(root=str(tmp_path / "store"))
    endpoint = request.getfixturevalue("s3_endpoint")
    # One prefix per test keeps tests independent inside the module's bucket.
    return ObjectStore(root=endpoint.root(request.node.name.replace("[", "-").rstrip("]")), endpoint_url=endpoint.url)


def test_uri_joins_under_a_local_root(tmp_path):
    store = ObjectStore(root=str(tmp_path))
    assert store.uri("a", "/b/", "c.json") == os.path.join(str(tmp_path), "a", "b", "c.json")
    assert store.uri() == str(tmp_path)


def test_uri_joins_under_an_s3_root():
    store = ObjectStore(root="s3://bucket/prefix/")
    assert store.uri("data", "team/", "x.parquet") == "s3://bucket/prefix/data/team/x.parquet"
    assert ObjectStore(root="s3://bucket").uri("k") == "s3://bucket/k"


def test_filesystem_is_created_once(store):
    assert store.fs is store.fs


def test_bytes_round_trip(store):
    uri = store.uri("dir", "blob.bin")
    assert not store.exists(uri)
    store.write_bytes(uri, b"\x00payload")
    assert store.exists(uri)
    assert store.read_bytes(uri) == b"\x00payload"
    assert store.size(uri) == 8
    store.write_bytes(uri, b"new")
    assert store.read_bytes(uri) == b"new"


def test_write_leaves_no_temporary_files(store):
    store.write_bytes(store.uri("d", "x.bin"), b"1")
    store.write_json(store.uri("d", "y.json"), {"a": 1})
    assert store.glob(store.uri("d", "*")) == [store.uri("d", "x.bin"), store.uri("d", "y.json")]


def test_json_is_sorted_and_indented(store):
    uri = store.uri("v.json")
    store.write_json(uri, {"b": [1, 2], "a": {"z": None, "y": "é"}})
    assert (
        store.read_bytes(uri)
        == b'{\n  "a": {\n    "y": "\\u00e9",\n    "z": null\n  },\n  "b": [\n    1,\n    2\n  ]\n}\n'
    )
    assert store.read_json(uri) == {"a": {"y": "é", "z": None}, "b": [1, 2]}


def test_glob_returns_sorted_full_uris(store):
    for name in ["b.csv", "a.csv", "c.txt", "sub/d.csv"]:
        store.write_bytes(store.uri("landing", name), name.encode())
    assert store.glob(store.uri("landing", "*.csv")) == [store.uri("landing", "a.csv"), store.uri("landing", "b.csv")]
    assert store.glob(store.uri("landing", "**", "*.csv")) == [
        store.uri("landing", "a.csv"),
        store.uri("landing", "b.csv"),
        store.uri("landing", "sub", "d.csv"),
    ]
    assert store.glob(store.uri("nothing", "*.csv")) == []
    if store.is_s3:
        assert all(u.startswith("s3://") for u in store.glob(store.uri("landing", "*")))


def test_file_round_trip(store, tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(3000))
    uri = store.uri("files", "f.bin")
    store.put_file(str(src), uri)
    dest = tmp_path / "out" / "deep" / "f.bin"
    store.get_file(uri, str(dest))
    assert dest.read_bytes() == src.read_bytes()
    assert sorted(os.listdir(dest.parent)) == ["f.bin"]


def test_copy_within_the_store(store):
    store.write_bytes(store.uri("a", "x"), b"data")
    store.copy(store.uri("a", "x"), store.uri("b", "y"))
    assert store.read_bytes(store.uri("b", "y")) == b"data"


def test_directory_round_trip(store, tmp_path):
    local = tmp_path / "ckpt"
    (local / "shards").mkdir(parents=True)
    (local / "meta.json").write_text("{}")
    (local / "shards" / "0.pt").write_bytes(b"zero")
    (local / "shards" / "1.pt").write_bytes(b"one")
    base = store.uri("ckpt", "step-10")
    assert store.put_dir(str(local), base) == [
        store.uri("ckpt", "step-10", "meta.json"),
        store.uri("ckpt", "step-10", "shards", "0.pt"),
        store.uri("ckpt", "step-10", "shards", "1.pt"),
    ]
    out = tmp_path / "restored"
    written = store.get_dir(base, str(out))
    assert written == [str(out / "meta.json"), str(out / "shards" / "0.pt"), str(out / "shards" / "1.pt")]
    assert (out / "shards" / "1.pt").read_bytes() == b"one"


def test_open_reads_and_writes(store):
    uri = store.uri("stream", "s.txt")
    with store.open(uri, "wb") as f:
        f.write(b"line1\nline2\n")
    with store.open(uri, "rb") as f:
        assert f.read().splitlines() == [b"line1", b"line2"]


def test_delete_file_and_tree(store):
    store.write_bytes(store.uri("t", "a"), b"1")
    store.write_bytes(store.uri("t", "sub", "b"), b"2")
    store.delete(store.uri("t", "a"))
    assert not store.exists(store.uri("t", "a"))
    store.delete(store.uri("t"), recursive=True)
    assert store.glob(store.uri("t", "**")) == []
    with pytest.raises(PermanentStorageError, match="cannot delete .*t"):
        store.delete(store.uri("t", "a"))


def test_missing_object_is_permanent_and_named(store):
    uri = store.uri("missing", "x.bin")
    with pytest.raises(PermanentStorageError) as info:
        store.read_bytes(uri)
    assert uri in str(info.value)
    assert info.value.uri == uri
    assert info.value.__cause__ is not None
    with pytest.raises(PermanentStorageError, match="no files under it"):
        store.get_dir(store.uri("missing"), "/nonexistent-never-written")


def test_invalid_json_is_permanent(store):
    uri = store.uri("bad.json")
    store.write_bytes(uri, b"{not json")
    with pytest.raises(PermanentStorageError, match="bad.json is not valid JSON"):
        store.read_json(uri)


def test_uri_of_the_other_kind_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="'s3://b/k' is not a local path"):
        ObjectStore(root=str(tmp_path)).read_bytes("s3://b/k")
    with pytest.raises(ValueError, match="is not an s3:// URI"):
        ObjectStore(root="s3://b").read_bytes(str(tmp_path))


def test_local_write_under_a_file_is_permanent(tmp_path):
    store = ObjectStore(root=str(tmp_path))
    store.write_bytes(store.uri("file"), b"x")
    with pytest.raises(PermanentStorageError, match="cannot write .*file/child"):
        store.write_bytes(store.uri("file", "child"), b"y")


def test_unreachable_endpoint_is_transient(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's retries would only slow the test down
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Nothing listens on the port any more: every connection is refused.
    store = ObjectStore(root="s3://bucket/p", endpoint_url=f"http://127.0.0.1:{port}")
    store.fs.retries = 1  # and so would s3fs's own
    with pytest.raises(TransientStorageError, match="cannot read s3://bucket/p/x"):
        store.read_bytes(store.uri("x"))


def _client_error(code: str, status: int):
    from botocore.exceptions import ClientError

    return ClientError(
        {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject"
    )


def _chained(outer: BaseException, cause: BaseException) -> BaseException:
    outer.__cause__ = cause
    return outer


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (_chained(OSError(errno.EBUSY, "slow"), _client_error("SlowDown", 503)), TransientStorageError),
        (_client_error("InternalError", 500), TransientStorageError),
        (_client_error("ThrottlingException", 400), TransientStorageError),
        (_client_error("Whatever", 429), TransientStorageError),
        (_chained(FileNotFoundError("k"), _client_error("NoSuchKey", 404)), PermanentStorageError),
        (_chained(PermissionError("k"), _client_error("AccessDenied", 403)), PermanentStorageError),
        (ConnectionRefusedError(), TransientStorageError),
        (TimeoutError(), TransientStorageError),
        (OSError(errno.ECONNRESET, "reset"), TransientStorageError),
        (FileNotFoundError(), PermanentStorageError),
        (OSError(errno.ENOSPC, "full"), PermanentStorageError),
    ],
)
def test_classify_error(error, expected):
    assert classify_error(error) is expected


def test_classify_botocore_network_errors():
    from botocore.exceptions import EndpointConnectionError, NoCredentialsError, ReadTimeoutError

    assert classify_error(EndpointConnectionError(endpoint_url="http://x")) is TransientStorageError
    assert classify_error(ReadTimeoutError(endpoint_url="http://x")) is TransientStorageError
    assert classify_error(NoCredentialsError()) is PermanentStorageError


def test_error_hierarchy():
    assert issubclass(TransientStorageError, StorageError)
    assert issubclass(PermanentStorageError, StorageError)
    assert not issubclass(TransientStorageError, PermanentStorageError)
