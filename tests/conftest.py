from __future__ import annotations

import os

import pytest

from tests.s3_server import s3_endpoint  # noqa: F401

os.environ.setdefault("GX_ANALYTICS_ENABLED", "False")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("DO_NOT_TRACK", "1")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow", action="store_true", help="also run tests marked slow (always on when CI is set)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--slow") or os.environ.get("CI"):
        return
    skip = pytest.mark.skip(reason="slow: run with --slow, `make test SLOW=1`, or CI=true (.ci/run)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
