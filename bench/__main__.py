"""`make bench`: run every benchmark and write bench/results/<name>.json."""

from __future__ import annotations

import importlib
import json
import sys

BENCHMARKS = ["bench.overhead", "bench.checkpoint_blocking", "bench.recovery", "bench.planner_memory", "bench.validation_throughput", "bench.ingest_memory", "bench.gbt_overhead", "bench.cluster_sim", "bench.sweep_10k", "bench.pruning_savings"]


def main(names: list[str]) -> int:
    for module in names or BENCHMARKS:
        record = importlib.import_module(module).main()
        print(json.dumps({k: record[k] for k in ("name", "value", "unit", "baseline", "ratio")}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
