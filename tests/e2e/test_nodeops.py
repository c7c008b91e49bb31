"""An operator's hands, end to end on a real nats-server with the fake fleet: `cordon` stops
placements on a node until `uncordon`, `drain` moves a running job from its checkpoint,
`notice` moves a spot job, and a bad request is answered with its reason, changing nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from broker.client import MusterClient, MusterError
from broker.nodeops import node_op
from schemas.natsopts import NatsOptions
from tests.support import wait_for
from tests.world import World, flavor, sim_job


@pytest_asyncio.fixture
async def ops(world: World) -> AsyncIterator[MusterClient]:
    h = world.harness
    async with MusterClient(NatsOptions(url=h.url), subjects=h.subjects) as client:
        yield client


async def test_cordon_holds_a_job_that_only_fits_there_until_uncordon(
    world: World, ops: MusterClient
) -> None:
    fleet = await world.start({"c1": [flavor("a100-od", "on-demand", nodes=1)]})
    h = world.harness
    (node,) = fleet["c1"].nodes
    reply = await node_op(ops, "c1", "cordon", node, reason="disk check")
    assert reply.ok and reply.nodes == [node]
    await h.wait_for(lambda: _broker_sees_cordon(world, "c1", node), 10)
    job_id = (await h.submit(sim_job("held", steps=40))).job_id
    await h.wait_event(job_id, "queued", timeout=10)

    async def waits_for_capacity() -> bool:
        why = await h.api("why", {"job_id": job_id})
        if not why["ok"]:
            return False
        codes = [r["code"] for r in why["result"]["reasons"]]
        # ... and its pool's line says the node is closed, not full
        pools = [c["message"] for c in why["result"].get("candidates", [])]
        return codes == ["insufficient-capacity"] and any("1 cordoned" in m for m in pools)

    await wait_for(waits_for_capacity, 10, what="`why` saying it waits for the cordoned node")
    assert not fleet.live_copies(job_id)
    assert (await world.job(job_id))["state"] == "queued"

    reply = await node_op(ops, "c1", "uncordon", node)
    assert reply.ok and reply.nodes == [node]
    running = await h.wait_event(job_id, "running", timeout=15)
    assert running.cluster == "c1"


async def test_drain_moves_a_running_job_from_its_checkpoint(
    world: World, ops: MusterClient
) -> None:
    fleet = await world.start(
        {
            "c1": [flavor("a100-od", "on-demand", nodes=1, price=1.0)],
            "c2": [flavor("a100-od", "on-demand", nodes=1, price=2.0)],
        }
    )
    h = world.harness
    job_id = (await h.submit(sim_job("drained", steps=100_000, rate=40.0, every=20))).job_id
    first = await h.wait_event(job_id, "running", timeout=15)
    assert first.cluster == "c1"
    await h.wait_for(lambda: (fleet.history(job_id)[0].last_checkpoint_step or 0) >= 20, 15)
    (node,) = fleet["c1"].nodes
    reply = await node_op(ops, "c1", "drain", node, reason="kernel upgrade")
    assert reply.ok and reply.nodes == [node] and reply.attempts == [f"{job_id}/1"]
    moved = await h.wait_event(job_id, "admitted", timeout=15, count=2)
    assert moved.cluster == "c2"
    ended = fleet.history(job_id)[0]
    assert ended.end_phase == "evicted" and ended.reason.startswith("node-drained")
    assert ended.last_checkpoint_step is not None
    assert moved.resume_from_step == ended.last_checkpoint_step
    await h.wait_event(job_id, "running", timeout=15, count=2)
    assert world.max_live_copies[job_id] == 1
    info = fleet["c1"].node_info(node)
    assert info is not None and info.no_new_pods and "kernel upgrade" in info.note


async def test_notice_moves_a_spot_job(world: World, ops: MusterClient) -> None:
    fleet = await world.start(
        {
            "c1": [
                flavor("a100-spot", "spot", nodes=1),
                flavor("a100-od", "on-demand", nodes=1, price=3.0),
            ]
        },
        spot_notice_s=8.0,
    )
    h = world.harness
    job_id = (await h.submit(sim_job("spotty", steps=100_000, capacity="any"))).job_id
    first = await h.wait_event(job_id, "running", timeout=15)
    assert first.flavor == "a100-spot"
    (spot_node,) = fleet["c1"].nodes_of("a100-spot")
    (od_node,) = fleet["c1"].nodes_of("a100-od")
    with pytest.raises(MusterError, match="on-demand capacity; only spot nodes"):
        await node_op(ops, "c1", "notice", od_node)
    reply = await node_op(ops, "c1", "notice", spot_node)
    assert reply.ok and reply.nodes == [spot_node]
    moved = await h.wait_event(job_id, "admitted", timeout=20, count=2)
    assert moved.flavor == "a100-od"
    assert [e.reason for e in h.events[job_id] if e.kind == "preempting"] == ["spot-notice"]


async def test_bad_requests_are_answered_and_change_nothing(
    world: World, ops: MusterClient
) -> None:
    fleet = await world.start({"c1": [flavor("a100-od", "on-demand", nodes=2)]})
    h = world.harness
    with pytest.raises(MusterError, match="has no node 'c1-nope'; its nodes: c1-a100-od-0"):
        await node_op(ops, "c1", "drain", "c1-nope")
    with pytest.raises(MusterError, match="no agent of cluster 'nowhere' answers"):
        await node_op(ops, "nowhere", "cordon", "x", timeout=2)
    with pytest.raises(MusterError, match="say so explicitly"):
        await node_op(ops, "c1", "cordon", None)
    subject = h.subjects.agent_nodeops("c1")
    for bad, expected in (
        (b'{"op": "reboot", "node": "c1-a100-od-0"}', "bad node operation request"),
        (b'{"op": "cordon", "node": "c1-a100-od-0", "force": true}', "force"),
        (b"not json", "bad node operation request"),
        (b'{"op": "cordon", "node": "c1-a100-od-0", "all_nodes": true}', "not both"),
    ):
        msg = await h.nc.request(subject, bad, timeout=5)
        assert b'"ok":false' in msg.data and expected.encode() in msg.data, msg.data
    assert not any(
        (info := fleet["c1"].node_info(n)) is not None and info.no_new_pods
        for n in fleet["c1"].nodes
    )
    every = await node_op(ops, "c1", "cordon", None, all_nodes=True)
    assert sorted(every.nodes) == sorted(fleet["c1"].nodes)


def _broker_sees_cordon(world: World, cluster: str, node: str) -> bool:
    """The broker's own inventory has taken the node out of placement."""
    broker = world.harness.broker
    if broker is None or broker.machine is None:
        return False
    known = broker.machine.scheduler.cluster_states().get(cluster)
    return known is not None and node in known.nodes and known.nodes[node].no_new_pods
