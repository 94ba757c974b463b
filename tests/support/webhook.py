"""A loopback webhook endpoint for handoff tests: records every POST, answers scripted statuses."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple


class Post(NamedTuple):
    """One request the endpoint received and the status it answered."""

    headers: dict[str, str]
    body: dict[str, Any]
    status: int


class WebhookServer:
    """Answers each POST with the next of `statuses` (then 200) and records it in `received`."""

    def __init__(self, path: str = "/handoff") -> None:
        self.received: list[Post] = []
        self.statuses: list[int] = []
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status = hook.statuses.pop(0) if hook.statuses else 200
                hook.received.append(Post(dict(self.headers), body, status))
                self.send_response(status)
                self.end_headers()
                self.wfile.write(
                    b"ok" if status < 400 else b"busy" if status in (429,) or status >= 500 else b"refused"
                )

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}{path}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def event_ids(self) -> list[str]:
        """The event id of every POST, in order, whatever it was answered."""
        return [p.body["event_id"] for p in self.received]

    def delivered(self) -> list[dict[str, Any]]:
        """The events answered 200: the body with the `X-Trainyard-Event-Id` header as `event_id`."""
        return [{"event_id": p.headers["X-Trainyard-Event-Id"], **p.body} for p in self.received if p.status == 200]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

