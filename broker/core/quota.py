"""Queue quotas per flavor class with Kueue's ClusterQueue and Cohort semantics, and DRF shares.

Quota rules (Kueue v1beta1, hierarchical cohorts):
- A queue with `quotas: None` has no limits and takes no part in cohort accounting.
- A queue with quotas may use only the flavor classes it lists. A listed class that omits a
  resource does not limit it (`unlisted_resources: unlimited`, Muster's default) or gives it
  zero quota (`zero`, Kueue's rule).
- Queues are the leaves of a tree of cohorts. For one (class, resource) every node has a
  nominal N, a borrowing limit B (None = unbounded) and a lending limit L (None = lends all).
  A node's subtree quota S is N for a queue and, for a cohort, its own N plus what each child
  lends up, S_child - G_child, where G = max(0, S - L) (0 when L is None) is never lent. A
  node's usage is its own for a queue and, for a cohort, the sum over children of
  max(0, usage_child - G_child). What a node can still use is Kueue's `available()`:

      root:  S - usage
      other: max(0, G - usage) + min(available(parent), (S - G) - max(0, usage - G) + B)

  so borrowing walks up the tree and every limit bounds its whole subtree.
- Usage of every gang is charged, whole (gpu, cpu and memory of all podsets, CPU-only ones
  included), to the flavor class of the pool its GPU podsets landed on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from broker.core.types import Bound, ReasonCode, Vec, add_amounts
from schemas.api import FlavorUsage, QueueView, ResourceUsage
from schemas.config import CohortConfig, FlavorQuota, QueueConfig

RESOURCES: tuple[str, str, str] = ("gpu", "cpu", "memory")
_INF = 1 << 62


@dataclass(frozen=True, slots=True)
class Limit:
    nominal: int
    borrowing: int | None
    lending: int | None

    @property
    def guaranteed(self) -> int:
        if self.lending is None:
            return 0
        return max(0, self.nominal - self.lending)


Limits = tuple[Limit | None, Limit | None, Limit | None]


class QuotaMiss(NamedTuple):
    """Why a demand does not fit a queue's quota in one flavor class, with its numbers."""

    code: ReasonCode
    message: str
    bound: Bound | None = None


_ZERO = Limit(0, 0, None)


@dataclass(slots=True, eq=False)
class QueueState:
    """One queue's configuration and what it uses now."""

    config: QueueConfig
    name: str
    index: int
    limits: dict[str, Limits] | None  # None = unlimited
    cohort: Cohort | None = None
    usage: dict[str, list[int]] = field(default_factory=dict)
    total: list[int] = field(default_factory=lambda: [0, 0, 0])
    admitted: int = 0
    # Fabric resources: class -> resource -> cap (`FlavorQuota.extended`), and what is held.
    ext_caps: dict[str, Mapping[str, int]] = field(default_factory=dict)
    ext_used: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def strict(self) -> bool:
        return self.config.strategy == "StrictFIFO"

    def used(self, cls: str) -> list[int]:
        return self.usage.get(cls) or [0, 0, 0]


@dataclass(slots=True, eq=False)
class Cohort:
    """An inner node of the quota tree: `lendable` is its subtree quota S and `borrowed` its
    usage as defined in the module docstring, per flavor class and resource."""

    name: str
    parent: Cohort | None = None
    limits: dict[str, Limits] = field(default_factory=dict)
    members: list[QueueState] = field(default_factory=list)
    children: list[Cohort] = field(default_factory=list)
    lendable: dict[str, list[int]] = field(default_factory=dict)
    borrowed: dict[str, list[int]] = field(default_factory=dict)

    def own(self, cls: str, r: int) -> Limit | None:
        lims = self.limits.get(cls)
        return lims[r] if lims is not None else None

    def guaranteed(self, cls: str, r: int) -> int:
        lim = self.own(cls, r)
        if lim is None or lim.lending is None:
            return 0
        return max(0, self.lendable[cls][r] - lim.lending)

    def depth(self) -> int:
        n, up = 0, self.parent
        while up is not None:
            n, up = n + 1, up.parent
        return n


def _limits(quotas: Iterable[FlavorQuota], zero_unlisted: bool) -> dict[str, Limits]:
    out: dict[str, Limits] = {}
    for fq in quotas:
        per: list[Limit | None] = [_ZERO if zero_unlisted else None] * 3
        for res, rq in fq.resources.items():
            per[RESOURCES.index(res)] = Limit(rq.nominal, rq.borrowing_limit, rq.lending_limit)
        out[fq.flavor] = (per[0], per[1], per[2])
    return out


def _limits_of(config: QueueConfig) -> dict[str, Limits] | None:
    if config.quotas is None:
        return None
    return _limits(config.quotas, config.unlisted_resources == "zero")


def amount_text(r: int, value: int) -> str:
    """An amount in the units users write: GPUs, cores, bytes with a binary suffix."""
    if r == 1:
        return f"{value / 1000:g}"
    if r == 2:
        for suffix, size in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20)):
            if abs(value) >= size:
                return f"{value / size:.4g}{suffix}"
    return str(value)


class QuotaBook:
    """All queues and cohorts; the only place quota arithmetic happens."""

    __slots__ = ("_trees", "cohorts", "queues")

    def __init__(self, queues: Sequence[QueueConfig], cohorts: Sequence[CohortConfig] = ()) -> None:
        self.queues: dict[str, QueueState] = {}
        self.cohorts: dict[str, Cohort] = {}
        self._trees: dict[str, list[QueueState]] = {}  # root cohort -> its queues (static)
        for cc in cohorts:
            co = self._cohort(cc.name)
            co.limits = _limits(cc.quotas, False)
            if cc.parent is not None:
                co.parent = self._cohort(cc.parent)
                co.parent.children.append(co)
        for i, qc in enumerate(queues):
            qs = QueueState(config=qc, name=qc.name, index=i, limits=_limits_of(qc))
            qs.ext_caps = {fq.flavor: fq.extended for fq in qc.quotas or () if fq.extended}
            self.queues[qc.name] = qs
            if qc.cohort is not None and qs.limits is not None:
                co = self._cohort(qc.cohort)
                co.members.append(qs)
                qs.cohort = co
                for cls, lims in qs.limits.items():
                    lend = self._classes(co, cls)
                    for r, lim in enumerate(lims):
                        if lim is not None:
                            lend[r] += lim.nominal - lim.guaranteed
        for co in sorted(self.cohorts.values(), key=Cohort.depth, reverse=True):
            for cls, lims in co.limits.items():
                lend = self._classes(co, cls)
                for r, lim in enumerate(lims):
                    if lim is not None:
                        lend[r] += lim.nominal
            if co.parent is not None:
                for cls, lend in co.lendable.items():
                    up = self._classes(co.parent, cls)
                    for r in range(3):
                        up[r] += lend[r] - co.guaranteed(cls, r)

    def _cohort(self, name: str) -> Cohort:
        co = self.cohorts.get(name)
        if co is None:
            co = self.cohorts[name] = Cohort(name)
        return co

    @staticmethod
    def _classes(co: Cohort, cls: str) -> list[int]:
        """co's subtree quota of cls, creating the entries of cls up to the root."""
        up: Cohort | None = co
        while up is not None and cls not in up.lendable:
            up.lendable[cls] = [0, 0, 0]
            up.borrowed[cls] = [0, 0, 0]
            up = up.parent
        return co.lendable[cls]

    # -- arithmetic ---------------------------------------------------------------------

    @classmethod
    def _cohort_available(cls_, co: Cohort, cls: str, r: int) -> int:
        quota = co.lendable.get(cls)
        if quota is None:
            return 0
        s = quota[r]
        u = co.borrowed[cls][r]
        if co.parent is None:
            return s - u
        g = co.guaranteed(cls, r)
        parent = cls_._cohort_available(co.parent, cls, r)
        lim = co.own(cls, r)
        if lim is not None and lim.borrowing is not None:
            parent = min(parent, (s - g) - max(0, u - g) + lim.borrowing)
        return max(0, g - u) + parent

    @classmethod
    def _available(cls_, q: QueueState, cls: str, r: int, lim: Limit, u: int) -> tuple[int, int]:
        """(what the queue can still use, what its own limits alone would allow)."""
        co = q.cohort
        if co is None:
            avail = lim.nominal - u
            return avail, avail
        g = lim.guaranteed
        local = max(0, g - u)
        if co.parent is None:  # a flat cohort: the common case, inline
            quota = co.lendable.get(cls)
            parent = quota[r] - co.borrowed[cls][r] if quota is not None else 0
        else:
            parent = cls_._cohort_available(co, cls, r)
        own = _INF
        if lim.borrowing is not None:
            cap = (lim.nominal - g) - max(0, u - g) + lim.borrowing
            own = local + cap
            parent = min(parent, cap)
        return local + parent, own

    def check(self, q: QueueState, cls: str, demand: Vec) -> QuotaMiss | None:
        """None when `demand` fits the queue's quota in `cls`, else the binding limit."""
        limits = q.limits
        if limits is None:
            return None
        lims = limits.get(cls)
        if lims is None:
            return QuotaMiss(
                "quota-exceeded", f"queue {q.name} has no quota for flavor class {cls}"
            )
        u = q.usage.get(cls)
        for r in range(3):
            lim = lims[r]
            d = demand[r]
            if lim is None or d == 0:
                continue
            used = u[r] if u is not None else 0
            avail, own = self._available(q, cls, r, lim, used)
            if d > avail:
                res = RESOURCES[r]
                if d > own:
                    bound = Bound(res, used, d, used + max(0, own))
                    if lim is _ZERO:
                        return QuotaMiss(
                            "quota-exceeded",
                            f"queue {q.name} needs {amount_text(r, d)} {res} of {cls}, and its "
                            f"quota of {cls} does not list {res}, so it admits none",
                            bound,
                        )
                    borrowing = "none" if lim.borrowing is None else amount_text(r, lim.borrowing)
                    return QuotaMiss(
                        "quota-exceeded",
                        f"queue {q.name} needs {amount_text(r, d)} {res} of {cls}; its limit "
                        f"leaves {amount_text(r, max(0, own))} (nominal "
                        f"{amount_text(r, lim.nominal)}, borrowing limit {borrowing}, used "
                        f"{amount_text(r, used)})",
                        bound,
                    )
                return QuotaMiss(
                    "cohort-exhausted",
                    f"queue {q.name} needs {amount_text(r, d)} {res} of {cls}; cohort "
                    f"{q.cohort.name if q.cohort else '-'} leaves {amount_text(r, max(0, avail))}",
                    Bound(res, used, d, used + max(0, avail)),
                )
        return None

    @staticmethod
    def check_ext(q: QueueState, cls: str, ext: Mapping[str, int]) -> QuotaMiss | None:
        """None when the fabric resources `ext` fit the queue's caps in `cls`."""
        caps = q.ext_caps.get(cls)
        if not caps or not ext:
            return None
        used = q.ext_used.get(cls, {})
        for res, amount in ext.items():
            cap = caps.get(res)
            if cap is not None and used.get(res, 0) + amount > cap:
                return QuotaMiss(
                    "quota-exceeded",
                    f"queue {q.name} needs {amount} {res} of {cls}; its cap of {cap} leaves "
                    f"{max(0, cap - used.get(res, 0))}",
                )
        return None

    @staticmethod
    def charge_ext(q: QueueState, cls: str, ext: Mapping[str, int], sign: int) -> None:
        add_amounts(q.ext_used.setdefault(cls, {}), ext, sign)

    def charge(self, q: QueueState, cls: str, vec: Vec, sign: int) -> None:
        """Add (sign=1) or remove (sign=-1) usage, keeping the cohorts' usage up the tree."""
        u = q.usage.get(cls)
        if u is None:
            u = q.usage[cls] = [0, 0, 0]
        lims = q.limits.get(cls) if q.limits is not None else None
        co = q.cohort
        for r in range(3):
            d = vec[r] * sign
            if d == 0:
                continue
            old = u[r]
            new = old + d
            u[r] = new
            q.total[r] += d
            if co is not None and lims is not None:
                lim = lims[r]
                if lim is not None:
                    if lim.lending is None:  # nothing guaranteed: all of it counts upwards
                        up = (new if new > 0 else 0) - (old if old > 0 else 0)
                    else:
                        g = lim.guaranteed
                        up = max(0, new - g) - max(0, old - g)
                    if up:
                        self._lift(co, cls, r, up)
        q.admitted += sign

    @staticmethod
    def _lift(co: Cohort | None, cls: str, r: int, delta: int) -> None:
        while co is not None and delta:
            usage = co.borrowed[cls]
            old = usage[r]
            new = usage[r] = old + delta
            up = co.parent
            if up is None:
                return
            g = co.guaranteed(cls, r)
            delta = max(0, new - g) - max(0, old - g)
            co = up

    def within_nominal(self, q: QueueState, cls: str, demand: Vec) -> bool:
        """Would the queue stay inside its nominal quota of `cls` after taking `demand`?"""
        if q.limits is None:
            return False
        lims = q.limits.get(cls)
        if lims is None:
            return False
        u = q.used(cls)
        return all(lim is None or u[r] + demand[r] <= lim.nominal for r, lim in enumerate(lims))

    def borrowing(self, q: QueueState, cls: str) -> list[int]:
        """Resource indices in which the queue uses more than its nominal quota of `cls`."""
        if q.limits is None:
            return []
        lims = q.limits.get(cls)
        if lims is None:
            return []
        u = q.used(cls)
        return [r for r, lim in enumerate(lims) if lim is not None and u[r] > lim.nominal]

    def borrowed_amount(self, q: QueueState, cls: str, r: int) -> int:
        if q.limits is None:
            return 0
        lims = q.limits.get(cls)
        lim = lims[r] if lims is not None else None
        if lim is None:
            return 0
        return max(0, q.used(cls)[r] - lim.nominal)

    def tree_members(self, q: QueueState) -> list[QueueState]:
        """Every queue of the cohort tree q belongs to (q's root cohort and all below it)."""
        co = q.cohort
        if co is None:
            return []
        while co.parent is not None:
            co = co.parent
        out = self._trees.get(co.name)
        if out is None:
            found: list[QueueState] = []
            todo = [co]
            while todo:
                c = todo.pop()
                found.extend(c.members)
                todo.extend(c.children)
            out = self._trees[co.name] = sorted(found, key=lambda m: m.index)
        return out

    @staticmethod
    def lender_path(victim: QueueState, preemptor: QueueState) -> list[QueueState | Cohort]:
        """The victim's queue and its cohorts below the lowest cohort it shares with the
        preemptor: the nodes that may hold quota lent across that common cohort. Empty when
        the two queues are in different trees."""
        if victim.cohort is not None and victim.cohort is preemptor.cohort:
            return [victim]  # siblings: the common cohort is their own
        shared: set[int] = set()
        up = preemptor.cohort
        while up is not None:
            shared.add(id(up))
            up = up.parent
        path: list[QueueState | Cohort] = [victim]
        co = victim.cohort
        while co is not None and id(co) not in shared:
            path.append(co)
            co = co.parent
        return path if co is not None else []

    def node_borrowed(self, node: QueueState | Cohort, cls: str, r: int) -> int:
        """How much of resource r in cls the node uses beyond its own (subtree) quota."""
        if isinstance(node, QueueState):
            return self.borrowed_amount(node, cls, r)
        used = node.borrowed.get(cls)
        if used is None:
            return 0
        return max(0, used[r] - node.lendable[cls][r])

    def reclaimable(self, victim: QueueState, preemptor: QueueState, cls: str, vec: Vec) -> bool:
        """May `vec` of the victim queue's use of `cls` be taken back for the preemptor? Only
        what was lent across their common cohort: the victim's queue and the subtree that
        hangs off that cohort both borrow, and each stays at or above its quota afterwards in
        every resource it borrows. Siblings of one cohort: the victim queue's own borrowing."""
        path = self.lender_path(victim, preemptor)
        if not path:
            return False
        if len(path) == 1:  # siblings: the victim queue's own borrowing (the common case)
            borrowing = self.borrowing(victim, cls)
            return bool(borrowing) and all(
                vec[r] <= self.borrowed_amount(victim, cls, r) for r in borrowing
            )
        for node in (path[0], path[-1]):
            borrowed = [self.node_borrowed(node, cls, r) for r in range(3)]
            rs = [r for r in range(3) if borrowed[r] > 0]
            if not rs or any(vec[r] > borrowed[r] for r in rs):
                return False
        return True

    def lent_out(self, victim: QueueState, preemptor: QueueState, cls: str) -> bool:
        """Does the victim queue use quota lent across its common cohort with the preemptor?"""
        return self.reclaimable(victim, preemptor, cls, (0, 0, 0))

    def cohort_borrowing(self, q: QueueState) -> bool:
        """Does any other reclaimable queue of q's cohort tree use quota lent to it?"""
        for m in self.tree_members(q):
            if m is q or not m.config.reclaimable or m.limits is None:
                continue
            for cls in m.usage:
                if self.lent_out(m, q, cls):
                    return True
        return False

    @staticmethod
    def share(q: QueueState, fleet: Sequence[int]) -> float:
        """Weighted dominant share: max over resources of usage / fleet total, / weight."""
        best = 0.0
        for r in range(3):
            tot = fleet[r]
            if tot > 0:
                s = q.total[r] / tot
                if s > best:
                    best = s
        return best / q.config.weight

    # -- views --------------------------------------------------------------------------

    def _lent(self, q: QueueState, cls: str, r: int) -> int:
        """q's share of what the rest of its cohort borrows, pro rata to unused lendable."""
        co = q.cohort
        if co is None or q.limits is None:
            return 0

        def unused_lendable(m: QueueState) -> int:
            lims = m.limits.get(cls) if m.limits is not None else None
            lim = lims[r] if lims is not None else None
            if lim is None:
                return 0
            room = max(0, lim.nominal - m.used(cls)[r])
            return min(room, lim.nominal - lim.guaranteed)

        borrowed = sum(self.borrowed_amount(m, cls, r) for m in co.members if m is not q)
        mine = unused_lendable(q)
        pool = sum(unused_lendable(m) for m in co.members)
        if borrowed <= 0 or mine <= 0 or pool <= 0:
            return 0
        return min(mine, borrowed * mine // pool)

    def view(self, q: QueueState, pending: int, fleet: Sequence[int]) -> QueueView:
        classes: Iterable[str] = list(q.limits) if q.limits is not None else []
        classes = list(dict.fromkeys([*classes, *sorted(q.usage)]))
        flavors: list[FlavorUsage] = []
        for cls in classes:
            lims = q.limits.get(cls) if q.limits is not None else None
            u = q.used(cls)
            rows: list[ResourceUsage] = []
            for r, res in enumerate(RESOURCES):
                lim = lims[r] if lims is not None else None
                if lim is None:
                    if u[r]:
                        rows.append(ResourceUsage(resource=res, used=u[r]))
                    continue
                rows.append(
                    ResourceUsage(
                        resource=res,
                        nominal=lim.nominal,
                        borrowing_limit=lim.borrowing,
                        lending_limit=lim.lending,
                        used=u[r],
                        borrowed=max(0, u[r] - lim.nominal),
                        lent=self._lent(q, cls, r),
                    )
                )
            flavors.append(FlavorUsage(flavor=cls, resources=rows))
        path = None
        if q.cohort is not None:
            names: list[str] = []
            up: Cohort | None = q.cohort
            while up is not None:
                names.append(up.name)
                up = up.parent
            path = "/".join(reversed(names))  # "org/team" for a nested cohort
        return QueueView(
            name=q.name,
            cohort=path or q.config.cohort,
            strategy=q.config.strategy,
            weight=q.config.weight,
            pending=pending,
            admitted=q.admitted,
            dominant_share=self.share(q, fleet),
            flavors=flavors,
            unlimited=q.limits is None,
        )


# -- what a queue could ever hold, and what binds it now -----------------------------------


def _amount(r: int, value: int) -> str:
    """A quota amount as a person reads it: GPUs, cores, GiB."""
    if r == 1:
        return f"{value / 1000:g}"
    if r == 2:
        return f"{value / 2**30:g}Gi"
    return str(value)


def quota_ceiling(q: QueueState, cls: str, r: int) -> int | None:
    """The most of resource `r` in `cls` the queue could hold with nothing else admitted:
    nominal + borrowing limit, capped by what its cohort lends. None = no limit; 0 when the
    queue lists no quota for the class."""
    if q.limits is None:
        return None
    lims = q.limits.get(cls)
    if lims is None:
        return 0
    lim = lims[r]
    if lim is None:
        return None
    co = q.cohort
    if co is None:
        return lim.nominal
    g = lim.guaranteed
    lendable = cohort_reach(co, cls, r)
    if lim.borrowing is None:
        return g + lendable
    return g + min(lendable, lim.nominal - g + lim.borrowing)


def cohort_reach(co: Cohort, cls: str, r: int) -> int:
    """The most of resource `r` in `cls` a cohort's subtree could hold with nothing else
    admitted: its own subtree quota plus what it may borrow from its parent's reach, within
    its borrowing limit (a nested quota may grow into what the levels above lend)."""
    own = co.lendable[cls][r] if cls in co.lendable else 0
    if co.parent is None:
        return own
    above = max(0, cohort_reach(co.parent, cls, r) - own)
    lim = co.own(cls, r)
    if lim is not None and lim.borrowing is not None:
        above = min(above, lim.borrowing)
    return own + above


def _ceiling_text(q: QueueState, cls: str, r: int, demand: int, ceiling: int) -> str:
    lims = q.limits.get(cls) if q.limits is not None else None
    lim = lims[r] if lims is not None else None
    res = RESOURCES[r]
    if lim is None:
        return f"{cls}: queue {q.name} has no quota for it"
    need = f"{cls}: needs {_amount(r, demand)} {res} > {_amount(r, ceiling)}"
    if q.cohort is None:
        return f"{need} (nominal {_amount(r, lim.nominal)}, no cohort to borrow from)"
    if lim.borrowing is None:
        return f"{need} (nominal {_amount(r, lim.nominal)} + all cohort {q.cohort.name} lends)"
    borrow = _amount(r, lim.borrowing)
    lendable = _amount(r, cohort_reach(q.cohort, cls, r))
    return (
        f"{need} (nominal {_amount(r, lim.nominal)} + borrowing limit {borrow}, of which "
        f"cohort {q.cohort.name} can lend at most {lendable})"
    )


def never_admissible(q: QueueState, classes: Iterable[str], demand: Vec) -> str | None:
    """None when some class in `classes` could ever hold `demand` under the queue's quota, else
    why not (per class, with the numbers). A queue without quotas admits anything."""
    if q.limits is None:
        return None
    problems: list[str] = []
    for cls in classes:
        failed = None
        for r in range(3):
            if demand[r] == 0:
                continue
            ceiling = quota_ceiling(q, cls, r)
            if ceiling is not None and demand[r] > ceiling:
                failed = _ceiling_text(q, cls, r, demand[r], ceiling)
                break
        if failed is None:
            return None
        problems.append(failed)
    if not problems:
        return f"queue {q.name} has no quota for any flavor class this job accepts"
    return f"queue {q.name} can never admit it: " + "; ".join(problems)


def binding_quota(book: QuotaBook, q: QueueState, cls: str, demand: Vec) -> QuotaMiss | None:
    """None when `demand` fits the queue's quota in `cls` now, else the binding limit with its
    numbers, e.g. `quota q gpu 8/8 used, needs 16 > nominal 8 + borrow 4`."""
    miss = book.check(q, cls, demand)
    if miss is None:
        return None
    return QuotaMiss(miss.code, _binding_text(book, q, cls, demand), miss.bound)


def _binding_text(book: QuotaBook, q: QueueState, cls: str, demand: Vec) -> str:
    limits = q.limits or {}
    lims = limits.get(cls)
    if lims is None:
        return f"queue {q.name} has no quota for flavor class {cls}"
    used = q.used(cls)
    for r in range(3):
        lim = lims[r]
        if lim is None or demand[r] == 0:
            continue
        avail, own = book._available(q, cls, r, lim, used[r])
        if demand[r] <= avail:
            continue
        res = RESOURCES[r]
        head = (
            f"quota {q.name} {res} {_amount(r, used[r])}/{_amount(r, lim.nominal)} used, "
            f"needs {_amount(r, demand[r])}"
        )
        if demand[r] > own:
            borrow = "∞" if lim.borrowing is None else _amount(r, lim.borrowing)
            return (
                f"{head} > {_amount(r, max(0, own))} left of nominal "
                f"{_amount(r, lim.nominal)} + borrow {borrow}"
            )
        co = q.cohort.name if q.cohort is not None else "-"
        return f"{head}; cohort {co} has {_amount(r, max(0, avail))} left to lend"
    return f"queue {q.name}: quota of {cls} does not cover it"
