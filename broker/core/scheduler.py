"""The scheduling core's facade: inventory events in, admissions and preemptions out.

Pure and synchronous: time arrives as `now`, nothing here awaits, sleeps, logs or does I/O.
The lifecycle machine (machine.py) owns jobs; this class owns capacity: the inventory, the
allocations keyed by (job_id, attempt), the quota book and the pools' interruption statistics.

Cycle (`schedule`): queues take turns by weighted dominant-resource fairness (lowest share of
admitted gpu/cpu/memory ÷ weight first; ties by config order); inside a queue, higher priority
first, then lower `order`. StrictFIFO stops a queue at its first blocked job; BestEffortFIFO lets
later jobs pass. Each decision is `assigner.assign` (a pure search over the cycle's `Snapshot`),
checked against the spot-only jobs that wait for spot (`placement.spot_kept_for`: a job that
may run on on-demand leaves them that spot and takes on-demand), then `commit` (node capacity,
the allocation, the quota charge). Capacity and quota only shrink during a cycle, so the
snapshot remembers a failure per gang shape (and per queue when quota was involved) and
repeated shapes are rejected in O(1).

Node events return the job_ids the lifecycle machine must act on:
- `upsert_node`: the node turned broken under Muster replicas (not ready, or fewer healthy
  GPUs than other pods plus Muster use). A spot deadline in an upsert only marks the node
  draining; the SpotNotice event (`spot_notice`) carries the make-before-break path.
- `set_gpu_health`: healthy GPUs dropped AND are now fewer than other pods plus Muster use, so
  by pigeonhole a GPU under a Muster replica failed; every job with GPU replicas there is
  returned. A drop absorbed by idle GPUs returns [] (the node still takes nothing new).
- `apply_snapshot`: jobs with allocations on nodes the snapshot no longer lists.
Allocations are never dropped by events: the machine ends the attempt and calls `release`.

Preemption: a planned preemptor waits (reason `waiting-for-preemption`) while its victims are
ended; its victims cannot be chosen by anyone else, and it plans nothing new. The node capacity
each victim frees is held for the preemptor, and once every victim is gone the next cycle
places the preemptor before any other job: an eviction only ever admits the job it was made
for, and nobody (least of all the victim, requeued) takes the capacity in between. A plan
whose victims are not all released within `_wait_s` (twice the checkpoint grace plus dispatch
acks, at least a minute) is dropped with its holds. Quota is held once per job: a
make-before-break replacement (`reserve` with `replacing_attempt`) takes the charge over from
the attempt it replaces, and a `Reservation` records the pair until one of them ends.

Stability (no eviction storms): a gang admitted less than `preemption_min_runtime_s` ago is
never a victim, and a job reclaimed once is not reclaimed again until an input changes (a
submission, a job ending on its own, or a change of capacity). Without the first rule the
freshest job is always the cheapest victim (it has lost the least work), so the same job bounced
between admission and eviction.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType

from broker.core.assigner import (
    Assignment,
    Reasons,
    Shape,
    Snapshot,
    allow_fallback,
    assign,
    least_podsets,
    shape_of,
)
from broker.core.diagnose import pool_reasons
from broker.core.elastic import with_placement, without_node_placement
from broker.core.inventory import AllocKey, Cluster, Inventory, Node, Pool
from broker.core.ledger import Alloc, Ledger
from broker.core.placement import (
    Candidates,
    Gang,
    build_candidates,
    capacity_rank,
    empty_fit,
    ext_per_node,
    gpu_type_ok,
    make_gang,
    pool_cost,
    summed,
)
from broker.core.preemption import plan_preemption, worth_planning
from broker.core.provision import Claim, Provisions, rank_of
from broker.core.quota import Cohort, QueueState, QuotaBook, QuotaMiss, never_admissible
from broker.core.reasons import feasibility
from broker.core.reservation import Reservation
from broker.core.risk import checkpoint_survival, gang_reclaim_rate
from broker.core.speed import WorkPrice, speed_of
from broker.core.spotwait import SpotWaiters, order_key
from broker.core.topology import growth_domains, zone_spread
from broker.core.types import (
    CycleResult,
    GangRequest,
    Placement,
    PodSetDemand,
    PoolKey,
    Preemption,
    Reason,
    TopologyNeed,
    Vec,
)
from schemas.agent import FlavorInfo, NodeInfo
from schemas.api import FlavorView, QueueView
from schemas.config import BrokerConfig

MAX_PLANS_PER_CYCLE = 256  # preemption searches per cycle (each may pack several pools)
# A plan whose victims are not all released in time is dropped (its victims may be chosen
# again), so a preemptor never waits forever on a victim the machine did not end.
PREEMPTION_WAIT_MIN_S = 60.0
HOLD_ATTEMPT = 0  # allocation key (preemptor, 0): capacity held for it; real attempts start at 1
_PREEMPTIBLE = frozenset({"insufficient-capacity", "quota-exceeded", "cohort-exhausted"})
_GANG_CACHE_MAX = 65_536
# A gang shape's candidate pools (matching pools ranked by capacity, flavor order and expected
# cost) are kept from one cycle to the next while the inventory's version holds (nodes, pools,
# schedulability, breakers and notices bump it), for at most this long: the only other input,
# the pools' interruption rates, drifts with `rate_half_life_s` (hours), not within a second.
# At a steady pace of submissions each cycle admits a few jobs, and ranking every pool of the
# fleet for each of their shapes was half the cycle's cost.
CANDIDATES_KEPT_S = 1.0


def _job_ids(keys: Iterable[AllocKey]) -> list[str]:
    """The jobs holding these allocations; capacity held for a preemptor is not a job there."""
    return list(dict.fromkeys(k[0] for k in keys if k[1] != HOLD_ATTEMPT))


def _root(q: QueueState) -> Cohort | None:
    co = q.cohort
    while co is not None and co.parent is not None:
        co = co.parent
    return co


def protection_message(victims: Sequence[str], min_runtime: float) -> str:
    """Who will be preempted, and why not yet (`muster why` adds when)."""
    shown = ", ".join(victims[:5]) + (f" and {len(victims) - 5} more" if len(victims) > 5 else "")
    return (
        f"will preempt {shown} when the protection of its newest run lapses "
        f"(preemption_min_runtime_s: {min_runtime:g}s)"
    )


def _same_tree(a: QueueState, b: QueueState) -> bool:
    """Both queues under one root cohort: they lend to and reclaim from each other."""
    root = _root(a)
    return root is not None and root is _root(b)


class Scheduler:
    """Capacity, quota and placement for every cluster; see the module docstring."""

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        sc = config.scheduling
        self._prior = sc.spot_prior_rate
        self._risk_weight = sc.risk_weight
        self._gpu_speeds = {t.lower(): v for t, v in sc.gpu_speeds.items()}
        self._inv = Inventory(config.flavors, sc.rate_half_life_s)
        self._book = QuotaBook(config.queues, config.cohorts)
        self._ledger = Ledger()
        self._progress: dict[AllocKey, float] = {}  # note_progress before the allocation
        # preemptor -> (victims still allocated, its reason, when the plan expires)
        self._waiting: dict[str, tuple[set[AllocKey], Reason, float]] = {}
        grace = config.timeouts.checkpoint_grace_s
        self._wait_s = max(PREEMPTION_WAIT_MIN_S, 2 * grace + config.timeouts.dispatch_ack_s * 4)
        self._gangs: dict[tuple[PodSetDemand, ...], Gang] = {}
        # Candidate pools per shape kept between cycles for `candidates_kept_s` (0: built
        # afresh every cycle), as of inventory version `_kept_version`, from `_kept_since` on.
        self.candidates_kept_s = CANDIDATES_KEPT_S
        self._kept: dict[Shape, Candidates] = {}
        self._kept_version = -1
        self._kept_since = 0.0
        # The running cycle's snapshot (its memo tables); None between cycles.
        self._snap: Snapshot | None = None
        self._plan_fail: set[tuple[str, int, Shape]] = set()
        self._shapes: dict[Shape, Shape] = {}  # interned shapes (see `_shape_of`)
        # (queue, shape) -> `check_feasible`'s answer, as of inventory version `_feas_at`: the
        # answer reads only the request's shape and queue, the inventory and the static
        # config, so alike submissions share one computation until the inventory changes.
        self._feas: dict[tuple[str, Shape], tuple[Reason, ...]] = {}
        self._feas_at = -1
        # (queue, priority) -> worth_planning, valid until the ledger or the book changes
        self._worth: dict[tuple[str, int], bool] = {}
        # (queue, priority, shape) -> the reasons its first request failed with this cycle:
        # later requests of that shape fail alike until an admission or a plan changes the
        # book. Per head this saves the whole decision path (see `_cycle`).
        self._same_fail: dict[tuple[str, int, Shape], tuple[Reason, ...]] = {}
        self._plans = 0
        self._fresh: list[Alloc] = []  # admitted by the running cycle
        self._rates: dict[tuple[str, str], float] = {}
        self._rates_at: tuple[float, int] = (float("nan"), -1)
        self._min_runtime = sc.preemption_min_runtime_s
        # preemptor -> cluster -> node -> capacity its ended victims freed; kept until the
        # preemptor's next cycle (or its plan expires while victims are still ending)
        self._holds: dict[str, dict[str, dict[str, Vec]]] = {}
        # jobs reclaimed since the inputs last changed (cleared by `_inputs_changed`)
        self._reclaimed: set[str] = set()
        self._max_order = 0
        # preemptor -> (its queue, the flavor class it preempts in): while it waits or holds,
        # later jobs of its queue and borrowers of its cohort may not take that quota
        self._claims: dict[str, tuple[QueueState, str]] = {}
        self._reservations: dict[str, Reservation] = {}  # job_id -> make-before-break pair
        # preemptor -> (when the first victim's minimum runtime ends, those victims, its
        # queue): a plan that only protection stopped is tried again at that time, not at
        # the next unrelated capacity change
        self._protection: dict[str, tuple[float, tuple[str, ...], str]] = {}
        # gangs waiting for nodes autoscaled pools are adding for them (provision.py)
        self._prov = Provisions(
            sc.provision_wait_horizon_s, sc.stockout_half_life_s, sc.stockout_avoid_s
        )
        self._provisionable = False
        self._provisionable_at = -1  # the inventory version `_provisionable` was read at
        # The queued spot-only jobs that wait for spot capacity: flexible jobs leave them the
        # spot (spotwait.py)
        self.spot_waiters = SpotWaiters(lambda r: self._gang(r.podsets))

    # -- inventory --------------------------------------------------------------------

    def apply_snapshot(
        self, cluster: str, flavors: list[FlavorInfo], nodes: list[NodeInfo], now: float
    ) -> list[str]:
        self._inputs_changed()
        self._inv.apply_snapshot(cluster, flavors, nodes, now)
        c = self._inv.clusters[cluster]
        gone = [k for name, here in c.node_allocs.items() if name not in c.nodes for k in here]
        return _job_ids(gone)

    def upsert_node(self, cluster: str, node: NodeInfo, now: float) -> list[str]:
        self._inputs_changed()
        n, was_broken = self._inv.upsert_node(cluster, node, now)
        if n.broken and not was_broken:
            return self.jobs_on_node(cluster, node.name)
        return []

    def remove_node(self, cluster: str, node_name: str, now: float) -> list[str]:
        self._inputs_changed()
        jobs = self.jobs_on_node(cluster, node_name)
        self._inv.remove_node(cluster, node_name, now)
        return jobs

    def set_gpu_health(self, cluster: str, node_name: str, healthy: int, now: float) -> list[str]:
        res = self._inv.set_gpu_health(cluster, node_name, healthy)
        if res is None:
            return []
        self._inputs_changed()
        node, before = res
        if node.usable_gpu < before and node.usable_gpu - node.other_gpu < node.used_gpu:
            here = self._inv.clusters[cluster].node_allocs.get(node_name, {})
            return _job_ids(k for k, vec in here.items() if vec[0] > 0)
        return []

    def spot_notice(self, cluster: str, node_name: str, deadline: float, now: float) -> list[str]:
        if self._inv.spot_notice(cluster, node_name, deadline, now) is None:
            return []
        self._inputs_changed()
        return self.jobs_on_node(cluster, node_name)

    def remove_cluster(self, cluster: str, now: float) -> list[str]:
        c = self._inv.clusters.get(cluster)
        if c is None:
            return []
        self._inputs_changed()
        keys = [k for here in c.node_allocs.values() for k in here]
        self._inv.remove_cluster(cluster, now)
        return _job_ids(keys)

    def set_cluster_schedulable(self, cluster: str, ok: bool) -> None:
        self._inputs_changed()
        self._inv.set_schedulable(cluster, ok)

    @property
    def inventory_version(self) -> int:
        """Changes with every node, pool, schedulability or rate change (`Inventory.version`)."""
        return self._inv.version

    def set_cluster_stale(self, cluster: str, stale: bool) -> None:
        self._inv.set_stale(cluster, stale)

    def set_pool_blocked(self, pool: PoolKey, reason: str | None, *, probing: bool) -> None:
        """The dispatch breaker of `pool` (health.py): `reason` when it takes no placements,
        `probing` when it takes one more (a half-open breaker's probe)."""
        inv = self._inv
        if reason is None:
            inv.blocked.pop(pool, None)
        else:
            inv.blocked[pool] = reason
        if probing:
            inv.probing.add(pool)
        else:
            inv.probing.discard(pool)
        inv.version += 1
        self._inputs_changed()

    def pool_blocked(self, pool: PoolKey) -> str | None:
        return self._inv.blocked.get(pool)

    def jobs_on_node(self, cluster: str, node: str) -> list[str]:
        return _job_ids(self._inv.keys_on_node(cluster, node))

    # -- views ------------------------------------------------------------------------

    def flavor_info(self, cluster: str, flavor: str) -> FlavorInfo | None:
        """What the cluster's agent said about the flavor (the inventory owns flavors)."""
        c = self._inv.clusters.get(cluster)
        pool = c.pools.get(flavor) if c is not None else None
        return pool.info if pool is not None else None

    def known_clusters(self) -> list[str]:
        return sorted(name for name, c in self._inv.clusters.items() if c.seen)

    def pool_interruption_rate(self, pool: tuple[str, str], now: float) -> float:
        return self._inv.rate(pool, now, self._prior)

    def gang_reclaims_per_hour(self, placement: Placement, now: float) -> float:
        """How often some node of `placement`'s gang is reclaimed: the pool's rate per node
        times its nodes, or fewer when the pool's notices come in bursts within a zone
        (`risk.gang_reclaim_rate`, what the placement's expected cost priced)."""
        key = placement.pool
        rate = self._inv.rate(key, now, self._prior)
        c = self._inv.clusters.get(key[0])
        pool = c.pools.get(key[1]) if c is not None else None
        names = [n for n in placement.nodes if pool is not None and n in pool.nodes]
        risk = self._inv.risk.get(key)
        if pool is None or risk is None or risk.burst() <= 1.0 or len(names) < 2:
            return rate * len(placement.nodes)
        return gang_reclaim_rate(rate, zone_spread(pool, names), risk.burst())

    def queue_views(self, pending_counts: Mapping[str, int]) -> list[QueueView]:
        fleet = self._inv.totals
        return [
            self._book.view(qs, pending_counts.get(name, 0), fleet)
            for name, qs in self._book.queues.items()
        ]

    def flavor_views(self, cluster: str, now: float) -> list[FlavorView]:
        c = self._inv.clusters.get(cluster)
        if c is None:
            return []
        out: list[FlavorView] = []
        for p in c.pools.values():
            risk = self._inv.risk.get(p.key)
            grow = p.info.provision
            out.append(
                FlavorView(
                    name=p.name,
                    capacity_type=p.capacity_type,
                    gpu_type=p.info.gpu_type,
                    price_per_gpu_hour=p.price,
                    flavor_class=p.flavor_class,
                    nodes=len(p.nodes),
                    gpu_total=sum(n.gpu for n in p.nodes.values()),
                    gpu_free=p.free_gpu,
                    draining_nodes=sum(1 for n in p.nodes.values() if n.spot_deadline is not None),
                    interruptions=risk.total_notices if risk is not None else 0,
                    interruption_rate_per_node_hour=self._inv.rate(p.key, now, self._prior),
                    interruption_prior=self._prior if p.capacity_type == "spot" else None,
                    autoscale_max_nodes=grow.limit if grow is not None else 0,
                    nodes_coming=self._prov.promised(p.key) if grow is not None else 0,
                    stockouts=round(self._prov.penalty(p.key, now), 3),
                )
            )
        return out

    # -- admission ----------------------------------------------------------------------

    def _gang(self, podsets: tuple[PodSetDemand, ...]) -> Gang:
        g = self._gangs.get(podsets)
        if g is None:
            if len(self._gangs) >= _GANG_CACHE_MAX:
                self._gangs.clear()
            g = self._gangs[podsets] = make_gang(podsets)
        return g

    def snapshot(self, now: float) -> Snapshot:
        """What `assign` reads: capacity, quota and claims as they are now."""
        if len(self._gangs) >= _GANG_CACHE_MAX:
            self._gangs.clear()
        version = self._inv.version
        if (
            version != self._kept_version
            or not 0.0 <= now - self._kept_since < self.candidates_kept_s
            or len(self._kept) >= _GANG_CACHE_MAX
        ):
            self._kept.clear()
            self._kept_version = version
            self._kept_since = now
        return Snapshot(
            self._inv,
            self._book,
            self._rate_at(now),
            self._risk_weight,
            self._claimed,
            self._claims,
            gangs=self._gangs,
            held=self._prov.held,
            held_quota=self._prov.held_quota,
            gpu_speeds=self._gpu_speeds,
            kept=self._kept,
        )

    def assign(self, req: GangRequest, now: float) -> Assignment | Reasons:
        """Where `req` would go now (nothing changes; `commit` applies the answer)."""
        qs = self._book.queues.get(req.queue)
        if qs is None:
            return (Reason("unknown-queue", f"queue {req.queue!r} is not configured"),)
        snap = self._snap if self._snap is not None else self.snapshot(now)
        return assign(req, qs, snap)

    def schedule(
        self,
        pending: Sequence[GangRequest],
        now: float,
        spot_waiters: Sequence[GangRequest] = (),
    ) -> CycleResult:
        """One admission cycle. `spot_waiters`: the current requests of the jobs in
        `self.spot_waiters` that are still queued and not backing off (the machine owns the
        records); until one is admitted, a job that could run on on-demand does not take the
        spot it waits for."""
        res = CycleResult()
        self._plan_fail.clear()
        self._worth.clear()
        self._same_fail.clear()
        self._plans = 0
        self._expire_plans(now)
        self._note_arrivals(pending)
        if self._prov.claims:
            self.expire_provisions(now)
        # Whether some known pool declares nodes it can add: asked again only when the
        # inventory changed (a pool's declaration comes with its cluster's snapshot).
        if self._provisionable_at != self._inv.version:
            self._provisionable = any(p.info.provision is not None for p in self._inv.pools())
            self._provisionable_at = self._inv.version
        self._snap = self.snapshot(now)
        self.spot_waiters.begin(spot_waiters)
        tried = pending
        try:
            pending = self._holders_first(pending, now, res)
            self._cycle(pending, now, res)
        finally:
            self._snap = None
            self._ledger.settle(self._fresh)
            self._fresh.clear()
        self.spot_waiters.settle(tried, res.pending, (job_id for job_id, _ in res.admitted))
        return res

    def _expire_plans(self, now: float) -> None:
        for job_id, (keys, _, until) in list(self._waiting.items()):
            if now < until:
                continue
            del self._waiting[job_id]
            self._drop_hold(job_id)
            for key in keys:
                a = self._ledger.allocs.get(key)
                if a is not None and a.doomed_by == job_id:
                    self._ledger.set_state(a, a.charged, None)

    # -- stability: holds for preemptors, inputs, protected victims -----------------------

    def _inputs_changed(self) -> None:
        self._reclaimed.clear()

    def _note_arrivals(self, pending: Sequence[GangRequest]) -> None:
        top = max((r.order for r in pending), default=0)
        if top > self._max_order:
            self._max_order = top
            self._inputs_changed()

    def _hold(self, preemptor: str, cluster: str, per_node: Mapping[str, Vec]) -> None:
        """Keep node capacity for the job the victims are evicted for."""
        by_cluster = self._holds.setdefault(preemptor, {})
        key = (preemptor, HOLD_ATTEMPT)
        held = by_cluster.setdefault(cluster, {})
        self._inv.remove_usage(cluster, key, held)
        for name, (g, c, m) in per_node.items():
            hg, hc, hm = held.get(name, (0, 0, 0))
            held[name] = (hg + g, hc + c, hm + m)
        self._inv.add_usage(cluster, key, held)

    def _hold_free(self, preemptor: str, victims: Sequence[Alloc]) -> None:
        """At plan time, what is still free on the victims' nodes: the preemptor's fit counted
        on it, so nobody else may take it while the victims end."""
        for cluster in {a.cluster for a in victims}:
            c = self._inv.clusters.get(cluster)
            if c is None:
                continue
            free: dict[str, Vec] = {}
            for a in victims:
                if a.cluster != cluster:
                    continue
                for name in a.per_node:
                    node = c.nodes.get(name)
                    if node is not None and name not in free:
                        free[name] = (node.free_gpu, node.free_cpu, node.free_mem)
            if any(any(v) for v in free.values()):
                self._hold(preemptor, cluster, free)

    def _drop_hold(self, preemptor: str, keep_claim: bool = False) -> None:
        if preemptor not in self._waiting and not keep_claim:
            self._claims.pop(preemptor, None)
        hold = self._holds.pop(preemptor, None)
        if hold is None:
            return
        for cluster, held in hold.items():
            self._inv.remove_usage(cluster, (preemptor, HOLD_ATTEMPT), held)

    # -- read-only views for the safety checks (broker/core/invariants.py) ------------------

    def allocations(self) -> Mapping[AllocKey, Alloc]:
        """Every allocation by (job_id, attempt)."""
        return MappingProxyType(self._ledger.allocs)

    def allocations_by_job(self) -> Mapping[str, Mapping[int, Alloc]]:
        """job_id -> attempt -> allocation (the ledger's own index, which the checks verify)."""
        return MappingProxyType(self._ledger.by_job)

    def queue_states(self) -> Mapping[str, QueueState]:
        """Each configured queue's quota and usage as the book keeps it."""
        return MappingProxyType(self._book.queues)

    def cohort_states(self) -> Mapping[str, Cohort]:
        """Each cohort's limits, members and borrowed usage as the book keeps it (for checks
        that verify a cohort never lends more than its subtree holds)."""
        return MappingProxyType(self._book.cohorts)

    def quota_check(self, queue: str, flavor_class: str, demand: Vec) -> QuotaMiss | None:
        """Whether `demand` more would fit `queue`'s quota in `flavor_class` now: None, or the
        binding limit. A read for checks; admission asks the book itself inside the cycle."""
        return self._book.check(self._book.queues[queue], flavor_class, demand)

    def cluster_states(self) -> Mapping[str, Cluster]:
        """Every cluster's nodes and the Muster usage filed under each node."""
        return MappingProxyType(self._inv.clusters)

    def changed_nodes(self) -> list[Node]:
        """The nodes whose usage, capacity or schedulability changed since the last call
        (every node the first time): what a check must look at again. Only the checks call
        it; nothing in the scheduler reads what it drains."""
        return self._inv.drain_touched()

    def held(self) -> dict[str, dict[str, dict[str, Vec]]]:
        """preemptor -> cluster -> node -> capacity held for it (a view for checks)."""
        return dict(self._holds)

    def _holders_first(
        self, pending: Sequence[GangRequest], now: float, res: CycleResult
    ) -> Sequence[GangRequest]:
        """Place preemptors whose victims are all gone before anyone else; return the rest."""
        if not self._holds and not self._claims:
            return pending
        wanted = {r.job_id for r in pending}
        for job_id in [j for j in self._holds if j not in wanted]:
            self._drop_hold(job_id)  # cancelled, or no longer a candidate: free the capacity
        for job_id in [j for j in self._claims if j not in wanted]:
            del self._claims[job_id]  # likewise, its quota is no longer kept for it
        ready = [r for r in pending if r.job_id in self._holds and r.job_id not in self._waiting]
        if not ready:
            return pending
        ready.sort(key=order_key)
        done: set[str] = set()
        for req in ready:
            qs = self._book.queues.get(req.queue)
            if qs is None:
                continue
            self._drop_hold(req.job_id, keep_claim=True)
            out = self._decide(req, qs, now, res)
            if req.job_id not in self._waiting:
                self._claims.pop(req.job_id, None)
            done.add(req.job_id)
            if isinstance(out, Placement):
                res.admitted.append((req.job_id, out))
            else:
                res.pending[req.job_id] = out
        # Holds came back as free capacity: the snapshot's memo assumes capacity only shrinks.
        self._snap = self.snapshot(now)
        return [r for r in pending if r.job_id not in done]

    def _claimed(self, job_id: str, qs: QueueState, cls: str, demand: Vec) -> QuotaMiss | None:
        """While a job preempts to start in `cls`, the quota it needs is kept for it: neither
        its own queue (those jobs come after it) nor the other queues of its cohort admit
        anything else in `cls` until it starts (at most the plan's wait)."""
        if not self._claims:
            return None
        for claimant, (other, ocls) in self._claims.items():
            if ocls != cls or claimant == job_id:
                continue
            if other is not qs and not _same_tree(qs, other):
                continue
            if other is qs:
                if job_id in self._claims:
                    continue  # two reclaims of one queue: each got its own victims
                return QuotaMiss(
                    "quota-exceeded",
                    f"{claimant} of queue {qs.name} is preempting to start in {cls}; later jobs "
                    "of the queue wait until it starts",
                )
            # Another queue of the cohort: with lending, even its use inside nominal shrinks
            # what the cohort has left for the preemptor.
            return QuotaMiss(
                "cohort-exhausted",
                f"queue {other.name} is preempting to start a job in {cls}; queue "
                f"{qs.name} waits for {cls} in cohort {other.cohort.name if other.cohort else ''} "
                "until that job starts",
            )
        return None

    def _planning_elsewhere(self, job_id: str, qs: QueueState) -> bool:
        """One preemption at a time per queue (and per cohort): two plans each made against
        the quota as it is could not both start once their victims end."""
        for claimant, (other, _) in self._claims.items():
            if claimant == job_id:
                continue
            if other is qs or _same_tree(qs, other):
                return True
        return False

    def _protected(self, now: float, young: list[Alloc]) -> Callable[[Alloc, bool], bool]:
        """Whether a candidate victim is off limits; those still inside their minimum runtime
        are collected in `young` (their protection lapses at a known time)."""
        floor = now - self._min_runtime
        reclaimed = self._reclaimed

        def protected(a: Alloc, own: bool) -> bool:
            if a.admitted_at is not None and a.admitted_at > floor:
                young.append(a)
                return True
            return not own and a.job_id in reclaimed

        return protected

    def _protected_plan(self, req: GangRequest, young: list[Alloc]) -> Reason:
        """Remember when the young victims may be preempted, and say so."""
        lapse = min(a.admitted_at or 0.0 for a in young) + self._min_runtime
        victims = tuple(sorted({a.job_id for a in young}))
        self._protection[req.job_id] = (lapse, victims, req.queue)
        return Reason("preemption-protected", protection_message(victims, self._min_runtime))

    def protection(self, job_id: str) -> tuple[float, tuple[str, ...]] | None:
        """(when the protection lapses, the victims it protects) for a job that waits on it."""
        found = self._protection.get(job_id)
        return None if found is None else found[:2]

    def protection_lapsed(self, now: float) -> set[str]:
        """The queues of the jobs whose would-be victims' protection ended by `now` (each
        reported once): their heads are considered again, so the preemption is planned then."""
        due = [j for j, (lapse, _, _) in self._protection.items() if lapse <= now]
        return {self._protection.pop(j)[2] for j in due}

    def _cycle(self, pending: Sequence[GangRequest], now: float, res: CycleResult) -> None:
        book = self._book
        fleet = list(self._inv.totals)
        by_queue: dict[str, list[GangRequest]] = {}
        out_pending = res.pending
        for r in pending:
            if r.queue in book.queues:
                lst = by_queue.get(r.queue)
                if lst is None:
                    lst = by_queue[r.queue] = []
                lst.append(r)
            else:
                out_pending[r.job_id] = (
                    Reason("unknown-queue", f"queue {r.queue!r} is not configured"),
                )
        heap: list[tuple[float, int, str]] = []
        pos: dict[str, int] = {}
        for name, lst in by_queue.items():
            lst.sort(key=order_key)
            qs = book.queues[name]
            heap.append((book.share(qs, fleet), qs.index, name))
            pos[name] = 0
        heapq.heapify(heap)
        budget = self.config.scheduling.max_admissions_per_cycle
        admitted = res.admitted
        same_fail = self._same_fail  # cleared in place, never replaced
        while heap:
            _, idx, name = heap[0]
            lst = by_queue[name]
            i = pos[name]
            if i >= len(lst):
                heapq.heappop(heap)
                continue
            if len(admitted) >= budget:
                full = (
                    Reason("max-admissions", f"this cycle admitted its limit of {budget} jobs"),
                )
                for _, _, qn in heap:
                    for r in by_queue[qn][pos[qn] :]:
                        out_pending[r.job_id] = full
                return
            req = lst[i]
            pos[name] = i + 1
            qs = book.queues[name]
            out: Placement | tuple[Reason, ...] | None = (
                self._same_shape_failure(req, name) if same_fail else None
            )
            if out is None:
                out = self._decide(req, qs, now, res)
                if (
                    not isinstance(out, Placement)
                    and req.job_id not in self._waiting
                    and req.job_id not in self._prov.claims
                ):
                    self._same_fail[self._alike(req, name)] = out
            if isinstance(out, Placement):
                admitted.append((req.job_id, out))
                if req.capacity == "spot":
                    self.spot_waiters.forget(req.job_id)
                heapq.heapreplace(heap, (book.share(qs, fleet), idx, name))
                continue
            out_pending[req.job_id] = out
            if req.capacity == "spot" and any(r.code == "insufficient-capacity" for r in out):
                self.spot_waiters.waits(req)
            if qs.strict:
                blocked = (
                    Reason(
                        "strict-fifo-blocked",
                        f"queue {name} is StrictFIFO and its head {req.job_id} is blocked",
                    ),
                )
                for r in lst[i + 1 :]:
                    out_pending[r.job_id] = blocked
                pos[name] = len(lst)
                heapq.heappop(heap)

    def _shape_of(self, req: GangRequest) -> Shape:
        shape = req.shape_memo
        if shape is None:
            # Interned: equal shapes are one tuple, so memo lookups compare by identity and
            # a cycle over many alike requests leaves one shape, not one per request.
            fresh = shape_of(req)
            shapes = self._shapes
            shape = shapes.get(fresh)
            if shape is None:
                if len(shapes) >= _GANG_CACHE_MAX:
                    shapes.clear()
                shape = shapes[fresh] = fresh
            req.shape_memo = shape
        return shape

    def _alike(self, req: GangRequest, queue: str) -> tuple[str, int, Shape]:
        """The requests a search's failure holds for within a cycle: same queue, priority and
        shape (the key of both the failure and the preemption-plan memo)."""
        return (queue, req.priority, self._shape_of(req))

    def _same_shape_failure(self, req: GangRequest, queue: str) -> tuple[Reason, ...] | None:
        """The reasons an earlier request of the same queue, priority and shape failed with
        in this cycle, when `_decide` would say the same for this one: capacity and quota
        only shrank since, and this job holds no allocation and waits for no plan."""
        if not self._same_fail:
            return None
        hit = self._same_fail.get(self._alike(req, queue))
        if hit is None or req.job_id in self._waiting:
            return None
        if (req.job_id, req.attempt) in self._ledger.allocs:
            return None
        return hit

    def _decide(
        self, req: GangRequest, qs: QueueState, now: float, res: CycleResult
    ) -> Placement | tuple[Reason, ...]:
        existing = self._ledger.allocs.get((req.job_id, req.attempt))
        if existing is not None:
            return existing.placement
        snap = self._snap if self._snap is not None else self.snapshot(now)
        prov = self._prov
        claim = prov.claims.get(req.job_id)
        # A claimant's own hold is not subtracted: its searches are memoised apart.
        shape = self._shape_of(req) if claim is None else (*self._shape_of(req), req.job_id)
        got = assign(req, qs, snap, shape)
        if self.spot_waiters.any_active and isinstance(got, Assignment):
            holder = self.spot_waiters.kept_for(req, got.pool)
            if holder is not None:
                got = self._leave_spot(req, qs, snap, got, holder, res)
        if self._provisionable and req.job_id not in self._waiting:
            wait = self._provision(req, qs, snap, got, claim, now, res)
            if wait is not None:
                return wait
        if isinstance(got, Assignment):
            return self.commit(got, now)
        out = got
        gang = snap.gang(req.podsets)
        waiting = self._waiting.get(req.job_id)
        if waiting is not None:
            return (waiting[1], *out)
        if self._plans >= MAX_PLANS_PER_CYCLE or not any(r.code in _PREEMPTIBLE for r in out):
            return out
        pkey = self._alike(req, qs.name)
        if pkey in self._plan_fail:
            return out
        wkey = (qs.name, req.priority)
        worth = self._worth.get(wkey)
        if worth is None:
            worth = self._worth[wkey] = worth_planning(self._book, self._ledger, req, qs)
        if not worth:
            return out
        if self._claims and self._planning_elsewhere(req.job_id, qs):
            return out
        self._plans += 1
        young: list[Alloc] = []
        cands = snap.candidates(req, gang)
        plan = plan_preemption(
            self._inv,
            self._book,
            self._ledger,
            req,
            gang,
            qs,
            cands,
            allow_fallback(req, gang, cands),
            now,
            self._protected(now, young),
        )
        if plan is None:
            self._plan_fail.add(pkey)
            if young:
                return (self._protected_plan(req, young), *out)
            return out
        self._protection.pop(req.job_id, None)
        self._worth.clear()
        self._same_fail.clear()
        keys: set[AllocKey] = set()
        for a in plan.victims:
            self._ledger.set_state(a, a.charged, req.job_id)
            keys.add(a.key)
            if a.queue != req.queue:
                self._reclaimed.add(a.job_id)
        self._claims[req.job_id] = (qs, plan.pool.flavor_class)
        self._hold_free(req.job_id, plan.victims)
        victims = tuple(dict.fromkeys(a.job_id for a in plan.victims))
        reason = Reason(
            "waiting-for-preemption",
            f"ending {len(victims)} job(s) ({plan.kind}) on {plan.pool.cluster}/"
            f"{plan.pool.name} to start this gang",
            cluster=plan.pool.cluster,
            flavor=plan.pool.name,
        )
        self._waiting[req.job_id] = (keys, reason, now + self._wait_s)
        res.preemptions.append(Preemption(req.job_id, victims, plan.pool.key, plan.kind))
        return (reason, *out)

    def _leave_spot(
        self,
        req: GangRequest,
        qs: QueueState,
        snap: Snapshot,
        got: Assignment,
        holder: GangRequest,
        res: CycleResult,
    ) -> Assignment | tuple[Reason, ...]:
        """`got` takes spot that `holder`, an earlier spot-only job, waits for: the best
        on-demand placement instead, or why the job waits for one. The spot stays the job's
        when no on-demand pool could host it (or quota refuses it there)."""
        pool = got.pool
        why = (
            f"skipped spot on {pool.cluster}/{pool.name}: {holder.job_id}, a spot-only job "
            "queued earlier, waits for that capacity"
        )
        on_demand = assign(replace(req, capacity="on-demand"), qs, snap)
        if isinstance(on_demand, Assignment):
            res.spot_held[req.job_id] = f"{why}; took on-demand instead"
            return replace(on_demand, request=req)
        if not any(r.code == "insufficient-capacity" for r in on_demand):
            return got
        res.spot_held[req.job_id] = f"{why}; waits for on-demand"
        held = Reason("spot-held", why, cluster=pool.cluster, flavor=pool.name)
        return (held, *on_demand)

    # -- autoscaled pools (provision.py) ------------------------------------------------

    def _provision(
        self,
        req: GangRequest,
        qs: QueueState,
        snap: Snapshot,
        got: Assignment | Reasons,
        claim: Claim | None,
        now: float,
        res: CycleResult,
    ) -> tuple[Reason, ...] | None:
        """The reasons the job waits for new nodes, or None to take `got` as it is. A gang
        that fits now waits only when the best plan, its wait priced, beats that placement."""
        prov = self._prov
        rest: Reasons = () if isinstance(got, Assignment) else got
        cost_now = 0.0  # of `got`, per unit of work
        if isinstance(got, Assignment):
            speed = speed_of(req.speeds, self._gpu_speeds)(got.pool.gpu_type)
            cost_now = got.placement.expected_cost_per_hour / speed
        if claim is not None and not self._claim_allowed(req, qs, claim):
            prov.end(req.job_id)  # the job no longer takes that pool (a spot fallback)
            claim = None
        if claim is not None:
            if isinstance(got, Assignment) and (
                got.pool.key == claim.pool
                or not prov.still_worth(claim, cost_now, rank_of(req, got.pool, qs), now)
            ):
                return None
            return (claim.reason, *rest)
        gang = snap.gang(req.podsets)
        plan = prov.plan(req, gang, qs, snap, now)
        if plan is None:
            return None
        if isinstance(got, Assignment) and not prov.beats(
            plan, cost_now, rank_of(req, got.pool, qs)
        ):
            return None
        res.provisions.append(prov.claim(req, gang, plan, now))
        if self._same_fail:
            self._same_fail.clear()  # the held GPUs changed what later requests see
        return (prov.claims[req.job_id].reason, *rest)

    def _claim_allowed(self, req: GangRequest, qs: QueueState, claim: Claim) -> bool:
        """Whether the request still accepts the pool it waits on."""
        cluster = self._inv.clusters.get(claim.pool[0])
        pool = cluster.pools.get(claim.pool[1]) if cluster is not None else None
        if pool is None or claim.pool in req.avoid_pools:
            return False
        return rank_of(req, pool, qs)[0] >= 0

    def expire_provisions(self, now: float) -> list[str]:
        """Count arrived nodes, then end claims past their window; returns the jobs whose
        pool stocked out (their next cycle plans them elsewhere)."""
        self._prov.observe(self._inv)
        return [c.job_id for c in self._prov.expire(now)]

    def drop_provision(self, job_id: str) -> None:
        """The job left the queue without being placed (cancelled, failed): its claim ends."""
        self._prov.drop(job_id)

    def provision_claims(self) -> Mapping[str, Claim]:
        return self._prov.claims

    def provision_counts(self) -> tuple[int, int, dict[PoolKey, int]]:
        """Pools asked to grow and stockouts since start, and each pool's nodes still coming
        (for metrics)."""
        prov = self._prov
        coming = {key: prov.promised(key) for key in {c.pool for c in prov.claims.values()}}
        return prov.asks, prov.stockouts_total, coming

    def pool_stockouts(self, pool: PoolKey, now: float) -> float:
        """The pool's decayed count of recent stockouts."""
        return self._prov.penalty(pool, now)

    def _rate_at(self, now: float) -> Callable[[tuple[str, str]], float]:
        """Pool interruption rates at `now`, memoised while `now` and the inventory hold."""
        stamp = (now, self._inv.version)
        if self._rates_at != stamp:
            self._rates.clear()
            self._rates_at = stamp
        rates = self._rates
        inv = self._inv
        prior = self._prior

        def rate_of(key: tuple[str, str]) -> float:
            r = rates.get(key)
            if r is None:
                r = rates[key] = inv.rate(key, now, prior)
            return r

        return rate_of

    def commit(self, a: Assignment, now: float) -> Placement:
        """Apply an assignment: node capacity, the allocation record and the quota charge.
        Refuses one that no longer fits its nodes (made against an older snapshot)."""
        req = a.request
        pool = a.pool
        key = (req.job_id, req.attempt)
        ext = ext_per_node(a.podsets, a.placement.assignment)
        bad = self._inv.ext_short(pool.cluster, ext) if ext else None
        if bad is None:
            bad = self._inv.add_usage_checked(pool.cluster, key, a.per_node)
        if bad is not None:
            raise ValueError(f"stale assignment of {req.job_id}: node {bad} cannot take it")
        if ext:
            self._inv.add_ext(pool.cluster, key, ext)
        fresh = self._snap is not None
        alloc = Alloc(
            key,
            req.queue,
            req.priority,
            req.order,
            a.placement,
            a.per_node,  # built for this assignment alone: it becomes the record's
            a.vec,
            work_since=self._progress.pop(key, now) if self._progress else now,
            fresh=fresh,
            admitted_at=now,
        )
        if fresh:
            self._fresh.append(alloc)
        if pool.key in self._inv.probing:
            self._probe_taken(pool)
        if self._worth:
            self._worth.clear()
        if self._same_fail:
            self._same_fail.clear()
        self._ledger.add(alloc)
        self._book.charge(a.queue, pool.flavor_class, a.vec, 1)
        if ext:
            self._book.charge_ext(a.queue, pool.flavor_class, summed(ext), 1)
        if self._waiting or self._holds or self._claims:
            self._waiting.pop(req.job_id, None)
            self._drop_hold(req.job_id)
        if self._prov.claims:
            self._prov.drop(req.job_id)
        return a.placement

    def _probe_taken(self, pool: Pool) -> None:
        """A half-open pool took its probe: the rest of this cycle places nothing more there
        (the running snapshot's candidate lists drop it); its dispatch then blocks it
        (`PoolHealth.dispatched`) until the probe is decided."""
        if self._snap is None:
            return
        for cands in self._snap.cands.values():
            for group in cands.live:
                if pool in group:
                    group.remove(pool)

    def reserve(
        self,
        request: GangRequest,
        now: float,
        replacing_attempt: int | None = None,
        held: list[str] | None = None,
    ) -> Placement | tuple[Reason, ...]:
        """Place one request now, outside a cycle. With `replacing_attempt` (make-before-break)
        the job's quota charge is handed from that attempt to the new one, and a `Reservation`
        records the handover until one of the two ends. `held` gets why the placement left
        spot to a waiting spot-only job, when it did."""
        existing = self._ledger.allocs.get((request.job_id, request.attempt))
        if existing is not None:
            return existing.placement
        old = None
        if replacing_attempt is not None:
            old = self._ledger.allocs.get((request.job_id, replacing_attempt))
        if old is None or not old.charged:
            got = self._assign_kept(request, now, held)
            return self.commit(got, now) if isinstance(got, Assignment) else got
        self._set_charged(old, False)
        got = self._assign_kept(request, now, held)
        if not isinstance(got, Assignment):
            self._set_charged(old, True)
            return got
        placement = self.commit(got, now)
        self._reservations[request.job_id] = Reservation(
            request.job_id, old.key[1], request.attempt
        )
        return placement

    def _assign_kept(
        self, request: GangRequest, now: float, held: list[str] | None
    ) -> Assignment | Reasons:
        """`assign` for a running job's replacement, keeping the spot that queued spot-only
        jobs of equal or higher priority wait for (spotwait.py): a job that may run on
        on-demand is reserved on-demand instead, or nothing while on-demand is full (it is
        requeued at the break and a cycle decides)."""
        got = self.assign(request, now)
        if not self.spot_waiters.any_active or not isinstance(got, Assignment):
            return got
        holder = self.spot_waiters.kept_for(request, got.pool, running=True)
        qs = self._book.queues.get(request.queue)
        if holder is None or qs is None:
            return got
        snap = self._snap if self._snap is not None else self.snapshot(now)
        res = CycleResult()
        out = self._leave_spot(request, qs, snap, got, holder, res)
        if held is not None and request.job_id in res.spot_held:
            held.append(res.spot_held[request.job_id])
        return out

    def _set_charged(self, a: Alloc, charged: bool) -> None:
        if a.charged == charged:
            return
        qs = self._book.queues.get(a.queue)
        if qs is not None:
            self._book.charge(qs, a.flavor_class, a.vec, 1 if charged else -1)
            ext = self._inv.ext_held(a.cluster, a.key, a.per_node)
            if ext:
                self._book.charge_ext(qs, a.flavor_class, ext, 1 if charged else -1)
        self._ledger.set_state(a, charged, a.doomed_by)

    def spot_pools_for(self, waiter: GangRequest, gang: Gang) -> list[Pool]:
        """The spot pools of schedulable clusters a queued spot-only job waits for: of a GPU
        type it accepts, not avoided, able to host its gang empty."""
        return [
            p
            for c in self._inv.clusters.values()
            if c.schedulable
            for p in c.pools.values()
            if p.capacity_type == "spot"
            and p.key not in waiter.avoid_pools
            and gpu_type_ok(p, waiter.gpu_types, gang.total[0])
            and empty_fit(p, gang)
        ]

    def job_speed(self, request: GangRequest) -> Callable[[str], float]:
        """The job's relative speed per GPU type (speed.py): its own figures, else the priors."""
        return speed_of(request.speeds, self._gpu_speeds)

    def allocations_on(self, pool: PoolKey) -> list[Alloc]:
        """The allocations whose GPU podsets sit in `pool`."""
        return [
            a for by_key in self._ledger.by_pool.get(pool, {}).values() for a in by_key.values()
        ]

    def reservations(self) -> dict[str, Reservation]:
        """job_id -> its make-before-break reservation (a view for checks)."""
        return dict(self._reservations)

    def assume(self, request: GangRequest, placement: Placement) -> None:
        key = (request.job_id, request.attempt)
        if key in self._ledger.allocs:
            return
        demands = {d.podset: d for d in request.podsets}
        for podset, nodes in placement.assignment:
            d = demands.get(podset)
            # A partially admitted podset runs with fewer replicas, never below its minimum.
            if d is None or not (
                request.min_replicas.get(podset, d.replicas) <= len(nodes) <= d.replicas
            ):
                raise ValueError(
                    f"placement of {request.job_id} does not match its podsets at {podset!r}"
                )
        per_node, vec = _usage(demands, placement.assignment)
        self._inv.add_usage(placement.cluster, key, per_node)
        ext = ext_per_node(request.podsets, placement.assignment)
        if ext:
            self._inv.add_ext(placement.cluster, key, ext)
        qs = self._book.queues.get(request.queue)
        # A job holds quota once: a restored make-before-break pair is a reservation, and
        # the newer attempt holds the charge.
        charged = qs is not None
        for other in list(self._ledger.by_job.get(request.job_id, {}).values()):
            older, newer = sorted((other.key[1], request.attempt))
            self._reservations[request.job_id] = Reservation(request.job_id, older, newer)
            if not other.charged:
                continue
            if other.key[1] > request.attempt:
                charged = False
            else:
                self._set_charged(other, False)
        alloc = Alloc(
            key,
            request.queue,
            request.priority,
            request.order,
            placement,
            per_node,
            vec,
            charged=charged,
            work_since=self._progress.pop(key, None),
        )
        self._ledger.add(alloc)
        if charged and qs is not None:
            self._book.charge(qs, placement.flavor_class, vec, 1)
            if ext:
                self._book.charge_ext(qs, placement.flavor_class, summed(ext), 1)

    def release(self, job_id: str, attempt: int) -> None:
        key = (job_id, attempt)
        self._progress.pop(key, None)
        a = self._ledger.remove(key)
        if a is None:
            return
        ext = self._inv.ext_held(a.cluster, key, a.per_node)
        self._inv.remove_ext(a.cluster, key, a.per_node)
        self._inv.remove_usage(a.cluster, key, a.per_node)
        if a.charged:
            qs = self._book.queues.get(a.queue)
            if qs is not None:
                self._book.charge(qs, a.flavor_class, a.vec, -1)
                if ext:
                    self._book.charge_ext(qs, a.flavor_class, ext, -1)
        res = self._reservations.get(job_id)
        if res is not None and attempt in (res.replaced, res.replacement):
            del self._reservations[job_id]
            if attempt == res.replacement and a.charged:
                # The replacement ended first: the attempt it replaced holds the quota again.
                back = self._ledger.allocs.get((job_id, res.replaced))
                if back is not None:
                    self._set_charged(back, True)
        if a.doomed_by is None:
            self._inputs_changed()  # a job ended on its own or was lost: not our eviction
            return
        w = self._waiting.get(a.doomed_by)
        if w is not None:
            w[0].discard(key)
            self._hold(a.doomed_by, a.cluster, a.per_node)
            if not w[0]:
                del self._waiting[a.doomed_by]

    def shrink(self, job_id: str, attempt: int, node: str) -> bool:
        """An elastic gang lost its replicas on `node` and runs on: give that node's share
        back (node capacity and quota) and keep the rest of the allocation. False, changing
        nothing, when the attempt holds nothing there or is mid-move (a victim, or a
        make-before-break reservation)."""
        key = (job_id, attempt)
        a = self._ledger.allocs.get(key)
        if a is None or node not in a.per_node or a.doomed_by is not None:
            return False
        if job_id in self._reservations:
            return False
        taken = a.per_node[node]
        self._ledger.remove(key)
        ext = self._inv.ext_held(a.cluster, key, (node,))
        self._inv.remove_ext(a.cluster, key, (node,))
        self._inv.remove_usage(a.cluster, key, {node: taken})
        qs = self._book.queues.get(a.queue)
        if a.charged and qs is not None:
            self._book.charge(qs, a.flavor_class, taken, -1)
            if ext:
                self._book.charge_ext(qs, a.flavor_class, ext, -1)
        a.per_node = {n: v for n, v in a.per_node.items() if n != node}
        a.vec = (a.vec[0] - taken[0], a.vec[1] - taken[1], a.vec[2] - taken[2])
        a.placement = without_node_placement(a.placement, node)
        self._ledger.add(a)
        self._inputs_changed()
        return True

    def settle(self, request: GangRequest, running: Placement) -> bool:
        """The attempt runs on `running` (a part of what it holds: a growth its workload
        refused): its allocation, node usage and quota charge become exactly those of
        `running`. False, changing nothing, when it is not held or is mid-move."""
        key = (request.job_id, request.attempt)
        old = self._ledger.allocs.get(key)
        if old is None or old.doomed_by is not None or request.job_id in self._reservations:
            return False
        per_node, vec = _usage({d.podset: d for d in request.podsets}, running.assignment)
        ext = ext_per_node(request.podsets, running.assignment)
        held = self._inv.ext_held(old.cluster, key, old.per_node)
        self._ledger.remove(key)
        self._inv.remove_ext(old.cluster, key, old.per_node)
        self._inv.remove_usage(old.cluster, key, old.per_node)
        self._inv.add_usage(old.cluster, key, per_node)
        if ext:
            self._inv.add_ext(old.cluster, key, ext)
        qs = self._book.queues.get(old.queue)
        if old.charged and qs is not None:
            self._book.charge(qs, old.flavor_class, old.vec, -1)
            self._book.charge(qs, old.flavor_class, vec, 1)
            if held:
                self._book.charge_ext(qs, old.flavor_class, held, -1)
            if ext:
                self._book.charge_ext(qs, old.flavor_class, summed(ext), 1)
        old.per_node = per_node
        old.vec = vec
        old.placement = replace(old.placement, assignment=running.assignment)
        self._ledger.add(old)
        self._inputs_changed()
        return True

    def grow(self, extra: GangRequest, now: float) -> Placement | None:
        """Add the replicas `extra` asks for (the most that fit, at least its minimum) to the
        running allocation of `(extra.job_id, extra.attempt)`, in the pool it runs in: node
        capacity and quota are checked as for an admission, and the allocation grows by
        what they took. The placement of the added replicas, or None (nothing changed)."""
        key = (extra.job_id, extra.attempt)
        old = self._ledger.allocs.get(key)
        if old is None or old.doomed_by is not None or extra.job_id in self._reservations:
            return None
        others = frozenset(p.key for p in self._inv.pools() if p.key != old.pool)
        got = None
        for need in self._growth_needs(old, extra.topology):
            got = self.assign(replace(extra, avoid_pools=others, topology=need), now)
            if isinstance(got, Assignment):
                break
        if not isinstance(got, Assignment):
            return None
        merged = dict(old.per_node)
        for name, v in got.per_node.items():
            have = merged.get(name, (0, 0, 0))
            merged[name] = (have[0] + v[0], have[1] + v[1], have[2] + v[2])
        self._ledger.remove(key)
        self._inv.remove_usage(old.cluster, key, old.per_node)
        bad = self._inv.add_usage_checked(old.cluster, key, merged)
        if bad is not None:  # cannot happen: the search counted the old usage as taken
            self._inv.add_usage_checked(old.cluster, key, old.per_node)
            self._ledger.add(old)
            return None
        ext = ext_per_node(got.podsets, got.placement.assignment)
        if ext:
            self._inv.add_ext(old.cluster, key, ext)
        qs = self._book.queues.get(old.queue)
        if old.charged and qs is not None:
            self._book.charge(qs, old.flavor_class, got.vec, 1)
            if ext:
                self._book.charge_ext(qs, old.flavor_class, summed(ext), 1)
        old.per_node = merged
        old.vec = (old.vec[0] + got.vec[0], old.vec[1] + got.vec[1], old.vec[2] + got.vec[2])
        old.placement = with_placement(old.placement, got.placement)
        self._ledger.add(old)
        self._inputs_changed()
        return got.placement

    def _growth_needs(self, alloc: Alloc, need: TopologyNeed | None) -> list[TopologyNeed | None]:
        """The topology of each growth search, first to last: within the running gang's own
        domain, then coarser ones down to the level it must stay within
        (`topology.growth_domains`), so a lost node is replaced beside the others."""
        c = self._inv.clusters.get(alloc.cluster)
        pool = c.pools.get(alloc.pool[1]) if c is not None else None
        if c is None or pool is None or not pool.levels:
            return [None]
        gpu_nodes = [c.nodes[n] for n, v in alloc.per_node.items() if v[0] > 0 and n in c.nodes]
        return [
            TopologyNeed(within=path) if path else TopologyNeed(spread=True)
            for path in growth_domains(pool, gpu_nodes, need)
        ]

    def note_progress(self, job_id: str, attempt: int, work_since: float) -> None:
        a = self._ledger.allocs.get((job_id, attempt))
        if a is not None:
            a.work_since = work_since
        else:
            self._progress[(job_id, attempt)] = work_since

    def check_feasible(self, request: GangRequest) -> tuple[Reason, ...]:
        """Could the gang ever start? Under partial admission, judged at its minimum.
        Asked once per submission: answered from a memo while the inventory is unchanged."""
        version = self._inv.version
        if version != self._feas_at:
            self._feas.clear()
            self._feas_at = version
        key = (request.queue, self._shape_of(request))
        hit = self._feas.get(key)
        if hit is None:
            if len(self._feas) >= _GANG_CACHE_MAX:
                self._feas.clear()
            hit = self._feas[key] = self.check_feasible_fresh(request)
        return hit

    def check_feasible_fresh(self, request: GangRequest) -> tuple[Reason, ...]:
        """`check_feasible` computed from scratch (what its memo must agree with)."""
        gang = self._gang(least_podsets(request))
        return feasibility(self._inv, request, gang) or self._quota_feasibility(request, gang)

    def _quota_feasibility(self, request: GangRequest, gang: Gang) -> tuple[Reason, ...]:
        """A gang larger than nominal + borrowing limit in every flavor class the job could be
        charged to can never be admitted (Kueue marks such workloads inadmissible)."""
        qs = self._book.queues.get(request.queue)
        if qs is None or qs.limits is None:
            return ()
        classes = {fc.name: fc for fc in self.config.flavors}
        types = {t.lower() for t in request.gpu_types}
        accepted = []
        for cls in qs.limits:
            fc = classes.get(cls)
            if fc is not None:
                typed = fc.gpu_type is not None and bool(types) and gang.total[0] > 0
                if typed and (fc.gpu_type or "").lower() not in types:
                    continue
                if fc.capacity_type is not None and (
                    capacity_rank(request.capacity, False, fc.capacity_type) < 0
                ):
                    continue
            accepted.append(cls)
        text = never_admissible(qs, accepted, gang.total)
        return () if text is None else (Reason("quota-exceeded", text),)

    def work_prices(self, request: GangRequest, now: float) -> list[WorkPrice]:
        """The pools that may host the job, best first, with their expected cost per hour
        and the job's relative speed there (`muster why`: $ per unit of work)."""
        gpus = self._gang(request.podsets).total[0]
        speed = speed_of(request.speeds, self._gpu_speeds)
        rate_of = self._rate_at(now)
        cands = build_candidates(self._inv, request, gpus, rate_of, self._risk_weight, (), speed)
        out: list[WorkPrice] = []
        for group in cands.groups:
            for p in group:
                nodes = max(1, -(-gpus // (p.node_gpu or 1)))
                cost = pool_cost(p, request, gpus, nodes, rate_of, self._risk_weight)
                survives = checkpoint_survival(
                    request.checkpoint_interval_s, rate_of(p.key) * nodes
                )
                out.append(
                    WorkPrice(p.cluster, p.name, p.gpu_type, cost, speed(p.gpu_type), survives)
                )
        return out

    def pool_reasons(self, request: GangRequest) -> tuple[Reason, ...]:
        """Per cluster x flavor, what keeps this job off it now (`muster why`)."""
        return pool_reasons(self._inv, self._book, request, self._gang(request.podsets))


def _usage(
    demands: Mapping[str, PodSetDemand], assignment: Iterable[tuple[str, Sequence[str]]]
) -> tuple[dict[str, Vec], Vec]:
    """What a placement's replicas take on each node, and in all."""
    per_node: dict[str, Vec] = {}
    for podset, nodes in assignment:
        d = demands[podset]
        for name in nodes:
            g, c, m = per_node.get(name, (0, 0, 0))
            per_node[name] = (g + d.gpu, c + d.cpu_milli, m + d.memory)
    vec = (
        sum(v[0] for v in per_node.values()),
        sum(v[1] for v in per_node.values()),
        sum(v[2] for v in per_node.values()),
    )
    return per_node, vec
