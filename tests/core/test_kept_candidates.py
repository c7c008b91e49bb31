"""Candidate pools kept between admission cycles: whatever the fleet did in between (nodes
added, replaced, removed, healed, noticed; clusters reported, lost, unschedulable; dispatch
breakers opened and closed), a cycle places jobs exactly where a scheduler that ranks every
pool afresh each cycle places them."""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.core.scheduler import Scheduler
from broker.core.types import CycleResult, GangRequest
from tests.core.fleet_changes import apply, changes, clusters
from tests.core.helpers import NOW, config, flavor, gang, nodes, queue

ORDERED = queue("ordered")
ORDERED.flavor_order = ["spot", "od"]
QUEUES = [queue("default"), ORDERED]
POOLS = st.sampled_from([("c0", "od"), ("c0", "spot"), ("c1", "od"), ("c1", "spot")])
breakers = st.tuples(st.just("breaker"), POOLS, st.booleans())
schedulable = st.tuples(st.just("schedulable"), clusters, st.booleans())


@st.composite
def jobs(draw: st.DrawFn) -> GangRequest:
    return gang(
        "j",
        (draw(st.integers(1, 3)), draw(st.sampled_from([0, 1, 4, 8]))),
        queue=draw(st.sampled_from(["default", "ordered"])),
        capacity=draw(st.sampled_from(["any", "on-demand", "spot", "spot-then-on-demand"])),
        gpu_types=draw(st.sampled_from([(), ("a100",), ("t4",)])),
        order=1,
    )


def change(s: Scheduler, step: tuple[object, ...]) -> None:
    if step[0] == "breaker":
        pool = step[1]
        s.set_pool_blocked(pool, "open" if step[2] else None, probing=False)  # type: ignore[arg-type]
    elif step[0] == "schedulable":
        s.set_cluster_schedulable(str(step[1]), bool(step[2]))
    else:
        apply(s, step)


def outcome(res: CycleResult) -> tuple[object, ...]:
    placed = sorted((j, p.cluster, p.flavor, p.assignment) for j, p in res.admitted)
    return tuple(placed), sorted((j, [r.code for r in rs]) for j, rs in res.pending.items())


def schedulers() -> tuple[Scheduler, Scheduler]:
    kept, fresh = (Scheduler(config(QUEUES)) for _ in range(2))
    fresh.candidates_kept_s = 0.0
    return kept, fresh


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=st.lists(
        st.one_of(changes, breakers, schedulable, st.lists(jobs(), min_size=1, max_size=3)),
        min_size=1,
        max_size=30,
    )
)
def test_a_cycle_places_jobs_as_with_candidates_built_afresh(steps: list[object]) -> None:
    kept, fresh = schedulers()
    n = 0
    for i, step in enumerate(steps):
        if isinstance(step, list):  # a cycle of these jobs, on both schedulers
            batch = []
            for req in step:
                n += 1
                batch.append(dataclasses.replace(req, job_id=f"j{n}", order=n))
            now = NOW + 0.01 * i  # within the window candidates are kept for
            assert outcome(kept.schedule(batch, now)) == outcome(fresh.schedule(batch, now))
        else:
            change(kept, step)  # type: ignore[arg-type]
            change(fresh, step)  # type: ignore[arg-type]


def test_a_pool_whose_breaker_opens_takes_no_more_jobs_of_a_shape_seen_before() -> None:
    s = Scheduler(config())
    cheap, dear = flavor("cheap", price=1.0), flavor("dear", price=5.0)
    s.apply_snapshot("c", [cheap, dear], nodes("a", "cheap", 2) + nodes("b", "dear", 2), NOW)
    first = s.schedule([gang("j1", (1, 8))], NOW).admitted
    assert [p.flavor for _, p in first] == ["cheap"]
    s.set_pool_blocked(("c", "cheap"), "dispatches failing", probing=False)
    second = s.schedule([gang("j2", (1, 8))], NOW + 0.001).admitted
    assert [p.flavor for _, p in second] == ["dear"]


def test_a_cheaper_cluster_reported_between_cycles_takes_the_next_job() -> None:
    s = Scheduler(config())
    s.apply_snapshot("c1", [flavor("od", price=5.0)], nodes("a", "od", 2), NOW)
    assert [p.cluster for _, p in s.schedule([gang("j1", (1, 8))], NOW).admitted] == ["c1"]
    s.apply_snapshot("c2", [flavor("od", price=1.0)], nodes("b", "od", 2), NOW)
    second = s.schedule([gang("j2", (1, 8))], NOW + 0.001).admitted
    assert [p.cluster for _, p in second] == ["c2"]
