"""Hostile and malformed messages on every subject the broker listens to. None may crash it,
and a good job submitted afterwards is admitted as usual."""

from __future__ import annotations

import random

import msgspec

from schemas.agent import (
    CheckpointReport,
    ClusterSnapshot,
    EventBatch,
    FlavorInfo,
    GpuHealth,
    NodeGone,
    NodeInfo,
    NodeUpsert,
    SpotNotice,
    WorkloadStatus,
)
from schemas.codec import encode_msgpack
from shell.natsio import flush
from tests.broker.conftest import Harness
from tests.broker.jobs import job


def _random_payloads(rng: random.Random, n: int) -> list[bytes]:
    valid = encode_msgpack(
        EventBatch(cluster="c1", instance="x", seq=1, events=[NodeGone(node="n")])
    )
    out: list[bytes] = [b"", b"\x00", b"\xc1", b"{}", b"[]", b"\xdc\xff\xff" + b"\x90" * 10]
    out.append(msgspec.msgpack.encode({"cluster": "c1", "instance": "x", "seq": 2**63}))
    out.append(msgspec.msgpack.encode([[[[[[[[[[[]]]]]]]]]]] * 100))
    out.append(b"\x91" * 100_000 + b"\x90")  # deep nesting
    for _ in range(n):
        kind = rng.randrange(3)
        if kind == 0:
            out.append(rng.randbytes(rng.randrange(1, 200)))
        elif kind == 1:
            cut = rng.randrange(1, len(valid))
            out.append(valid[:cut])
        else:
            data = bytearray(valid)
            for _ in range(rng.randrange(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            out.append(bytes(data))
    return out


def _hostile_batches(cluster: str) -> list[EventBatch]:
    """Well-formed messages with contents that make no sense."""
    flavor = FlavorInfo(name="f", capacity_type="spot", gpu_type="A100")
    weird_nodes = [
        NodeInfo(name="ghost-flavor", flavor="no-such-flavor", gpu=8),
        NodeInfo(name="n0", flavor="f", gpu=0, cpu_milli=0, memory=0),
        NodeInfo(name="n1", flavor="f", gpu=8, gpu_healthy=99, other_gpu=50),
        NodeInfo(name="n1", flavor="f", gpu=8),  # duplicate name
    ]
    events = [
        ClusterSnapshot(flavors=[flavor, flavor], nodes=weird_nodes),
        NodeUpsert(node=NodeInfo(name="x", flavor="nope", gpu=4)),
        NodeGone(node="never-existed"),
        GpuHealth(node="never-existed", healthy=0, xid=79),
        GpuHealth(node="n1", healthy=0),
        SpotNotice(node="never-existed", deadline=1.0),
        SpotNotice(node="n1", deadline=0.0),
        WorkloadStatus(job_id="nope", attempt=3, phase="running", running_replicas=99),
        WorkloadStatus(job_id="nope", attempt=1, phase="succeeded"),
        CheckpointReport(job_id="nope", attempt=1, step=10, uri="x"),
    ]
    return [
        EventBatch(cluster=cluster, instance="hostile", seq=i + 1, events=[e])
        for i, e in enumerate(events)
    ]


async def test_garbage_on_every_subject_changes_nothing(harness: Harness) -> None:
    h = harness
    broker = await h.start_broker()
    rng = random.Random(20261129)
    payloads = _random_payloads(rng, 150)
    subjects = [
        h.subjects.agent_events("c1"),
        h.subjects.api("get"),
        h.subjects.api("list"),
        h.subjects.api("cancel"),
        h.subjects.api("why"),
        h.subjects.checkpoint("job-x"),
        h.subjects.submit("default"),
    ]
    for data in payloads:
        for subject in subjects:
            await h.nc.publish(subject, data)
    hostile = _hostile_batches("c1")
    for batch in hostile:
        await h.nc.publish(h.subjects.agent_events("c1"), encode_msgpack(batch))
    # Markers behind the garbage on the ordered paths: a sane heartbeat from c1 and a real
    # submission (refused: nothing can hold it). Once the broker has answered the one and
    # counted the other, it has read everything sent before them.
    beat = EventBatch(cluster="c1", instance="hostile", seq=len(hostile) + 1, events=[])
    await h.nc.publish(h.subjects.agent_events("c1"), encode_msgpack(beat))
    await flush(h.nc)
    marker = await h.submit(job("marker", replicas=1, gpu=8))
    assert not marker.accepted and "can never be placed" in (marker.error or "")
    assert broker.machine is not None
    machine = broker.machine
    await h.wait_for(
        lambda: machine.agents.get("c1") is not None and machine.agents["c1"].seq == beat.seq
    )
    for data in payloads[:30]:
        msg = await h.nc.request(h.subjects.api("get"), data, timeout=5)
        assert b'"ok":false' in msg.data
    assert broker.machine is not None
    assert broker.stats["bad_batches"] > 0
    # No job came out of the garbage, and the hostile cluster's nonsense was absorbed.
    assert not broker.machine.jobs
    # The broker still works end to end.
    agent = await h.agent("c2")
    reply = await h.submit(job("after-the-storm", replicas=1, gpu=8))
    assert reply.accepted
    await h.wait_event(reply.job_id, "running")
    del agent
