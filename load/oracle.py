"""The hindsight bound: the least any schedule could have paid for the work a run completed,
knowing the whole run's capacity in advance.

A linear program over time slots of the run (`SLOT_S`), solved offline after the run:

- the capacity is what was really there: each pool's GPU-seconds of present nodes per slot,
  from the run's own node log (spot nodes between their add and their reclaim; autoscaled
  nodes while they were up);
- every job the run completed must get its work done (GPUs x V100-seconds, Philly's duration
  at the GPU's speed): its work may be split over pools and slots at will (divisible, packed
  into GPUs freely, no checkpoint, no start-up, no restore, no lost work), but it is never
  run twice, never before it arrives, never on a pool its capacity preference refuses (`spot`
  only spot, `on-demand` only on-demand, `spot-then-on-demand` and `any` both), never on more
  GPUs at once than its gang holds, and on a pool only while that pool has at least as many
  GPUs present as the fewest the gang runs on (a gang runs whole, on one pool: its work on a
  pool in a slot is at most its GPUs x the seconds of the slot when the pool held that many);
- the cost is each pool's price x GPU-seconds used.

Every schedule the simulator can produce for those jobs satisfies these constraints (one live
attempt per job, on capacity that was present, within the preference), and pays at least as
much for them, so the bound's cost per useful GPU-hour is never above the run's: a run "beating"
it would be a bug in the simulator or here. It is a bound, not a policy: nothing replays it.

Jobs with the same allowed pools arriving in the same slot are merged (their work and their
GPU caps add up), which only relaxes the program further. Solved with SciPy's HiGHS (`linprog`).
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

try:
    import numpy as np
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix
except ImportError as exc:  # the simulator's tools come with the dev extra
    raise ImportError(
        "the hindsight bound (load/oracle.py) needs SciPy: pip install -e '.[dev]'"
    ) from exc

SLOT_S = 900.0  # the program's time step (s); finer is tighter and slower

PoolKey = tuple[str, str]  # (cluster, flavor)


@dataclass(frozen=True, slots=True)
class BoundPool:
    key: PoolKey
    capacity_type: str  # "spot" | "on-demand"
    price: float  # $ per GPU-hour
    speed: float  # V100-seconds of work per GPU-second


@dataclass(frozen=True, slots=True)
class BoundJob:
    arrival: float  # seconds from the run's start
    gpus: int
    work: float  # V100-GPU-seconds
    capacity: str  # the capacity preference the run's broker saw
    finish: float | None = None  # done by then (s from the start); None: by the run's end
    # The fewest GPUs it runs on at once, all on one pool (an elastic gang's minimum): it uses
    # a pool only while that many are present there. 0: no floor.
    whole_gpus: int = 0


@dataclass(frozen=True, slots=True)
class Bound:
    cost_usd: float
    useful_gpu_h: float  # V100-GPU-hours of the jobs it covers
    jobs: int
    slots: int
    # V100-GPU-hours of work the bound's schedule does on each pool (where the cheap work is).
    work_by_pool: Mapping[PoolKey, float] = field(default_factory=dict)

    @property
    def cost_per_useful_gpu_h(self) -> float:
        return self.cost_usd / self.useful_gpu_h if self.useful_gpu_h > 0 else math.nan


class BoundError(RuntimeError):
    """The program has no solution: the run completed work the capacity log cannot hold."""


def allows(preference: str, capacity_type: str) -> bool:
    """Whether a job of this capacity preference may use a pool of this capacity type."""
    if preference == "spot":
        return capacity_type == "spot"
    if preference == "on-demand":
        return capacity_type == "on-demand"
    return True  # spot-then-on-demand, any


def slot_capacity(
    spans: Iterable[tuple[PoolKey, int, float, float]], end: float, slot_s: float = SLOT_S
) -> dict[PoolKey, list[float]]:
    """GPU-seconds present per pool per slot, from (pool, GPUs, start, end) node spans."""
    slots = max(1, math.ceil(end / slot_s))
    out: dict[PoolKey, list[float]] = defaultdict(lambda: [0.0] * slots)
    for key, gpus, start, stop in spans:
        lo, hi = max(0.0, start), min(end, stop)
        if hi <= lo:
            continue
        row = out[key]
        for t in range(int(lo // slot_s), min(slots, math.ceil(hi / slot_s))):
            a, b = max(lo, t * slot_s), min(hi, (t + 1) * slot_s)
            if b > a:
                row[t] += gpus * (b - a)
    return dict(out)


class Presence:
    """How many GPUs a pool had present over the run, as steps: the seconds within any span
    during which it held at least some number of them (what a whole gang needs)."""

    def __init__(self, spans: Iterable[tuple[int, float, float]]) -> None:
        change: dict[float, int] = defaultdict(int)
        for gpus, start, stop in spans:
            if stop > start:
                change[start] += gpus
                change[stop] -= gpus
        self.times = sorted(change)
        self.counts: list[int] = []  # GPUs present from times[i] to times[i + 1]
        present = 0
        for t in self.times:
            present += change[t]
            self.counts.append(present)
        self._at_least: dict[int, list[float]] = {}

    def seconds(self, gpus: int, lo: float, hi: float) -> float:
        """Seconds within [lo, hi] when at least `gpus` GPUs were present."""
        if hi <= lo or not self.times:
            return 0.0
        return self._upto(gpus, hi) - self._upto(gpus, lo)

    def _upto(self, gpus: int, x: float) -> float:
        cum = self._at_least.get(gpus)
        if cum is None:  # seconds with at least `gpus` present up to each step
            cum = [0.0]
            for i in range(1, len(self.times)):
                held = self.counts[i - 1] >= gpus
                cum.append(cum[-1] + (self.times[i] - self.times[i - 1] if held else 0.0))
            self._at_least[gpus] = cum
        i = bisect.bisect_right(self.times, x) - 1
        if i < 0:
            return 0.0
        return cum[i] + (x - self.times[i] if self.counts[i] >= gpus else 0.0)


def presence(spans: Iterable[tuple[PoolKey, int, float, float]]) -> dict[PoolKey, Presence]:
    """Each pool's `Presence`, from (pool, GPUs, start, end) node spans."""
    by_pool: dict[PoolKey, list[tuple[int, float, float]]] = defaultdict(list)
    for key, gpus, start, stop in spans:
        by_pool[key].append((gpus, start, stop))
    return {key: Presence(rows) for key, rows in by_pool.items()}


def hindsight_bound(
    jobs: Sequence[BoundJob],
    pools: Sequence[BoundPool],
    capacity: Mapping[PoolKey, Sequence[float]],
    end: float,
    slot_s: float = SLOT_S,
    present: Mapping[PoolKey, Presence] | None = None,
) -> Bound:
    """The least cost of doing every job's work on the capacity that was there (see above).
    Without `present`, a job's floor of GPUs (`whole_gpus`) is not applied."""
    slots = max(1, math.ceil(end / slot_s))
    useful = sum(j.work for j in jobs) / 3600.0
    if not jobs:
        return Bound(0.0, 0.0, 0, slots)
    # Groups: the jobs of one preference arriving in one slot. Their rate cap per slot is the
    # sum of their gangs' GPUs over the part of the slot after each one's arrival.
    work: dict[tuple[str, int, int], float] = defaultdict(float)
    rate: dict[tuple[str, int, int], list[float]] = {}
    members: dict[tuple[str, int, int], list[tuple[BoundJob, float]]] = defaultdict(list)
    for j in jobs:
        first = min(slots - 1, int(j.arrival // slot_s))
        stop = end if j.finish is None else min(end, j.finish)
        last = max(first, min(slots, math.ceil(stop / slot_s)) - 1)
        g = (j.capacity, first, last)
        work[g] += j.work
        members[g].append((j, stop))
        caps = rate.setdefault(g, [0.0] * slots)
        for t in range(first, last + 1):
            lo, hi = max(j.arrival, t * slot_s), min(stop, (t + 1) * slot_s)
            caps[t] += j.gpus * max(0.0, hi - lo)
    whole: dict[tuple[PoolKey, int, int], float] = {}  # (pool, GPUs, slot) -> whole-slot seconds

    def pool_cap(key: PoolKey, g: tuple[str, int, int], t: int) -> float:
        """The most GPU-seconds the group's jobs can use on pool `key` in slot `t`, each only
        while the pool held its floor of GPUs (inf: no floor applies)."""
        have = present.get(key) if present is not None else None
        if have is None:
            return math.inf
        total = 0.0
        for j, stop in members[g]:
            lo, hi = max(j.arrival, t * slot_s), min(stop, (t + 1) * slot_s)
            if hi <= lo:
                continue
            if j.whole_gpus <= 0:
                total += j.gpus * (hi - lo)
            elif lo == t * slot_s and hi == (t + 1) * slot_s:
                k = (key, j.whole_gpus, t)
                if k not in whole:
                    whole[k] = have.seconds(j.whole_gpus, lo, hi)
                total += j.gpus * whole[k]
            else:
                total += j.gpus * have.seconds(j.whole_gpus, lo, hi)
        return total

    pool_index = {p.key: i for i, p in enumerate(pools)}
    cost: list[float] = []
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    n_groups = len(work)
    # Row layout: [demand rows (equalities)] then [pool x slot caps] then [group x slot caps].
    cap_row = {
        (p, t): n_groups + i * slots + t for i, p in enumerate(pool_index) for t in range(slots)
    }
    group_base = n_groups + len(pools) * slots
    var = 0
    var_pool: list[tuple[PoolKey, float]] = []
    var_cap: list[float] = []
    for gi, (pref, first, last) in enumerate(sorted(work)):
        caps = rate[(pref, first, last)]
        usable = [p for p in pools if allows(pref, p.capacity_type)]
        if not usable:
            raise BoundError(f"no pool accepts capacity preference {pref!r}")
        for t in range(first, last + 1):
            if caps[t] <= 0:
                continue
            for p in usable:
                if capacity.get(p.key) is None or capacity[p.key][t] <= 0:
                    continue
                most = pool_cap(p.key, (pref, first, last), t)
                if most <= 0:
                    continue
                var_cap.append(most)
                cost.append(p.price / 3600.0)
                var_pool.append((p.key, p.speed))
                rows += [gi, cap_row[(p.key, t)], group_base + gi * slots + t]
                cols += [var, var, var]
                vals += [p.speed, 1.0, 1.0]
                var += 1
    if var == 0:
        raise BoundError("no capacity at all in the run's capacity log")
    n_rows = group_base + n_groups * slots
    a = coo_matrix((vals, (rows, cols)), shape=(n_rows, var)).tocsr()
    demand = np.array([w for _, w in sorted(work.items())])
    upper = np.zeros(n_rows - n_groups)
    for p in pools:
        row = capacity.get(p.key)
        for t in range(slots):
            upper[cap_row[(p.key, t)] - n_groups] = row[t] if row is not None else 0.0
    for gi, g in enumerate(sorted(work)):
        upper[group_base - n_groups + gi * slots : group_base - n_groups + (gi + 1) * slots] = rate[
            g
        ]
    res = linprog(
        np.array(cost),
        A_ub=a[n_groups:],
        b_ub=upper,
        A_eq=a[:n_groups],
        b_eq=demand,
        bounds=[(0.0, None if math.isinf(c) else c) for c in var_cap],
        method="highs",
    )
    if res.status != 0:
        raise BoundError(
            f"the hindsight program found no schedule ({res.message}); the capacity log "
            "cannot hold the work the run completed"
        )
    by_pool: dict[PoolKey, float] = defaultdict(float)
    for (key, speed), gpu_s in zip(var_pool, res.x, strict=True):
        by_pool[key] += gpu_s * speed / 3600.0
    return Bound(float(res.fun), useful, len(jobs), slots, dict(by_pool))


def bound_summary(
    bound: Bound, summary: Mapping[str, Any], timed: Bound | None = None
) -> dict[str, float]:
    """The bounds' figures for a run's summary row, and the run's cost over each."""
    run = float(summary.get("cost_per_useful_gpu_h", math.nan))
    out: dict[str, float] = {}
    for prefix, b in (("bound", bound), ("bound_timed", timed)):
        if b is None:
            continue
        per = b.cost_per_useful_gpu_h
        out[f"{prefix}_cost_usd"] = b.cost_usd
        out[f"{prefix}_cost_per_useful_gpu_h"] = per
        out[f"vs_{prefix}"] = run / per if per > 0 and math.isfinite(run) else math.nan
    return out
