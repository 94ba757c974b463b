"""Headless Chromium for the UI journey: Debian's `chromium` driven by Playwright (its own browser download never runs).

`chromium()` yields a browser, or None outside CI when Chromium or Playwright is
missing (in CI, `.ci/run` installs both and their absence fails the test).
The page helpers read what a person sees: the metadata tables of asset and
partition pages, waited for with a bound and the rows last seen on failure.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

ROOT = Path(__file__).resolve().parents[2]
VIEWPORT = {"width": 1280, "height": 800}


@contextlib.contextmanager
def chromium() -> Iterator[Optional[Any]]:
    """Headless Chromium from the system's packages; None (outside CI) when it or Playwright is missing."""
    executable = shutil.which("chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    if executable is None or sync_playwright is None:
        missing = (
            "chromium (apt-get install chromium)"
            if executable is None
            else "playwright (pip install -c constraints.txt playwright)"
        )
        if os.environ.get("CI"):
            pytest.fail(f"the UI journey needs {missing}; .ci/run installs both")
        yield None
        return
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, headless=True)
        try:
            yield browser
        finally:
            browser.close()


def open_page(browser: Any) -> Any:
    """A page at the docs' size on which the webserver's one-time community dialog never covers the graph."""
    context = browser.new_context(viewport=VIEWPORT)
    # The dialog's "seen" flag, as the webserver keeps it in the browser's local storage.
    context.add_init_script("window.localStorage.setItem('communityNux', JSON.stringify('1'))")
    page = context.new_page()
    page.add_locator_handler(page.get_by_role("button", name="Skip"), lambda skip: skip.click())
    page.set_default_timeout(30_000)
    return page


def screenshot(page: Any, name: str) -> None:
    """Save a screenshot as `<TRAINYARD_SCREENSHOTS>/<name>.png` when that variable is set (docs/ui.md's images)."""
    folder = os.environ.get("TRAINYARD_SCREENSHOTS")
    if folder:
        path = Path(folder) if Path(folder).is_absolute() else ROOT / folder
        path.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(path / f"{name}.png"))


def metadata_rows(page: Any) -> dict[str, str]:
    """The metadata table(s) on the page as {key: value text}: a row's first cell is the key, its last non-empty one the
    value.

    (The asset page's table has a timestamp column between them, the partition view a trailing empty one.)
    """
    cells = page.evaluate(
        "() => Array.from(document.querySelectorAll('tr')).map(tr => Array.from(tr.cells).map(c => "
        "c.textContent.trim()))"
    )
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
