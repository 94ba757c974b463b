"""Dagster Pipes messages written to the trial's store, for pods the orchestrator cannot share a file with.

A local launch hands rank 0 a temporary file to append Pipes messages to. A pod
shares no file system with the run worker, but it does share the trial's store
(`output_uri`, local or `s3://`), so on a cluster the launcher's reader
(`resources.pipes_store.PipesStoreMessageReader`) passes
`{PIPES_STORE_KEY: <uri>}` and rank 0 writes chunks of messages there:

    <uri>/<incarnation>/<n>.json      n = 1, 2, ... one JSON message per line

`<incarnation>` names one process (start time in ns, host, pid), so a pod that
is replaced or a gang that is restarted writes beside its predecessor instead of
over it, and the reader takes each incarnation's chunks in order, oldest
incarnation first. Each chunk is written atomically (`training.storage.write_atomic`):
a reader sees a whole chunk or none.

`StoreOrDefaultMessageWriter` is the writer rank 0 opens Pipes with: the store
channel when the params name a store, Dagster's default writer (a file or a
stream) otherwise, so the same pod code serves both launchers.
"""

from __future__ import annotations

import os
import socket
import time
from contextlib import contextmanager
from typing import IO, Iterator

from dagster_pipes import (
    PipesBlobStoreMessageWriter,
    PipesBlobStoreMessageWriterChannel,
    PipesDefaultMessageWriter,
    PipesMessageWriterChannel,
    PipesParams,
)

from training.spec import PIPES_STORE_KEY
from training.storage import join, write_atomic

UPLOAD_INTERVAL_SECONDS = 1.0  # a chunk at most every ~2 s (the writer's loop counts whole seconds)


def incarnation_name() -> str:
    """This process's folder name: sortable by start time, unique per host and pid."""
    host = "".join(c if c.isalnum() or c in "-." else "-" for c in socket.gethostname())[:63] or "host"
    return f"{time.time_ns():020d}-{host}-{os.getpid()}"


class StoreMessageWriterChannel(PipesBlobStoreMessageWriterChannel):
    """Uploads each chunk of buffered messages to `<uri>/<incarnation>/<n>.json`."""

    def __init__(self, uri: str, *, interval: float = UPLOAD_INTERVAL_SECONDS) -> None:
        super().__init__(interval=interval)
        self.uri = join(uri, incarnation_name())

    def upload_messages_chunk(self, payload: IO, index: int) -> None:
        write_atomic(join(self.uri, f"{index}.json"), payload.read().encode("utf-8"), fsync=False)


class StoreOrDefaultMessageWriter(PipesBlobStoreMessageWriter):
    """The store channel when the reader passed `PIPES_STORE_KEY`, else Dagster's default writer."""

    def __init__(self, *, interval: float = UPLOAD_INTERVAL_SECONDS) -> None:
        super().__init__(interval=interval)

    @contextmanager
    def open(self, params: PipesParams) -> Iterator[PipesMessageWriterChannel]:
        if PIPES_STORE_KEY in params:
            with super().open(params) as channel:
                yield channel
        else:
            with PipesDefaultMessageWriter().open(params) as channel:
                yield channel

    def make_channel(self, params: PipesParams) -> StoreMessageWriterChannel:
        uri = params[PIPES_STORE_KEY]
        if not isinstance(uri, str) or not uri:
            raise ValueError(f"Pipes params {PIPES_STORE_KEY}={uri!r}: accepted a store URI (a local path or s3://...)")
        return StoreMessageWriterChannel(uri, interval=self.interval)
