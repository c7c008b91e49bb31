"""Slow acks make the broker wait longer, never start a second attempt: the adaptive ack wait
(broker/ackwait.py) and the retry that counts the ack of any copy it sent."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import generate_latest

from agents.fake.cluster import FakeCluster
from broker.ackwait import AckWait, AckWaits
from schemas.agent import CommandAck, Dispatch, WorkloadStatus
from schemas.codec import decode_command, encode_msgpack
from schemas.config import Timeouts
from shell.tasks import cancel_and_wait
from tests.broker.conftest import Harness
from tests.broker.jobs import job
from tests.broker.wire import WireAgent, next_item
from tests.support import wait_for
from tests.world import flavor, open_world

SEED = 20261202
JOBS = 150
# The fake cluster's API takes this long per create, one request at a time: the 150th Dispatch
# is acked about 3 s after the first, far beyond a 0.3 s floor and the old fixed retries (four
# copies 0.3 s each, about 1.9 s in all).
API_REQUEST_S = 0.02

rtts = st.floats(min_value=0.0, max_value=100.0, allow_nan=False)


@given(st.lists(rtts, max_size=50), st.integers(min_value=0, max_value=40))
def test_wait_stays_between_floor_and_ceiling_and_grows_with_retries(
    samples: list[float], retry: int
) -> None:
    w = AckWait(floor=0.5, ceiling=20.0)
    for s in samples:
        w.observe(s)
    assert 0.5 <= w.wait(retry) <= 20.0
    assert w.wait(retry) <= w.wait(retry + 1)


def test_wait_follows_the_observed_round_trips() -> None:
    w = AckWait(floor=2.0, ceiling=20.0)
    assert w.wait() == 2.0 and w.wait(1) == 4.0 and w.wait(5) == 20.0
    for _ in range(20):
        w.observe(0.01)  # fast acks: the floor holds
    assert w.wait() == 2.0
    for _ in range(5):
        w.observe(3.0)  # a slow moment: the wait rises above the slowest ack seen
    assert w.wait() > 3.0
    waits = AckWaits(Timeouts(dispatch_ack_s=2.0, dispatch_ack_max_s=1.0))
    assert waits.of("c1").wait(3) == 2.0, "a ceiling below the floor means the floor"


def slow_api(cluster: FakeCluster, per_request_s: float) -> None:
    """Make the cluster's API take `per_request_s` for each create, one request at a time
    (a loaded API server); the agent's runtime is unchanged."""
    lock = asyncio.Lock()
    create = cluster.dispatch

    async def dispatch(cmd: Dispatch) -> None:
        async with lock:
            await asyncio.sleep(per_request_s)  # the request's time on the API server
            await create(cmd)

    cluster.dispatch = dispatch  # type: ignore[method-assign]


@pytest.mark.usefixtures("two_burners")
async def test_a_batch_acked_slowly_needs_no_second_attempt(nats_url: str) -> None:
    rng = random.Random(SEED)
    async with open_world(
        nats_url, dispatch_ack_s=0.3, dispatch_retries=3, dispatch_ack_max_s=5.0
    ) as world:
        fleet = await world.start({"c1": [flavor("od", "on-demand", nodes=40)]})
        slow_api(fleet["c1"], API_REQUEST_S)
        h = world.harness
        jobs: list[dict[str, Any]] = [
            {"name": f"j{i}", "gang": [{"name": "w", "replicas": 1, "gpu": rng.choice([1, 2])}]}
            for i in range(JOBS)
        ]
        replies = await asyncio.gather(*(h.submit(j) for j in jobs))
        ids = [r.job_id for r in replies]
        assert all(ids), replies
        broker = h.broker
        assert broker is not None

        def settled() -> bool:
            return broker.stats["dispatch_acked"] + broker.stats["dispatch_failed"] >= JOBS

        await wait_for(settled, 60, what=f"{JOBS} dispatches acked or failed")
        stats = broker.stats
        assert stats["dispatch_failed"] == 0, stats
        slow = stats["ack_retries"] + stats["ack_waits_again"]
        assert slow > 0, "no ack was slower than the floor: nothing was tested"
        metrics = generate_latest(broker.metrics.registry).decode()
        assert f'muster_command_resends_total{{kind="resent"}} {stats["ack_retries"]}.0' in metrics
        busy = stats["ack_waits_again"]
        assert f'muster_command_resends_total{{kind="busy"}} {busy}.0' in metrics
        for job_id in ids:
            history = fleet.history(job_id)
            assert [r.attempt for r in history] == [1], (job_id, history)
            assert "requeued" not in h.kinds(job_id), (job_id, h.kinds(job_id))


async def test_a_refused_copy_does_not_outvote_a_later_copy_carried_out(harness: Harness) -> None:
    """The agent runs a job's commands one after the other, so when the first copy of a
    Dispatch failed, the retried copy may still create the attempt: its ack decides, and the
    job is not sent to a second attempt while the first runs."""
    await harness.start_broker()
    agent = await harness.agent("c1", count=1)
    agent.ack = False
    job_id = (await harness.submit(job("r", replicas=1, gpu=8))).job_id
    first: Dispatch = await next_item(agent.dispatches)
    second: Dispatch = await next_item(agent.dispatches)  # resent after the floor, 0.3 s
    assert (first.job_id, first.attempt) == (second.job_id, second.attempt) == (job_id, 1)
    copy1, copy2 = [m for m in agent.unanswered if isinstance(decode_command(m.data), Dispatch)]
    await copy1.respond(encode_msgpack(CommandAck(ok=False, error="API server busy")))
    await copy2.respond(encode_msgpack(CommandAck(ok=True)))
    await agent.send(
        WorkloadStatus(job_id=job_id, attempt=1, phase="running", running_replicas=1,
                       total_replicas=1)
    )  # fmt: skip
    await harness.wait_event(job_id, "running")
    assert "requeued" not in harness.kinds(job_id), harness.kinds(job_id)
    assert harness.broker is not None and harness.broker.stats["dispatch_failed"] == 0


async def _created_while_held(agent: WireAgent, cmd: Dispatch, held_s: float) -> None:
    """What a busy agent sends while it works through a Dispatch it has not acked: the
    workload it created, reported again and again (the broker takes it as progress)."""
    created = WorkloadStatus(job_id=cmd.job_id, attempt=cmd.attempt, phase="created")
    loop = asyncio.get_running_loop()
    until = loop.time() + held_s
    while loop.time() < until:
        await agent.send(created)
        await asyncio.sleep(0.05)


async def test_a_busy_agent_is_waited_for_and_a_silent_one_asked_again(harness: Harness) -> None:
    """A Dispatch held unacked for three times the ack wait is not sent again while its
    cluster reports the workload it is creating (a busy agent, broker/ackwait.py); one whose
    cluster only heartbeats is asked again once the wait ends."""
    timeouts = msgspec.structs.replace(
        harness.config.timeouts, dispatch_ack_s=0.5, dispatch_ack_max_s=5.0, dispatch_retries=1
    )
    harness.config = msgspec.structs.replace(harness.config, timeouts=timeouts)
    await harness.start_broker()
    agent = await harness.agent("c1", count=2, ack=False, auto_run=False)
    broker = harness.broker
    assert broker is not None

    busy = (await harness.submit(job("busy", replicas=1, gpu=8))).job_id
    first: Dispatch = await next_item(agent.dispatches)
    assert first.job_id == busy
    await _created_while_held(agent, first, held_s=1.5)
    assert agent.dispatches.empty(), "a busy agent was asked again"
    assert broker.stats["ack_retries"] == 0 and broker.stats["ack_waits_again"] >= 2
    (copy,) = [m for m in agent.unanswered if isinstance(decode_command(m.data), Dispatch)]
    await copy.respond(encode_msgpack(CommandAck(ok=True)))
    await harness.wait_for(lambda: broker.stats["dispatch_acked"] == 1)
    assert "requeued" not in harness.kinds(busy), harness.kinds(busy)

    # Heartbeats say the agent lives, not that its commands get done: asked again.
    silent = (await harness.submit(job("silent", replicas=1, gpu=8))).job_id
    sent: Dispatch = await next_item(agent.dispatches)
    again: Dispatch = await next_item(agent.dispatches)  # after the 0.5 s wait
    assert (sent.job_id, sent.attempt) == (again.job_id, again.attempt) == (silent, 1)
    assert broker.stats["ack_retries"] >= 1


async def test_a_busy_agent_is_waited_for_no_longer_than_its_patience(harness: Harness) -> None:
    """An agent that reports progress but never acks is asked again once the command was
    waited for the ceiling times the copies allowed (0.6 s x 2 here), not forever."""
    timeouts = msgspec.structs.replace(
        harness.config.timeouts, dispatch_ack_s=0.3, dispatch_ack_max_s=0.6, dispatch_retries=1
    )
    harness.config = msgspec.structs.replace(harness.config, timeouts=timeouts)
    await harness.start_broker()
    agent = await harness.agent("c1", count=2, ack=False, auto_run=False)
    job_id = (await harness.submit(job("stuck", replicas=1, gpu=8))).job_id
    first: Dispatch = await next_item(agent.dispatches)
    progress = asyncio.create_task(_created_while_held(agent, first, held_s=10.0))
    try:
        again: Dispatch = await next_item(agent.dispatches, timeout=5.0)
    finally:
        await cancel_and_wait(progress)
    assert (again.job_id, again.attempt) == (job_id, 1)
    broker = harness.broker
    assert broker is not None and broker.stats["ack_waits_again"] >= 1
