"""Where one gang goes, as a pure function: `assign(request, snapshot) -> Assignment | Reasons`.

Kueue's flavor assigner is the model: the search reads a snapshot of capacity and quota and
returns either an assignment (one cluster x flavor, a node per replica, the quota it charges)
or typed reasons with their numbers. It changes nothing; `Scheduler.commit` applies an
assignment. A snapshot carries memo tables for one admission cycle (candidate pools per gang
shape, failures per shape, pools found empty). They stay valid because a commit only ever
takes capacity and quota; whatever gives some back (a release, a hold returned) starts a new
snapshot. The candidate pools, which read no free capacity, are also kept from one cycle to the
next while the inventory holds (`Snapshot.kept`, `scheduler.CANDIDATES_KEPT_S`).

Partial admission (Kueue's `job-min-parallelism`): a request whose podsets carry
`min_replicas` below `replicas` is tried whole first; when that fails, the largest count at or
above the minimum that fits (quota and nodes, one pool) is admitted, found by bisection over
the scalable podset's replica count.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from broker.core.elastic import admission_note
from broker.core.inventory import Inventory, Node, Pool
from broker.core.placement import (
    TIE_EVAL,
    Candidates,
    Gang,
    Take,
    assignment_of,
    build_candidates,
    empty_fit,
    estimate,
    has_fallback_rank,
    make_gang,
    pack,
    pack_single,
    pool_cost,
)
from broker.core.quota import QueueState, QuotaBook, QuotaMiss
from broker.core.reasons import explain
from broker.core.risk import gang_cost_per_hour, gang_reclaim_rate
from broker.core.speed import speed_of
from broker.core.topology import Fit, applies, fits_now, place, zone_spread
from broker.core.types import (
    GangRequest,
    Placement,
    PodSetDemand,
    PoolKey,
    Reason,
    ReasonCode,
    Vec,
)

Shape = tuple[object, ...]
Reasons = tuple[Reason, ...]
# (job_id, queue, flavor class, demand) -> a refusal while another job's preemption claims it
ClaimCheck = Callable[[str, QueueState, str, Vec], QuotaMiss | None]


@dataclass(slots=True, eq=False)
class Assignment:
    """A placement found for one request, not yet applied (see `Scheduler.commit`). Not
    frozen only because a frozen dataclass costs twice as much to build, once per admission;
    nothing changes one after `assign` returns it."""

    request: GangRequest
    queue: QueueState
    pool: Pool
    placement: Placement
    per_node: dict[str, Vec]  # node -> (gpu, cpu_milli, memory) the gang takes there
    vec: Vec  # the quota it charges (whole gang, admitted replicas only)
    podsets: tuple[PodSetDemand, ...]  # as admitted: fewer replicas under partial admission

    @property
    def partial(self) -> bool:
        return self.podsets != self.request.podsets


@dataclass(slots=True)
class Snapshot:
    """Capacity, quota and the cycle's memo tables, as `assign` reads them."""

    inv: Inventory
    book: QuotaBook
    rate_of: Callable[[PoolKey], float]
    risk_weight: float
    claimed: ClaimCheck | None = None  # asked after the quota check passes...
    claims: Mapping[str, object] = field(default_factory=dict)  # ...while this is not empty
    cands: dict[Shape, Candidates] = field(default_factory=dict)
    cap_fail: dict[Shape, Reasons] = field(default_factory=dict)
    queue_fail: dict[tuple[str, Shape], Reasons] = field(default_factory=dict)
    gangs: dict[tuple[PodSetDemand, ...], Gang] = field(default_factory=dict)
    # (pool, GPUs, checkpoint interval) -> expected cost of a one-node gang there
    costs: dict[tuple[Pool, int, float | None], float] = field(default_factory=dict)
    # (node, podset, GPUs, checkpoint interval) -> the placement of that one replica there
    lone: dict[tuple[Node, str, int, float | None], Placement] = field(default_factory=dict)
    # shape -> its candidates (a shape decides the key of `cands`; saves building that key)
    by_shape: dict[object, Candidates] = field(default_factory=dict)
    # pool -> job -> GPUs of the pool's nodes held for a job waiting on nodes the pool is
    # adding (provision.py): other jobs see that much less free there
    held: Mapping[PoolKey, Mapping[str, int]] = field(default_factory=dict)
    # (queue, flavor class) -> job -> the quota a gang waiting on new nodes will charge: other
    # jobs of that queue may not take it meanwhile
    held_quota: Mapping[tuple[str, str], Mapping[str, Vec]] = field(default_factory=dict)
    # GPU type -> relative speed (`scheduling.gpu_speeds`): the priors of speed.py
    gpu_speeds: Mapping[str, float] = field(default_factory=dict)
    # The candidate pools built by earlier cycles, by the key of `cands`, while the inventory
    # holds (`Scheduler.snapshot` owns and clears it): each cycle copies their `live` lists
    # instead of ranking every pool of the fleet again. None: build every shape's afresh.
    kept: dict[Shape, Candidates] | None = None

    def gang(self, podsets: tuple[PodSetDemand, ...]) -> Gang:
        g = self.gangs.get(podsets)
        if g is None:
            g = self.gangs[podsets] = make_gang(podsets)
        return g

    def candidates(self, req: GangRequest, gang: Gang) -> Candidates:
        qs = self.book.queues.get(req.queue)
        order = qs.config.flavor_order if qs is not None else []
        key: Shape = (pool_terms(req), gang.total[0], (req.queue, *order) if order else "")
        c = self.cands.get(key)
        if c is not None:
            return c
        kept = self.kept.get(key) if self.kept is not None else None
        if kept is None:
            c = build_candidates(
                self.inv,
                req,
                gang.total[0],
                self.rate_of,
                self.risk_weight,
                order,
                speed_of(req.speeds, self.gpu_speeds),
            )
            if self.kept is not None:
                self.kept[key] = c
        else:  # the same pools in the same order; this cycle prunes its own copies
            c = replace(kept, live=[list(g) for g in kept.groups])
        self.cands[key] = c
        return c


def pool_terms(req: GangRequest) -> Shape:
    """The request's terms that decide which pools may host it and in what order (with the
    gang's GPUs and the queue's flavor order): part of every key a search is memoised by."""
    return (
        req.gpu_types,
        req.capacity,
        req.spot_exhausted,
        req.checkpoint_interval_s,
        req.spot_ok,
        req.speeds,
    )


def shape_of(req: GangRequest) -> Shape:
    """What decides a search's outcome besides the snapshot (requests alike fail alike): the
    one key the scheduler's and the snapshot's memo tables are built from."""
    return (
        req.podsets,
        pool_terms(req),
        req.avoid_pools,
        tuple(req.min_replicas.items()) if req.min_replicas else (),
        req.topology,
    )


def allow_fallback(req: GangRequest, gang: Gang, cands: Candidates) -> bool:
    """spot-then-on-demand may use on-demand when no spot pool could ever host the gang, and
    an `any` job that may not go to spot at its price may use spot when no on-demand pool
    could."""
    if not has_fallback_rank(req):
        return True
    return not any(empty_fit(p, gang) for p in cands.spot_pools)


def assign(
    req: GangRequest, qs: QueueState, snap: Snapshot, shape: Shape | None = None
) -> Assignment | Reasons:
    """The best placement of the whole gang (or, under partial admission, of the most
    replicas that fit), or why there is none. Changes nothing but the snapshot's memo.
    `shape` is `shape_of(req)` when the caller has it already."""
    whole = _assign(req, req.podsets, qs, snap, shape or shape_of(req))
    if isinstance(whole, Assignment) or not any(d.replicas > d_min for d, d_min in _mins(req)):
        return whole
    return _assign_partial(req, qs, snap, whole)


def _mins(req: GangRequest) -> list[tuple[PodSetDemand, int]]:
    mins = req.min_replicas
    return [(d, mins.get(d.podset, d.replicas)) for d in req.podsets]


def least_podsets(req: GangRequest) -> tuple[PodSetDemand, ...]:
    """The podsets at their minimum replicas (all of them without partial admission)."""
    if not req.min_replicas:
        return req.podsets
    return tuple(d._replace(replicas=m) for d, m in _mins(req))


def _scaled(req: GangRequest, count: int) -> tuple[PodSetDemand, ...]:
    """The podsets with the scalable ones at `count` replicas (capped at their own size)."""
    mins = req.min_replicas
    return tuple(
        d._replace(replicas=min(d.replicas, count)) if d.podset in mins else d for d in req.podsets
    )


def _assign_partial(
    req: GangRequest, qs: QueueState, snap: Snapshot, whole: Reasons
) -> Assignment | Reasons:
    lo = max(req.min_replicas.values())
    hi = max(d.replicas for d in req.podsets if d.podset in req.min_replicas) - 1
    best: Assignment | None = None
    while lo <= hi:
        mid = (lo + hi) // 2
        podsets = _scaled(req, mid)
        got = _assign(req, podsets, qs, snap, (podsets, *shape_of(req)[1:]))
        if isinstance(got, Assignment):
            best = got
            lo = mid + 1
        else:
            hi = mid - 1
    if best is None:
        return whole
    if req.elastic:
        pool = snap.inv.clusters[best.placement.cluster].pools.get(best.placement.flavor)
        note = admission_note(req, best.podsets, best.placement, pool)
        return replace(best, placement=replace(best.placement, note=note))
    asked = sum(d.replicas for d in req.podsets)
    took = sum(d.replicas for d in best.podsets)
    low = sum(d_min for _, d_min in _mins(req))
    why = whole[0].message if whole else "the whole gang does not fit"
    note = f"admitted {took} of {asked} pods (min {low}): {why}"
    return replace(best, placement=replace(best.placement, note=note))


def _assign(
    req: GangRequest,
    podsets: tuple[PodSetDemand, ...],
    qs: QueueState,
    snap: Snapshot,
    shape: Shape,
) -> Assignment | Reasons:
    gang = snap.gangs.get(podsets) or snap.gang(podsets)
    hit = snap.cap_fail.get(shape)
    if hit is None and snap.queue_fail:
        hit = snap.queue_fail.get((qs.name, shape))
    if hit is not None:
        return hit
    # a queue with a flavor order has candidates of its own
    key = (qs.name, shape) if qs.config.flavor_order else shape
    cands = snap.by_shape.get(key)
    if cands is None:
        cands = snap.by_shape[key] = snap.candidates(req, gang)
    book = snap.book
    claimed = snap.claimed
    clusters = snap.inv.clusters
    avoid = req.avoid_pools
    quota_memo: dict[str, QuotaMiss | None] = {}
    quota_fail: dict[ReasonCode, tuple[QuotaMiss, str]] = {}
    avoided: list[Pool] = []
    fallback: bool | None = None
    need_gpu = gang.total[0]
    has_gpu = bool(gang.gpu_sets)
    single = gang.single_gpu > 0
    if single:
        d0 = gang.demands[gang.gpu_sets[0]]
        need_cpu, need_mem = d0.cpu_milli, d0.memory
        hint_ok = not d0.extended  # fabric resources: `pack_single` checks them
    phys = False  # some pool failed on capacity (not only on quota or avoidance)
    hint: Node | None = None
    topo = applies(req, gang)
    topo_miss: list[Reason] = []
    held = snap.held
    for gi, group in enumerate(cands.live):
        if cands.ranks[gi] == 1:
            if fallback is None:
                fallback = allow_fallback(req, gang, cands)
            if not fallback:
                break
        n = len(group)
        start = 0
        dead = False
        while start < n:
            # (score, index, pool, the node a one-replica gang takes there if known)
            scored: list[tuple[tuple[int, int], int, Pool, Node | None]] = []
            k = 0  # len(scored)
            j = start
            while j < n and k < TIE_EVAL:
                pool = group[j]
                j += 1
                if has_gpu:
                    if pool.free_gpu < need_gpu or (
                        held
                        and pool.key in held
                        and _free_for(held[pool.key], pool, req) < need_gpu
                    ):
                        phys = True
                        if pool.free_gpu == 0:
                            dead = True
                        continue
                    if avoid and pool.key in avoid:
                        avoided.append(pool)
                        continue
                    if single:
                        # `estimate` inline: the fullest bucket that takes it; and the first
                        # node there with the cpu and memory, which is what `pack_single`
                        # returns (it looks at no emptier bucket: those hold no node).
                        buckets = pool.buckets
                        nb = len(buckets)
                        b = need_gpu
                        while b < nb and not buckets[b]:
                            b += 1
                        if b < nb:
                            est = (1, b - need_gpu)
                            hint = None
                            for hn in buckets[b].values():
                                if hint_ok and hn.free_cpu >= need_cpu and hn.free_mem >= need_mem:
                                    hint = hn
                                    break
                        else:
                            est = None
                    else:
                        est = estimate(pool, gang)
                    if est is None:
                        phys = True
                        continue
                else:
                    if pool.key in avoid:
                        avoided.append(pool)
                        continue
                    est = (0, pool.node_gpu)
                cls = pool.flavor_class
                if cls in quota_memo:
                    qr = quota_memo[cls]
                else:
                    need = gang.total
                    if snap.held_quota:
                        need = plus_held(snap.held_quota, qs.name, cls, req.job_id, need)
                    qr = quota_memo[cls] = book.check(qs, cls, need)
                    if qr is None and gang.ext_total:
                        qr = quota_memo[cls] = book.check_ext(qs, cls, gang.ext_total)
                    if qr is None and claimed is not None and snap.claims:
                        qr = quota_memo[cls] = claimed(req.job_id, qs, cls, gang.total)
                if qr is not None:
                    quota_fail.setdefault(qr.code, (qr, cls))
                    continue
                scored.append((est, k, pool, hint))
                k += 1
                if est[1] == 0 and est[0] <= 1:
                    break
            start = j
            if k > 1:
                scored.sort()  # by score; the index is unique, so pools are never compared
            if topo:
                if scored:  # pools that passed quota and avoidance: did a domain fit?
                    fit = _tightest(req, qs, snap, gang, scored, topo_miss)
                    if fit is not None:
                        if dead:
                            _prune(group)
                        return fit
                    phys = True
                scored = []
            for _, _, pool, hint in scored:
                if single:
                    node = hint if hint is not None else pack_single(pool, gang)
                    if node is not None:
                        if dead:
                            _prune(group)
                        return _single(req, qs, snap, gang, pool, node)
                else:
                    takes = pack(clusters[pool.cluster], pool, gang, req)
                    if takes is not None:
                        if dead:
                            _prune(group)
                        return _assignment(req, qs, snap, gang, pool, takes)
                phys = True
        if dead:
            _prune(group)
    reasons = explain(
        snap.inv,
        req,
        gang,
        cands,
        quota_fail,
        avoided,
        fallback,
        phys or not quota_fail,
        lambda pool: _fits_quota(req, gang, qs, snap, pool),
        topo_miss,
    )
    if quota_fail or avoided:
        snap.queue_fail[(qs.name, shape)] = reasons
    else:
        snap.cap_fail[shape] = reasons
    return reasons


def _free_for(held: Mapping[str, int], pool: Pool, req: GangRequest) -> int:
    """The pool's free GPUs less what it holds for other jobs waiting on its new nodes."""
    return pool.free_gpu - sum(g for job_id, g in held.items() if job_id != req.job_id)


def plus_held(
    held: Mapping[tuple[str, str], Mapping[str, Vec]], queue: str, cls: str, job_id: str, need: Vec
) -> Vec:
    """`need` plus the quota the queue's other gangs waiting on new nodes will charge."""
    jobs = held.get((queue, cls))
    if not jobs:
        return need
    g, c, m = need
    for other, (hg, hc, hm) in jobs.items():
        if other != job_id:
            g, c, m = g + hg, c + hc, m + hm
    return (g, c, m)


def _tightest(
    req: GangRequest,
    qs: QueueState,
    snap: Snapshot,
    gang: Gang,
    scored: list[tuple[tuple[int, int], int, Pool, Node | None]],
    misses: list[Reason],
) -> Assignment | None:
    """Of pools that cost the same, the one that keeps the gang in the tightest topology domain
    (then the better packing score); pools that declare no levels count as depth 0. Each pool's
    topology refusal is added to `misses`."""
    best: tuple[int, Pool, list[Take], str] | None = None
    clusters = snap.inv.clusters
    for _, _, pool, _ in scored:
        cluster = clusters[pool.cluster]
        got: Fit | Reason | None
        if pool.levels:
            got = place(cluster, pool, gang, req)
        else:
            takes = pack(cluster, pool, gang, req)
            got = None if takes is None else Fit(takes, 0, "")
        if isinstance(got, Reason):
            misses.append(got)
        elif got is not None and (best is None or got.depth > best[0]):
            best = (got.depth, pool, got.takes, got.note)
    if best is None:
        return None
    _, pool, takes, note = best
    return _assignment(req, qs, snap, gang, pool, takes, note)


def _prune(group: list[Pool]) -> None:
    """Empty pools stay empty while the snapshot lives: drop them from its candidate list."""
    group[:] = [p for p in group if p.free_gpu > 0]


def _fits_quota(req: GangRequest, gang: Gang, qs: QueueState, snap: Snapshot, pool: Pool) -> bool:
    if snap.book.check(qs, pool.flavor_class, gang.total) is not None:
        return False
    if gang.ext_total and snap.book.check_ext(qs, pool.flavor_class, gang.ext_total):
        return False
    cluster = snap.inv.clusters.get(pool.cluster)
    return cluster is not None and fits_now(cluster, pool, gang, req)


def _single(
    req: GangRequest, qs: QueueState, snap: Snapshot, gang: Gang, pool: Pool, node: Node
) -> Assignment:
    """`_assignment` of a one-replica gang on `node` (most gangs: built without the takes)."""
    d = gang.demands[gang.gpu_sets[0]]
    ckpt = req.checkpoint_interval_s
    # A placement is a value: gangs of one podset name, GPU count and checkpoint interval
    # (so one cost) placed on the same node in one cycle share one (fewer objects to build,
    # and for the cycle collector to walk).
    lone_key = (node, d.podset, d.gpu, ckpt)
    placement = snap.lone.get(lone_key)
    if placement is None:
        key = (pool, d.gpu, ckpt)
        cost = snap.costs.get(key)
        if cost is None:
            cost = snap.costs[key] = pool_cost(pool, req, d.gpu, 1, snap.rate_of, snap.risk_weight)
        placement = snap.lone[lone_key] = Placement(
            pool.cluster, pool.name, pool.flavor_class, ((d.podset, (node.name,)),), cost
        )
    total = gang.total  # one replica: the node's share is the whole gang
    return Assignment(req, qs, pool, placement, {node.name: total}, total, gang.demands)


def _assignment(
    req: GangRequest,
    qs: QueueState,
    snap: Snapshot,
    gang: Gang,
    pool: Pool,
    takes: list[Take],
    note: str = "",
) -> Assignment:
    assignment, per_node = assignment_of(takes, gang)
    gpu_nodes = [name for name, v in per_node.items() if v[0] > 0]
    cost = pool_cost(pool, req, gang.total[0], len(gpu_nodes), snap.rate_of, snap.risk_weight)
    risk = snap.inv.risk.get(pool.key) if len(gpu_nodes) > 1 else None
    if risk is not None and risk.burst() > 1.0:
        rate = gang_reclaim_rate(snap.rate_of(pool.key), zone_spread(pool, gpu_nodes), risk.burst())
        cost = gang_cost_per_hour(
            pool.price, gang.total[0], rate, req.checkpoint_interval_s, snap.risk_weight
        )
    placement = Placement(pool.cluster, pool.name, pool.flavor_class, assignment, cost, note)
    return Assignment(req, qs, pool, placement, per_node, gang.total, gang.demands)
