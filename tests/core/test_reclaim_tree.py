"""Reclaim across a hierarchical cohort tree (Kueue's hierarchical cohorts).

A queue inside its nominal quota takes back what the tree lent to a queue in another branch,
and only that: a victim's queue and the branch that hangs off the common cohort must both
borrow. The property runs random two-level trees, fleets and arrival rounds (victims end at
once and are requeued; nothing else changes between arrivals), and checks after every cycle
that no job is reclaimed twice without a change in the inputs and that quota holds at every
level of the tree (queues within nominal + borrowing, the root within what its subtree has).
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from broker.core.scheduler import Scheduler
from broker.core.types import GangRequest
from schemas.config import CohortConfig, FlavorQuota, ResourceQuota

from .helpers import NOW, config, flavor, gang, nodes, queue, quota_broken, random_fleet_and_rounds

TREE = [
    CohortConfig(name="org"),
    CohortConfig(name="team-a", parent="org"),
    CohortConfig(name="team-b", parent="org"),
]


def _tree_world(b_nominal: int = 8) -> Scheduler:
    s = Scheduler(
        config(
            queues=[
                queue("a1", "team-a", {"od": {"gpu": (0, None, None)}}),
                queue("b1", "team-b", {"od": {"gpu": (b_nominal, None, None)}}),
            ],
            cohorts=TREE,
        )
    )
    s.apply_snapshot("c", [flavor("od")], nodes("n", "od", 2, gpu=8), NOW)
    return s


def test_a_queue_reclaims_what_it_lent_to_another_branch() -> None:
    s = _tree_world()
    # a1 has no quota of its own: both of its jobs run on b1's quota, lent across org.
    res = s.schedule([gang("x", (1, 8), queue="a1"), gang("y", (1, 8), queue="a1")], NOW)
    assert len(res.admitted) == 1  # org has 8 GPUs of quota in all
    res = s.schedule([gang("b", (1, 8), queue="b1")], NOW + 1)
    assert [(p.victims, p.kind) for p in res.preemptions] == [(("x",), "reclaim")]
    s.release("x", 1)
    res = s.schedule(
        [gang("b", (1, 8), queue="b1"), gang("x", (1, 8), queue="a1", attempt=2)], NOW + 2
    )
    assert [j for j, _ in res.admitted] == ["b"]
    assert not quota_broken(s)


def test_nothing_is_reclaimed_inside_the_victims_own_quota() -> None:
    s = Scheduler(
        config(
            queues=[
                queue("a1", "team-a", {"od": {"gpu": (8, None, None)}}),
                queue("b1", "team-b", {"od": {"gpu": (8, None, None)}}),
            ],
            cohorts=TREE,
        )
    )
    s.apply_snapshot("c", [flavor("od")], nodes("n", "od", 1, gpu=8), NOW)
    assert s.schedule([gang("x", (1, 8), queue="a1")], NOW).admitted
    res = s.schedule([gang("b", (1, 8), queue="b1")], NOW + 1)
    assert res.preemptions == []  # a1 runs inside its own nominal: nothing was lent to it


def test_a_queue_borrowing_only_inside_its_branch_is_not_reclaimed_from_outside() -> None:
    """a2 borrows from its sibling a1 inside team-a; team-a as a whole borrows nothing from
    org, so b1 (another branch) has nothing to take back from a2."""
    s = Scheduler(
        config(
            queues=[
                queue("a1", "team-a", {"od": {"gpu": (8, None, None)}}),
                queue("a2", "team-a", {"od": {"gpu": (0, None, None)}}),
                queue("b1", "team-b", {"od": {"gpu": (8, None, None)}}),
            ],
            cohorts=TREE,
        )
    )
    s.apply_snapshot("c", [flavor("od")], nodes("n", "od", 1, gpu=8), NOW)
    assert s.schedule([gang("x", (1, 8), queue="a2")], NOW).admitted
    res = s.schedule([gang("b", (1, 8), queue="b1")], NOW + 1)
    assert res.preemptions == []
    # a1, its own branch's lender, does take it back.
    res = s.schedule([gang("a", (1, 8), queue="a1")], NOW + 2)
    assert [(p.victims, p.kind) for p in res.preemptions] == [(("x",), "reclaim")]


@st.composite
def trees(draw: st.DrawFn) -> tuple[Scheduler, list[list[GangRequest]]]:
    branch = st.sampled_from(["team-a", "team-b", "org"])
    queues = [
        queue(
            f"q{i}",
            draw(branch),
            {"od": {"gpu": (draw(st.integers(0, 8)), draw(st.sampled_from([None, 0, 4])), None)}},
            reclaim=draw(st.sampled_from(["Any", "Any", "LowerPriority", "Never"])),
            within=draw(st.sampled_from(["LowerPriority", "Never"])),
        )
        for i in range(draw(st.integers(2, 4)))
    ]
    cohorts = list(TREE)
    if draw(st.booleans()):
        limit = draw(st.integers(0, 8))
        cohorts[1] = CohortConfig(
            name="team-a",
            parent="org",
            quotas=[FlavorQuota("od", {"gpu": ResourceQuota(nominal=0, borrowing_limit=limit)})],
        )
    s = Scheduler(config(queues=queues, cohorts=cohorts))
    rounds = random_fleet_and_rounds(draw, s, len(queues))
    return s, rounds


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=trees())
def test_tree_reclaim_never_bounces_and_quota_holds_at_every_level(
    world: tuple[Scheduler, list[list[GangRequest]]],
) -> None:
    s, rounds = world
    note(repr(s.config.queues))
    by_id = {r.job_id: r for batch in rounds for r in batch}
    now = NOW
    pending: dict[str, GangRequest] = {}
    live: dict[str, int] = {}
    for arrivals in rounds:
        for r in arrivals:
            pending[r.job_id] = r
        reclaimed: Counter[str] = Counter()
        for _ in range(40):
            res = s.schedule(sorted(pending.values(), key=lambda r: r.order), now)
            note(f"admitted={[j for j, _ in res.admitted]} preemptions={res.preemptions}")
            for job_id, _ in res.admitted:
                live[job_id] = pending.pop(job_id).attempt
            assert not quota_broken(s)
            for pre in res.preemptions:
                for victim in pre.victims:
                    attempt = live.pop(victim)
                    s.release(victim, attempt)
                    old = by_id[victim]
                    pending[victim] = gang(
                        victim,
                        *((d.replicas, d.gpu) for d in old.podsets),
                        queue=old.queue,
                        priority=old.priority,
                        attempt=attempt + 1,
                        order=old.order,
                    )
                    if pre.kind == "reclaim":
                        reclaimed[victim] += 1
            assert not quota_broken(s)
            twice = {j: n for j, n in reclaimed.items() if n > 1}
            assert not twice, twice
            if not res.admitted and not res.preemptions:
                break
            now += 1.0
