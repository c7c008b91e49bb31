"""Choosing victims: within-queue preemption by priority and reclaim of borrowed quota.

Rules (Kueue's preemption, with Muster's checkpoint-aware victim order):
- within queue: when the preemptor's queue has `within_queue: LowerPriority`, admitted gangs of
  the same queue with a strictly lower priority are candidates.
- reclaim: when the preemptor's queue has `reclaim_within_cohort` other than Never and would stay
  inside its own nominal quota of the pool's flavor class, gangs of other queues of its cohort
  tree (Kueue's hierarchical cohorts: every queue under the same root cohort) are candidates if
  their queue is `reclaimable`, uses quota lent across the lowest cohort it shares with the
  preemptor, and (for LowerPriority) has a lower priority. "Lent across" means the victim's
  queue borrows, and so does the subtree that hangs off the common cohort (for two queues of
  one cohort that subtree is the queue itself). A reclaim victim is taken only while both stay
  at or above their quota, after the removal, in every resource they borrow: reclaim takes back
  lent capacity, never a victim's own nominal share or its subtree's.
- Candidates are tried least lost work first: (now - newest checkpoint or attempt start) * GPUs;
  ties go to lower priority, then to the most recently submitted. Victims are added until the
  WHOLE gang fits on that one pool by per-node packing (within one domain of its topology
  level, topology.py) and within quota; then victims that turn
  out unnecessary are given back (last added first, except the one that made it fit).
- Among pools with a plan (at most `PLAN_POOLS` are planned), the plan losing the least work
  wins. Victims already chosen by another preemptor are never chosen again, nor are gangs
  admitted by the running cycle (no admit-then-preempt churn inside one cycle), nor gangs the
  caller protects (`protected`: admitted less than the minimum runtime ago, or already
  reclaimed once since the scheduler's inputs last changed).
The scheduler does not end the victims; it reports them and keeps their capacity until release.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from broker.core.inventory import Inventory, Pool
from broker.core.ledger import Alloc, Ledger
from broker.core.placement import Candidates, Gang
from broker.core.quota import QueueState, QuotaBook
from broker.core.topology import fits_now
from broker.core.types import GangRequest

PLAN_POOLS = 4


@dataclass(slots=True)
class Plan:
    pool: Pool
    victims: list[Alloc]
    lost: float
    kind: Literal["within-queue", "reclaim"]


class _Trial:
    """Temporarily removes victims' node capacity and quota, and tests whether the gang fits."""

    __slots__ = ("book", "cls", "gang", "inv", "pool", "qs", "req")

    def __init__(
        self,
        inv: Inventory,
        book: QuotaBook,
        req: GangRequest,
        gang: Gang,
        qs: QueueState,
        pool: Pool,
    ) -> None:
        self.inv = inv
        self.book = book
        self.req = req
        self.gang = gang
        self.qs = qs
        self.pool = pool
        self.cls = pool.flavor_class

    def suspend(self, a: Alloc, sign: int) -> None:
        """sign=1 removes the victim's usage for the trial, sign=-1 puts it back."""
        self.inv.suspend_usage(a.cluster, a.per_node, -sign)
        vq = self.book.queues.get(a.queue)
        if a.charged and vq is not None:
            self.book.charge(vq, a.flavor_class, a.vec, -sign)

    def fits(self) -> bool:
        if self.book.check(self.qs, self.cls, self.gang.total) is not None:
            return False
        if self.gang.ext_total and self.book.check_ext(self.qs, self.cls, self.gang.ext_total):
            return False
        cluster = self.inv.clusters[self.pool.cluster]
        return fits_now(cluster, self.pool, self.gang, self.req)

    def reclaimable_now(self, a: Alloc) -> bool:
        return self.book.reclaimable(self.book.queues[a.queue], self.qs, self.cls, a.vec)


def _try_pool(trial: _Trial, victims: list[Alloc], now: float) -> list[Alloc] | None:
    victims.sort(key=lambda a: (a.lost_work(now), a.priority, -a.order, a.key))
    own = trial.qs.name
    removed: list[Alloc] = []
    ok = False
    for a in victims:
        if a.queue != own and not trial.reclaimable_now(a):
            continue
        trial.suspend(a, 1)
        removed.append(a)
        if trial.fits():
            ok = True
            break
    if ok:
        for a in reversed(removed[:-1]):
            trial.suspend(a, -1)
            if trial.fits():
                removed.remove(a)
            else:
                trial.suspend(a, 1)
    for a in removed:
        trial.suspend(a, -1)
    return removed if ok else None


def _modes(book: QuotaBook, ledger: Ledger, req: GangRequest, qs: QueueState) -> tuple[bool, bool]:
    """(within-queue candidates may exist, reclaim candidates may exist)."""
    policy = qs.config.preemption
    within = policy.within_queue == "LowerPriority" and ledger.has_lower(qs.name, req.priority)
    reclaim = (
        policy.reclaim_within_cohort != "Never"
        and qs.cohort is not None
        and book.cohort_borrowing(qs)
    )
    return within, reclaim


def worth_planning(book: QuotaBook, ledger: Ledger, req: GangRequest, qs: QueueState) -> bool:
    """Cheap pre-check: could any admitted gang be a victim for this request at all?"""
    return any(_modes(book, ledger, req, qs))


def plan_preemption(
    inv: Inventory,
    book: QuotaBook,
    ledger: Ledger,
    req: GangRequest,
    gang: Gang,
    qs: QueueState,
    cands: Candidates,
    allow_fallback: bool,
    now: float,
    protected: Callable[[Alloc, bool], bool] | None = None,
) -> Plan | None:
    """The cheapest set of victims that lets the whole gang start on one pool, or None."""
    policy = qs.config.preemption
    within, reclaim = _modes(book, ledger, req, qs)
    if not within and not reclaim:
        return None
    lower_only = policy.reclaim_within_cohort == "LowerPriority"
    need_gpu = gang.total[0]
    best: Plan | None = None
    tried = 0
    queues_for: dict[str, list[str]] = {}

    def victim_queues(cls: str) -> list[str]:
        names = queues_for.get(cls)
        if names is None:
            names = [qs.name] if within else []
            if reclaim and qs.cohort is not None and book.within_nominal(qs, cls, gang.total):
                names.extend(
                    m.name
                    for m in book.tree_members(qs)
                    if m is not qs and m.config.reclaimable and book.lent_out(m, qs, cls)
                )
            queues_for[cls] = names
        return names

    for gi, group in enumerate(cands.groups):
        if cands.ranks[gi] == 1 and not allow_fallback:
            continue
        for pool in group:
            if pool.key in req.avoid_pools:
                continue
            sums = ledger.gpu.get(pool.key)
            if not sums:
                continue
            names = victim_queues(pool.flavor_class)
            freeable = sum(sums.get(q, 0) for q in names)
            if (need_gpu and not freeable) or pool.free_gpu + freeable < need_gpu:
                continue
            here = ledger.by_pool.get(pool.key, {})
            victims: list[Alloc] = []
            for qname in names:
                allocs = here.get(qname)
                if not allocs:
                    continue
                own = qname == qs.name
                for a in allocs.values():
                    if not a.charged or a.doomed_by is not None or a.fresh:
                        continue
                    if (own or lower_only) and a.priority >= req.priority:
                        continue
                    if protected is not None and protected(a, own):
                        continue
                    victims.append(a)
            if not victims:
                continue
            chosen = _try_pool(_Trial(inv, book, req, gang, qs, pool), victims, now)
            tried += 1
            if chosen:
                lost = sum(a.lost_work(now) for a in chosen)
                if best is None or lost < best.lost:
                    kind: Literal["within-queue", "reclaim"] = (
                        "reclaim" if any(a.queue != qs.name for a in chosen) else "within-queue"
                    )
                    best = Plan(pool, chosen, lost, kind)
            if tried >= PLAN_POOLS:
                return best
    return best
