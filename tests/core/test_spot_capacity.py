"""A spot pool at zero nodes is normal: feasibility judges what a pool can hold, not what it
holds now, so a spot-only job submitted while its pools are empty waits and runs when nodes
return."""

from __future__ import annotations

from broker.core.effects import Send
from broker.core.machine import Machine
from schemas.agent import ClusterSnapshot, Dispatch, EventBatch, NodeGone, NodeUpsert
from schemas.config import BrokerConfig, QueueConfig
from schemas.job import JobSpec, PodSet
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
        out = self.m.on_batch(self.cluster, batch, now)
        assert out.error is None, out.error


def spot_job(name: str, gpu: int = 8, replicas: int = 1) -> JobSpec:
    return JobSpec(
        name=name,
        job_id=name,
        queue="default",
        capacity="spot",
        gang=[PodSet(name="worker", replicas=replicas, gpu=gpu)],
    )


def setup() -> tuple[Machine, Agent]:
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


def test_spot_only_job_waits_for_an_empty_spot_pool_and_runs_when_nodes_return() -> None:
    m, agent = setup()
    reply, _ = m.submit(spot_job("wait-for-spot", replicas=2), NOW + 2)
    assert reply.accepted, reply.error
    assert dispatches(m.schedule(NOW + 3)) == []  # the on-demand node is not for it
    record = m.jobs["wait-for-spot"]
    assert record.state == "queued"
    codes = [r.code for r in m.reasons["wait-for-spot"]]
    assert codes == ["insufficient-capacity"], m.reasons["wait-for-spot"]

    # One spot node back is not enough for a 2-node gang; two are.
    agent.send(NodeUpsert(node=nodes("spot-back", "v100-spot", 1)[0]), now=NOW + 60)
    assert dispatches(m.schedule(NOW + 61)) == []
    agent.send(NodeUpsert(node=nodes("spot-again", "v100-spot", 1)[0]), now=NOW + 120)
    sent = dispatches(m.schedule(NOW + 121))
    assert [(d.job_id, d.flavor) for d in sent] == [("wait-for-spot", "v100-spot")]
    assert sorted(n for a in sent[0].assignment for n in a.nodes) == ["spot-again-0", "spot-back-0"]


def test_a_gang_bigger_than_the_pool_ever_was_is_still_rejected() -> None:
    m, _ = setup()
    reply, effects = m.submit(spot_job("too-big", replicas=3), NOW + 2)
    assert not reply.accepted
    assert "never be placed" in (reply.error or "")
    assert effects == [] and "too-big" not in m.jobs
    reply, _ = m.submit(spot_job("too-wide", gpu=16), NOW + 2)
    assert not reply.accepted


def test_a_spot_pool_that_never_had_nodes_cannot_vouch_for_a_job() -> None:
    m = Machine(BrokerConfig(queues=[QueueConfig(name="default")]))
    agent = Agent(m, "east")
    agent.send(
        ClusterSnapshot(
            flavors=[flavor("v100-spot", "spot", "v100", 0.9), flavor("v100-od", price=3.0)],
            nodes=nodes("od", "v100-od", 1),
        )
    )
    reply, _ = m.submit(spot_job("no-history"), NOW + 1)
    assert not reply.accepted
    assert "never be placed" in (reply.error or "")
