"""`kill -9` of a real broker process with several hundred jobs in every state, then a restart:
every job is recovered in the state it had, nothing is dispatched twice, and the capacity the
running jobs hold is accounted exactly (finishing N jobs admits exactly N more)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from broker.store import JobStore
from load.common import BrokerProcess
from schemas.agent import Dispatch, SpotNotice
from tests.broker.conftest import Harness, broker_config
from tests.broker.jobs import job
from tests.support import wait_for


async def _states(h: Harness) -> dict[str, dict[str, Any]]:
    reply = await h.api("list", {"limit": 10_000})
    assert reply["ok"], reply
    return {j["job_id"]: j for j in reply["result"]}


async def _at_least(count: Callable[[], Awaitable[int]], n: int) -> bool:
    return await count() >= n


async def test_kill9_and_restart_with_hundreds_of_jobs(harness: Harness) -> None:
    h = harness
    config = broker_config(
        h.prefix,
        lost_after_s=30.0,
        unreachable_after_s=10.0,
        checkpoint_grace_s=300.0,
        lease_ttl_s=2.0,
    )
    broker = BrokerProcess(h.url, config)
    broker.start()
    try:
        await broker.wait_leading(h.nc)
        agent = await h.agent("c1", count=40)  # 320 GPUs

        async def inventory_known() -> bool:
            clusters = (await h.api("clusters"))["result"]
            return bool(clusters and clusters[0].get("flavors"))

        await wait_for(inventory_known, 10, what="the broker's view of c1")

        def dispatched() -> list[Dispatch]:
            return [c for c in agent.commands if isinstance(c, Dispatch)]

        ids: list[str] = []
        for i in range(400):
            spec = job(
                f"k{i}",
                replicas=1,
                gpu=[1, 2, 4, 8][i % 4],
                checkpoint={"uri": f"s3://c/k{i}"},
                restart={"max_restarts_on_error": 0},
            )
            reply = await h.submit(spec)
            assert reply.accepted, reply.error
            ids.append(reply.job_id)
        await h.wait_for(lambda: len(dispatched()) >= 60, 20)

        async def sixty_running() -> bool:  # the broker has read their running statuses
            return sum(v["state"] == "running" for v in (await _states(h)).values()) >= 60

        await wait_for(sixty_running, 20, what="60 running jobs")
        running = [d.job_id for d in dispatched()]
        # Drive jobs into every state.
        for j in running[:20]:
            await agent.finish(j, 1, "succeeded")
        for j in running[20:30]:
            await agent.finish(j, 1, "failed")
        for j in ids[-15:]:
            assert (await h.api("cancel", {"job_id": j}))["ok"]
        victim = next(d for d in dispatched() if d.job_id in running[40:])
        node = victim.assignment[0].nodes[0]
        await agent.send(SpotNotice(node=node, deadline=time.time() + 3600))
        every_state = {"queued", "running", "preempting", "succeeded", "failed", "cancelled"}

        store = await JobStore.open(h.nc.jetstream(), h.subjects.jobs_bucket, nc=h.nc)

        async def persisted_in_every_state() -> dict[str, dict[str, Any]] | None:
            """Jobs in every state, each state as written to the store (what a restart
            reads back), not only as the running broker holds it."""
            states = await _states(h)
            if not every_state <= {v["state"] for v in states.values()}:
                return None
            stored = {r.job_id: r.state for r in await store.load_all(10)}
            same = all(stored.get(j) == v["state"] for j, v in states.items())
            return states if same else None

        before = await wait_for(persisted_in_every_state, 20, what="every state persisted")
        n_dispatched = len(dispatched())

        broker.kill9()
        broker.start()
        await broker.wait_leading(h.nc, timeout=60)
        await h.wait_for(
            lambda: sum(1 for c in agent.commands if type(c).__name__ == "Resync") > 0, 20
        )

        async def batches_taken() -> int:
            reply = await h.nc.request(h.subjects.api("stats"), b"{}")
            return int(msgspec.json.decode(reply.data).get("batches", 0))

        # The resync snapshot and two heartbeats behind it are in: the new leader has seen
        # the cluster as it is, and whatever it would redo it has done.
        await wait_for(lambda: _at_least(batches_taken, 3), 20, what="three batches read")
        after = await _states(h)
        assert set(after) == set(before) == set(ids)
        changed = {
            j: (before[j]["state"], after[j]["state"])
            for j in ids
            if before[j]["state"] != after[j]["state"]
        }
        assert not changed, changed
        assert len(dispatched()) == n_dispatched  # nothing started again
        keys = [(d.job_id, d.attempt) for d in dispatched()]
        assert len(keys) == len(set(keys))
        live = Counter(w.job_id for w in agent.workloads)
        assert all(n == 1 for n in live.values())

        # Quotas and capacity survived exactly: finishing five running jobs admits more,
        # and every admitted job fits on the nodes (the agent would refuse over-commit).
        still_running = [j for j, v in after.items() if v["state"] == "running"][:5]
        for j in still_running:
            await agent.finish(j, after[j]["attempt"], "succeeded")
        await h.wait_for(lambda: len(dispatched()) > n_dispatched, 20)
        used: Counter[str] = Counter()
        gpus = {d.job_id: d.spec.gang[0].gpu for d in dispatched()}
        for w in agent.workloads:
            d = next(x for x in dispatched() if (x.job_id, x.attempt) == (w.job_id, w.attempt))
            used[d.assignment[0].nodes[0]] += gpus[w.job_id]
        assert max(used.values()) <= 8
        stats = msgspec.json.decode((await h.nc.request(h.subjects.api("stats"), b"{}")).data)
        assert stats["restored_jobs"] == 400
    finally:
        broker.cleanup()
