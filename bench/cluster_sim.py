"""Cluster simulator benchmark: the platform's scheduling policy against Kueue's StrictFIFO and BestEffortFIFO.

Trace (`bench.sim.trace.TraceConfig`): 64 nodes x 8 GPUs (512), five teams
with quotas, 14 days of which the first 2 are warm-up (the cluster starts
empty); GBT jobs, sweeps of 8-32 trials, interactive sessions and gangs of 16
to 256 GPUs (each size bringing the same expected GPU-hours) running half a
day to four days; node failures at a 1500 h MTBF with 8 h repairs. Arrival
rates are set for an offered load of 0.7, 0.9 (nominal) and 1.1 x capacity;
each (load, seed) is one trace that every policy replays.

Policies:
- `strict_fifo`: Kueue StrictFIFO: priority class, then arrival; the first job
  that does not fit blocks every later one. No quotas, no preemption.
- `best_effort_fifo`: Kueue BestEffortFIFO (what deploy/ ships): the same
  order, but a job that does not fit does not block later jobs that fit; no
  reservation for it. No quotas, no preemption.
- `platform` (docs/cluster_policy.md): what deploy/ ships: priority classes,
  within-quota before borrowing, Kueue's BestEffortFIFO passing (a later job
  that fits starts; no reservation is held), checkpoint-aware preemption of
  sweep-class jobs only.
- with `--ablations`: `platform_easy_reservation` (the platform plus EASY
  backfill: the first blocked job holds a reservation; a design option, not
  shipped) and `platform_no_preemption`.

Figures per run (`SimResult.metrics`): effective utilization (useful GPU-hours
/ capacity after warm-up; the headline "utilization"), busy utilization (GPU-hours
held), p95 job completion time and p95 gang time-to-start (submission to first
start) of jobs submitted after warm-up, censored at the horizon. Across seeds:
mean and 95% Student-t interval; platform - baseline as a paired (same seeds)
interval.

Value: the platform's effective utilization at the nominal load; baseline:
BestEffortFIFO's; ratio = platform / BestEffortFIFO (higher is better).

Run: `python -m bench.cluster_sim [--seeds N] [--loads 0.7 0.9 1.1] [--workers W] [--ablations] [--checkpoint-study]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Optional, Sequence

from bench.harness import write_result
from bench.sim import Policy, TraceConfig, node_failures, simulate, synthetic_jobs
from bench.sim.stats import paired_difference, t_interval
from bench.sim.trace import offered_load

LOADS = (0.7, 0.9, 1.1)
NOMINAL = 0.9
SEEDS = 10
DAYS = TraceConfig().days
WARMUP_HOURS = 48.0
BASELINE = "best_effort_fifo"
HEADLINE = "effective_utilization"
# metric -> the direction that is better
METRICS = {
    "effective_utilization": "higher",
    "utilization": "higher",
    "p95_completion_hours": "lower",
    "p95_gang_start_hours": "lower",
    "p95_wait_hours_interactive": "lower",
    "p95_wait_hours_production": "lower",
    "p95_wait_hours_sweep": "lower",
    "preemptions": "lower",
    "unfinished": "lower",
    "gangs_not_started": "lower",
}
UTILIZATION_TARGET = 0.9


def policies(cfg: TraceConfig, ablations: bool = False) -> dict[str, Policy]:
    """The compared policies; with `ablations`, also the platform with an EASY reservation (not shipped: Kueue holds
    none) and without preemption.

    `platform` is what deploy/ ships (Kueue ClusterQueues with the platform's classes, quotas and preemption, and
    BestEffortFIFO's passing without a reservation). Until 2026-12-06 the headline was the platform with an EASY
    reservation, which deploy/ never had (docs/cluster_policy.md says why it changed)."""
    platform = Policy(
        "platform", order="priority", backfill=True, reserve=False, preemption=True, quotas=dict(cfg.quotas)
    )
    out = {
        "strict_fifo": Policy("strict_fifo", order="strict_fifo"),
        "best_effort_fifo": Policy("best_effort_fifo", order="best_effort_fifo"),
        "platform": platform,
    }
    if ablations:
        out["platform_easy_reservation"] = dataclasses.replace(platform, name="platform_easy_reservation", reserve=True)
        out["platform_no_preemption"] = dataclasses.replace(platform, name="platform_no_preemption", preemption=False)
    return out


def run_trace(cfg: TraceConfig, seed: int, warmup: float = WARMUP_HOURS, ablations: bool = False) -> dict[str, Any]:
    """Every policy on the trace (cfg, seed): their `SimResult.metrics`, the realised offered load, CPU seconds."""
    started = time.process_time()
    jobs = synthetic_jobs(cfg, seed)
    failures = node_failures(cfg.nodes, cfg.node_mtbf_hours, cfg.horizon, seed)
    out: dict[str, Any] = {
        "seed": seed,
        "load": cfg.load,
        "offered_load": offered_load(jobs, cfg.cluster(), cfg.horizon),
        "jobs": len(jobs),
        "node_failures": len(failures),
        "policies": {},
    }
    for name, policy in policies(cfg, ablations).items():
        out["policies"][name] = simulate(jobs, failures, cfg.cluster(), policy, cfg.horizon, warmup).metrics()
    out["cpu_seconds"] = time.process_time() - started
    return out


def _run_task(task: tuple[TraceConfig, int, float, bool]) -> dict[str, Any]:
    return run_trace(*task)


def run(base: TraceConfig, loads: Sequence[float], seeds: int, warmup: float = WARMUP_HOURS, workers: int = 1,
        ablations: bool = False) -> list[dict[str, Any]]:
    """`run_trace` for every (load, seed), in `workers` processes; results in (load, seed) order."""
    tasks = [(dataclasses.replace(base, load=load), seed, warmup, ablations) for load in loads for seed in range(seeds)]
    if workers <= 1:
        return [_run_task(t) for t in tasks]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(_run_task, tasks))


def aggregate(runs: list[dict[str, Any]], baseline: str = BASELINE) -> dict[str, Any]:
    """Per load: each policy's metrics across seeds (mean, 95% t-interval, per seed) and each policy minus `baseline`
    paired by seed."""
    by_load: dict[str, Any] = {}
    for load in sorted({r["load"] for r in runs}):
        group = sorted((r for r in runs if r["load"] == load), key=lambda r: r["seed"])
        names = list(group[0]["policies"])
        per_seed = {p: {m: [r["policies"][p][m] for r in group] for m in METRICS} for p in names}
        by_load[f"{load:g}"] = {
            "seeds": [r["seed"] for r in group],
            "offered_load": t_interval([r["offered_load"] for r in group]),
            "policies": {
                p: {m: {**t_interval(v), "per_seed": v} for m, v in metrics.items()} for p, metrics in per_seed.items()
            },
            "vs_" + baseline: {
                p: {m: paired_difference(per_seed[p][m], per_seed[baseline][m]) for m in METRICS}
                for p in names
                if p != baseline
            },
        }
    return by_load


def nominal_figures(by_load: dict[str, Any], nominal: float = NOMINAL, baseline: str = BASELINE) -> dict[str, float]:
    """The figures the targets read (`details.nominal.<key>`), at the nominal load."""
    at = by_load[f"{nominal:g}"]
    diff = at["vs_" + baseline]["platform"]
    return {
        "load": nominal,
        "platform_effective_utilization": at["policies"]["platform"][HEADLINE]["mean"],
        "effective_utilization_gain_ci_low": diff[HEADLINE]["ci_low"],
        "effective_utilization_gain_ci_high": diff[HEADLINE]["ci_high"],
        "p95_gang_start_change_hours_ci_low": diff["p95_gang_start_hours"]["ci_low"],
        "p95_gang_start_change_hours_ci_high": diff["p95_gang_start_hours"]["ci_high"],
    }


def targets(figures: dict[str, float], baseline: str = BASELINE) -> list[dict[str, Any]]:
    """The issue's targets at the nominal load: the platform beats `baseline` on utilization and on p95 gang
    time-to-start (the 95% interval of the paired difference clear of 0), and reaches 0.9 effective utilization."""
    load = f"{figures['load']:g}"
    rows = [
        (
            "platform_effective_utilization",
            ">=",
            UTILIZATION_TARGET,
            f"platform effective utilization at load {load}, mean over seeds",
        ),
        (
            "effective_utilization_gain_ci_low",
            ">=",
            0.0,
            f"platform - {baseline} effective utilization at load {load}: the 95% interval's low end (above 0 = "
            "platform better)",
        ),
        (
            "p95_gang_start_change_hours_ci_high",
            "<=",
            0.0,
            f"platform - {baseline} p95 gang time-to-start (hours) at load {load}: the 95% interval's high end (below "
            "0 = platform better)",
        ),
    ]
    return [
        {"metric": f"details.nominal.{key}", "op": op, "threshold": threshold, "value": figures[key],
         "met": figures[key] >= threshold if op == ">=" else figures[key] <= threshold, "description": text}
        for key, op, threshold, text in rows
    ]


def table(
    by_load: dict[str, Any],
    metrics: Sequence[str] = (HEADLINE, "utilization", "p95_completion_hours", "p95_gang_start_hours"),
) -> list[str]:
    """Markdown rows: load, policy, then each metric as `mean [low, high]`; differences to the baseline last."""
    def cell(s: dict[str, float]) -> str:
        return (
            f"{s['mean']:.3f} [{s['ci_low']:.3f}, {s['ci_high']:.3f}]"
            if abs(s["mean"]) < 10
            else f"{s['mean']:.1f} [{s['ci_low']:.1f}, {s['ci_high']:.1f}]"
        )

    lines = ["| load | policy | " + " | ".join(metrics) + " |", "|---|---|" + "---|" * len(metrics)]
    for load, at in by_load.items():
        for name, stats in at["policies"].items():
            lines.append(f"| {load} | {name} | " + " | ".join(cell(stats[m]) for m in metrics) + " |")
        for name, diff in at["vs_" + BASELINE].items():
            lines.append(f"| {load} | {name} - {BASELINE} | " + " | ".join(cell(diff[m]) for m in metrics) + " |")
    return lines


def checkpoint_study(base: TraceConfig, seeds: int, warmup: float = WARMUP_HOURS) -> dict[str, Any]:
    """Gang goodput (useful / held GPU-hours of gangs) under the platform at each gang checkpoint interval."""
    out: dict[str, Any] = {}
    for label, hours in (("young_daly", None), ("1h", 1.0), ("12h", 12.0)):
        cfg = dataclasses.replace(base, gang_checkpoint_hours=hours)
        goodput, lost = [], []
        for seed in range(seeds):
            r = simulate(
                synthetic_jobs(cfg, seed),
                node_failures(cfg.nodes, cfg.node_mtbf_hours, cfg.horizon, seed),
                cfg.cluster(),
                policies(cfg)["platform"],
                cfg.horizon,
                warmup,
            )
            gangs = [o for o in r.outcomes.values() if o.job.kind == "gang"]
            goodput.append(sum(o.useful for o in gangs) / max(1e-9, sum(o.allocated for o in gangs)))
            lost.append(sum(o.lost for o in gangs))
        out[label] = {"gang_goodput": t_interval(goodput), "gang_lost_gpu_hours": t_interval(lost)}
    return out


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster_sim", description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=SEEDS, help="traces per load (>= 2 for intervals)")
    parser.add_argument(
        "--loads", type=float, nargs="+", default=list(LOADS), help=f"offered loads; must include the nominal {NOMINAL}"
    )
    parser.add_argument("--days", type=float, default=DAYS)
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument(
        "--ablations",
        action="store_true",
        help="also the platform with an EASY reservation / without preemption (slower)",
    )
    parser.add_argument(
        "--checkpoint-study", action="store_true", help="also compare gang checkpoint intervals (slower)"
    )
    args = parser.parse_args(argv or [])
    if args.seeds < 2:
        parser.error(f"--seeds must be >= 2 to give an interval, got {args.seeds}")
    if NOMINAL not in args.loads:
        parser.error(f"--loads must include the nominal load {NOMINAL}, got {args.loads}")
    base = TraceConfig(days=args.days, load=NOMINAL)
    started = time.perf_counter()
    runs = run(base, args.loads, args.seeds, WARMUP_HOURS, args.workers, args.ablations)
    by_load = aggregate(runs)
    figures = nominal_figures(by_load)
    goals = targets(figures)
    details: dict[str, Any] = {
        "targets": goals,
        "better": "higher",
        "nominal": figures,
        "all_targets_met": all(t["met"] for t in goals),
        "table": table(by_load),
        "loads": by_load,
        "nominal_load": NOMINAL,
        "baseline_policy": BASELINE,
        "ratio": f"platform / {BASELINE} effective utilization at load {NOMINAL:g}; higher is better",
        "trace": {
            **dataclasses.asdict(base),
            "load": list(args.loads),
            "seeds": args.seeds,
            "warmup_hours": WARMUP_HOURS,
        },
        "policies": {name: dataclasses.asdict(p) for name, p in policies(base, args.ablations).items()},
        "metrics": "effective_utilization = useful GPU-hours / (GPUs x (horizon - warm-up)); utilization = GPU-hours "
                   "held / same; "
        "p95_completion_hours = nearest-rank p95 of finish - submit, p95_gang_start_hours = of first start - submit of "
        "multi-node jobs, p95_wait_hours_<class> = of first start - submit; jobs submitted after the warm-up, a job "
        "not finished / not started counts with its time to the horizon",
        "intervals": "mean over seeds with a 95% Student-t interval; vs_<baseline>: paired (same seed) difference "
                     "policy - baseline",
        "runs": [{k: v for k, v in r.items() if k != "policies"} for r in runs],
        "cpu_seconds": round(sum(r["cpu_seconds"] for r in runs), 1),
        "workers": args.workers,
    }
    if args.checkpoint_study:
        details["gang_checkpoint_interval"] = checkpoint_study(base, min(args.seeds, 3))
    details["wall_seconds"] = round(time.perf_counter() - started, 1)
    nominal = by_load[f"{NOMINAL:g}"]["policies"]
    return write_result("cluster_sim", nominal["platform"][HEADLINE]["mean"], "fraction of GPU-hours (useful)",
                        nominal[BASELINE][HEADLINE]["mean"], details)


if __name__ == "__main__":
    import sys

    result = main(sys.argv[1:])
    print("\n".join(result["details"]["table"]))
    print(json.dumps(result["details"]["targets"], indent=2))
