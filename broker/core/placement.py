"""Where a gang can go: candidate pools in preference order, and node-level bin packing.

Rules (Kueue's flavor assigner, Armada's gang scheduling, per node not per total):
- Every replica of every podset lands in ONE cluster; every GPU podset lands on ONE pool
  (cluster flavor: one capacity type, one GPU type).
- CPU-only podsets (gpu=0, e.g. a launcher) may use any schedulable node of that cluster: the
  chosen GPU pool's nodes first (locality), then the cluster's other pools with the fewest GPUs
  per node first (keep GPU nodes' CPU for GPU pods). They skip avoided pools, and spot pools
  when the job wants on-demand capacity. A gang with no GPU podset at all ignores `gpu_types`
  and is placed the same way, its `flavor` being the pool chosen for it (fewest GPUs per node
  first, so CPU pools before GPU pools).
- Capacity preference: `spot` and `on-demand` take only that capacity type. `any` takes both
  and lets cost decide, unless the job may not go to spot at its price (`spot_ok`: it writes no
  checkpoint): then on-demand first, and spot only when no on-demand pool could ever host it.
  A `spot-then-on-demand` job that writes no checkpoint (and is not `spot_ok`) loses its
  whole run at every reclaim, so spot is not cheap for it by its list price: it takes spot
  and on-demand at one rank, ordered by expected cost per unit of work with that loss priced
  in (risk.py: a reclaim costs the run so far, about 1 / rate hours, at most
  `NO_CHECKPOINT_LOSS_H`), and so goes to on-demand while the priced spot costs more. Every
  other `spot-then-on-demand` job takes spot; on-demand only when the job is `spot_exhausted` (the
  lifecycle machine's fallback after preemptions or waiting) or when no spot pool could host
  the gang even empty (no spot pool fits, ever). While spot is merely full the job waits for
  spot; the machine's `fallback_after_wait_s` bounds that wait. It stops waiting at once when
  an earlier job of equal or higher priority, no bigger and accepting every GPU type it does,
  already waits for spot too (`futile_spot_waits`): whatever spot frees up goes to that job
  first, so the wait would only delay the job and save nothing.
- A job that may run on on-demand (`any`, `spot-then-on-demand` still on spot) does not take
  a spot pool that an earlier (higher priority, or equal and submitted first) queued spot-only
  job waits for: one that asks for the pool's GPU type, does not avoid it, could fit it empty
  and last failed for capacity (`spot_kept_for`). The flexible job takes on-demand instead,
  or waits for it when on-demand is full now; it takes the spot only when no on-demand pool
  could host it (its own fallback rules). Spot-only jobs have nowhere else to go, so spot is
  theirs first (spot-return keeps the same order for running jobs, spotreturn.py).
- A `spot` (spot-only) gang that spans more than one node skips a pool whose expected cost per
  unit of work is over `WAIT_RATIO` times that of the cheapest pool that could host it empty,
  or where it expects over `WAIT_RECLAIMS` times the fewest reclaims per unit of work of such a
  pool (gang rate / speed), and waits: on a slow or reclaim-heavy pool the run is longer and
  every reclaim ends the whole gang's attempt. Jobs with an on-demand fallback keep their
  fallback rules; autoscaled pools keep the provisioning rules (provision.py).
- Order among feasible pools: capacity rank, then expected cost per unit of work: the
  expected cost per hour (risk.py) divided by the job's relative speed on the pool's GPU type
  (speed.py); costs within `COST_TIE` of each other count as equal, then the faster GPU type
  comes first (sooner finished), and then packing decides: fewer nodes, then fuller nodes
  (less GPU left over on the nodes used). Packing compares at most `TIE_EVAL`
  feasible pools of one cost tier and stops early at a perfect fit.
- Packing one podset of R replicas x g GPUs: the fullest node that takes all remaining replicas
  at once; when none does, the node taking the most replicas, then repeat. GPU podsets go
  biggest per-replica first. cpu and memory are checked per node; nothing is over-committed.
- Fabric resources a podset asks per replica (EFA, rdma/..., hugepages; `PodSetDemand.extended`)
  are checked per node the same way: a node without one, or with too little of it free, takes
  fewer replicas or none.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from broker.core.inventory import Cluster, Inventory, Node, Pool
from broker.core.risk import expected_cost_per_hour
from broker.core.types import GangRequest, PodSetDemand, PoolKey, Vec
from schemas.agent import FlavorInfo
from schemas.job import CapacityPreference

COST_TIE = 0.01  # relative
WAIT_RATIO = 1.5  # a multi-node spot-only gang waits rather than pay more per unit of work
WAIT_RECLAIMS = 2.0  # ... or than meet this many times more reclaims per unit of work
TIE_EVAL = 4

Take = tuple[Node, int, int]  # (node, podset index, replicas)


@dataclass(slots=True)
class Gang:
    """A request's podsets, precomputed once for the hot path."""

    demands: tuple[PodSetDemand, ...]
    gpu_sets: tuple[int, ...]  # indices of GPU podsets, biggest per-replica GPU first
    cpu_sets: tuple[int, ...]  # indices of CPU-only podsets
    total: Vec
    max_gpu: int
    single_gpu: int  # g when the gang is one replica of g GPUs and nothing else, else 0
    fabric: bool = False  # some podset asks for fabric resources (`PodSetDemand.extended`)
    ext_total: Mapping[str, int] | None = None  # the whole gang's, when `fabric`


def make_gang(podsets: tuple[PodSetDemand, ...]) -> Gang:
    gpu_sets = sorted(
        (i for i, p in enumerate(podsets) if p.gpu > 0 and p.replicas > 0),
        key=lambda i: (-podsets[i].gpu, -podsets[i].replicas, i),
    )
    cpu_sets = [i for i, p in enumerate(podsets) if p.gpu == 0 and p.replicas > 0]
    g = sum(p.replicas * p.gpu for p in podsets)
    c = sum(p.replicas * p.cpu_milli for p in podsets)
    m = sum(p.replicas * p.memory for p in podsets)
    ext: dict[str, int] = {}
    for p in podsets:
        for res, amount in p.extended:
            ext[res] = ext.get(res, 0) + p.replicas * amount
    single = 0
    if len(gpu_sets) == 1 and not cpu_sets and podsets[gpu_sets[0]].replicas == 1:
        single = podsets[gpu_sets[0]].gpu
    return Gang(
        demands=podsets,
        gpu_sets=tuple(gpu_sets),
        cpu_sets=tuple(cpu_sets),
        total=(g, c, m),
        max_gpu=max((p.gpu for p in podsets if p.replicas > 0), default=0),
        single_gpu=single,
        fabric=bool(ext),
        ext_total=ext or None,
    )


# -- candidate pools ------------------------------------------------------------------------


def capacity_rank(
    capacity: CapacityPreference, exhausted: bool, capacity_type: str, spot_ok: bool = True
) -> int:
    """0 = preferred, 1 = the fallback (on-demand of spot-then-on-demand, spot of an `any` job
    that may not go to spot at its price), -1 = not allowed. A spot-then-on-demand job that
    may not go to spot at its price has no fallback rank: expected cost decides."""
    spot = capacity_type == "spot"
    if capacity == "spot":
        return 0 if spot else -1
    if capacity == "on-demand":
        return -1 if spot else 0
    if capacity == "spot-then-on-demand":
        if exhausted:
            return -1 if spot else 0
        if not spot_ok:
            return 0
        return 0 if spot else 1
    return 1 if spot and not spot_ok else 0


def has_fallback_rank(req: GangRequest) -> bool:
    """Whether the job has a rank-1 capacity type that it takes only when no pool of its
    preferred one could ever host it (`capacity_rank`)."""
    if req.capacity == "any":
        return not req.spot_ok
    return req.capacity == "spot-then-on-demand" and not req.spot_exhausted and req.spot_ok


def wants_on_demand(req: GangRequest) -> bool:
    return req.capacity == "on-demand" or (
        req.capacity == "spot-then-on-demand" and req.spot_exhausted
    )


def futile_spot_waits(waiting: Sequence[GangRequest]) -> dict[str, str]:
    """Spot-then-on-demand jobs among `waiting` (requests a cycle could not place) that would
    wait for spot behind another: job id -> the earlier job (higher priority, or equal and
    submitted first) that also wants spot, needs no more GPUs and accepts every GPU type this
    one does. Spot that frees goes to that job first (queue order), so waiting is futile."""
    spot = sorted(
        (r for r in waiting if wants_spot(r)),
        key=lambda r: (-r.priority, r.order),
    )
    out: dict[str, str] = {}
    smallest: GangRequest | None = None  # the smallest earlier waiter of any GPU type
    typed: list[GangRequest] = []  # earlier waiters limited to some GPU types
    for r in spot:
        total = r.total_gpu
        if wants_spot_first(r):
            if smallest is not None and smallest.total_gpu <= total:
                out[r.job_id] = smallest.job_id
            elif r.gpu_types:
                ahead = next(
                    (a for a in typed if a.total_gpu <= total and r.gpu_types <= a.gpu_types),
                    None,
                )
                if ahead is not None:
                    out[r.job_id] = ahead.job_id
        if r.gpu_types:
            typed.append(r)
        elif smallest is None or total < smallest.total_gpu:
            smallest = r
    return out


OrderKey = tuple[int, int]  # queue order: (-priority, submission order)


class Waiter(NamedTuple):
    """A queued spot-only job that waits for spot capacity (spotwait.py)."""

    key: OrderKey
    request: GangRequest
    gang: Gang


def may_yield_spot(req: GangRequest, pool: Pool) -> bool:
    """Whether `req` is a job that leaves `pool` to a spot waiter: `pool` is spot and the job
    could run on on-demand (`any`, or `spot-then-on-demand` still on spot). Spot-only jobs,
    the waiters themselves among them, never yield."""
    return (
        pool.capacity_type == "spot"
        and req.capacity in ("any", "spot-then-on-demand")
        and not req.spot_exhausted
    )


def spot_kept_for(
    req: GangRequest,
    pool: Pool,
    heads: Iterable[Waiter],
    running: bool = False,
) -> GangRequest | None:
    """The queued spot-only job that `pool`'s spot is kept for against `req`, or None.

    `heads`: of the spot-only jobs that last failed for capacity, grouped by the pools they
    accept (same GPU types, avoided pools and gang), the earliest of each group (higher
    priority, then submitted first). Only a job that could run on on-demand yields (`any`,
    or `spot-then-on-demand` still on spot), only on a spot pool, and only to the earliest
    waiter before it that accepts the pool and could fit it empty: spot that frees there is
    what that job waits for, and it has no other capacity to go to. A `running` job (a
    replacement booked at a spot notice) had its turn: it yields to every waiter of equal or
    higher priority, as a running job moves off spot for one (spotyield.py). A group is
    judged by its head alone, so the question costs the number of groups, not of waiters."""
    if not may_yield_spot(req, pool):
        return None
    found: GangRequest | None = None
    before = (-req.priority, req.order if not running else float("inf"))
    for key, waiter, gang in heads:
        if (
            key < before
            and waiter.job_id != req.job_id
            and pool.key not in waiter.avoid_pools
            and gpu_type_ok(pool, waiter.gpu_types, gang.total[0])
            and empty_fit(pool, gang)
        ):
            found, before = waiter, key
    return found


def wants_spot_first(req: GangRequest) -> bool:
    return req.capacity == "spot-then-on-demand" and not req.spot_exhausted


def wants_spot(req: GangRequest) -> bool:
    """The job would wait for spot: spot-only, or spot-then-on-demand still on spot."""
    return req.capacity == "spot" or wants_spot_first(req)


@dataclass(slots=True)
class Candidates:
    """Matching pools of schedulable clusters in preference order, as cost tiers."""

    groups: list[list[Pool]]
    ranks: list[int]
    live: list[list[Pool]]  # copies of `groups` that a cycle prunes of pools with no free GPU
    matching: int  # pools passing the type filters, in any cluster
    unhealthy: int  # of those, pools in clusters that take no placements
    blocked: list[Pool]  # of those, pools whose dispatch breaker is open (health.py)
    # The rank-0 pools of a job with a fallback rank: the fallback is allowed when none of them
    # could ever host the gang (spot pools of spot-then-on-demand, on-demand ones of `any`).
    spot_pools: list[Pool]


def gpu_type_ok(pool: Pool, gpu_types: frozenset[str], gpus: int) -> bool:
    return gpus == 0 or not gpu_types or pool.gpu_type in gpu_types


def build_candidates(
    inv: Inventory,
    req: GangRequest,
    gpus: int,
    rate_of: Callable[[PoolKey], float],
    risk_weight: float,
    flavor_order: Sequence[str] = (),
    speed: Callable[[str], float] | None = None,
) -> Candidates:
    """`flavor_order`: the queue's preferred flavor classes, first to last (a Kueue
    ClusterQueue's flavor list); within a capacity rank it comes before cost. `speed`: the
    job's relative speed on a GPU type (speed.py); cost is then per unit of work, and among
    pools of one cost tier the faster GPU type comes first (it finishes sooner)."""
    prefer = {cls: i for i, cls in enumerate(flavor_order)}
    scored: list[tuple[int, float, str, str, Pool]] = []
    speeds: dict[str, float] = {}
    reclaims: dict[PoolKey, float] = {}  # the gang's expected reclaims per unit of work
    matching = unhealthy = 0
    spot_pools: list[Pool] = []
    blocked: list[Pool] = []
    blocked_keys = inv.blocked
    fallback = has_fallback_rank(req)
    for c in inv.clusters.values():
        for p in c.pools.values():
            if not gpu_type_ok(p, req.gpu_types, gpus):
                continue
            rank = capacity_rank(req.capacity, req.spot_exhausted, p.capacity_type, req.spot_ok)
            if rank < 0:
                continue
            matching += 1
            if not c.schedulable:
                unhealthy += 1
                continue
            if p.key in blocked_keys:
                blocked.append(p)
                continue
            if rank == 0 and fallback:
                spot_pools.append(p)
            node_gpu = p.node_gpu or 1
            nodes = max(1, -(-gpus // node_gpu))
            rate = rate_of(p.key)
            cost = expected_cost_per_hour(
                p.price, gpus, rate, nodes, req.checkpoint_interval_s, risk_weight
            )
            s = 1.0
            if speed is not None and gpus:
                known = speeds.get(p.gpu_type)
                if known is None:
                    known = speeds[p.gpu_type] = speed(p.gpu_type)
                s = known
                cost /= s
            if req.capacity == "spot":
                reclaims[p.key] = rate * nodes / s
            scored.append((rank, cost, p.cluster, p.name, p))
    if req.capacity == "spot" and len(scored) > 1:
        scored = _wait_for_cheaper_work(scored, req, gpus, reclaims)
    last = len(prefer)
    scored.sort(key=lambda t: (t[0], prefer.get(t[4].flavor_class, last), t[1], t[2], t[3]))
    groups: list[list[Pool]] = []
    ranks: list[int] = []
    base = 0.0
    tier = -1
    for rank, cost, _, _, p in scored:
        here = prefer.get(p.flavor_class, last)
        if (
            groups
            and ranks[-1] == rank
            and here == tier
            and cost <= base * (1.0 + COST_TIE) + 1e-12
        ):
            groups[-1].append(p)
        else:
            groups.append([p])
            ranks.append(rank)
            base = cost
            tier = here
    if len(speeds) > 1:
        groups, ranks = _faster_first(groups, ranks, speeds)
    return Candidates(
        groups, ranks, [list(g) for g in groups], matching, unhealthy, blocked, spot_pools
    )


def _wait_for_cheaper_work(
    scored: list[tuple[int, float, str, str, Pool]],
    req: GangRequest,
    gpus: int,
    reclaims: Mapping[PoolKey, float],
) -> list[tuple[int, float, str, str, Pool]]:
    """A spot-only gang that spans nodes skips pools whose expected cost per unit of work is
    over `WAIT_RATIO` times that of the cheapest pool that could host it empty, and pools
    where it expects over `WAIT_RECLAIMS` times the fewest reclaims per unit of work
    (`reclaims`: gang rate / speed) of such a pool: it waits for those. A slow or
    reclaim-heavy pool multiplies the run's length and so its reclaims, each of which ends
    the whole gang's attempt (a start-up, a restore and the work since the last checkpoint,
    and one more attempt), even where its price per unit of work is close. Only gangs with
    no on-demand fallback wait this way; the others keep their fallback rules. Autoscaled
    pools neither set the bars nor are skipped: whether they can grow is the provisioning
    rules' to judge (a pool that stocked out is avoided for a while, and waiting for it would
    wait on nothing)."""
    gang = make_gang(req.podsets)
    hosts = [t for t in scored if t[4].info.provision is None and empty_fit(t[4], gang)]
    if not hosts:
        return scored
    bar = WAIT_RATIO * min(t[1] for t in hosts)
    least = WAIT_RECLAIMS * min(reclaims[t[4].key] for t in hosts)
    return [
        t
        for t in scored
        if (t[1] <= bar and reclaims[t[4].key] <= least + 1e-12)
        or gpus <= (t[4].node_gpu or 1)
        or t[4].info.provision is not None
    ]


def _faster_first(
    groups: list[list[Pool]], ranks: list[int], speeds: dict[str, float]
) -> tuple[list[list[Pool]], list[int]]:
    """Split each cost tier by GPU speed, fastest first: at equal cost per unit of work the
    job finishes sooner there."""
    out: list[list[Pool]] = []
    out_ranks: list[int] = []
    for group, rank in zip(groups, ranks, strict=True):
        by_speed: dict[float, list[Pool]] = {}
        for p in group:
            by_speed.setdefault(speeds.get(p.gpu_type, 1.0), []).append(p)
        for s in sorted(by_speed, reverse=True):
            out.append(by_speed[s])
            out_ranks.append(rank)
    return out, out_ranks


def pool_cost(
    pool: Pool,
    req: GangRequest,
    gpus: int,
    nodes: int,
    rate_of: Callable[[PoolKey], float],
    risk_weight: float,
) -> float:
    rate = rate_of(pool.key)
    return expected_cost_per_hour(
        pool.price, gpus, rate, nodes, req.checkpoint_interval_s, risk_weight
    )


# -- packing estimates over bucket counts -------------------------------------------------


def estimate_counts(counts: list[int], gang: Gang) -> tuple[int, int] | None:
    """Greedy packing over a histogram of nodes by free GPUs (mutates `counts`).

    Returns (nodes used, GPUs left over on them) or None when the GPU podsets do not fit.
    cpu and memory are not looked at: this is the fast filter and the tie-break score.
    """
    nodes = left = 0
    top = len(counts) - 1
    demands = gang.demands
    for i in gang.gpu_sets:
        g = demands[i].gpu
        rem = demands[i].replicas
        while rem:
            while top > 0 and not counts[top]:
                top -= 1
            want = rem * g
            b = want
            while b <= top and not counts[b]:
                b += 1
            if b <= top:
                counts[b] -= 1
                counts[b - want] += 1
                nodes += 1
                left += b - want
                break
            if top < g:
                return None
            k = top // g  # < rem, else the loop above had found it
            counts[top] -= 1
            counts[top - k * g] += 1
            nodes += 1
            left += top - k * g
            rem -= k
    return nodes, left


def estimate(pool: Pool, gang: Gang) -> tuple[int, int] | None:
    """Packing score of the gang's GPU podsets on the pool as it is now."""
    if gang.total[0] > pool.free_gpu:
        return None
    top = pool.top_bucket()
    if gang.max_gpu > top:
        return None
    buckets = pool.buckets
    g = gang.single_gpu
    if g:
        for b in range(g, top + 1):
            if buckets[b]:
                return 1, b - g
        return None
    if not gang.gpu_sets:
        return 0, 0
    return estimate_counts([len(buckets[b]) for b in range(top + 1)], gang)


def empty_fit(pool: Pool, gang: Gang) -> bool:
    """Could the pool host the gang's GPU podsets when it is empty and holds as many nodes
    as it ever has? (Judged by high-water marks: a spot pool at zero nodes comes back.)"""
    ceiling = pool.ceiling
    if not any(ceiling.counts):
        return declared_fit(pool.info, gang)
    if pool.info.provision is not None and declared_fit(pool.info, gang):
        return True  # an autoscaled pool reaches its declared limit, whatever it held so far
    if not gang.gpu_sets:
        return True
    if estimate_counts(list(ceiling.counts), gang) is None:
        return False
    cpu, mem = ceiling.node_cpu, ceiling.node_mem
    return all(
        gang.demands[i].cpu_milli <= cpu and gang.demands[i].memory <= mem for i in gang.gpu_sets
    )


def declared_fit(info: FlavorInfo, gang: Gang) -> bool:
    """For a pool that has never held a node (a spot zone that starts empty, a node pool at
    zero): could it host the gang at the size its agent declares? A pool that declares no
    size is not judged: it may come up at any size, so a job is never refused for it. An
    autoscaled pool (`info.provision`) declares its limit and node template there."""
    grow = info.provision
    if grow is not None:
        size, node_gpu = grow.limit, grow.node_gpu
        cpu, mem = grow.node_cpu_milli, grow.node_memory
    else:
        size, node_gpu = info.max_nodes, info.node_gpu
        cpu, mem = info.node_cpu_milli, info.node_memory
    if not size or not node_gpu:
        return True
    counts = [0] * (node_gpu + 1)
    counts[node_gpu] = size
    if gang.gpu_sets and estimate_counts(counts, gang) is None:
        return False
    return all(
        (not cpu or gang.demands[i].cpu_milli <= cpu) and (not mem or gang.demands[i].memory <= mem)
        for i in gang.gpu_sets
    )


def cluster_empty_fit_cpu(cluster: Cluster, gang: Gang) -> bool:
    """Could some node of the cluster host each CPU-only replica if it were empty? Judged by
    the pools' ceilings (high-water marks), like `empty_fit`."""
    if not gang.cpu_sets:
        return True
    cpu = mem = total_cpu = total_mem = 0
    for p in cluster.pools.values():
        ceiling = p.ceiling
        cpu = max(cpu, ceiling.node_cpu)
        mem = max(mem, ceiling.node_mem)
        total_cpu += ceiling.total_cpu
        total_mem += ceiling.total_mem
    # The whole gang in one cluster: all of it must fit the cluster's CPU and memory at once.
    _, need_cpu, need_mem = gang.total
    if need_cpu > total_cpu or need_mem > total_mem:
        return False
    return all(
        gang.demands[i].cpu_milli <= cpu and gang.demands[i].memory <= mem for i in gang.cpu_sets
    )


# -- packing on live nodes ------------------------------------------------------------------
#
# Packing never changes a node: what the gang has taken so far is an overlay (`Tentative`,
# node -> (gpu, cpu, memory) taken), so the search is a pure function of the inventory and a
# commit applies its result (`Inventory.add_usage`). Nodes in the overlay are few (at most the
# gang's replicas); they are skipped in the free-GPU index and looked at by their free
# capacity net of the overlay instead, after the untouched nodes of the same bucket (the order
# a node taken for real would have been re-filed in).

Tentative = dict[Node, Vec]
ExtTentative = dict[Node, dict[str, int]]  # fabric resources taken so far, same overlay
NO_LIMIT = 1 << 30
_NO_EXT: ExtTentative = {}  # the overlay of a gang that asks none: never written


def ext_room(node: Node, ext: tuple[tuple[str, int], ...], taken: ExtTentative) -> int:
    """How many replicas asking `ext` each the node's free fabric resources still take."""
    room = NO_LIMIT
    t = taken.get(node)
    for res, amount in ext:
        if amount <= 0:
            continue
        free = node.ext_free(res) - (t.get(res, 0) if t is not None else 0)
        k = free // amount if free > 0 else 0
        if k < room:
            room = k
    return room


def _ext_take(taken: ExtTentative, node: Node, ext: tuple[tuple[str, int], ...], k: int) -> None:
    mine = taken.setdefault(node, {})
    for res, amount in ext:
        mine[res] = mine.get(res, 0) + k * amount


class NodeIndex(Protocol):
    """Nodes by free GPUs, as packing reads them: a pool, or one topology domain of it."""

    buckets: list[dict[str, Node]]

    def top_bucket(self) -> int: ...

    def owns(self, node: Node) -> bool: ...


def _touched_at(touched: Tentative, pool: NodeIndex, b: int) -> list[tuple[Node, int, int]]:
    """Nodes of `pool` in the overlay with exactly `b` free GPUs net of it: (node, cpu, mem)."""
    out: list[tuple[Node, int, int]] = []
    for n, (tg, tc, tm) in touched.items():
        if n.schedulable and n.free_gpu - tg == b and pool.owns(n):
            out.append((n, n.free_cpu - tc, n.free_mem - tm))
    return out


def _tentative_take(touched: Tentative, node: Node, g: int, c: int, m: int) -> None:
    prev = touched.get(node)
    touched[node] = (g, c, m) if prev is None else (prev[0] + g, prev[1] + c, prev[2] + m)


def _pack_gpu(
    pool: NodeIndex,
    i: int,
    d: PodSetDemand,
    takes: list[Take],
    touched: Tentative,
    ext_taken: ExtTentative,
) -> bool:
    g, c, m = d.gpu, d.cpu_milli, d.memory
    x = d.extended
    rem = d.replicas
    buckets = pool.buckets
    top = pool.top_bucket()
    while rem:
        want = rem * g
        found: Node | None = None
        b = want
        while b <= top and found is None:
            for n in buckets[b].values():
                if n.free_cpu >= rem * c and n.free_mem >= rem * m and n not in touched:
                    if x and ext_room(n, x, ext_taken) < rem:
                        continue
                    found = n
                    break
            if found is None and touched:
                for n, fc, fm in _touched_at(touched, pool, b):
                    if fc >= rem * c and fm >= rem * m:
                        if x and ext_room(n, x, ext_taken) < rem:
                            continue
                        found = n
                        break
            b += 1
        if found is not None:
            _tentative_take(touched, found, want, rem * c, rem * m)
            if x:
                _ext_take(ext_taken, found, x, rem)
            takes.append((found, i, rem))
            return True
        best: Node | None = None
        best_k = 0
        b = top
        while b >= g:
            cap = min(rem, b // g)
            if cap <= best_k:
                break
            row = [(n, n.free_cpu, n.free_mem) for n in buckets[b].values() if n not in touched]
            if touched:
                row.extend(_touched_at(touched, pool, b))
            for n, fc, fm in row:
                k = cap
                if c and fc < k * c:
                    k = min(k, fc // c)
                if m and fm < k * m:
                    k = min(k, fm // m)
                if x:
                    k = min(k, ext_room(n, x, ext_taken))
                if k > best_k:
                    best, best_k = n, k
                    if k == cap:
                        break
            b -= 1
        if best is None:
            return False
        _tentative_take(touched, best, best_k * g, best_k * c, best_k * m)
        if x:
            _ext_take(ext_taken, best, x, best_k)
        takes.append((best, i, best_k))
        rem -= best_k
    return True


def pack_single(pool: Pool, gang: Gang) -> Node | None:
    """`pack` for a gang of one replica of `gang.single_gpu` GPUs: the fullest node that takes
    it (cpu and memory included), found straight from the free-GPU index."""
    d = gang.demands[gang.gpu_sets[0]]
    c, m, x = d.cpu_milli, d.memory, d.extended
    buckets = pool.buckets
    for b in range(gang.single_gpu, pool.top_bucket() + 1):
        for n in buckets[b].values():
            if n.free_cpu >= c and n.free_mem >= m and (not x or ext_room(n, x, {}) >= 1):
                return n
    return None


def cpu_pools(cluster: Cluster, primary: Pool, req: GangRequest) -> list[Pool]:
    """Pools of the cluster that may host the gang's CPU-only podsets, best first."""
    od_only = wants_on_demand(req)
    others = [
        p
        for p in cluster.pools.values()
        if p is not primary
        and p.key not in req.avoid_pools
        and not (od_only and p.capacity_type == "spot")
    ]
    others.sort(key=lambda p: (p.node_gpu, p.name))
    return [primary, *others]


def _pack_cpu(
    pools: Sequence[Pool],
    i: int,
    d: PodSetDemand,
    takes: list[Take],
    touched: Tentative,
    ext_taken: ExtTentative,
) -> bool:
    c, m, x = d.cpu_milli, d.memory, d.extended
    rem = d.replicas
    for pool in pools:
        for bucket in pool.buckets:
            for n in bucket.values():
                fc, fm = n.free_cpu, n.free_mem
                t = touched.get(n)
                if t is not None:
                    fc -= t[1]
                    fm -= t[2]
                k = rem
                if c:
                    k = min(k, fc // c)
                if m:
                    k = min(k, fm // m)
                if x:
                    k = min(k, ext_room(n, x, ext_taken))
                if k <= 0:
                    continue
                _tentative_take(touched, n, 0, k * c, k * m)
                if x:
                    _ext_take(ext_taken, n, x, k)
                takes.append((n, i, k))
                rem -= k
                if not rem:
                    return True
    return False


def pack(
    cluster: Cluster, pool: Pool, gang: Gang, req: GangRequest, within: NodeIndex | None = None
) -> list[Take] | None:
    """Place the whole gang with `pool` as its GPU pool without changing any node; its GPU
    podsets only on the nodes of `within` (a topology domain of the pool) when given.

    Returns the takes (node, podset index, replicas), or None when the gang does not fit.
    """
    takes: list[Take] = []
    touched: Tentative = {}
    ext_taken: ExtTentative = {} if gang.fabric else _NO_EXT
    demands = gang.demands
    index: NodeIndex = pool if within is None else within
    for i in gang.gpu_sets:
        if not _pack_gpu(index, i, demands[i], takes, touched, ext_taken):
            return None
    if gang.cpu_sets:
        pools = cpu_pools(cluster, pool, req)
        for i in gang.cpu_sets:
            if not _pack_cpu(pools, i, demands[i], takes, touched, ext_taken):
                return None
    return takes


def ext_per_node(
    podsets: Sequence[PodSetDemand], assignment: Sequence[tuple[str, Sequence[str]]]
) -> dict[str, dict[str, int]]:
    """The fabric resources a placement takes per node (empty when no podset asks any)."""
    out: dict[str, dict[str, int]] = {}
    for d in podsets:  # a loop, not any(): this runs once per admission
        if d.extended:
            break
    else:
        return out
    asks = {d.podset: d.extended for d in podsets if d.extended}
    for podset, nodes in assignment:
        x = asks.get(podset)
        if x is None:
            continue
        for name in nodes:
            mine = out.setdefault(name, {})
            for res, amount in x:
                mine[res] = mine.get(res, 0) + amount
    return out


def fits_now(cluster: Cluster, pool: Pool, gang: Gang, req: GangRequest) -> bool:
    """Does the whole gang fit right now?"""
    if gang.gpu_sets and estimate(pool, gang) is None:
        return False
    return pack(cluster, pool, gang, req) is not None


def assignment_of(
    takes: Sequence[Take], gang: Gang
) -> tuple[tuple[tuple[str, tuple[str, ...]], ...], dict[str, Vec]]:
    """Node per replica for each podset (in podset order) and the usage per node."""
    per_set: list[list[str]] = [[] for _ in gang.demands]
    per_node: dict[str, Vec] = {}
    demands = gang.demands
    for node, i, k in takes:
        per_set[i].extend([node.name] * k)
        d = demands[i]
        prev = per_node.get(node.name)
        add = (k * d.gpu, k * d.cpu_milli, k * d.memory)
        per_node[node.name] = (
            add if prev is None else (prev[0] + add[0], prev[1] + add[1], prev[2] + add[2])
        )
    assignment = tuple(
        (d.podset, tuple(per_set[i])) for i, d in enumerate(demands) if d.replicas > 0
    )
    return assignment, per_node


def summed(per_node: Mapping[str, Mapping[str, int]]) -> dict[str, int]:
    """`ext_per_node` over all its nodes."""
    out: dict[str, int] = {}
    for amounts in per_node.values():
        for res, amount in amounts.items():
            out[res] = out.get(res, 0) + amount
    return out
