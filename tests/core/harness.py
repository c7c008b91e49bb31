"""A machine and its agents on a virtual clock, for core tests that need agents in the loop:
each cluster one 8-GPU on-demand node, batches with proper sequences, dispatches acked."""

from __future__ import annotations

from typing import Any

from broker.core.effects import Effect, Send, refusal, split_reply
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
from schemas.job import JobSpec, PodSet

T0 = 1_800_000_000.0
OD = FlavorInfo(name="od", capacity_type="on-demand", gpu_type="A100", price_per_gpu_hour=3.0)


class Sim:
    """The machine and its agents, each cluster one 8-GPU node, on a virtual clock."""

    def __init__(
        self,
        clusters: tuple[str, ...] = ("a",),
        aliases: dict[str, str] | None = None,
        **timeouts: Any,
    ) -> None:
        cfg = BrokerConfig(
            queues=[QueueConfig(name="q")],
            timeouts=Timeouts(**timeouts),
            queue_aliases=aliases or {},
        )
        self.m = Machine(cfg, epoch=1)
        self.now = T0
        self.seq: dict[str, int] = {}
        for c in clusters:
            node = NodeInfo(name=f"{c}-0", flavor="od", gpu=8, cpu_milli=64_000, memory=2**40)
            self.send(c, ClusterSnapshot(flavors=[OD], nodes=[node]))

    def send(self, cluster: str, *events: Any) -> list[Effect]:
        out = self.m.handle(self.batch(cluster, *events), self.now)
        assert refusal(out) is None
        return out

    def batch(self, cluster: str, *events: Any) -> AgentBatch:
        """The cluster's next batch (its sequence taken), not yet handled."""
        self.seq[cluster] = self.seq.get(cluster, 0) + 1
        batch = EventBatch(
            cluster=cluster, instance=f"{cluster}-i", seq=self.seq[cluster], events=list(events)
        )
        return AgentBatch(cluster, batch)

    def submit(self, **kw: Any) -> str:
        spec = JobSpec(name="j", gang=[PodSet(name="w", replicas=1, gpu=8)], **kw)
        reply, _ = split_reply(self.m.handle(SubmitJob(spec, subject_queue="q"), self.now))
        assert reply.job_id is not None, reply.error
        return reply.job_id

    def step(self, dt: float) -> list[Effect]:
        """Time passes; every agent stays in touch; the broker ticks and admits."""
        self.now += dt
        out: list[Effect] = []
        for c in self.seq:
            out += self.send(c, Heartbeat(at=self.now))
        out += self.m.handle(TICK, self.now)
        out += self.m.handle(CYCLE, self.now)
        for e in out:
            if isinstance(e, Send) and isinstance(e.command, Dispatch):
                cmd = e.command
                self.m.handle(DispatchAcked(cmd.job_id, cmd.attempt, True, ""), self.now)
                # As an agent does: the workload's objects are made, not yet running.
                made = WorkloadStatus(job_id=cmd.job_id, attempt=cmd.attempt, phase="created")
                out += self.send(e.cluster, made)
        return out


def cancels(effects: list[Effect]) -> list[Cancel]:
    return [e.command for e in effects if isinstance(e, Send) and isinstance(e.command, Cancel)]
