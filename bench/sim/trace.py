"""A synthetic multi-team trace at a chosen offered load: many short GBT and sweep jobs, interactive sessions, gangs.

Every kind arrives as a Poisson process whose rate is set so that, in
expectation, the kind brings its `mix` share of `load` x the cluster's
GPU-hours of work (`TraceConfig.rates`); the realised load of one seed is
`offered_load`. Durations are log-normal around a median (gangs: log-uniform
between `gang_days`); teams are drawn per kind from weights (the tabular team
runs most GBT jobs, language and vision own most gangs). Gang sizes are drawn
from `gang_gpus` with weights 1/size, so every size brings the same expected
GPU-hours, and a gang goes to a team whose quota holds it. Gangs checkpoint at
the Young/Daly interval for their node count, as the platform's default
`CheckpointPolicy` does. Node failures are exponential per node with the given
MTBF. Everything is drawn from one seeded `random.Random`, so (config, seed)
names a trace.

With `exact_load` (the default) every job's work is then scaled by `load` /
realised load, so that each trace offers exactly `load`: without it, a few
multi-day 256-GPU gangs more or less move a 14-day trace's load by +-0.2, and
traces meant for 0.7 and 0.9 overlap.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field

from bench.sim.model import Cluster, Failure, Job, TraceError


def young_daly_hours(save_hours: float, node_mtbf_hours: float, nodes: int) -> float:
    """Checkpoint interval sqrt(2 x save time x job MTBF), job MTBF = node MTBF / nodes."""
    return math.sqrt(2.0 * save_hours * node_mtbf_hours / max(1, nodes))


@dataclass(frozen=True)
class TraceConfig:
    """Shape of the synthetic trace and cluster (times in hours unless named in days).

    `load` is the offered load: requested GPU-hours of work / (GPUs x horizon),
    exactly with `exact_load`, else in expectation; `mix` splits it between the
    kinds (shares summing to 1, in expectation).
    """

    days: float = 14.0
    nodes: int = 64
    gpus_per_node: int = 8
    load: float = 0.9
    mix: dict[str, float] = field(
        default_factory=lambda: {"gang": 0.45, "sweep": 0.45, "interactive": 0.07, "gbt": 0.03}
    )
    quotas: dict[str, int] = field(
        default_factory=lambda: {"language": 256, "vision": 96, "ranking": 64, "speech": 48, "tabular": 48}
    )
    gbt_median_hours: float = 0.33
    trials_per_sweep: tuple[int, int] = (8, 32)
    trial_median_hours: float = 2.0
    interactive_median_hours: float = 1.5
    gang_gpus: tuple[int, ...] = (16, 32, 64, 128, 256)
    gang_days: tuple[float, float] = (0.5, 4.0)
    node_mtbf_hours: float = 1500.0
    repair_hours: float = 8.0
    gang_save_hours: float = 0.05
    gang_checkpoint_hours: float | None = None  # None: Young/Daly
    exact_load: bool = True

    def __post_init__(self) -> None:
        if not self.load > 0:
            raise TraceError(f"trace: load must be > 0, got {self.load}")
        if (
            set(self.mix) != set(_TEAMS)
            or any(v < 0 for v in self.mix.values())
            or not math.isclose(sum(self.mix.values()), 1.0)
        ):
            raise TraceError(
                f"trace: mix must give a share >= 0 to each of {sorted(_TEAMS)}, summing to 1; got {self.mix}"
            )
        for g in self.gang_gpus:
            if g <= self.gpus_per_node or g % self.gpus_per_node:
                raise TraceError(
                    f"trace: gang_gpus {g} must be a multiple of gpus_per_node {self.gpus_per_node} above it"
                )
            if not any(self.quotas.get(t, 0) >= g for t in _TEAMS["gang"]):
                raise TraceError(f"trace: no gang team ({sorted(_TEAMS['gang'])}) has a quota of gang_gpus {g}")

    @property
    def horizon(self) -> float:
        return self.days * 24.0

    def cluster(self) -> Cluster:
        return Cluster(self.nodes, self.gpus_per_node, self.repair_hours)

    def rates(self) -> dict[str, float]:
        """Arrivals per day of each kind (sweeps, not trials) that give `load` in expectation."""
        per_day = self.load * self.nodes * self.gpus_per_node * 24.0
        return {kind: self.mix[kind] * per_day / _expected_gpu_hours(self, kind) for kind in _TEAMS}


_TEAMS = {
    "gbt": {"tabular": 4, "ranking": 3, "vision": 1, "language": 1, "speech": 1},
    "sweep": {"vision": 3, "ranking": 2, "speech": 2, "language": 2, "tabular": 1},
    "interactive": {"vision": 1, "ranking": 1, "speech": 1, "language": 1, "tabular": 1},
    "gang": {"language": 3, "vision": 2, "speech": 1},
}
_SIGMA = {"gbt": 0.6, "sweep": 0.7, "interactive": 0.5}
_FLOOR = {"gbt": 0.02, "sweep": 0.1, "interactive": 0.1}
_SMALL_GPUS = (1, 2, 4, 8)


def _clipped_lognormal_mean(median: float, sigma: float, floor: float) -> float:
    """E[max(floor, median x exp(N(0, sigma)))]."""
    z = math.log(floor / median) / sigma
    phi = lambda x: 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))
    return floor * phi(z) + median * math.exp(sigma * sigma / 2) * phi(sigma - z)


def _gang_sizes(cfg: TraceConfig) -> tuple[tuple[int, ...], list[float]]:
    return cfg.gang_gpus, [1.0 / g for g in cfg.gang_gpus]


def _expected_gpu_hours(cfg: TraceConfig, kind: str) -> float:
    """Expected requested GPU-hours of one arrival of `kind` (a whole sweep for `sweep`)."""
    small = sum(_SMALL_GPUS) / len(_SMALL_GPUS)
    if kind == "gbt":
        return _clipped_lognormal_mean(cfg.gbt_median_hours, _SIGMA["gbt"], _FLOOR["gbt"])
    if kind == "sweep":
        trials = sum(cfg.trials_per_sweep) / 2
        return trials * small * _clipped_lognormal_mean(cfg.trial_median_hours, _SIGMA["sweep"], _FLOOR["sweep"])
    if kind == "interactive":
        return small * _clipped_lognormal_mean(
            cfg.interactive_median_hours, _SIGMA["interactive"], _FLOOR["interactive"]
        )
    sizes, weights = _gang_sizes(cfg)
    gpus = sum(s * w for s, w in zip(sizes, weights)) / sum(weights)
    lo, hi = cfg.gang_days
    days = lo if math.isclose(lo, hi) else (hi - lo) / math.log(hi / lo)
    return gpus * days * 24.0


def _team(rng: random.Random, kind: str, eligible: set[str] | None = None) -> str:
    weights = {t: w for t, w in _TEAMS[kind].items() if eligible is None or t in eligible}
    return rng.choices(sorted(weights), [weights[t] for t in sorted(weights)])[0]


def _arrivals(rng: random.Random, per_day: float, hours: float) -> list[float]:
    out, t = [], 0.0
    while per_day > 0:
        t += rng.expovariate(per_day / 24.0)
        if t >= hours:
            return out
        out.append(t)
    return out


def _lognormal(rng: random.Random, kind: str, median: float) -> float:
    return max(_FLOOR[kind], median * math.exp(rng.gauss(0.0, _SIGMA[kind])))


def synthetic_jobs(cfg: TraceConfig, seed: int) -> list[Job]:
    """The jobs of one seeded trace, sorted by submission time."""
    rng = random.Random(seed)
    hours, rates = cfg.horizon, cfg.rates()
    jobs: list[Job] = []
    for i, t in enumerate(_arrivals(rng, rates["gbt"], hours)):
        jobs.append(Job(f"gbt-{i:05d}", _team(rng, "gbt"), "gbt", rng.choice(["production", "sweep"]), t, 1,
                        _lognormal(rng, "gbt", cfg.gbt_median_hours), 0.05, 0.001, 0.01))
    for s, t in enumerate(_arrivals(rng, rates["sweep"], hours)):
        team = _team(rng, "sweep")
        gpus = rng.choice(_SMALL_GPUS)
        for k in range(rng.randint(*cfg.trials_per_sweep)):
            jobs.append(Job(f"sweep-{s:04d}-{k:02d}", team, "sweep", "sweep", t + 0.01 * k, gpus,
                            _lognormal(rng, "sweep", cfg.trial_median_hours), 0.5, 0.02, 0.05))
    for i, t in enumerate(_arrivals(rng, rates["interactive"], hours)):
        jobs.append(
            Job(
                f"interactive-{i:04d}",
                _team(rng, "interactive"),
                "interactive",
                "interactive",
                t,
                rng.choice(_SMALL_GPUS),
                _lognormal(rng, "interactive", cfg.interactive_median_hours),
                None,
                0.0,
                0.02,
            )
        )
    sizes, weights = _gang_sizes(cfg)
    lo, hi = cfg.gang_days
    for i, t in enumerate(_arrivals(rng, rates["gang"], hours)):
        gpus = rng.choices(sizes, weights)[0]
        # A gang goes to a team whose quota holds it, so admitting it never needs borrowing.
        team = _team(rng, "gang", {t for t in _TEAMS["gang"] if cfg.quotas.get(t, 0) >= gpus})
        nodes = gpus // cfg.gpus_per_node
        interval = cfg.gang_checkpoint_hours or young_daly_hours(cfg.gang_save_hours, cfg.node_mtbf_hours, nodes)
        days = lo * math.exp(rng.uniform(0.0, math.log(hi / lo)))
        jobs.append(
            Job(f"gang-{i:03d}", team, "gang", "production", t, gpus, 24.0 * days, interval, cfg.gang_save_hours, 0.25)
        )
    jobs.sort(key=lambda j: (j.submit, j.id))
    if cfg.exact_load and jobs:
        scale = cfg.load / offered_load(jobs, cfg.cluster(), hours)
        jobs = [dataclasses.replace(j, work=j.work * scale) for j in jobs]
    return jobs


def node_failures(nodes: int, mtbf_hours: float, hours: float, seed: int) -> list[Failure]:
    """Exponential failures per node (a renewal process), sorted by time."""
    rng = random.Random(f"failures-{seed}")
    out = []
    for n in range(nodes):
        t = rng.expovariate(1.0 / mtbf_hours)
        while t < hours:
            out.append(Failure(t, n))
            t += rng.expovariate(1.0 / mtbf_hours)
    return sorted(out, key=lambda f: (f.time, f.node))


def offered_load(jobs: list[Job], cluster: Cluster, hours: float) -> float:
    """Requested GPU-hours of work over the cluster's GPU-hours."""
    return sum(j.gpus * j.work for j in jobs) / (cluster.gpus * hours)
