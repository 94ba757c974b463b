"""Helpers for the Feast tests: the example repository made by the real Feast interpreter, under a test store."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from pipelines.commerce.churn import LANDING, REPO
from trainyard.data.feast import PROJECT_ROOT, feast_python


def make_example(store_root: Path, customers: int, *extra: str) -> dict:
    """Run `python -m featurestore.example` in the Feast interpreter: the churn repository and entity files under `store_root`."""
    proc = subprocess.run(
        [feast_python(), "-W", "ignore", "-m", "featurestore.example", "--repo", str(store_root / REPO), "--landing", str(store_root / LANDING),
         "--customers", str(customers), *extra],
        cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
