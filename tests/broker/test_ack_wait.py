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


async def _backlog(harness: Harness, jobs: int, ack_s: float, ack_max_s: float) -> WireAgent:
    """A broker whose agent holds every Dispatch unanswered, and `jobs` jobs dispatched to it
    (one 8-GPU node each), their first copies received."""
    timeouts = msgspec.structs.replace(
        harness.config.timeouts, dispatch_ack_s=ack_s, dispatch_ack_max_s=ack_max_s
    )
    harness.config = msgspec.structs.replace(harness.config, timeouts=timeouts)
    await harness.start_broker()
    agent = await harness.agent("c1", count=jobs, ack=False, auto_run=False)
    await asyncio.gather(*(harness.submit(job(f"b{i}", replicas=1, gpu=8)) for i in range(jobs)))
    for _ in range(jobs):
        await next_item(agent.dispatches)
    return agent


async def _carry_out(agent: WireAgent, cmds: list[Dispatch], every_s: float) -> None:
    """What a busy agent reports while it works through its backlog: one more of the
    Dispatches it holds created every `every_s`, none of them answered yet."""
    for cmd in cmds:
        await agent.send(WorkloadStatus(job_id=cmd.job_id, attempt=cmd.attempt, phase="created"))
        await asyncio.sleep(every_s)


async def _answer(agent: WireAgent, job_ids: set[str]) -> None:
    """Acknowledge every copy the agent holds of these jobs' Dispatches."""
    for msg in list(agent.unanswered):
        cmd = decode_command(msg.data)
        if isinstance(cmd, Dispatch) and cmd.job_id in job_ids:
            agent.unanswered.remove(msg)
            await msg.respond(encode_msgpack(CommandAck(ok=True)))


def _held(agent: WireAgent) -> list[Dispatch]:
    return [c for c in agent.commands if isinstance(c, Dispatch)]


async def test_a_busy_agent_is_waited_for_and_then_asked_again_once_it_stops(
    harness: Harness,
) -> None:
    """Eight Dispatches held unanswered: while the agent reports one more of them created
    every 0.2 s, the last one is not sent again, though its 1 s wait ended; once the reports
    stop (the agent went quiet), it is asked again after one more wait. The ones reported
    created are asked again at their wait's end: they were carried out, and a copy of them
    is answered at once (broker/ackwait.py)."""
    agent = await _backlog(harness, jobs=8, ack_s=1.0, ack_max_s=10.0)
    held = _held(agent)
    *working, last = held
    await _carry_out(agent, working, every_s=0.2)  # 1.4 s: past the last one's first wait
    copies = [c for c in _held(agent)[len(held) :] if c.job_id == last.job_id]
    assert copies == [], "a busy agent was asked again"
    broker = harness.broker
    assert broker is not None and broker.stats["ack_waits_again"] >= 1
    await _answer(agent, {c.job_id for c in working})  # what it carried out is answered
    again: Dispatch = await next_item(agent.dispatches)
    while again.job_id != last.job_id:  # copies of the ones reported created came first
        assert again.job_id in {c.job_id for c in working}
        again = await next_item(agent.dispatches)
    assert again.attempt == last.attempt == 1
    await _answer(agent, {last.job_id})
    await harness.wait_for(lambda: broker.stats["dispatch_acked"] == len(held))
    for cmd in held:
        assert "requeued" not in harness.kinds(cmd.job_id), harness.kinds(cmd.job_id)


async def test_a_silent_agent_is_asked_again_though_it_heartbeats(harness: Harness) -> None:
    """Heartbeats say the agent lives, not that its Dispatches get done: asked again once the
    wait ends."""
    agent = await _backlog(harness, jobs=1, ack_s=0.5, ack_max_s=5.0)
    (sent,) = _held(agent)
    again: Dispatch = await next_item(agent.dispatches)  # after the 0.5 s wait
    assert (sent.job_id, sent.attempt) == (again.job_id, again.attempt)
    broker = harness.broker
    assert broker is not None and broker.stats["ack_retries"] >= 1


async def test_a_busy_agent_is_waited_for_no_longer_than_its_patience(harness: Harness) -> None:
    """A Dispatch of an agent that keeps carrying out others is asked again once it was
    waited for the ceiling times the copies allowed (0.6 s x 2 here), not for as long as the
    others keep coming."""
    agent = await _backlog(harness, jobs=13, ack_s=0.3, ack_max_s=0.6)
    *working, last = _held(agent)
    progress = asyncio.create_task(_carry_out(agent, working, every_s=0.2))  # 2.4 s
    try:
        again: Dispatch = await next_item(agent.dispatches, timeout=5.0)
        while again.job_id != last.job_id:
            again = await next_item(agent.dispatches, timeout=5.0)
        assert not progress.done(), "asked again only once the others stopped coming"
    finally:
        await cancel_and_wait(progress)
    broker = harness.broker
    assert broker is not None and broker.stats["ack_waits_again"] >= 1


async def test_a_dispatch_reported_created_is_asked_again_while_others_keep_its_agent_busy(
    harness: Harness,
) -> None:
    """A Dispatch its cluster reported created was carried out: a missing answer is lost or
    slow, not queued behind a backlog, so it is asked again when its wait ends (a copy is
    answered at once), even while the agent reports others created."""
    agent = await _backlog(harness, jobs=2, ack_s=2.0, ack_max_s=20.0)
    loop = asyncio.get_running_loop()
    sent_at = loop.time()
    done, busy = _held(agent)
    await _carry_out(agent, [done], every_s=0.5)
    await _carry_out(agent, [busy], every_s=0.0)  # progress within `done`'s wait
    again: Dispatch = await next_item(agent.dispatches, timeout=5.0)
    assert (again.job_id, again.attempt) == (done.job_id, done.attempt)
    assert loop.time() - sent_at < 3.0, "waited for as if its agent's backlog held it"
