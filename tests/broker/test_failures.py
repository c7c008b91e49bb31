"""Failure paths of the broker service: agents that stop acking, clusters that go silent,
stale attempts, sequence gaps, a crashed leader and a standby taking over."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from schemas.agent import Cancel, Dispatch, EventBatch, Heartbeat, Resync, WorkloadStatus
from schemas.codec import encode_msgpack
from tests.broker.conftest import Harness
from tests.broker.jobs import job
from tests.broker.wire import next_item
from tests.support import wait_for


async def test_agent_that_stops_acking_rolls_back_and_requeues(harness: Harness) -> None:
    await harness.start_broker()
    mute = await harness.agent("mute", count=2)
    mute.ack = False
    reply = await harness.submit(job("a", replicas=1, gpu=8, restart={"backoff_s": 0.2}))
    job_id = reply.job_id
    await next_item(mute.dispatches)
    requeued = await harness.wait_event(job_id, "requeued", timeout=10)
    assert "did not ack" in (requeued.reason or "")
    # The reservation was rolled back: a healthy cluster takes the job next.
    mute.ack = True
    healthy = await harness.agent("healthy", count=1)
    await harness.wait_event(job_id, "running", timeout=10)
    view = (await harness.api("get", {"job_id": job_id}))["result"]
    assert view["state"] == "running"
    assert view["attempts"][0]["end_cause"].startswith("dispatch-failed")
    assert view["attempts"][-1]["attempt"] == view["attempt"]
    del healthy


async def test_unreachable_then_lost_cluster_requeues_its_jobs(harness: Harness) -> None:
    await harness.start_broker()
    doomed = await harness.agent("doomed", count=1)
    reply = await harness.submit(job("b", replicas=1, gpu=8))
    job_id = reply.job_id
    await harness.wait_event(job_id, "running")
    doomed.silent = True  # no heartbeats from "doomed" from now on
    await harness.wait_for(
        lambda: harness.broker.machine.agents["doomed"].health == "unreachable",
        5,  # type: ignore[union-attr]
    )
    spare = await harness.agent("spare", count=1)
    # Unreachable is not lost: the job stays where it is until the longer timeout.
    assert harness.kinds(job_id)[-1] == "running"
    requeued = await harness.wait_event(job_id, "requeued", timeout=10)
    assert requeued.reason == "cluster-lost"
    dispatch: Dispatch = await next_item(spare.dispatches)
    assert dispatch.job_id == job_id and dispatch.attempt == 2
    await harness.wait_event(job_id, "running", count=2)
    # The lost cluster comes back still running attempt 1: it must be told to delete it.
    doomed.instance = "restarted"
    doomed.silent = False
    doomed.workloads = [
        WorkloadStatus(
            job_id=job_id, attempt=1, phase="running", running_replicas=1, total_replicas=1
        )
    ]
    await doomed.send(doomed.snapshot(), seq=1)
    cancel: Cancel = await next_item(doomed.cancels)
    assert cancel.job_id == job_id and cancel.attempt == 1
    view = (await harness.api("get", {"job_id": job_id}))["result"]
    assert view["state"] == "running" and view["cluster"] == "spare"


async def test_stale_attempt_report_gets_a_cancel(harness: Harness) -> None:
    await harness.start_broker()
    agent = await harness.agent("c1")
    reply = await harness.submit(job("c", replicas=1, gpu=8))
    await harness.wait_event(reply.job_id, "running")
    await agent.send(
        WorkloadStatus(
            job_id=reply.job_id, attempt=7, phase="running", running_replicas=1, total_replicas=1
        )
    )
    cancel: Cancel = await next_item(agent.cancels)
    assert (cancel.job_id, cancel.attempt) == (reply.job_id, 7)
    # A report about a job the broker never heard of is fenced the same way.
    await agent.send(WorkloadStatus(job_id="ghost", attempt=1, phase="created"))
    cancel = await next_item(agent.cancels)
    assert cancel.job_id == "ghost"
    view = (await harness.api("get", {"job_id": reply.job_id}))["result"]
    assert view["state"] == "running" and view["attempt"] == 1


async def test_sequence_gap_and_foreign_cluster_claims(harness: Harness) -> None:
    await harness.start_broker()
    agent = await harness.agent("c1")
    await agent.send(Heartbeat(at=0.0), seq=agent.seq + 5)  # a gap
    await harness.wait_for(lambda: any(isinstance(c, Resync) for c in agent.commands))
    # A payload that claims another cluster is rejected and changes nothing.
    forged = EventBatch(cluster="c2", instance="x", seq=1, events=[])
    await harness.nc.publish(harness.subjects.agent_events("c1"), encode_msgpack(forged))
    await harness.nc.publish(harness.subjects.agent_events("c1"), b"\xc1garbage")
    await harness.wait_for(lambda: harness.broker.stats["bad_batches"] >= 2)  # type: ignore[union-attr]
    assert "c2" not in harness.broker.machine.agents  # type: ignore[union-attr]
    reply = await harness.submit(job("d", replicas=1, gpu=8))
    assert reply.accepted


async def test_crash_and_restart_loses_nothing_and_runs_nothing_twice(harness: Harness) -> None:
    await harness.start_broker()
    agent = await harness.agent("c1", count=8)

    def dispatched() -> list[Dispatch]:
        return [c for c in agent.commands if isinstance(c, Dispatch)]

    ids = []
    for i in range(40):
        reply = await harness.submit(job(f"r{i}", replicas=1, gpu=4))
        ids.append(reply.job_id)
    await harness.wait_for(lambda: sum(1 for j in ids if "running" in harness.kinds(j)) == 16)
    for j in ids[:3]:
        await agent.finish(j, 1)
    # Three jobs end, three queued ones take their place: 19 dispatches in all.
    await harness.wait_for(lambda: len(dispatched()) == 19)
    # Events go out after the records they report are persisted: once all 19 ran and three
    # ended, the store holds what the list shows.
    await harness.wait_for(
        lambda: (
            sum(1 for j in ids if "running" in harness.kinds(j)) == 19
            and all("succeeded" in harness.kinds(j) for j in ids[:3])
        )
    )
    before = {j["job_id"]: j for j in (await harness.api("list", {}))["result"]}
    assert sum(1 for j in before.values() if j["state"] == "succeeded") == 3
    await harness.crash_broker()
    # The crashed leader's lease must expire before the new one leads; the agent resyncs
    # and its snapshot lists every workload it runs.
    broker = await harness.start_broker()
    assert broker.stats["redispatched"] == 0  # every dispatch was acknowledged before
    await harness.wait_for(lambda: any(isinstance(c, Resync) for c in agent.commands), 10)
    # The snapshot was applied and the admission cycle after it has run (it would have
    # admitted or requeued anything the new leader got wrong).
    machine = broker.machine
    assert machine is not None
    await harness.wait_for(lambda: harness.synced("c1") and not machine.wants_cycle)
    after = {j["job_id"]: j for j in (await harness.api("list", {}))["result"]}
    assert set(after) == set(before)
    for job_id, view in before.items():
        assert after[job_id]["state"] == view["state"], job_id
        assert after[job_id].get("attempt", 0) == view.get("attempt", 0)
    assert len(dispatched()) == 19  # nothing was started again
    # Capacity accounting survived: finishing three more admits exactly three more.
    running = [j for j, v in after.items() if v["state"] == "running"][:3]
    for j in running:
        await agent.finish(j, 1)
    await harness.wait_for(lambda: sum(1 for j in ids if "running" in harness.kinds(j)) == 22)
    # The cycles that admitted the three admitted nothing else: the cluster is full again.
    stats = await harness.api("stats")
    assert (stats["live"], stats["pending"]) == (16, 18), stats
    keys = [(c.job_id, c.attempt) for c in dispatched()]
    assert len(keys) == 22 and len({k[0] for k in keys}) == 22


async def test_standby_takes_over_while_jobs_dispatch(harness: Harness) -> None:
    import nats

    from broker.service import Broker

    leader = await harness.start_broker()
    standby_nc = await nats.connect(harness.url)
    standby = Broker(harness.config, standby_nc, holder="standby")
    standby_task = asyncio.create_task(standby.run())
    agent = await harness.agent("c1", count=16)
    ids = []
    for i in range(20):
        ids.append((await harness.submit(job(f"s{i}", replicas=1, gpu=2))).job_id)
    old_epoch = leader.lease.epoch
    await harness.crash_broker()
    await asyncio.wait_for(standby.leading.wait(), 10)
    assert standby.lease.epoch > old_epoch
    await harness.wait_for(lambda: any(isinstance(c, Resync) for c in agent.commands), 10)
    for i in range(20, 30):
        ids.append((await harness.submit(job(f"s{i}", replicas=1, gpu=2))).job_id)

    # A job runs when the new leader's record says so and the agent runs that attempt. Its
    # `running` event is no proof (docs/protocol.md): the old leader may have written the
    # record (its ack write carries the deferred `running`) and died before publishing the
    # event, and the new leader restores the record without announcing it again. Jobs
    # submitted after the takeover must announce it: their leader does not crash.
    def runs(job_id: str) -> bool:
        machine = standby.machine
        record = machine.jobs.get(job_id) if machine is not None else None
        listed = {(w.job_id, w.attempt) for w in agent.workloads if w.phase == "running"}
        return (
            record is not None
            and record.state == "running"
            and (job_id, record.attempt) in listed
            and (job_id in ids[:20] or "running" in harness.kinds(job_id))
        )

    try:
        await harness.wait_for(lambda: all(runs(j) for j in ids), 30)
    except AssertionError as exc:
        machine = standby.machine
        late = {
            j: (machine.jobs[j].state if machine and j in machine.jobs else None, harness.kinds(j))
            for j in ids
            if not runs(j)
        }
        raise AssertionError(f"jobs not running (leader's state, events): {late}") from exc
    dispatches = [c for c in agent.commands if isinstance(c, Dispatch)]
    assert len({c.job_id for c in dispatches}) == 30
    assert len({(c.job_id, c.attempt) for c in dispatches}) == 30
    # A dispatch the old leader persisted but never saw acknowledged is sent again by the new
    # one (same attempt, its own epoch), which agents treat as a duplicate.
    seen: dict[tuple[str, int], int] = {}
    for c in dispatches:
        key = (c.job_id, c.attempt)
        assert key not in seen or c.epoch > seen[key], "the same dispatch was sent twice"
        seen[key] = c.epoch
    assert {c.epoch for c in dispatches if c.job_id in ids[20:]} == {standby.lease.epoch}
    await standby.stop()
    await standby_task
    await standby_nc.close()


async def test_broker_rides_out_a_nats_restart(fresh_nats: Any) -> None:
    """NATS goes away and comes back (same port and store): the broker reconnects, keeps its
    state and its leadership, and takes new jobs."""
    import nats

    from broker.service import Broker
    from tests.broker.conftest import broker_config
    from tests.broker.wire import WireAgent, nodes

    opts: dict[str, Any] = {"max_reconnect_attempts": -1, "reconnect_time_wait": 0.2}
    prefix = "restart"
    config = broker_config(
        prefix,
        lease_ttl_s=10.0,
        lost_after_s=30.0,
        unreachable_after_s=10.0,
        dispatch_retries=5,  # subscriptions take a moment to come back after a reconnect
    )
    bnc = await nats.connect(fresh_nats.url, **opts)
    cnc = await nats.connect(fresh_nats.url, **opts)
    broker = Broker(config, bnc)
    task = asyncio.create_task(broker.run())
    try:
        await asyncio.wait_for(broker.leading.wait(), 15)
        subjects = broker.subjects
        from tests.broker.conftest import OD_A100

        agent = await WireAgent(cnc, subjects, "c1", [OD_A100], nodes("c1", "a100-od", 2)).start()

        async def submit(name: str) -> Any:
            async def answered() -> Any:
                # One job id for every copy: a copy whose reply was lost to the restart and the
                # copy sent again are one job (the second answered as a duplicate), as for a
                # client that retries with its job id.
                spec = job(name, 1, 8, restart={"backoff_s": 0.2}, job_id=f"{name}-{prefix}")
                try:
                    msg = await cnc.request(subjects.submit("default"), _enc(spec), 2)
                except Exception:
                    return None  # NATS or the broker's subscriptions are not back yet
                return __import__("msgspec").json.decode(msg.data)

            return await wait_for(answered, 30, what=f"a reply to {name!r}", interval=0.1)

        first = await submit("before")
        assert first["accepted"]

        def state_of(job_id: str) -> str | None:
            record = broker.machine.jobs.get(job_id) if broker.machine else None
            return record.state if record else None

        await wait_for(lambda: state_of(first["job_id"]) == "running", what="the first job runs")
        epoch = broker.lease.epoch
        fresh_nats.stop_sync()
        await wait_for(lambda: not bnc.is_connected and not cnc.is_connected, 10)
        fresh_nats.start_sync()
        second = await submit("after")
        assert second["accepted"]
        await wait_for(
            lambda: state_of(second["job_id"]) in ("admitted", "running"),
            30,
            what="the job submitted after the restart is admitted",
        )
        machine = broker.machine
        assert machine is not None and broker.lease.epoch == epoch
        assert machine.jobs[first["job_id"]].state == "running"
        assert machine.jobs[second["job_id"]].state in ("admitted", "running")
        await agent.stop()
    finally:
        await broker.stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 15)
        await bnc.close()
        await cnc.close()


def _enc(obj: Any) -> bytes:
    from schemas.codec import encode_json

    return encode_json(obj)
