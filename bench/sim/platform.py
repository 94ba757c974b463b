"""The platform's scheduling pass (`Policy(order="priority")`): quotas, EASY backfill, checkpoint-aware preemption.

A mixin of the simulator (`bench.sim.engine._Sim`), whose state it reads and
changes: pending queues, free GPUs per node, holders and the event queue.

One pass looks at pending jobs by priority class, within-quota before borrowing
(by each team's usage when the pass began), then arrival. A job starts if it has
a place, unless the first blocked job's reservation (its shadow time and nodes)
forbids it; otherwise it may preempt; otherwise it is blocked. The pass ends
after `Policy.max_blocked` blocked jobs; a job preempted in it waits for the
next pass.

Pending jobs are kept in one sorted queue per (class, team, size). A queue whose
next job could only be blocked (its size has no place, and preempting cannot
help it) is stuck: `_walk` counts its jobs as blocked in passing instead of
looking at each, and looks again when something starts, is preempted or is
reserved. That decides exactly as looking at every job would (the tests check
it against the plain loop), at a fraction of the cost on a long queue.
"""

from __future__ import annotations

import bisect
import heapq
import math
from typing import Callable, Iterable, Optional

from bench.sim.holders import _HANDOVER, _LOWEST, _RELEASE, _Holder, _Pass
from bench.sim.model import PRIORITIES, Job

_Queue = tuple[str, int, list[tuple[float, str]]]  # (team, gpus, pending (submit, id) in order)
_NAMES = {rank: name for name, rank in PRIORITIES.items()}


class PlatformScheduling:
    """The `priority` order's pass; mixed into `_Sim`."""

    def _schedule_priority(self, now: float) -> None:
        """The platform's pass: jobs in order (see the module docstring); each starts if it fits (and, once a job is
        blocked, does not delay its reservation), else may preempt; the pass ends after `max_blocked` blocked jobs.
        A job preempted in the pass waits for the next one."""
        use = self.usage()
        st = _Pass(use, dict(use))
        self._no_victims = set()
        self._costs = {}
        for rank in sorted(self.queues, reverse=True):
            within, borrowing = self._split(rank, st.start)
            for lists, can_preempt in ((within, True), (borrowing, rank != _LOWEST)):
                if lists and not self._walk(lists, rank, now, st, can_preempt):
                    return

    def _consider(self, job: Job, now: float, st: _Pass, can_preempt: bool) -> bool:
        """Start `job` if it fits without delaying the reservation, else let it preempt; False: the pass stops here."""
        alloc = None
        if job.gpus not in st.no_fit:
            alloc = self.place(job.gpus, None, st.reservation[1] if st.reservation else frozenset())
            if alloc is None:
                st.no_fit.add(job.gpus)
        reserved: frozenset[int] = frozenset()  # nodes it may not take: it would still hold them at the reserved start
        if (
            st.reservation is not None
            and now + job.wall_hours(job.work - self.outcomes[job.id].done) > st.reservation[0]
        ):
            reserved = st.reservation[1]
            if alloc is not None and set(alloc) & reserved:
                alloc = None  # would delay the reserved job
        if alloc is not None:
            self._dequeue(job)
            self._forget_failures(self._start_run(job, now, alloc))
            st.use[job.team] = st.use.get(job.team, 0) + job.gpus
            return True
        if can_preempt and self.p.preemption and self._preempt_for(job, now, st.use, reserved):
            st.use[job.team] = st.use.get(job.team, 0) + job.gpus
            self._no_victims.clear()
            st.no_fit.clear()  # victims may have freed more than the preemptor took
            return True
        return self._block(job, st)

    def _block(self, job: Job, st: _Pass) -> bool:
        st.blocked += 1
        if not self.p.backfill:
            return False
        if st.reservation is None and self.p.reserve:
            st.reservation = self._reserve(job) or (math.inf, frozenset())
        return True

    def _split(self, rank: int, start: dict[str, int]) -> tuple[list[_Queue], list[_Queue]]:
        """(team, gpus, queue) of class `rank`: those within their team's quota (by usage `start`), and those
        borrowing."""
        within: list[_Queue] = []
        borrowing: list[_Queue] = []
        for (team, gpus), q in self.by_team[rank].items():
            if q:
                (within if start.get(team, 0) + gpus <= self.quota(team) else borrowing).append((team, gpus, q))
        return within, borrowing

    def _stuck(self, queue: _Queue, rank: int, st: _Pass, can_preempt: bool, now: float) -> bool:
        """Whether the next job of `queue` could only be blocked: its size has no place and preempting cannot help it
        (not allowed, nobody it may preempt, or a job just like it found no victims in this pass)."""
        team, gpus, _ = queue
        if gpus not in st.no_fit:
            if self.place(gpus) is not None:
                return False
            st.no_fit.add(gpus)
        if not can_preempt or not self.p.preemption or _NAMES[rank] not in self.p.preemptors:
            return True
        within = st.use.get(team, 0) + gpus <= self.quota(team)
        if not within and rank == _LOWEST:
            return True
        if (team, rank, gpus, within, False) in self._no_victims:
            return True  # no victims with every node usable: none with the reserved ones kept off either
        if st.reservation is None or (team, rank, gpus, within, True) not in self._no_victims:
            return False
        # its jobs that must keep off the reserved nodes found none; those that need not: ask once for all of them
        return self._victims((team, rank, gpus, within, False), frozenset(), now) is None

    def _walk(self, lists: list[_Queue], rank: int, now: float, st: _Pass, can_preempt: bool) -> bool:
        """The jobs of `lists` (queues of class `rank`) in arrival order, each as `_consider` decides; False: the pass
        ends.

        While a queue is stuck (`_stuck`), its jobs are counted as blocked in
        passing, without a look each: nothing changes between two jobs looked
        at, so this decides exactly as looking at every job would. Jobs
        preempted in this pass are passed over (they wait for the next pass).
        """
        heap: list[tuple[tuple[float, str], int]] = []
        pushed: dict[int, tuple[float, str]] = {}  # each queue's live entry in the heap
        stuck: set[int] = set()
        last: Optional[tuple[float, str]] = None  # the last job looked at (or blocked in passing to reserve)
        index = {(team, gpus): i for i, (team, gpus, _) in enumerate(lists)}

        def push(i: int, after: Optional[tuple[float, str]]) -> None:
            q = lists[i][2]
            nxt = bisect.bisect_right(q, after) if after else 0
            if nxt < len(q):
                heapq.heappush(heap, (q[nxt], i))
                pushed[i] = q[nxt]

        def refresh(queues: Iterable[int]) -> None:
            for i in queues:
                if self._stuck(lists[i], rank, st, can_preempt, now):
                    stuck.add(i)
                    pushed.pop(i, None)  # its heap entry is stale: its jobs are counted in passing now
                else:
                    stuck.discard(i)
                    if i not in pushed:
                        push(i, last)

        refresh(range(len(lists)))
        while True:
            key, i = self._next(heap, pushed, push)
            count, first = self._passed(stuck, lists, index, rank, last, key)
            if count and (not self.p.backfill or (st.reservation is None and self.p.reserve)):
                assert first is not None
                if not self._block(self.pending[first[1]], st):
                    return False
                last = first  # the first blocked job reserved: what follows it is looked at again with the reservation
                if key is not None:
                    push(i, last)
                refresh(range(len(lists)))
                continue
            st.blocked += count
            if st.blocked >= self.p.max_blocked:
                return False
            if key is None:
                return True
            job = self.pending[key[1]]
            if self._blocked_again(job, now, st):
                st.blocked += 1  # what `_consider` would decide, without its cost: nothing changes
                last = key
                push(i, last)
                continue
            had_reservation = st.reservation is not None
            if not self._consider(job, now, st, can_preempt):
                return False
            last = key
            if job.id not in self.pending or (st.reservation is not None) != had_reservation:
                refresh(range(len(lists)))  # something started or was preempted, or a reservation was made
            else:
                refresh((i,))
            if i not in stuck and i not in pushed:
                push(i, last)

    def _blocked_again(self, job: Job, now: float, st: _Pass) -> bool:
        """Whether `_consider` could only block `job`, told cheaply: the reservation is made, and a job just like it
        (team, class, size, quota standing, reserved nodes to keep off) found no victims in this pass, and `job` has no
        place, or only on reserved nodes it may not hold."""
        if not self._no_victims or not self.p.backfill or (st.reservation is None and self.p.reserve):
            return False  # (the first blocked job makes the reservation: `_consider` must see it)
        like = (job.team, job.rank, job.gpus, st.use.get(job.team, 0) + job.gpus <= self.quota(job.team))
        anywhere = (*like, False) in self._no_victims  # no victims with every node usable: none with fewer either
        if st.reservation is None:
            return anywhere and job.gpus in st.no_fit
        if not anywhere and (*like, True) not in self._no_victims:
            return False
        if job.gpus in st.no_fit and anywhere:
            return True
        if now + job.wall_hours(job.work - self.outcomes[job.id].done) <= st.reservation[0]:
            return False  # it may use the reserved nodes: if it has a place it starts
        alloc = self.place(job.gpus, None, st.reservation[1])
        if alloc is None:
            st.no_fit.add(job.gpus)
        return alloc is None or bool(set(alloc) & st.reservation[1])

    def _forget_failures(self, run: _Holder) -> None:
        """A new run of a preemptible class may be a victim for jobs that found none in this pass: forget those
        failures (any other start only takes capacity, which cannot make a failed preemption succeed)."""
        v = run.job
        if v.priority in self.p.preemptible and self._no_victims:
            self._no_victims = {
                k
                for k in self._no_victims
                if not (
                    (k[0] == v.team and k[1] > v.rank) or (run.borrowing and k[3] and k[0] != v.team and k[1] >= v.rank)
                )
            }

    def _next(self, heap: list[tuple[tuple[float, str], int]], pushed: dict[int, tuple[float, str]],
              push: Callable[[int, Optional[tuple[float, str]]], None]) -> tuple[Optional[tuple[float, str]], int]:
        """The next live entry of `_walk`'s heap and its queue, passing over jobs preempted in this pass; (None, -1) at
        the end."""
        while heap:
            key, i = heapq.heappop(heap)
            if pushed.get(i) != key:
                continue
            del pushed[i]
            if key[1] in self._requeued:
                push(i, key)
                continue
            return key, i
        return None, -1

    def _passed(
        self,
        stuck: set[int],
        lists: list[_Queue],
        index: dict[tuple[str, int], int],
        rank: int,
        after: Optional[tuple[float, str]],
        before: Optional[tuple[float, str]],
    ) -> tuple[int, Optional[tuple[float, str]]]:
        """(how many, the first) jobs of the `stuck` queues strictly between `after` and `before` (None: the start, the
        end), less those preempted in this pass."""
        count, first = 0, None
        for k in stuck:
            q = lists[k][2]
            lo = bisect.bisect_right(q, after) if after else 0
            hi = bisect.bisect_left(q, before) if before else len(q)
            if hi <= lo:
                continue
            count += hi - lo
            while lo < hi and q[lo][1] in self._requeued:
                lo += 1
            if lo < hi and (first is None or q[lo] < first):
                first = q[lo]
        for v in self._requeued.values():
            entry = (v.submit, v.id)
            if (
                v.rank == rank
                and index.get((v.team, v.gpus), -1) in stuck
                and (after is None or entry > after)
                and (before is None or entry < before)
            ):
                count -= 1
        return count, first

    def _reserve(self, job: Job) -> Optional[tuple[float, frozenset[int]]]:
        """When and where `job` could start if running jobs end as expected (EASY backfill's shadow time)."""
        free = list(self.free)
        releases = [(end, self.holders[hid].alloc) for end, hid in self.ends]
        i = self._first_fit(job.gpus, free, [alloc for _, alloc in releases])
        if i is None:
            return None
        placed = self.place(job.gpus, free)
        assert placed is not None
        return releases[i][0], frozenset(placed)

    def _first_fit(self, gpus: int, free: list[int], allocs: list[dict[int, int]]) -> Optional[int]:
        """Add `allocs` one by one to the what-if `free` (in place) until `gpus` has a place: the index of the last one
        added, or None if it never has (then all were added)."""
        gpn = self.c.gpus_per_node
        need = gpus // gpn if gpus > gpn else 0
        whole = free.count(gpn)
        for i, alloc in enumerate(allocs):
            fits = False
            for n, g in alloc.items():
                if self.up[n]:
                    free[n] += g
                    if need and free[n] == gpn:
                        whole += 1
                    elif not need and free[n] >= gpus:
                        fits = True
            if fits or (need and whole >= need):
                return i
        return None

    def _victim_cost(self, h: _Holder, now: float) -> tuple[float, float]:
        """(GPU-hours a preemption wastes: lost work, the save and the restart; hours the save takes)."""
        done, committed, _ = self._progress(h, now)
        job = h.job
        if job.checkpoint_every is None:
            return (done + job.startup_hours) * job.gpus, 0.0
        save = job.checkpoint_cost if done > committed else 0.0
        return (save + job.startup_hours) * job.gpus, save

    def _victims(self, like: tuple[str, int, int, bool, bool], reserved: frozenset[int], now: float) -> Optional[tuple]:
        """For a job `like` (team, class, size, within its quota, keeps off the `reserved` nodes): (victims in the order
        they are taken, how many are needed, what-if free GPUs with them gone); None, remembered, when none would do."""
        team, rank, gpus, within, _ = like
        if like in self._no_victims:
            return None  # a job just like it found no victims in this pass, and nothing that could change that happened
        pool = [(h, "priority") for h in self.victims_by_team.get(team, {}).values() if h.job.rank < rank]
        if within:  # reclaim: runs other teams were admitted beyond their quota
            pool += [
                (h, "reclaim") for h in self.borrowing_victims.values() if h.job.team != team and h.job.rank <= rank
            ]
        free = self.frees()
        for n in reserved:
            free[n] = -self.c.gpus * 2  # no victim's GPUs make a reserved node usable
        if not pool or self._first_fit(gpus, list(free), [h.alloc for h, _ in pool]) is None:
            self._no_victims.add(like)  # not even all of them together would do
            return None
        for h, _ in pool:
            if h.id not in self._costs:
                self._costs[h.id] = self._victim_cost(h, now)
        ranked = [
            (h, self._costs[h.id][1], reason)
            for h, reason in sorted(pool, key=lambda c: (self._costs[c[0].id][0], -c[0].start, c[0].id))
        ]
        last = self._first_fit(gpus, free, [h.alloc for h, _, _ in ranked])
        assert last is not None
        return ranked, last, free

    def _preempt_for(self, job: Job, now: float, use: dict[str, int], reserved: frozenset[int] = frozenset()) -> bool:
        """Stop the cheapest victims whose GPUs give `job` a place off the `reserved` nodes; False if none do."""
        within = use.get(job.team, 0) + job.gpus <= self.p.quotas.get(job.team, 0)
        if (not within and job.rank == _LOWEST) or job.priority not in self.p.preemptors:
            return False  # a borrowing job of the lowest class has no one to preempt
        found = self._victims((job.team, job.rank, job.gpus, within, bool(reserved)), reserved, now)
        if found is None:
            return False
        ranked, last, free = found
        alloc = self.place(job.gpus, free)
        assert alloc is not None
        victims = [(h, save, reason) for h, save, reason in ranked[:last + 1] if set(h.alloc) & set(alloc)]
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
