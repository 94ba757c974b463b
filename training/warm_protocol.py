"""The request a launcher sends a warm server (`training.warm`): one JSON line with the output pipe attached.

`resources.warm` writes it; the server's supervisor reads it with
`receive_request`, which also takes the write end of the launcher's output pipe
passed with it (`SCM_RIGHTS`).
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass

REQUEST_TIMEOUT_SECONDS = 30.0
MAX_REQUEST_BYTES = 16 * 1024 * 1024
MAX_PROCS = 64
ENTRIES = ("training.entrypoint", "training.describe")
"""The programs a worker may run, each `main(["--spec", spec_uri])`: a trial, or the planner's model description."""


@dataclass
class Request:
    """One launch, as a launcher sends it.

    Attributes:
        env: the worker's whole environment (torchrun's variables are added to it).
        cwd: the worker's working directory.
        spec_uri: what `training.entrypoint --spec` reads.
        max_restarts: restarts of the worker group after a worker failed, before the launch fails.
        run_id: `TORCHELASTIC_RUN_ID`.
        entry: the module whose `main(["--spec", spec_uri])` the worker runs, one of `ENTRIES`.
        nprocs: workers of this one-node launch (ranks 0..nprocs-1), as torchrun's `--nproc-per-node`.
    """

    env: dict[str, str]
    cwd: str
    spec_uri: str
    max_restarts: int
    run_id: str
    entry: str = ENTRIES[0]
    nprocs: int = 1

    @classmethod
    def parse(cls, raw: bytes) -> "Request":
        """The request in one JSON line.

        Raises:
            ValueError: not JSON, or a field missing or of the wrong type (named).
        """
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError(f"a request is a JSON object, got {type(data).__name__}")
        fields = {"env": dict, "cwd": str, "spec_uri": str, "max_restarts": int, "run_id": str}
        for name, kind in fields.items():
            if not isinstance(data.get(name), kind):
                raise ValueError(f"request field {name!r} must be a {kind.__name__}, got {data.get(name)!r:.80}")
        if data["max_restarts"] < 0:
            raise ValueError(f"request field 'max_restarts' must be >= 0, got {data['max_restarts']}")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in data["env"].items()):
            raise ValueError("request field 'env' must map strings to strings")
        entry = data.get("entry", ENTRIES[0])
        if entry not in ENTRIES:
            raise ValueError(f"request field 'entry' must be one of {list(ENTRIES)}, got {entry!r:.80}")
        nprocs = data.get("nprocs", 1)
        if not isinstance(nprocs, int) or isinstance(nprocs, bool) or not 1 <= nprocs <= MAX_PROCS:
            raise ValueError(f"request field 'nprocs' must be an integer from 1 to {MAX_PROCS}, got {nprocs!r:.80}")
        return cls(**{name: data[name] for name in fields}, entry=entry, nprocs=nprocs)


def receive_request(conn: socket.socket) -> tuple[Request, int]:
    """The request on `conn` and the output pipe's write end that came with it.

    Raises:
        ValueError: no pipe attached, a malformed request, or the connection closed or stalled first.
    """
    conn.settimeout(REQUEST_TIMEOUT_SECONDS)
    try:
        data, fds, _, _ = socket.recv_fds(conn, 65536, 1)
        while data and not data.endswith(b"\n") and len(data) < MAX_REQUEST_BYTES:
            more = conn.recv(65536)
            if not more:
                break
            data += more
    except TimeoutError as e:
        raise ValueError(f"no request within {REQUEST_TIMEOUT_SECONDS:.0f} s") from e
    finally:
        conn.settimeout(None)
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"a request carries exactly one file descriptor (the output pipe), got {len(fds)}")
    if not data.endswith(b"\n"):
        os.close(fds[0])
        raise ValueError(f"the request ended after {len(data)} bytes without its closing newline")
    try:
        return Request.parse(data), fds[0]
    except ValueError:
        os.close(fds[0])
        raise
