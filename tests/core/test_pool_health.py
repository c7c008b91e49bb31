"""Dispatch breakers per cluster x flavor (broker/core/health.py) under a virtual clock: a
cluster that refuses every dispatch and one that acknowledges and never runs them, beside honest
ones; jobs finish on the honest ones, long before the start timeout."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Literal

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.core.effects import Effect, Send, split_reply
from broker.core.inputs import CYCLE, TICK, AgentBatch, DispatchAcked, SubmitJob
from broker.core.invariants import violations
from broker.core.machine import Machine
from schemas.agent import (
    Cancel,
    ClusterSnapshot,
    Dispatch,
    EventBatch,
    FlavorInfo,
    Heartbeat,
    NodeInfo,
    WorkloadStatus,
)
from schemas.config import BrokerConfig, QueueConfig, SchedulingConfig, Timeouts
from schemas.job import JobSpec, PodSet, RestartPolicy

T0 = 1_800_000_000.0
Behaviour = Literal["honest", "refuse", "swallow", "flaky", "quota"]
RUN_S = 5.0  # how long an honest cluster runs each job


@dataclass
class Fleet:
    """A machine and scripted agents, one behaviour per cluster, on a virtual clock."""

    behaviours: dict[str, Behaviour]
    prices: dict[str, float]
    rng: random.Random
    timeouts: dict[str, float] = field(default_factory=dict)
    now: float = T0
    seq: dict[str, int] = field(default_factory=dict)
    running: dict[tuple[str, int], tuple[str, float]] = field(default_factory=dict)
    dispatches: dict[str, int] = field(default_factory=dict)
    silent: set[str] = field(default_factory=set)  # clusters whose agents send nothing
    m: Machine = field(init=False)

    def __post_init__(self) -> None:
        self.m = Machine(
            BrokerConfig(
                queues=[QueueConfig(name="q")],
                timeouts=Timeouts(**self.timeouts),
                scheduling=SchedulingConfig(breaker_failures=3, breaker_cool_down_s=60.0),
            ),
            epoch=1,
        )
        for name in self.behaviours:
            flavor = FlavorInfo(
                name="od",
                capacity_type="on-demand",
                gpu_type="A100",
                price_per_gpu_hour=self.prices[name],
            )
            nodes = [
                NodeInfo(name=f"{name}-{i}", flavor="od", gpu=8, cpu_milli=64_000, memory=2**40)
                for i in range(4)
            ]
            self.send(name, ClusterSnapshot(flavors=[flavor], nodes=nodes))

    def send(self, cluster: str, *events: object) -> list[Effect]:
        self.seq[cluster] = self.seq.get(cluster, 0) + 1
        batch = EventBatch(
            cluster=cluster,
            instance=f"{cluster}-1",
            seq=self.seq[cluster],
            events=list(events),  # type: ignore[arg-type]
        )
        return self.m.handle(AgentBatch(cluster, batch), self.now)

    def submit(self, n: int) -> list[str]:
        ids = []
        for i in range(n):
            spec = JobSpec(
                name=f"j{i}",
                gang=[PodSet(name="w", replicas=1, gpu=8)],
                restart=RestartPolicy(backoff_s=2, max_backoff_s=20),
            )
            reply, _ = split_reply(self.m.handle(SubmitJob(spec, subject_queue="q"), self.now))
            assert reply.accepted and reply.job_id, reply.error
            ids.append(reply.job_id)
        return ids

    def step(self, dt: float = 1.0) -> None:
        """One second: heartbeats, honest workloads that end, timers, a cycle; then each
        agent answers the commands it got, as its behaviour says."""
        self.now += dt
        effects: list[Effect] = []
        for cluster in self.behaviours:
            if cluster in self.silent:
                continue
            ended = [
                WorkloadStatus(job_id=j, attempt=a, phase="succeeded")
                for (j, a), (c, end) in self.running.items()
                if c == cluster and end <= self.now
            ]
            for status in ended:
                del self.running[(status.job_id, status.attempt)]
            effects += self.send(cluster, Heartbeat(at=self.now), *ended)
        effects += self.m.handle(TICK, self.now)
        effects += self.m.handle(CYCLE, self.now)
        self.answer(effects)
        assert violations(self.m) == []

    def answer(self, effects: list[Effect]) -> None:
        pending = list(effects)
        while pending:
            e = pending.pop(0)
            if not isinstance(e, Send):
                continue
            cmd = e.command
            if isinstance(cmd, Cancel):
                self.running.pop((cmd.job_id, cmd.attempt or 0), None)
                continue
            if not isinstance(cmd, Dispatch):
                continue
            self.dispatches[e.cluster] = self.dispatches.get(e.cluster, 0) + 1
            behaviour = self.behaviours[e.cluster]
            if behaviour == "flaky":
                behaviour = self.rng.choice(["honest", "refuse", "swallow"])
            if behaviour == "quota":  # this job's namespace is full there: not the pool's fault
                why = "namespace team-a: exceeded quota: gpu, requested: 8, used: 8, limited: 8"
                pending += self.m.handle(
                    DispatchAcked(cmd.job_id, cmd.attempt, False, why, job_only=True), self.now
                )
                continue
            if behaviour == "refuse":
                pending += self.m.handle(
                    DispatchAcked(cmd.job_id, cmd.attempt, False, "webhook denied the request"),
                    self.now,
                )
                continue
            pending += self.m.handle(DispatchAcked(cmd.job_id, cmd.attempt, True, ""), self.now)
            if behaviour == "honest":
                self.running[(cmd.job_id, cmd.attempt)] = (e.cluster, self.now + RUN_S)
                pending += self.send(
                    e.cluster,
                    WorkloadStatus(
                        job_id=cmd.job_id,
                        attempt=cmd.attempt,
                        phase="running",
                        running_replicas=1,
                        total_replicas=1,
                    ),
                )

    def blocked(self, cluster: str) -> str | None:
        return self.m.scheduler.pool_blocked((cluster, "od"))

    def done(self, ids: list[str]) -> bool:
        return all(self.m.jobs[j].state in ("succeeded", "failed", "cancelled") for j in ids)


def test_refusing_and_swallowing_clusters_are_skipped_and_jobs_finish_on_honest_ones() -> None:
    fleet = Fleet(
        behaviours={"refuse": "refuse", "swallow": "swallow", "h1": "honest", "h2": "honest"},
        prices={"refuse": 0.5, "swallow": 0.8, "h1": 2.0, "h2": 3.0},
        rng=random.Random(1),
        timeouts={"start_s": 300.0, "dispatch_report_s": 20.0},
    )
    ids = fleet.submit(20)
    saw_open: set[str] = set()
    for _ in range(120):
        fleet.step()
        saw_open |= {c for c in ("refuse", "swallow") if fleet.blocked(c)}
        assert fleet.blocked("h1") is None and fleet.blocked("h2") is None
        if fleet.done(ids):
            break
    assert fleet.done(ids), {j: fleet.m.jobs[j].state for j in ids}
    # Well before the 300 s start timeout, every job ran on an honest cluster.
    assert fleet.now - T0 < 120
    for j in ids:
        record = fleet.m.jobs[j]
        assert record.state == "succeeded"
        assert record.attempts[-1].cluster in ("h1", "h2")
    assert saw_open == {"refuse", "swallow"}
    # The breakers opened after three different jobs failed there, not after every job.
    assert fleet.dispatches["refuse"] <= 4 and fleet.dispatches["swallow"] <= 4


def test_an_open_breaker_is_told_in_why_and_clusters_then_one_probe_decides() -> None:
    fleet = Fleet(
        behaviours={"refuse": "refuse", "h1": "honest"},
        prices={"refuse": 0.5, "h1": 2.0},
        rng=random.Random(2),
        timeouts={"dispatch_report_s": 20.0},
    )
    fleet.m.handle(TICK, fleet.now)
    ids = fleet.submit(12)
    while fleet.blocked("refuse") is None:
        fleet.step()
    # A job that waits for capacity says the refusing pool's breaker is open, and why.
    waiting = next(j for j in ids if fleet.m.jobs[j].state == "queued")
    why = fleet.m.views.why(waiting, fleet.now)
    assert why is not None
    open_ = [c for c in why.candidates if c.code == "circuit-open"]
    assert open_ and open_[0].cluster == "refuse", why.candidates
    assert "webhook denied" in open_[0].message
    (view,) = [v for v in fleet.m.views.cluster_views(fleet.now) if v.name == "refuse"]
    assert view.flavors[0].breaker == "open" and view.flavors[0].breaker_failures == 3
    # Cool-down: nothing goes there; then exactly one probe, refused again: open once more.
    before = fleet.dispatches["refuse"]
    for _ in range(59):
        fleet.step()
    assert fleet.dispatches["refuse"] == before
    fleet.submit(4)
    for _ in range(3):
        fleet.step()
    assert fleet.dispatches["refuse"] == before + 1
    assert fleet.blocked("refuse") is not None
    # The cluster is repaired: the next probe (after a doubled cool-down) closes the breaker.
    fleet.behaviours["refuse"] = "honest"
    for _ in range(125):
        fleet.step()
    assert fleet.blocked("refuse") is None
    ids2 = fleet.submit(2)
    for _ in range(10):
        fleet.step()
    assert "refuse" in {fleet.m.jobs[j].attempts[-1].cluster for j in ids2}


BEHAVIOURS = st.lists(st.sampled_from(["honest", "refuse", "swallow", "flaky"]), max_size=4)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(others=BEHAVIOURS, seed=st.integers(0, 2**16), jobs=st.integers(1, 12))
def test_the_breaker_never_stops_admission_to_an_honest_cluster(
    others: list[Behaviour], seed: int, jobs: int
) -> None:
    rng = random.Random(seed)
    behaviours: dict[str, Behaviour] = {"honest": "honest"}
    behaviours.update({f"c{i}": b for i, b in enumerate(others)})
    prices = {name: rng.uniform(0.1, 4.0) for name in behaviours}
    fleet = Fleet(behaviours, prices, rng, timeouts={"dispatch_report_s": 10.0})
    ids = fleet.submit(jobs)
    for _ in range(400):
        fleet.step()
        for name, b in behaviours.items():
            if b == "honest":
                assert fleet.blocked(name) is None, name
        if fleet.done(ids):
            break
    assert fleet.done(ids)
    assert all(fleet.m.jobs[j].state == "succeeded" for j in ids)


def test_a_refusal_for_one_job_alone_never_opens_the_pools_breaker() -> None:
    """A team namespace's full quota refuses that team's jobs on a cluster: each goes elsewhere
    at once, and the pool stays open to everyone else (one team cannot close it)."""
    fleet = Fleet(
        behaviours={"quota": "quota", "h1": "honest"},
        prices={"quota": 0.5, "h1": 2.0},
        rng=random.Random(3),
        timeouts={"dispatch_report_s": 20.0},
    )
    ids = fleet.submit(12)
    for _ in range(120):
        fleet.step()
        assert fleet.blocked("quota") is None
        if fleet.done(ids):
            break
    assert fleet.done(ids)
    assert all(fleet.m.jobs[j].attempts[-1].cluster == "h1" for j in ids)
    assert fleet.dispatches["quota"] >= 4  # more refusals than would open a breaker


def test_a_dispatch_swallowed_while_its_cluster_was_silent_is_found_once_it_is_back() -> None:
    """The report deadline passes while the cluster is unreachable (its health deals with
    that, not the breaker); once it beats again, the unreported dispatch counts at once."""
    fleet = Fleet(
        behaviours={"swallow": "swallow"},
        prices={"swallow": 1.0},
        rng=random.Random(7),
        timeouts={"start_s": 600.0, "dispatch_report_s": 10.0, "unreachable_after_s": 3.0},
    )
    (job_id,) = fleet.submit(1)
    fleet.step()
    record = fleet.m.jobs[job_id]
    assert record.current is not None and record.current.acked_at is not None
    fleet.silent.add("swallow")
    for _ in range(20):  # past the report deadline, unreachable all along
        fleet.step()
    assert record.start_failures == 0  # not judged while its cluster takes no placements
    fleet.silent.clear()
    for _ in range(3):
        fleet.step()
    assert record.start_failures == 1, record
    assert record.attempts[0].ended_at is not None
