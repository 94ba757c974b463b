"""A synthetic multi-team trace: many short GBT and sweep jobs, interactive sessions, a few multi-week gangs.

Arrivals are Poisson per kind; durations log-normal around a median; teams are
drawn per kind from weights (the tabular team runs most GBT jobs, language and
vision own the gangs). Gangs checkpoint at the Young/Daly interval for their
node count, as the platform's default `CheckpointPolicy` does. Node failures are
exponential per node with the given MTBF. Everything is drawn from one seeded
`random.Random`, so a seed names a trace.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from bench.sim.model import Cluster, Failure, Job


def young_daly_hours(save_hours: float, node_mtbf_hours: float, nodes: int) -> float:
    """Checkpoint interval sqrt(2 x save time x job MTBF), job MTBF = node MTBF / nodes."""
    return math.sqrt(2.0 * save_hours * node_mtbf_hours / max(1, nodes))


@dataclass(frozen=True)
class TraceConfig:
    """Shape of the synthetic trace and cluster (times in hours unless named in days)."""

    days: float = 28.0
    nodes: int = 32
    gpus_per_node: int = 8
    quotas: dict[str, int] = field(
        default_factory=lambda: {"language": 96, "vision": 64, "ranking": 40, "speech": 32, "tabular": 24}
    )
    gbt_per_day: float = 200.0
    gbt_median_hours: float = 0.33
    sweeps_per_day: float = 18.0
    trials_per_sweep: tuple[int, int] = (8, 32)
    trial_median_hours: float = 2.0
    interactive_per_day: float = 30.0
    interactive_median_hours: float = 1.5
    gangs: int = 5
    gang_nodes: tuple[int, int] = (8, 16)
    gang_days: tuple[float, float] = (5.0, 14.0)
    node_mtbf_hours: float = 1500.0
    repair_hours: float = 8.0
    gang_save_hours: float = 0.05
    gang_checkpoint_hours: float | None = None  # None: Young/Daly

    @property
    def horizon(self) -> float:
        return self.days * 24.0

    def cluster(self) -> Cluster:
        return Cluster(self.nodes, self.gpus_per_node, self.repair_hours)


_TEAMS = {
    "gbt": {"tabular": 4, "ranking": 3, "vision": 1, "language": 1, "speech": 1},
    "sweep": {"vision": 3, "ranking": 2, "speech": 2, "language": 2, "tabular": 1},
    "interactive": {"vision": 1, "ranking": 1, "speech": 1, "language": 1, "tabular": 1},
    "gang": {"language": 3, "vision": 2, "speech": 1},
}


def _team(rng: random.Random, kind: str) -> str:
    weights = _TEAMS[kind]
    return rng.choices(sorted(weights), [weights[t] for t in sorted(weights)])[0]


def _arrivals(rng: random.Random, per_day: float, hours: float) -> list[float]:
    out, t = [], 0.0
    while per_day > 0:
        t += rng.expovariate(per_day / 24.0)
        if t >= hours:
            return out
        out.append(t)
    return out


def _lognormal(rng: random.Random, median: float, sigma: float = 0.7) -> float:
    return median * math.exp(rng.gauss(0.0, sigma))


def synthetic_jobs(cfg: TraceConfig, seed: int) -> list[Job]:
    """The jobs of one seeded trace, sorted by submission time."""
    rng = random.Random(seed)
    hours = cfg.horizon
    jobs: list[Job] = []
    for i, t in enumerate(_arrivals(rng, cfg.gbt_per_day, hours)):
        jobs.append(Job(f"gbt-{i:05d}", _team(rng, "gbt"), "gbt", rng.choice(["production", "sweep"]), t, 1,
                        max(0.02, _lognormal(rng, cfg.gbt_median_hours, 0.6)), 0.05, 0.001, 0.01))
    for s, t in enumerate(_arrivals(rng, cfg.sweeps_per_day, hours)):
        team = _team(rng, "sweep")
        gpus = rng.choice([1, 2, 4, 8])
        for k in range(rng.randint(*cfg.trials_per_sweep)):
            jobs.append(Job(f"sweep-{s:04d}-{k:02d}", team, "sweep", "sweep", t + 0.01 * k, gpus,
                            max(0.1, _lognormal(rng, cfg.trial_median_hours)), 0.5, 0.02, 0.05))
    for i, t in enumerate(_arrivals(rng, cfg.interactive_per_day, hours)):
        jobs.append(Job(f"interactive-{i:04d}", _team(rng, "interactive"), "interactive", "interactive", t,
                        rng.choice([1, 2, 4, 8]), max(0.1, _lognormal(rng, cfg.interactive_median_hours, 0.5)), None, 0.0, 0.02))
    for i in range(cfg.gangs):
        team = _team(rng, "gang")
        # A gang fits within its team's quota, so admitting it never needs borrowing.
        nodes = min(rng.randint(*cfg.gang_nodes), max(1, cfg.quotas.get(team, 0) // cfg.gpus_per_node))
        interval = cfg.gang_checkpoint_hours or young_daly_hours(cfg.gang_save_hours, cfg.node_mtbf_hours, nodes)
        jobs.append(Job(f"gang-{i:02d}", team, "gang", "production", rng.uniform(0.0, hours / 3),
                        nodes * cfg.gpus_per_node, 24.0 * rng.uniform(*cfg.gang_days), interval, cfg.gang_save_hours, 0.25))
    return sorted(jobs, key=lambda j: (j.submit, j.id))


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
