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

The queue orders `fifo`, `strict_fifo` and `best_effort_fifo` are served here;
the platform's `priority` order (quotas, backfill, preemption) in
`bench.sim.platform`. Free GPUs per node are kept in buckets by count, and
pending jobs in sorted lists per class, per (class, size) and per (class, team,
size), so a pass costs little more than the jobs it starts or looks at.
"""

from __future__ import annotations

import bisect
import heapq
import math
from typing import Any, Iterable, Optional

from bench.sim.holders import _ARRIVE, _FAIL, _RELEASE, _Holder
from bench.sim.model import PRIORITIES, Cluster, Failure, Job, Policy, TraceError
from bench.sim.platform import PlatformScheduling
from bench.sim.result import JobOutcome, SimResult


class _Sim(PlatformScheduling):
    def __init__(self, cluster: Cluster, policy: Policy, horizon: float, warmup: float = 0.0) -> None:
        self.c = cluster
        self.p = policy
        self.horizon = horizon
        self.warmup = warmup
        self.up = [True] * cluster.nodes
        self.down_since: dict[int, float] = {}
        self.down_gpu_hours = 0.0
        self.held = [0] * cluster.nodes
        self.free = [cluster.gpus_per_node] * cluster.nodes  # free GPUs of each node; 0 while it is down
        self.nodes_by_free: list[list[int]] = [[] for _ in range(cluster.gpus_per_node)] + [list(range(cluster.nodes))]
        self.holders: dict[int, _Holder] = {}
        self.by_node: list[set[int]] = [set() for _ in range(cluster.nodes)]
        self.use: dict[str, int] = {}  # GPUs of runs and claims per team
        self.ends: list[tuple[float, int]] = []  # (end, id) of runs and drains, sorted: the release order
        self.victims: dict[int, _Holder] = {}  # runs of a preemptible class
        self.victims_by_team: dict[str, dict[int, _Holder]] = {}
        self.borrowing_victims: dict[int, _Holder] = {}  # of those, the ones admitted beyond their team's quota
        self.pending: dict[str, Job] = {}
        # Pending ids in arrival order, (submit, id): per priority rank, and per (rank, gpus).
        self.queues: dict[int, list[tuple[float, str]]] = {r: [] for r in sorted(set(PRIORITIES.values()))}
        self.by_size: dict[tuple[int, int], list[tuple[float, str]]] = {}
        self.by_team: dict[int, dict[tuple[str, int], list[tuple[float, str]]]] = {
            r: {} for r in self.queues
        }  # (team, gpus)
        self._no_victims: set[tuple] = set()
        self._requeued: dict[str, Job] = {}  # jobs queued again (preempted) in the current pass
        self._costs: dict[int, tuple[float, float]] = {}  # victim costs in this pass
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
        return SimResult(self.p.name, self.horizon, self.c, self.outcomes, self.preemptions, self.node_failures,
                         self.down_gpu_hours, self.warmup)

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
        self._set_free(node, 0)
        self.down_since[node] = now
        self.push(now + self.c.repair_hours, _RELEASE, "repair", node)

    def _on_repair(self, now: float, node: int) -> None:
        self.up[node] = True
        self._set_free(node, self.c.gpus_per_node - self.held[node])
        self.down_gpu_hours += (now - self.down_since.pop(node)) * self.c.gpus_per_node

    # -- holders -------------------------------------------------------------------

    def _hold(self, node: int, gpus: int, hid: int) -> None:
        """Node `node` gives (gpus > 0) or takes back (gpus < 0) GPUs of holder `hid`."""
        self.held[node] += gpus
        if self.up[node]:
            self._set_free(node, self.c.gpus_per_node - self.held[node])
        if gpus > 0:
            self.by_node[node].add(hid)

    def _set_free(self, node: int, free: int) -> None:
        old = self.free[node]
        if old != free:
            bucket = self.nodes_by_free[old]
            del bucket[bisect.bisect_left(bucket, node)]
            bisect.insort(self.nodes_by_free[free], node)
            self.free[node] = free

    def _add(self, job: Job, kind: str, alloc: dict[int, int], start: float, end: float, **kw: Any) -> _Holder:
        self.next_id += 1
        h = _Holder(self.next_id, job, kind, dict(alloc), start, end, **kw)
        self.holders[h.id] = h
        for n, g in h.alloc.items():
            self._hold(n, g, h.id)
        if kind in ("run", "claim"):
            self.use[job.team] = self.use.get(job.team, 0) + job.gpus
        if kind in ("run", "drain"):
            bisect.insort(self.ends, (end, h.id))
        if kind == "run" and job.priority in self.p.preemptible:
            self.victims[h.id] = h
            self.victims_by_team.setdefault(job.team, {})[h.id] = h
            if h.borrowing:
                self.borrowing_victims[h.id] = h
        return h

    def _remove(self, h: _Holder) -> None:
        del self.holders[h.id]
        for n, g in h.alloc.items():
            self._hold(n, -g, h.id)
            self.by_node[n].discard(h.id)
        if h.kind in ("run", "claim"):
            self.use[h.job.team] -= h.job.gpus
        if h.kind in ("run", "drain"):
            del self.ends[bisect.bisect_left(self.ends, (h.end, h.id))]
        if self.victims.pop(h.id, None) is not None:
            del self.victims_by_team[h.job.team][h.id]
            self.borrowing_victims.pop(h.id, None)

    def _start_run(self, job: Job, now: float, alloc: dict[int, int]) -> _Holder:
        o = self.outcomes[job.id]
        end = now + job.wall_hours(job.work - o.done)
        borrowing = self.use.get(job.team, 0) + job.gpus > self.quota(job.team)
        h = self._add(job, "run", alloc, now, end, base=o.done, borrowing=borrowing)
        self.push(end, _RELEASE, "finish", h.id)
        if o.first_start is None:
            o.first_start = now
        o.starts += 1
        if o.pending_since is not None:
            o.queued += now - o.pending_since
            o.pending_since = None
        return h

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
            self._stop_drain(h, now, why)
            return
        elapsed = max(0.0, now - h.start)
        o.allocated += elapsed * g
        o.allocated_window += max(0.0, now - max(h.start, self.warmup)) * g
        # work this run did before the warm-up ended, which the window does not count
        before = self._progress(h, min(now, self.warmup))[0] if h.start < self.warmup else 0.0
        if why == "finish":
            work = job.work - h.base
            o.useful += work * g
            o.useful_window += (work - before) * g
            o.overhead += (elapsed - work) * g
            o.done, o.finished = job.work, now
            return
        done, committed, overhead = self._progress(h, now)
        o.overhead += overhead * g
        if why == "horizon":
            o.useful += done * g
            o.useful_window += (done - before) * g
        elif why == "fail":
            o.useful += committed * g
            o.useful_window += max(0.0, committed - before) * g
            o.lost += (done - committed) * g
            o.done += committed
            o.failures += 1
            self._requeue(job, now)
        elif why == "preempt":
            if job.checkpoint_every is None:
                o.lost += done * g
            else:
                o.useful += done * g
                o.useful_window += (done - before) * g
                o.done += done
            o.preemptions += 1
            self._requeue(job, now)

    def _stop_drain(self, h: _Holder, now: float, why: str) -> None:
        o, g = self.outcomes[h.job.id], h.job.gpus
        held = min(now, h.end) - h.start
        o.allocated += held * g
        o.overhead += held * g
        o.allocated_window += max(0.0, min(now, h.end) - max(h.start, self.warmup)) * g
        claim = self.holders.get(h.claim_id) if h.claim_id is not None else None
        if claim is None:
            return
        if why == "drained":
            for n, k in h.transfer.items():
                claim.alloc[n] = claim.alloc.get(n, 0) + k
                self._hold(n, k, claim.id)
        elif why == "fail":
            self._stop(claim, now, "fail")  # the GPUs it waited for are gone with the node: queue again

    def _requeue(self, job: Job, now: float) -> None:
        self._requeued[job.id] = job
        self._enqueue(job)
        self.outcomes[job.id].pending_since = now

    def _enqueue(self, job: Job) -> None:
        self.pending[job.id] = job
        bisect.insort(self.queues[job.rank], (job.submit, job.id))
        bisect.insort(self.by_size.setdefault((job.rank, job.gpus), []), (job.submit, job.id))
        bisect.insort(self.by_team[job.rank].setdefault((job.team, job.gpus), []), (job.submit, job.id))

    def _dequeue(self, job: Job) -> None:
        del self.pending[job.id]
        key = (job.submit, job.id)
        for q in (self.queues[job.rank], self.by_size[(job.rank, job.gpus)]):
            del q[bisect.bisect_left(q, key)]
        by_team = self.by_team[job.rank]
        q = by_team[(job.team, job.gpus)]
        del q[bisect.bisect_left(q, key)]
        if not q:
            del by_team[(job.team, job.gpus)]  # a pass looks at every list of a class: keep only those with jobs

    # -- placement -----------------------------------------------------------------

    def frees(self) -> list[int]:
        return list(self.free)

    def place(
        self, gpus: int, free: Optional[list[int]] = None, avoid: frozenset[int] = frozenset()
    ) -> Optional[dict[int, int]]:
        """Best fit for one node's worth, whole free nodes for a gang; nodes in `avoid` only as a last resort.

        `free` is a what-if list of free GPUs per node; None: the cluster as it is now.
        """
        if free is not None:
            return self._place_in(gpus, free, avoid)
        gpn = self.c.gpus_per_node
        if gpus > gpn:
            whole = self.nodes_by_free[gpn]
            need = gpus // gpn
            if len(whole) < need:
                return None
            chosen = sorted(whole, key=lambda n: (n in avoid, n))[:need] if avoid else whole[:need]
            return {n: gpn for n in chosen}
        fallback = None
        for k in range(gpus, gpn + 1):
            bucket = self.nodes_by_free[k]
            if not bucket:
                continue
            for n in bucket:
                if n not in avoid:
                    return {n: gpus}
            if fallback is None:
                fallback = bucket[0]
        return None if fallback is None else {fallback: gpus}

    def _place_in(self, gpus: int, free: list[int], avoid: frozenset[int]) -> Optional[dict[int, int]]:
        gpn = self.c.gpus_per_node
        if gpus <= gpn:
            fits = [n for n, f in enumerate(free) if f >= gpus]
            if not fits:
                return None
            n = min(fits, key=lambda n: (n in avoid, free[n], n))
            return {n: gpus}
        need = gpus // gpn
        whole = [n for n, f in enumerate(free) if f == gpn]
        if len(whole) < need:
            return None
        if avoid:
            whole.sort(key=lambda n: (n in avoid, n))
        return {n: gpn for n in whole[:need]}

    # -- scheduling ------------------------------------------------------------------

    def _may_start(self, job: Job) -> bool:
        """Whether a new arrival could change anything: it fits now, or it could preempt.

        When only arrivals happened, every job already pending was blocked on the
        same free capacity, so a pass is needed only if a new job might start.
        """
        order = self.p.order
        if order == "fifo" and len(self.pending) > 1:
            return False  # arrival order: it queues behind a blocked head
        if order == "strict_fifo" and self._head() != (job.submit, job.id):
            return False  # it queues behind a blocked head of its class or a higher one
        if self.place(job.gpus) is not None:
            return True
        if not self.p.preemption:
            return False
        return job.priority in self.p.preemptors and bool(self.victims)

    def _head(self) -> Optional[tuple[float, str]]:
        """The first pending job in (priority class, arrival) order."""
        for rank in sorted(self.queues, reverse=True):
            if self.queues[rank]:
                return self.queues[rank][0]
        return None

    def quota(self, team: str) -> int:
        return self.p.quotas.get(team, 0)

    def usage(self) -> dict[str, int]:
        return {t: g for t, g in self.use.items() if g}

    def schedule(self, now: float) -> None:
        self._requeued = {}
        if not self.pending:
            return
        if self.p.order == "fifo":
            merged = sorted(q[0] for q in self.queues.values() if q)  # only the heads can be first
            while merged:
                job = self.pending[merged[0][1]]
                alloc = self.place(job.gpus)
                if alloc is None:
                    return  # head-of-line blocking
                self._dequeue(job)
                self._start_run(job, now, alloc)
                merged = sorted(q[0] for q in self.queues.values() if q)
            return
        if self.p.order in ("strict_fifo", "best_effort_fifo"):
            self._schedule_kueue(now, strict=self.p.order == "strict_fifo")
            return
        self._schedule_priority(now)

    def _schedule_kueue(self, now: float, strict: bool) -> None:
        """Kueue's queueing strategies: (priority class, arrival) order; StrictFIFO stops at the first job that does not
        fit, BestEffortFIFO passes over it to later jobs that fit (it holds no reservation for it)."""
        blocked: set[int] = set()  # sizes that do not fit: capacity only shrinks during a pass
        while True:
            best: Optional[tuple[tuple[int, float, str], int]] = None
            for (rank, gpus), q in self.by_size.items():
                if q and gpus not in blocked:
                    key = (-rank, *q[0])
                    if best is None or key < best[0]:
                        best = (key, gpus)
            if best is None:
                return
            job = self.pending[best[0][2]]
            alloc = self.place(job.gpus)
            if alloc is None:
                if strict:
                    return
                blocked.add(job.gpus)
                continue
            self._dequeue(job)
            self._start_run(job, now, alloc)


def simulate(
    jobs: list[Job], failures: list[Failure], cluster: Cluster, policy: Policy, horizon: float, warmup: float = 0.0
) -> SimResult:
    """Replay `jobs` and node `failures` on `cluster` under `policy` until `horizon` hours.

    Utilization in the summary is measured over [warmup, horizon], and waits and
    completion times over the jobs submitted in that window (the cluster starts empty).

    Deterministic: the same inputs give the same result.

    Example:
        >>> r = simulate([Job("a", "t", "gbt", "production", 0.0, 1, 2.0)], [], Cluster(1, 8), Policy("fifo"), 10.0)
        >>> r.outcomes["a"].finished
        2.0
    """
    cluster.check(jobs, failures)
    if not 0 <= warmup < horizon:
        raise TraceError(f"warmup={warmup} must be in [0, horizon={horizon})")
    return _Sim(cluster, policy, horizon, warmup).run(jobs, failures)
