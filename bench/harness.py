"""Benchmark result files: `bench/results/<name>.json` with name, value, unit, baseline, ratio, details."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any, Optional

RESULTS = Path(__file__).resolve().parent / "results"


def write_result(name: str, value: float, unit: str, baseline: Optional[float], details: dict[str, Any]) -> dict[str, Any]:
    record = {
        "name": name,
        "value": value,
        "unit": unit,
        "baseline": baseline,
        "ratio": (value / baseline) if baseline else None,
        "details": {**details, "machine": {"python": platform.python_version(), "cpu": platform.processor() or platform.machine()}},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return record
