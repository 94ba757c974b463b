"""The run worker's side of Pipes messages written to the trial's store (`training.pipes_store`).

`PipesStoreMessageReader(uri)` gives the pod `{PIPES_STORE_KEY: uri}` and, while
the launch runs, polls `uri` every `interval` seconds: each incarnation folder
(one per rank 0 process, oldest first) is read chunk by chunk in order (`1.json`,
`2.json`, ...), and every message goes to Dagster's handler, so rank 0's log
lines and progress records reach the run as they do locally.

A gang restarted after a lost node, a preemption or a replaced pod starts a new
rank 0 process, which opens Pipes again and closes it when it ends. Dagster's
handler stops reading at the first `closed`, so the reader holds every `closed`
back and hands over only the last one, when the session ends (after a final read
of everything written): messages of a later incarnation are never dropped
because an earlier one closed. A store that cannot be read for a moment (S3
throttling, a network blip) is retried at the next poll; the final read raises.
"""

from __future__ import annotations

import json
import logging
import threading
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import fsspec
from dagster import PipesMessageHandler, PipesMessageReader
from dagster_pipes import PipesParams

from training.spec import PIPES_STORE_KEY

logger = logging.getLogger("trainyard.pipes")


class PipesStoreMessageReader(PipesMessageReader):
    """Reads the message chunks rank 0 writes under `uri` (see the module docstring).

    Args:
        uri: The folder (local path or `s3://...`) given to the pod; one per launch attempt.
        interval: Seconds between polls while the launch runs.
    """

    def __init__(self, uri: str, interval: float = 1.0) -> None:
        self.uri = uri.rstrip("/")
        self.interval = interval
        self._next: dict[str, int] = {}  # incarnation -> the next chunk index to read
        self._closed: Optional[dict[str, Any]] = None  # the last `closed` message, held back
        self._lock = threading.Lock()
        self._warned = False
        self.messages_read = 0

    @contextmanager
    def read_messages(self, handler: PipesMessageHandler) -> Iterator[PipesParams]:
        stop = threading.Event()

        def poll() -> None:
            while not stop.wait(self.interval):
                try:
                    self.drain(handler)
                except OSError as e:  # the store answered nothing readable this time: the next poll tries again
                    if not self._warned:
                        logger.warning("could not read Pipes messages under %s (%s); retrying", self.uri, e)
                        self._warned = True

        thread = threading.Thread(target=poll, name="trainyard-pipes-store", daemon=True)
        thread.start()
        try:
            yield {PIPES_STORE_KEY: self.uri}
        finally:
            stop.set()
            thread.join()
            self.drain(handler)
            if self._closed is not None:
                handler.handle_message(self._closed)  # type: ignore[arg-type]  # a PipesMessage as read from JSON

    def drain(self, handler: PipesMessageHandler) -> int:
        """Hand every message written since the last call to `handler`; returns how many."""
        with self._lock:
            fs, root = fsspec.core.url_to_fs(self.uri)
            if not fs.exists(root):
                return 0
            fs.invalidate_cache(root)
            incarnations = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
            count = 0
            for incarnation in incarnations:
                index = self._next.get(incarnation, 1)
                while True:
                    path = f"{root}/{incarnation}/{index}.json"
                    try:
                        with fs.open(path, "r", encoding="utf-8") as f:
                            text = f.read()
                    except FileNotFoundError:
                        break
                    for line in text.splitlines():
                        if line.strip():
                            count += self._handle(handler, json.loads(line))
                    index += 1
                self._next[incarnation] = index
            self.messages_read += count
            return count

    def _handle(self, handler: PipesMessageHandler, message: dict[str, Any]) -> int:
        if message.get("method") == "closed":
            self._closed = message
            return 0
        handler.handle_message(message)  # type: ignore[arg-type]  # a PipesMessage as read from JSON
        return 1

    def no_messages_debug_text(self) -> str:
        return f"Attempted to read messages from chunks under {self.uri} (the trial's store); rank 0 writes them there."
