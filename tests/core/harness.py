"""A machine and its agents on a virtual clock, for core tests that need agents in the loop:
batches with proper sequences, heartbeats while time passes, and either dispatches left to the
test (`cycle`) or acked as an agent would (`step`)."""

from __future__ import annotations

from typing import Any

from broker.core.effects import Effect, Publish, Send, refusal, split_reply
from broker.core.inputs import CYCLE, TICK, AgentBatch, DispatchAcked, SubmitJob
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
from schemas.config import BrokerConfig, QueueConfig, Timeouts
from schemas.job import CheckpointSpec, JobSpec, PodSet

T0 = 1_800_000_000.0
SPOT = FlavorInfo(name="spot", capacity_type="spot", gpu_type="A100", price_per_gpu_hour=1.0)
OD = FlavorInfo(name="od", capacity_type="on-demand", gpu_type="A100", price_per_gpu_hour=3.0)


def node(cluster: str, i: int, flavor: str = "spot") -> NodeInfo:
    """Node `i` of a cluster: 8 GPUs, 64 cores, 1 TiB."""
    return NodeInfo(name=f"{cluster}-{i}", flavor=flavor, gpu=8, cpu_milli=64_000, memory=2**40)


class Sim:
    """The machine and its agents on a virtual clock; `clusters` start with one 8-GPU
    on-demand node each, `cluster` adds more."""

    def __init__(
        self,
        clusters: tuple[str, ...] = ("a",),
        aliases: dict[str, str] | None = None,
        *,
        epoch: int = 1,
        **timeouts: Any,
    ) -> None:
        cfg = BrokerConfig(
            queues=[QueueConfig(name="q")],
            timeouts=Timeouts(**timeouts),
            queue_aliases=aliases or {},
        )
        self.m = Machine(cfg, epoch=epoch)
        self.now = T0
        self.seq: dict[str, int] = {}
        for c in clusters:
            self.cluster(c, 1, OD)

    @classmethod
    def empty(cls, **timeouts: Any) -> Sim:
        """No cluster yet (the test adds its own), at epoch 3 so that an epoch is never
        mistaken for an attempt number."""
        return cls((), epoch=3, **timeouts)

    def send(self, cluster: str, *events: Any, seq: int | None = None) -> list[Effect]:
        out = self.m.handle(self.batch(cluster, *events, seq=seq), self.now)
        assert refusal(out) is None
        return out

    def batch(self, cluster: str, *events: Any, seq: int | None = None) -> AgentBatch:
        """The cluster's next batch (its sequence taken, or `seq`), not yet handled."""
        self.seq[cluster] = self.seq.get(cluster, 0) + 1 if seq is None else seq
        batch = EventBatch(
            cluster=cluster, instance=f"{cluster}-i", seq=self.seq[cluster], events=list(events)
        )
        return AgentBatch(cluster, batch)

    def cluster(self, name: str, count: int = 1, flavor: FlavorInfo = SPOT) -> None:
        """A cluster reports `count` nodes of one flavor."""
        nodes = [node(name, i, flavor.name) for i in range(count)]
        self.send(name, ClusterSnapshot(flavors=[flavor], nodes=nodes))

    def submit(self, name: str = "j", gpu: int = 8, **kw: Any) -> str:
        spec = JobSpec(name=name, gang=[PodSet(name="w", replicas=1, gpu=gpu)], **kw)
        reply, _ = split_reply(self.m.handle(SubmitJob(spec, subject_queue="q"), self.now))
        assert reply.accepted and reply.job_id is not None, reply.error
        return reply.job_id

    def cycle(self, dt: float = 0.0) -> list[Effect]:
        """Time passes; every agent stays in touch; the broker ticks and admits."""
        self.now += dt
        out: list[Effect] = []
        for c in list(self.seq):
            out += self.send(c, Heartbeat(at=self.now))
        out += self.m.handle(TICK, self.now)
        out += self.m.handle(CYCLE, self.now)
        return out

    def step(self, dt: float) -> list[Effect]:
        """A `cycle` whose dispatches the agents ack and create, not yet running."""
        out = self.cycle(dt)
        for e in out:  # what the acks bring about is handled too
            if isinstance(e, Send) and isinstance(e.command, Dispatch):
                cmd = e.command
                self.m.handle(DispatchAcked(cmd.job_id, cmd.attempt, True, ""), self.now)
                made = WorkloadStatus(job_id=cmd.job_id, attempt=cmd.attempt, phase="created")
                out += self.send(e.cluster, made)
        return out


def sends(effects: list[Effect], kind: type) -> list[Any]:
    return [e.command for e in effects if isinstance(e, Send) and isinstance(e.command, kind)]


def cancels(effects: list[Effect]) -> list[Cancel]:
    return sends(effects, Cancel)


def events(effects: list[Effect]) -> list[str]:
    return [e.event.kind for e in effects if isinstance(e, Publish)]


def run(w: Sim, job_id: str, cluster: str, attempt: int) -> None:
    """The attempt's dispatch acked and its one replica running."""
    w.m.handle(DispatchAcked(job_id, attempt, True, ""), w.now)
    w.send(
        cluster,
        WorkloadStatus(
            job_id=job_id, attempt=attempt, phase="running", running_replicas=1, total_replicas=1
        ),
    )


def running_on_a(location: str) -> tuple[Sim, str]:
    """A job with a checkpoint location, its first attempt running on cluster "a"."""
    w = Sim.empty()
    w.cluster("a")
    job = w.submit(checkpoint=CheckpointSpec(uri=location))  # type: ignore[arg-type]
    w.cycle()
    run(w, job, "a", 1)
    return w, job
