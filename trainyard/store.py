"""The object store: files under one root, on a local directory or an S3 bucket, through fsspec.

Dagster-free: the data engine and every other part of the core read and write
through a `FileStore` they are given. `resources.storage.ObjectStore` is the
configured Dagster resource with the same methods; `Store` is the plain one.

Every method takes and returns full URIs as strings: `s3://bucket/key` on S3,
plain absolute paths on the local filesystem. `ObjectStore.uri` builds them
under the configured root, so assets never hard-code buckets or directories.

Writes are atomic for readers. Locally a file is written to a temporary name
beside its destination and moved into place with `os.replace`. On S3 a single
PUT (or a completed multipart upload) is already atomic: readers see the old
object or the new one, never a partial one, so the object is written in place;
a temporary key plus server-side copy would double the traffic and leave
orphans behind when interrupted between the two steps.

Failures are raised as `TransientStorageError` (worth retrying: connection
problems, timeouts, 5xx, throttling) or `PermanentStorageError` (not found,
access denied, anything not known to be transient), both naming the URI.

Example:
    >>> store = Store(root="/tmp/trainyard-store")
    >>> uri = store.uri("io", "team", "value.json")
    >>> store.write_json(uri, {"rows": 3})
    >>> store.read_json(uri)
    {'rows': 3}
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import shutil
import uuid
from typing import IO, TYPE_CHECKING, Any, Iterator, Optional

from pydantic import BaseModel, PrivateAttr

_S3 = "s3://"

# S3 error codes that mean "slow down / try again", whatever their HTTP status.
_THROTTLING_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequestsException",
        "RequestThrottled",
        "RequestTimeout",
        "ServiceUnavailable",
        "InternalError",
    }
)
# errno values s3fs gives to 5xx/throttling responses (EBUSY for 503/SlowDown,
# EREMOTEIO for 500) and the OS gives to dropped connections.
_TRANSIENT_ERRNOS = frozenset(
    {
        errno.EBUSY,
        getattr(errno, "EREMOTEIO", errno.EIO),
        errno.ETIMEDOUT,
        errno.EAGAIN,
        errno.ECONNRESET,
        errno.ECONNREFUSED,
        errno.ECONNABORTED,
        errno.EPIPE,
    }
)
_PERMANENT_OS_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)
# A full disk (or quota) is permanent for a retry: the same write fails again until someone frees space.
_NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)})
_NO_SPACE_TEXTS = ("no space left on device", "disk quota exceeded", "database or disk is full", "errno 28]")


def no_space(e: BaseException) -> bool:
    """Whether a failure anywhere in `e`'s chain is a full disk or quota (ENOSPC, EDQUOT, SQLite's "disk is full")."""
    for exc in _chain(e):
        if isinstance(exc, OSError) and exc.errno in _NO_SPACE_ERRNOS:
            return True
        if any(t in str(exc).lower() for t in _NO_SPACE_TEXTS):
            return True
    return False


def no_space_message(action: str, where: str, e: BaseException) -> str:
    """`cannot <action> <where>: no space left on device (...)`, with the free bytes of the local filesystem when
    known."""
    free = ""
    probe = where
    while probe and not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if probe and not probe.startswith(_S3):
        with contextlib.suppress(OSError):
            free = f"; {shutil.disk_usage(probe).free} bytes free on the filesystem of {probe}"
    return f"cannot {action} {where}: no space left on device{free}; free space and run again ({type(e).__name__}: {e})"


@contextlib.contextmanager
def local_writes(action: str, where: str) -> Iterator[None]:
    """Turn a full disk while writing local (temporary) files into a `PermanentStorageError` that says so.

    Other errors pass unchanged.
    """
    try:
        yield
    except OSError as e:
        if no_space(e):
            raise PermanentStorageError(no_space_message(action, where, e), uri=where) from e
        raise


class StorageError(Exception):
    """Base of object store failures; `uri` names the object concerned."""

    def __init__(self, message: str, uri: Optional[str] = None):
        super().__init__(message)
        self.uri = uri


class TransientStorageError(StorageError):
    """A failure worth retrying: connection errors, timeouts, 5xx responses, throttling."""


class PermanentStorageError(StorageError):
    """A failure retrying will not fix: not found, access denied, invalid request or content."""


def _optional_error_types() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    """(botocore ClientError types, network error types) from whichever clients are installed."""
    client: list[type[BaseException]] = []
    network: list[type[BaseException]] = []
    try:
        from botocore.exceptions import ClientError, HTTPClientError
        from botocore.exceptions import ConnectionError as BotoConnectionError

        client.append(ClientError)
        # EndpointConnectionError, ConnectTimeoutError; ReadTimeoutError, ConnectionClosedError.
        network += [BotoConnectionError, HTTPClientError]
    except ImportError:
        pass
    try:
        from aiohttp import ClientConnectionError, ClientPayloadError

        network += [ClientConnectionError, ClientPayloadError]
    except ImportError:
        pass
    return tuple(client), tuple(network)


def _handled_types() -> tuple[type[BaseException], ...]:
    client, network = _optional_error_types()
    handled: list[type[BaseException]] = [OSError, *client, *network]
    try:
        from botocore.exceptions import BotoCoreError

        handled.append(BotoCoreError)  # NoCredentialsError and friends
    except ImportError:
        pass
    return tuple(handled)


def _chain(e: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: Optional[BaseException] = e
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def classify_error(e: BaseException) -> type[StorageError]:
    """Tell whether a filesystem/S3 failure is worth retrying.

    The HTTP response of a botocore `ClientError` anywhere in the exception
    chain decides first (5xx, 429 and throttling codes are transient; other
    responses are permanent); otherwise network errors, timeouts and the errno
    values s3fs maps 5xx responses to are transient. Anything else, including
    not found, access denied and a full disk (`no_space`: retrying at once
    fails the same way until space is freed), is permanent: an error that is
    not understood is not retried.

    Args:
        e: The exception raised by fsspec, s3fs, botocore or the OS.

    Returns:
        `TransientStorageError` or `PermanentStorageError`.
    """
    client_types, network_types = _optional_error_types()
    if no_space(e):
        return PermanentStorageError
    chain = list(_chain(e))
    for exc in chain:
        if client_types and isinstance(exc, client_types):
            response = getattr(exc, "response", None) or {}
            code = str(response.get("Error", {}).get("Code", ""))
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in _THROTTLING_CODES or (isinstance(status, int) and (status >= 500 or status == 429)):
                return TransientStorageError
            if code.isdigit() and (int(code) >= 500 or int(code) == 429):
                return TransientStorageError
            return PermanentStorageError
    for exc in chain:
        if isinstance(exc, _PERMANENT_OS_ERRORS):
            return PermanentStorageError
        if isinstance(exc, (ConnectionError, TimeoutError)) or (network_types and isinstance(exc, network_types)):
            return TransientStorageError
        if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
            return TransientStorageError
    return PermanentStorageError


@dataclasses.dataclass(frozen=True)
class FileInfo:
    """What the store knows about one file/object without reading it.

    Attributes:
        uri: Full URI.
        size: Size in bytes.
        mtime: Modification time (seconds since the epoch; S3 `LastModified`).
        etag: S3 ETag (content hash for single-part uploads); for local files
            `<inode>:<mtime_ns>`, so an atomic replace with the same size and
            second is still seen as a change.
    """

    uri: str
    size: int
    mtime: Optional[float]
    etag: Optional[str]

    @property
    def identity(self) -> tuple[int, Optional[float], Optional[str]]:
        """(size, mtime, etag): equal identities mean the content was not replaced in between."""
        return (self.size, self.mtime, self.etag)


def _file_info(uri: str, info: dict[str, Any]) -> FileInfo:
    mtime = info.get("mtime")
    modified = info.get("LastModified")
    if mtime is None and modified is not None:
        mtime = modified.timestamp() if hasattr(modified, "timestamp") else None
    etag = info.get("ETag")
    if etag is None and info.get("ino") is not None and mtime is not None:
        etag = f"{info['ino']}:{int(float(mtime) * 1e9)}"
    return FileInfo(
        uri=uri,
        size=int(info.get("size") or 0),
        mtime=None if mtime is None else float(mtime),
        etag=None if etag is None else str(etag).strip('"'),
    )


def _local_entry(path: str, listed: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The info of a local entry fsspec lists as "other", following a link; or why it is no regular file."""
    import stat as st

    try:
        target = os.stat(path)  # follows links
    except OSError as e:
        link = os.readlink(path) if os.path.islink(path) else None
        return listed, (
            f"a symbolic link to {link!r}, which does not exist" if link is not None else f"cannot be read: {e}"
        )
    if st.S_ISREG(target.st_mode):
        return {**listed, "type": "file", "size": target.st_size, "mtime": target.st_mtime, "ino": target.st_ino}, ""
    what = (
        "a directory"
        if st.S_ISDIR(target.st_mode)
        else "a FIFO"
        if st.S_ISFIFO(target.st_mode)
        else "a socket or device"
    )
    if os.path.islink(path):
        return listed, f"a symbolic link to {os.readlink(path)!r}, {what}, not a regular file"
    return listed, f"{what}, not a regular file"


class FileStore:
    """The store's operations, shared by the plain `Store` and the Dagster resource.

    A subclass provides the fields `root` (a local directory, made absolute, or
    `s3://bucket/prefix`), `endpoint_url` (an S3-compatible endpoint such as MinIO
    or a moto server; None for AWS itself) and `anon` (S3 without credentials),
    and a private `_fs` slot for the filesystem it creates once.

    Credentials for S3 come only from the standard AWS environment (variables
    such as `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`, a profile or an
    instance role), never from fields, so they stay out of run config.
    """

    if TYPE_CHECKING:
        root: str
        endpoint_url: Optional[str]
        anon: bool
        _fs: Any

    @property
    def is_s3(self) -> bool:
        """Whether the root is on S3."""
        return self.root.startswith(_S3)

    @property
    def fs(self) -> Any:
        """The fsspec filesystem of the root, created once per resource instance."""
        if self._fs is None:
            if self.is_s3:
                import s3fs

                self._fs = s3fs.S3FileSystem(
                    anon=self.anon,
                    client_kwargs={"endpoint_url": self.endpoint_url} if self.endpoint_url else {},
                    # Each resource owns its client, so credentials read from the
                    # environment now are not shadowed by an older cached instance;
                    # listings are not cached because other processes write too.
                    skip_instance_cache=True,
                    use_listings_cache=False,
                )
            else:
                from fsspec.implementations.local import LocalFileSystem

                self._fs = LocalFileSystem()
        return self._fs

    def uri(self, *parts: str) -> str:
        """Join `parts` under the root.

        Example:
            >>> Store(root="s3://bucket/prefix").uri("data", "a.csv")
            's3://bucket/prefix/data/a.csv'
        """
        clean = [p.strip("/") for p in parts if p and p.strip("/")]
        if self.is_s3:
            return "/".join([self.root.rstrip("/"), *clean])
        return os.path.join(os.path.abspath(os.path.expanduser(self.root)), *clean)

    def _check(self, uri: str) -> str:
        if self.is_s3 != uri.startswith(_S3):
            kind = "an s3:// URI" if self.is_s3 else "a local path"
            raise ValueError(f"uri {uri!r} is not {kind}, as the store root {self.root!r} requires")
        return uri if self.is_s3 else os.path.abspath(uri)

    @contextlib.contextmanager
    def _errors(self, action: str, uri: str) -> Iterator[None]:
        try:
            yield
        except StorageError:
            raise
        except _handled_types() as e:
            if no_space(e):
                raise PermanentStorageError(no_space_message(action, uri, e), uri=uri) from e
            kind = classify_error(e)
            raise kind(f"cannot {action} {uri}: {type(e).__name__}: {e}", uri=uri) from e

    def exists(self, uri: str) -> bool:
        """Whether a file/object or directory/prefix exists at `uri`."""
        path = self._check(uri)
        with self._errors("check", path):
            return bool(self.fs.exists(path))

    def glob(self, uri_pattern: str) -> list[str]:
        """Sorted full URIs matching a glob pattern (`*`, `?`, `[...]`, `**`)."""
        pattern = self._check(uri_pattern)
        with self._errors("list", pattern):
            found = self.fs.glob(pattern)
        if self.is_s3:
            found = [_S3 + p for p in found]
        return sorted(found)

    def list_files(self, uri_pattern: str, skipped: Optional[list[tuple[str, str]]] = None) -> list[FileInfo]:
        """Files/objects matching a glob pattern with their size, mtime and etag, sorted by URI.

        Directories (and S3 "directory" placeholders) are left out. A local
        symbolic link to a regular file is listed as that file, under the
        link's name, with the target's size, mtime and identity (what `stat`
        and `open` see); re-pointing the link changes its identity. Anything
        else that is not a regular file (a dangling link, a link to a
        directory, a FIFO, socket or device, which could block a reader) is
        left out and, when `skipped` is given, appended to it as (URI, why).
        """
        pattern = self._check(uri_pattern)
        with self._errors("list", pattern):
            found = self.fs.glob(pattern, detail=True)
        files = []
        for path, info in found.items():
            kind = info.get("type")
            if kind == "other" and not self.is_s3:
                # fsspec's listing does not follow links (they show as "other"); `info` does.
                info, why = _local_entry(path, info)
                if why:
                    if skipped is not None:
                        skipped.append((path, why))
                    continue
                kind = info.get("type")
            if kind != "file":
                continue
            files.append(_file_info(_S3 + path if self.is_s3 else path, info))
        return sorted(files, key=lambda f: f.uri)

    def stat(self, uri: str) -> FileInfo:
        """Size, mtime and etag of one file/object, read fresh (never from a listing cache)."""
        path = self._check(uri)
        with self._errors("stat", path):
            if self.is_s3:
                self.fs.invalidate_cache(path)
            info = self.fs.info(path)
        if info.get("type") != "file":
            raise PermanentStorageError(f"cannot stat {path}: it is a directory, not a file", uri=path)
        return _file_info(uri if self.is_s3 else path, info)

    def read_bytes(self, uri: str) -> bytes:
        """The whole content of one file/object."""
        path = self._check(uri)
        with self._errors("read", path):
            return self.fs.cat_file(path)

    def write_bytes(self, uri: str, data: bytes) -> None:
        """Write `data` to `uri` atomically (see the module docstring), replacing any old content."""
        path = self._check(uri)
        if self.is_s3:
            with self._errors("write", path):
                self.fs.pipe_file(path, data)
            return
        with self._local_atomic(path) as tmp:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())

    @contextlib.contextmanager
    def _local_atomic(self, path: str) -> Iterator[str]:
        """Yield a temporary path beside `path`; move it into place on success, remove it on failure."""
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        with self._errors("write", path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            try:
                yield tmp
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)

    def read_json(self, uri: str) -> Any:
        """Parse the JSON document at `uri`.

        Raises:
            PermanentStorageError: The object is missing or is not valid UTF-8 JSON.
        """
        data = self.read_bytes(uri)
        try:
            return json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise PermanentStorageError(f"{uri} is not valid JSON: {e}", uri=uri) from e

    def write_json(self, uri: str, value: Any) -> None:
        """Write `value` as JSON (sorted keys, indent 2, trailing newline), atomically."""
        self.write_bytes(uri, (json.dumps(value, sort_keys=True, indent=2) + "\n").encode("utf-8"))

    def put_file(self, local_path: str, uri: str) -> None:
        """Upload (or locally copy) one file to `uri`, atomically."""
        path = self._check(uri)
        if not os.path.isfile(local_path):
            raise PermanentStorageError(f"cannot upload {local_path} to {path}: no such local file", uri=path)
        if self.is_s3:
            with self._errors(f"upload {local_path} to", path):
                self.fs.put_file(local_path, path)
            return
        with self._local_atomic(path) as tmp:
            shutil.copyfile(local_path, tmp)

    def get_file(self, uri: str, local_path: str) -> None:
        """Download (or locally copy) one file to `local_path`, atomically."""
        path = self._check(uri)
        local_path = os.path.abspath(local_path)
        tmp = f"{local_path}.tmp-{uuid.uuid4().hex}"
        with self._errors(f"download to {local_path} from", path):
            os.makedirs(os.path.dirname(local_path), exist_ok=True)
            try:
                if self.is_s3:
                    self.fs.get_file(path, tmp)
                else:
                    shutil.copyfile(path, tmp)
                os.replace(tmp, local_path)
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)

    def copy(self, src_uri: str, dst_uri: str) -> None:
        """Copy one file/object within the store (server-side on S3), atomically at the destination."""
        src, dst = self._check(src_uri), self._check(dst_uri)
        if self.is_s3:
            with self._errors(f"copy {src} to", dst):
                self.fs.copy(src, dst)
            return
        if not os.path.isfile(src):
            raise PermanentStorageError(f"cannot copy {src} to {dst}: no such file", uri=src)
        with self._local_atomic(dst) as tmp:
            shutil.copyfile(src, tmp)

    def put_dir(self, local_dir: str, uri: str) -> list[str]:
        """Upload every file under `local_dir` to the same relative paths under `uri`.

        Returns:
            The URIs written, sorted.
        """
        if not os.path.isdir(local_dir):
            raise PermanentStorageError(f"cannot upload {local_dir} to {uri}: no such local directory", uri=uri)
        written = []
        for dirpath, dirnames, filenames in os.walk(local_dir):
            dirnames.sort()
            for name in sorted(filenames):
                rel = os.path.relpath(os.path.join(dirpath, name), local_dir)
                target = self._join(uri, rel)
                self.put_file(os.path.join(dirpath, name), target)
                written.append(target)
        return sorted(written)

    def get_dir(self, uri: str, local_dir: str) -> list[str]:
        """Download every file under `uri` to the same relative paths under `local_dir`.

        Returns:
            The local paths written, sorted.

        Raises:
            PermanentStorageError: Nothing exists under `uri`.
        """
        base = self._check(uri).rstrip("/")
        with self._errors("list", base):
            found = self.fs.find(base)
        files = [(_S3 + p) if self.is_s3 else p for p in found]
        if not files:
            raise PermanentStorageError(f"cannot download {base}: no files under it", uri=base)
        written = []
        for file_uri in sorted(files):
            rel = file_uri[len(base) :].lstrip("/") or file_uri.rsplit("/", 1)[-1]  # `uri` was a single file
            target = os.path.join(local_dir, *rel.split("/"))
            self.get_file(file_uri, target)
            written.append(os.path.abspath(target))
        return sorted(written)

    def _join(self, uri: str, rel: str) -> str:
        parts = rel.replace(os.sep, "/").split("/")
        return "/".join([uri.rstrip("/"), *parts]) if self.is_s3 else os.path.join(uri, *parts)

    def open(self, uri: str, mode: str = "rb") -> IO[Any]:
        """Open a file-like object; use it as a context manager.

        Writing through `open` is not atomic; prefer `write_bytes`/`put_file`
        for content others may read concurrently.
        """
        path = self._check(uri)
        with self._errors(f"open ({mode})", path):
            if not self.is_s3 and any(c in mode for c in "wax"):
                os.makedirs(os.path.dirname(path), exist_ok=True)
            return self.fs.open(path, mode)

    def delete(self, uri: str, recursive: bool = False) -> None:
        """Delete a file/object, or everything under a directory/prefix with `recursive=True`."""
        path = self._check(uri)
        with self._errors("delete", path):
            if not self.fs.exists(path):
                raise FileNotFoundError(errno.ENOENT, "no such file or object", path)
            self.fs.rm(path, recursive=recursive)

    def size(self, uri: str) -> int:
        """Size in bytes of one file/object."""
        path = self._check(uri)
        with self._errors("stat", path):
            return int(self.fs.size(path))


class Store(FileStore, BaseModel):
    """A plain (Dagster-free) store, for the CLI, the pod side and tests.

    Example:
        >>> Store(root="s3://bucket/prefix").is_s3
        True
    """

    root: str
    endpoint_url: Optional[str] = None
    anon: bool = False

    _fs: Any = PrivateAttr(default=None)

    # pydantic's deprecated `BaseModel.copy(*, include, exclude, update, deep)` (use
    # `model_copy`) has the same name as the store's object copy; the store's wins, as the
    # MRO already has it, and the override says so to the type checker.
    def copy(self, src_uri: str, dst_uri: str) -> None:  # type: ignore[override]
        """Copy one file/object within the store; see `FileStore.copy`."""
        FileStore.copy(self, src_uri, dst_uri)
