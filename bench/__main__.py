"""`make bench`: run every benchmark, each in a fresh process, and write bench/results/<name>.json.

A fresh interpreter per benchmark keeps them from measuring each other: a
memory benchmark run after a 1.2 GB checkpoint benchmark in the same process
would inherit that process's pages and threads (and its spawned children its
high-water mark). `python -m bench bench.pruning_savings ...` runs only those.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = ["bench.overhead", "bench.checkpoint_blocking", "bench.recovery", "bench.planner_memory", "bench.validation_throughput", "bench.ingest_memory", "bench.gbt_overhead", "bench.cluster_sim", "bench.sweep_10k", "bench.pruning_savings"]
ROOT = Path(__file__).resolve().parent.parent
_RUN = "import importlib, json, sys; r = importlib.import_module(sys.argv[1]).main(); print('BENCH-RESULT ' + json.dumps({k: r[k] for k in ('name', 'value', 'unit', 'baseline', 'ratio')}))"


def main(names: list[str]) -> int:
    failed = []
    for module in names or BENCHMARKS:
        proc = subprocess.run([sys.executable, "-c", _RUN, module], cwd=ROOT, stdout=subprocess.PIPE, text=True, check=False)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("BENCH-RESULT ")]
        if proc.returncode != 0 or not lines:
            failed.append(module)
            sys.stderr.write(proc.stdout[-4000:])
            print(json.dumps({"benchmark": module, "failed": f"exit code {proc.returncode}"}), flush=True)
            continue
        print(lines[-1].removeprefix("BENCH-RESULT "), flush=True)
    if failed:
        print(f"failed: {', '.join(failed)} (their output is above)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
