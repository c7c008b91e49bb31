"""Copies of one Cancel that arrive while it waits its turn or is under way are answered by it:
the broker asks again when an answer is slow, and on kube each Cancel lists every workload
kind, so carrying out every copy spent the API budget the work itself needed."""

from __future__ import annotations

import asyncio

from schemas.agent import Cancel
from schemas.job import Simulation
from tests.agents.conftest import MakeAgent
from tests.agents.helpers import dispatch
from tests.support import wait_for

SLOW = Simulation(total_steps=100_000, steps_per_second=20.0, checkpoint_every=10)


async def test_copies_of_a_cancel_under_way_get_its_answer_and_a_later_one_runs(
    make_agent: MakeAgent,
) -> None:
    a = await make_agent()
    (n0,) = a.cluster.nodes_of("spot-a100")[:1]
    assert (await a.wire.send(dispatch("job-c", [n0], sim=SLOW))).ok
    await a.wire.wait_status("job-c", 1, "running")
    calls: list[tuple[str, int | None]] = []
    release = asyncio.Event()
    cancel = a.cluster.cancel

    async def slow_cancel(job_id: str, attempt: int | None, reason: str) -> None:
        calls.append((job_id, attempt))
        await release.wait()  # the API server takes its time
        await cancel(job_id, attempt, reason)

    a.cluster.cancel = slow_cancel  # type: ignore[method-assign]
    copy = Cancel(job_id="job-c", epoch=1, attempt=1, reason="moved")
    answers = [asyncio.ensure_future(a.wire.send(copy)) for _ in range(3)]
    await wait_for(lambda: a.runtime.stats["cancels_joined"] == 2, 5, what="copies joined")
    assert calls == [("job-c", 1)]
    release.set()
    assert all(ack.ok for ack in await asyncio.gather(*answers))
    assert calls == [("job-c", 1)] and a.cluster.live_workloads() == []
    # Once answered, a copy is carried out again (nothing is remembered past the answer).
    assert (await a.wire.send(copy)).ok
    assert calls == [("job-c", 1)] * 2
