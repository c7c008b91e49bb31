"""A machine on one cluster ("east") whose spot pool the provider has emptied, an agent that
numbers its batches, and spot job specs: what the spot-capacity tests start from."""

from __future__ import annotations

from typing import Any

from broker.core.effects import Effect, Send, refusal
from broker.core.inputs import AgentBatch
from broker.core.machine import Machine
from broker.core.records import SPOT_OK_LABEL
from schemas.agent import ClusterSnapshot, Dispatch, EventBatch, NodeGone, WorkloadStatus
from schemas.config import BrokerConfig, QueueConfig
from schemas.job import CapacityPreference, JobSpec, PodSet
from tests.core.helpers import NOW, flavor, nodes


class Agent:
    """Numbers the batches of one cluster as a real agent does."""

    def __init__(self, machine: Machine, cluster: str) -> None:
        self.m = machine
        self.cluster = cluster
        self.seq = 0

    def send(self, *events: object, now: float = NOW) -> None:
        self.seq += 1
        batch = EventBatch(
            cluster=self.cluster,
            instance="a-1",
            seq=self.seq,
            events=list(events),  # type: ignore[arg-type]
        )
        out = self.m.handle(AgentBatch(self.cluster, batch), now)
        assert refusal(out) is None, refusal(out)


# A job that writes no checkpoint but says spot is fine for it (records.spot_ok): placed as
# one that checkpoints is, spot first.
SPOT_OK = {SPOT_OK_LABEL: "true"}


def spot_job(
    name: str,
    gpu: int = 8,
    replicas: int = 1,
    capacity: CapacityPreference = "spot",
    **extra: Any,
) -> JobSpec:
    return JobSpec(
        name=name,
        job_id=name,
        queue="default",
        capacity=capacity,
        gang=[PodSet(name="worker", replicas=replicas, gpu=gpu)],
        **extra,
    )


def setup() -> tuple[Machine, Agent]:
    """A machine whose "east" cluster reported two spot nodes and one on-demand node, then lost
    both spot nodes."""
    m = Machine(BrokerConfig(queues=[QueueConfig(name="default")]))
    agent = Agent(m, "east")
    agent.send(
        ClusterSnapshot(
            flavors=[flavor("v100-spot", "spot", "v100", 0.9), flavor("v100-od", price=3.0)],
            nodes=nodes("spot", "v100-spot", 2) + nodes("od", "v100-od", 1),
        )
    )
    # The provider takes every spot node away.
    agent.send(NodeGone(node="spot-0"), NodeGone(node="spot-1"), now=NOW + 1)
    return m, agent


def dispatches(effects: list[object]) -> list[Dispatch]:
    return [e.command for e in effects if isinstance(e, Send) and isinstance(e.command, Dispatch)]


def running(agent: Agent, d: Dispatch, now: float) -> None:
    """The agent reports the dispatch's one replica running on its first node."""
    node = d.assignment[0].nodes[0]
    events: list[object] = [
        WorkloadStatus(
            job_id=d.job_id,
            attempt=d.attempt,
            phase="running",
            running_replicas=1,
            total_replicas=1,
            nodes=[node],
        )
    ]
    agent.send(*events, now=now)


def live_attempts(m: Machine, job_id: str) -> int:
    return sum(1 for a in m.jobs[job_id].attempts if a.live)


def sends(effects: list[Effect], kind: type) -> list[object]:
    return [e.command for e in effects if isinstance(e, Send) and isinstance(e.command, kind)]
