"""Autoscaled pools: nodes a pool can still add count as capacity that arrives later.

A flavor whose agent declares `FlavorInfo.provision` (a Karpenter NodePool, a cluster-autoscaler
node group, a GKE node pool) may grow to its limit (`ProvisionPool.limit`: `max_nodes`, or
`max_gpus` over the GPUs per node) of one template, a new node being Ready about `ready_s`
after it is asked for. When a gang does not fit the nodes that exist, or
fits only on a pool that costs more than waiting for a cheaper one, the broker plans it on one
such pool: its free nodes now (when no other job waits on that pool) plus the fewest new nodes
that take the whole gang, within the pool's limit less what earlier plans already asked for.
The plan becomes a `Claim`, and exactly one cluster is asked to grow (`Ask`, the shell's
`provision` command). The gang is then placed as usual once the nodes are reported. Until
then other jobs see the pool's free GPUs less what claims hold (`Claim.hold`: every free GPU
the plan counted on, and each new node whole once it came), a count per pool rather than
named nodes, so nothing can cut the held capacity into pieces the gang no longer fits.

Pricing the wait. A plan's score is its expected cost per hour (risk.py) times
`1 + ready_s / wait_horizon_s`: waiting w seconds costs w / horizon of an hour of the gang
at that pool's price. With the default hour, a gang that can start now on a pool 5 % dearer
beats one that waits 300 s (+8.3 %) for the cheaper pool; one 3x dearer does not. Capacity
rank (spot or on-demand as the job asks) and the queue's flavor order come first, as in
placement.py.

Stockouts (SkyPilot's failover and Kueue's ProvisioningRequest `Failed`, without Kueue's
deactivation after retries): a claim whose nodes have not all come by `window_s` is a failed
placement. The job's next cycle plans it elsewhere at once (that pool is skipped for the job
for `stockout_avoid_s`), and the pool's score is multiplied by `1 + stockouts`, a count that
halves every `stockout_half_life_s`, like the learned spot risk. Nothing is disabled for good.

Quotas: a plan passes the queue's quota check for its gang plus every other claim of that
queue in that flavor class, so the claims of a queue together never promise more than its
quota; the charge itself is made only when the gang is placed (`Scheduler.commit`).

Not modelled: which zone or topology domain new nodes join (a gang with a topology need
waits for the nodes, then is placed by `topology.place` as usual), and the cpu and memory of
a pool's existing nodes (only the template's are checked).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from broker.core.assigner import Snapshot, allow_fallback, plus_held
from broker.core.inventory import Inventory, Pool
from broker.core.placement import Gang, capacity_rank, estimate_counts, pool_cost
from broker.core.quota import QueueState
from broker.core.speed import speed_of
from broker.core.types import Ask, GangRequest, PoolKey, Reason, Vec
from schemas.agent import Provision, ProvisionPool

# GPUs held per pool for the jobs waiting on it: pool -> job -> GPUs (Snapshot.held).
Held = dict[PoolKey, dict[str, int]]
MAX_EXTRA_NODES = 64  # new nodes tried beyond the fewest that could hold the gang's GPUs


@dataclass(slots=True)
class Claim:
    """A gang waiting for nodes one pool is adding for it."""

    job_id: str
    pool: PoolKey
    queue: str
    flavor_class: str
    vec: Vec  # the gang's quota vector
    node_gpu: int
    nodes: int  # new nodes asked for
    pending: int  # of those, not reported yet
    free: int  # free GPUs of the pool's nodes that the plan counted on (0: new nodes only)
    ready_at: float
    deadline: float
    cost: float  # expected cost per hour there, stockout penalty included
    rank: tuple[int, int]  # (capacity rank, flavor-order index)
    reason: Reason
    speed: float = 1.0  # the job's relative speed on the pool's GPU type (speed.py)

    def hold(self) -> int:
        """GPUs of the pool held for this gang: every free GPU the plan counted on and the
        whole of each new node that came, so that no other job can cut them into pieces the
        gang's replicas no longer fit."""
        return self.free + (self.nodes - self.pending) * self.node_gpu


@dataclass(slots=True, frozen=True)
class Plan:
    pool: Pool
    nodes: int
    free: int  # free GPUs of the pool counted on
    wait_s: float
    cost: float  # per hour, stockout penalty included
    score: float  # cost with the wait priced
    rank: tuple[int, int]
    speed: float = 1.0  # the job's relative speed on the pool's GPU type (speed.py)

    @property
    def per_work(self) -> float:
        """The score per unit of work: what plans and placements are compared by."""
        return self.score / self.speed


@dataclass(slots=True)
class Provisions:
    """Claims on autoscaled pools, the stockout history and each job's pools to skip."""

    wait_horizon_s: float = 3600.0
    half_life_s: float = 1800.0
    avoid_s: float = 600.0
    claims: dict[str, Claim] = field(default_factory=dict)
    held: Held = field(default_factory=dict)
    # (queue, flavor class) -> job -> quota vector of its claim (Snapshot.held_quota)
    held_quota: dict[tuple[str, str], dict[str, Vec]] = field(default_factory=dict)
    stockouts: dict[PoolKey, tuple[float, float]] = field(default_factory=dict)  # (count, at)
    asks: int = 0  # pools asked to grow, since start
    stockouts_total: int = 0  # of those asks, the ones that stocked out
    _seen: dict[PoolKey, int] = field(default_factory=dict)  # nodes last counted per pool
    _coming: dict[PoolKey, int] = field(default_factory=dict)  # pool -> pending nodes (claims)
    _skip: dict[str, dict[PoolKey, float]] = field(default_factory=dict)  # job -> pool -> until

    # -- state ------------------------------------------------------------------------
    def promised(self, key: PoolKey) -> int:
        """New nodes asked of the pool that have not come yet."""
        return self._coming.get(key, 0)

    def penalty(self, key: PoolKey, now: float) -> float:
        """The decayed count of the pool's recent stockouts (0 when none)."""
        got = self.stockouts.get(key)
        if got is None:
            return 0.0
        count, at = got
        return float(count * 0.5 ** (max(0.0, now - at) / self.half_life_s))

    def observe(self, inv: Inventory) -> None:
        """Nodes that joined a pool with claims count against its claims, oldest first."""
        keys = {c.pool for c in self.claims.values()}
        for key in list(self._seen):
            if key not in keys:
                del self._seen[key]
        for key in keys:
            pool = _pool(inv, key)
            n = len(pool.nodes) if pool is not None else 0
            arrived = n - self._seen.get(key, n)
            self._seen[key] = n
            for c in self.claims.values():
                if arrived <= 0:
                    break
                if c.pool == key and c.pending:
                    took = min(arrived, c.pending)
                    c.pending -= took
                    arrived -= took
        self._rebuild_held()

    def _rebuild_held(self) -> None:
        """The per-pool and per-queue sums every plan reads, from the claims (one pass)."""
        self.held.clear()
        self.held_quota.clear()
        self._coming.clear()
        for c in self.claims.values():
            self._coming[c.pool] = self._coming.get(c.pool, 0) + c.pending
            h = c.hold()
            if h:
                self.held.setdefault(c.pool, {})[c.job_id] = h
            self.held_quota.setdefault((c.queue, c.flavor_class), {})[c.job_id] = c.vec

    def expire(self, now: float) -> list[Claim]:
        """Claims past their window: those still missing nodes are stockouts (returned; the
        pool's penalty grows and the job skips it for a while); the others just end."""
        out: list[Claim] = []
        ended = [c for c in self.claims.values() if now >= c.deadline]
        for c in ended:
            del self.claims[c.job_id]
            if c.pending:
                out.append(c)
                self.stockouts_total += 1
                self.stockouts[c.pool] = (self.penalty(c.pool, now) + 1.0, now)
                self._skip.setdefault(c.job_id, {})[c.pool] = now + self.avoid_s
        if ended:
            self._rebuild_held()
        return out

    def end(self, job_id: str) -> None:
        """The job's claim ends without a stockout (the nodes stay for the autoscaler)."""
        if self.claims.pop(job_id, None) is not None:
            self._rebuild_held()

    def drop(self, job_id: str) -> None:
        """The job was placed or left: its claim ends, and what it learned of stockouts."""
        self.end(job_id)
        self._skip.pop(job_id, None)

    # -- planning ---------------------------------------------------------------------
    def plan(
        self, req: GangRequest, gang: Gang, qs: QueueState, snap: Snapshot, now: float
    ) -> Plan | None:
        """The best pool to grow for the whole gang, or None when no declared pool can."""
        if not gang.gpu_sets:
            return None
        cands = snap.candidates(req, gang)
        skip = self._skip.get(req.job_id)
        if skip:
            for key, until in list(skip.items()):
                if now >= until:
                    del skip[key]
        fallback: bool | None = None
        best: Plan | None = None
        for gi, group in enumerate(cands.groups):
            if cands.ranks[gi] == 1:
                if fallback is None:
                    fallback = allow_fallback(req, gang, cands)
                if not fallback:
                    break
            for pool in group:
                spec = pool.info.provision
                if spec is None or pool.key in req.avoid_pools or (skip and pool.key in skip):
                    continue
                rank = rank_of(req, pool, qs)
                if best is not None and rank > best.rank:
                    continue
                got = self._plan_pool(req, gang, qs, snap, pool, spec, rank, now)
                if got is not None and (
                    best is None or (got.rank, got.per_work) < (best.rank, best.per_work)
                ):
                    best = got
        return best

    def _plan_pool(
        self,
        req: GangRequest,
        gang: Gang,
        qs: QueueState,
        snap: Snapshot,
        pool: Pool,
        spec: ProvisionPool,
        rank: tuple[int, int],
        now: float,
    ) -> Plan | None:
        room = spec.limit - len(pool.nodes) - self.promised(pool.key)
        if room <= 0:
            return None
        # The first gang to wait on a pool may count on its free nodes; later ones only on
        # new nodes (the first holds every free GPU).
        alone = pool.key not in self._coming  # every claim is of a pool with a key here
        k = nodes_needed(pool, spec, gang, room, use_free=alone)
        if k is None:
            return None
        cls = pool.flavor_class
        vec = plus_held(self.held_quota, qs.name, cls, req.job_id, gang.total)
        if snap.book.check(qs, cls, vec) is not None:
            return None
        nodes = max(1, -(-gang.total[0] // spec.node_gpu))
        cost = pool_cost(pool, req, gang.total[0], nodes, snap.rate_of, snap.risk_weight)
        cost *= 1.0 + self.penalty(pool.key, now)
        free = pool.free_gpu if alone else 0
        speed = speed_of(req.speeds, snap.gpu_speeds)(pool.gpu_type)
        score = self.score(cost, spec.ready_s)
        return Plan(pool, k, free, spec.ready_s, cost, score, rank, speed)

    def score(self, cost: float, wait_s: float) -> float:
        """A cost per hour with a wait of `wait_s` priced in."""
        return cost * (1.0 + max(0.0, wait_s) / self.wait_horizon_s)

    def beats(self, plan: Plan, cost_now: float, rank_now: tuple[int, int]) -> bool:
        """Is waiting for `plan` better than starting now at `cost_now` per unit of work
        (rank `rank_now`)?"""
        return (plan.rank, plan.per_work) < (rank_now, cost_now)

    def still_worth(
        self, claim: Claim, cost_now: float, rank_now: tuple[int, int], now: float
    ) -> bool:
        """Is the rest of a claim's wait better than starting now elsewhere (`cost_now`: per
        unit of work)?"""
        rest = self.score(claim.cost, claim.ready_at - now) / claim.speed
        return (claim.rank, rest) <= (rank_now, cost_now)

    def claim(self, req: GangRequest, gang: Gang, plan: Plan, now: float) -> Ask:
        """Record the plan as the job's claim; the ask goes to the pool's cluster only."""
        pool = plan.pool
        spec = pool.info.provision
        assert spec is not None  # plans are made on declared pools only
        if pool.key not in self._seen:
            self._seen[pool.key] = len(pool.nodes)
        note = " (and its free nodes)" if plan.free else ""
        reason = Reason(
            "waiting-for-nodes",
            f"waits ~{plan.wait_s:.0f} s for {plan.nodes} node{'s' if plan.nodes != 1 else ''} "
            f"of pool {pool.cluster}/{pool.name}{note}: ${plan.score:.2f}/h with the wait priced",
            cluster=pool.cluster,
            flavor=pool.name,
        )
        c = Claim(
            req.job_id,
            pool.key,
            req.queue,
            pool.flavor_class,
            gang.total,
            spec.node_gpu,
            plan.nodes,
            plan.nodes,
            plan.free,
            now + plan.wait_s,
            now + spec.window_s,
            plan.cost,
            plan.rank,
            reason,
            plan.speed,
        )
        self.claims[req.job_id] = c
        self.asks += 1
        self._rebuild_held()
        return Ask(req.job_id, pool.cluster, pool.name, plan.nodes, c.deadline)


def provision_command(ask: Ask, epoch: int) -> Provision:
    """The `provision` command for one ask, to the one cluster chosen."""
    return Provision(
        job_id=ask.job_id,
        epoch=epoch,
        flavor=ask.flavor,
        nodes=ask.nodes,
        deadline=max(0.0, ask.deadline),
    )


def rank_of(req: GangRequest, pool: Pool, qs: QueueState) -> tuple[int, int]:
    """(capacity rank, flavor-order index) of a pool for a request, as `Plan.rank`."""
    order = qs.config.flavor_order
    idx = order.index(pool.flavor_class) if pool.flavor_class in order else len(order)
    return (capacity_rank(req.capacity, req.spot_exhausted, pool.capacity_type, req.spot_ok), idx)


def nodes_needed(
    pool: Pool, spec: ProvisionPool, gang: Gang, room: int, use_free: bool
) -> int | None:
    """The fewest new template nodes (1..room) that, with the pool's free nodes when
    `use_free`, hold every GPU replica of the gang; None when none do, or when the gang fits
    without a new node (then something other than capacity binds)."""
    g = spec.node_gpu
    for i in gang.gpu_sets:
        d = gang.demands[i]
        if d.gpu > g:
            return None
        if spec.node_cpu_milli and d.cpu_milli > spec.node_cpu_milli:
            return None
        if spec.node_memory and d.memory > spec.node_memory:
            return None
    base = [0] * (g + 1)
    free = 0
    if use_free:
        top = pool.top_bucket()
        if top >= len(base):
            base.extend([0] * (top + 1 - len(base)))
        for b in range(1, top + 1):
            base[b] = len(pool.buckets[b])
            free += b * base[b]
        if estimate_counts(list(base), gang) is not None:
            return None
    lo = max(1, -(-(gang.total[0] - free) // g))
    for k in range(lo, min(room, lo + MAX_EXTRA_NODES) + 1):
        counts = list(base)
        counts[g] += k
        if estimate_counts(counts, gang) is not None:
            return k
    return None


def _pool(inv: Inventory, key: PoolKey) -> Pool | None:
    cluster = inv.clusters.get(key[0])
    return None if cluster is None else cluster.pools.get(key[1])
