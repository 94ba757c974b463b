"""The emulated API server's reaction lookup (`tests.support.cluster.server`) decides as kmock's own does.

kmock finds the reaction for a request by scanning the whole request history through
each reaction's filters; the emulator judges the request alone (`holds`), so a long
drill's thousands of polls no longer cost more with every request. These tests keep
that shortcut honest: on every reaction the emulator registers, and on filters,
exclusions and groups registered here, `holds` says what kmock's membership says for
every request served; where a view needs the history (a slice), it defers to kmock.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any, Optional

import kmock
import pytest

from tests.support.cluster.server import KubeServer, holds

NS = "team"


@pytest.fixture
def server() -> Iterator[KubeServer]:
    s = KubeServer(graceful=True)
    yield s
    s.stop()


def call(s: KubeServer, method: str, path: str, body: Optional[dict[str, Any]] = None) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(s.url + path, method=method, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def pod(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS}, "spec": {"containers": []}}


def traffic(s: KubeServer) -> None:
    """Creates, gets, lists, patches, deletes, a log read and requests for what does not exist."""
    pods = f"/api/v1/namespaces/{NS}/pods"
    for i in range(3):
        assert call(s, "POST", pods, pod(f"p{i}"))[0] == 200
    assert call(s, "GET", f"{pods}/p1")[0] == 200
    assert call(s, "GET", pods)[0] == 200
    assert call(s, "PATCH", f"{pods}/p2", {"metadata": {"labels": {"a": "b"}}})[0] == 200
    s.logs["p0"] = ["2026-01-01T00:00:00.000000000Z hello"]
    status, body = call(s, "GET", f"{pods}/p0/log")
    assert status == 200 and body == b"hello\n"
    assert call(s, "GET", f"{pods}/nope")[0] == 404
    assert call(s, "GET", f"/apis/batch/v1/namespaces/{NS}/jobs")[0] == 200
    assert call(s, "DELETE", f"/apis/batch/v1/namespaces/{NS}/jobs/none")[0] == 404


def agree(s: KubeServer) -> list[Optional[bool]]:
    """`holds` against kmock's own `request in view` on every reaction and every request; the verdicts `holds` gave."""
    verdicts = []
    for payload in s.km._payloads:
        for request in list(s.km):
            verdict = holds(payload._source, request)
            if verdict is not None:
                assert verdict == (request in payload._source), (payload, request.method, request.url.path)
            verdicts.append(verdict)
    return verdicts


def test_every_reaction_of_the_emulator_is_judged_by_the_request_alone_and_as_kmock_judges(server: KubeServer) -> None:
    traffic(server)
    verdicts = agree(server)
    assert verdicts and None not in verdicts  # every reaction the emulator has takes the shortcut
    assert True in verdicts and False in verdicts


def test_filters_exclusions_and_groups_agree_and_a_slice_defers_to_kmock(server: KubeServer) -> None:
    km = server.km
    pods = f"/api/v1/namespaces/{NS}/pods"
    # Views only (no reaction on them): nothing here changes what the server answers.
    views = [km["get"], km["post"] - km[f"{pods}/p1"], km["patch"] | km["delete"], km["get"] & km[kmock.action.LIST],
             km[lambda req: req.subresource == "log"], km["get"][:1]]
    traffic(server)
    for view in views:
        for request in list(km):
            verdict = holds(view, request)
            if type(view).__name__ == "Slicer":
                assert verdict is None  # a slice depends on the requests before it: kmock scans
            else:
                assert verdict == (request in view), (view, request.method, request.url.path)


def test_a_scripted_reaction_answers_before_the_emulator_and_a_depleted_one_falls_through(server: KubeServer) -> None:
    """What the launcher's tests script (an error for one request, then the normal answer) still works."""
    pods = f"/api/v1/namespaces/{NS}/pods"
    server._loop.call_soon_threadsafe(lambda: server.km["post", pods][:1] << 500 << {"message": "injected"})
    deadline = time.time() + 5
    while len(server.km._payloads) < 16:
        assert time.time() < deadline
        time.sleep(0.01)
    status, body = call(server, "POST", pods, pod("a"))
    assert status == 500 and b"injected" in body
    assert call(server, "POST", pods, pod("b"))[0] == 200  # the one-shot reaction is spent: the emulator answers
    assert call(server, "GET", f"{pods}/b")[0] == 200
