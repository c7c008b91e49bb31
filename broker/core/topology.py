"""Topology-aware placement inside one pool: nodes grouped into domains, and the packing rule.

A pool declares its levels once, coarsest first (`FlavorInfo.topology_levels`: the zone, then
e.g. block, sub-block or rack, NVLink domain, host), and each node its value per level
(`NodeInfo.topology`). A domain of depth d is the set of the pool's nodes that share their
first d values; depth 0 is the whole pool.

Rules (Kueue's Topology Aware Scheduling, kubernetes-sigs/kueue KEP-2724 "Computing the
assignment" and pkg/cache/tas_flavor_snapshot.go, Apache-2.0; the rule is ported, not the code):
- A gang whose GPU replicas may span nodes stays within ONE zone unless it says `spread`;
  a required level narrows that to one domain of that level (the finest one named wins). A
  `spread` gang may cross zones, but goes through the same search: one that fits a zone (or a
  finer domain) is kept there, so at equal price the tighter cluster wins for it too.
- The search starts at the finest level and goes up to the required one: the first level
  where one domain takes the whole gang is used, and of its domains the one with the least
  free GPUs that still fits (BestFit), so large domains stay free for large gangs.
- A preferred level is a wish: when no domain of it fits, the gang goes to the next level up
  that fits (up to the required one, or the whole pool), and the placement says so.
- A level is named by its node label or by its short name (`short_name`): `zone`, `block`,
  `subblock`, `host`, or the label's last path segment (`example.com/rack` is `rack`). Or by a
  tier counted from below, as Volcano's `networkTopology.highestTierAllowed` counts HyperNode
  tiers: `tier-1` is the pool's finest level above the host, `tier-2` the one above it, and a
  tier above the zone is the zone (volcano-sh/apis pkg/apis/batch/v1alpha1/job.go, Apache-2.0).
- Pools that declare no levels have no topology: the whole pool is one domain. Only GPU
  podsets are constrained; CPU-only podsets (a launcher) go anywhere in the cluster.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from broker.core.inventory import ZONE, Cluster, Node, Pool
from broker.core.placement import Gang, Take, estimate_counts, pack
from broker.core.placement import fits_now as plain_fits_now
from broker.core.types import GangRequest, Reason, TopologyNeed
from schemas.job import GangTopology, JobSpec, PodSet

SHORT_NAMES = {
    ZONE: "zone",
    "topology.kubernetes.io/region": "region",
    "kubernetes.io/hostname": "host",
    "cloud.google.com/gce-topology-block": "block",
    "cloud.google.com/gce-topology-subblock": "subblock",
    "cloud.google.com/gce-topology-host": "host",
}
HOST_LEVELS = frozenset({"kubernetes.io/hostname", "cloud.google.com/gce-topology-host"})
TIER_PREFIX = "tier-"  # a level counted from below (Volcano HyperNode tiers)
MAX_TRIES = 16  # domains packed per level before the search moves up (fitting ones come first)


def short_name(level: str) -> str:
    known = SHORT_NAMES.get(level)
    return known if known is not None else level.rsplit("/", 1)[-1]


def depth_of(levels: tuple[str, ...], name: str) -> int:
    """Depth of the level called `name` (its label, short name or `tier-N`) in `levels`;
    0 = none."""
    for i, level in enumerate(levels):
        if name == level or name == short_name(level):
            return i + 1
    tier = name.removeprefix(TIER_PREFIX)
    if tier != name and tier.isdigit() and int(tier) >= 1:
        above_host = sum(1 for level in levels if level not in HOST_LEVELS)
        return max(above_host - int(tier) + 1, 1) if above_host else 0
    return 0


def path_at(node: Node, depth: int) -> tuple[str, ...]:
    """The node's first `depth` topology values ("" for a missing one)."""
    t = node.topology
    if len(t) >= depth:
        return t[:depth]
    return t + ("",) * (depth - len(t))


def applies(req: GangRequest, gang: Gang) -> bool:
    """Whether topology can change where the gang goes: more than one GPU replica, or replicas
    that must join a running gang's domain. A gang told to spread may cross zones, but one
    that fits a domain is still kept in the tightest."""
    if req.topology is not None and req.topology.within:
        return bool(gang.gpu_sets)
    return not gang.single_gpu and bool(gang.gpu_sets)


@dataclass(slots=True, eq=False)
class Domain:
    """One domain's schedulable nodes by free GPUs: what `placement.pack` reads (NodeIndex)."""

    pool: Pool
    path: tuple[str, ...]
    buckets: list[dict[str, Node]]

    def top_bucket(self) -> int:
        return len(self.buckets) - 1

    def owns(self, node: Node) -> bool:
        return node.pool is self.pool and path_at(node, len(self.path)) == self.path


def _domain(pool: Pool, path: tuple[str, ...], members: list[Node]) -> Domain:
    buckets: list[dict[str, Node]] = [{}]
    for n in members:
        b = n.free_gpu
        while len(buckets) <= b:
            buckets.append({})
        buckets[b][n.name] = n
    return Domain(pool, path, buckets)


@dataclass(slots=True)
class Fit:
    takes: list[Take]
    depth: int  # the level the gang stays within (0 = only the pool)
    note: str  # set when a preferred level could not be kept


def _required(pool: Pool, need: TopologyNeed | None) -> int | Reason:
    levels = pool.levels
    if need is None or not need.required:
        depth = 0 if need is not None and need.spread else depth_of(levels, "zone")
        return max(depth, len(need.within)) if need is not None else depth
    depth = 0
    for name in need.required:
        d = depth_of(levels, name)
        if d == 0:
            names = ", ".join(short_name(lv) for lv in levels)
            return Reason(
                "topology-unfit",
                f"needs one {name}, but the pool declares no such topology level "
                f"(its levels: {names}); require one of those or use another pool",
                cluster=pool.cluster,
                flavor=pool.name,
            )
        depth = max(depth, d)
    return max(depth, len(need.within))


def place(cluster: Cluster, pool: Pool, gang: Gang, req: GangRequest) -> Fit | Reason | None:
    """The gang on one domain of `pool` (see the module docstring): a fit, a reason with the
    numbers when the required level has no domain that fits, or None when the gang does not
    fit even ignoring topology (plain capacity: the caller explains that)."""
    levels = pool.levels
    need = req.topology
    required = _required(pool, need)
    if isinstance(required, Reason):
        return required
    preferred = max((depth_of(levels, p) for p in need.preferred), default=0) if need else 0
    want = gang.total[0]
    finest = len(levels)
    top = pool.top_bucket()
    if finest > max(required, 1) and levels[-1] in HOST_LEVELS and want > top:
        finest -= 1  # one host is one node, and no node has that much free
    # One pass over the nodes with free GPUs: members and free GPUs of every domain per depth.
    depths = range(max(required, 1), finest + 1)
    members: dict[int, dict[tuple[str, ...], list[Node]]] = {d: {} for d in depths}
    free: dict[int, dict[tuple[str, ...], int]] = {d: {} for d in depths}
    within = need.within if need is not None else ()
    for b in range(1, top + 1):
        for n in pool.buckets[b].values():
            if within and path_at(n, len(within)) != within:
                continue  # outside the running gang's domain
            for d in depths:
                key = path_at(n, d)
                got = members[d].get(key)
                if got is None:
                    members[d][key] = [n]
                    free[d][key] = b
                else:
                    got.append(n)
                    free[d][key] += b
    for d in reversed(depths):
        fitting = sorted((f, k) for k, f in free[d].items() if f >= want)
        for _, key in fitting[:MAX_TRIES]:
            dom = _domain(pool, key, members[d][key])
            if estimate_counts([len(x) for x in dom.buckets], gang) is None:
                continue
            takes = pack(cluster, pool, gang, req, dom)
            if takes is not None:
                return Fit(takes, d, _degraded(levels, preferred, d, free))
    if required == 0:
        takes = pack(cluster, pool, gang, req)
        return None if takes is None else Fit(takes, 0, _degraded(levels, preferred, 0, free))
    level = short_name(levels[required - 1])
    largest = max(free[required].values(), default=0)
    return Reason(
        "topology-unfit",
        f"needs {want} GPUs in one {level}; largest free {level} of {pool.cluster}/{pool.name} "
        f"has {largest}",
        cluster=pool.cluster,
        flavor=pool.name,
    )


def _degraded(
    levels: tuple[str, ...], preferred: int, depth: int, free: dict[int, dict[tuple[str, ...], int]]
) -> str:
    """Why a preferred level was not kept (empty when it was, or none was preferred)."""
    if not preferred or depth >= preferred:
        return ""
    wanted = short_name(levels[preferred - 1])
    where = f"one {short_name(levels[depth - 1])}" if depth else "the pool (across zones)"
    sizes = free.get(preferred)
    largest = f" (largest free {wanted} has {max(sizes.values(), default=0)} GPUs)" if sizes else ""
    return f"preferred one {wanted}{largest}; placed within {where}"


def need_of(spec: JobSpec) -> TopologyNeed | None:
    """The gang's topology need from its spec (None: the default, one zone)."""
    return need_of_parts(spec.topology, spec.gang)


def need_of_parts(whole: GangTopology | None, gang: Sequence[PodSet]) -> TopologyNeed | None:
    """`need_of` from the spec's own topology and its gang (what it is read from)."""
    parts = [t for t in (whole, *(p.topology for p in gang)) if t is not None]
    if not parts:
        return None
    return TopologyNeed(
        required=tuple(sorted({t.required for t in parts if t.required})),
        preferred=tuple(sorted({t.preferred for t in parts if t.preferred})),
        spread=whole is not None and whole.spread,
    )


def fits_now(cluster: Cluster, pool: Pool, gang: Gang, req: GangRequest) -> bool:
    """`placement.fits_now` with the gang's topology: whether `assign` could place it on `pool`
    right now (what a preemption plan asks after each victim it takes)."""
    if pool.levels and applies(req, gang):
        return isinstance(place(cluster, pool, gang, req), Fit)
    return plain_fits_now(cluster, pool, gang, req)


def largest_domain(pool: Pool, gang: Gang, req: GangRequest) -> tuple[str, int] | None:
    """For a gang that could never fit one domain of its required level on `pool` even with
    every node empty: (the level's short name, the most GPUs one such domain holds). None when
    it could fit, when topology does not bind it here, or when the pool holds no nodes now
    (a pool at zero nodes may come back in any shape)."""
    if not pool.levels or not pool.nodes or not applies(req, gang):
        return None
    required = _required(pool, req.topology)
    if isinstance(required, Reason):
        return short_name(req.topology.required[0]) if req.topology else "", 0
    if required == 0:
        return None
    counts: dict[tuple[str, ...], list[int]] = {}
    for n in pool.nodes.values():
        row = counts.setdefault(path_at(n, required), [0] * (n.gpu + 1))
        if len(row) <= n.gpu:
            row.extend([0] * (n.gpu + 1 - len(row)))
        row[n.gpu] += 1
    if any(estimate_counts(list(row), gang) is not None for row in counts.values()):
        return None
    most = max(sum(g * k for g, k in enumerate(row)) for row in counts.values())
    return short_name(pool.levels[required - 1]), most


def zone_spread(pool: Pool, names: list[str]) -> list[tuple[int, int]]:
    """Per zone the gang's named nodes reach: (its nodes there, the pool's nodes there), what
    `risk.gang_reclaim_rate` prices correlated reclaims by."""
    mine: dict[str, int] = {}
    for name in names:
        zone = pool.zone_of(pool.nodes[name])
        mine[zone] = mine.get(zone, 0) + 1
    everyone: dict[str, int] = dict.fromkeys(mine, 0)
    for node in pool.nodes.values():
        zone = pool.zone_of(node)
        if zone in everyone:
            everyone[zone] += 1
    return [(k, everyone[zone]) for zone, k in mine.items()]


def growth_domains(
    pool: Pool, nodes: list[Node], need: TopologyNeed | None
) -> list[tuple[str, ...]]:
    """Where a running gang on `nodes` grows back (a lost node replaced, capacity returned),
    first to last: the finest domain all its nodes share (a host level aside), then each
    coarser one down to the level the gang must stay within (one zone by default, the
    required level, the pool for `spread`). A `()`: anywhere in the pool, which is all there
    is when the pool declares no levels. Empty when the gang has no GPU node left there."""
    levels = pool.levels
    if not levels or not nodes:
        return [()] if not levels else []
    finest = len(levels) - (1 if levels[-1] in HOST_LEVELS else 0)
    shared = 0
    first = path_at(nodes[0], finest)
    while shared < finest and all(path_at(n, shared + 1) == first[: shared + 1] for n in nodes):
        shared += 1
    floor = _required(pool, need)
    floor = 0 if isinstance(floor, Reason) else min(floor, shared)
    return [first[:d] for d in range(shared, floor - 1, -1)]
