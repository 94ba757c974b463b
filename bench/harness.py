"""Benchmark result files: `bench/results/<name>.json` with name, value, unit, baseline, ratio, details."""

from __future__ import annotations

import json
import platform
import resource
from pathlib import Path
from typing import Any, Optional

RESULTS = Path(__file__).resolve().parent / "results"


def peak_rss_bytes() -> int:
    """This process's own peak resident set size (Linux `VmHWM`).

    Not `getrusage(RUSAGE_SELF).ru_maxrss`: on Linux a process started with
    fork/vfork + exec keeps its parent's high-water mark as its own, so a
    child of a 2.7 GiB parent reports at least 2.7 GiB however little it
    uses. `VmHWM` belongs to the process's address space and starts afresh at
    exec. Falls back to `ru_maxrss` where /proc is missing.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


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
