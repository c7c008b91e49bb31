"""Elastic gangs in the core: admitted at what fits between min and max, said in words."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.core.assigner import Assignment
from broker.core.effects import Publish, Send, split_reply
from broker.core.elastic import GROW_RETRY_S
from broker.core.inputs import DispatchAcked, Restore, SubmitJob
from broker.core.invariants import violations
from broker.core.machine import Machine
from broker.core.records import JobRecord
from broker.core.scheduler import Scheduler
from broker.manifests import jobspec_from_manifest
from schemas.agent import (
    ClusterSnapshot,
    Dispatch,
    FlavorInfo,
    NodeGone,
    NodeInfo,
    NodeUpsert,
    SpotNotice,
    WorkloadStatus,
)
from schemas.api import JobEvent
from schemas.config import BrokerConfig, QueueConfig
from schemas.job import GangTopology, JobSpec, PodSet

from .harness import T0, Sim, cancels
from .helpers import NOW, config, flavor, gang, nodes

SEED = Path(__file__).parents[1] / "cli" / "fixtures" / "pytorchjob-elastic-spot.yaml"

SPOT = FlavorInfo(name="a100-spot", capacity_type="spot", gpu_type="A100", price_per_gpu_hour=1.0)


class SpotSim(Sim):
    """One cluster `spot-east` of `count` one-GPU spot A100 nodes."""

    def __init__(self, count: int) -> None:
        self.m = Machine(BrokerConfig(queues=[QueueConfig(name="q")]), epoch=1)
        self.now = T0
        self.seq: dict[str, int] = {}
        self.send("spot-east", ClusterSnapshot(flavors=[SPOT], nodes=self.nodes(range(count))))

    @staticmethod
    def nodes(indices: Any) -> list[NodeInfo]:
        return [
            NodeInfo(name=f"se-{i}", flavor=SPOT.name, gpu=1, cpu_milli=8000, memory=2**36)
            for i in indices
        ]

    def submit_seed(self) -> str:
        """The seed's elastic PyTorchJob (min 2, replicas 4, max 8), unchanged."""
        spec = jobspec_from_manifest(yaml.safe_load(SEED.read_text(encoding="utf-8")))
        reply, _ = split_reply(self.m.handle(SubmitJob(spec, subject_queue="q"), self.now))
        assert reply.job_id is not None, reply.error
        return reply.job_id


def dispatches(effects: list[Any]) -> list[Dispatch]:
    return [e.command for e in effects if isinstance(e, Send) and isinstance(e.command, Dispatch)]


def test_the_seed_elastic_job_is_admitted_at_what_fits_and_says_so() -> None:
    sim = SpotSim(4)
    job = sim.submit_seed()
    out = sim.step(1.0)
    (cmd,) = dispatches(out)
    assert [len(a.nodes) for a in cmd.assignment] == [4]  # 4 of at most 8
    admitted = [e.event for e in out if isinstance(e, Publish) and e.event.kind == "admitted"]
    assert admitted[0].reason == (
        "admitted 4 of 8 worker replicas (min 2): spot-east/a100-spot has room for 4 on 4 "
        "free A100 nodes now"
    )
    why = sim.m.views.why(job, sim.now)
    assert why is not None
    assert [r.message for r in why.reasons if r.code == "elastic"] == [
        "worker runs 4 of 8 replicas (min 2; grows back when its pool has room)"
    ]


def test_the_seed_elastic_job_takes_its_maximum_when_it_fits() -> None:
    sim = SpotSim(10)
    sim.submit_seed()
    (cmd,) = dispatches(sim.step(1.0))
    assert [len(a.nodes) for a in cmd.assignment] == [8]


def test_a_fleet_too_small_for_the_minimum_refuses_it_at_submission() -> None:
    sim = SpotSim(1)
    spec = jobspec_from_manifest(yaml.safe_load(SEED.read_text(encoding="utf-8")))
    reply, _ = split_reply(sim.m.handle(SubmitJob(spec, subject_queue="q"), sim.now))
    assert reply.error is not None and "2x1 GPU (worker) does not fit" in reply.error


def test_an_elastic_request_asks_for_its_maximum_first() -> None:
    s = Scheduler(config())
    s.apply_snapshot("c", [flavor("od")], nodes("n", "od", 3, gpu=8), NOW)
    req = gang("e", (8, 8))
    req.min_replicas = {"p0": 2}
    req.elastic = frozenset({"p0"})
    got = s.assign(req, NOW)
    assert isinstance(got, Assignment)
    assert [len(n) for _, n in got.placement.assignment] == [3]
    assert got.placement.note.startswith("admitted 3 of 8 p0 replicas (min 2): c/od")


def _running(sim: SpotSim) -> Dispatch:
    """The seed's job admitted and running."""
    sim.submit_seed()
    (cmd,) = dispatches(sim.step(1.0))
    sim.send("spot-east", WorkloadStatus(job_id=cmd.job_id, attempt=cmd.attempt, phase="running"))
    return cmd


def _free_gpus(sim: SpotSim) -> dict[str, int]:
    c = sim.m.scheduler.cluster_states()["spot-east"]
    return {name: n.free_gpu for name, n in c.nodes.items()}


def test_a_spot_notice_shrinks_the_gang_in_place_down_to_its_minimum_then_moves_it() -> None:
    sim = SpotSim(4)
    first = _running(sim)
    job = first.job_id
    for n, left in (("se-0", 3), ("se-1", 2)):
        out = sim.send("spot-east", SpotNotice(node=n, deadline=sim.now + 120))
        assert not cancels(out)  # the attempt goes on
        (rev,) = dispatches(out)
        assert (rev.attempt, rev.revision) == (first.attempt, 4 - left)
        assert [len(a.nodes) for a in rev.assignment] == [left] and n not in rev.assignment[0].nodes
        resized = [e.event for e in out if isinstance(e, Publish) and e.event.kind == "resized"]
        assert resized[0].reason == f"spot-notice on {n}: worker {left + 1} -> {left}"
        assert sim.m.jobs[job].state in ("admitted", "running")
        assert sim.m.jobs[job].attempt == first.attempt
        assert _free_gpus(sim)[n] == 1  # its node's share given back
        assert violations(sim.m) == []
    # 2 -> 1 would go below the minimum of 2: the whole gang moves from its checkpoint
    out = sim.send("spot-east", SpotNotice(node="se-2", deadline=sim.now + 120))
    assert not dispatches(out)
    assert sim.m.jobs[job].state in ("preempting", "queued")  # as any gang on a notice
    assert violations(sim.m) == []


def test_a_lost_node_shrinks_the_gang_and_quota_follows() -> None:
    sim = SpotSim(4)
    first = _running(sim)
    out = sim.send("spot-east", NodeGone(node="se-3"))
    assert not cancels(out)
    record = sim.m.jobs[first.job_id]
    assert [len(a.nodes) for a in record.attempts[-1].assignment] == [3]
    (alloc,) = sim.m.scheduler.allocations_by_job()[first.job_id].values()
    assert alloc.vec[0] == 3  # 3 GPUs charged, not 4
    assert violations(sim.m) == []


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    size=st.integers(2, 10),
    rival=st.sampled_from([None, -1, 0, 5]),
    moves=st.lists(
        st.tuples(st.sampled_from(["notice", "gone", "join", "tick"]), st.integers(0, 11)),
        min_size=1,
        max_size=14,
    ),
)
def test_elastic_gangs_stay_within_bounds_and_growth_never_passes_a_queued_job(
    size: int, rival: int | None, moves: list[tuple[str, int]]
) -> None:
    """Shrinks never leave a gang below its minimum, growth never above its maximum or
    ahead of a queued job of the same or higher priority, and node and quota accounting
    stay exact (invariants.violations) through every step."""
    sim = SpotSim(size)
    first = _running(sim)
    if rival is not None:
        spec = JobSpec(
            name="r", capacity="spot", priority=rival, gang=[PodSet(name="w", replicas=3, gpu=1)]
        )
        split_reply(sim.m.handle(SubmitJob(spec, subject_queue="q"), sim.now))
    for op, index in moves:
        node = f"se-{index}"
        if op == "notice":
            out = sim.send("spot-east", SpotNotice(node=node, deadline=sim.now + 60))
        elif op == "gone":
            out = sim.send("spot-east", NodeGone(node=node))
        elif op == "join":
            out = sim.send("spot-east", NodeUpsert(node=SpotSim.nodes([index])[0]))
        else:
            waiting = [
                r.spec.priority
                for r in sim.m.jobs.values()
                if r.state == "queued" and r.job_id != first.job_id
            ]
            out = sim.step(1.0)
            grew = [e for e in _resized(out) if (e.reason or "").startswith("capacity returned")]
            if grew:
                assert all(p < sim.m.jobs[first.job_id].spec.priority for p in waiting)
        assert violations(sim.m) == []
        current = sim.m.jobs[first.job_id].current
        if current is not None and current.attempt == first.attempt:
            (a,) = current.assignment
            assert 2 <= len(a.nodes) <= 8, a.nodes
        sim.now += 1.0


def _resized(out: list[Any]) -> list[JobEvent]:
    return [e.event for e in out if isinstance(e, Publish) and e.event.kind == "resized"]


def _join(sim: SpotSim, indices: range) -> list[Any]:
    out: list[Any] = []
    for node in SpotSim.nodes(indices):
        out += sim.send("spot-east", NodeUpsert(node=node))
    return out + sim.step(1.0)


def test_capacity_returning_to_its_pool_grows_the_gang_up_to_its_maximum() -> None:
    sim = SpotSim(4)
    first = _running(sim)
    out = _join(sim, range(4, 10))  # six more nodes; the job wants at most 8
    (rev,) = [d for d in dispatches(out) if d.job_id == first.job_id]
    assert (rev.attempt, rev.revision) == (first.attempt, 1)
    assert [len(a.nodes) for a in rev.assignment] == [8]
    assert set(first.assignment[0].nodes) <= set(rev.assignment[0].nodes)  # the 4 stay
    assert _resized(out)[0].reason == "capacity returned: worker 4 -> 8"
    assert sum(_free_gpus(sim).values()) == 2
    assert violations(sim.m) == []
    assert not _resized(sim.step(1.0))  # at its maximum: nothing more


def test_growth_waits_while_a_queued_job_of_equal_priority_waits() -> None:
    sim = SpotSim(4)
    first = _running(sim)
    other = JobSpec(name="b", capacity="spot", gang=[PodSet(name="w", replicas=4, gpu=1, cpu="1")])
    reply, _ = split_reply(sim.m.handle(SubmitJob(other, subject_queue="q"), sim.now))
    assert reply.job_id is not None
    out = _join(sim, range(4, 6))  # two free nodes: not enough for b, enough to grow
    assert not _resized(out) and sim.m.jobs[reply.job_id].state == "queued"
    out = _join(sim, range(6, 8))  # b fits now and is admitted; the rest is growth's
    assert sim.m.jobs[reply.job_id].state == "admitted"
    assert [len(a.nodes) for a in sim.m.jobs[first.job_id].attempts[-1].assignment] == [4]
    assert violations(sim.m) == []


def test_a_new_leader_restores_a_shrunk_gang_exactly_and_grows_it() -> None:
    sim = SpotSim(4)
    first = _running(sim)
    sim.send("spot-east", NodeGone(node="se-0"))
    records = [
        msgspec.msgpack.decode(msgspec.msgpack.encode(r), type=JobRecord)
        for r in sim.m.jobs.values()
    ]
    after = SpotSim(0)
    after.now = sim.now
    after.m.handle(Restore(records), after.now)
    after.send("spot-east", ClusterSnapshot(flavors=[SPOT], nodes=SpotSim.nodes(range(1, 4))))
    (alloc,) = after.m.scheduler.allocations_by_job()[first.job_id].values()
    assert alloc.vec[0] == 3
    out = _join(after, range(4, 6))
    (rev,) = [d for d in dispatches(out) if d.job_id == first.job_id]
    assert (rev.attempt, rev.revision) == (first.attempt, 2)
    assert [len(a.nodes) for a in rev.assignment] == [5]
    assert violations(after.m) == []


def test_growth_is_given_back_first_to_a_queued_job_of_equal_priority() -> None:
    sim = SpotSim(4)
    first = _running(sim)
    _join(sim, range(4, 8))  # grows to its maximum of 8
    rival = JobSpec(name="r", capacity="spot", gang=[PodSet(name="w", replicas=3, gpu=1)])
    reply, _ = split_reply(sim.m.handle(SubmitJob(rival, subject_queue="q"), sim.now))
    assert reply.job_id is not None
    out = sim.step(1.0)  # the tick gives the growth back, the cycle admits the rival
    given = [e.reason for e in _resized(out)]
    assert len(given) == 4 and all(
        (r or "").startswith("growth given back to a queued job of priority 0") for r in given
    )
    assert sim.m.jobs[reply.job_id].state == "admitted"
    (a,) = sim.m.jobs[first.job_id].attempts[-1].assignment
    assert len(a.nodes) == 4  # what it was admitted with stays
    out = sim.step(1.0)  # nothing queued now: it grows into the one node left
    assert [e.reason for e in _resized(out)] == ["capacity returned: worker 4 -> 5"]
    assert violations(sim.m) == []


def test_a_gang_that_requires_a_topology_domain_does_not_grow() -> None:
    sim = SpotSim(4)
    spec = jobspec_from_manifest(yaml.safe_load(SEED.read_text(encoding="utf-8")))
    spec = msgspec.structs.replace(spec, topology=GangTopology(required="zone"))
    reply, _ = split_reply(sim.m.handle(SubmitJob(spec, subject_queue="q"), sim.now))
    assert reply.job_id is not None
    assert dispatches(sim.step(1.0))
    assert not _resized(_join(sim, range(4, 8)))


def test_capacity_another_job_gives_back_is_grown_into_at_the_next_retry() -> None:
    sim = SpotSim(6)
    plain = JobSpec(name="a", capacity="spot", gang=[PodSet(name="w", replicas=2, gpu=1)])
    reply, _ = split_reply(sim.m.handle(SubmitJob(plain, subject_queue="q"), sim.now))
    assert reply.job_id is not None and dispatches(sim.step(1.0))
    first = _running(sim)  # the seed's job takes the 4 nodes left
    assert [len(a.nodes) for a in first.assignment] == [4]
    sim.step(1.0)  # no room: the next try is GROW_RETRY_S later
    done = WorkloadStatus(job_id=reply.job_id, attempt=1, phase="succeeded", exit_codes=[0])
    sim.send("spot-east", done)
    assert sim.m.jobs[reply.job_id].state == "succeeded"
    assert not _resized(sim.step(1.0))  # not searched again yet
    out = sim.step(GROW_RETRY_S)
    assert [e.reason for e in _resized(out)] == ["capacity returned: worker 4 -> 6"]
    assert violations(sim.m) == []


def test_gpu_seconds_count_each_size_for_its_time() -> None:
    sim = SpotSim(4)
    first = _running(sim)
    start = sim.m.jobs[first.job_id].attempts[-1].dispatched_at
    sim.now = start + 10.0
    sim.send("spot-east", NodeGone(node="se-0"))  # 4 GPUs for 10 s, then 3
    view = sim.m.views.job_view(first.job_id, start + 30.0)
    assert view is not None
    assert view.accounting.gpu_seconds_used == 4 * 10.0 + 3 * 20.0
    assert view.accounting.cost == (4 * 10.0 + 3 * 20.0) / 3600.0 * SPOT.price_per_gpu_hour


def test_a_resize_the_agent_never_acknowledges_does_not_end_the_attempt() -> None:
    sim = SpotSim(4)
    first = _running(sim)
    sim.send("spot-east", NodeGone(node="se-0"))
    out = sim.m.handle(DispatchAcked(first.job_id, first.attempt, False, "no reply"), sim.now)
    assert out == [] and sim.m.jobs[first.job_id].current is not None
    assert sim.m.jobs[first.job_id].attempt == first.attempt
