"""Admitted gangs: one record per (job_id, attempt), indexed for release and victim search."""

from __future__ import annotations

from dataclasses import dataclass

from broker.core.types import Placement, PoolKey, Vec

AllocKey = tuple[str, int]  # (job_id, attempt)


@dataclass(slots=True, eq=False)
class Alloc:
    key: AllocKey
    queue: str
    priority: int
    order: int
    placement: Placement
    per_node: dict[str, Vec]
    vec: Vec  # what the gang charges to its queue's quota (gpu, cpu, memory)
    charged: bool = True  # False once a replacement attempt took its quota over (reserve)
    work_since: float | None = None  # newest checkpoint or attempt start; None = unknown
    doomed_by: str | None = None  # preemptor that chose this allocation as a victim
    # Admitted by the cycle that is running now: not a victim candidate until it ends, so
    # one cycle never admits a gang and then preempts it.
    fresh: bool = False
    admitted_at: float | None = None  # None = unknown (restored after a restart)

    @property
    def job_id(self) -> str:
        return self.key[0]

    @property
    def pool(self) -> PoolKey:
        return self.placement.pool

    @property
    def cluster(self) -> str:
        return self.placement.cluster

    @property
    def flavor_class(self) -> str:
        return self.placement.flavor_class

    def lost_work(self, now: float) -> float:
        """GPU-seconds a preemption would throw away (unknown progress counts as infinite)."""
        if self.work_since is None:
            return float("inf")
        return max(0.0, now - self.work_since) * self.vec[0]


class Ledger:
    """All allocations, plus per-pool and per-queue-priority indices of preemptible ones."""

    __slots__ = ("allocs", "by_job", "by_pool", "gpu", "prio")

    def __init__(self) -> None:
        self.allocs: dict[AllocKey, Alloc] = {}
        self.by_job: dict[str, dict[int, Alloc]] = {}  # job_id -> attempt -> allocation
        # pool -> queue -> allocations whose GPU podsets sit in that pool
        self.by_pool: dict[PoolKey, dict[str, dict[AllocKey, Alloc]]] = {}
        # Victim pre-checks count only eligible allocations (charged, not doomed, not fresh):
        # queue -> priority -> count, and pool -> queue -> GPUs.
        self.prio: dict[str, dict[int, int]] = {}
        self.gpu: dict[PoolKey, dict[str, int]] = {}

    @staticmethod
    def _eligible(a: Alloc) -> bool:
        return a.charged and a.doomed_by is None and not a.fresh

    def _count(self, a: Alloc, delta: int) -> None:
        per = self.prio.setdefault(a.queue, {})
        n = per.get(a.priority, 0) + delta
        if n:
            per[a.priority] = n
        else:
            per.pop(a.priority, None)
        sums = self.gpu.setdefault(a.pool, {})
        g = sums.get(a.queue, 0) + delta * a.vec[0]
        if g:
            sums[a.queue] = g
        else:
            sums.pop(a.queue, None)
            if not sums:
                del self.gpu[a.pool]

    def add(self, a: Alloc) -> None:
        key = a.key
        self.allocs[key] = a
        self.by_job.setdefault(key[0], {})[key[1]] = a
        self.by_pool.setdefault(a.pool, {}).setdefault(a.queue, {})[key] = a
        if a.charged and a.doomed_by is None and not a.fresh:  # `_eligible`, inline
            self._count(a, 1)

    def remove(self, key: AllocKey) -> Alloc | None:
        a = self.allocs.pop(key, None)
        if a is None:
            return None
        attempts = self.by_job.get(key[0])
        if attempts is not None:
            attempts.pop(key[1], None)
            if not attempts:
                del self.by_job[key[0]]
        here = self.by_pool.get(a.pool)
        if here is not None:
            mine = here.get(a.queue)
            if mine is not None:
                mine.pop(key, None)
                if not mine:
                    del here[a.queue]
            if not here:
                del self.by_pool[a.pool]
        if self._eligible(a):
            self._count(a, -1)
        return a

    def set_state(self, a: Alloc, charged: bool, doomed_by: str | None) -> None:
        before = self._eligible(a)
        a.charged = charged
        a.doomed_by = doomed_by
        after = self._eligible(a)
        if before != after:
            self._count(a, 1 if after else -1)

    def settle(self, allocs: list[Alloc]) -> None:
        """The cycle that admitted these ended: they become victim candidates."""
        for a in allocs:
            if a.fresh and self.allocs.get(a.key) is a:
                a.fresh = False
                if self._eligible(a):
                    self._count(a, 1)
            a.fresh = False

    def has_lower(self, queue: str, priority: int) -> bool:
        per = self.prio.get(queue)
        return per is not None and any(p < priority for p in per)
