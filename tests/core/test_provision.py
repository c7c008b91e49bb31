"""Autoscaled pools in the core: nodes a pool can still add are capacity that arrives after
its delay. A gang waits for them only on one pool of one cluster, the wait is priced against
pools that have nodes now, and a stockout moves the job to the next pool at once."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from broker.core.effects import Send, split_reply
from broker.core.inputs import CancelJob, SubmitJob
from broker.core.invariants import violations
from broker.core.scheduler import Scheduler
from schemas.agent import (
    ClusterSnapshot,
    Dispatch,
    FlavorInfo,
    NodeInfo,
    NodeUpsert,
    Provision,
    ProvisionPool,
)
from schemas.job import JobSpec, PodSet, SpotPolicy
from tests.core.harness import Sim
from tests.core.helpers import NOW, config, gang, queue

GROW = ProvisionPool(max_nodes=4, node_gpu=8, ready_s=300.0, window_s=900.0)


def pooled(name: str, price: float, capacity: str = "spot", **grow: Any) -> FlavorInfo:
    pool = ProvisionPool(**{**{"max_nodes": 4, "node_gpu": 8, "ready_s": 300.0}, **grow})
    return FlavorInfo(name, capacity, "a100", price, provision=pool)  # type: ignore[arg-type]


def node(name: str, flavor: str) -> NodeInfo:
    return NodeInfo(name=name, flavor=flavor, gpu=8, cpu_milli=64_000, memory=2**40)


def submit(s: Sim, replicas: int, capacity: str = "spot", gpu: int = 8) -> str:
    spec = JobSpec(name="g", capacity=capacity, gang=[PodSet(name="w", replicas=replicas, gpu=gpu)])
    reply, _ = split_reply(s.m.handle(SubmitJob(spec, subject_queue="q"), s.now))
    assert reply.accepted and reply.job_id is not None, reply.error
    return str(reply.job_id)


def sent(effects: list[Any], kind: type) -> list[tuple[str, Any]]:
    return [
        (e.cluster, e.command)
        for e in effects
        if isinstance(e, Send) and isinstance(e.command, kind)
    ]


def fleet(*clusters: tuple[str, list[FlavorInfo], list[NodeInfo]]) -> Sim:
    s = Sim(())
    for name, flavors, nodes in clusters:
        s.send(name, ClusterSnapshot(flavors=flavors, nodes=nodes))
    return s


def test_a_spot_gang_waits_for_a_pool_at_zero_and_runs_on_its_new_nodes() -> None:
    s = fleet(("east", [pooled("spot", 1.0)], []))
    job = submit(s, replicas=2)
    out = s.step(1)
    (asked,) = sent(out, Provision)
    assert asked[0] == "east"
    assert (asked[1].job_id, asked[1].flavor, asked[1].nodes) == (job, "spot", 2)
    assert asked[1].deadline == s.now + 900.0 and asked[1].epoch == 1
    why = s.m.reasons[job][0]
    assert why.code == "waiting-for-nodes"
    assert why.message.startswith("waits ~300 s for 2 nodes of pool east/spot")
    assert not sent(s.step(60), Provision)  # asked once, not again every cycle...
    (view,) = s.m.scheduler.flavor_views("east", s.now)
    assert (view.nodes, view.nodes_coming, view.autoscale_max_nodes) == (0, 2, 4)
    s.send("east", NodeUpsert(node=node("od-0", "od")))
    assert not sent(s.step(1), Provision)  # ...nor when capacity changes elsewhere
    s.send("east", NodeUpsert(node=node("spot-0", "spot")), NodeUpsert(node=node("spot-1", "spot")))
    (dispatched,) = sent(s.step(1), Dispatch)
    assert dispatched[0] == "east" and dispatched[1].job_id == job
    assert sorted(dispatched[1].assignment[0].nodes) == ["spot-0", "spot-1"]
    assert not s.m.scheduler.provision_claims()


def test_submission_judges_an_autoscaled_pool_by_the_size_it_can_reach() -> None:
    s = fleet(("east", [pooled("spot", 1.0, max_nodes=3)], [node("spot-0", "spot")]))
    assert submit(s, replicas=3)  # one node now, three at its limit: accepted
    spec = JobSpec(name="g", capacity="spot", gang=[PodSet(name="w", replicas=4, gpu=8)])
    reply, _ = split_reply(s.m.handle(SubmitJob(spec, subject_queue="q"), s.now))
    assert not reply.accepted and "never be placed" in (reply.error or "")


def test_a_pool_limited_in_gpus_is_never_asked_past_them() -> None:
    """A Karpenter NodePool's limit is in resources: 24 GPUs are three 8-GPU nodes."""
    s = fleet(("east", [pooled("spot", 1.0, max_nodes=0, max_gpus=24)], []))
    assert submit(s, replicas=3) and submit(s, replicas=1)
    spec = JobSpec(name="g", capacity="spot", gang=[PodSet(name="w", replicas=4, gpu=8)])
    reply, _ = split_reply(s.m.handle(SubmitJob(spec, subject_queue="q"), s.now))
    assert not reply.accepted  # 32 GPUs: more than the pool may ever hold
    asks = sent(s.step(1), Provision)
    assert sum(p.nodes for _, p in asks) == 3 and len(asks) == 1


def test_only_the_cheapest_cluster_is_asked_to_grow() -> None:
    s = fleet(
        ("east", [pooled("spot", 1.2)], []),
        ("west", [pooled("spot", 1.0)], []),
        ("north", [pooled("spot", 1.1)], []),
    )
    submit(s, replicas=1)
    asks = sent(s.step(1), Provision) + sent(s.step(30), Provision)
    assert [c for c, _ in asks] == ["west"]


def test_a_stockout_moves_the_job_to_the_next_pool_at_once_and_never_ends_it() -> None:
    s = fleet(
        ("east", [pooled("spot", 1.0, window_s=600.0)], []), ("west", [pooled("spot", 2.5)], [])
    )
    job = submit(s, replicas=2)
    assert [c for c, _ in sent(s.step(1), Provision)] == ["east"]
    assert not sent(s.step(598), Provision)  # within the window: still waits on east
    (moved,) = sent(s.step(2), Provision)  # the window ran out: west is asked at once
    assert moved[0] == "west" and moved[1].job_id == job
    assert s.m.scheduler.pool_stockouts(("east", "spot"), s.now) == 1.0
    assert s.m.scheduler.flavor_views("east", s.now)[0].stockouts == 1.0
    assert s.m.scheduler.provision_counts() == (2, 1, {("west", "spot"): 2})
    why = s.m.reasons[job][0]
    assert "pool west/spot" in why.message
    # west stocks out too: the job goes back to east (its skip has lapsed), still queued
    again = sent(s.step(900), Provision)
    assert [c for c, _ in again] == ["east"] and s.m.jobs[job].state == "queued"
    # the penalty fades with its half-life: nothing is disabled for good
    later = s.now + 6 * 1800.0
    assert s.m.scheduler.pool_stockouts(("east", "spot"), later) < 0.1


@pytest.mark.parametrize(
    ("price_now", "waits"),
    [(1.05, False), (3.0, True)],
    ids=["starts-now-on-a-slightly-dearer-pool", "waits-minutes-for-a-much-cheaper-pool"],
)
def test_the_wait_is_priced_against_a_pool_that_has_nodes_now(
    price_now: float, waits: bool
) -> None:
    ready = ("now", [FlavorInfo("od", "on-demand", "a100", price_now)], [node("od-0", "od")])
    grow = ("grow", [pooled("od", 1.0, capacity="on-demand")], [])  # 300 s away
    s = fleet(ready, grow)
    job = submit(s, replicas=1, capacity="on-demand")
    out = s.step(1)
    _waits_or_starts(out, job, waits)


def _waits_or_starts(out: list[Any], job: str, waits: bool) -> None:
    """The job waits for one node of cluster `grow`, or starts now on cluster `now`."""
    if waits:
        assert not sent(out, Dispatch)
        assert [(c, p.job_id, p.nodes) for c, p in sent(out, Provision)] == [("grow", job, 1)]
    else:
        assert not sent(out, Provision)
        assert [(c, d.job_id) for c, d in sent(out, Dispatch)] == [("now", job)]


def test_free_nodes_held_for_a_waiting_gang_are_not_taken_by_a_later_one() -> None:
    s = fleet(("east", [pooled("spot", 1.0)], [node("spot-0", "spot")]))
    first = submit(s, replicas=2)  # one free node + one new one
    (asked,) = sent(s.step(1), Provision)
    assert (asked[1].job_id, asked[1].nodes) == (first, 1)
    second = submit(s, replicas=1)
    out = s.step(1)
    assert not sent(out, Dispatch)  # spot-0 is held for the first gang
    assert [p.job_id for _, p in sent(out, Provision)] == [second]
    s.send("east", NodeUpsert(node=node("spot-1", "spot")))
    (d,) = sent(s.step(1), Dispatch)
    assert d[1].job_id == first


def test_held_free_gpus_are_not_cut_into_pieces_the_gang_no_longer_fits() -> None:
    s = fleet(("east", [pooled("spot", 1.0)], [node("spot-0", "spot")]))
    first = submit(s, replicas=2, gpu=6)  # one replica on spot-0, one on a new node
    (asked,) = sent(s.step(1), Provision)
    assert (asked[1].job_id, asked[1].nodes) == (first, 1)
    submit(s, replicas=1, gpu=2)  # 2 of spot-0's 8 GPUs would leave 6: still fits, but...
    assert not sent(s.step(1), Dispatch)  # ...the whole free node is held for the gang
    s.send("east", NodeUpsert(node=node("spot-1", "spot")))
    placed = {d.job_id: d for _, d in sent(s.step(1), Dispatch)}
    assert sorted(placed[first].assignment[0].nodes) == ["spot-0", "spot-1"]


def test_a_gang_that_falls_back_to_on_demand_stops_waiting_for_spot_nodes() -> None:
    od = FlavorInfo("od", "on-demand", "a100", 3.0)
    s = fleet(("east", [pooled("spot", 1.0, window_s=3600.0), od], [node("od-0", "od")]))
    spec = JobSpec(
        name="g",
        capacity="spot-then-on-demand",
        spot=SpotPolicy(fallback_after_wait_s=120.0),
        gang=[PodSet(name="w", replicas=1, gpu=8)],
    )
    reply, _ = split_reply(s.m.handle(SubmitJob(spec, subject_queue="q"), s.now))
    job = reply.job_id
    assert [p.job_id for _, p in sent(s.step(1), Provision)] == [job]
    (d,) = sent(s.step(150), Dispatch)  # the spot wait ran out: on-demand now, at once
    assert (d[0], d[1].job_id, d[1].flavor) == ("east", job, "od")
    assert not s.m.scheduler.provision_claims()


def test_a_cancelled_waiting_job_frees_its_claim_without_a_stockout() -> None:
    s = fleet(("east", [pooled("spot", 1.0)], []))
    job = submit(s, replicas=1)
    s.step(1)
    s.m.handle(CancelJob(job, "user"), s.now)
    assert not s.m.scheduler.provision_claims()
    s.step(2000)
    assert s.m.scheduler.pool_stockouts(("east", "spot"), s.now) == 0.0


# -- properties --------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_claims_are_whole_gangs_within_pool_limits_and_quota(data: st.DataObject) -> None:
    """Over random fleets of autoscaled pools, gangs and quotas, in rounds where some asked
    nodes arrive: every claim holds its whole gang (free nodes it may use plus new ones),
    no pool is promised more than its limit, and each queue's claims with its usage fit its
    quota; every placed gang is whole."""
    gpu_quota = data.draw(st.sampled_from([16, 32, 64, 10_000]), "quota")
    qs = [queue(f"q{i}", quotas={"spot": {"gpu": (gpu_quota, 0, None)}}) for i in range(2)]
    s = Scheduler(config(qs))
    now = NOW
    limits: dict[tuple[str, str], int] = {}
    for c in range(data.draw(st.integers(1, 3), "clusters")):
        size = data.draw(st.integers(1, 6))
        price = data.draw(st.sampled_from([1.0, 1.2, 2.0]))
        have = data.draw(st.integers(0, min(2, size)))
        flavors = [
            pooled("spot", price, max_nodes=size),
            FlavorInfo("od", "on-demand", "a100", 3.0),
        ]
        s.apply_snapshot(f"c{c}", flavors, [node(f"c{c}-s{i}", "spot") for i in range(have)], now)
        limits[(f"c{c}", "spot")] = size
    jobs = [
        gang(
            f"j{i}",
            (data.draw(st.integers(1, 4)), data.draw(st.sampled_from([4, 6, 8]))),
            queue=f"q{data.draw(st.integers(0, 1))}",
            capacity="spot",
            order=i + 1,
        )
        for i in range(data.draw(st.integers(1, 8), "jobs"))
    ]
    added = asked = 0
    for _ in range(3):
        pending = [j for j in jobs if not s.allocations_by_job().get(j.job_id)]
        res = s.schedule(pending, now)
        for job_id, placement in res.admitted:
            j = next(j for j in jobs if j.job_id == job_id)
            assert sum(len(n) for _, n in placement.assignment) == sum(
                d.replicas for d in j.podsets
            )
        claims = s.provision_claims()
        assert len({a.job_id for a in res.provisions}) == len(res.provisions)
        for (cluster, flavor), limit in limits.items():
            pool = s.cluster_states()[cluster].pools[flavor]
            mine = [c for c in claims.values() if c.pool == (cluster, flavor)]
            assert len(pool.nodes) + sum(c.pending for c in mine) <= limit
            fresh = [a.job_id for a in res.provisions if (a.cluster, a.flavor) == (cluster, flavor)]
            alone = fresh[0] if fresh and len(mine) == len(fresh) else None
            for c in mine:
                if c.job_id not in fresh:
                    continue
                (d,) = next(j for j in jobs if j.job_id == c.job_id).podsets
                # whole gang: its new nodes, and the pool's free nodes when it was the first
                # to wait on that pool
                room = c.nodes * (c.node_gpu // d.gpu)
                if c.job_id == alone:
                    room += sum(n.free_gpu // d.gpu for n in pool.nodes.values() if n.schedulable)
                assert d.replicas <= room
        for q in qs:
            vec = (0, 0, 0)
            for c in claims.values():
                if c.queue == q.name:
                    vec = (vec[0] + c.vec[0], vec[1] + c.vec[1], vec[2] + c.vec[2])
            assert s.quota_check(q.name, "spot", vec) is None
        asked += len(res.provisions)
        # some of the asked nodes come up
        for ask in res.provisions:
            for _ in range(data.draw(st.integers(0, ask.nodes))):
                s.upsert_node(ask.cluster, node(f"{ask.cluster}-new{added}", ask.flavor), now)
                added += 1
        now += data.draw(st.sampled_from([1.0, 400.0, 1000.0]))
    event("pools asked to grow", asked > 0)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_the_machine_stays_sound_while_gangs_wait_for_nodes(data: st.DataObject) -> None:
    """Random submissions, node arrivals for the asks, stockouts, cancellations and time on
    pools that start empty: the core's invariants hold after every step (whole gangs, no
    node over-committed, quota charged once), a job is asked for by one cluster at a time,
    and a gang is dispatched only onto nodes its cluster reported."""
    clusters = [f"c{i}" for i in range(data.draw(st.integers(1, 2), "clusters"))]
    s = fleet(
        *(
            (c, [pooled("spot", 1.0 + i / 10, max_nodes=data.draw(st.integers(1, 4)))], [])
            for i, c in enumerate(clusters)
        )
    )
    reported: dict[str, set[str]] = {c: set() for c in clusters}
    open_asks: dict[str, tuple[str, float]] = {}  # job -> (cluster, deadline)
    asked_nodes: dict[str, int] = {}
    jobs: list[str] = []
    cancelled: set[str] = set()
    ran: set[str] = set()
    added = 0

    def new_node(cluster: str) -> None:
        nonlocal added
        name = f"{cluster}-new-{added}"
        added += 1
        reported[cluster].add(name)
        s.send(cluster, NodeUpsert(node=node(name, "spot")))

    def step(dt: float) -> None:
        out = s.step(dt)
        for cluster, ask in sent(out, Provision):
            held = open_asks.get(ask.job_id)
            assert held is None or held[1] <= s.now, f"{ask.job_id} asked twice at once"
            open_asks[ask.job_id] = (cluster, ask.deadline)
            asked_nodes[ask.job_id] = ask.nodes
        for cluster, d in sent(out, Dispatch):
            assert {n for a in d.assignment for n in a.nodes} <= reported[cluster]
            open_asks.pop(d.job_id, None)
            ran.add(d.job_id)
            event("a gang ran on nodes its pool added")
        assert violations(s.m) == []

    for _ in range(data.draw(st.integers(3, 10), "steps")):
        action = data.draw(st.sampled_from(["submit", "nodes", "time", "cancel"]))
        if action == "submit":
            gpu = data.draw(st.sampled_from([4, 8]))
            spec = JobSpec(
                name="g",
                capacity="spot",
                gang=[PodSet(name="w", replicas=data.draw(st.integers(1, 3)), gpu=gpu)],
            )
            reply, _ = split_reply(s.m.handle(SubmitJob(spec, subject_queue="q"), s.now))
            if reply.accepted:
                jobs.append(str(reply.job_id))
        elif action == "nodes" and open_asks:
            new_node(open_asks[data.draw(st.sampled_from(sorted(open_asks)))][0])
        elif action == "cancel" and jobs:
            job = data.draw(st.sampled_from(jobs))
            cancelled.add(job)
            s.m.handle(CancelJob(job, "user"), s.now)
        step(data.draw(st.sampled_from([1.0, 400.0, 1000.0])))
    # Every live ask is met in full: each of those gangs runs (its nodes were held for it).
    waiting = {j: c for j, (c, due) in open_asks.items() if due > s.now and j not in cancelled}
    for job, cluster in waiting.items():
        for _ in range(asked_nodes[job]):
            new_node(cluster)
    step(1.0)
    step(1.0)
    assert set(waiting) <= ran, sorted(set(waiting) - ran)


@pytest.mark.parametrize(
    ("gpu_now", "waits"),
    [("t4", True), ("a100", False)],
    ids=["waits-for-a100s-over-t4s-cheaper-per-hour", "starts-now-on-a-cheaper-a100"],
)
def test_the_wait_is_priced_per_unit_of_work(gpu_now: str, waits: bool) -> None:
    """A T4 node now at a sixth of the growing A100 pool's hourly price is still dearer per
    unit of work (T4 0.3, A100 2.2): the gang waits 300 s for A100 nodes."""
    ready = ("now", [FlavorInfo("od", "on-demand", gpu_now, 1.0)], [node("od-0", "od")])
    grow = ("grow", [pooled("od", 6.0, capacity="on-demand")], [])  # A100, 300 s away
    s = fleet(ready, grow)
    job = submit(s, replicas=1, capacity="on-demand")
    out = s.step(1)
    _waits_or_starts(out, job, waits)


def test_a_waiting_gang_keeps_its_claim_when_a_node_dearer_per_work_appears() -> None:
    s = fleet(("grow", [pooled("od", 6.0, capacity="on-demand")], []))  # A100, 300 s away
    job = submit(s, replicas=1, capacity="on-demand")
    assert [(c, p.job_id) for c, p in sent(s.step(1), Provision)] == [("grow", job)]
    t4 = FlavorInfo("od", "on-demand", "t4", 1.0)  # a sixth of the price, 0.3 / 2.2 the speed
    s.send("now", ClusterSnapshot(flavors=[t4], nodes=[node("od-0", "od")]))
    assert not sent(s.step(1), Dispatch)
    assert s.m.reasons[job][0].code == "waiting-for-nodes"
