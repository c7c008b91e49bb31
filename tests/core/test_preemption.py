"""Preemption: within a queue by lower priority, reclaim of borrowed quota in a cohort, victims
that lose the least work, and plans only when the whole gang then fits on one pool."""

from __future__ import annotations

from broker.core.scheduler import Scheduler
from broker.core.types import Preemption

from .helpers import NOW, codes, config, flavor, gang, nodes, queue


def fleet(s: Scheduler, count: int = 1, gpu: int = 8) -> Scheduler:
    s.apply_snapshot("c1", [flavor("od")], nodes("n", "od", count, gpu=gpu), NOW)
    return s


def node_of(s: Scheduler, job: str) -> str:
    return s.allocations()[(job, 1)].placement.assignment[0][1][0]


def test_within_queue_picks_the_victim_losing_least_work() -> None:
    s = fleet(Scheduler(config()))
    s.schedule([gang("old", (1, 4), priority=0), gang("new", (1, 4), priority=0)], NOW)
    s.note_progress("old", 1, NOW - 3600)  # last checkpoint an hour ago
    s.note_progress("new", 1, NOW - 60)
    res = s.schedule([gang("hi", (1, 4), priority=10)], NOW)
    assert res.preemptions == [Preemption("hi", ("new",), ("c1", "od"), "within-queue")]
    assert codes(res.pending["hi"])[0] == "waiting-for-preemption"
    # a fresh checkpoint makes the older job the cheaper victim
    s2 = fleet(Scheduler(config()))
    s2.schedule([gang("old", (1, 4)), gang("new", (1, 4))], NOW)
    s2.note_progress("old", 1, NOW - 10)
    s2.note_progress("new", 1, NOW - 60)
    res = s2.schedule([gang("hi", (1, 4), priority=10)], NOW)
    assert res.preemptions[0].victims == ("old",)


def test_no_second_overlapping_preemption_and_admission_after_release() -> None:
    s = fleet(Scheduler(config()))
    s.schedule([gang("low", (1, 8))], NOW)
    s.note_progress("low", 1, NOW)
    res = s.schedule([gang("hi", (1, 8), priority=5), gang("hi2", (1, 8), priority=5)], NOW)
    assert [p.preemptor for p in res.preemptions] == ["hi"]
    assert codes(res.pending["hi2"]) == ["insufficient-capacity"]
    res = s.schedule([gang("hi", (1, 8), priority=5)], NOW + 1)
    assert res.preemptions == []
    assert codes(res.pending["hi"])[0] == "waiting-for-preemption"
    s.release("low", 1)
    res = s.schedule([gang("hi", (1, 8), priority=5)], NOW + 2)
    assert [j for j, _ in res.admitted] == ["hi"]


def test_equal_or_higher_priority_is_never_a_within_queue_victim() -> None:
    s = fleet(Scheduler(config()))
    s.schedule([gang("peer", (1, 8), priority=5)], NOW)
    res = s.schedule([gang("hi", (1, 8), priority=5)], NOW)
    assert res.preemptions == []
    s2 = fleet(Scheduler(config(queues=[queue("default", within="Never", reclaim="Never")])))
    s2.schedule([gang("low", (1, 8))], NOW)
    res = s2.schedule([gang("hi", (1, 8), priority=5)], NOW)
    assert res.preemptions == []


def test_planned_only_when_victims_free_a_whole_gang_fit_per_node() -> None:
    s = fleet(Scheduler(config()), count=2)
    s.schedule([gang("l1", (1, 4))], NOW)
    s.schedule([gang("h1", (1, 4), priority=5)], NOW)
    s.schedule([gang("l2", (1, 4))], NOW)
    s.schedule([gang("h2", (1, 4), priority=5)], NOW)
    assert node_of(s, "l1") == node_of(s, "h1") != node_of(s, "l2") == node_of(s, "h2")
    # ending l1 and l2 frees 8 GPUs in total, but 4 + 4 on two nodes: no 8-GPU pod fits
    res = s.schedule([gang("p", (1, 8), priority=5)], NOW)
    assert res.preemptions == []
    assert codes(res.pending["p"]) == ["insufficient-capacity"]
    # two 4-GPU replicas do fit once both are gone: both are chosen
    res = s.schedule([gang("q", (2, 4), priority=5)], NOW)
    assert len(res.preemptions) == 1
    assert sorted(res.preemptions[0].victims) == ["l1", "l2"]


def cohort(reclaim: str = "Any", reclaimable: bool = True, b_nominal: int = 8) -> Scheduler:
    return Scheduler(
        config(
            queues=[
                queue("a", "team", {"od": {"gpu": (8, None, None)}}, reclaim=reclaim),
                queue(
                    "b", "team", {"od": {"gpu": (b_nominal, None, None)}}, reclaimable=reclaimable
                ),
            ]
        )
    )


def fill_b(s: Scheduler, count: int) -> list[str]:
    jobs = [gang(f"b{i}", (1, 1), queue="b") for i in range(count)]
    res = s.schedule(jobs, NOW)
    assert len(res.admitted) == count
    return [j for j, _ in res.admitted]


def test_reclaim_takes_back_only_borrowed_capacity() -> None:
    s = fleet(cohort(), count=2)
    admitted = fill_b(s, 12)  # b: 8 nominal + 4 borrowed from a
    second = node_of(s, "b11")
    for j in admitted:  # jobs on the second node lose the least work
        s.note_progress(j, 1, NOW - (10 if node_of(s, j) == second else 1000))
    res = s.schedule([gang("a8", (1, 8), queue="a")], NOW)
    assert len(res.preemptions) == 1
    pre = res.preemptions[0]
    assert pre.kind == "reclaim"
    assert len(pre.victims) == 4  # exactly what b borrowed
    assert all(node_of(s, v) == second for v in pre.victims)


def test_reclaim_never_touches_nominal_share() -> None:
    s = fleet(cohort(), count=1)
    fill_b(s, 8)  # b uses exactly its nominal 8 and the fleet is full
    res = s.schedule([gang("a4", (1, 4), queue="a")], NOW)
    assert res.preemptions == []
    assert codes(res.pending["a4"]) == ["insufficient-capacity"]


def test_reclaim_stops_when_victim_would_drop_below_nominal() -> None:
    # b borrows 2; a needs 4 GPUs on one 8-GPU node: two victims are not enough, so no plan.
    s = fleet(cohort(b_nominal=6), count=1)
    fill_b(s, 8)
    res = s.schedule([gang("a4", (1, 4), queue="a")], NOW)
    assert res.preemptions == []
    res = s.schedule([gang("a2", (1, 2), queue="a")], NOW)
    assert len(res.preemptions) == 1 and len(res.preemptions[0].victims) == 2


def test_reclaim_policies_and_reclaimable_flag() -> None:
    for kwargs, expect in (
        ({"reclaim": "Never"}, 0),
        ({"reclaimable": False}, 0),
        ({"reclaim": "LowerPriority"}, 0),  # b's jobs have the same priority as a's
        ({"reclaim": "Any"}, 1),
    ):
        s = fleet(cohort(b_nominal=4, **kwargs), count=1)  # type: ignore[arg-type]
        fill_b(s, 8)  # b borrows 4 and the fleet is full
        res = s.schedule([gang("a1", (1, 1), queue="a")], NOW)
        assert len(res.preemptions) == expect, kwargs
    s = fleet(cohort(b_nominal=4, reclaim="LowerPriority"), count=1)
    fill_b(s, 8)
    res = s.schedule([gang("a1", (1, 1), queue="a", priority=1)], NOW)
    assert len(res.preemptions) == 1


def test_gangs_admitted_in_the_same_cycle_are_not_victims() -> None:
    s = fleet(
        Scheduler(
            config(
                queues=[
                    queue("a", "team", {"od": {"gpu": (6, None, None)}}),
                    queue("b", "team", {"od": {"gpu": (2, None, None)}}, weight=100.0),
                ]
            )
        )
    )
    s.schedule([gang("a0", (1, 2), queue="a")], NOW)
    pending = [gang(f"b{i}", (1, 1), queue="b") for i in range(6)]
    pending.append(gang("a1", (1, 4), queue="a"))
    res = s.schedule(pending, NOW)
    # b (tiny share) goes first and borrows; a1 then finds nothing it may reclaim this cycle
    assert len(res.admitted) == 6 and res.preemptions == []
    res = s.schedule([gang("a1", (1, 4), queue="a")], NOW + 1)
    assert len(res.preemptions) == 1 and res.preemptions[0].kind == "reclaim"
    assert len(res.preemptions[0].victims) == 4


def test_a_stale_plan_expires_and_can_be_made_again() -> None:
    s = fleet(Scheduler(config()))
    s.schedule([gang("low", (1, 8))], NOW)
    res = s.schedule([gang("hi", (1, 8), priority=5)], NOW)
    assert len(res.preemptions) == 1
    res = s.schedule([gang("hi", (1, 8), priority=5)], NOW + 30)
    assert res.preemptions == []
    # the victim was never ended: after the wait the plan is dropped and made again
    res = s.schedule([gang("hi", (1, 8), priority=5)], NOW + 3600)
    assert [p.victims for p in res.preemptions] == [("low",)]


def test_capacity_held_for_a_preemptor_is_not_a_job_on_the_node() -> None:
    """A planned preemption holds the victims' node for the preemptor. A spot notice or a lost
    node there names the jobs to move: the victim, never the preemptor, which runs nowhere."""
    s = fleet(Scheduler(config()))
    s.schedule([gang("low", (1, 8))], NOW)
    node = node_of(s, "low")
    res = s.schedule([gang("hi", (1, 8), priority=5)], NOW + 1)
    assert [p.preemptor for p in res.preemptions] == ["hi"]
    assert s.jobs_on_node("c1", node) == ["low"]
    assert s.spot_notice("c1", node, NOW + 120, NOW + 2) == ["low"]
