"""`make bench`: run every benchmark, each in a fresh process, write bench/results/<name>.json, end with a table of
targets.

A fresh interpreter per benchmark keeps them from measuring each other: a
memory benchmark run after a 1.2 GB checkpoint benchmark in the same process
would inherit that process's pages and threads (and its spawned children its
high-water mark). `python -m bench bench.pruning_savings ...` runs only those.

Prints one JSON line per benchmark as it finishes, then a table (benchmark,
metric value, unit, target, met). Exits 1 when a benchmark failed, declared no
target, or missed one; 0 when every target of every benchmark run was met.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.harness import STARTED_ENV, started_marker

BENCHMARKS = [
    "bench.overhead",
    "bench.checkpoint_blocking",
    "bench.recovery",
    "bench.planner_memory",
    "bench.validation_throughput",
    "bench.ingest_memory",
    "bench.gbt_overhead",
    "bench.time_to_first_step",
    "bench.sweep_throughput",
    "bench.cluster_sim",
    "bench.long_run_sim",
    "bench.sweep_10k",
    "bench.pruning_savings",
    "bench.gang_recovery",
    "bench.stream_throughput",
    "bench.data_memory",
    "bench.lm_throughput",
    "bench.hang_detect",
    "bench.elastic_resume",
]
ROOT = Path(__file__).resolve().parent.parent
_KEYS = ("name", "value", "unit", "baseline", "ratio")
# The benchmark's argv is its module alone: `python -c` leaves the module name in sys.argv[1:], which a
# benchmark with command-line options (sweep_10k, pruning_savings) would read as an unknown argument.
_RUN = (
    "import importlib, json, sys; sys.argv = sys.argv[1:2]; r = importlib.import_module(sys.argv[0]).main(); "
    f"print('BENCH-RESULT ' + json.dumps({{**{{k: r[k] for k in {_KEYS!r}}}, "
    "'better': r['details'].get('better'), 'targets': r['details'].get('targets', [])}))"
)


def _fmt(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    return f"{value:.4g}"


def rows(module: str, result: dict[str, Any] | None) -> list[tuple[str, str, str, str, str]]:
    """Table rows of one benchmark: one per target; a failed benchmark or one without targets is one row, not met."""
    if result is None:
        return [(module, "-", "-", "benchmark failed", "no")]
    if not result["targets"]:
        return [(result["name"], _fmt(result["value"]), result["unit"], "no target declared", "no")]
    out = []
    for t in result["targets"]:
        unit = result["unit"] if t["metric"] == "value" else t.get("unit", "x" if t["metric"] == "ratio" else "")
        label = f"{t['metric']} {t['op']} {_fmt(t['threshold'])}"
        out.append((result["name"], _fmt(t["value"]), unit, label, "yes" if t["met"] else "no"))
    return out


def table(lines: list[tuple[str, str, str, str, str]]) -> str:
    header = ("benchmark", "value", "unit", "target", "met")
    widths = [max(len(r[i]) for r in [header, *lines]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*r).rstrip() for r in [header, tuple("-" * w for w in widths), *lines])


def run_one(module: str) -> dict[str, Any] | None:
    """Run `module.main()` in a fresh interpreter; its result line, or None when it failed (its output goes to
    stderr)."""
    env = {**os.environ, STARTED_ENV: started_marker()}
    proc = subprocess.run(
        [sys.executable, "-c", _RUN, module], cwd=ROOT, stdout=subprocess.PIPE, text=True, check=False, env=env
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("BENCH-RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-4000:])
        print(json.dumps({"benchmark": module, "failed": f"exit code {proc.returncode}"}), flush=True)
        return None
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("BENCH-RESULT "))
    print(json.dumps(result), flush=True)
    return result


def main(names: list[str]) -> int:
    modules = names or BENCHMARKS
    results = {module: run_one(module) for module in modules}
    lines = [row for module, result in results.items() for row in rows(module, result)]
    print("\n" + table(lines), flush=True)
    failed = [m for m, r in results.items() if r is None]
    missed = sorted({r[0] for r in lines if r[4] != "yes"} - set(failed))
    if failed:
        print(f"failed: {', '.join(failed)} (their output is above)", file=sys.stderr)
    if missed:
        print(f"targets missed or not declared: {', '.join(missed)}", file=sys.stderr)
    return 1 if failed or missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
