"""The assigner is a pure function of the snapshot, and commit keeps the core's invariants.

- `assign` changes nothing: node usage, the free-GPU index (down to the order of nodes in each
  bucket), allocation records, quota usage at every level and the ledger are the same after it.
- `commit(assign(...))` never over-commits a node, admits whole gangs only (or at least the
  minimum under partial admission), and keeps every queue within nominal + borrowing and every
  cohort within what its subtree lends.
- Refusals carry their numbers, partial admission admits the most that fits, and the
  make-before-break reservation hands the job's one quota charge back and forth.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from broker.core.assigner import Assignment
from broker.core.scheduler import Scheduler
from broker.core.types import GangRequest, PodSetDemand
from schemas.config import CohortConfig

from .helpers import GI, NOW, config, flavor, gang, nodes, queue, quota_broken


def fingerprint(s: Scheduler) -> Any:
    out: list[Any] = []
    for cname, c in sorted(s.cluster_states().items()):
        for pname, p in sorted(c.pools.items()):
            out.append(
                (
                    cname,
                    pname,
                    p.free_gpu,
                    [list(b) for b in p.buckets],
                    [
                        (n.name, n.used_gpu, n.used_cpu, n.used_mem, n.bucket)
                        for n in p.nodes.values()
                    ],
                )
            )
        out.append(sorted((k, sorted(v.items())) for k, v in c.node_allocs.items()))
    out.append(
        [
            (q.name, sorted((k, tuple(v)) for k, v in q.usage.items()), tuple(q.total), q.admitted)
            for q in s.queue_states().values()
        ]
    )
    out.append(
        [
            (co.name, sorted((k, tuple(v)) for k, v in co.borrowed.items()))
            for co in s.cohort_states().values()
        ]
    )
    out.append(sorted((k, a.charged, a.doomed_by) for k, a in s.allocations().items()))
    return out


def overcommitted(s: Scheduler) -> list[str]:
    bad = []
    for c in s.cluster_states().values():
        for n in c.nodes.values():
            if n.used_gpu > n.usable_gpu - n.other_gpu and n.used_gpu > 0 and not n.broken:
                bad.append(f"{c.name}/{n.name} gpu {n.used_gpu}")
            if n.used_cpu > n.cpu - n.other_cpu or n.used_mem > n.mem - n.other_mem:
                bad.append(f"{c.name}/{n.name} cpu/mem")
    return bad


@st.composite
def worlds(draw: st.DrawFn) -> tuple[Scheduler, list[GangRequest]]:
    nested = draw(st.booleans())
    cohorts = (
        [CohortConfig(name="root"), CohortConfig(name="team", parent="root")] if nested else []
    )
    queues = [
        queue(
            f"q{i}",
            draw(st.sampled_from(["team", "root"])) if nested else "team",
            {"od": {"gpu": (draw(st.integers(0, 16)), draw(st.sampled_from([None, 0, 8])), None)}},
        )
        for i in range(draw(st.integers(1, 3)))
    ]
    s = Scheduler(config(queues=queues, cohorts=cohorts))
    for c in range(draw(st.integers(1, 2))):
        s.apply_snapshot(
            f"c{c}",
            [flavor("od")],
            nodes(
                f"c{c}n",
                "od",
                draw(st.integers(1, 4)),
                gpu=draw(st.sampled_from([4, 8])),
                cpu=draw(st.sampled_from([8_000, 96_000])),
            ),
            NOW,
        )
    reqs = []
    for i in range(draw(st.integers(1, 12))):
        sets = draw(
            st.lists(
                st.tuples(st.integers(1, 4), st.sampled_from([0, 1, 2, 4, 8])),
                min_size=1,
                max_size=3,
            )
        )
        r = gang(
            f"j{i}",
            *sets,
            queue=f"q{draw(st.integers(0, len(queues) - 1))}",
            cpu=draw(st.sampled_from([1000, 4000])),
            order=i + 1,
        )
        if draw(st.booleans()):
            ps = r.podsets[0]
            r.min_replicas = {ps.podset: draw(st.integers(1, ps.replicas))}
            if draw(st.booleans()):  # elastic: asked for at its maximum, same search
                r.elastic = frozenset(r.min_replicas)
        reqs.append(r)
    return s, reqs


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=worlds())
def test_assign_never_mutates_and_commit_keeps_the_invariants(
    world: tuple[Scheduler, list[GangRequest]],
) -> None:
    s, reqs = world
    for req in reqs:
        before = fingerprint(s)
        got = s.assign(req, NOW)
        assert fingerprint(s) == before, req.job_id
        again = s.assign(req, NOW)
        assert type(again) is type(got)
        if not isinstance(got, Assignment):
            continue
        note(f"{req.job_id} -> {got.placement}")
        s.commit(got, NOW)
        counts = {p: len(n) for p, n in got.placement.assignment}
        for d in req.podsets:
            low = req.min_replicas.get(d.podset, d.replicas)
            assert low <= counts[d.podset] <= d.replicas, (d, counts)
        if got.partial and req.elastic:
            assert got.placement.note.startswith("admitted "), got.placement.note
        assert len({got.placement.cluster}) == 1
        assert not overcommitted(s)
        assert not quota_broken(s)


def test_a_stale_assignment_is_refused_by_commit() -> None:
    s = Scheduler(config())
    s.apply_snapshot("c", [flavor("od")], nodes("n", "od", 1, gpu=8), NOW)
    a = s.assign(gang("a", (1, 8)), NOW)
    b = s.assign(gang("b", (1, 8)), NOW)
    assert isinstance(a, Assignment) and isinstance(b, Assignment)
    s.commit(a, NOW)
    with pytest.raises(ValueError, match="stale assignment of b"):
        s.commit(b, NOW)
    assert sorted(s.allocations()) == [("a", 1)]


def _quota_world() -> Scheduler:
    s = Scheduler(
        config(queues=[queue("q", quotas={"od": {"cpu": (9000, 0, None), "gpu": (8, 0, None)}})])
    )
    s.apply_snapshot("c", [flavor("od")], nodes("n", "od", 4, gpu=8), NOW)
    return s


def _cpu_job(job_id: str, replicas: int, min_replicas: int | None) -> GangRequest:
    req = GangRequest(
        job_id=job_id,
        attempt=1,
        queue="q",
        priority=0,
        order=1,
        podsets=(PodSetDemand("worker", replicas, 0, 1000, GI),),
    )
    if min_replicas is not None:
        req.min_replicas = {"worker": min_replicas}
    return req


def test_quota_refusals_carry_used_needed_and_limit() -> None:
    s = _quota_world()
    got = s.assign(_cpu_job("big", 20, None), NOW)
    assert not isinstance(got, Assignment)
    quota = [r for r in got if r.code == "quota-exceeded"]
    assert quota and quota[0].bound is not None
    assert quota[0].bound == ("cpu", 0, 20_000, 9_000)
    why = {(r.cluster, r.flavor): r for r in s.pool_reasons(_cpu_job("big", 20, None))}
    assert why[("c", "od")].bound == ("cpu", 0, 20_000, 9_000)


def test_partial_admission_takes_the_most_that_fits_quota() -> None:
    s = _quota_world()
    res = s.schedule([_cpu_job("j", 20, 5)], NOW)
    (job_id, placement), *_ = res.admitted
    assert job_id == "j"
    assert [len(n) for _, n in placement.assignment] == [9]
    assert placement.note.startswith("admitted 9 of 20 pods (min 5): queue q needs 20 cpu")
    assert s.queue_states()["q"].usage["od"][1] == 9000


def test_partial_admission_never_goes_below_the_minimum() -> None:
    s = _quota_world()
    res = s.schedule([_cpu_job("j", 20, 10)], NOW)
    assert not res.admitted
    assert [r.code for r in res.pending["j"]] == ["quota-exceeded"]


def test_a_whole_gang_that_fits_is_never_cut() -> None:
    s = _quota_world()
    res = s.schedule([_cpu_job("j", 8, 2)], NOW)
    assert [len(n) for _, n in res.admitted[0][1].assignment] == [8]
    assert res.admitted[0][1].note == ""


def _charged(s: Scheduler) -> dict[tuple[str, int], bool]:
    return {k: a.charged for k, a in s.allocations().items()}


@pytest.mark.parametrize("first", ["replacement", "replaced"])
def test_make_before_break_reservation_holds_quota_once(first: str) -> None:
    s = Scheduler(config(queues=[queue("q", quotas={"od": {"gpu": (8, 0, None)}})]))
    s.apply_snapshot("c", [flavor("od")], nodes("n", "od", 2, gpu=8), NOW)
    res = s.schedule([gang("j", (1, 8), queue="q")], NOW)
    assert res.admitted
    # The replacement fits only because the job's one charge moves over to it.
    got = s.reserve(gang("j", (1, 8), queue="q", attempt=2), NOW, replacing_attempt=1)
    assert not isinstance(got, tuple), got
    assert _charged(s) == {("j", 1): False, ("j", 2): True}
    assert s.reservations()["j"].replaced == 1
    assert s.queue_states()["q"].usage["od"][0] == 8
    if first == "replacement":
        s.release("j", 2)
        assert _charged(s) == {("j", 1): True}
    else:
        s.release("j", 1)
        assert _charged(s) == {("j", 2): True}
    assert s.queue_states()["q"].usage["od"][0] == 8
    assert s.reservations() == {}


def test_a_failed_replacement_leaves_the_charge_where_it_was() -> None:
    s = Scheduler(config(queues=[queue("q", quotas={"od": {"gpu": (8, 0, None)}})]))
    s.apply_snapshot("c", [flavor("od")], nodes("n", "od", 1, gpu=8), NOW)
    assert s.schedule([gang("j", (1, 8), queue="q")], NOW).admitted
    got = s.reserve(gang("j", (1, 8), queue="q", attempt=2), NOW, replacing_attempt=1)
    assert isinstance(got, tuple)
    assert _charged(s) == {("j", 1): True}
    assert s.queue_states()["q"].usage["od"][0] == 8
    assert s.reservations() == {}
