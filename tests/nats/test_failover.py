"""`kill -9` of NATS servers under a broker and a fake fleet with jobs flowing, on a real
three-server cluster with R3 streams: the server leading the submission stream, then the one
leading the job bucket, then the JetStream meta leader; then a rolling restart of all three.
Nothing acknowledged is lost, nothing runs twice, and the broker serves again within a bound
(the measured times are printed; docs/operations.md quotes them)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

from broker.service import Broker
from load.natscluster import NatsCluster
from schemas.config import Replication
from tests.nats.world import ClusterWorld, cluster_world, connect
from tests.support import wait_for

R3 = Replication(replicas=3)
SERVE_AGAIN_S = 30.0  # the bound: JetStream elects within ~10 s, the lease TTL is 2 s
MAX_JOBS = 600


class Flow:
    """Submits one job after another (each retried with its id until acknowledged) while a
    fault runs, so every fault lands on jobs in flight."""

    def __init__(self, world: ClusterWorld) -> None:
        self.world = world
        self.task: asyncio.Task[None] | None = None
        self.count = 0

    async def _run(self) -> None:
        while self.count < MAX_JOBS:
            await self.world.submit_until_accepted(f"f{self.count:04d}", timeout=SERVE_AGAIN_S)
            self.count += 1
            await asyncio.sleep(0.05)  # pacing: about 15 jobs a second at most

    def start(self) -> None:
        self.task = asyncio.create_task(self._run())

    async def accepted_after(self, t: float, n: int = 3) -> float:
        """Wait for `n` acknowledgements after `t`; returns the first one's delay."""

        def after() -> list[float]:
            assert self.task is not None
            if self.task.done():
                self.task.result()  # a submission that never got through fails the test
            times = sorted(at for at in self.world.accepted.values() if at > t)
            return times if len(times) >= n else []

        times = await wait_for(after, SERVE_AGAIN_S, what=f"{n} jobs acknowledged")
        return times[0] - t

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task


async def _restore(cluster: NatsCluster, world: ClusterWorld, name: str) -> None:
    """Start the server again and wait until every stream has three current replicas."""
    cluster.start(name)
    await cluster.ready()
    js = world.nc.jetstream()
    s = world.subjects
    for stream in (s.submit_stream, f"KV_{s.jobs_bucket}", f"KV_{s.leader_bucket}"):
        await cluster.replicas_current(js, stream, 3)


async def _check_nothing_lost_or_twice(world: ClusterWorld) -> None:
    states = await world.all_accepted_succeeded(timeout=60)
    assert world.accepted and set(world.accepted) <= set(states)
    assert world.fleet is not None
    runs: dict[str, int] = {}
    for c in world.fleet.clusters.values():
        for job_id, attempts in c.history.items():
            runs[job_id] = runs.get(job_id, 0) + len(attempts)
    twice = {j: n for j, n in runs.items() if n != 1}
    assert not twice, f"jobs started more than once: {twice}"
    assert max(world.max_live_copies.values()) == 1


async def test_kill9_of_each_leader_loses_nothing(nats_cluster: NatsCluster) -> None:
    async with cluster_world(nats_cluster, R3, lease_ttl_s=5.0) as w:
        broker = await w.start_broker()
        epoch = broker.lease.epoch
        await w.start_fleet()
        js = w.nc.jetstream()
        s = w.subjects
        flow = Flow(w)
        flow.start()
        await flow.accepted_after(0.0, n=10)

        leaders: list[tuple[str, Callable[[], Awaitable[str]]]] = [
            ("submission stream", lambda: nats_cluster.stream_leader(js, s.submit_stream)),
            ("job bucket", lambda: nats_cluster.stream_leader(js, f"KV_{s.jobs_bucket}")),
            ("meta leader", nats_cluster.meta_leader),
        ]
        measured = {}
        for what, leader in leaders:
            victim = await leader()
            killed_at = time.monotonic()
            nats_cluster.server(victim).kill9()
            measured[what] = await flow.accepted_after(killed_at)
            await _restore(nats_cluster, w, victim)
            await flow.accepted_after(time.monotonic())
        await flow.stop()
        await _check_nothing_lost_or_twice(w)
        # The leader rode out every election (suspended while the lease bucket had none): it
        # never stepped down and restored.
        assert (broker.lease.epoch, broker.stats["lead_failures"]) == (epoch, 0)
        assert broker.leading.is_set()
        print(f"\nserving again after kill -9 of the leader of (s): {measured}")
        print(f"jobs acknowledged: {len(w.accepted)}")


async def test_rolling_restart_costs_nothing(nats_cluster: NatsCluster) -> None:
    async with cluster_world(nats_cluster, R3) as w:
        await w.start_broker()
        await w.start_fleet()
        flow = Flow(w)
        flow.start()
        await flow.accepted_after(0.0, n=10)
        gaps = {}
        for server in nats_cluster.servers:
            stopped_at = time.monotonic()
            server.stop()
            gaps[server.name] = await flow.accepted_after(stopped_at)
            await _restore(nats_cluster, w, server.name)
            await flow.accepted_after(time.monotonic())
        await flow.stop()
        await _check_nothing_lost_or_twice(w)
        print(f"\nfirst acknowledgement after each clean stop (s): {gaps}")


async def test_rolling_upgrade_of_the_brokers_standby_first_loses_nothing(
    nats_cluster: NatsCluster,
) -> None:
    """docs/operations.md, "Upgrades": the standby is replaced first, then the leader is
    stopped (its lease passes to the new standby) and comes back as the standby."""
    async with cluster_world(nats_cluster, R3, lease_ttl_s=5.0) as w:
        first = await w.start_broker()
        await w.start_fleet()
        standby = await Standby.start(w)
        flow = Flow(w)
        flow.start()
        await flow.accepted_after(0.0, n=10)

        await standby.stop()  # 1. the standby, replaced by the new release
        assert await first.lease.current() == first.holder, "the standby released the lease"
        upgraded = await Standby.start(w)
        await flow.accepted_after(time.monotonic())
        await w.stop_broker()  # 2. the leader: the upgraded standby takes over
        await wait_for(upgraded.broker.leading.is_set, 30, what="the upgraded standby leading")
        assert upgraded.broker.lease.epoch > first.lease.epoch
        again = await Standby.start(w)  # 3. the old leader, upgraded, stands by
        await flow.accepted_after(time.monotonic(), n=10)
        await flow.stop()
        await _check_nothing_lost_or_twice(w)
        assert not again.broker.leading.is_set()
        for b in (upgraded, again):
            await b.stop()


class Standby:
    """A second broker on the world's config: it mirrors the bucket and waits for the lease."""

    def __init__(self, broker: Broker, task: asyncio.Task[None]) -> None:
        self.broker = broker
        self.task = task

    @classmethod
    async def start(cls, world: ClusterWorld) -> Standby:
        nc = await connect(world.cluster, "broker")
        broker = Broker(world.config, nc)
        standby = cls(broker, asyncio.create_task(broker.run()))
        await wait_for(lambda: broker.mirror is not None or broker.leading.is_set(), 30)
        return standby

    async def stop(self) -> None:
        await self.broker.stop()
        await asyncio.wait_for(self.task, 20)
        await self.broker.nc.close()
