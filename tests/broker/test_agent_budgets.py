"""One agent's snapshot storm costs its own cluster freshness, never the broker's liveness: the
API answers within a second throughout, other clusters keep working, and the counters name
the offender."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import sys
import time
from pathlib import Path

import nats

from broker.agentlink import AgentMailboxes, Bucket
from broker.service import Broker
from schemas.config import Limits
from tests.broker.conftest import OD_A100, Harness
from tests.broker.wire import WireAgent, nodes
from tests.support import wait_for

STORM = 60  # snapshots of 10,000 nodes (about 580 KB each), sent as fast as NATS takes them
# Publishes the length-prefixed batches on stdin to one subject, then flushes (the server has
# them all when it exits).
PUBLISH = """
import asyncio, sys, nats
async def main():
    nc = await nats.connect(sys.argv[1])
    data = sys.stdin.buffer.read()
    at = 0
    while at < len(data):
        size = int.from_bytes(data[at:at + 4], "big")
        await nc.publish(sys.argv[2], data[at + 4:at + 4 + size])
        at += 4 + size
    await nc.flush(30)
    await nc.close()
asyncio.run(main())
"""


async def test_a_snapshot_storm_leaves_the_api_answering(harness: Harness, tmp_path: Path) -> None:
    # The broker is set up as `muster broker` runs it: the agents' subjects on a connection of
    # their own (on one connection the storm's 35 MB queue ahead of every API request), and its
    # heap frozen for the cycle collector (shell/gcpacing.py; here the whole test process's,
    # which the collector would walk on each full pass during the storm).
    gc.freeze()
    try:
        await _snapshot_storm(harness, tmp_path)
    finally:
        gc.unfreeze()


async def _snapshot_storm(harness: Harness, tmp_path: Path) -> None:
    broker = await harness.start_broker(agent_connection=True)
    calm = await harness.agent("calm", count=2)
    storm_nc = await nats.connect(harness.url)
    storm = WireAgent(
        storm_nc, harness.subjects, "storm", [OD_A100], nodes("storm", OD_A100.name, 10_000)
    )
    await storm.start()
    await wait_for(lambda: harness.synced("storm"), 30, what="the storm cluster's first snapshot")
    latencies: list[float] = []
    done = asyncio.Event()

    async def probe() -> None:
        """API calls back to back, each with a one-second deadline, until the storm is over."""
        for _ in range(100_000):  # bounded
            if done.is_set():
                return
            started = time.monotonic()
            await harness.nc.request(harness.subjects.api("stats"), b"{}", timeout=1.0)
            latencies.append(time.monotonic() - started)

    # The storm comes from a process of its own, as from another cluster's agent: the
    # promise is about the broker's event loop, not the encoding of 35 MB beside it.
    storm.silent = True  # no heartbeats meanwhile, so the storm's sequence numbers run on
    snapshot = storm.snapshot()
    batches = tmp_path / "storm.bin"
    with batches.open("wb") as out:
        for _ in range(STORM):
            batch = storm.batch(snapshot)
            out.write(len(batch).to_bytes(4, "big") + batch)
    prober = asyncio.create_task(probe())
    try:
        with batches.open("rb") as stdin:
            sender = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                PUBLISH,
                harness.url,
                harness.subjects.agent_events("storm"),
                stdin=stdin,
            )
            assert await asyncio.wait_for(sender.wait(), 60) == 0
        storm.silent = False
        # The broker has taken the whole storm: the coalesced snapshots are counted.
        await wait_for(
            lambda: (
                sum(n for (c, _), n in broker.agent_drops().items() if c == "storm") >= STORM // 2
            ),
            30,
            what="the storm's snapshots coalesced",
        )
        # Another cluster keeps working meanwhile: a job is placed and runs there.
        reply = await harness.submit(
            {"name": "during", "gang": [{"name": "w", "replicas": 1, "gpu": 8}], "gpu_types": []}
        )
        assert reply.accepted, reply.error
        await harness.wait_event(reply.job_id, "running", timeout=10)
        assert broker.machine is not None
        assert broker.machine.jobs[reply.job_id].attempts[-1].cluster in ("calm", "storm")
    finally:
        done.set()
        with contextlib.suppress(asyncio.CancelledError):
            await prober  # raises if a call went unanswered for a second
        await storm.stop()
        await storm_nc.close()
    assert broker.leading.is_set()
    assert len(latencies) >= 5
    assert (await harness.api("stats"))["epoch"] == broker.lease.epoch
    assert not any(c == "calm" for (c, _) in broker.agent_drops())
    del calm


def test_a_mailbox_keeps_the_newest_snapshot_and_paces_the_rest() -> None:
    limits = Limits(
        agent_msgs_per_s=10, agent_burst_msgs=2, agent_snapshots_per_s=1, agent_pending_bytes=100
    )
    mail = AgentMailboxes(limits, 0.0)
    delta = b"\x84\xa7cluster\xa1c" + b"d" * 30
    snap = b"\x84\xa7cluster\xa1c\xa6events\x91\x83\xa4type\xa8snapshot" + b"s"
    for _ in range(2):
        assert mail.offer("c", delta, 0.0) is None
    assert mail.offer("c", delta, 0.0) == "over-budget"  # 100 bytes waiting at most
    assert mail.offer("c", snap, 0.0) == "coalesced"  # the snapshot replaces both deltas
    assert mail.offer("quiet", delta, 0.0) is None
    assert mail.take(0.0) == ("c", snap)
    assert mail.take(0.0) == ("quiet", delta)  # clusters in turn
    for _ in range(3):
        assert mail.offer("c", delta, 0.0) in (None, "over-budget")
    assert mail.take(0.0) == ("c", delta)  # the burst of two messages is spent
    wait = mail.take(0.0)
    assert isinstance(wait, float) and 0.09 <= wait <= 0.11  # 10 messages/s
    assert mail.take(0.1) == ("c", delta)
    assert mail.dropped() == {("c", "over-budget"): 2, ("c", "coalesced"): 2}


def test_a_message_larger_than_the_burst_waits_for_a_full_bucket() -> None:
    bucket = Bucket(rate=10.0, burst=100.0, tokens=40.0, at=0.0)
    assert not bucket.ready(500)
    assert bucket.wait(500) == 6.0
    bucket.refill(6.0)
    assert bucket.ready(500)


async def test_agent_events_on_their_own_connection_cut_leaves_the_broker_serving(
    harness: Harness,
) -> None:
    """nats-server cuts a slow consumer's connection; the agents' events have one of their
    own, so losing it costs agent freshness, not the lease, the API or submissions."""
    agent_nc = await nats.connect(harness.url, max_reconnect_attempts=0)
    main_nc = await nats.connect(harness.url)
    broker = Broker(harness.config, main_nc, agent_nc=agent_nc)
    harness.broker = broker
    harness.task = asyncio.create_task(broker.run())
    await asyncio.wait_for(broker.leading.wait(), 15)
    await harness.agent("calm", count=2)  # its events arrive on the agents' connection
    assert broker.stats["batches"] >= 1
    assert agent_nc.stats["in_msgs"] >= 1  # the batches came on the agents' connection
    await agent_nc.close()  # as nats-server does to a slow consumer
    reply = await harness.submit({"name": "after", "gang": [{"name": "w", "gpu": 8}]})
    assert reply.accepted, reply.error
    assert (await harness.api("stats"))["epoch"] == broker.lease.epoch
    assert broker.leading.is_set()
