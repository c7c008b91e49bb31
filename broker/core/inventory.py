"""What the agents report (clusters, pools, nodes) plus what Muster placed on every node.

A pool is one (cluster, flavor). It indexes its schedulable nodes by free GPUs (`buckets[b]`
holds the nodes with exactly b free GPUs), so "can any node take 8 GPUs?" and "which is the
fullest node that still fits?" cost O(GPUs per node), not O(nodes).

Node rules:
- free = allocatable - other_* (pods Muster did not place) - Muster allocations, never < 0.
- A node takes nothing new while it has a spot notice, is not ready, has failed GPUs
  (gpu_healthy < gpu) or says it takes no new pods (a cordon, an untolerated taint, a short
  NotReady: `NodeInfo.no_new_pods`): such nodes leave the index but keep their allocations.
- A cluster whose agent reports stale watches (`Heartbeat.stale_s`) takes no placements.
- A node with failed GPUs still counts `gpu_healthy` as usable for the replicas already on it.
- Allocations are stored per (cluster, node name), apart from the node objects, so they survive
  snapshots and can be restored (`assume`) before the agent has reported the node at all.
- A node carries its topology path (`NodeInfo.topology`: zone, then the levels its flavor
  declares in `FlavorInfo.topology_levels`); topology.py groups nodes into domains by it.
- Fabric resources (EFA, rdma/..., hugepages-...; `NodeInfo.extended`, else the flavor's
  `FlavorInfo.node_extended`) are counted per node like GPUs: `Node.ext_cap` minus what Muster
  placed there (`Cluster.node_ext`, per allocation, so it survives snapshots too). A node
  without a resource has none of it.
- A node that names a flavor the agent did not list gets an implicit on-demand flavor of that
  name with no GPU type and price 0, so its capacity and allocations are still tracked.
- A notice sticks (across upserts and snapshots that omit the deadline) while the node still
  takes no new pods, and counts as one interruption of its pool however often it is
  re-reported. An upsert or snapshot with neither a deadline nor `no_new_pods` withdraws it (a
  cordon lifted, a taint removed): the node takes placements again. What a notice already set
  off (a preemption) is not undone.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from broker.core.risk import PoolRisk
from broker.core.types import Vec, add_amounts
from schemas.agent import FlavorInfo, NodeInfo
from schemas.config import FlavorClass

ZONE = "topology.kubernetes.io/zone"  # the level a pool names first when it knows its zones

AllocKey = tuple[str, int]  # (job_id, attempt)


@dataclass(slots=True, eq=False)
class Node:
    name: str
    pool: Pool
    gpu: int
    cpu: int
    mem: int
    usable_gpu: int
    other_gpu: int
    other_cpu: int
    other_mem: int
    ready: bool
    spot_deadline: float | None
    healthy_all: bool
    no_new_pods: bool = False
    used_gpu: int = 0
    used_cpu: int = 0
    used_mem: int = 0
    free_gpu: int = 0
    free_cpu: int = 0
    free_mem: int = 0
    schedulable: bool = False
    bucket: int = -1  # index in pool.buckets, -1 when not schedulable
    notice_counted: bool = False
    # Its place in the cluster, one value per level its pool declares (`Pool.levels`): zone
    # first, then e.g. block, rack, host. Shorter when a label is missing (topology.py).
    topology: tuple[str, ...] = ()
    ext_cap: Mapping[str, int] = field(default_factory=dict)  # fabric resources it offers
    ext_used: dict[str, int] = field(default_factory=dict)  # of those, what Muster placed

    def ext_free(self, resource: str) -> int:
        return self.ext_cap.get(resource, 0) - self.ext_used.get(resource, 0)

    def refresh(self) -> None:
        """Recompute free capacity and schedulability, then re-file the node in its pool."""
        fg = self.usable_gpu - self.other_gpu - self.used_gpu
        self.free_gpu = fg if fg > 0 else 0
        fc = self.cpu - self.other_cpu - self.used_cpu
        self.free_cpu = fc if fc > 0 else 0
        fm = self.mem - self.other_mem - self.used_mem
        self.free_mem = fm if fm > 0 else 0
        self.schedulable = (
            self.ready and self.spot_deadline is None and self.healthy_all and not self.no_new_pods
        )
        pool = self.pool
        pool.touched[self] = None
        pool.refile(self)

    def take(self, gpu: int, cpu: int, mem: int) -> None:
        """`refresh` after a change of Muster usage only (schedulability stays as it is)."""
        fg = self.usable_gpu - self.other_gpu - (self.used_gpu + gpu)
        fc = self.cpu - self.other_cpu - (self.used_cpu + cpu)
        fm = self.mem - self.other_mem - (self.used_mem + mem)
        self.used_gpu += gpu
        self.used_cpu += cpu
        self.used_mem += mem
        self.free_gpu = fg if fg > 0 else 0
        self.free_cpu = fc if fc > 0 else 0
        self.free_mem = fm if fm > 0 else 0
        pool = self.pool
        pool.touched[self] = None
        if self.schedulable:
            pool.refile(self)

    @property
    def broken(self) -> bool:
        """Replicas already here cannot keep running (not ready, or too few healthy GPUs)."""
        return not self.ready or self.usable_gpu - self.other_gpu < self.used_gpu


@dataclass(slots=True, eq=False)
class Ceiling:
    """What a pool can hold, not what it holds now: the one owner of its capacity over time.

    A spot pool at zero nodes is normal and its nodes come back, so whether a gang could ever
    fit (`placement.empty_fit`, `placement.cluster_empty_fit_cpu`) is judged by high-water
    marks: the most nodes held at once per GPU size, the biggest node's cpu and memory, and the
    most cpu and memory held at once. The running counts they are raised from live here too.
    """

    now_counts: list[int] = field(default_factory=lambda: [0])  # nodes by allocatable GPUs
    counts: list[int] = field(default_factory=lambda: [0])  # high-water of now_counts
    node_cpu: int = 0
    node_mem: int = 0
    now_cpu: int = 0
    now_mem: int = 0
    total_cpu: int = 0  # high-water of now_cpu
    total_mem: int = 0

    def count(self, node: Node, sign: int) -> None:
        g = node.gpu
        now, hw = self.now_counts, self.counts
        while len(now) <= g:
            now.append(0)
        while len(hw) <= g:
            hw.append(0)
        now[g] += sign
        if now[g] > hw[g]:
            hw[g] = now[g]
        self.now_cpu += sign * node.cpu
        self.now_mem += sign * node.mem
        if sign > 0:
            self.node_cpu = max(self.node_cpu, node.cpu)
            self.node_mem = max(self.node_mem, node.mem)
            self.total_cpu = max(self.total_cpu, self.now_cpu)
            self.total_mem = max(self.total_mem, self.now_mem)


class Pool:
    """One (cluster, flavor): its nodes, the free-GPU index and its `Ceiling`."""

    __slots__ = (
        "buckets",
        "capacity_type",
        "ceiling",
        "cluster",
        "flavor_class",
        "free_gpu",
        "gpu_type",
        "info",
        "key",
        "levels",
        "name",
        "nodes",
        "price",
        "top",
        "touched",
    )

    def __init__(
        self,
        cluster: str,
        info: FlavorInfo,
        flavor_class: str,
        touched: dict[Node, None] | None = None,
    ) -> None:
        self.cluster = cluster
        # Nodes whose usage, capacity or schedulability changed since the invariant check last
        # read them (shared by every pool of one inventory; see `Inventory.touched`).
        self.touched: dict[Node, None] = {} if touched is None else touched
        self.name = info.name
        self.key = (cluster, info.name)
        self.nodes: dict[str, Node] = {}
        self.buckets: list[dict[str, Node]] = [{}]
        self.top = 0  # upper bound of the highest non-empty bucket
        self.free_gpu = 0  # sum of free GPUs over schedulable nodes
        self.ceiling = Ceiling()
        self.info = info
        self.flavor_class = flavor_class
        self.capacity_type = info.capacity_type
        self.gpu_type = info.gpu_type.lower()  # GPU types match case-insensitively
        self.price = info.price_per_gpu_hour
        self.levels = info.topology_levels  # topology level names, coarsest (zone) first

    def set_info(self, info: FlavorInfo, flavor_class: str) -> None:
        self.info = info
        self.flavor_class = flavor_class
        self.capacity_type = info.capacity_type
        self.gpu_type = info.gpu_type.lower()  # GPU types match case-insensitively
        self.price = info.price_per_gpu_hour
        self.levels = info.topology_levels

    def zone_of(self, node: Node) -> str:
        """The node's zone ("" when the pool declares no zone level: one zone for risk.py)."""
        if self.levels and self.levels[0] == ZONE and node.topology:
            return node.topology[0]
        return ""

    def owns(self, node: Node) -> bool:
        """Whether `node` is filed here (what packing asks of any node index)."""
        return node.pool is self

    def refile(self, node: Node) -> None:
        b = node.free_gpu if node.schedulable else -1
        old = node.bucket
        if b == old:
            return
        if old >= 0:
            del self.buckets[old][node.name]
            self.free_gpu -= old
        if b >= 0:
            buckets = self.buckets
            while len(buckets) <= b:
                buckets.append({})
            buckets[b][node.name] = node
            self.free_gpu += b
            if b > self.top:
                self.top = b
        node.bucket = b

    def top_bucket(self) -> int:
        """Highest bucket holding a node (0 when none)."""
        t = self.top
        buckets = self.buckets
        while t > 0 and not buckets[t]:
            t -= 1
        self.top = t
        return t

    def attach(self, node: Node) -> None:
        self.nodes[node.name] = node
        self.ceiling.count(node, 1)
        node.bucket = -1
        node.refresh()

    def detach(self, node: Node) -> None:
        node.schedulable = False
        self.refile(node)
        if self.nodes.pop(node.name, None) is not None:
            self.ceiling.count(node, -1)

    @property
    def node_gpu(self) -> int:
        """GPUs of the biggest node it has now (for cost estimates)."""
        now = self.ceiling.now_counts
        for g in range(len(now) - 1, 0, -1):
            if now[g]:
                return g
        return 0


@dataclass(slots=True, eq=False)
class Cluster:
    name: str
    pools: dict[str, Pool] = field(default_factory=dict)
    nodes: dict[str, Node] = field(default_factory=dict)
    node_allocs: dict[str, dict[AllocKey, Vec]] = field(default_factory=dict)
    node_ext: dict[str, dict[AllocKey, dict[str, int]]] = field(default_factory=dict)
    schedulable: bool = True
    seen: bool = False  # an agent reported inventory for it
    reachable: bool = True  # its agent is heard from
    stale: bool = False  # its agent's view of the cluster is stale (watches failing)


def _implicit_flavor(name: str) -> FlavorInfo:
    return FlavorInfo(name=name, capacity_type="on-demand")


class Inventory:
    """Every cluster's pools and nodes, the Muster allocations on them and pool risk stats."""

    __slots__ = (
        "_classes",
        "blocked",
        "clusters",
        "half_life_s",
        "probing",
        "risk",
        "totals",
        "touched",
        "version",
    )

    def __init__(self, classes: Sequence[FlavorClass], half_life_s: float) -> None:
        self._classes = tuple(classes)
        self.half_life_s = half_life_s
        self.clusters: dict[str, Cluster] = {}
        self.risk: dict[tuple[str, str], PoolRisk] = {}
        self.totals: list[int] = [0, 0, 0]  # allocatable over known nodes (DRF denominators)
        # Bumped whenever anything a waiting request's chances depend on changes here: nodes
        # (added, replaced, removed, healed, noticed), pools, their schedulability and rates.
        # The backlog reads it to know that capacity changed (`Backlog.capacity_changed`).
        self.version = 0
        # Nodes changed since `drain_touched` (insertion-ordered set). Every change of a node's
        # usage, capacity or schedulability files it here (`Node.refresh`, `Node.take`), so a
        # check that re-verifies these nodes verifies every node that could have gone wrong.
        self.touched: dict[Node, None] = {}
        # Pools whose dispatch breaker takes no placements now, with the reason (health.py),
        # and half-open pools that take one probe (the first admission blocks them).
        self.blocked: dict[tuple[str, str], str] = {}
        self.probing: set[tuple[str, str]] = set()

    # -- classes and lookups ----------------------------------------------------------

    def flavor_class(self, info: FlavorInfo) -> str:
        for fc in self._classes:
            if fc.capacity_type is not None and fc.capacity_type != info.capacity_type:
                continue
            if fc.gpu_type is not None and fc.gpu_type.lower() != info.gpu_type.lower():
                continue
            return fc.name
        return info.name

    def cluster(self, name: str) -> Cluster:
        c = self.clusters.get(name)
        if c is None:
            c = self.clusters[name] = Cluster(name)
        return c

    def pools(self) -> Iterator[Pool]:
        for c in self.clusters.values():
            yield from c.pools.values()

    def risk_of(self, key: tuple[str, str], spot: bool) -> PoolRisk:
        r = self.risk.get(key)
        if r is None:
            r = self.risk[key] = PoolRisk(spot=spot)
        r.spot = spot
        return r

    def rate(self, key: tuple[str, str], now: float, spot_prior: float) -> float:
        r = self.risk.get(key)
        if r is None:
            return 0.0
        return r.rate(now, self.half_life_s, spot_prior)

    # -- node bookkeeping ---------------------------------------------------------------

    def _pool(self, c: Cluster, flavor: str, now: float) -> Pool:
        p = c.pools.get(flavor)
        if p is None:
            info = _implicit_flavor(flavor)
            p = c.pools[flavor] = Pool(c.name, info, self.flavor_class(info), self.touched)
            self.risk_of(p.key, False).set_nodes(0, now, self.half_life_s)
            self.version += 1
        return p

    def _sync_pool_nodes(self, p: Pool, now: float) -> None:
        self.risk_of(p.key, p.capacity_type == "spot").set_nodes(
            len(p.nodes), now, self.half_life_s
        )

    def _add_node(
        self,
        c: Cluster,
        info: NodeInfo,
        now: float,
        notice: float | None = None,
        *,
        sync: bool = True,
    ) -> Node:
        """Build the node of `info` and file it in its pool. `sync=False`: the node replaces
        one of the same pool (an upsert), whose count of nodes is the same as before, so its
        spot risk is not told (twice) of a count that did not change."""
        pool = self._pool(c, info.flavor, now)
        if info.spot_deadline is None and not info.no_new_pods:
            notice = None  # withdrawn: nothing about the node says it is going away any more
        usable = info.gpu if info.gpu_healthy is None else min(info.gpu, info.gpu_healthy)
        node = Node(
            name=info.name,
            pool=pool,
            gpu=info.gpu,
            cpu=info.cpu_milli,
            mem=info.memory,
            usable_gpu=usable,
            other_gpu=info.other_gpu,
            other_cpu=info.other_cpu_milli,
            other_mem=info.other_memory,
            ready=info.ready,
            spot_deadline=info.spot_deadline if info.spot_deadline is not None else notice,
            healthy_all=usable >= info.gpu,
            no_new_pods=info.no_new_pods,
            topology=info.topology,
            ext_cap=info.extended or pool.info.node_extended,
        )
        for g, cp, m in c.node_allocs.get(info.name, {}).values():
            node.used_gpu += g
            node.used_cpu += cp
            node.used_mem += m
        for amounts in c.node_ext.get(info.name, {}).values():
            add_amounts(node.ext_used, amounts, 1)
        # A known notice that was not withdrawn is the same interruption (counted once).
        node.notice_counted = notice is not None
        c.nodes[info.name] = node
        pool.attach(node)
        if sync:
            self._sync_pool_nodes(pool, now)
        self.totals[0] += node.gpu
        self.totals[1] += node.cpu
        self.totals[2] += node.mem
        if node.spot_deadline is not None:
            self._count_notice(node, now)
        return node

    def _drop_node(self, c: Cluster, node: Node, now: float, *, sync: bool = True) -> None:
        node.pool.detach(node)
        self.touched.pop(node, None)  # gone: nothing to check (and `touched` stays bounded)
        if sync:
            self._sync_pool_nodes(node.pool, now)
        del c.nodes[node.name]
        self.totals[0] -= node.gpu
        self.totals[1] -= node.cpu
        self.totals[2] -= node.mem

    def _count_notice(self, node: Node, now: float) -> None:
        if not node.notice_counted:
            node.notice_counted = True
            pool = node.pool
            self.risk_of(pool.key, pool.capacity_type == "spot").record_notice(
                now, self.half_life_s, pool.zone_of(node)
            )

    # -- events ---------------------------------------------------------------------------

    def apply_snapshot(
        self, cluster: str, flavors: Sequence[FlavorInfo], nodes: Sequence[NodeInfo], now: float
    ) -> None:
        c = self.cluster(cluster)
        c.seen = True
        notices = {
            n.name: n.spot_deadline
            for n in c.nodes.values()
            if n.notice_counted and n.spot_deadline is not None
        }
        # Each pool's spot risk is told its count of nodes once, at the end: every count in
        # between is at the same `now`, where it accrues nothing (risk.py, `advance`).
        for node in list(c.nodes.values()):
            self._drop_node(c, node, now, sync=False)
        wanted = {f.name: f for f in flavors}
        for name, p in list(c.pools.items()):
            if name not in wanted:
                self._sync_pool_nodes(p, now)
                del c.pools[name]
        for f in flavors:
            known = c.pools.get(f.name)
            if known is None:
                known = c.pools[f.name] = Pool(cluster, f, self.flavor_class(f), self.touched)
            else:
                known.set_info(f, self.flavor_class(f))
        for info in nodes:
            if info.name in c.nodes:  # a duplicate in one snapshot: the last one wins
                self._drop_node(c, c.nodes[info.name], now, sync=False)
            self._add_node(c, info, now, notices.get(info.name), sync=False)
        for p in c.pools.values():
            self._sync_pool_nodes(p, now)
        self.version += 1

    def upsert_node(self, cluster: str, info: NodeInfo, now: float) -> tuple[Node, bool]:
        """Add or replace one node; returns (node, was it broken before this update)."""
        c = self.cluster(cluster)
        c.seen = True
        old = c.nodes.get(info.name)
        was_broken = False
        notice = None
        same_pool = False
        if old is not None:
            was_broken = old.broken
            notice = old.spot_deadline if old.notice_counted else None
            same_pool = old.pool is c.pools.get(info.flavor)
            self._drop_node(c, old, now, sync=not same_pool)
        self.version += 1
        return self._add_node(c, info, now, notice, sync=not same_pool), was_broken

    def remove_node(self, cluster: str, name: str, now: float) -> bool:
        c = self.clusters.get(cluster)
        if c is None or name not in c.nodes:
            return False
        self._drop_node(c, c.nodes[name], now)
        self.version += 1
        return True

    def set_gpu_health(self, cluster: str, name: str, healthy: int) -> tuple[Node, int] | None:
        """Returns (node, previous usable GPU count) or None for an unknown node."""
        c = self.clusters.get(cluster)
        node = c.nodes.get(name) if c is not None else None
        if node is None:
            return None
        before = node.usable_gpu
        node.usable_gpu = min(node.gpu, healthy)
        node.healthy_all = node.usable_gpu >= node.gpu
        node.refresh()
        self.version += 1
        return node, before

    def spot_notice(self, cluster: str, name: str, deadline: float, now: float) -> Node | None:
        c = self.clusters.get(cluster)
        node = c.nodes.get(name) if c is not None else None
        if node is None:
            return None
        node.spot_deadline = deadline
        node.refresh()
        self._count_notice(node, now)
        self.version += 1  # rates changed
        return node

    def remove_cluster(self, cluster: str, now: float) -> None:
        c = self.clusters.get(cluster)
        if c is None:
            return
        for node in list(c.nodes.values()):
            self._drop_node(c, node, now)
        c.pools.clear()
        c.seen = False
        if not c.node_allocs:
            del self.clusters[cluster]
        self.version += 1

    def set_schedulable(self, cluster: str, ok: bool) -> None:
        c = self.cluster(cluster)
        c.reachable = ok
        self._sync_schedulable(c)

    def set_stale(self, cluster: str, stale: bool) -> None:
        """An agent whose watches fail reports an old picture: place nothing there."""
        c = self.clusters.get(cluster)
        if c is not None and c.stale != stale:
            c.stale = stale
            self._sync_schedulable(c)

    def _sync_schedulable(self, c: Cluster) -> None:
        ok = c.reachable and not c.stale
        if c.schedulable != ok:
            c.schedulable = ok
            self.version += 1

    # -- Muster allocations -------------------------------------------------------------

    def drain_touched(self) -> list[Node]:
        """The nodes changed since the last call, oldest change first; forgets them."""
        out = list(self.touched)
        self.touched.clear()
        return out

    def add_usage_checked(
        self, cluster: str, key: AllocKey, per_node: Mapping[str, Vec]
    ) -> str | None:
        """`add_usage` when every node is known and takes its share; else changes nothing and
        returns the first node that cannot take it."""
        c = self.clusters.get(cluster)
        if c is None:
            if per_node:
                return next(iter(per_node))
            c = self.cluster(cluster)
        nodes = c.nodes
        for name, (g, cp, m) in per_node.items():
            n = nodes.get(name)
            if n is None or n.free_gpu < g or n.free_cpu < cp or n.free_mem < m:
                return name
        allocs = c.node_allocs
        for name, vec in per_node.items():
            here = allocs.get(name)
            if here is None:
                allocs[name] = {key: vec}
            else:
                here[key] = vec
            nodes[name].take(vec[0], vec[1], vec[2])
        return None

    def add_usage(self, cluster: str, key: AllocKey, per_node: Mapping[str, Vec]) -> None:
        c = self.cluster(cluster)
        for name, vec in per_node.items():
            c.node_allocs.setdefault(name, {})[key] = vec
            node = c.nodes.get(name)
            if node is not None:
                node.take(vec[0], vec[1], vec[2])

    def remove_usage(self, cluster: str, key: AllocKey, per_node: Mapping[str, Vec]) -> None:
        c = self.clusters.get(cluster)
        if c is None:
            return
        for name in per_node:
            here = c.node_allocs.get(name)
            if here is None:
                continue
            vec = here.pop(key, None)
            if not here:
                del c.node_allocs[name]
            node = c.nodes.get(name)
            if vec is not None and node is not None:
                node.take(-vec[0], -vec[1], -vec[2])
        if not c.node_allocs and not c.seen:
            del self.clusters[cluster]

    def ext_short(self, cluster: str, per_node: Mapping[str, Mapping[str, int]]) -> str | None:
        """The first node without enough free fabric resources for its share, else None."""
        nodes = self.clusters[cluster].nodes if cluster in self.clusters else {}
        for name, amounts in per_node.items():
            n = nodes.get(name)
            if n is None or any(n.ext_free(r) < v for r, v in amounts.items()):
                return name
        return None

    def ext_held(self, cluster: str, key: AllocKey, nodes: Iterable[str]) -> dict[str, int]:
        """The fabric resources the allocation holds on `nodes`, summed."""
        out: dict[str, int] = {}
        c = self.clusters.get(cluster)
        if c is None or not c.node_ext:
            return out
        for name in nodes:
            mine = c.node_ext.get(name, {}).get(key)
            if mine:
                add_amounts(out, mine, 1)
        return out

    def add_ext(
        self, cluster: str, key: AllocKey, per_node: Mapping[str, Mapping[str, int]]
    ) -> None:
        """Count an allocation's fabric resources on its nodes (`add_usage` for them)."""
        c = self.cluster(cluster)
        for name, amounts in per_node.items():
            here = c.node_ext.setdefault(name, {})
            mine = here.setdefault(key, {})
            add_amounts(mine, amounts, 1)
            node = c.nodes.get(name)
            if node is not None:
                add_amounts(node.ext_used, amounts, 1)
                node.pool.touched[node] = None

    def remove_ext(self, cluster: str, key: AllocKey, nodes: Iterable[str]) -> None:
        """Give back what the allocation holds of fabric resources on `nodes`."""
        c = self.clusters.get(cluster)
        if c is None:
            return
        for name in nodes:
            here = c.node_ext.get(name)
            amounts = here.pop(key, None) if here is not None else None
            if here is not None and not here:
                del c.node_ext[name]
            node = c.nodes.get(name)
            if amounts and node is not None:
                add_amounts(node.ext_used, amounts, -1)
                node.pool.touched[node] = None

    def suspend_usage(self, cluster: str, per_node: Mapping[str, Vec], sign: int) -> None:
        """Take (sign=1) or give back (sign=-1) node capacity without touching the records."""
        c = self.clusters.get(cluster)
        if c is None:
            return
        for name, vec in per_node.items():
            node = c.nodes.get(name)
            if node is not None:
                node.take(sign * vec[0], sign * vec[1], sign * vec[2])

    def keys_on_node(self, cluster: str, name: str) -> list[AllocKey]:
        c = self.clusters.get(cluster)
        if c is None:
            return []
        return list(c.node_allocs.get(name, {}))
