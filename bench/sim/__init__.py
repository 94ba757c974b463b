"""A discrete-event simulator of a shared GPU cluster under different scheduling policies (pure Python)."""

from bench.sim.engine import simulate
from bench.sim.model import PRIORITIES, Cluster, Failure, Job, Policy, TraceError
from bench.sim.result import JobOutcome, SimResult
from bench.sim.trace import TraceConfig, node_failures, synthetic_jobs, young_daly_hours

__all__ = [
    "PRIORITIES", "Cluster", "Failure", "Job", "JobOutcome", "Policy", "SimResult", "TraceConfig", "TraceError",
    "node_failures", "simulate", "synthetic_jobs", "young_daly_hours",
]
