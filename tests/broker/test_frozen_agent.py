"""A frozen agent process (SIGSTOP) past the time the broker declares its cluster lost: the
job is re-dispatched elsewhere, and when the agent thaws (SIGCONT) its old copy is already
stopped by the cluster's fence, never running beside the new one."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import msgspec
import pytest

from schemas.agent import ClusterSnapshot, EventBatch, WorkloadStatus
from schemas.codec import decode_event_batch
from tests.broker.agentproc import fake_agent
from tests.broker.conftest import Harness, broker_config
from tests.broker.wire import next_item

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs SIGSTOP")


def _statuses(batch: EventBatch) -> list[WorkloadStatus]:
    out: list[WorkloadStatus] = []
    for ev in batch.events:
        if isinstance(ev, WorkloadStatus):
            out.append(ev)
        elif isinstance(ev, ClusterSnapshot):
            out.extend(ev.workloads)
    return out


async def test_frozen_agent_never_leaves_two_live_copies(harness: Harness) -> None:
    h = harness
    # Lost after 3 s of silence; agents' workloads are fenced 1 s before that.
    config = broker_config(h.prefix, lost_after_s=3.0, fence_lead_s=1.0)
    await h.start_broker(config)
    seen: list[tuple[float, WorkloadStatus]] = []

    async def on_c1(msg: Any) -> None:
        for status in _statuses(decode_event_batch(msg.data)):
            seen.append((time.monotonic(), status))

    await h.nc.subscribe(h.subjects.agent_events("c1"), cb=on_c1)
    async with fake_agent("c1", h.prefix, h.url) as proc:
        await h.wait_for(lambda: h.synced("c1"), 30)
        job = {
            "name": "frozen",
            "gang": [{"name": "w", "replicas": 1, "gpu": 8}],
            "workload": {"simulate": {"total_steps": 10**6, "steps_per_second": 10}},
        }
        job_id = (await h.submit(job)).job_id
        running = await h.wait_event(job_id, "running", timeout=20)
        assert running.cluster == "c1"
        spare = await h.agent("c2", count=1)
        os.kill(proc.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        # What a frozen process meets in practice: traffic piles up for it until the server
        # drops it as a slow consumer, so it reconnects on thaw (and its link looks fresh).
        junk = b"\x00" * 2**20
        for _ in range(80):  # bounded: 80 MiB, over the server's 64 MiB pending limit
            await h.nc.publish(h.subjects.agent_cmd("c1"), junk)
        await h.nc.flush()
        try:
            moved = await next_item(spare.dispatches, 20)
            assert (moved.job_id, moved.attempt) == (job_id, 2)
            moved_at = time.monotonic()
            assert moved_at - stopped_at >= 2.0  # not before the fence could lapse
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        thawed_at = time.monotonic()
        # The thawed agent speaks again (it is heard and resynced) ...
        await h.wait_for(lambda: h.synced("c1"), 20)

        def old_copy_ended() -> bool:
            return any(
                t >= thawed_at and (s.job_id, s.attempt) == (job_id, 1) and s.phase == "evicted"
                for t, s in seen
            )

        await h.wait_for(old_copy_ended, 20)  # what it says of the old copy is in
        # ... and never reports its old copy as alive: the fence stopped it.
        after = [s for t, s in seen if t >= thawed_at and s.job_id == job_id]
        alive = [s for s in after if s.attempt == 1 and s.phase in ("created", "running")]
        assert not alive, [msgspec.structs.asdict(s) for s in alive]
        assert h.kinds(job_id).count("running") >= 1
        # Stopped by the cluster at the fence, which is what it reports.
        ended = [s for s in after if s.attempt == 1]
        assert ended and all(s.phase == "evicted" and "fence" in s.reason for s in ended)
