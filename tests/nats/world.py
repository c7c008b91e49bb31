"""A broker, a fake fleet and a submitting client on the three-server cluster, each with its
own connection that knows every server (as `--nats URL1,URL2,URL3` gives them)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import nats
from nats.aio.client import Client
from nats.js.client import JetStreamContext
from nats.js.errors import BadRequestError

from agents.config import AgentConfig, FakeClusterConfig
from agents.fleet import Fleet, start_fake_fleet
from broker.service import Broker
from broker.store import JobStore, StoreError
from load.natscluster import NatsCluster
from schemas.codec import decode_submit_reply, encode_json
from schemas.config import BrokerConfig, Replication
from schemas.subjects import Subjects
from shell.natsio import submit_request
from tests.broker.conftest import broker_config
from tests.support import wait_for
from tests.world import TIME_SCALE, flavor, sim_job


def cluster_config(prefix: str, replication: Replication, **timeouts: Any) -> BrokerConfig:
    """The test broker config, with the replication under test and timeouts that ride out a
    NATS failover (agents reconnect within seconds; a cluster is lost only after 30 s)."""
    base = broker_config(
        prefix,
        **{
            "lost_after_s": 30.0,
            "unreachable_after_s": 10.0,
            "dispatch_ack_s": 1.0,
            "dispatch_retries": 5,
            "start_s": 60.0,
            **timeouts,
        },
    )
    return msgspec.structs.replace(base, replication=replication)


def fake_agent(cluster: str, subjects: Subjects, *, nodes: int, seed: int) -> AgentConfig:
    """A fake cluster of `nodes` 8-GPU on-demand nodes whose jobs run at TIME_SCALE."""
    return AgentConfig(
        cluster=cluster,
        backend="fake",
        heartbeat_s=0.2,
        subject_prefix=subjects.prefix,
        fake=FakeClusterConfig(
            flavors=[flavor(f"od-{cluster}", "on-demand", nodes=nodes)],
            time_scale=TIME_SCALE,
            start_delay_s=0.2,
            seed=seed,
        ),
    )


async def connect(cluster: NatsCluster, role: str = "admin") -> Client:
    return await nats.connect(**cluster.options(role).connect_kwargs())


NO_PEERS = 10005  # nats-server JSClusterNoPeersErrF: no suitable peers for placement


async def open_store(
    js: JetStreamContext, bucket: str, replication: int | Replication, timeout: float
) -> JobStore:
    """The job bucket `bucket`, created on a fresh cluster: its meta leader may not answer
    a create in time (the stream may exist then: opening again finds it), and it may count a
    peer offline for a moment (no peers for the placement yet)."""
    opened: list[JobStore] = []

    async def created() -> bool:
        try:
            opened.append(await JobStore.open(js, bucket, replication))
        except TimeoutError:
            return False
        except StoreError as exc:  # JetStream's refusal is its cause
            cause = exc.__cause__
            if not isinstance(cause, BadRequestError) or cause.err_code != NO_PEERS:
                raise
            return False
        return True

    await wait_for(created, timeout, what=f"bucket {bucket} created")
    return opened[-1]


@dataclass
class ClusterWorld:
    cluster: NatsCluster
    config: BrokerConfig
    subjects: Subjects
    nc: Client  # the test's own connection (client submissions, API calls)
    broker: Broker | None = None
    broker_task: asyncio.Task[None] | None = None
    fleet: Fleet | None = None
    fleet_nc: Client | None = None
    accepted: dict[str, float] = field(default_factory=dict)  # job_id -> when acknowledged
    max_live_copies: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def start_broker(self) -> Broker:
        bnc = await connect(self.cluster, "broker")
        self.broker = Broker(self.config, bnc)
        self.broker_task = asyncio.create_task(self.broker.run())
        await asyncio.wait_for(self.broker.leading.wait(), 30)
        return self.broker

    async def stop_broker(self) -> None:
        if self.broker is not None and self.broker_task is not None:
            await self.broker.stop()
            await asyncio.wait_for(self.broker_task, 20)
            with contextlib.suppress(Exception):
                await self.broker.nc.close()
        self.broker = self.broker_task = None

    async def start_fleet(self, clusters: int = 2) -> Fleet:
        self.fleet_nc = await connect(self.cluster)
        configs = [fake_agent(f"c{i}", self.subjects, nodes=4, seed=i + 1) for i in range(clusters)]
        self.fleet = await start_fake_fleet(self.fleet_nc, configs, self.subjects)
        self._tasks.append(asyncio.create_task(self._watch_copies()))
        return self.fleet

    async def _watch_copies(self) -> None:
        """Samples every job's live copies; more than one at once would be a job run twice."""
        for _ in range(1_000_000):
            assert self.fleet is not None
            counts: dict[str, int] = defaultdict(int)
            for c in self.fleet.clusters.values():
                for job_id, _attempt in c.live_workloads():
                    counts[job_id] += 1
            for job_id, n in counts.items():
                self.max_live_copies[job_id] = max(self.max_live_copies[job_id], n)
            await asyncio.sleep(0.02)

    async def submit(self, job_id: str, timeout: float = 2.0, steps: int = 40) -> bool:
        """One try; True when the broker acknowledged the job."""
        spec = {**sim_job(job_id, gpu=8, steps=steps, rate=20.0, every=10), "job_id": job_id}
        try:
            msg = await submit_request(
                self.nc, self.subjects.submit("default"), encode_json(spec), timeout
            )
        except Exception:  # a timeout or no responders while NATS fails over: retry
            return False
        reply = decode_submit_reply(msg.data)
        if reply.accepted:
            self.accepted.setdefault(job_id, time.monotonic())
        return bool(reply.accepted)

    async def submit_until_accepted(
        self, job_id: str, timeout: float = 60.0, steps: int = 40
    ) -> float:
        """Retry the same job (same id: safe) until acknowledged; returns the seconds it took."""
        started = time.monotonic()
        await wait_for(
            lambda: self.submit(job_id, steps=steps),
            timeout,
            what=f"{job_id} accepted",
            interval=0.1,
        )
        return time.monotonic() - started

    async def api(self, verb: str, body: dict[str, Any] | None = None) -> Any:
        msg = await self.nc.request(self.subjects.api(verb), encode_json(body or {}), timeout=5)
        return msgspec.json.decode(msg.data)

    async def states(self) -> dict[str, dict[str, Any]]:
        reply = await self.api("list", {"limit": 10_000})
        assert reply["ok"], reply
        return {j["job_id"]: j for j in reply["result"]}

    async def all_accepted_succeeded(self, timeout: float = 60.0) -> dict[str, dict[str, Any]]:
        async def done() -> dict[str, dict[str, Any]] | None:
            try:
                states = await self.states()
            except Exception:
                return None
            ok = all(states.get(j, {}).get("state") == "succeeded" for j in self.accepted)
            return states if ok else None

        return await wait_for(done, timeout, what="every acknowledged job succeeded", interval=0.2)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.fleet is not None:
            await self.fleet.stop()
        await self.stop_broker()
        for nc in (self.fleet_nc, self.nc):
            if nc is not None:
                with contextlib.suppress(Exception):
                    await nc.close()


@contextlib.asynccontextmanager
async def cluster_world(
    cluster: NatsCluster, replication: Replication | BrokerConfig, **timeouts: Any
) -> AsyncIterator[ClusterWorld]:
    """A world with its own subject prefix, or the prefix of the config given."""
    if isinstance(replication, BrokerConfig):
        config = replication
    else:
        config = cluster_config(f"n{uuid.uuid4().hex[:10]}", replication, **timeouts)
    world = ClusterWorld(
        cluster, config, Subjects(prefix=config.subject_prefix), await connect(cluster)
    )
    try:
        yield world
    finally:
        await world.close()
