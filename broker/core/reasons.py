"""Why a gang is not admitted: typed reasons from what one placement search saw.

Order and rules: `no-clusters` (nothing reported yet), `no-matching-flavor` (no pool offers the
GPU types and capacity type), `cluster-unhealthy` (every matching pool is in a cluster that takes
no placements, or behind an open dispatch breaker: then `circuit-open` per such pool follows) end
the list alone. Otherwise, in this order: `pool-avoided` when an avoided
pool would fit now; `quota-exceeded` / `cohort-exhausted` per failing code (flavor = the
flavor class); then up to `MAX_TOPOLOGY_REASONS` `topology-unfit` (a pool whose free GPUs
would take the gang, but no single domain of the level it needs, with the numbers: "needs 64
GPUs in one block; largest free block has 40"); then, when capacity was the problem
somewhere, `insufficient-capacity` if some considered pool could host the gang when empty
(naming a fabric resource no node has enough of free, with the numbers), else
`gang-too-large`; and a trailing `cluster-unhealthy` when some matching pools sit in
unschedulable clusters, and one `circuit-open` per matching pool whose dispatch breaker is
open (health.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from broker.core.inventory import Inventory, Pool
from broker.core.placement import (
    Candidates,
    Gang,
    capacity_rank,
    cluster_empty_fit_cpu,
    empty_fit,
    gpu_type_ok,
)
from broker.core.quota import QuotaMiss
from broker.core.topology import largest_domain
from broker.core.types import GangRequest, Reason, ReasonCode
from schemas.api import PendingReason, ReasonBound

MAX_TOPOLOGY_REASONS = 3  # `topology-unfit` reasons kept (one per pool, cheapest pools first)


def describe(gang: Gang) -> str:
    parts = [f"{d.replicas}x{d.gpu} GPU ({d.podset})" for d in gang.demands if d.replicas]
    return " + ".join(parts) or "nothing"


def _no_matching(req: GangRequest) -> Reason:
    types = ", ".join(sorted(req.gpu_types)) or "any GPU type"
    return Reason(
        "no-matching-flavor", f"no flavor offers {types} with capacity preference {req.capacity}"
    )


def _too_large(gang: Gang) -> Reason:
    return Reason(
        "gang-too-large", f"{describe(gang)} does not fit any matching pool even when empty"
    )


def _reported(inv: Inventory) -> bool:
    return any(c.seen and c.pools for c in inv.clusters.values())


def explain(
    inv: Inventory,
    req: GangRequest,
    gang: Gang,
    cands: Candidates,
    quota_fail: Mapping[ReasonCode, tuple[QuotaMiss, str]],
    avoided: Sequence[Pool],
    allow_fallback: bool | None,
    capacity_failed: bool,
    fits_now: Callable[[Pool], bool],
    topology: Sequence[Reason] = (),
) -> tuple[Reason, ...]:
    """Reasons for a failed search (see the module docstring)."""
    if not _reported(inv):
        return (Reason("no-clusters", "no cluster has reported its nodes yet"),)
    if cands.matching == 0:
        return (_no_matching(req),)
    if cands.unhealthy + len(cands.blocked) == cands.matching:
        return (
            Reason(
                "cluster-unhealthy",
                f"all {cands.matching} matching pools are in clusters that take no placements now",
            ),
            *_circuit_open(inv, cands),
        )
    reasons: list[Reason] = []
    if avoided:
        fit = next((p for p in avoided if fits_now(p)), None)
        if fit is not None:
            reasons.append(
                Reason(
                    "pool-avoided",
                    "only the pool that just lost this job fits; it is avoided for this attempt",
                    cluster=fit.cluster,
                    flavor=fit.name,
                )
            )
    for code, (miss, cls) in quota_fail.items():
        reasons.append(Reason(code, miss.message, flavor=cls, bound=miss.bound))
    considered = [
        p
        for gi, g in enumerate(cands.groups)
        if cands.ranks[gi] == 0 or allow_fallback
        for p in g
        if p.key not in req.avoid_pools
    ]
    reasons.extend(topology[:MAX_TOPOLOGY_REASONS])
    if capacity_failed or not considered:
        clusters = inv.clusters
        if any(
            empty_fit(p, gang) and cluster_empty_fit_cpu(clusters[p.cluster], gang)
            for p in (considered or avoided)
        ):
            waits = allow_fallback is False
            kind = "on-demand" if req.capacity == "any" else "spot"
            reasons.append(
                Reason(
                    "insufficient-capacity",
                    f"no {kind + ' ' if waits else ''}pool has free nodes for {describe(gang)} "
                    f"now (per-node packing{f', waiting for {kind} capacity' if waits else ''})"
                    + (
                        ": the job writes no checkpoint, so it does not go to spot (give it a "
                        "checkpoint, capacity spot-then-on-demand, or label muster.dev/spot-ok)"
                        if waits and kind == "on-demand"
                        else ""
                    )
                    + _fabric_short(considered or avoided, gang),
                )
            )
        else:
            reasons.append(_too_large(gang))
    if cands.unhealthy:
        reasons.append(
            Reason(
                "cluster-unhealthy",
                f"{cands.unhealthy} matching pools are in clusters that take no placements now",
            )
        )
    reasons.extend(_circuit_open(inv, cands))
    return tuple(reasons)


def _fabric_short(pools: Sequence[Pool], gang: Gang) -> str:
    """The first fabric resource a replica asks for that no schedulable node of `pools` has
    free, with the numbers; "" when each is free somewhere (the packing as a whole failed)."""
    for d in gang.demands:
        for res, amount in d.extended if d.replicas else ():
            most = max(
                (n.ext_free(res) for p in pools for n in p.nodes.values() if n.schedulable),
                default=0,
            )
            if most < amount:
                return (
                    f"; {d.podset} needs {amount} {res} per replica, and the most free on one "
                    f"node is {max(most, 0)}"
                )
    return ""


def _circuit_open(inv: Inventory, cands: Candidates) -> list[Reason]:
    return [
        Reason("circuit-open", inv.blocked.get(p.key, ""), cluster=p.cluster, flavor=p.name)
        for p in cands.blocked
    ]


def feasibility(inv: Inventory, req: GangRequest, gang: Gang) -> tuple[Reason, ...]:
    """Empty when some known pool could ever host the gang (its nodes empty), or when no
    cluster has reported yet (nothing to judge by); avoidance and health are ignored."""
    if not _reported(inv):
        return ()
    gpus = gang.total[0]
    matching = [
        (c, p)
        for c in inv.clusters.values()
        if c.seen
        for p in c.pools.values()
        if gpu_type_ok(p, req.gpu_types, gpus)
        and capacity_rank(req.capacity, req.spot_exhausted, p.capacity_type, req.spot_ok) >= 0
    ]
    if not matching:
        return (_no_matching(req),)
    fitting = [(c, p) for c, p in matching if empty_fit(p, gang) and cluster_empty_fit_cpu(c, gang)]
    if not fitting:
        return (_too_large(gang),)
    tight = [largest_domain(p, gang, req) for _, p in fitting]
    if not all(tight):
        return ()
    level, most = max((t for t in tight if t is not None), key=lambda t: t[1])
    return (
        Reason(
            "topology-unfit",
            f"needs {gang.total[0]} GPUs in one {level}, and no matching pool has a {level} "
            f"that large even when empty (the largest holds {most}); require a coarser level "
            "or set topology.spread",
        ),
    )


def pending_reason(r: Reason) -> PendingReason:
    """A core reason as the API shows it (cpu in cores, as `muster queues` shows it)."""
    bound = None
    if r.bound is not None:
        scale = 1000.0 if r.bound.resource == "cpu" else 1.0
        b = r.bound
        bound = ReasonBound(b.resource, b.used / scale, b.needed / scale, b.limit / scale)
    return PendingReason(
        code=r.code, message=r.message, cluster=r.cluster, flavor=r.flavor, bound=bound
    )
