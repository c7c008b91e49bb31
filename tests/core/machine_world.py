"""The lifecycle machine driven as its shell would drive it: agents that speak through
EventBatches with proper sequences, at a clock the test moves."""

from __future__ import annotations

from typing import Any

from broker.core.effects import Effect, Publish, Send, refusal, split_reply
from broker.core.inputs import CYCLE, TICK, AgentBatch, DispatchAcked, SubmitJob
from broker.core.machine import Machine
from schemas.agent import (
    ClusterSnapshot,
    EventBatch,
    FlavorInfo,
    Heartbeat,
    NodeInfo,
    WorkloadStatus,
)
from schemas.config import BrokerConfig, QueueConfig, Timeouts
from schemas.job import CheckpointSpec, JobSpec, PodSet

T0 = 1_800_000_000.0
SPOT = FlavorInfo(name="spot", capacity_type="spot", gpu_type="A100", price_per_gpu_hour=1.0)
OD = FlavorInfo(name="od", capacity_type="on-demand", gpu_type="A100", price_per_gpu_hour=3.0)


def node(cluster: str, i: int, flavor: str = "spot") -> NodeInfo:
    return NodeInfo(name=f"{cluster}-{i}", flavor=flavor, gpu=8, cpu_milli=64_000, memory=2**40)


class World:
    """A machine plus agents that speak through EventBatches with proper sequences."""

    def __init__(self, **timeouts: Any) -> None:
        self.m = Machine(
            BrokerConfig(queues=[QueueConfig(name="q")], timeouts=Timeouts(**timeouts)), epoch=3
        )
        self.seq: dict[str, int] = {}
        self.now = T0

    def send(self, cluster: str, *events: Any, seq: int | None = None) -> list[Effect]:
        self.seq[cluster] = self.seq.get(cluster, 0) + 1 if seq is None else seq
        batch = EventBatch(
            cluster=cluster, instance=f"{cluster}-i", seq=self.seq[cluster], events=list(events)
        )
        out = self.m.handle(AgentBatch(cluster, batch), self.now)
        assert refusal(out) is None
        return out

    def cluster(self, name: str, count: int = 1, flavor: FlavorInfo = SPOT) -> None:
        self.send(
            name,
            ClusterSnapshot(
                flavors=[flavor], nodes=[node(name, i, flavor.name) for i in range(count)]
            ),
        )

    def submit(self, name: str = "j", gpu: int = 8, **kw: Any) -> str:
        spec = JobSpec(name=name, gang=[PodSet(name="w", replicas=1, gpu=gpu)], **kw)
        reply, _ = split_reply(self.m.handle(SubmitJob(spec, subject_queue="q"), self.now))
        assert reply.accepted, reply.error
        assert reply.job_id is not None
        return reply.job_id

    def cycle(self, dt: float = 0.0) -> list[Effect]:
        self.now += dt
        effects: list[Effect] = []
        for cluster in list(self.seq):  # the agents are alive
            effects += self.send(cluster, Heartbeat(at=self.now))
        effects += self.m.handle(TICK, self.now)
        effects += self.m.handle(CYCLE, self.now)
        return effects


def sends(effects: list[Effect], kind: type) -> list[Any]:
    return [e.command for e in effects if isinstance(e, Send) and isinstance(e.command, kind)]


def events(effects: list[Effect]) -> list[str]:
    return [e.event.kind for e in effects if isinstance(e, Publish)]


def run(w: World, job_id: str, cluster: str, attempt: int) -> None:
    w.m.handle(DispatchAcked(job_id, attempt, True, ""), w.now)
    w.send(
        cluster,
        WorkloadStatus(
            job_id=job_id, attempt=attempt, phase="running", running_replicas=1, total_replicas=1
        ),
    )


def running_on_a(location: str) -> tuple[World, str]:
    """A job with a checkpoint location, its first attempt running on cluster "a"."""
    w = World()
    w.cluster("a")
    job = w.submit(checkpoint=CheckpointSpec(uri=location))  # type: ignore[arg-type]
    w.cycle()
    run(w, job, "a", 1)
    return w, job
