"""The object store as a Dagster resource: a configured `trainyard.store.FileStore`.

Everything it does lives in `trainyard.store`; this class only makes it
configurable from Dagster (run config, environment builders).
"""

from __future__ import annotations

from typing import Any, Optional

from dagster import ConfigurableResource
from pydantic import PrivateAttr

from trainyard.store import (
    FileInfo,
    FileStore,
    PermanentStorageError,
    StorageError,
    TransientStorageError,
    classify_error,
)

__all__ = [
    "FileInfo",
    "ObjectStore",
    "PermanentStorageError",
    "StorageError",
    "TransientStorageError",
    "classify_error",
]


class ObjectStore(FileStore, ConfigurableResource):
    """Files and objects under one root, on the local filesystem or S3 (see `trainyard.store`).

    Attributes:
        root: A local directory (made absolute) or `s3://bucket/prefix`.
        endpoint_url: An S3-compatible endpoint, e.g. MinIO or a moto server;
            None for AWS itself. Ignored for local roots.
        anon: Access S3 without credentials (public buckets).
    """

    root: str
    endpoint_url: Optional[str] = None
    anon: bool = False

    _fs: Any = PrivateAttr(default=None)

    # Same name clash as `trainyard.store.Store.copy`: the store's object copy wins over
    # pydantic's deprecated `BaseModel.copy`, as the MRO already has it.
    def copy(self, src_uri: str, dst_uri: str) -> None:  # type: ignore[override]
        """Copy one file/object within the store; see `FileStore.copy`."""
        FileStore.copy(self, src_uri, dst_uri)
