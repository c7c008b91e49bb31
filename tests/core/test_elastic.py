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
from broker.core.elastic import (
    GROW_RETRY_S,
    HORIZON_S,
    MOVE_START_S,
    SCALING_EFFICIENCY,
    shrink_or_move,
    throughput,
    without_node,
)
from broker.core.inputs import CYCLE, TICK, DispatchAcked, Restore, SubmitJob
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
    PodSetAssignment,
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


def speed(count: int, most: int = 8) -> float:
    """A podset's speed at `count` of `most` replicas without declared throughput."""
    return (1 + (count - 1) * SCALING_EFFICIENCY) / (1 + (most - 1) * SCALING_EFFICIENCY)


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
        assert resized[0].reason == (
            f"spot-notice on {n}, shrunk to {speed(left):.0%} of full speed (no whole-gang "
            f"placement elsewhere): worker {left + 1} -> {left}"
        )
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
        st.tuples(
            st.sampled_from(["notice", "gone", "join", "tick", "grow", "ack", "refuse"]),
            st.integers(0, 11),
        ),
        min_size=1,
        max_size=14,
    ),
)
def test_elastic_gangs_stay_within_bounds_and_growth_never_passes_a_queued_job(
    size: int, rival: int | None, moves: list[tuple[str, int]]
) -> None:
    """Shrinks never leave a gang below its minimum, growth never above its maximum or
    ahead of a queued job of the same or higher priority, and node and quota accounting
    stay exact (invariants.violations) through every step, also when the agent takes
    ("ack") or refuses ("refuse") the revisions a join and tick ("grow") or a shrink send."""
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
        elif op == "grow":
            out = _grow_unanswered(sim, range(index, index + 1))
        elif op in ("ack", "refuse"):
            error = REFUSAL if op == "refuse" else ""
            answer = DispatchAcked(
                first.job_id, first.attempt, op == "ack", error, resize_refused=op == "refuse"
            )
            out = sim.m.handle(answer, sim.now)
            current = sim.m.jobs[first.job_id].current
            if op == "refuse" and _resized(out):  # given back: charged for what it runs
                assert current is not None and current.settled is None
                assert _held(sim, first.job_id) == sum(len(a.nodes) for a in current.assignment)
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


ZONED = msgspec.structs.replace(
    SPOT, topology_levels=("topology.kubernetes.io/zone", "kubernetes.io/hostname")
)


def _zoned(indices: range, zone: str) -> list[NodeInfo]:
    return [
        msgspec.structs.replace(n, flavor=ZONED.name, topology=(zone, n.name))
        for n in SpotSim.nodes(indices)
    ]


def test_a_gang_that_requires_a_zone_grows_only_inside_it() -> None:
    sim = SpotSim(0)
    sim.send("spot-east", ClusterSnapshot(flavors=[ZONED], nodes=_zoned(range(4), "za")))
    spec = jobspec_from_manifest(yaml.safe_load(SEED.read_text(encoding="utf-8")))
    spec = msgspec.structs.replace(spec, topology=GangTopology(required="zone"))
    reply, _ = split_reply(sim.m.handle(SubmitJob(spec, subject_queue="q"), sim.now))
    assert reply.job_id is not None
    assert dispatches(sim.step(1.0))
    out: list[Any] = []
    for node in _zoned(range(4, 8), "zb"):  # room, but in another zone
        out += sim.send("spot-east", NodeUpsert(node=node))
    assert not _resized(out + sim.step(1.0))
    for node in _zoned(range(8, 10), "za"):  # room in its own zone
        out += sim.send("spot-east", NodeUpsert(node=node))
    assert [e.reason for e in _resized(out + sim.step(GROW_RETRY_S))] == [
        "capacity returned: worker 4 -> 6"
    ]
    (a,) = sim.m.jobs[reply.job_id].attempts[-1].assignment
    assert sorted(a.nodes) == ["se-0", "se-1", "se-2", "se-3", "se-8", "se-9"]
    assert violations(sim.m) == []


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
    assert not cancels(out) and not dispatches(out)
    assert sim.m.jobs[first.job_id].current is not None
    assert sim.m.jobs[first.job_id].attempt == first.attempt


def test_a_resize_the_workload_cannot_take_moves_the_gang_whole() -> None:
    sim = SpotSim(4)
    first = _running(sim)
    (rev,) = dispatches(sim.send("spot-east", NodeGone(node="se-0")))
    assert rev.revision == 1
    why = "cannot resize in place: RayJob r-a1: RayJob has no replica count"
    refused = DispatchAcked(first.job_id, first.attempt, False, why, resize_refused=True)
    out = sim.m.handle(refused, sim.now)
    (requeued,) = _events(out, "requeued")
    assert requeued.reason == f"resize-refused: {why}"
    assert [c.attempt for c in cancels(out)] == [first.attempt]
    record = sim.m.jobs[first.job_id]
    assert record.state == "queued" and record.current is None
    assert sum(_free_gpus(sim).values()) == 3  # the three nodes left hold nothing of it
    assert violations(sim.m) == []


REFUSAL = (
    "cannot resize in place: JobSet r-a1: JobSet has no replica count Muster can change while "
    "it runs"
)
STAYS = (
    "cluster spot-east cannot grow JobSet r-a1 in place: JobSet has no replica count Muster "
    "can change while it runs"
)


def _grow_unanswered(sim: SpotSim, indices: range) -> list[Any]:
    """Nodes join and the broker ticks, its growth revision not yet answered by the agent."""
    for node in SpotSim.nodes(indices):
        sim.send("spot-east", NodeUpsert(node=node))
    sim.now += 1.0
    return sim.m.handle(TICK, sim.now) + sim.m.handle(CYCLE, sim.now)


def _refuse(sim: SpotSim, cmd: Dispatch, error: str = REFUSAL) -> list[Any]:
    return sim.m.handle(
        DispatchAcked(cmd.job_id, cmd.attempt, False, error, resize_refused=True), sim.now
    )


def _held(sim: SpotSim, job_id: str) -> int:
    """GPUs the job's allocation holds (what its queue's quota is charged)."""
    (alloc,) = sim.m.scheduler.allocations_by_job()[job_id].values()
    return alloc.vec[0]


def test_a_refused_growth_is_given_back_and_the_attempt_runs_on_at_its_size() -> None:
    sim = SpotSim(4)
    first = _running(sim)
    job = first.job_id
    (rev,) = [d for d in dispatches(_grow_unanswered(sim, range(4, 8))) if d.job_id == job]
    assert [len(a.nodes) for a in rev.assignment] == [8] and _held(sim, job) == 8
    out = _refuse(sim, rev)
    assert not cancels(out) and not dispatches(out)  # the attempt runs on, nothing resent
    record = sim.m.jobs[job]
    current = record.current
    assert current is not None and current.attempt == first.attempt
    assert record.state in ("admitted", "running")
    assert current.assignment == first.assignment and current.grown == []
    assert _held(sim, job) == 4  # quota charged for the four it runs
    assert _free_gpus(sim) == {f"se-{i}": int(i >= 4) for i in range(8)}
    assert [e.reason for e in _resized(out)] == [f"growth given back, {STAYS}: worker 8 -> 4"]
    why = sim.m.views.why(job, sim.now)
    assert why is not None
    assert [r.message for r in why.reasons if r.code == "elastic"] == [
        "worker runs 4 of 8 replicas (min 2; stays: its cluster cannot grow it in place)"
    ]
    (refused,) = [r for r in why.reasons if r.code == "grow-refused"]
    assert (refused.message, refused.cluster, refused.flavor) == (STAYS, "spot-east", SPOT.name)
    assert violations(sim.m) == []
    # growth is not offered to this attempt again, even when more capacity arrives
    assert not _resized(_join(sim, range(8, 10)) + sim.step(GROW_RETRY_S))
    assert _held(sim, job) == 4 and violations(sim.m) == []


def test_a_refused_growth_goes_back_to_the_size_the_agent_last_took() -> None:
    """4 -> 6 taken by the agent, 6 -> 8 refused: it runs on at 6, charged for 6."""
    sim = SpotSim(4)
    first = _running(sim)
    job = first.job_id
    (took,) = [d for d in dispatches(_grow_unanswered(sim, range(4, 6))) if d.job_id == job]
    sim.m.handle(DispatchAcked(job, first.attempt, True, ""), sim.now)
    (rev,) = [d for d in dispatches(_grow_unanswered(sim, range(6, 8))) if d.job_id == job]
    assert [len(a.nodes) for a in rev.assignment] == [8]
    out = _refuse(sim, rev, "cannot resize in place: PyTorchJob p-a1: spec.template pins")
    assert not cancels(out)
    current = sim.m.jobs[job].current
    assert current is not None and current.assignment == took.assignment
    assert sorted(current.grown) == ["se-4", "se-5"]  # what growth added and it runs
    assert _held(sim, job) == 6
    assert [e.reason for e in _resized(out)] == [
        "growth given back, cluster spot-east cannot grow PyTorchJob p-a1 in place: "
        "spec.template pins: worker 8 -> 6"
    ]
    assert violations(sim.m) == []
    # it still shrinks in place, but is not grown again when room returns
    (shrunk,) = dispatches(sim.send("spot-east", NodeGone(node="se-0")))
    sim.m.handle(DispatchAcked(job, first.attempt, True, ""), sim.now)
    assert [len(a.nodes) for a in shrunk.assignment] == [5]
    assert not _resized(_join(sim, range(8, 10)) + sim.step(GROW_RETRY_S))
    assert _held(sim, job) == 5 and violations(sim.m) == []


def test_a_refusal_after_a_revision_went_unanswered_moves_the_gang_whole() -> None:
    """The shell gave up on a growth: the agent may run it, so what it last took is unknown,
    and a later refusal cannot be given back to a size the broker can vouch for."""
    sim = SpotSim(4)
    first = _running(sim)
    _grow_unanswered(sim, range(4, 6))
    sim.m.handle(DispatchAcked(first.job_id, first.attempt, False, "no reply"), sim.now)
    (rev,) = dispatches(_grow_unanswered(sim, range(6, 8)))
    out = _refuse(sim, rev)
    assert [c.attempt for c in cancels(out)] == [first.attempt]
    assert sim.m.jobs[first.job_id].state == "queued"
    assert violations(sim.m) == []


def test_a_refusal_after_a_shrink_moves_the_gang_whole() -> None:
    """A growth then a shrink both unanswered: the refused workload still has replicas on
    the node that is going, so the whole gang moves from its checkpoint."""
    sim = SpotSim(4)
    first = _running(sim)
    job = first.job_id
    _grow_unanswered(sim, range(4, 6))
    (rev,) = dispatches(sim.send("spot-east", NodeGone(node="se-0")))
    assert [len(a.nodes) for a in rev.assignment] == [5]
    out = _refuse(sim, rev)
    assert [c.attempt for c in cancels(out)] == [first.attempt]
    assert sim.m.jobs[job].state == "queued"
    assert violations(sim.m) == []


def _with_west(sim: SpotSim, count: int) -> None:
    """A second spot cluster with `count` free one-GPU A100 nodes, after the job ran."""
    west = [
        NodeInfo(name=f"sw-{i}", flavor=SPOT.name, gpu=1, cpu_milli=8000, memory=2**36)
        for i in range(count)
    ]
    sim.send("spot-west", ClusterSnapshot(flavors=[SPOT], nodes=west))


def _events(out: list[Any], kind: str) -> list[JobEvent]:
    return [e.event for e in out if isinstance(e, Publish) and e.event.kind == kind]


def test_a_notice_moves_the_gang_whole_when_a_full_placement_does_more_work() -> None:
    """4 of 8 workers, one reclaimed: 3 run at 38% speed, while spot-west has room for all 8
    now and a move loses nothing (the job just started): the gang moves, and says why."""
    sim = SpotSim(4)
    first = _running(sim)
    _with_west(sim, 8)
    out = sim.send("spot-east", SpotNotice(node="se-0", deadline=sim.now + 120))
    assert not _events(out, "resized")
    moved = sim.m.jobs[first.job_id].current
    assert moved is not None and moved.attempt > first.attempt  # no checkpoint to wait for
    assert (moved.cluster, sum(len(a.nodes) for a in moved.assignment)) == ("spot-west", 8)
    (pre,) = _events(out, "preempting")
    move_work = HORIZON_S - MOVE_START_S
    assert pre.reason == (
        f"spot-notice: moved whole (a move runs at 100% after {MOVE_START_S:.0f} s of restart "
        f"and redoes 0 s since the checkpoint: {move_work:.0f} s of full-speed work over "
        f"{HORIZON_S:.0f} s, shrunk to 38%: {HORIZON_S * speed(3):.0f} s)"
    )
    assert violations(sim.m) == []


def test_a_notice_shrinks_when_the_placement_elsewhere_is_smaller() -> None:
    sim = SpotSim(4)
    first = _running(sim)
    _with_west(sim, 2)
    out = sim.send("spot-east", SpotNotice(node="se-0", deadline=sim.now + 120))
    (resized,) = _events(out, "resized")
    assert resized.reason == (
        "spot-notice on se-0, shrunk to 38% of full speed (1381 s of full-speed work; a move "
        "runs at 26% after 120 s of restart and redoes 0 s since the checkpoint: 906 s of "
        "full-speed work over 3600 s): worker 4 -> 3"
    )
    assert sim.m.jobs[first.job_id].attempt == first.attempt


def test_a_lost_node_shrinks_when_a_move_would_redo_hours_of_work() -> None:
    """Three hours without a checkpoint: a move to a full placement redoes them all."""
    sim = SpotSim(4)
    first = _running(sim)
    ran = WorkloadStatus(
        job_id=first.job_id, attempt=1, phase="running", running_replicas=4, total_replicas=4
    )
    sim.send("spot-east", ran)
    sim.step(3 * 3600.0)
    _with_west(sim, 8)
    out = sim.send("spot-east", NodeGone(node="se-1"))
    (resized,) = _events(out, "resized")
    assert "redoes 10800 s since the checkpoint" in (resized.reason or "")
    assert sim.m.jobs[first.job_id].attempt == first.attempt
    assert violations(sim.m) == []


def test_a_lost_node_moves_whole_and_the_requeue_says_why() -> None:
    sim = SpotSim(4)
    first = _running(sim)
    _with_west(sim, 8)
    out = sim.send("spot-east", NodeGone(node="se-1"))
    assert not _events(out, "resized")
    (requeued,) = _events(out, "requeued")
    assert (requeued.reason or "").startswith("node-lost: moved whole (a move runs at 100%")
    assert sim.m.jobs[first.job_id].state == "queued"  # placed again by the next cycle


_counts = st.integers(1, 6)


@settings(max_examples=200, deadline=None)
@given(
    least=st.integers(1, 4),
    extra=st.integers(0, 4),
    more=st.integers(0, 4),
    node=st.integers(0, 8),
    declared=st.none() | st.dictionaries(st.integers(1, 12), st.floats(0.1, 100.0), min_size=1),
    elsewhere=st.none() | st.integers(1, 12),
    lost=st.floats(0, 1e5),
    restart=st.floats(0, 1e4),
)
def test_the_priced_choice_never_goes_below_the_minimum_nor_moves_to_nowhere(
    least: int,
    extra: int,
    more: int,
    node: int,
    declared: dict[int, float] | None,
    elsewhere: int | None,
    lost: float,
    restart: float,
) -> None:
    """Whatever the throughput, lost work and restart: a shrink keeps every podset at or
    above its minimum, and with no whole-gang placement elsewhere the gang shrinks."""
    running = least + extra
    spec = JobSpec(
        name="e",
        gang=[
            PodSet(
                name="w",
                replicas=running,
                gpu=1,
                min_replicas=least,
                max_replicas=running + more,
                throughput=declared,
            )
        ],
    )
    before = [PodSetAssignment(podset="w", nodes=[f"n{i}" for i in range(running)])]
    kept = without_node(spec, before, f"n{node}")
    if kept is None:  # below the minimum, or nothing on that node: not a shrink to price
        assert node >= running or running - 1 < least
        return
    after = {a.podset: len(a.nodes) for a in kept}
    where = None if elsewhere is None else {"w": min(elsewhere, running + more)}
    choice = shrink_or_move(spec, {"w": running}, after, where, lost, restart)
    if where is None:
        assert choice.shrink
    if choice.shrink:
        assert after["w"] >= least
        assert choice.reason.startswith("shrunk to ")
    else:
        assert choice.reason.startswith("moved whole (")


def test_declared_throughput_is_interpolated_and_scaled_beyond_its_counts() -> None:
    ps = PodSet(name="w", replicas=4, max_replicas=8, gpu=1, throughput={2: 2.0, 4: 3.0})
    assert [throughput(ps, n) for n in (1, 2, 3, 4, 8)] == [1.0, 2.0, 2.5, 3.0, 6.0]
    plain = PodSet(name="w", replicas=4, max_replicas=8, gpu=1)
    assert throughput(plain, 3) == 1 + 2 * SCALING_EFFICIENCY


def test_a_declared_flat_throughput_makes_a_shrink_cheap() -> None:
    """Past 2 workers this job gains nothing: losing 1 of 4 costs no speed, so it shrinks
    even with a full placement elsewhere."""
    ps = PodSet(name="w", replicas=4, max_replicas=8, gpu=1, throughput={2: 5.0, 8: 5.0})
    spec = JobSpec(name="e", gang=[ps])
    choice = shrink_or_move(spec, {"w": 4}, {"w": 3}, {"w": 8}, 0.0, 0.0)
    assert choice.shrink and choice.reason.startswith("shrunk to 100% of full speed")
