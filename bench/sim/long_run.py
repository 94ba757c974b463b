"""One week-long training run on 256 GPUs under failures: how much of the week trains, with and without elastic
mechanisms.

The cluster simulator (`bench.sim.engine`) replays many jobs on a shared
cluster; this model follows ONE gang (32 nodes x 8 GPUs, `RunConfig`) through
a week of interruptions and measures its effective training time ratio:
progress in full-size-gang hours / wall hours (a gang of n of N nodes makes
progress at n / N of the full rate: data parallel, the global batch kept).
Times are hours unless the field says seconds.

Failure rate (published): Meta, "The Llama 3 Herd of Models" (2024), section
3.3.4 and Table 5: a 54-day snapshot of pre-training on up to 16,384 H100 GPUs
had 466 job interruptions, 47 planned and 419 unexpected, about 78% of the
unexpected ones attributed to confirmed or suspected hardware. Per GPU-hour::

    419 / (54 days x 24 h x 16,384 GPUs) = 419 / 21,233,664 = 1.973e-5 unexpected interruptions per GPU-hour

(a lower bound: the job did not always run on all 16,384 GPUs). At 256 GPUs that
is 5.05e-3 per hour: a job MTBF of 198 h, 0.85 interruptions expected in a week;
per 8-GPU node an MTBF of 6,336 h (the `node_mtbf_hours` the Young/Daly interval
is computed from, as `training.checkpointing.writer.young_daly_interval` does).

What an interruption is here (shares of the 419, from Table 5's counts):

- `node_loss` (356 / 419 = 85.0%): every GPU (268: faulty GPU 148, HBM3 72, SRAM
  19, system processor 17, thermal 6, silent data corruption 6), host (21: NIC,
  SSD, power supply, chassis, IO board, CPU, memory), network switch/cable (35)
  and unplanned host maintenance (32) interruption. The node is cordoned and the
  gang needs another one. An upper bound: the paper does not say how many nodes
  came back after a reset; treating all as lost favours the mechanisms.
- `hang` (20.5 / 419 = 4.9%): the 7 NCCL watchdog timeouts (hangs by definition)
  plus a quarter of the 54 software bugs (an assumption: deadlocks in a data
  loader or collective, stalled I/O; the paper does not split bugs into crashes
  and hangs). A share `silent_hang_share` (0.25, assumed) never raises on any
  rank (every rank stuck outside a collective, e.g. on I/O, or a kernel the
  NCCL watchdog cannot abort): without hang detection a person notices it after
  Uniform(0, `notice_hours`) hours (someone looks at the run twice a day); the
  others end at the 600 s process-group timeout. An in-job restart fixes a hang.
- `transient` (the rest, 42.5 / 419 = 10.1%: the other software bugs and
  dependencies): a rank raises at once and torchrun's in-job restart on the same
  nodes fixes it.

Transients and hangs strike a training gang at a rate proportional to its size;
node losses strike the nodes the gang holds (`Interruption.strike`). Events that
find the gang not training (restarting, waiting) are dropped for transients and
hangs: they strike running processes.

Replacement nodes (a busy cluster, assumed): with probability `free_node_share`
(0.5) a free node is admitted after Exp(mean `free_node_minutes` = 10 min); else
the cluster is full and a node frees when another job ends: LogNormal(median
`busy_median_hours` = 3 h, sigma 1.0; mean 4.9 h, p90 10.8 h).

Checkpoints: every Young/Daly interval sqrt(2 x save x node_mtbf / n) of training
for the gang's CURRENT size n (2.57 h at 32 nodes), each blocking `save_seconds`
(60 s; a synchronous save, conservative for the async writer). Restart costs: a
relaunch of the gang (pods, workers, rendezvous: 300 s) or torchrun's in-job
restart (90 s), plus the checkpoint's load (120 s), plus resharding when the size
changed (60 s); the work since the last committed checkpoint is lost. A lost
node is noticed after min(Kubernetes' not-ready eviction, 40 s + 300 s; the
process-group timeout, 600 s; the hang watchdog's timeout where it runs).

Policies (`Policy`): the baseline waits for a replacement while holding the
gang's quota, and catches hangs only by the process-group timeout (silent hangs
by a person); `continue_smaller` is what `resources.k8s.elastic` does: after a
bound (`resize_after_seconds`, 120 s) without the lost node it relaunches at the
largest size in [min_nodes, nodes] available, and once capacity returns (all of
it, or part of it unchanged for the bound) SIGTERM writes a checkpoint and the
gang relaunches larger (each a relaunch, load and reshard; `grow="next_save"`
instead waits for the next scheduled checkpoint); `hang_detection` is the
pod-side watchdog (`training.spec.WatchdogPolicy`): no progress for
max(300 s, 20 x the step time of 8 s) declares a hang, dumps stacks and
restarts in the job.

Left out: stragglers and slow nodes (no published per-GPU rate of slow nodes
with a slowdown distribution could be found to parameterise them; the
platform's mechanism only reports them), failures during a restart, planned
maintenance (47 of 466), a smaller gang's per-GPU efficiency (taken as equal),
and the initial launch (the same under every policy).
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Literal, Optional, Sequence

from bench.sim.trace import young_daly_hours

# Llama 3 (2024), section 3.3.4: 419 unexpected interruptions in 54 days on up to 16,384 GPUs.
LLAMA3_UNEXPECTED = 419
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16_384
LLAMA3_PER_GPU_HOUR = LLAMA3_UNEXPECTED / (LLAMA3_DAYS * 24 * LLAMA3_GPUS)
# Table 5's counts, grouped as the module docstring says.
NODE_LOSS_COUNT = 268 + 21 + 35 + 32
HANG_COUNT = 7 + 54 / 4

Kind = Literal["node_loss", "hang", "transient"]
KINDS: tuple[Kind, ...] = ("node_loss", "hang", "transient")
PHASES = ("running", "saving", "restarting", "waiting", "detecting", "hung")


class LongRunError(ValueError):
    """A run configuration, policy or interruption is malformed; the message names the field."""


@dataclass(frozen=True)
class RunConfig:
    """The run, its failures and its costs (module docstring: where each default comes from).

    Attributes:
        nodes, gpus_per_node: the full gang.
        hours: wall time simulated (a week).
        per_gpu_hour: unexpected interruptions per GPU-hour (Llama 3's).
        node_loss_share, hang_share: shares of interruptions; transients are the rest.
        silent_hang_share: share of hangs that never raise on any rank.
        notice_hours: a silent hang without detection ends after Uniform(0, notice_hours).
        free_node_share: probability a replacement finds a free node.
        free_node_minutes: mean of the exponential admission delay of a free node.
        busy_median_hours, busy_sigma: the lognormal wait for a node on a full cluster.
        save_seconds: blocking time of one checkpoint save.
        checkpoint_hours: a fixed training time between saves; None: Young/Daly for the current size.
        relaunch_seconds: a new gang (after a node loss, a size change or a person's restart) until it trains.
        in_job_restart_seconds: torchrun's restart of the worker group on the same nodes.
        load_seconds: reading the newest checkpoint.
        reshard_seconds: added to the load when the size differs from the checkpoint's.
        node_notready_seconds: Kubernetes' not-ready grace plus eviction toleration (40 s + 300 s).
        pg_timeout_seconds: the process-group (NCCL) timeout.
        step_seconds, hang_floor_seconds, hang_step_factor: the watchdog's timeout, max(floor, factor x step).
    """

    nodes: int = 32
    gpus_per_node: int = 8
    hours: float = 168.0
    per_gpu_hour: float = LLAMA3_PER_GPU_HOUR
    node_loss_share: float = NODE_LOSS_COUNT / LLAMA3_UNEXPECTED
    hang_share: float = HANG_COUNT / LLAMA3_UNEXPECTED
    silent_hang_share: float = 0.25
    notice_hours: float = 12.0
    free_node_share: float = 0.5
    free_node_minutes: float = 10.0
    busy_median_hours: float = 3.0
    busy_sigma: float = 1.0
    save_seconds: float = 60.0
    checkpoint_hours: Optional[float] = None
    relaunch_seconds: float = 300.0
    in_job_restart_seconds: float = 90.0
    load_seconds: float = 120.0
    reshard_seconds: float = 60.0
    node_notready_seconds: float = 340.0
    pg_timeout_seconds: float = 600.0
    step_seconds: float = 8.0
    hang_floor_seconds: float = 300.0
    hang_step_factor: float = 20.0

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise LongRunError(f"nodes={self.nodes} and gpus_per_node={self.gpus_per_node} must be >= 1")
        if not self.hours > 0 or not self.per_gpu_hour >= 0:
            raise LongRunError(f"hours={self.hours} must be > 0 and per_gpu_hour={self.per_gpu_hour} >= 0")
        for name in ("node_loss_share", "hang_share", "silent_hang_share", "free_node_share"):
            if not 0 <= getattr(self, name) <= 1:
                raise LongRunError(f"{name}={getattr(self, name)} must be in [0, 1]")
        if self.node_loss_share + self.hang_share > 1 + 1e-12:
            raise LongRunError(
                f"node_loss_share + hang_share = {self.node_loss_share + self.hang_share} must be <= 1 (transients "
                "are the rest)"
            )
        if self.checkpoint_hours is not None and not self.checkpoint_hours > 0:
            raise LongRunError(f"checkpoint_hours={self.checkpoint_hours} must be > 0 or None (Young/Daly)")
        if not self.save_seconds > 0:
            raise LongRunError(f"save_seconds={self.save_seconds} must be > 0")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def node_mtbf_hours(self) -> float:
        """Mean hours between interruptions of one node: 1 / (per-GPU rate x GPUs per node)."""
        return math.inf if self.per_gpu_hour == 0 else 1.0 / (self.per_gpu_hour * self.gpus_per_node)

    def checkpoint_interval_hours(self, nodes: int) -> float:
        """Training hours between saves at gang size `nodes`: Young/Daly sqrt(2 x save x node MTBF / nodes), or
        fixed."""
        if self.checkpoint_hours is not None:
            return self.checkpoint_hours
        if math.isinf(self.node_mtbf_hours):
            return math.inf
        return young_daly_hours(self.save_seconds / 3600.0, self.node_mtbf_hours, nodes)

    @property
    def hang_timeout_seconds(self) -> float:
        """The watchdog's timeout: max(floor, factor x measured step time)."""
        return max(self.hang_floor_seconds, self.hang_step_factor * self.step_seconds)


@dataclass(frozen=True)
class Policy:
    """What the platform does about a lost node and a hung rank.

    Attributes:
        name: label in reports.
        continue_smaller: after `bound_seconds` without a replacement, resume at the largest
            size in [min_nodes, nodes] (a multiple of `size_multiple`) available; grow back
            once capacity returned: `grow="at_once"` (all missing nodes back, or some unchanged
            for `bound_seconds`: a checkpoint now, then the relaunch) or `grow="next_save"`
            (after the next scheduled checkpoint).
        hang_detection: the pod-side watchdog (`RunConfig.hang_timeout_seconds`) catches every
            hang, silent ones included, and restarts in the job.
    """

    name: str
    continue_smaller: bool = False
    hang_detection: bool = False
    min_nodes: int = 16
    size_multiple: int = 1
    bound_seconds: float = 120.0
    grow: Literal["at_once", "next_save"] = "at_once"

    def sizes(self, nodes: int) -> list[int]:
        """The sizes the gang may run at, largest first."""
        if not self.continue_smaller:
            return [nodes]
        return [n for n in range(nodes, self.min_nodes - 1, -1) if n % self.size_multiple == 0 or n == nodes]


def policies() -> dict[str, Policy]:
    """The compared policies: the baseline, both mechanisms, and each alone."""
    return {
        "wait_and_timeout": Policy("wait_and_timeout"),
        "mechanisms_on": Policy("mechanisms_on", continue_smaller=True, hang_detection=True),
        "continue_smaller_only": Policy("continue_smaller_only", continue_smaller=True),
        "hang_detection_only": Policy("hang_detection_only", hang_detection=True),
    }


@dataclass(frozen=True)
class Interruption:
    """One interruption drawn at the full gang's rate; every policy replays the same list.

    Attributes:
        time: hours from the start.
        kind: `node_loss`, `hang` or `transient`.
        strike: Uniform[0, 1); node `floor(strike x nodes)` is struck. A node loss counts when that node is held,
            a hang or transient when that node trains (the first `size` nodes train).
        replacement_hours: a node loss's replacement is admitted this long after the loss.
        silent: a hang on which no rank ever raises.
        notice_hours: without detection, a person notices a silent hang this long after it began.
    """

    time: float
    kind: Kind
    strike: float = 0.0
    replacement_hours: float = 0.0
    silent: bool = False
    notice_hours: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise LongRunError(f"interruption at {self.time}: kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if not 0 <= self.strike < 1:
            raise LongRunError(f"interruption at {self.time}: strike={self.strike} must be in [0, 1)")
        if self.time < 0 or self.replacement_hours < 0 or self.notice_hours < 0:
            raise LongRunError(f"interruption at {self.time}: time, replacement_hours and notice_hours must be >= 0")


def interruptions(cfg: RunConfig, seed: int) -> list[Interruption]:
    """A Poisson stream of interruptions at the full gang's rate (nodes x GPUs x per-GPU rate) over `cfg.hours`.

    Every mark is drawn for every event whatever its kind, so two configurations that differ only in shares
    or delays see the same event times.
    """
    rng = random.Random(f"long-run-{seed}")
    rate = cfg.gpus * cfg.per_gpu_hour
    out: list[Interruption] = []
    t = 0.0
    while rate > 0:
        t += rng.expovariate(rate)
        if t >= cfg.hours:
            break
        u_kind, strike, u_free, free, busy, u_silent, notice = (rng.random() for _ in range(7))
        kind: Kind = (
            "node_loss"
            if u_kind < cfg.node_loss_share
            else "hang"
            if u_kind < cfg.node_loss_share + cfg.hang_share
            else "transient"
        )
        if u_free < cfg.free_node_share:
            replacement = -math.log(1.0 - free) * cfg.free_node_minutes / 60.0
        else:
            replacement = cfg.busy_median_hours * math.exp(cfg.busy_sigma * _normal_quantile(busy))
        out.append(
            Interruption(t, kind, strike, replacement, u_silent < cfg.silent_hang_share, notice * cfg.notice_hours)
        )
    return out


def _normal_quantile(u: float) -> float:
    return NormalDist().inv_cdf(min(max(u, 1e-12), 1 - 1e-12))


@dataclass
class RunResult:
    """One policy's week.

    `hours` splits the wall time exactly (they sum to `cfg.hours`): `progress` (kept and, at the end,
    not yet committed), `lost` (progress discarded at an interruption), `smaller` (what running at n of N
    nodes did not make: (1 - n / N) of those hours), and the hours in each phase other than training.
    `log` lists (hours, event, gang size, checkpoint interval in hours).
    """

    policy: str
    seed: Optional[int]
    wall_hours: float
    hours: dict[str, float]
    counts: dict[str, int]
    log: list[tuple[float, str, int, float]] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        """Effective training time ratio: full-gang-equivalent progress / wall time."""
        return self.hours["progress"] / self.wall_hours


class _Gang:
    """The event loop of one run (see `simulate`).

    Phase events (a save due, a restart done, a lost node noticed, a hang ended, the continue-smaller bound)
    carry the token of the phase or notice that scheduled them and are dropped once it has passed.
    """

    def __init__(self, cfg: RunConfig, policy: Policy) -> None:
        self.cfg, self.policy = cfg, policy
        self.sizes = policy.sizes(cfg.nodes)
        self.t = 0.0
        self.up = cfg.nodes  # healthy nodes the gang holds or has been admitted
        self.size = cfg.nodes  # the size it trains (or restarts) at
        self.ckpt_size = cfg.nodes  # the size the newest committed checkpoint was written at
        self.phase = "running"
        self.since = 0.0
        self.uncommitted = 0.0
        self.kept = 0.0
        self.hours = {k: 0.0 for k in ("lost", "smaller", "saving", "restarting", "waiting", "detecting", "hung")}
        self.counts = {
            k: 0
            for k in (
                "node_losses",
                "hangs",
                "silent_hangs",
                "transients",
                "saves",
                "restarts",
                "shrinks",
                "grows",
                "missed",
            )
        }
        self.log: list[tuple[float, str, int, float]] = []
        self.queue: list[tuple[float, int, str, int, object]] = []
        self.seq = 0
        self.token = 0
        self.notice = 0  # the bound belongs to the newest noticed loss
        self.bound_passed = False
        self._enter("running")

    def push(self, time: float, what: str, token: int = 0, payload: object = None) -> None:
        self.seq += 1
        heapq.heappush(self.queue, (time, self.seq, what, token, payload))

    def note(self, what: str) -> None:
        self.log.append((self.t, what, self.size, self.cfg.checkpoint_interval_hours(self.size)))

    def _close(self) -> None:
        dt = self.t - self.since
        if self.phase == "running":
            share = self.size / self.cfg.nodes
            self.uncommitted += dt * share
            self.hours["smaller"] += dt * (1.0 - share)
        else:
            self.hours[self.phase] += dt
        self.since = self.t

    def _enter(self, phase: str) -> None:
        self._close()
        self.phase = phase
        self.token += 1
        if phase == "running":
            self.push(self.t + self.cfg.checkpoint_interval_hours(self.size), "save", self.token)

    def _lose_uncommitted(self) -> None:
        self._close()
        self.hours["lost"] += self.uncommitted
        self.uncommitted = 0.0

    def _restart(self, to: int, kind: Literal["relaunch", "in_job"]) -> None:
        cfg = self.cfg
        seconds = (cfg.relaunch_seconds if kind == "relaunch" else cfg.in_job_restart_seconds) + cfg.load_seconds
        if to != self.ckpt_size:
            seconds += cfg.reshard_seconds
        self.counts["restarts"] += 1
        if to != self.size:
            self.counts["shrinks" if to < self.size else "grows"] += 1
        self.size = to
        self._enter("restarting")
        self.push(self.t + seconds / 3600.0, "restarted", self.token)
        self.note(f"restart ({kind}, {seconds:.0f} s)")

    def _largest_size(self) -> Optional[int]:
        return next((n for n in self.sizes if n <= self.up), None)

    def _decide(self) -> None:
        """A lost node noticed, or a change while waiting: restart at full size, continue smaller, or wait."""
        smaller = self._largest_size() if self.policy.continue_smaller and self.bound_passed else None
        if self.up >= self.cfg.nodes:
            self._restart(self.cfg.nodes, "relaunch")
        elif smaller is not None:
            self._restart(smaller, "relaunch")
        elif self.phase != "waiting":
            self._enter("waiting")
            self.note("waiting for a node")

    def interruption(self, ev: Interruption) -> None:
        struck = int(ev.strike * self.cfg.nodes)  # nodes [0, size) train, [size, up) are held and idle
        if ev.kind == "node_loss":
            if struck >= self.up:
                self.counts["missed"] += 1
                return
            self.counts["node_losses"] += 1
            self.up -= 1
            self.push(self.t + ev.replacement_hours, "replacement")
            if self.phase not in ("running", "saving", "restarting", "hung"):
                return  # already stopped: waiting for nodes, or a loss not yet noticed
            if struck >= self.size:
                self.note("an idle held node lost")
                return
            self._lose_uncommitted()
            self._enter("detecting")
            self.note("node lost")
            timeout = min(self.cfg.node_notready_seconds, self.cfg.pg_timeout_seconds)
            if self.policy.hang_detection:
                timeout = min(timeout, self.cfg.hang_timeout_seconds)
            self.push(self.t + timeout / 3600.0, "noticed", self.token)
            return
        if self.phase not in ("running", "saving") or struck >= self.size:
            self.counts["missed"] += 1
            return
        self._lose_uncommitted()
        if ev.kind == "transient":
            self.counts["transients"] += 1
            self.note("transient")
            self._restart(self.size, "in_job")
            return
        self.counts["hangs"] += 1
        self.counts["silent_hangs"] += int(ev.silent)
        self._enter("hung")
        self.note("silent hang" if ev.silent else "hang")
        if self.policy.hang_detection:
            delay, kind = self.cfg.hang_timeout_seconds / 3600.0, "in_job"
        elif ev.silent:
            delay, kind = ev.notice_hours, "relaunch"  # a person restarts the job
        else:
            delay, kind = self.cfg.pg_timeout_seconds / 3600.0, "in_job"
        self.push(self.t + delay, "hang_ended", self.token, kind)

    def event(self, what: str, token: int, payload: object) -> None:
        if what == "interruption":
            assert isinstance(payload, Interruption)
            self.interruption(payload)
        elif what == "replacement":
            self.up += 1
            self.note("replacement admitted")
            if self.phase == "waiting":
                self._decide()
            elif self.policy.continue_smaller and self.policy.grow == "at_once" and self.size < self.cfg.nodes:
                self.push(
                    self.t if self.up >= self.cfg.nodes else self.t + self.policy.bound_seconds / 3600.0,
                    "grow",
                    self.up,
                )
        elif what == "grow":
            bigger = self._largest_size() if self.policy.continue_smaller else None
            if (
                self.phase == "running"
                and bigger is not None
                and bigger > self.size
                and (token == self.up or self.up >= self.cfg.nodes)
            ):
                self._enter("saving")  # the checkpoint the larger gang resumes from
                self.push(self.t + self.cfg.save_seconds / 3600.0, "saved", self.token)
        elif what == "bound":
            if token == self.notice:
                self.bound_passed = True
                if self.phase == "waiting":
                    self._decide()
        elif token != self.token:
            return  # scheduled by a phase that has ended
        elif what == "save":
            self._enter("saving")
            self.push(self.t + self.cfg.save_seconds / 3600.0, "saved", self.token)
        elif what == "saved":
            self._close()
            self.kept += self.uncommitted
            self.uncommitted = 0.0
            self.ckpt_size = self.size
            self.counts["saves"] += 1
            self.note("checkpoint committed")
            bigger = self._largest_size() if self.policy.continue_smaller else None
            if bigger is not None and bigger > self.size:
                self._restart(bigger, "relaunch")  # grow back at a checkpoint boundary
            else:
                self._enter("running")
        elif what == "restarted":
            self._enter("running")
            self.note("training")
            if self.policy.grow == "at_once" and self.size < self.cfg.nodes:
                self.push(self.t, "grow", self.up)  # capacity that returned during the restart
        elif what == "noticed":
            self.notice += 1
            self.bound_passed = False
            if self.policy.continue_smaller and self.up < self.cfg.nodes:
                self.push(self.t + self.policy.bound_seconds / 3600.0, "bound", self.notice)
            self._decide()
        elif what == "hang_ended":
            self._restart(self.size, "relaunch" if payload == "relaunch" else "in_job")

    def run(self, events: Sequence[Interruption]) -> None:
        for ev in events:
            self.push(ev.time, "interruption", 0, ev)
        while self.queue and self.queue[0][0] < self.cfg.hours:
            self.t, _, what, token, payload = heapq.heappop(self.queue)
            self.event(what, token, payload)
        self.t = self.cfg.hours
        self._close()


def simulate(
    cfg: RunConfig, policy: Policy, seed: Optional[int] = None, events: Optional[Sequence[Interruption]] = None
) -> RunResult:
    """One run of `cfg.hours` under `policy`: the interruptions of `seed` (`interruptions`), or the given `events`.

    The gang starts training at time 0 at full size. Progress made since the last committed checkpoint
    is lost at an interruption and counted at the end of the week (the run goes on).
    """
    if (seed is None) == (events is None):
        raise LongRunError("simulate needs exactly one of seed and events")
    if not 1 <= policy.min_nodes <= cfg.nodes:
        raise LongRunError(f"policy {policy.name}: min_nodes={policy.min_nodes} must be in [1, nodes={cfg.nodes}]")
    stream = interruptions(cfg, seed) if seed is not None else sorted(events or [], key=lambda e: e.time)
    gang = _Gang(cfg, policy)
    gang.run(stream)
    hours = {"progress": gang.kept + gang.uncommitted, **gang.hours}
    return RunResult(policy.name, seed, cfg.hours, hours, dict(gang.counts), gang.log)
