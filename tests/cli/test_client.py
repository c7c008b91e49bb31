"""MusterClient against the real broker and a fake fleet on a real nats-server."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
import pytest_asyncio

from broker.client import (
    DEFAULT_NATS_URL,
    MusterClient,
    MusterError,
    new_job_id,
    resolve_nats_url,
)
from broker.embedded import free_port
from broker.nodeops import node_op
from schemas.api import ClusterView, JobEvent, QueueView, WhyView
from schemas.config import FlavorQuota, QueueConfig, ResourceQuota
from schemas.job import JobSpec, PodSet, Simulation, Workload
from schemas.natsopts import NatsOptions
from shell.natsio import flush
from tests.support import wait_for
from tests.world import World, flavor, open_world

# One cluster of two 8-GPU on-demand nodes; queue "ml" may use 8 of those 16 GPUs.
FLAVOR = "a100-od"
QUEUES = [
    QueueConfig(name="default"),
    QueueConfig(
        name="ml",
        quotas=[FlavorQuota(flavor=FLAVOR, resources={"gpu": ResourceQuota(nominal=8)})],
    ),
    QueueConfig(name="urgent"),
]


async def start_world(w: World) -> World:
    w.harness.config = msgspec.structs.replace(w.harness.config, queues=QUEUES)
    await w.start({"c1": [flavor(FLAVOR, capacity="on-demand", nodes=2)]}, start_delay_s=0.1)
    return w


@pytest_asyncio.fixture
async def world(nats_url: str) -> AsyncIterator[World]:
    async with open_world(nats_url) as w:
        yield await start_world(w)


@pytest_asyncio.fixture
async def client(world: World) -> AsyncIterator[MusterClient]:
    h = world.harness
    async with MusterClient(NatsOptions(url=h.url), h.subjects) as c:
        yield c


@pytest_asyncio.fixture
async def idle_client(nats_url: str) -> AsyncIterator[MusterClient]:
    """A client whose subject prefix no broker serves."""
    async with (
        open_world(nats_url) as w,
        MusterClient(NatsOptions(url=nats_url), w.harness.subjects) as c,
    ):
        yield c


def spec(queue: str | None = "ml", steps: int = 1_000_000, **kw: Any) -> JobSpec:
    """Two replicas of 4 GPUs; by default it runs far longer than any test."""
    sim = Simulation(total_steps=steps, steps_per_second=20.0, checkpoint_every=10)
    return JobSpec(
        name="resnet",
        queue=queue,
        gang=[PodSet(name="worker", replicas=2, gpu=4)],
        workload=Workload(simulate=sim),
        **kw,
    )


# -- submit ------------------------------------------------------------------------------


async def test_submit_uses_the_specs_queue_and_assigns_an_id(client: MusterClient) -> None:
    reply = await client.submit(spec())
    assert reply.accepted and not reply.duplicate
    assert reply.job_id is not None and re.fullmatch(r"resnet-[0-9a-f]{12}", reply.job_id)
    view = await client.get(reply.job_id)
    assert view.queue == "ml" and view.gpus == 8


async def test_submit_queue_argument_wins(client: MusterClient) -> None:
    reply = await client.submit(spec(), queue="urgent")
    assert (await client.get(reply.job_id or "")).queue == "urgent"


async def test_submit_a_dict_and_keep_its_job_id(client: MusterClient) -> None:
    body = {"name": "bert", "job_id": "bert-7", "gang": [{"name": "w", "gpu": 1}]}
    reply = await client.submit(body, queue="ml")
    assert reply.job_id == "bert-7" and not reply.duplicate
    again = await client.submit(body, queue="ml")
    assert again.accepted and again.duplicate and again.job_id == "bert-7"
    assert [j.job_id for j in await client.list(queue="ml")] == ["bert-7"]


async def test_submit_without_a_queue_goes_to_the_default_queue(client: MusterClient) -> None:
    reply = await client.submit(spec(queue=None))
    assert reply.accepted
    assert (await client.get(reply.job_id or "")).queue == "default"


async def test_submit_invalid_dict(client: MusterClient) -> None:
    with pytest.raises(MusterError, match=r"invalid JobSpec: .*gpu"):
        await client.submit({"name": "x", "gang": [{"name": "w", "gpu": -1}]}, queue="ml")


async def test_rejection_carries_the_brokers_text(client: MusterClient) -> None:
    with pytest.raises(MusterError, match=r"^unknown queue 'nope'; known queues: default, ml"):
        await client.submit(spec(queue="nope"))
    assert await client.list() == []  # the rejected job left nothing behind


async def test_submit_with_no_broker(idle_client: MusterClient) -> None:
    with pytest.raises(MusterError, match=r"nothing listens on .*start it with `muster broker`"):
        await idle_client.submit(spec())


async def test_submit_timeout_names_the_job(idle_client: MusterClient, nats_url: str) -> None:
    silent = await nats.connect(nats_url)
    try:
        await silent.subscribe(idle_client.subjects.submit("ml"))  # listens, never answers
        await flush(silent)
        with pytest.raises(MusterError, match=r"no answer on .* within 0\.2s.*as job resnet-"):
            await idle_client.submit(spec(), timeout=0.2)
    finally:
        await silent.close()  # drain would wait for the unread submission


# -- API ---------------------------------------------------------------------------------


async def test_api_verbs(client: MusterClient, world: World) -> None:
    first = (await client.submit(spec())).job_id or ""
    await world.harness.wait_event(first, "running")
    second = (await client.submit(spec())).job_id or ""  # ml's 8 GPUs are taken

    view = await client.get(second)
    assert view.job_id == second and view.state == "queued" and view.gpus == 8
    assert view.spec is not None and view.spec.gang[0].replicas == 2

    jobs = await client.list(queue="ml", state="queued", limit=10)
    assert [j.job_id for j in jobs] == [second]
    assert await client.list(queue="urgent") == []

    async def quota_bound() -> WhyView | None:  # once a cycle has looked at it
        why = await client.why(second)
        return why if [r.code for r in why.reasons] == ["quota-exceeded"] else None

    why = await wait_for(quota_bound, what="a quota reason")
    assert "nominal 8" in why.reasons[0].message and "used 8" in why.reasons[0].message
    assert why.position == 0 and why.reasons[0].flavor == FLAVOR

    (ml,) = [q for q in await client.queues() if q.name == "ml"]
    assert isinstance(ml, QueueView)
    (usage,) = ml.flavors
    assert usage.flavor == FLAVOR
    assert [(r.resource, r.used, r.nominal) for r in usage.resources if r.resource == "gpu"] == [
        ("gpu", 8, 8)
    ]

    (c1,) = await client.clusters()
    assert isinstance(c1, ClusterView) and c1.name == "c1" and c1.running_jobs == 1
    assert [(f.name, f.gpu_total, f.gpu_free) for f in c1.flavors] == [(FLAVOR, 16, 8)]

    cancelled = await client.cancel(second, "no longer needed")
    assert cancelled.state == "cancelled" and cancelled.reason == "no longer needed"
    assert (await client.get(second)).state == "cancelled"


async def test_server_errors_become_muster_errors(client: MusterClient) -> None:
    with pytest.raises(MusterError, match=r"^unknown job 'nope'$"):
        await client.get("nope")
    with pytest.raises(MusterError, match=r"^unknown job 'nope'$"):
        await client.cancel("nope")


async def test_api_with_no_broker(idle_client: MusterClient) -> None:
    with pytest.raises(MusterError, match=r"no broker answers on e\w+\.api\.get; is the broker"):
        await idle_client.get("x")


async def test_unreadable_reply(idle_client: MusterClient, nats_url: str) -> None:
    liar = await nats.connect(nats_url)

    async def answer(msg: nats.aio.msg.Msg) -> None:
        await msg.respond(b'{"ok": true, "result": {"job_id": 1}}')

    try:
        await liar.subscribe(idle_client.subjects.api("get"), cb=answer)
        await flush(liar)
        with pytest.raises(MusterError, match="unreadable get reply"):
            await idle_client.get("x")
    finally:
        await liar.drain()


async def test_a_node_operation_names_the_cluster_when_its_agent_is_late_or_garbled(
    idle_client: MusterClient, nats_url: str
) -> None:
    """`muster drain` shares the client's request path but keeps its own texts: a slow agent
    may still be draining, and an unreadable reply names the cluster that sent it."""
    agent = await nats.connect(nats_url)
    subject = idle_client.subjects.agent_nodeops

    async def garble(msg: nats.aio.msg.Msg) -> None:
        await msg.respond(b'{"ok": "yes"}')

    try:
        await agent.subscribe(subject("slow"))  # listens, never answers
        await agent.subscribe(subject("odd"), cb=garble)
        await flush(agent)
        with pytest.raises(
            MusterError, match=r"^the agent of cluster 'slow' did not answer within 0\.2s; what"
        ):
            await node_op(idle_client, "slow", "drain", "n1", timeout=0.2)
        with pytest.raises(MusterError, match=r"^cluster 'odd' sent an unreadable reply: "):
            await node_op(idle_client, "odd", "cordon", "n1")
    finally:
        await agent.close()  # drain would wait for the unanswered request


# -- connection --------------------------------------------------------------------------


async def test_connect_failure_is_one_clear_error() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    with pytest.raises(MusterError, match=r"cannot reach NATS at .*start it with `muster broker`"):
        await MusterClient(NatsOptions(url=url)).connect()


async def test_not_connected() -> None:
    with pytest.raises(MusterError, match="not connected"):
        await MusterClient().get("x")


# -- watch -------------------------------------------------------------------------------


async def test_watch_follows_a_job_to_its_end(client: MusterClient, world: World) -> None:
    """What the watch yields is the tail of the job's event stream, up to the terminal event
    and nothing after it."""
    h = world.harness
    job_id = (await client.submit(spec(steps=20), queue="urgent")).job_id or ""

    async def follow() -> list[JobEvent]:
        return [ev async for ev in client.watch(job_id)]

    seen = await asyncio.wait_for(follow(), 30)
    await h.wait_event(job_id, "succeeded")
    everything = h.events[job_id]
    assert seen and seen[-1].kind == "succeeded"
    assert [e.kind for e in seen] == [e.kind for e in everything[len(everything) - len(seen) :]]


async def test_watch_of_a_finished_job_ends_at_once(client: MusterClient) -> None:
    job_id = (await client.submit(spec())).job_id or ""
    await client.cancel(job_id)
    events = [e async for e in client.watch(job_id)]
    assert events == []


async def test_watch_skips_what_it_cannot_read(client: MusterClient, world: World) -> None:
    h = world.harness
    job_id = (await client.submit(spec(steps=40), queue="urgent")).job_id or ""
    await h.wait_event(job_id, "running")
    watch = asyncio.create_task(_collect(client, job_id))
    # Garbage on the job's subject until the job ends: the watch reads past it.
    for _ in range(200):
        if watch.done():
            break
        await h.nc.publish(h.subjects.job_events(job_id), b"not json")
        await asyncio.sleep(0.01)
    seen = await asyncio.wait_for(watch, 30)
    assert seen and seen[-1].kind == "succeeded"


async def _collect(client: MusterClient, job_id: str) -> list[JobEvent]:
    return [ev async for ev in client.watch(job_id)]


async def test_watch_unknown_job(client: MusterClient) -> None:
    with pytest.raises(MusterError, match="unknown job 'ghost'"):
        async for _ in client.watch("ghost"):
            pass


async def test_watch_idle_timeout(client: MusterClient) -> None:
    await client.submit(spec(job_id="filler"), queue="ml")
    job_id = (await client.submit(spec())).job_id or ""  # waits behind ml's quota: no events
    with pytest.raises(MusterError, match=r"no event for job .* in 0\.2s"):
        async for _ in client.watch(job_id, idle_timeout=0.2):
            pass


# -- helpers -----------------------------------------------------------------------------


def test_resolve_nats_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MUSTER_NATS", raising=False)
    monkeypatch.delenv("MUSTER_STATE_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    assert resolve_nats_url(None) == DEFAULT_NATS_URL
    (tmp_path / ".muster").mkdir()
    (tmp_path / ".muster" / "nats.url").write_text("nats://127.0.0.1:4333\n")
    assert resolve_nats_url(None) == "nats://127.0.0.1:4333"
    monkeypatch.setenv("MUSTER_STATE_DIR", str(tmp_path / "elsewhere"))
    assert resolve_nats_url(None) == DEFAULT_NATS_URL
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "nats.url").write_text("nats://127.0.0.1:4444")
    assert resolve_nats_url(None) == "nats://127.0.0.1:4444"
    monkeypatch.setenv("MUSTER_NATS", "nats://env:4222")
    assert resolve_nats_url(None) == "nats://env:4222"
    assert resolve_nats_url("nats://flag:4222") == "nats://flag:4222"


def test_new_job_id_is_a_valid_subject_token() -> None:
    for name in ("resnet", "a" * 63, "x"):
        job_id = new_job_id(name)
        assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}", job_id), job_id
    assert new_job_id("resnet") != new_job_id("resnet")
