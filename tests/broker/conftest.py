"""An in-process broker on the shared real nats-server; each test gets its own subject prefix
(and so its own streams and buckets), which keeps tests independent without a server each."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from broker.service import Broker
from schemas.agent import FlavorInfo
from schemas.api import JobEvent
from schemas.codec import decode_job_event, decode_submit_reply, encode_json
from schemas.config import BrokerConfig, Limits, QueueConfig, Timeouts
from schemas.subjects import Subjects
from shell.natsio import submit_request
from tests.broker.wire import WireAgent, nodes
from tests.handover import in_process
from tests.support import wait_for

SPOT_A100 = FlavorInfo(
    name="a100-spot", capacity_type="spot", gpu_type="A100", price_per_gpu_hour=1.2
)
OD_A100 = FlavorInfo(
    name="a100-od", capacity_type="on-demand", gpu_type="A100", price_per_gpu_hour=3.0
)


def broker_config(prefix: str, **timeouts: Any) -> BrokerConfig:
    base = dict(
        heartbeat_s=0.2,
        unreachable_after_s=1.0,
        lost_after_s=2.0,
        dispatch_ack_s=0.3,
        dispatch_retries=1,
        start_s=5.0,
        checkpoint_grace_s=2.0,
        lease_ttl_s=2.0,
    )
    base.update(timeouts)
    return BrokerConfig(
        subject_prefix=prefix,
        queues=[QueueConfig(name="default"), QueueConfig(name="research")],
        timeouts=Timeouts(**base),
        # Small reservations: every test reserves its streams on one shared server.
        limits=Limits(submit_stream_max_bytes=8 * 2**20, jobs_bucket_max_bytes=32 * 2**20),
    )


@dataclass
class Harness:
    url: str
    prefix: str
    subjects: Subjects
    config: BrokerConfig
    nc: Client
    broker: Broker | None = None
    task: asyncio.Task[None] | None = None
    events: dict[str, list[JobEvent]] = field(default_factory=lambda: defaultdict(list))
    agents: list[WireAgent] = field(default_factory=list)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def start_broker(
        self,
        config: BrokerConfig | None = None,
        *,
        pace_gc: bool = False,
        agent_connection: bool = False,
    ) -> Broker:
        """`agent_connection`: the agents' subjects on a connection of their own, as `muster
        broker` has them (otherwise one connection carries everything)."""
        bnc = await nats.connect(self.url)
        anc = await nats.connect(self.url) if agent_connection else None
        broker = Broker(config or self.config, bnc, pace_gc=pace_gc, agent_nc=anc)
        self.broker = broker
        self.task = asyncio.create_task(broker.run())
        await asyncio.wait_for(broker.leading.wait(), 15)

        # The API subscriptions are flushed before `leading` is set; prove it answers anyway.
        async def answers() -> bool:
            try:
                await self.nc.request(self.subjects.api("stats"), b"{}", timeout=1)
            except (NoRespondersError, NatsTimeoutError):
                return False
            return True

        await wait_for(answers, 30, what="the broker's API", interval=0.02)
        return broker

    async def stop_broker(self) -> None:
        if self.broker is not None and self.task is not None:
            await self.broker.stop()
            await asyncio.wait_for(self.task, 15)
            await self._close(self.broker)
        self.broker = None
        self.task = None

    @staticmethod
    async def _close(broker: Broker) -> None:
        await broker.nc.close()
        if broker.agent_nc is not broker.nc:
            await broker.agent_nc.close()

    async def crash_broker(self) -> None:
        """Like kill -9 for an in-process broker: no lease release, no drain."""
        assert self.broker is not None and self.task is not None
        await self._close(self.broker)
        self.task.cancel()
        done, _ = await asyncio.wait({self.task}, timeout=15)
        assert done, "the broker's task went on after it was cancelled"
        self.broker = None
        self.task = None

    async def agent(
        self,
        cluster: str,
        flavors: list[FlavorInfo] | None = None,
        count: int = 4,
        gpu: int = 8,
        **settings: Any,
    ) -> WireAgent:
        """A scripted agent, started (and synced, with a broker running); `settings` are
        WireAgent attributes set before it starts (`wire`, `ack`, ...)."""
        flavors = flavors or [OD_A100]
        node_list = [n for f in flavors for n in nodes(cluster, f.name, count, gpu)]
        agent = WireAgent(self.nc, self.subjects, cluster, flavors, node_list)
        for name, value in settings.items():
            if not hasattr(agent, name):
                raise AttributeError(f"WireAgent has no setting {name!r}")
            setattr(agent, name, value)
        await agent.start()
        self.agents.append(agent)
        if self.broker is not None:
            try:
                await self.wait_for(lambda: self.synced(cluster))
            except AssertionError:
                raise AssertionError(
                    f"agent {cluster} never synced: {self.broker.stats} "
                    f"{self.broker.machine.agents if self.broker.machine else None}"
                ) from None
        return agent

    def synced(self, cluster: str) -> bool:
        machine = self.broker.machine if self.broker else None
        track = machine.agents.get(cluster) if machine else None
        return bool(track and track.synced)

    async def submit(self, job: dict[str, Any] | bytes, queue: str = "default") -> Any:
        data = job if isinstance(job, bytes) else encode_json(job)
        msg = await submit_request(self.nc, self.subjects.submit(queue), data, 10)
        return decode_submit_reply(msg.data)

    async def api(self, verb: str, body: dict[str, Any] | None = None) -> Any:
        msg = await self.nc.request(self.subjects.api(verb), encode_json(body or {}), timeout=10)
        import msgspec

        return msgspec.json.decode(msg.data)

    async def follow_events(self) -> None:
        """Record every job event the broker publishes, in `events`, from now on."""

        async def on_event(msg: Any) -> None:
            event = decode_job_event(msg.data)
            self.events[event.job_id].append(event)
            self._changed.set()

        await self.nc.subscribe(self.subjects.job_events_all, cb=on_event)

    async def wait_for(self, pred: Callable[[], bool], timeout: float = 10.0) -> None:
        """Look at `pred` whenever a job event arrives (bounded by `timeout`)."""
        await wait_for(pred, timeout, changed=self._changed)

    async def wait_event(
        self, job_id: str, kind: str, timeout: float = 10.0, count: int = 1
    ) -> JobEvent:
        await self.wait_for(
            lambda: sum(1 for e in self.events[job_id] if e.kind == kind) >= count, timeout
        )
        return [e for e in self.events[job_id] if e.kind == kind][count - 1]

    def kinds(self, job_id: str) -> list[str]:
        return [e.kind for e in self.events[job_id]]


@pytest_asyncio.fixture
async def harness(nats_url: str) -> AsyncIterator[Harness]:
    prefix = f"t{uuid.uuid4().hex[:10]}"
    nc = await nats.connect(nats_url)
    h = Harness(nats_url, prefix, Subjects(prefix=prefix), broker_config(prefix), nc)
    await h.follow_events()
    yield h
    for agent in h.agents:
        await agent.stop()
    await h.stop_broker()
    await nc.close()


# Starts a broker beside the harness's: `start(holder="standby", config=None)`.
StartBroker = Callable[..., Awaitable[Broker]]


@pytest_asyncio.fixture
async def brokers(harness: Harness) -> AsyncIterator[StartBroker]:
    """Starts more in-process brokers on the harness's server (each stands by, mirroring the
    job bucket, while another leads; the harness's config unless given one); stops them after
    the test."""
    async with contextlib.AsyncExitStack() as stack:

        async def start(holder: str = "standby", config: BrokerConfig | None = None) -> Broker:
            running = in_process(config or harness.config, harness.url, holder)
            broker = await stack.enter_async_context(running)
            await harness.wait_for(lambda: broker.mirror is not None)
            return broker

        yield start


BURNER_S = 120  # a burner ends itself after this even if the test never stops it


@pytest.fixture
def two_burners() -> Iterator[None]:
    """Two processes that keep both cores busy while the test runs."""
    code = f"import time\nend = time.monotonic() + {BURNER_S}\nwhile time.monotonic() < end: pass"
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(2)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
