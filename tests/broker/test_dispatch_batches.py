"""Dispatches to one cluster in one request (wire 1.3): an admission cycle's Dispatches reach a
1.3 agent as one DispatchBatch, an older agent one by one, and each job's fate follows its own
ack, a late answer to the batch, or the Dispatch asked again alone."""

from __future__ import annotations

from typing import Any

from prometheus_client import generate_latest

from broker.service import Broker
from schemas.agent import CommandAck, Dispatch, DispatchAcks, DispatchBatch
from schemas.codec import encode_msgpack
from schemas.wire import WIRE_VERSION
from tests.broker.conftest import OD_A100, Harness, broker_config
from tests.broker.jobs import job
from tests.broker.wire import WireAgent, nodes
from tests.support import wait_for


async def queued(harness: Harness, count: int) -> list[str]:
    """`count` one-node jobs, queued while no cluster can take them."""
    return [(await harness.submit(job(f"q{i}", replicas=1, gpu=8))).job_id for i in range(count)]


def dispatching(agent: WireAgent) -> list[type]:
    """The kinds of the dispatching commands the agent received, in order."""
    return [type(cmd) for cmd in agent.commands if isinstance(cmd, Dispatch | DispatchBatch)]


def requests_metric(broker: Broker) -> dict[str, int]:
    """`muster_dispatch_requests_total` by kind, as Prometheus scrapes it."""
    text = generate_latest(broker.metrics.registry).decode()
    return {
        kind: int(float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        for kind in ("single", "batch")
        if line.startswith(f'muster_dispatch_requests_total{{kind="{kind}"}}')
    }


async def view(harness: Harness, job_id: str) -> Any:
    return (await harness.api("get", {"job_id": job_id}))["result"]


async def test_a_cycle_sends_a_cluster_its_dispatches_in_one_request(harness: Harness) -> None:
    broker = await harness.start_broker()
    ids = await queued(harness, 5)
    agent = await harness.agent("batched", count=5, wire=WIRE_VERSION)
    for job_id in ids:
        await harness.wait_event(job_id, "running")
    assert dispatching(agent) == [DispatchBatch]
    sent = agent.batches[0].dispatches
    assert sorted(d.job_id for d in sent) == sorted(ids)
    assert {d.attempt for d in sent} == {1}
    placed = [node for d in sent for a in d.assignment for node in a.nodes]
    assert len(placed) == len(set(placed)) == 5  # one job a node: none over-committed
    assert broker.stats["dispatch_batches"] == broker.stats["dispatch_requests"] == 1
    assert broker.stats["dispatch_acked"] == 5 and broker.stats["ack_retries"] == 0
    assert requests_metric(broker) == {"single": 0, "batch": 1}


async def test_an_agent_before_wire_1_3_gets_one_dispatch_a_request(harness: Harness) -> None:
    broker = await harness.start_broker()
    ids = await queued(harness, 5)
    agent = await harness.agent("older", count=5, wire="1.2")
    for job_id in ids:
        await harness.wait_event(job_id, "running")
    assert dispatching(agent) == [Dispatch] * 5
    assert broker.stats["dispatch_batches"] == 0 and broker.stats["dispatch_requests"] == 5
    assert broker.stats["dispatch_acked"] == 5
    assert requests_metric(broker) == {"single": 5, "batch": 0}


async def test_a_late_answer_to_a_batch_is_each_jobs_ack(harness: Harness) -> None:
    broker = await harness.start_broker(broker_config(harness.prefix, dispatch_retries=3))
    ids = await queued(harness, 4)
    agent = await harness.agent("slow", count=4, wire=WIRE_VERSION, ack=False)
    # The batch went unanswered past its wait, so each Dispatch was asked again alone.
    await wait_for(lambda: len(dispatching(agent)) == 5, 10, what="the batch and 4 copies")
    assert dispatching(agent) == [DispatchBatch] + [Dispatch] * 4
    # Every command went unanswered, in the order received.
    batch = agent.unanswered[[type(c) for c in agent.commands].index(DispatchBatch)]
    await batch.respond(encode_msgpack(DispatchAcks(acks=[CommandAck(ok=True)] * 4)))
    await wait_for(lambda: broker.stats["dispatch_acked"] == 4, 10, what="4 dispatches acked")
    for job_id in ids:
        got = await view(harness, job_id)
        assert got["attempt"] == 1 and len(got["attempts"]) == 1
        assert "requeued" not in harness.kinds(job_id)
    assert broker.stats["late_acks"] == 4 and broker.stats["dispatch_failed"] == 0


async def test_a_batch_refused_as_such_goes_again_one_dispatch_a_request(
    harness: Harness,
) -> None:
    broker = await harness.start_broker()
    ids = await queued(harness, 3)
    unknown = "undecodable command: unknown tag 'dispatch_batch'"
    agent = await harness.agent("picky", count=3, wire=WIRE_VERSION, refuse_batches=unknown)
    for job_id in ids:
        await harness.wait_event(job_id, "running")
        assert (await view(harness, job_id))["attempt"] == 1
    assert dispatching(agent) == [DispatchBatch] + [Dispatch] * 3
    assert broker.stats["dispatch_acked"] == 3 and broker.stats["dispatch_failed"] == 0


async def test_each_job_of_a_batch_follows_its_own_ack(harness: Harness) -> None:
    await harness.start_broker()
    ids = await queued(harness, 4)
    refused, taken = ids[1], [ids[0], *ids[2:]]
    agent = await harness.agent("choosy", count=4, wire=WIRE_VERSION, refuse_jobs={refused})
    for job_id in taken:
        await harness.wait_event(job_id, "running")
    requeued = await harness.wait_event(refused, "requeued")
    assert f"job {refused} refused here" in (requeued.reason or "")
    assert dispatching(agent)[0] is DispatchBatch
    assert len(agent.batches[0].dispatches) == 4
    for job_id in taken:
        assert (await view(harness, job_id))["attempt"] == 1
        assert "requeued" not in harness.kinds(job_id)


async def test_a_batch_nobody_hears_is_sent_again_one_by_one_then_requeued(
    harness: Harness,
) -> None:
    broker = await harness.start_broker()
    agent = await harness.agent("deaf", count=0, wire=WIRE_VERSION)
    await agent.stop_answering()  # its heartbeats go on: the cluster stays healthy
    ids = await queued(harness, 3)
    agent.nodes = nodes("deaf", OD_A100.name, 3)
    await agent.send(agent.snapshot())  # room for all three: one cycle admits them together
    for job_id in ids:
        requeued = await harness.wait_event(job_id, "requeued")
        assert "no agent is listening for cluster 'deaf'" in (requeued.reason or "")
    assert broker.stats["dispatch_batches"] >= 1
    # Each Dispatch was asked again alone after the batch went unheard.
    assert broker.stats["ack_retries"] >= len(ids)
