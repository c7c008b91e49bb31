"""Topology-aware placement: one zone by default, required and preferred levels, BestFit
domains, typed reasons with their numbers, and the tighter domain winning at equal price."""

from __future__ import annotations

from broker.core.scheduler import Scheduler
from broker.core.types import GangRequest, TopologyNeed
from broker.core.views import _waiting_for
from schemas.agent import FlavorInfo, NodeInfo
from schemas.api import PendingReason

from .helpers import GI, NOW, config, gang, tflavor


def tnode(name: str, zone: str, block: str, rack: str, gpu: int = 8, used: int = 0) -> NodeInfo:
    return NodeInfo(
        name=name,
        flavor="od",
        gpu=gpu,
        cpu_milli=96_000,
        memory=1024 * GI,
        other_gpu=used,
        topology=(zone, block, rack, name),
    )


def fleet(spec: dict[tuple[str, str, str], int], used: int = 0) -> list[NodeInfo]:
    """(zone, block, rack) -> node count, each node 8 GPUs with `used` taken by others."""
    return [
        tnode(f"{z}-{b}-{r}-{i}", z, b, r, used=used)
        for (z, b, r), count in spec.items()
        for i in range(count)
    ]


def sched(**clusters: list[NodeInfo]) -> Scheduler:
    s = Scheduler(config())
    for name, ns in clusters.items():
        s.apply_snapshot(name, [tflavor()], ns, NOW)
    return s


def with_need(req: GangRequest, **need: object) -> GangRequest:
    req.topology = TopologyNeed(**need)  # type: ignore[arg-type]
    return req


def paths(s: Scheduler, cluster: str, names: frozenset[str]) -> set[tuple[str, ...]]:
    c = s.cluster_states()[cluster]
    return {c.nodes[n].topology for n in names}


def test_a_multi_node_gang_stays_in_one_zone_unless_told_to_spread() -> None:
    nodes = fleet({("za", "b1", "r1"): 3, ("zb", "b1", "r1"): 1})
    s = sched(c=nodes)
    res = s.schedule([gang("j", (4, 8))], NOW)
    assert not res.admitted
    (why,) = [r for r in res.pending["j"] if r.code == "topology-unfit"]
    assert why.message == "needs 32 GPUs in one zone; largest free zone of c/od has 24"

    s = sched(c=nodes)
    res = s.schedule([with_need(gang("k", (4, 8)), spread=True)], NOW)
    ((_, p),) = res.admitted
    assert {t[0] for t in paths(s, "c", p.nodes)} == {"za", "zb"}


def test_a_required_block_takes_the_smallest_block_that_fits() -> None:
    s = sched(c=fleet({("z", "big", "r1"): 4, ("z", "small", "r1"): 2, ("z", "tiny", "r1"): 1}))
    first = with_need(gang("a", (2, 8)), required=("block",))
    res = s.schedule([first], NOW)
    ((_, p),) = res.admitted
    assert {t[1] for t in paths(s, "c", p.nodes)} == {"small"}
    # The big block stayed whole for the gang that needs all of it.
    res = s.schedule([with_need(gang("b", (4, 8)), required=("block",))], NOW)
    ((_, p),) = res.admitted
    assert {t[1] for t in paths(s, "c", p.nodes)} == {"big"}


def test_a_required_level_that_does_not_fit_waits_with_the_numbers() -> None:
    s = sched(c=fleet({("z", "b1", "r1"): 5, ("z", "b2", "r1"): 3}))
    res = s.schedule(
        [with_need(gang("j", (8, 8)), required=("cloud.google.com/gce-topology-block",))], NOW
    )
    assert not res.admitted
    codes = [r.code for r in res.pending["j"]]
    assert codes[0] == "topology-unfit"
    assert res.pending["j"][0].message == (
        "needs 64 GPUs in one block; largest free block of c/od has 40"
    )


def test_a_preferred_rack_degrades_to_the_block_with_a_note() -> None:
    s = sched(c=fleet({("z", "b1", "r1"): 2, ("z", "b1", "r2"): 2, ("z", "b2", "r1"): 1}))
    res = s.schedule([with_need(gang("j", (3, 8)), preferred=("rack",))], NOW)
    ((_, p),) = res.admitted
    assert {t[1] for t in paths(s, "c", p.nodes)} == {"b1"}
    assert p.note == "preferred one rack (largest free rack has 16 GPUs); placed within one block"

    s = sched(c=fleet({("z", "b1", "r1"): 2, ("z", "b1", "r2"): 2}))
    res = s.schedule([with_need(gang("k", (2, 8)), preferred=("rack",))], NOW)
    ((_, p),) = res.admitted
    assert len({t[2] for t in paths(s, "c", p.nodes)}) == 1
    assert p.note == ""


def test_an_undeclared_level_is_refused_with_the_levels_there_are() -> None:
    s = sched(c=fleet({("z", "b1", "r1"): 2}))
    res = s.schedule([with_need(gang("j", (2, 8)), required=("nvlink",))], NOW)
    assert not res.admitted
    msg = next(r.message for r in res.pending["j"] if r.code == "topology-unfit")
    assert "needs one nvlink" in msg and "zone, block, rack, host" in msg


def test_at_equal_price_the_cluster_with_the_tighter_domain_wins() -> None:
    # Cluster "a" (first by name) fits 2 nodes only across two racks; "b" fits them in one.
    s = sched(
        a=fleet({("z", "b1", "r1"): 1, ("z", "b1", "r2"): 1}),
        b=fleet({("z", "b1", "r1"): 2}),
    )
    res = s.schedule([gang("j", (2, 8))], NOW)
    ((_, p),) = res.admitted
    assert p.cluster == "b"


def test_pools_without_topology_place_as_before() -> None:
    s = Scheduler(config())
    plain = FlavorInfo("od", "on-demand", "a100", 3.0)
    ns = [
        NodeInfo(name=f"n{i}", flavor="od", gpu=8, cpu_milli=96_000, memory=1024 * GI)
        for i in range(3)
    ]
    s.apply_snapshot("c", [plain], ns, NOW)
    res = s.schedule([gang("j", (3, 8))], NOW)
    assert len(res.admitted) == 1


def test_a_preemption_plan_frees_one_domain_not_just_enough_gpus() -> None:
    nodes = fleet({("z", "b1", "r1"): 2, ("z", "b2", "r1"): 2})
    s = sched(c=nodes)
    # Victims are tried lowest priority first: l0 (block b1), l2 (b2), l1 (b1), l3 (b2).
    low = [gang(f"l{i}", (1, 8), priority=p) for i, p in enumerate([0, 2, 1, 3])]
    on = {}
    for req in low:  # one per cycle, so l<i> takes node i
        ((job, p),) = s.schedule([req], NOW).admitted
        on[job] = next(iter(p.nodes))
    assert [on[f"l{i}"] for i in range(4)] == [n.name for n in nodes]
    high = with_need(gang("high", (2, 8), priority=10), required=("block",))
    res = s.schedule([high], NOW + 1)
    (plan,) = res.preemptions
    assert set(plan.victims) == {"l0", "l1"}  # both b1 nodes: 16 GPUs in one block


def test_a_gang_no_domain_could_ever_hold_is_refused_at_submission() -> None:
    s = sched(c=fleet({("za", "b1", "r1"): 4, ("za", "b2", "r1"): 4, ("zb", "b3", "r1"): 4}))
    s.schedule([gang("busy", (4, 8))], NOW)  # what is in use now does not matter
    (why,) = s.check_feasible(with_need(gang("j", (5, 8)), required=("block",)))
    assert why.code == "topology-unfit"
    assert why.message.startswith(
        "needs 40 GPUs in one block, and no matching pool has a block that large even when "
        "empty (the largest holds 32)"
    )
    assert s.check_feasible(with_need(gang("k", (5, 8)), required=("zone",))) == ()
    (why,) = s.check_feasible(gang("l", (9, 8)))  # the default: one zone
    assert "in one zone" in why.message and "(the largest holds 64)" in why.message
    assert s.check_feasible(with_need(gang("m", (9, 8)), spread=True)) == ()


def test_why_says_the_gang_needs_one_block_when_the_free_gpus_are_spread() -> None:
    # Two blocks of 8 nodes; others use 3 nodes of b1 and 5 of b2. 64 GPUs are free in the
    # pool, 40 of them in the largest block: the gang waits, it does not "fit now".
    free = fleet({("z", "b1", "r1"): 5, ("z", "b2", "r1"): 3})
    busy = fleet({("z", "b1", "r2"): 3, ("z", "b2", "r2"): 5}, used=8)
    s = sched(c=free + busy)
    (why,) = s.pool_reasons(with_need(gang("j", (8, 8)), required=("block",)))
    assert (why.code, why.cluster, why.flavor) == ("topology-unfit", "c", "od")
    assert why.message == "needs 64 GPUs in one block; largest free block of c/od has 40"
    (why,) = s.pool_reasons(with_need(gang("k", (5, 8)), required=("block",)))
    assert why.code == "fits-now"


def test_why_says_never_when_no_domain_could_hold_the_gang_empty() -> None:
    s = sched(c=fleet({("za", "b1", "r1"): 4, ("zb", "b2", "r1"): 4}))
    (why,) = s.pool_reasons(gang("j", (6, 8)))  # the default: one zone
    assert why.code == "topology-unfit"
    assert why.message.startswith(
        "needs 48 GPUs in one zone, and no zone here holds that many even when empty "
        "(the largest holds 32)"
    )
    (why,) = s.pool_reasons(with_need(gang("k", (6, 8)), spread=True))
    assert why.code == "fits-now"


def test_why_names_the_level_a_preferred_gang_falls_back_to() -> None:
    s = sched(c=fleet({("z", "b1", "r1"): 2, ("z", "b1", "r2"): 2}))
    (why,) = s.pool_reasons(with_need(gang("j", (3, 8)), preferred=("rack",)))
    assert why.code == "fits-now"
    assert why.message == (
        "fits now (32 GPUs free); preferred one rack (largest free rack has 16 GPUs); "
        "placed within one block; next admission cycle"
    )


def test_a_gang_waiting_for_one_domain_waits_for_capacity() -> None:
    spread = PendingReason(code="topology-unfit", message="needs 64 GPUs in one block")
    assert _waiting_for([], [spread]) == "capacity"


def grow_back(s: Scheduler, req: GangRequest, lost: str, now: float) -> set[tuple[str, ...]]:
    """The gang loses `lost` (the node goes), then grows back one replica: where it went."""
    assert s.remove_node("c", lost, now) == [req.job_id]
    assert s.shrink(req.job_id, req.attempt, lost)
    extra = gang(req.job_id, (1, 8))
    extra.topology = req.topology
    got = s.grow(extra, now)
    return set() if got is None else paths(s, "c", got.nodes)


def test_a_lost_node_is_replaced_inside_the_gangs_block() -> None:
    # Block b2 is listed first and has more room; the gang fits rack b1/r1 and takes it.
    s = sched(c=fleet({("z", "b2", "r1"): 6, ("z", "b1", "r1"): 5}))
    req = gang("j", (4, 8))
    ((_, p),) = s.schedule([req], NOW).admitted
    assert {t[1] for t in paths(s, "c", p.nodes)} == {"b1"}
    lost = sorted(p.nodes)[0]
    assert grow_back(s, req, lost, NOW + 1) == {("z", "b1", "r1", "z-b1-r1-4")}


def test_growth_goes_to_the_next_domain_up_but_never_leaves_the_zone() -> None:
    # The gang fills block b1 of zone za; b2 of za has room, and so has zone zb (listed first).
    nodes = fleet({("zb", "b3", "r1"): 3, ("za", "b1", "r1"): 4, ("za", "b2", "r1"): 1})
    s = sched(c=nodes)
    req = with_need(gang("j", (4, 8)), preferred=("block",))
    ((_, p),) = s.schedule([req], NOW).admitted
    assert {t[:2] for t in paths(s, "c", p.nodes)} == {("za", "b1")}
    (where,) = grow_back(s, req, sorted(p.nodes)[0], NOW + 1)
    assert where[:2] == ("za", "b2")  # the next level up: the zone, not zone zb
    # With zone za full, nothing grows: the gang stays whole in one zone, shrunk.
    assert grow_back(s, req, sorted(p.nodes)[1], NOW + 2) == set()


def test_a_gang_that_requires_a_block_grows_only_inside_it() -> None:
    s = sched(c=fleet({("z", "b1", "r1"): 4, ("z", "b2", "r1"): 2}))
    req = with_need(gang("j", (4, 8)), required=("block",))
    ((_, p),) = s.schedule([req], NOW).admitted
    assert {t[1] for t in paths(s, "c", p.nodes)} == {"b1"}
    assert grow_back(s, req, sorted(p.nodes)[0], NOW + 1) == set()  # b2 has room; not its block
    s.upsert_node("c", tnode("z-b1-r1-new", "z", "b1", "r1"), NOW + 2)
    extra = gang("j", (1, 8))
    extra.topology = req.topology
    got = s.grow(extra, NOW + 2)
    assert got is not None and got.nodes == frozenset({"z-b1-r1-new"})


def test_an_avoided_pool_is_not_said_to_fit_when_no_domain_takes_the_gang() -> None:
    s = sched(c=fleet({("za", "b1", "r1"): 3, ("zb", "b1", "r1"): 1}))
    req = gang("j", (4, 8), avoid=[("c", "od")])
    res = s.schedule([req], NOW)
    assert not res.admitted
    assert "pool-avoided" not in [r.code for r in res.pending["j"]]
    s = sched(c=fleet({("za", "b1", "r1"): 4}))
    res = s.schedule([gang("k", (4, 8), avoid=[("c", "od")])], NOW)
    assert res.pending["k"][0].code == "pool-avoided"
