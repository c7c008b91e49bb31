"""Elastic gangs: podsets that run with any count between their minimum and maximum.

A podset with `max_replicas` (TorchElastic's `--nnodes=min:max`, Volcano's `minAvailable`,
Kueue's elastic jobs) is asked for at its maximum; `assign` admits the most that fits, at least
the minimum (the partial-admission search), and this module words that choice. While the job
runs, a spot notice or a lost node that leaves every podset at or above its minimum removes
only the replicas on that node (`without_node`, `Scheduler.shrink`); below it the whole gang
moves as before. Growth back towards the maximum stays in the same pool (`growth`,
`Scheduler.grow`): elastic workers share one rendezvous and one fabric. On a pool with
topology levels it goes first into the finest domain the running replicas share, then coarser
ones down to the level the gang must stay within (one zone by default, its required level):
a lost node is replaced beside the others rather than the gang moved
(`topology.growth_domains`, Kueue's `nodeToReplace` idea). The lifecycle
(`AttemptLifecycle.shrink_in_place`, `grow_elastic`, `give_back_growth`) drives both.

A shrink is priced (`shrink_or_move`): over the next `HORIZON_S` the shrunk gang runs at its
throughput at the smaller size, while a move runs at its new size after a restart and first
redoes the work since its last checkpoint; the move wins only when a whole-gang placement
exists now elsewhere and it does more work over the horizon.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import replace
from itertools import pairwise
from typing import NamedTuple

from broker.core.inventory import Pool
from broker.core.records import JobRecord
from broker.core.types import GangRequest, Placement, PodSetDemand
from schemas.agent import PodSetAssignment
from schemas.job import JobSpec, PodSet

# An elastic attempt whose pool had no room tries to grow again after this (s), or as soon as
# nodes arrive: each try searches the pool, so a shrunk gang does not search every tick.
GROW_RETRY_S = 5.0
# Without a declared throughput each replica past the first adds this share of one replica's
# throughput (linear scaling at 90% efficiency, what data-parallel training typically keeps
# over a shared fabric).
SCALING_EFFICIENCY = 0.9
# How far ahead "shrink and continue" and "move whole" are compared (s): about as long as a
# shrunk gang runs before its pool has room to grow it back, or the next reclaim.
HORIZON_S = 3600.0
# What a move costs beyond restoring the checkpoint (s): dispatch, image pull, rendezvous.
MOVE_START_S = 120.0


class Priced(NamedTuple):
    """The choice between shrinking in place and moving the whole gang, and why."""

    shrink: bool
    reason: str


def admission_note(
    req: GangRequest, admitted: tuple[PodSetDemand, ...], placement: Placement, pool: Pool | None
) -> str:
    """ "admitted 4 of 8 worker replicas (min 2): spot-east/a100-spot has room for 4 on 4
    free A100 nodes", one clause per elastic podset that got fewer than its maximum."""
    got = {d.podset: d.replicas for d in admitted}
    parts = [
        f"{got.get(d.podset, 0)} of {d.replicas} {d.podset} replicas "
        f"(min {req.min_replicas.get(d.podset, d.replicas)})"
        for d in req.podsets
        if d.podset in req.elastic and got.get(d.podset, 0) < d.replicas
    ]
    nodes = len({n for ps, ns in placement.assignment if ps in req.elastic for n in ns})
    gpu = f" {pool.info.gpu_type}" if pool is not None and pool.info.gpu_type else ""
    took = sum(got.get(ps, 0) for ps in req.elastic)
    where = f"{placement.cluster}/{placement.flavor} has room for {took} on {nodes} free{gpu} "
    return f"admitted {', '.join(parts)}: {where}{'node' if nodes == 1 else 'nodes'} now"


def size_text(
    spec: JobSpec, assignment: Iterable[PodSetAssignment], grow_refused: bool = False
) -> str:
    """The current and target size of each elastic podset of a placed job: "worker runs 4 of
    8 replicas (min 2; grows back when its pool has room)" (`muster why`'s reason `[elastic]`,
    `JobView.size`); with `grow_refused`, that it stays at its size (the reason
    `[grow-refused]` says why)."""
    now = {a.podset: len(a.nodes) for a in assignment}
    grows = (
        "; stays: its cluster cannot grow it in place"
        if grow_refused
        else "; grows back when its pool has room"
    )
    parts = []
    for p in spec.gang:
        if p.elastic:
            have = now.get(p.name, 0)
            tail = grows if have < p.most else ""
            parts.append(f"{p.name} runs {have} of {p.most} replicas (min {p.least}{tail})")
    return ", ".join(parts)


def without_node(
    spec: JobSpec, assignment: Iterable[PodSetAssignment], node: str
) -> list[PodSetAssignment] | None:
    """The assignment once the replicas on `node` are gone, when every podset stays at or
    above its minimum and only elastic podsets lose replicas; None when the gang must move
    whole (or has nothing on the node)."""
    podsets = {p.name: p for p in spec.gang}
    kept: list[PodSetAssignment] = []
    lost = False
    for a in assignment:
        rest = [n for n in a.nodes if n != node]
        if len(rest) < len(a.nodes):
            ps = podsets.get(a.podset)
            if ps is None or not ps.elastic or len(rest) < ps.least:
                return None
            lost = True
        kept.append(PodSetAssignment(podset=a.podset, nodes=rest))
    return kept if lost else None


def shrink_text(before: Iterable[PodSetAssignment], after: Iterable[PodSetAssignment]) -> str:
    """ "worker 4 -> 3" for each podset whose count changed."""
    was = {a.podset: len(a.nodes) for a in before}
    return ", ".join(
        f"{a.podset} {was.get(a.podset, 0)} -> {len(a.nodes)}"
        for a in after
        if was.get(a.podset, 0) != len(a.nodes)
    )


def without_node_placement(placement: Placement, node: str) -> Placement:
    """The placement without its replicas on `node` (a shrink in place)."""
    kept = tuple((ps, tuple(n for n in nodes if n != node)) for ps, nodes in placement.assignment)
    return replace(placement, assignment=kept)


def with_placement(placement: Placement, more: Placement) -> Placement:
    """The placement with the replicas of `more` (a growth in the same pool) appended."""
    extra = dict(more.assignment)
    kept = tuple((ps, nodes + extra.pop(ps, ())) for ps, nodes in placement.assignment)
    return replace(placement, assignment=kept + tuple(extra.items()))


def growth(
    req: GangRequest, spec: JobSpec, running: Iterable[PodSetAssignment]
) -> GangRequest | None:
    """The request for what an elastic attempt lacks of its maximum: one podset demand per
    elastic podset below it, each taking at least one replica; None when it is whole. Its
    `topology` is the gang's: `Scheduler.grow` keeps the added replicas in the gang's domain."""
    have = {a.podset: len(a.nodes) for a in running}
    most = {p.name: p.most for p in spec.gang if p.elastic}
    lack = tuple(
        d._replace(replicas=most[d.podset] - have.get(d.podset, 0))
        for d in req.podsets
        if d.podset in most and have.get(d.podset, 0) < most[d.podset]
    )
    if not lack:
        return None
    return replace(
        req,
        podsets=lack,
        min_replicas={d.podset: 1 for d in lack if d.replicas > 1},
        elastic=frozenset(),
    )


def only_grew(before: Iterable[PodSetAssignment], after: Iterable[PodSetAssignment]) -> bool:
    """Whether `after` holds every replica of `before` (the same node, as often), and more:
    a revision from `before` to `after` only added replicas, so refusing it leaves the
    workload running whole at `before`."""
    had = Counter((a.podset, n) for a in before for n in a.nodes)
    has = Counter((a.podset, n) for a in after for n in a.nodes)
    return had < has


def refused_growth_text(cluster: str, error: str) -> str:
    """ "cluster spot-east cannot grow RayJob r-a1 in place: <why>", from the agent's refusal
    ("cannot resize in place: RayJob r-a1: <why>")."""
    detail = error.removeprefix("cannot resize in place: ")
    what, sep, why = detail.partition(": ")
    if not sep:
        return f"cluster {cluster} cannot grow the workload in place: {detail}"
    return f"cluster {cluster} cannot grow {what} in place: {why}"


def grown(running: Iterable[PodSetAssignment], more: Placement) -> list[PodSetAssignment]:
    """The attempt's assignment with the added replicas' nodes appended."""
    extra = {ps: list(nodes) for ps, nodes in more.assignment}
    return [
        PodSetAssignment(podset=a.podset, nodes=[*a.nodes, *extra.get(a.podset, [])])
        for a in running
    ]


def short(spec: JobSpec, running: Iterable[PodSetAssignment]) -> bool:
    """Whether some elastic podset runs below its maximum. Asked at every admission, and
    most gangs have no elastic podset: those are answered without counting nodes."""
    for p in spec.gang:
        if p.elastic:
            break
    else:
        return False
    elastic = [p for p in spec.gang if p.elastic]
    have = {a.podset: len(a.nodes) for a in running}
    return any(have.get(p.name, 0) < p.most for p in elastic)


def queued_top(pending: Mapping[str, Iterable[str]], jobs: Mapping[str, JobRecord]) -> int | None:
    """The highest priority of a queued job: each queue iterates in admission order, highest
    priority first, so its head has its highest."""
    heads = [h for q in pending.values() if (h := next(iter(q), "")) in jobs]
    return max((jobs[h].spec.priority for h in heads), default=None)


def throughput(podset: PodSet, count: int) -> float:
    """The podset's throughput at `count` replicas: its declared figures (interpolated
    between declared counts, proportional beyond them), else linear scaling at
    `SCALING_EFFICIENCY`."""
    points = sorted((podset.throughput or {}).items())
    if not points:
        return 1.0 + (count - 1) * SCALING_EFFICIENCY if count > 0 else 0.0
    if count <= points[0][0]:
        return points[0][1] * count / points[0][0]
    if count >= points[-1][0]:
        return points[-1][1] * count / points[-1][0]
    for (lo, at_lo), (hi, at_hi) in pairwise(points):
        if lo <= count <= hi:
            return at_lo + (at_hi - at_lo) * (count - lo) / (hi - lo)
    return 0.0  # unreachable: count lies between the first and last declared counts


def speed(spec: JobSpec, counts: Mapping[str, int]) -> float:
    """The gang's speed at `counts` as a share of its speed at its maximum: the slowest
    elastic podset sets it (the workers step together)."""
    shares = [
        throughput(p, counts.get(p.name, 0)) / throughput(p, p.most) for p in spec.gang if p.elastic
    ]
    return min(shares, default=1.0)


def shrink_or_move(
    spec: JobSpec,
    before: Mapping[str, int],
    after: Mapping[str, int],
    elsewhere: Mapping[str, int] | None,
    lost_s: float,
    restart_s: float,
    horizon_s: float = HORIZON_S,
) -> Priced:
    """Shrink to `after` and go on, or move whole to the placement found elsewhere
    (`elsewhere`: its replica counts, None when none exists now), which first restarts
    (`restart_s`: start and checkpoint restore) and redoes the `lost_s` seconds of work
    done at `before` since the last checkpoint. Work is counted over `horizon_s`."""
    kept = speed(spec, after)
    shrink_work = horizon_s * kept
    shrunk = f"shrunk to {kept:.0%} of full speed"
    if elsewhere is None:
        return Priced(True, f"{shrunk} (no whole-gang placement elsewhere)")
    moved = speed(spec, elsewhere)
    move_work = max(0.0, horizon_s - restart_s) * moved - lost_s * speed(spec, before)
    costs = (
        f"a move runs at {moved:.0%} after {restart_s:.0f} s of restart and redoes "
        f"{lost_s:.0f} s since the checkpoint: {max(move_work, 0.0):.0f} s of full-speed work "
        f"over {horizon_s:.0f} s"
    )
    if move_work > shrink_work:
        return Priced(False, f"moved whole ({costs}, shrunk to {kept:.0%}: {shrink_work:.0f} s)")
    return Priced(True, f"{shrunk} ({shrink_work:.0f} s of full-speed work; {costs})")
