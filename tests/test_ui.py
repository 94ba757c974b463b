"""`make ui`'s webserver loads workspace.yaml and shows each pipeline's six-asset lineage graph."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.dagster_dev import free_port

ROOT = Path(__file__).resolve().parent.parent
QUERY = "{ assetNodes { assetKey { path } dependencyKeys { path } } }"


def graphql(port: int, query: str) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/graphql",
        data=json.dumps({"query": query}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


@pytest.mark.slow
def test_webserver_shows_lineage_graph(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path), "TRAINYARD_HOME": str(tmp_path / "home")}
    (tmp_path / "dagster.yaml").write_text((ROOT / "deploy" / "local" / "dagster.yaml").read_text())
    proc = subprocess.Popen(
        [sys.executable, "-m", "dagster_webserver", "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(port)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 180
        nodes = None
        while time.monotonic() < deadline:
            try:
                data = graphql(port, QUERY)
                nodes = data["data"]["assetNodes"]
                if nodes:
                    break
            except OSError:
                pass
            time.sleep(2)
        assert nodes, "webserver did not serve asset nodes within 180 s"
        graph = {"/".join(n["assetKey"]["path"]): {"/".join(d["path"]) for d in n["dependencyKeys"]} for n in nodes}
        p = "vision/digits/"
        assert graph[p + "validated_data"] == {p + "raw_data"}
        assert graph[p + "sweep"] == {p + "validated_data"}
        assert graph[p + "trial_model"] == {p + "validated_data", p + "sweep"}
        assert graph[p + "best_model"] == {p + "sweep", p + "trial_model"}
        assert graph[p + "registered_model"] == {p + "best_model", p + "validated_data"}
        assert len([k for k in graph if k.startswith(p)]) == 6
    finally:
        proc.terminate()
        proc.wait(timeout=30)
