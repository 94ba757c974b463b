"""The UI journey in a real browser: lineage graph, materialize from the UI, champion metadata.

Starts `dagster dev` (webserver and daemon) on the one-pipeline location
`tests/ui_location.py` and drives it with headless Chromium from the system's
packages through Playwright (Playwright's own browser download is never used).
The user's only act is materializing the pipeline's data assets from the
lineage graph; the sweep sensor (running by default) trains the trial and
starts `promote`, which registers the first version as champion.

Set `TRAINYARD_SCREENSHOTS=docs/img` to refresh the screenshots of docs/ui.md.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

from tests.support.dagster_dev import free_port, stop_group, wait_for
from tests.ui_location import pipeline, write_landing
from trainyard import naming
from trainyard.naming import job_names

ROOT = Path(__file__).resolve().parent.parent
ASSETS = list(naming.ASSETS)
PREFIX = [pipeline.team, pipeline.name]
LOCATION = "ui"
DATA_ASSETS = [naming.RAW_DATA, naming.VALIDATED_DATA, naming.SWEEP]  # the unpartitioned head of the chain
SERVER_TIMEOUT_S = 240
RUN_TIMEOUT_S = 300
CHAMPION_TIMEOUT_S = 480  # from the click: prepare run, a sensor tick, the trial, a tick, promote
VIEWPORT = {"width": 1280, "height": 800}

RUNS_QUERY = "{ runsOrError { ... on Runs { results { runId status jobName tags { key value } } } } }"
MATERIALIZATION_QUERY = """
query ($path: [String!]!) {
  assetOrError(assetKey: {path: $path}) {
    ... on Asset { assetMaterializations(limit: 1) { runId metadataEntries { label
      ... on TextMetadataEntry { text } ... on BoolMetadataEntry { boolValue } } } }
  }
}"""


def graphql(port: int, query: str, variables: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    body = json.dumps({"query": query, "variables": variables or {}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/graphql", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())["data"]


def log_tail(log: Path, chars: int = 6000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else "(no log)"


@pytest.fixture()
def dagster_dev(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """`dagster dev` on a free port over tests/ui_location.py, with its homes in `tmp_path`; yields (port, log path)."""
    dagster_home, trainyard_home = tmp_path / "dagster", tmp_path / "trainyard"
    dagster_home.mkdir()
    (dagster_home / "dagster.yaml").write_text((ROOT / "deploy" / "local" / "dagster.yaml").read_text())
    workspace = tmp_path / "workspace.yaml"
    workspace.write_text(
        f"load_from:\n  - python_module:\n      module_name: tests.ui_location\n      location_name: {LOCATION}\n      working_directory: {ROOT}\n"
    )
    write_landing(trainyard_home)
    port, log = free_port(), tmp_path / "dagster-dev.log"
    env = {**os.environ, "DAGSTER_HOME": str(dagster_home), "TRAINYARD_HOME": str(trainyard_home)}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dagster", "dev", "-w", str(workspace), "-h", "127.0.0.1", "-p", str(port)],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        wait_for(lambda: len(graphql(port, "{ assetNodes { id } }")["assetNodes"]) == len(ASSETS), SERVER_TIMEOUT_S, "the webserver serving the six assets", context=lambda: "; dagster dev log tail:\n" + log_tail(log))
        yield port, log
    finally:
        stop_group(proc)


@pytest.fixture()
def browser() -> Iterator[Any]:
    """Headless Chromium from the system's packages; skipped outside CI when it or Playwright is missing."""
    chromium = shutil.which("chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    if chromium is None or sync_playwright is None:
        missing = "chromium (apt-get install chromium)" if chromium is None else "playwright (pip install -c constraints.txt playwright)"
        if os.environ.get("CI"):
            pytest.fail(f"the browser UI test needs {missing}; .ci/run installs both")
        pytest.skip(f"the browser UI test needs {missing}")
    with sync_playwright() as playwright:
        chrome = playwright.chromium.launch(executable_path=chromium, headless=True)
        try:
            yield chrome
        finally:
            chrome.close()


def screenshot(page: Any, name: str) -> None:
    """Save a screenshot as `<TRAINYARD_SCREENSHOTS>/<name>.png` when that variable is set (docs/ui.md's images)."""
    folder = os.environ.get("TRAINYARD_SCREENSHOTS")
    if folder:
        path = Path(folder) if Path(folder).is_absolute() else ROOT / folder
        path.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(path / f"{name}.png"))


def open_page(browser: Any) -> Any:
    """A page at the docs' size on which the webserver's one-time community dialog never covers the graph."""
    context = browser.new_context(viewport=VIEWPORT)
    # The dialog's "seen" flag, as the webserver keeps it in the browser's local storage.
    context.add_init_script("window.localStorage.setItem('communityNux', JSON.stringify('1'))")
    page = context.new_page()
    page.add_locator_handler(page.get_by_role("button", name="Skip"), lambda skip: skip.click())
    page.set_default_timeout(30_000)
    return page


def ui_runs(port: int) -> list[dict[str, Any]]:
    return graphql(port, RUNS_QUERY)["runsOrError"]["results"]


def latest_metadata(port: int, name: str) -> Optional[dict[str, Any]]:
    """The metadata of the asset's latest materialization as {label: value}, None when there is none."""
    found = graphql(port, MATERIALIZATION_QUERY, {"path": [*PREFIX, name]})["assetOrError"]["assetMaterializations"]
    if not found:
        return None
    return {e["label"]: e.get("text", e.get("boolValue")) for e in found[0]["metadataEntries"]}


def metadata_rows(page: Any) -> dict[str, str]:
    """The metadata table(s) on the page as {key: value text}: a row's first cell is the key, its last non-empty one the value.

    (The asset page's table has a timestamp column between them, the partition view a trailing empty one.)
    """
    cells = page.evaluate("() => Array.from(document.querySelectorAll('tr')).map(tr => Array.from(tr.cells).map(c => c.textContent.trim()))")
    return {row[0]: ([c for c in row[1:] if c] or [""])[-1] for row in cells if len(row) >= 2}


def wait_for_rows(page: Any, key: str, value: str, what: str, timeout: float = 60) -> dict[str, str]:
    """Wait until the page's metadata shows `key` = `value`; returns all its rows, fails showing what it last saw."""
    deadline = time.monotonic() + timeout
    rows: dict[str, str] = {}
    while time.monotonic() < deadline:
        rows = metadata_rows(page)
        if rows.get(key) == value:
            return rows
        time.sleep(1)
    pytest.fail(f"{what}: no {key} = {value!r} within {timeout:.0f} s on {page.url}; rows seen: {rows}")


def no_failed_runs(port: int, log: Path) -> None:
    failed = [f"{r['jobName']} {r['runId']}" for r in ui_runs(port) if r["status"] == "FAILURE"]
    if failed:
        pytest.fail(f"runs failed: {failed}; dagster dev log tail:\n{log_tail(log)}")


@pytest.mark.slow
@pytest.mark.timeout(CHAMPION_TIMEOUT_S + SERVER_TIMEOUT_S + 180)
def test_materialize_from_the_lineage_graph_ends_with_a_champion(browser: Any, dagster_dev: tuple[int, Path]) -> None:
    port, log = dagster_dev  # after `browser`, so a missing browser skips before the server starts
    base = f"http://127.0.0.1:{port}"
    page = open_page(browser)

    # The lineage graph of the pipeline's asset group: all six assets.
    page.goto(f"{base}/locations/{LOCATION}/asset-groups/{naming.group_name(pipeline)}/lineage", wait_until="networkidle")
    for name in ASSETS:
        page.get_by_text(name, exact=True).wait_for(state="visible")
    screenshot(page, "lineage")

    # Materialize the data assets from the graph: select them, click "Materialize selected".
    page.get_by_text(DATA_ASSETS[0], exact=True).click()
    for name in DATA_ASSETS[1:]:
        page.get_by_text(name, exact=True).click(modifiers=["Shift"])
    page.get_by_role("button", name=f"Materialize selected ({len(DATA_ASSETS)})").click()
    page.get_by_text("Launched run").wait_for(state="visible")
    clicked = time.monotonic()

    def ui_run() -> Optional[dict[str, Any]]:
        runs = [r for r in ui_runs(port) if {"key": "dagster/from_ui", "value": "true"} in r["tags"]]
        return runs[0] if runs and runs[0]["status"] in ("SUCCESS", "FAILURE", "CANCELED") else None

    run = wait_for(ui_run, RUN_TIMEOUT_S, "the run launched from the UI ending", context=lambda: "; dagster dev log tail:\n" + log_tail(log))
    assert run["status"] == "SUCCESS", f"the UI's run {run['runId']} ended {run['status']}:\n{log_tail(log)}"
    page.goto(f"{base}/runs/{run['runId']}", wait_until="networkidle")
    page.get_by_text("Success", exact=True).filter(visible=True).first.wait_for(state="visible")
    page.get_by_text("Loading run logs").wait_for(state="hidden")
    screenshot(page, "run")

    # Nobody starts anything else: the sweep sensor trains the trial and starts `promote`.
    def decided() -> Optional[dict[str, Any]]:
        no_failed_runs(port, log)
        meta = latest_metadata(port, naming.REGISTERED_MODEL)
        return meta if meta and meta.get("decision") else None

    meta = wait_for(decided, CHAMPION_TIMEOUT_S - (time.monotonic() - clicked), "a promotion decision on registered_model", interval=5.0, context=lambda: "; dagster dev log tail:\n" + log_tail(log))
    assert meta["decision"] == "champion" and meta["champion"] is True, meta
    jobs = {r["jobName"] for r in ui_runs(port)}
    assert {job_names(pipeline)["train"], job_names(pipeline)["promote"]} <= jobs, jobs
    page.goto(f"{base}/runs", wait_until="networkidle")
    page.get_by_text(job_names(pipeline)["promote"]).filter(visible=True).first.wait_for(state="visible")
    screenshot(page, "runs")

    # The sweep's trial as a partition of trial_model, with its metrics.
    page.goto(f"{base}/assets/{'/'.join([*PREFIX, naming.TRIAL_MODEL])}?view=partitions&partition={naming.trial_key(0)}", wait_until="networkidle")
    trial = wait_for_rows(page, "status", "completed", f"{naming.trial_key(0)}'s metadata on its partition")
    assert float(trial["test_acc"]) > 0.5, trial
    screenshot(page, "trial_partitions")

    # The champion's metadata on the registered_model asset page.
    page.goto(f"{base}/assets/{'/'.join([*PREFIX, naming.REGISTERED_MODEL])}", wait_until="networkidle")
    rows = wait_for_rows(page, "decision", "champion", "registered_model's metadata table")
    assert (rows["decision"], rows["champion"], rows["version"], rows["model"]) == ("champion", "true", meta["version"], meta["model"]), rows
    page.get_by_text("Metadata", exact=True).first.evaluate("e => e.scrollIntoView({block: 'start'})")
    screenshot(page, "champion")
