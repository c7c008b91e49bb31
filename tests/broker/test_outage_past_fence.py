"""A broker away for longer than the clusters' fence, with jobs submitted meanwhile. The
agent's gate refuses a Dispatch that would start an attempt once the broker has not
acknowledged its cluster for the fence (`agents/gate.py`), so the leader that comes back must
have the agent's resync acknowledged before its first Dispatches there reach it: otherwise
they are refused as read late, the jobs go elsewhere and the pool's breaker opens."""

from __future__ import annotations

import asyncio

from schemas.codec import encode_json
from tests.broker.agentproc import fake_agent
from tests.broker.conftest import Harness, broker_config

JOB = {
    "name": "after-outage",
    "gang": [{"name": "w", "replicas": 1, "gpu": 1}],
    "workload": {"simulate": {"total_steps": 10**6, "steps_per_second": 10}},
}


async def test_the_first_dispatches_after_an_outage_past_the_fence_start_work(
    harness: Harness,
) -> None:
    h = harness
    config = broker_config(h.prefix, lost_after_s=3.0, fence_lead_s=1.0)  # a fence of 2 s
    await h.start_broker(config)
    await h.follow_events()
    async with fake_agent("c1", h.prefix, h.url):
        await h.wait_for(lambda: h.synced("c1"), 30)
        await h.crash_broker()
        await asyncio.sleep(4.0)  # twice the fence: the agent's gate holds it lapsed
        ids = [f"o-{i}" for i in range(6)]
        for job_id in ids:  # stored while no broker leads: the next one admits them
            await h.nc.publish(h.subjects.submit("default"), encode_json({**JOB, "job_id": job_id}))
        await h.nc.flush()
        broker = await h.start_broker(config)
        for job_id in ids:
            await h.wait_event(job_id, "running", timeout=30)
        for job_id in ids:
            attempts = {e.attempt for e in h.events[job_id] if e.attempt}
            assert attempts == {1}, [(e.kind, e.attempt, e.reason) for e in h.events[job_id]]
        assert broker.stats["dispatch_failed"] == 0


async def test_a_node_freed_during_the_outage_takes_the_waiting_job_at_once(
    harness: Harness,
) -> None:
    """The ending the agent kept through the outage and the Dispatch of the job that waited
    for its node arrive together: the `Applied` of the first must reach the agent first."""
    h = harness
    config = broker_config(h.prefix, lost_after_s=3.0, fence_lead_s=1.0)  # a fence of 2 s
    await h.start_broker(config)
    await h.follow_events()
    whole = {**JOB, "gang": [{"name": "w", "replicas": 1, "gpu": 8}]}  # the agent's one node
    async with fake_agent("c1", h.prefix, h.url):
        await h.wait_for(lambda: h.synced("c1"), 30)
        first = (await h.submit({**whole, "name": "first"})).job_id
        await h.wait_event(first, "running", timeout=30)
        waiting = (await h.submit({**whole, "name": "waiting"})).job_id
        await h.wait_event(waiting, "queued")
        await h.crash_broker()
        # Twice the fence: the agent ends the first job at its fence and keeps the ending.
        await asyncio.sleep(4.0)
        broker = await h.start_broker(config)
        await h.wait_event(waiting, "running", timeout=30)
        attempts = {e.attempt for e in h.events[waiting] if e.attempt}
        assert attempts == {1}, [(e.kind, e.attempt, e.reason) for e in h.events[waiting]]
        assert broker.stats["dispatch_failed"] == 0
