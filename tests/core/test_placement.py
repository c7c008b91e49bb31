"""Gang placement: whole gangs on one cluster x flavor, per-node packing, node states, and the
preference order (capacity type, expected cost, packing)."""

from __future__ import annotations

from dataclasses import replace

from broker.core.scheduler import Scheduler
from broker.core.types import Placement
from schemas.agent import NodeInfo

from .helpers import GI, NOW, codes, config, flavor, gang, nodes


def one_cluster(*pools: tuple[str, str, str, float, int, int]) -> Scheduler:
    """pools: (flavor, capacity, gpu type, price, node count, gpus per node) on cluster c1."""
    s = Scheduler(config(spot_prior_rate=0.0))
    flavors = [flavor(f, cap, t, p) for f, cap, t, p, _, _ in pools]
    ns = [n for f, _, _, _, count, g in pools for n in nodes(f"c1-{f}", f, count, gpu=g)]
    s.apply_snapshot("c1", flavors, ns, NOW)
    return s


def test_seed_deadlock_two_4gpu_gangs_on_6_gpus_one_admitted_whole() -> None:
    # The seed's deadlock: two gangs of 4 x 1-GPU workers, 6 GPUs in total (3 nodes x 2 GPUs).
    s = one_cluster(("od", "on-demand", "a100", 3.0, 3, 2))
    res = s.schedule([gang("a", (4, 1)), gang("b", (4, 1))], NOW)
    assert len(res.admitted) == 1
    job, placement = res.admitted[0]
    assert job == "a"
    assert [len(n) for _, n in placement.assignment] == [4]
    assert codes(res.pending["b"]) == ["insufficient-capacity"]


def test_eight_free_gpus_on_eight_nodes_cannot_host_an_8_gpu_pod() -> None:
    s = one_cluster(("od", "on-demand", "a100", 3.0, 8, 8))
    # fill 7 of 8 GPUs on every node
    fill = [gang(f"f{i}", (1, 7)) for i in range(8)]
    res = s.schedule(fill, NOW)
    assert len(res.admitted) == 8
    res = s.schedule([gang("big", (1, 8))], NOW)
    assert not res.admitted
    assert codes(res.pending["big"]) == ["insufficient-capacity"]
    # ... while 8 one-GPU replicas do fit (one per node)
    res = s.schedule([gang("wide", (8, 1))], NOW)
    assert len(res.admitted) == 1
    assert len(set(res.admitted[0][1].assignment[0][1])) == 8


def test_best_fit_prefers_fuller_nodes_and_fewer_nodes() -> None:
    s = one_cluster(("od", "on-demand", "a100", 3.0, 3, 8))
    s.schedule([gang("six", (1, 6))], NOW)  # one node has 2 free now
    res = s.schedule([gang("two", (1, 2))], NOW)
    six_node = s.allocations()[("six", 1)].placement.assignment[0][1][0]
    assert res.admitted[0][1].assignment[0][1] == (six_node,)
    # 4 x 1 GPU goes onto one node, not four
    res = s.schedule([gang("four", (4, 1))], NOW)
    assert len(set(res.admitted[0][1].assignment[0][1])) == 1


def test_never_overcommits_cpu_or_memory() -> None:
    s = Scheduler(config())
    s.apply_snapshot(
        "c1",
        [flavor("od")],
        [NodeInfo(name="n1", flavor="od", gpu=8, cpu_milli=4000, memory=8 * GI)],
        NOW,
    )
    res = s.schedule([gang("a", (2, 1), cpu=1500), gang("b", (1, 1), cpu=1500)], NOW)
    assert [j for j, _ in res.admitted] == ["a"]
    res = s.schedule([gang("c", (1, 1), cpu=1000, mem=7 * GI)], NOW)
    assert not res.admitted


def test_other_pods_reduce_free_capacity() -> None:
    s = Scheduler(config())
    s.apply_snapshot(
        "c1",
        [flavor("od")],
        [NodeInfo(name="n1", flavor="od", gpu=8, cpu_milli=96_000, memory=GI * 512, other_gpu=5)],
        NOW,
    )
    res = s.schedule([gang("a", (1, 4))], NOW)
    assert not res.admitted
    res = s.schedule([gang("b", (1, 3))], NOW)
    assert res.admitted


def test_gpu_podsets_share_one_flavor_and_cpu_podsets_may_use_other_nodes() -> None:
    s = Scheduler(config())
    s.apply_snapshot(
        "c1",
        [flavor("gpu"), flavor("cpu", gpu_type="")],
        [
            NodeInfo(name="g1", flavor="gpu", gpu=8, cpu_milli=8000, memory=64 * GI),
            NodeInfo(name="g2", flavor="gpu", gpu=8, cpu_milli=8000, memory=64 * GI),
            NodeInfo(name="cpu1", flavor="cpu", gpu=0, cpu_milli=64_000, memory=256 * GI),
        ],
        NOW,
    )
    # launcher needs more cpu than the GPU nodes have left after the workers
    req = gang("mpi", (2, 8), cpu=8000, mem=GI)
    launcher = type(req.podsets[0])(podset="launcher", replicas=1, gpu=0, cpu_milli=4000, memory=GI)
    req = replace(req, podsets=(*req.podsets, launcher))
    res = s.schedule([req], NOW)
    assert res.admitted
    placement = res.admitted[0][1]
    assignment = dict(placement.assignment)
    assert placement.flavor == "gpu"
    assert sorted(assignment["p0"]) == ["g1", "g2"]
    assert assignment["launcher"] == ("cpu1",)


def test_gang_spanning_flavors_is_not_split() -> None:
    # 2 x 8 GPUs: one node in each of two flavors must not host it.
    s = Scheduler(config())
    s.apply_snapshot(
        "c1",
        [flavor("a"), flavor("b")],
        [*nodes("a", "a", 1), *nodes("b", "b", 1)],
        NOW,
    )
    res = s.schedule([gang("x", (2, 8))], NOW)
    assert not res.admitted
    assert codes(res.pending["x"]) == ["gang-too-large"]


def test_gang_is_never_split_across_clusters() -> None:
    s = Scheduler(config())
    for c in ("c1", "c2"):
        s.apply_snapshot(c, [flavor("od")], nodes(c, "od", 1), NOW)
    res = s.schedule([gang("x", (2, 8))], NOW)
    assert not res.admitted
    assert codes(res.pending["x"]) == ["gang-too-large"]
    assert codes(s.check_feasible(gang("x", (2, 8)))) == ["gang-too-large"]


def test_draining_not_ready_and_failed_gpu_nodes_take_nothing_new() -> None:
    s = Scheduler(config())
    s.apply_snapshot(
        "c1",
        [flavor("od")],
        [
            NodeInfo(name="spot", flavor="od", gpu=8, cpu_milli=96_000, memory=GI * 512),
            NodeInfo(
                name="down", flavor="od", gpu=8, cpu_milli=96_000, memory=GI * 512, ready=False
            ),
            NodeInfo(
                name="xid", flavor="od", gpu=8, cpu_milli=96_000, memory=GI * 512, gpu_healthy=7
            ),
        ],
        NOW,
    )
    assert s.spot_notice("c1", "spot", NOW + 120, NOW) == []
    res = s.schedule([gang("a", (1, 1))], NOW)
    assert not res.admitted
    assert codes(res.pending["a"]) == ["insufficient-capacity"]
    # recovery of the GPU makes the node schedulable again
    s.set_gpu_health("c1", "xid", 8, NOW)
    res = s.schedule([gang("b", (1, 1))], NOW)
    assert res.admitted[0][1].assignment[0][1] == ("xid",)


def test_capacity_preference_filters_and_orders() -> None:
    s = one_cluster(
        ("od", "on-demand", "a100", 3.0, 1, 8),
        ("sp", "spot", "a100", 1.0, 1, 8),
    )
    res = s.schedule(
        [
            gang("any", (1, 1), capacity="any"),
            gang("spot", (1, 1), capacity="spot"),
            gang("od", (1, 1), capacity="on-demand"),
            gang("stod", (1, 1), capacity="spot-then-on-demand"),
            gang("fell", (1, 1), capacity="spot-then-on-demand", spot_exhausted=True),
        ],
        NOW,
    )
    got = {j: p.flavor for j, p in res.admitted}
    assert got == {"any": "sp", "spot": "sp", "od": "od", "stod": "sp", "fell": "od"}


def test_spot_then_on_demand_waits_for_spot_while_spot_could_fit() -> None:
    s = one_cluster(
        ("od", "on-demand", "a100", 3.0, 1, 8),
        ("sp", "spot", "a100", 1.0, 1, 8),
    )
    s.schedule([gang("filler", (1, 8), capacity="spot")], NOW)
    res = s.schedule([gang("stod", (1, 4), capacity="spot-then-on-demand")], NOW)
    assert not res.admitted
    assert codes(res.pending["stod"]) == ["insufficient-capacity"]
    assert "spot" in res.pending["stod"][0].message
    # no spot pool could ever host 16 GPUs on one node: on-demand is allowed at once
    s2 = one_cluster(
        ("od", "on-demand", "a100", 3.0, 1, 16),
        ("sp", "spot", "a100", 1.0, 1, 8),
    )
    res = s2.schedule([gang("big", (1, 16), capacity="spot-then-on-demand")], NOW)
    assert res.admitted[0][1].flavor == "od"


def test_cost_orders_pools_and_spot_risk_counts() -> None:
    s = Scheduler(config(spot_prior_rate=0.0, risk_weight=5.0))
    s.apply_snapshot(
        "c1",
        [flavor("cheap", "spot", "a100", 1.0), flavor("dear", "spot", "a100", 1.5)],
        [*nodes("cheap", "cheap", 4), *nodes("dear", "dear", 4)],
        NOW,
    )
    res = s.schedule([gang("a", (1, 1))], NOW)
    assert res.admitted[0][1].flavor == "cheap"
    s.release("a", 1)
    # the cheap pool gets reclaimed a lot: 3 notices on 4 nodes within the hour
    for i in range(3):
        s.spot_notice("c1", f"cheap-{i}", NOW + 120, NOW + 60 * i)
    later = NOW + 3600
    assert s.pool_interruption_rate(("c1", "cheap"), later) > 0.05
    assert s.pool_interruption_rate(("c1", "dear"), later) == 0.0
    res = s.schedule([gang("b", (1, 1))], later)
    assert res.admitted[0][1].flavor == "dear"
    # ... unless the job checkpoints often: then the loss per reclaim is small
    res = s.schedule([gang("c", (1, 1), checkpoint_interval_s=60.0)], later)
    assert res.admitted[0][1].flavor == "cheap"


def test_gpu_types_filter_and_no_matching_flavor() -> None:
    s = one_cluster(
        ("a", "on-demand", "a100", 3.0, 1, 8),
        ("h", "on-demand", "h100", 6.0, 1, 8),
    )
    res = s.schedule([gang("x", (1, 1), gpu_types={"h100"})], NOW)
    assert res.admitted[0][1].flavor == "h"
    res = s.schedule([gang("y", (1, 1), gpu_types={"t4"})], NOW)
    assert codes(res.pending["y"]) == ["no-matching-flavor"]
    assert codes(s.check_feasible(gang("y", (1, 1), gpu_types={"t4"}))) == ["no-matching-flavor"]
    assert s.check_feasible(gang("z", (1, 8))) == ()
    assert codes(s.check_feasible(gang("z", (2, 8)))) == ["gang-too-large"]


def test_avoided_pool_is_skipped_and_reported_when_it_was_the_only_fit() -> None:
    s = one_cluster(
        ("a", "on-demand", "a100", 1.0, 1, 8),
        ("b", "on-demand", "a100", 2.0, 1, 8),
    )
    res = s.schedule([gang("x", (1, 8), avoid={("c1", "a")})], NOW)
    assert res.admitted[0][1].flavor == "b"
    res = s.schedule([gang("y", (1, 8), avoid={("c1", "a")})], NOW)
    assert not res.admitted
    assert codes(res.pending["y"])[0] == "pool-avoided"
    assert res.pending["y"][0].flavor == "a"


def test_unschedulable_cluster_takes_nothing_but_keeps_allocations() -> None:
    s = Scheduler(config())
    s.apply_snapshot("c1", [flavor("od")], nodes("c1", "od", 1), NOW)
    s.schedule([gang("a", (1, 4))], NOW)
    s.set_cluster_schedulable("c1", False)
    res = s.schedule([gang("b", (1, 1))], NOW)
    assert codes(res.pending["b"]) == ["cluster-unhealthy"]
    assert s.jobs_on_node("c1", "c1-0") == ["a"]
    s.set_cluster_schedulable("c1", True)
    res = s.schedule([gang("c", (1, 4))], NOW)
    assert res.admitted
    res = s.schedule([gang("d", (1, 1))], NOW)
    assert not res.admitted


def test_no_clusters_and_feasibility_unknown() -> None:
    s = Scheduler(config())
    res = s.schedule([gang("a", (1, 1))], NOW)
    assert codes(res.pending["a"]) == ["no-clusters"]
    assert s.check_feasible(gang("a", (64, 64))) == ()


def test_reserve_places_now_without_counting_quota_twice() -> None:
    from .helpers import queue

    s = Scheduler(
        config(
            queues=[queue("q", quotas={"a100": {"gpu": (8, None, None)}})],
            classes=[],
        )
    )
    s.apply_snapshot(
        "c1",
        [flavor("a100", "spot", "a100", 1.0)],
        nodes("c1", "a100", 3),
        NOW,
    )
    res = s.schedule([gang("j", (1, 8), queue="q")], NOW)
    node = res.admitted[0][1].assignment[0][1][0]
    assert s.spot_notice("c1", node, NOW + 120, NOW) == ["j"]
    # quota is full (8 of 8), but the replacement takes over the old attempt's share
    got = s.reserve(gang("j", (1, 8), queue="q", attempt=2), NOW, replacing_attempt=1)
    assert isinstance(got, Placement)
    assert got.assignment[0][1][0] != node
    assert s.queue_views({})[0].flavors[0].resources[0].used == 8
    # a second job finds the quota full
    res = s.schedule([gang("k", (1, 1), queue="q")], NOW)
    assert codes(res.pending["k"]) == ["quota-exceeded"]
    s.release("j", 1)
    assert s.queue_views({})[0].flavors[0].resources[0].used == 8
    s.release("j", 2)
    assert s.queue_views({})[0].flavors[0].resources[0].used == 0


def test_reserve_failure_restores_the_old_quota() -> None:
    s = Scheduler(config())
    s.apply_snapshot("c1", [flavor("od")], nodes("c1", "od", 1), NOW)
    s.schedule([gang("j", (1, 8))], NOW)
    got = s.reserve(gang("j", (1, 8), attempt=2), NOW, replacing_attempt=1)
    assert codes(got) == ["insufficient-capacity"]
    assert s.queue_views({})[0].admitted == 1
