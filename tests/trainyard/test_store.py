from __future__ import annotations

import pytest

from trainyard.store import PermanentStorageError, Store


def test_copy_is_the_object_copy_not_pydantics(tmp_path):
    store = Store(root=str(tmp_path))
    store.write_bytes(store.uri("a", "x"), b"data")
    assert store.copy(store.uri("a", "x"), store.uri("b", "y")) is None
    assert store.read_bytes(store.uri("b", "y")) == b"data"
    assert store.read_bytes(store.uri("a", "x")) == b"data"


def test_copy_of_a_missing_file_is_permanent_and_named(tmp_path):
    store = Store(root=str(tmp_path))
    missing = store.uri("a", "missing")
    with pytest.raises(PermanentStorageError, match="no such file") as err:
        store.copy(missing, store.uri("b", "y"))
    assert err.value.uri == missing
