"""Why one job does not start, per cluster x flavor: the binding constraint with its numbers.

Computed on demand (`muster why`), never in the admission cycle, so it may look at every pool.
Each pool gets one Reason, the first that binds in the order admission checks them: GPU type,
capacity type, cluster health, the pool's dispatch breaker (health.py), avoidance, quota, then
capacity (ever, then now). On a pool with topology levels, capacity is the gang's one domain
(topology.py): enough free GPUs spread over several blocks is `topology-unfit` with the
numbers ("needs 64 GPUs in one block; largest free block has 40"), never `fits-now`.
"""

from __future__ import annotations

from broker.core.inventory import Cluster, Inventory, Pool
from broker.core.placement import Gang, capacity_rank, empty_fit, fits_now, gpu_type_ok
from broker.core.quota import QueueState, QuotaBook, binding_quota
from broker.core.reasons import describe
from broker.core.topology import applies, largest_domain, place
from broker.core.types import Bound, GangRequest, Reason, ReasonCode


def _pool_reason(
    inv: Inventory,
    c: Cluster,
    p: Pool,
    req: GangRequest,
    gang: Gang,
    book: QuotaBook,
    qs: QueueState | None,
) -> Reason:
    def r(code: ReasonCode, message: str, bound: Bound | None = None) -> Reason:
        return Reason(code, message, cluster=c.name, flavor=p.name, bound=bound)

    gpus = gang.total[0]
    if not gpu_type_ok(p, req.gpu_types, gpus):
        return r(
            "no-matching-flavor",
            f"no {p.gpu_type.upper() or 'untyped GPU'} accepted "
            f"(the job accepts {', '.join(sorted(req.gpu_types))})",
        )
    rank = capacity_rank(req.capacity, req.spot_exhausted, p.capacity_type, req.spot_ok)
    if rank < 0:
        return r("no-matching-flavor", f"{p.capacity_type} not accepted (capacity {req.capacity})")
    if not c.schedulable:
        return r("cluster-unhealthy", f"cluster {c.name} takes no placements now")
    breaker = inv.blocked.get(p.key)
    if breaker is not None:
        return r("circuit-open", breaker)
    if p.key in req.avoid_pools:
        return r("pool-avoided", "this pool just lost the job; avoided for this attempt")
    if qs is not None:
        binding = binding_quota(book, qs, p.flavor_class, gang.total)
        if binding is not None:
            return r("quota-exceeded", binding.message, binding.bound)
    if not empty_fit(p, gang):
        return r(
            "gang-too-large",
            f"{describe(gang)} never fits: {len(p.nodes)} nodes of at most {p.node_gpu} GPUs",
        )
    note = ""
    if p.levels and applies(req, gang):
        got = place(c, p, gang, req)
        if isinstance(got, Reason):
            return _topology_unfit(p, gang, req, got)
        fits = got is not None
        note = f"; {got.note}" if got is not None and got.note else ""
    else:
        fits = fits_now(c, p, gang, req)
    if not fits:
        total = sum(n.usable_gpu for n in p.nodes.values())
        return r(
            "insufficient-capacity",
            f"{p.free_gpu} GPUs free on {len(p.nodes)} nodes; needs {describe(gang)}, "
            f"each replica on one node{_closed(p)}",
            Bound("gpu", total - p.free_gpu, gpus, total),
        )
    if rank == 1:
        return r(
            "spot-first",
            "fits, but the job takes on-demand only after spot fails (spot fallback settings)",
        )
    return r("fits-now", f"fits now ({p.free_gpu} GPUs free){note}; next admission cycle")


def _topology_unfit(p: Pool, gang: Gang, req: GangRequest, now: Reason) -> Reason:
    """The pool's topology refusal, said as never when no domain of the level could hold the
    gang even empty (waiting does not help there)."""
    never = largest_domain(p, gang, req)
    if never is None or not never[1]:
        return now
    level, most = never
    return Reason(
        "topology-unfit",
        f"needs {gang.total[0]} GPUs in one {level}, and no {level} here holds that many even "
        f"when empty (the largest holds {most}); require a coarser level or set topology.spread",
        cluster=p.cluster,
        flavor=p.name,
    )


def _closed(p: Pool) -> str:
    """Why some of the pool's nodes take nothing now, so a waiting job's reason does not read
    as a full pool when an operator closed the nodes."""
    cordoned = sum(1 for n in p.nodes.values() if n.no_new_pods)
    noticed = sum(1 for n in p.nodes.values() if n.spot_deadline is not None)
    notes = []
    if cordoned:
        notes.append(f"{cordoned} cordoned or draining")
    if noticed:
        notes.append(f"{noticed} under a spot notice")
    return f" ({', '.join(notes)}: no new gangs there)" if notes else ""


def pool_reasons(
    inv: Inventory, book: QuotaBook, req: GangRequest, gang: Gang
) -> tuple[Reason, ...]:
    """One Reason per known cluster x flavor, sorted by cluster and flavor."""
    qs = book.queues.get(req.queue)
    out: list[Reason] = []
    for cname in sorted(inv.clusters):
        c = inv.clusters[cname]
        if not c.seen:
            continue
        for fname in sorted(c.pools):
            out.append(_pool_reason(inv, c, c.pools[fname], req, gang, book, qs))
    return tuple(out)
