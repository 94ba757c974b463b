"""Discrete-event replay of a job trace on a cluster under one policy.

Resources are GPUs per node. A job of up to one node's GPUs goes to the fullest
node it fits on (best fit keeps whole nodes free for gangs); a gang takes whole
free nodes. Events at the same instant are handled before one scheduling pass:
releases (finish, end of a preemption save, repair) first, then failures, then
arrivals.

Accounting per job, in GPU-hours: `allocated` (held) = `useful` (work that counts)
+ `lost` (work redone after a failure, or after preempting a job that cannot
checkpoint) + `overhead` (startup at each start, checkpoint saves, the save a
preemption asks for). Work in progress at the horizon counts as useful.

Preemption is checkpoint-aware: a victim is sent SIGTERM, saves what it did
since its last checkpoint (`checkpoint_cost` hours, nothing when there is
nothing new) and releases its GPUs; the preemptor holds a claim on the GPUs it
needs and starts when the last of its victims has saved.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Optional

from bench.sim.model import PRIORITIES, Cluster, Failure, Job, Policy

_RELEASE, _HANDOVER, _FAIL, _ARRIVE = 0, 1, 2, 3  # order of events at one instant


@dataclass
class JobOutcome:
    """What happened to one job; GPU-hours in `allocated`, `useful`, `lost`, `overhead`."""

    job: Job
    done: float = 0.0
    first_start: Optional[float] = None
    finished: Optional[float] = None
    starts: int = 0
    preemptions: int = 0
    failures: int = 0
    allocated: float = 0.0
    useful: float = 0.0
    lost: float = 0.0
    overhead: float = 0.0
    queued: float = 0.0
    pending_since: Optional[float] = None

    def wait(self, horizon: float) -> float:
        """Hours from submission to first start; for a job never started, to the horizon (censored)."""
        return (self.first_start if self.first_start is not None else horizon) - self.job.submit


@dataclass
class _Holder:
    id: int
    job: Job
    kind: str  # run | drain (a preempted job saving) | claim (GPUs kept for a preemptor)
    alloc: dict[int, int]
    start: float
    end: float
    base: float = 0.0  # work committed when a run began
    transfer: dict[int, int] = field(default_factory=dict)  # drain: GPUs handed to claim `claim_id`
    claim_id: Optional[int] = None
    borrowing: bool = False  # admitted beyond its team's quota (a run)


@dataclass
class SimResult:
    policy: str
    horizon: float
    cluster: Cluster
    outcomes: dict[str, JobOutcome]
    preemptions: dict[str, int]
    node_failures: int
    down_gpu_hours: float

    def summary(self) -> dict[str, Any]:
        """Utilization, goodput, waits and losses of this run (numbers rounded for reports)."""
        out = list(self.outcomes.values())
        capacity = self.cluster.gpus * self.horizon
        allocated = sum(o.allocated for o in out)
        useful = sum(o.useful for o in out)
        lost = sum(o.lost for o in out)
        overhead = sum(o.overhead for o in out)
        waits: dict[str, dict[str, float]] = {}
        for label, group in [*_groups(out, lambda o: o.job.priority), *_groups(out, lambda o: o.job.kind)]:
            waits[label] = _stats([o.wait(self.horizon) for o in group])
        teams = {}
        for team, group in _groups(out, lambda o: o.job.team):
            teams[team] = {
                "jobs": len(group),
                "gpu_hours": round(sum(o.allocated for o in group), 3),
                "useful_gpu_hours": round(sum(o.useful for o in group), 3),
                "mean_wait_hours": round(sum(o.wait(self.horizon) for o in group) / len(group), 4),
            }
        return {
            "policy": self.policy,
            "utilization": allocated / capacity,
            "goodput": useful / allocated if allocated else 0.0,
            "effective_utilization": useful / capacity,
            "capacity_gpu_hours": capacity,
            "allocated_gpu_hours": round(allocated, 3),
            "useful_gpu_hours": round(useful, 3),
            "lost_gpu_hours": round(lost, 3),
            "overhead_gpu_hours": round(overhead, 3),
            "down_gpu_hours": round(self.down_gpu_hours, 3),
            "jobs": len(out),
            "completed": {k: sum(1 for o in g if o.finished is not None) for k, g in _groups(out, lambda o: o.job.kind)},
            "never_started": sum(1 for o in out if o.first_start is None),
            "preemptions": sum(self.preemptions.values()),
            "preemptions_by_reason": dict(sorted(self.preemptions.items())),
            "node_failures": self.node_failures,
            "restarts_after_failure": sum(o.failures for o in out),
            "wait_hours": waits,
            "teams": teams,
        }


def _groups(items: list[JobOutcome], key: Any) -> list[tuple[str, list[JobOutcome]]]:
    groups: dict[str, list[JobOutcome]] = {}
    for o in items:
        groups.setdefault(key(o), []).append(o)
    return sorted(groups.items())


def _stats(values: list[float]) -> dict[str, float]:
    """Mean, nearest-rank p50/p95 and max."""
    v = sorted(values)
    rank = lambda q: v[max(0, math.ceil(q * len(v)) - 1)]
    return {"n": len(v), "mean": round(sum(v) / len(v), 4), "p50": round(rank(0.5), 4), "p95": round(rank(0.95), 4), "max": round(v[-1], 4)}


class _Sim:
    def __init__(self, cluster: Cluster, policy: Policy, horizon: float) -> None:
        self.c = cluster
        self.p = policy
        self.horizon = horizon
        self.up = [True] * cluster.nodes
        self.down_since: dict[int, float] = {}
        self.down_gpu_hours = 0.0
        self.held = [0] * cluster.nodes
        self.holders: dict[int, _Holder] = {}
        self.by_node: list[set[int]] = [set() for _ in range(cluster.nodes)]
        self.pending: dict[str, Job] = {}
        # Pending ids per priority rank, in arrival order: (submit, id).
        self.queues: dict[int, list[tuple[float, str]]] = {r: [] for r in sorted(set(PRIORITIES.values()))}
        self._borrowing_cache: Optional[set[int]] = None
        self.outcomes: dict[str, JobOutcome] = {}
        self.events: list[tuple] = []
        self.seq = 0
        self.next_id = 0
        self.preemptions: dict[str, int] = {}
        self.node_failures = 0

    # -- events --------------------------------------------------------------------

    def push(self, time: float, order: int, kind: str, payload: Any) -> None:
        self.seq += 1
        heapq.heappush(self.events, (time, order, self.seq, kind, payload))

    def run(self, jobs: Iterable[Job], failures: Iterable[Failure]) -> SimResult:
        for j in jobs:
            self.push(j.submit, _ARRIVE, "arrive", j)
        for f in failures:
            self.push(f.time, _FAIL, "fail", f.node)
        while self.events and self.events[0][0] <= self.horizon:
            now = self.events[0][0]
            arrivals: list[Job] = []
            changed = False
            while self.events and self.events[0][0] == now:
                _, _, _, kind, payload = heapq.heappop(self.events)
                getattr(self, f"_on_{kind}")(now, payload)
                if kind == "arrive":
                    arrivals.append(payload)
                else:
                    changed = True
            if changed or any(self._may_start(j) for j in arrivals):
                self.schedule(now)
        for h in sorted(self.holders.values(), key=lambda h: h.id):
            self._stop(h, self.horizon, "horizon")
        for since in self.down_since.values():
            self.down_gpu_hours += (self.horizon - since) * self.c.gpus_per_node
        return SimResult(self.p.name, self.horizon, self.c, self.outcomes, self.preemptions, self.node_failures, self.down_gpu_hours)

    def _on_arrive(self, now: float, job: Job) -> None:
        self.outcomes[job.id] = JobOutcome(job, pending_since=now)
        self._enqueue(job)

    def _on_finish(self, now: float, hid: int) -> None:
        h = self.holders.get(hid)
        if h is not None and h.end == now:
            self._stop(h, now, "finish")

    def _on_drain_end(self, now: float, hid: int) -> None:
        h = self.holders.get(hid)
        if h is not None:
            self._stop(h, now, "drained")

    def _on_handover(self, now: float, hid: int) -> None:
        claim = self.holders.get(hid)
        if claim is not None:
            self._remove(claim)
            self._start_run(claim.job, now, claim.alloc)

    def _on_fail(self, now: float, node: int) -> None:
        if not self.up[node]:
            return
        self.node_failures += 1
        for hid in sorted(self.by_node[node]):
            if hid in self.holders:
                self._stop(self.holders[hid], now, "fail")
        self.up[node] = False
        self.down_since[node] = now
        self.push(now + self.c.repair_hours, _RELEASE, "repair", node)

    def _on_repair(self, now: float, node: int) -> None:
        self.up[node] = True
        self.down_gpu_hours += (now - self.down_since.pop(node)) * self.c.gpus_per_node

    # -- holders -------------------------------------------------------------------

    def _add(self, job: Job, kind: str, alloc: dict[int, int], start: float, end: float, **kw: Any) -> _Holder:
        self.next_id += 1
        h = _Holder(self.next_id, job, kind, dict(alloc), start, end, **kw)
        self.holders[h.id] = h
        self._borrowing_cache = None
        for n, g in h.alloc.items():
            self.held[n] += g
            self.by_node[n].add(h.id)
        return h

    def _remove(self, h: _Holder) -> None:
        del self.holders[h.id]
        self._borrowing_cache = None
        for n, g in h.alloc.items():
            self.held[n] -= g
            self.by_node[n].discard(h.id)

    def _start_run(self, job: Job, now: float, alloc: dict[int, int]) -> None:
        o = self.outcomes[job.id]
        end = now + job.wall_hours(job.work - o.done)
        borrowing = self.usage().get(job.team, 0) + job.gpus > self.quota(job.team)
        h = self._add(job, "run", alloc, now, end, base=o.done, borrowing=borrowing)
        self.push(end, _RELEASE, "finish", h.id)
        if o.first_start is None:
            o.first_start = now
        o.starts += 1
        if o.pending_since is not None:
            o.queued += now - o.pending_since
            o.pending_since = None

    def _progress(self, h: _Holder, now: float) -> tuple[float, float, float]:
        """(work done, work committed, startup + save hours) of run `h` by `now`."""
        job = h.job
        remaining = job.work - h.base
        elapsed = max(0.0, now - h.start)
        startup = min(elapsed, job.startup_hours)
        x = elapsed - startup
        if job.checkpoint_every is None:
            return min(x, remaining), 0.0, startup
        tau, cost = job.checkpoint_every, job.checkpoint_cost
        k = math.floor(x / (tau + cost)) if tau + cost > 0 else 0
        rest = x - k * (tau + cost)
        done = min(k * tau + min(rest, tau), remaining)
        return done, min(k * tau, remaining), startup + k * cost + max(0.0, rest - tau)

    def _stop(self, h: _Holder, now: float, why: str) -> None:
        """End holder `h` at `now` for `why` (finish, fail, preempt, drained, horizon) and account for it."""
        self._remove(h)
        job, o, g = h.job, self.outcomes[h.job.id], h.job.gpus
        if h.kind == "claim":
            if why == "fail":
                self._requeue(job, now)
            return
        if h.kind == "drain":
            held = min(now, h.end) - h.start
            o.allocated += held * g
            o.overhead += held * g
            claim = self.holders.get(h.claim_id) if h.claim_id is not None else None
            if why == "drained" and claim is not None:
                for n, k in h.transfer.items():
                    claim.alloc[n] = claim.alloc.get(n, 0) + k
                    self.held[n] += k
                    self.by_node[n].add(claim.id)
            return
        elapsed = max(0.0, now - h.start)
        o.allocated += elapsed * g
        if why == "finish":
            work = job.work - h.base
            o.useful += work * g
            o.overhead += (elapsed - work) * g
            o.done, o.finished = job.work, now
            return
        done, committed, overhead = self._progress(h, now)
        o.overhead += overhead * g
        if why == "horizon":
            o.useful += done * g
        elif why == "fail":
            o.useful += committed * g
            o.lost += (done - committed) * g
            o.done += committed
            o.failures += 1
            self._requeue(job, now)
        elif why == "preempt":
            if job.checkpoint_every is None:
                o.lost += done * g
            else:
                o.useful += done * g
                o.done += done
            o.preemptions += 1
            self._requeue(job, now)

    def _requeue(self, job: Job, now: float) -> None:
        self._enqueue(job)
        self.outcomes[job.id].pending_since = now

    def _enqueue(self, job: Job) -> None:
        self.pending[job.id] = job
        bisect.insort(self.queues[job.rank], (job.submit, job.id))

    def _dequeue(self, job: Job) -> None:
        del self.pending[job.id]
        q = self.queues[job.rank]
        del q[bisect.bisect_left(q, (job.submit, job.id))]

    # -- placement -----------------------------------------------------------------

    def frees(self) -> list[int]:
        gpn = self.c.gpus_per_node
        return [gpn - self.held[n] if self.up[n] else 0 for n in range(self.c.nodes)]

    def place(self, gpus: int, free: list[int], avoid: frozenset[int] = frozenset()) -> Optional[dict[int, int]]:
        """Best fit for one node's worth, whole free nodes for a gang; nodes in `avoid` only as a last resort."""
        gpn = self.c.gpus_per_node
        if gpus <= gpn:
            fits = [n for n in range(len(free)) if free[n] >= gpus]
            if not fits:
                return None
            n = min(fits, key=lambda n: (n in avoid, free[n], n))
            return {n: gpus}
        whole = sorted((n for n in range(len(free)) if free[n] == gpn), key=lambda n: (n in avoid, n))
        need = gpus // gpn
        return {n: gpn for n in whole[:need]} if len(whole) >= need else None

    # -- scheduling ------------------------------------------------------------------

    def _may_start(self, job: Job) -> bool:
        """Whether a new arrival could change anything: it fits now, or it could preempt.

        When only arrivals happened, every job already pending was blocked on the
        same free capacity, so a pass is needed only if a new job might start.
        """
        if self.p.order == "fifo" and len(self.pending) > 1:
            return False  # strict FIFO: it queues behind a blocked head
        if self.place(job.gpus, self.frees()) is not None:
            return True
        if not self.p.preemption:
            return False
        return job.priority in self.p.preemptors and any(
            h.kind == "run" and h.job.priority in self.p.preemptible for h in self.holders.values())

    def quota(self, team: str) -> int:
        return self.p.quotas.get(team, 0)

    def usage(self) -> dict[str, int]:
        use: dict[str, int] = {}
        for h in self.holders.values():
            if h.kind in ("run", "claim"):
                use[h.job.team] = use.get(h.job.team, 0) + h.job.gpus
        return use

    def schedule(self, now: float) -> None:
        if not self.pending:
            return
        if self.p.order == "fifo":
            merged = sorted(q[0] for q in self.queues.values() if q)  # only the heads can be first
            while merged:
                job = self.pending[merged[0][1]]
                alloc = self.place(job.gpus, self.frees())
                if alloc is None:
                    return  # head-of-line blocking
                self._dequeue(job)
                self._start_run(job, now, alloc)
                merged = sorted(q[0] for q in self.queues.values() if q)
            return
        use = self.usage()
        reservation: Optional[tuple[float, frozenset[int]]] = None
        blocked = 0
        self._no_victims: set[tuple] = set()
        for job in self._in_order(use):
            if blocked >= self.p.max_blocked:
                return  # like a scheduler's backfill depth: the queue's tail waits for the next pass
            avoid = reservation[1] if reservation else frozenset()
            alloc = self.place(job.gpus, self.frees(), avoid)
            if alloc is not None and reservation is not None:
                ends = now + job.wall_hours(job.work - self.outcomes[job.id].done)
                if ends > reservation[0] and set(alloc) & reservation[1]:
                    alloc = None  # would delay the reserved job
            if alloc is not None:
                self._dequeue(job)
                self._start_run(job, now, alloc)
                use[job.team] = use.get(job.team, 0) + job.gpus
                self._no_victims.clear()
                continue
            if self.p.preemption and self._preempt_for(job, now, use):
                use[job.team] = use.get(job.team, 0) + job.gpus
                self._no_victims.clear()
                continue
            blocked += 1
            if not self.p.backfill:
                return
            if reservation is None:
                reservation = self._reserve(job) or (math.inf, frozenset())

    def _in_order(self, use: dict[str, int]) -> Iterator[Job]:
        """Pending jobs by priority class, within-quota before borrowing (as of the pass start), then arrival."""
        for rank in sorted(self.queues, reverse=True):
            borrowing = []
            for _, jid in list(self.queues[rank]):
                job = self.pending.get(jid)
                if job is None:
                    continue
                if use.get(job.team, 0) + job.gpus > self.quota(job.team):
                    borrowing.append(job)
                else:
                    yield job
            for job in borrowing:
                if job.id in self.pending:
                    yield job

    def _reserve(self, job: Job) -> Optional[tuple[float, frozenset[int]]]:
        """When and where `job` could start if running jobs end as expected (EASY backfill's shadow time)."""
        free = self.frees()
        releases = sorted((h.end, h.id, h.alloc) for h in self.holders.values() if h.kind in ("run", "drain"))
        for end, _, alloc in releases:
            for n, g in alloc.items():
                if self.up[n]:
                    free[n] += g
            placed = self.place(job.gpus, free)
            if placed is not None:
                return end, frozenset(placed)
        return None

    def _borrowing(self) -> set[int]:
        """Runs admitted beyond their team's quota (decided at admission, as Kueue does)."""
        if self._borrowing_cache is None:
            self._borrowing_cache = {h.id for h in self.holders.values() if h.kind == "run" and h.borrowing}
        return self._borrowing_cache

    def _victim_cost(self, h: _Holder, now: float) -> tuple[float, float]:
        """(GPU-hours a preemption wastes: lost work, the save and the restart; hours the save takes)."""
        done, committed, _ = self._progress(h, now)
        job = h.job
        if job.checkpoint_every is None:
            return (done + job.startup_hours) * job.gpus, 0.0
        save = job.checkpoint_cost if done > committed else 0.0
        return (save + job.startup_hours) * job.gpus, save

    def _preempt_for(self, job: Job, now: float, use: dict[str, int]) -> bool:
        within = use.get(job.team, 0) + job.gpus <= self.quota(job.team)
        memo = (job.team, job.rank, job.gpus, within)
        if memo in self._no_victims:
            return False  # a job just like it found no victims in this pass, and nothing changed since
        if job.priority not in self.p.preemptors or (job.rank == min(PRIORITIES.values()) and not within):
            return False
        borrowing = self._borrowing() if within else set()
        candidates = []
        for h in self.holders.values():
            if h.kind != "run" or h.start > now or h.job.priority not in self.p.preemptible:
                continue
            v = h.job
            own = v.team == job.team and v.rank < job.rank
            reclaim = within and v.team != job.team and h.id in borrowing and v.rank <= job.rank
            if own or reclaim:
                cost, save = self._victim_cost(h, now)
                candidates.append((cost, -h.start, h.id, save, "priority" if own else "reclaim"))
        if not candidates:
            self._no_victims.add(memo)
            return False
        free = self.frees()
        chosen: list[tuple[_Holder, float, str]] = []
        alloc = None
        for _cost, _, hid, save, reason in sorted(candidates):
            h = self.holders[hid]
            chosen.append((h, save, reason))
            for n, g in h.alloc.items():
                free[n] += g
            alloc = self.place(job.gpus, free)
            if alloc is not None:
                break
        if alloc is None:
            self._no_victims.add(memo)
            return False
        victims = [(h, save, reason) for h, save, reason in chosen if set(h.alloc) & set(alloc)]
        self._dequeue(job)
        needed = dict(alloc)
        from_victims = {n: 0 for n in alloc}
        for h, _, _ in victims:
            for n, g in h.alloc.items():
                if n in from_victims:
                    from_victims[n] += g
        claim_alloc = {n: max(0, alloc[n] - from_victims[n]) for n in alloc}
        claim = self._add(job, "claim", {n: g for n, g in claim_alloc.items() if g}, now, now)
        still = {n: needed[n] - claim_alloc[n] for n in alloc}
        start_at = now
        for h, save, reason in victims:
            self._stop(h, now, "preempt")
            self.preemptions[reason] = self.preemptions.get(reason, 0) + 1
            transfer = {}
            for n, g in h.alloc.items():
                k = min(g, still.get(n, 0))
                if k:
                    transfer[n] = k
                    still[n] -= k
            drain = self._add(h.job, "drain", h.alloc, now, now + save, transfer=transfer, claim_id=claim.id)
            if save > 0:
                self.push(now + save, _RELEASE, "drain_end", drain.id)
            else:
                self._stop(drain, now, "drained")
            start_at = max(start_at, now + save)
        claim.end = start_at
        if start_at == now:
            self._remove(claim)
            self._start_run(job, now, claim.alloc)
        else:
            self.push(start_at, _HANDOVER, "handover", claim.id)
        return True


def simulate(jobs: list[Job], failures: list[Failure], cluster: Cluster, policy: Policy, horizon: float) -> SimResult:
    """Replay `jobs` and node `failures` on `cluster` under `policy` until `horizon` hours.

    Deterministic: the same inputs give the same result.

    Example:
        >>> r = simulate([Job("a", "t", "gbt", "production", 0.0, 1, 2.0)], [], Cluster(1, 8), Policy("fifo"), 10.0)
        >>> r.outcomes["a"].finished
        2.0
    """
    cluster.check(jobs, failures)
    return _Sim(cluster, policy, horizon).run(jobs, failures)
