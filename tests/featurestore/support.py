"""Helpers for the Feast tests: the example repository made by the real Feast interpreter, under a test store."""

from __future__ import annotations

import json
from pathlib import Path

from pipelines.commerce.churn import LANDING, REPO
from trainyard.data.feast import run_featurestore


def make_example(store_root: Path, customers: int, *extra: str) -> dict:
    """Run `python -m featurestore.example` in the Feast interpreter: the churn repository and entity files under
    `store_root`."""
    args = [
        "--repo",
        str(store_root / REPO),
        "--landing",
        str(store_root / LANDING),
        "--customers",
        str(customers),
        *extra,
    ]
    proc = run_featurestore("example", args, timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
