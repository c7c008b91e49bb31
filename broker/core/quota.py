"""Queue quotas per flavor class with Kueue's ClusterQueue semantics, and DRF shares.

Quota rules (Kueue v1beta1, one cohort level):
- A queue with `quotas: None` has no limits and takes no part in cohort accounting.
- A queue with quotas may use only the flavor classes it lists. A listed class that omits a
  resource does not limit that resource.
- For one (class, resource): nominal N, borrowing limit B (None = unbounded), lending limit L
  (None = lends all unused nominal). The guaranteed part G = N - L (0 when L is None) is never
  lent. The cohort pool holds the sum over members of N - G; each member's usage above its G
  draws from that pool. A queue can use

      max(0, G - u) + min(pool_total - pool_used, (N - G) - max(0, u - G) + B)

  which is Kueue's `available()` for a ClusterQueue under a flat cohort.
- Usage of every gang is charged, whole (gpu, cpu and memory of all podsets, CPU-only ones
  included), to the flavor class of the pool its GPU podsets landed on.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from broker.core.types import ReasonCode
from schemas.api import FlavorUsage, QueueView, ResourceUsage
from schemas.config import QueueConfig

RESOURCES: tuple[str, str, str] = ("gpu", "cpu", "memory")
_INF = 1 << 62

Vec = tuple[int, int, int]  # (gpu, cpu_milli, memory bytes)


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

    @property
    def strict(self) -> bool:
        return self.config.strategy == "StrictFIFO"

    def used(self, cls: str) -> list[int]:
        return self.usage.get(cls) or [0, 0, 0]


@dataclass(slots=True, eq=False)
class Cohort:
    name: str
    members: list[QueueState] = field(default_factory=list)
    lendable: dict[str, list[int]] = field(default_factory=dict)
    borrowed: dict[str, list[int]] = field(default_factory=dict)


def _limits_of(config: QueueConfig) -> dict[str, Limits] | None:
    if config.quotas is None:
        return None
    out: dict[str, Limits] = {}
    for fq in config.quotas:
        per: list[Limit | None] = [None, None, None]
        for res, rq in fq.resources.items():
            per[RESOURCES.index(res)] = Limit(rq.nominal, rq.borrowing_limit, rq.lending_limit)
        out[fq.flavor] = (per[0], per[1], per[2])
    return out


class QuotaBook:
    """All queues and cohorts; the only place quota arithmetic happens."""

    __slots__ = ("cohorts", "queues")

    def __init__(self, queues: Sequence[QueueConfig]) -> None:
        self.queues: dict[str, QueueState] = {}
        self.cohorts: dict[str, Cohort] = {}
        for i, qc in enumerate(queues):
            qs = QueueState(config=qc, name=qc.name, index=i, limits=_limits_of(qc))
            self.queues[qc.name] = qs
            if qc.cohort is not None and qs.limits is not None:
                co = self.cohorts.setdefault(qc.cohort, Cohort(qc.cohort))
                co.members.append(qs)
                qs.cohort = co
                for cls, lims in qs.limits.items():
                    lend = co.lendable.setdefault(cls, [0, 0, 0])
                    co.borrowed.setdefault(cls, [0, 0, 0])
                    for r, lim in enumerate(lims):
                        if lim is not None:
                            lend[r] += lim.nominal - lim.guaranteed

    # -- arithmetic ---------------------------------------------------------------------

    @staticmethod
    def _available(q: QueueState, cls: str, r: int, lim: Limit, u: int) -> tuple[int, int]:
        """(what the queue can still use, what its own limits alone would allow)."""
        co = q.cohort
        if co is None:
            avail = lim.nominal - u
            return avail, avail
        g = lim.guaranteed
        local = max(0, g - u)
        parent = co.lendable[cls][r] - co.borrowed[cls][r]
        own = _INF
        if lim.borrowing is not None:
            cap = (lim.nominal - g) - max(0, u - g) + lim.borrowing
            own = local + cap
            parent = min(parent, cap)
        return local + parent, own

    def check(self, q: QueueState, cls: str, demand: Vec) -> tuple[ReasonCode, str] | None:
        """None when `demand` fits the queue's quota in `cls`, else (reason code, message)."""
        limits = q.limits
        if limits is None:
            return None
        lims = limits.get(cls)
        if lims is None:
            return ("quota-exceeded", f"queue {q.name} has no quota for flavor class {cls}")
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
                    return (
                        "quota-exceeded",
                        f"queue {q.name} needs {d} {res} of {cls}; its limit leaves "
                        f"{max(0, own)} (nominal {lim.nominal}, borrowing limit "
                        f"{lim.borrowing}, used {used})",
                    )
                return (
                    "cohort-exhausted",
                    f"queue {q.name} needs {d} {res} of {cls}; cohort "
                    f"{q.cohort.name if q.cohort else '-'} leaves {max(0, avail)}",
                )
        return None

    def charge(self, q: QueueState, cls: str, vec: Vec, sign: int) -> None:
        """Add (sign=1) or remove (sign=-1) usage, keeping the cohort's borrowed sums."""
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
                    g = lim.guaranteed
                    co.borrowed[cls][r] += max(0, new - g) - max(0, old - g)
        q.admitted += sign

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

    def cohort_borrowing(self, q: QueueState) -> bool:
        """Does any other reclaimable member of q's cohort borrow anything?"""
        co = q.cohort
        if co is None:
            return False
        for m in co.members:
            if m is q or not m.config.reclaimable or m.limits is None:
                continue
            for cls in m.usage:
                if self.borrowing(m, cls):
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
        return QueueView(
            name=q.name,
            cohort=q.config.cohort,
            strategy=q.config.strategy,
            weight=q.config.weight,
            pending=pending,
            admitted=q.admitted,
            dominant_share=self.share(q, fleet),
            flavors=flavors,
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
    lendable = co.lendable[cls][r]
    if lim.borrowing is None:
        return g + lendable
    return g + min(lendable, lim.nominal - g + lim.borrowing)


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
    return f"{need} (nominal {_amount(r, lim.nominal)} + borrowing limit {borrow})"


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


def binding_quota(book: QuotaBook, q: QueueState, cls: str, demand: Vec) -> str | None:
    """None when `demand` fits the queue's quota in `cls` now, else the binding limit with its
    numbers, e.g. `quota q gpu 8/8 used, needs 16 > nominal 8 + borrow 4`."""
    if book.check(q, cls, demand) is None:
        return None
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
