"""The earlier spot waiters kept between admission cycles (earlier.py) are the ones a walk over
every queue's heads finds, and the futile-spot-wait decisions made from them are the walk's,
through random submissions, placements, failed dispatches (back-off), cancels, finished jobs,
spot nodes lost and back, and spot waits that run out."""

from __future__ import annotations

import random
from collections.abc import Mapping

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.core.effects import split_reply
from broker.core.inputs import CYCLE, TICK, CancelJob, DispatchAcked, SubmitJob
from broker.core.machine import Machine
from broker.core.placement import futile_spot_waits, wants_spot, wants_spot_first
from broker.core.types import GangRequest
from schemas.agent import ClusterSnapshot, Heartbeat, NodeGone, NodeUpsert, WorkloadStatus
from schemas.config import BrokerConfig, QueueConfig
from schemas.job import CapacityPreference, JobSpec, PodSet
from tests.core.helpers import NOW, flavor, nodes
from tests.core.spot_pools import Agent

QUEUES = ("q0", "q1")
CAPACITIES: tuple[CapacityPreference, ...] = ("spot", "spot-then-on-demand", "any", "on-demand")
GPU_TYPES: tuple[list[str], ...] = ([], ["v100"], ["a100"], ["v100", "a100"])
SPOT_NODES = {"east": "east-spot", "west": "west-spot"}


def waiting_from_scratch(
    m: Machine, now: float, skip: Mapping[str, object]
) -> dict[str, GangRequest]:
    """The walk the kept set replaces: every queue's first `lookahead` jobs that a cycle tried
    and left unplaced, not backing off, whose request wants spot."""
    out: dict[str, GangRequest] = {}
    for pending in m.backlog.pending.values():
        for job_id in pending.heads(m.backlog.lookahead, lambda _: True):
            record = m.jobs[job_id]
            if job_id in skip or job_id not in m.reasons or record.not_before > now:
                continue
            request = m.backlog.request(record, now, m.registry.demands(job_id))
            if wants_spot(request):
                out[job_id] = request
    return out


def earliest_per_shape(waiting: Mapping[str, GangRequest]) -> set[str]:
    best: dict[tuple[str, frozenset[str], int], GangRequest] = {}
    for r in waiting.values():
        at = (r.queue, r.gpu_types, r.total_gpu)
        if at not in best or (-r.priority, r.order) < (-best[at].priority, best[at].order):
            best[at] = r
    return {r.job_id for r in best.values()}


class Checked(Machine):
    """A machine whose every futile-spot-wait decision is checked against the walk."""

    decided = 0

    def given_up_spot_waits(self, stuck: Mapping[str, GangRequest], now: float) -> dict[str, str]:
        expected: dict[str, str] = {}
        if any(wants_spot_first(r) for r in stuck.values()):
            waiting = {**stuck, **waiting_from_scratch(self, now, stuck)}
            futile = futile_spot_waits(list(waiting.values()))
            expected = {job_id: ahead for job_id, ahead in futile.items() if job_id in stuck}
        got = super().given_up_spot_waits(stuck, now)
        assert got == expected
        Checked.decided += len(got)
        return got


class World:
    """Two clusters, each with two spot nodes (of one GPU type) and one on-demand node, and
    two queues read `lookahead` jobs deep."""

    def __init__(self, lookahead: int) -> None:
        self.m = Checked(BrokerConfig(queues=[QueueConfig(name=q) for q in QUEUES]))
        self.m.backlog.lookahead = lookahead
        self.now = NOW
        self.agents = {c: Agent(self.m, c) for c in SPOT_NODES}
        self.jobs: list[str] = []
        for cluster, gpu_type in (("east", "v100"), ("west", "a100")):
            self.agents[cluster].send(
                ClusterSnapshot(
                    flavors=[
                        flavor("spot", "spot", gpu_type, 0.9),
                        flavor("od", gpu_type=gpu_type),
                    ],
                    nodes=nodes(SPOT_NODES[cluster], "spot", 2) + nodes(f"{cluster}-od", "od", 1),
                ),
                now=self.now,
            )

    def submit(self, rng: random.Random) -> None:
        name = f"j{len(self.jobs)}"
        spec = JobSpec(
            name=name,
            job_id=name,
            priority=rng.randint(0, 2),
            capacity=rng.choice(CAPACITIES),
            gpu_types=rng.choice(GPU_TYPES),
            gang=[PodSet(name="w", replicas=1, gpu=rng.choice((1, 2, 4, 8)))],
        )
        queue = rng.choice(QUEUES)
        reply, _ = split_reply(self.m.handle(SubmitJob(spec, subject_queue=queue), self.now))
        assert reply.accepted, reply.error
        self.jobs.append(name)

    def step(self, op: str, rng: random.Random) -> None:
        m = self.m
        job = rng.choice(self.jobs) if self.jobs else None
        current = m.jobs[job].current if job is not None else None
        if op == "submit":
            self.submit(rng)
        elif op in ("cycle", "wait"):
            self.now += 1.0 if op == "cycle" else 400.0
            for agent in self.agents.values():
                agent.send(Heartbeat(at=self.now), now=self.now)
            m.handle(TICK, self.now)
            m.handle(CYCLE, self.now)
        elif op == "cancel" and job is not None:
            m.handle(CancelJob(job, "test"), self.now)
        elif op == "fail" and job is not None and current is not None and current.live:
            m.handle(DispatchAcked(job, current.attempt, False, "no room"), self.now)
        elif op == "done" and job is not None and current is not None and current.live:
            done = WorkloadStatus(job_id=job, attempt=current.attempt, phase="succeeded")
            self.agents[current.cluster].send(done, now=self.now)
        elif op in ("gone", "back"):
            cluster = rng.choice(sorted(SPOT_NODES))
            name = f"{SPOT_NODES[cluster]}-{rng.randint(0, 1)}"
            if op == "gone":
                self.agents[cluster].send(NodeGone(node=name), now=self.now)
            else:
                (back,) = [n for n in nodes(SPOT_NODES[cluster], "spot", 2) if n.name == name]
                self.agents[cluster].send(NodeUpsert(node=back), now=self.now)
        self.check()

    def check(self) -> None:
        """The kept set, read as a cycle reads it, is the walk's, earliest per shape."""
        m = self.m
        scratch = waiting_from_scratch(m, self.now, {})
        assert all(job_id in m.backlog.earlier_waiters for job_id in scratch)
        kept = m.backlog.earlier_spot_waiters(
            m.jobs, m.registry.all_demands, m.reasons, self.now, {}
        )
        assert {r.job_id for r in kept} == earliest_per_shape(scratch)


OPS = (
    "submit",
    "submit",
    "submit",
    "cycle",
    "cycle",
    "wait",
    "cancel",
    "fail",
    "done",
    "gone",
    "back",
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 4), st.lists(st.sampled_from(OPS), max_size=80), st.integers(0, 2**32))
def test_the_kept_spot_waiters_are_the_walks(lookahead: int, ops: list[str], seed: int) -> None:
    world = World(lookahead)
    rng = random.Random(seed)
    for op in ops:
        world.step(op, rng)


def test_long_random_runs_decide_futile_waits_as_the_walk_does() -> None:
    Checked.decided = 0
    for seed in range(6):
        rng = random.Random(seed)
        world = World(lookahead=3 + seed)
        for _ in range(600):
            world.step(rng.choice(OPS), rng)
        assert len(world.m.backlog.earlier_waiters) > 0
    assert Checked.decided > 0  # some spot waits were found futile and checked
