"""Inventory events: what each returns, allocations surviving snapshots and restarts, spot
statistics and views."""

from __future__ import annotations

import msgspec
import pytest

from broker.core.scheduler import Scheduler
from broker.core.types import Placement
from schemas.agent import NodeInfo

from .helpers import GI, NOW, config, flavor, gang, nodes


def started(count: int = 2) -> Scheduler:
    s = Scheduler(config())
    s.apply_snapshot(
        "c1",
        [flavor("od"), flavor("sp", "spot", price=1.0)],
        [*nodes("od", "od", count), *nodes("sp", "sp", count)],
        NOW,
    )
    return s


def free_gpu(s: Scheduler, cluster: str = "c1") -> dict[str, int]:
    return {v.name: v.gpu_free for v in s.flavor_views(cluster, NOW)}


def test_release_restores_capacity_exactly_and_is_idempotent() -> None:
    s = started()
    before = free_gpu(s)
    res = s.schedule([gang("a", (2, 3)), gang("b", (1, 8), capacity="spot")], NOW)
    assert len(res.admitted) == 2
    assert free_gpu(s) != before
    for _ in range(2):
        s.release("a", 1)
        s.release("b", 1)
    assert free_gpu(s) == before
    assert s.queue_views({})[0].admitted == 0


def test_allocations_survive_a_snapshot_of_the_same_nodes() -> None:
    s = started()
    s.schedule([gang("a", (1, 6), capacity="on-demand")], NOW)
    before = free_gpu(s)
    lost = s.apply_snapshot(
        "c1",
        [flavor("od"), flavor("sp", "spot", price=1.0)],
        [*nodes("od", "od", 2), *nodes("sp", "sp", 2)],
        NOW + 1,
    )
    assert lost == []
    assert free_gpu(s) == before
    # a snapshot without the node reports the job; the allocation stays until release
    lost = s.apply_snapshot("c1", [flavor("od")], nodes("od", "od", 2)[1:], NOW + 2)
    assert lost == ["a"]
    s.release("a", 1)
    assert s.jobs_on_node("c1", "od-0") == []


def test_assume_before_the_nodes_are_known() -> None:
    s = Scheduler(config())
    req = gang("a", (2, 4))
    s.assume(req, Placement("c1", "od", "od", (("p0", ("od-0", "od-0")),)))
    assert s.jobs_on_node("c1", "od-0") == ["a"]
    assert s.known_clusters() == []
    s.upsert_node("c1", nodes("od", "od", 1)[0], NOW)
    assert s.known_clusters() == ["c1"]
    res = s.schedule([gang("b", (1, 1))], NOW)
    assert not res.admitted  # the restored gang holds all 8 GPUs of od-0
    s.release("a", 1)
    res = s.schedule([gang("c", (1, 8))], NOW)
    assert res.admitted


def test_assumed_replacement_holds_the_quota_once() -> None:
    from .helpers import queue

    s = Scheduler(config(queues=[queue("q", quotas={"od": {"gpu": (8, None, None)}})]))
    s.assume(gang("j", (1, 8), queue="q"), Placement("c1", "od", "od", (("p0", ("n1",)),)))
    s.assume(
        gang("j", (1, 8), queue="q", attempt=2), Placement("c2", "od", "od", (("p0", ("n9",)),))
    )
    gpu = s.queue_views({})[0].flavors[0].resources[0]
    assert gpu.used == 8


def test_remove_node_and_cluster_return_their_jobs() -> None:
    s = started()
    s.schedule([gang("a", (1, 8), capacity="on-demand"), gang("b", (2, 8), capacity="spot")], NOW)
    assert s.remove_node("c1", "od-0", NOW) == ["a"]
    assert s.remove_node("c1", "od-0", NOW) == ["a"]  # still allocated until release
    assert sorted(s.remove_cluster("c1", NOW)) == ["a", "b"]
    assert s.known_clusters() == []
    assert s.remove_cluster("zz", NOW) == []


def test_gpu_failure_returns_jobs_only_when_a_used_gpu_must_have_failed() -> None:
    s = started(1)
    s.schedule([gang("a", (1, 6), capacity="on-demand")], NOW)
    assert s.set_gpu_health("c1", "od-0", 7, NOW) == []  # 6 in use, 7 healthy
    assert s.set_gpu_health("c1", "od-0", 5, NOW) == ["a"]
    assert s.set_gpu_health("c1", "nope", 5, NOW) == []


def test_upsert_returns_jobs_when_the_node_turns_unusable() -> None:
    s = started(1)
    s.schedule([gang("a", (1, 4), capacity="on-demand")], NOW)
    node = nodes("od", "od", 1)[0]
    assert s.upsert_node("c1", node, NOW) == []
    down = msgspec.structs.replace(node, ready=False)
    assert s.upsert_node("c1", down, NOW) == ["a"]
    assert s.upsert_node("c1", down, NOW) == []  # only on the transition
    assert s.upsert_node("c1", node, NOW) == []
    assert s.upsert_node("c1", msgspec.structs.replace(node, gpu_healthy=2), NOW) == ["a"]


def test_spot_notice_drains_and_counts_one_interruption() -> None:
    s = started(2)
    res = s.schedule([gang("a", (1, 8), capacity="spot")], NOW)
    node = res.admitted[0][1].assignment[0][1][0]
    assert s.spot_notice("c1", node, NOW + 120, NOW) == ["a"]
    assert s.spot_notice("c1", "unknown", NOW + 120, NOW) == []
    # the agent re-reports the node (with the deadline, or without it while the node takes no
    # new pods): still one interruption
    info = NodeInfo(name=node, flavor="sp", gpu=8, cpu_milli=96_000, memory=1024 * GI)
    s.upsert_node("c1", msgspec.structs.replace(info, spot_deadline=NOW + 120), NOW + 1)
    s.upsert_node("c1", msgspec.structs.replace(info, no_new_pods=True), NOW + 1)
    s.spot_notice("c1", node, NOW + 120, NOW + 2)
    views = {v.name: v for v in s.flavor_views("c1", NOW + 3)}
    assert views["sp"].interruptions == 1
    assert views["sp"].draining_nodes == 1
    assert views["sp"].gpu_free == 8  # only the other node takes placements
    assert views["od"].interruption_rate_per_node_hour == 0.0


def test_interruption_rate_prior_history_and_decay() -> None:
    s = Scheduler(config(spot_prior_rate=0.5, rate_half_life_s=3600.0))
    s.apply_snapshot("c1", [flavor("sp", "spot")], nodes("sp", "sp", 10), NOW)
    assert abs(s.pool_interruption_rate(("c1", "sp"), NOW) - 0.5) < 1e-9
    # quiet for a long time: the observed 0 outweighs the prior
    quiet = s.pool_interruption_rate(("c1", "sp"), NOW + 10 * 3600)
    assert quiet < 0.5
    for i in range(10):
        s.spot_notice("c1", f"sp-{i}", NOW + 10 * 3600 + 120, NOW + 10 * 3600)
    busy = s.pool_interruption_rate(("c1", "sp"), NOW + 10 * 3600)
    assert busy > quiet
    # notices fade with the half-life
    assert s.pool_interruption_rate(("c1", "sp"), NOW + 30 * 3600) < busy


def test_upserts_move_node_hours_only_with_the_node() -> None:
    """A spot pool's rate counts its node-hours: upserts that keep nodes in their pool change
    none of them, and one that moves a node to another pool moves them as a NodeGone and a
    new node would."""

    def fleet() -> Scheduler:
        s = Scheduler(config(spot_prior_rate=0.5, rate_half_life_s=3600.0))
        spot = [flavor("a", "spot"), flavor("b", "spot")]
        s.apply_snapshot("c1", spot, [*nodes("a", "a", 10), *nodes("b", "b", 2)], NOW)
        return s

    upserted, reference = fleet(), fleet()
    t = NOW + 2 * 3600
    for i in range(10):  # the same pool, the node changed or not
        info = nodes("a", "a", 10, cpu=96_000 - 1000 * (i % 2))[i]
        upserted.upsert_node("c1", info, t + i)
    for i in range(5, 10):
        moved = nodes("a", "b", 10)[i]
        upserted.upsert_node("c1", moved, t + 60)
        reference.remove_node("c1", moved.name, t + 60)
        reference.upsert_node("c1", moved, t + 60)
    later = t + 5 * 3600
    for pool in ("a", "b"):
        got = upserted.pool_interruption_rate(("c1", pool), later)
        assert got == pytest.approx(reference.pool_interruption_rate(("c1", pool), later))
    assert upserted.pool_interruption_rate(("c1", "a"), later) != pytest.approx(
        upserted.pool_interruption_rate(("c1", "b"), later)
    )


def test_unknown_flavor_nodes_get_an_implicit_pool() -> None:
    s = Scheduler(config())
    s.apply_snapshot("c1", [], nodes("x", "mystery", 1), NOW)
    views = s.flavor_views("c1", NOW)
    assert [(v.name, v.capacity_type, v.gpu_total) for v in views] == [("mystery", "on-demand", 8)]


def test_a_node_taking_no_new_pods_keeps_its_gang_and_takes_nothing_new() -> None:
    s = started(1)
    s.schedule([gang("a", (1, 4), capacity="on-demand")], NOW)
    node = nodes("od", "od", 1)[0]
    closed = msgspec.structs.replace(node, no_new_pods=True, note="cordoned")
    assert s.upsert_node("c1", closed, NOW) == []  # nothing lost
    assert free_gpu(s)["od"] == 0  # and its 4 free GPUs are no capacity
    assert s.schedule([gang("b", (1, 4), capacity="on-demand")], NOW).admitted == []
    assert s.upsert_node("c1", node, NOW) == []
    assert free_gpu(s)["od"] == 4


def test_a_stale_cluster_takes_no_placements_until_fresh() -> None:
    s = started(1)
    s.set_cluster_stale("c1", True)
    assert s.schedule([gang("a", (1, 4), capacity="on-demand")], NOW).admitted == []
    s.set_cluster_schedulable("c1", True)  # heard from again: still stale
    assert s.schedule([gang("a", (1, 4), capacity="on-demand")], NOW).admitted == []
    s.set_cluster_stale("c1", False)
    assert [j for j, _ in s.schedule([gang("a", (1, 4), capacity="on-demand")], NOW).admitted] == [
        "a"
    ]


def test_a_withdrawn_notice_frees_the_node_but_not_the_preempted_attempt() -> None:
    """Cordon (a notice) then uncordon: the node takes placements again; the job the notice
    moved off it was already told to leave."""
    s = started(2)
    res = s.schedule([gang("a", (1, 8), capacity="spot")], NOW)
    node = res.admitted[0][1].assignment[0][1][0]
    info = NodeInfo(name=node, flavor="sp", gpu=8, cpu_milli=96_000, memory=1024 * GI)
    cordoned = msgspec.structs.replace(info, spot_deadline=NOW + 120, no_new_pods=True)
    assert s.upsert_node("c1", cordoned, NOW) == []
    assert s.spot_notice("c1", node, NOW + 120, NOW) == ["a"]
    # Still cordoned (a snapshot without the deadline): the notice sticks.
    others = [n for n in nodes("sp", "sp", 2) if n.name != node]
    s.apply_snapshot(
        "c1",
        [flavor("od"), flavor("sp", "spot", price=1.0)],
        [*nodes("od", "od", 2), *others, msgspec.structs.replace(info, no_new_pods=True)],
        NOW + 1,
    )
    assert {v.name: v for v in s.flavor_views("c1", NOW + 1)}["sp"].draining_nodes == 1
    # Uncordoned: withdrawn; the node is no longer draining and counts as free again once
    # the job's allocation is released.
    s.upsert_node("c1", info, NOW + 2)
    views = {v.name: v for v in s.flavor_views("c1", NOW + 2)}
    assert views["sp"].draining_nodes == 0
    assert views["sp"].interruptions == 1  # the notice happened; it is not un-counted
    s.release("a", 1)
    views = {v.name: v for v in s.flavor_views("c1", NOW + 3)}
    assert views["sp"].gpu_free == 16
    res = s.schedule([gang("b", (2, 8), capacity="spot")], NOW + 3)
    assert [a[0] for a in res.admitted] == ["b"]


def test_a_spot_pool_at_zero_nodes_still_takes_cpu_only_gangs_its_ceiling_allows() -> None:
    """Feasibility judges a pool by its ceiling (high-water marks), for CPU-only gangs too:
    a spot pool whose nodes were all reclaimed comes back, so the gang waits, never refused."""
    s = Scheduler(config())
    s.apply_snapshot("c", [flavor("sp", "spot")], nodes("n", "sp", 2, cpu=96_000), NOW)
    # Three 64-core replicas: more cpu than one node has, all of the pool's cpu at its peak.
    wide = gang("wide", (3, 0), cpu=64_000, capacity="spot")
    assert s.check_feasible(wide) == ()
    for i in range(2):
        s.remove_node("c", f"n-{i}", NOW + 1)
    pool = s.cluster_states()["c"].pools["sp"]
    assert not pool.nodes
    assert (pool.ceiling.now_cpu, pool.ceiling.total_cpu) == (0, 192_000)
    assert s.check_feasible(wide) == ()
    too_wide = gang("too-wide", (4, 0), cpu=64_000, capacity="spot")
    assert [r.code for r in s.check_feasible(too_wide)] == ["gang-too-large"]
