"""MusterClient against a real nats-server and the stand-in broker (tests/.../standin.py)."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

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
from schemas.api import CancelRequest, ClusterView, Empty, JobEvent, JobRef, ListRequest, QueueView
from schemas.job import JobSpec, PodSet
from schemas.natsopts import NatsOptions
from schemas.subjects import Subjects
from shell.natsio import flush

from .standin import StandInBroker


@pytest.fixture
def subjects() -> Subjects:
    """A private prefix per test, so stand-ins of different tests never answer each other."""
    return Subjects(prefix=f"t{uuid.uuid4().hex[:10]}")


@pytest_asyncio.fixture
async def standin(nats_url: str, subjects: Subjects) -> AsyncIterator[StandInBroker]:
    broker = StandInBroker(subjects)
    await broker.start(nats_url)
    yield broker
    await broker.stop()


@pytest_asyncio.fixture
async def client(nats_url: str, subjects: Subjects) -> AsyncIterator[MusterClient]:
    async with MusterClient(NatsOptions(url=nats_url), subjects) as c:
        yield c


def spec(queue: str | None = "ml", **kw: object) -> JobSpec:
    return JobSpec(
        name="resnet",
        queue=queue,
        gang=[PodSet(name="worker", replicas=2, gpu=4)],
        **kw,  # type: ignore[arg-type]
    )


# -- submit ------------------------------------------------------------------------------


async def test_submit_uses_the_specs_queue_and_assigns_an_id(
    client: MusterClient, standin: StandInBroker, subjects: Subjects
) -> None:
    reply = await client.submit(spec())
    assert reply.accepted and not reply.duplicate
    assert reply.job_id is not None and re.fullmatch(r"resnet-[0-9a-f]{12}", reply.job_id)
    subject, data = standin.submitted[-1]
    assert subject == subjects.submit("ml")
    sent = msgspec.json.decode(data, type=JobSpec)
    assert sent.job_id == reply.job_id and sent.queue == "ml"


async def test_submit_queue_argument_wins(client: MusterClient, standin: StandInBroker) -> None:
    reply = await client.submit(spec(), queue="urgent")
    assert standin.jobs[reply.job_id or ""].queue == "urgent"


async def test_submit_a_dict_and_keep_its_job_id(
    client: MusterClient, standin: StandInBroker
) -> None:
    body = {"name": "bert", "job_id": "bert-7", "gang": [{"name": "w", "gpu": 1}]}
    reply = await client.submit(body, queue="ml")
    assert reply.job_id == "bert-7"
    again = await client.submit(body, queue="ml")
    assert again.accepted and again.duplicate and again.job_id == "bert-7"


async def test_submit_without_a_queue_goes_to_the_default_queue(
    client: MusterClient, standin: StandInBroker
) -> None:
    reply = await client.submit(spec(queue=None))
    assert reply.accepted
    subject, data = standin.submitted[-1]
    assert subject.endswith(".submit.default")
    assert b'"queue"' not in data  # the broker decides what no queue means


async def test_submit_invalid_dict(client: MusterClient) -> None:
    with pytest.raises(MusterError, match=r"invalid JobSpec: .*gpu"):
        await client.submit({"name": "x", "gang": [{"name": "w", "gpu": -1}]}, queue="ml")


async def test_rejection_carries_the_brokers_text(
    client: MusterClient, standin: StandInBroker
) -> None:
    # the stand-in rejects priorities above 100 with its own text
    standin.max_priority = 100
    with pytest.raises(MusterError, match=r"^priority 500 is over this broker's limit of 100$"):
        await client.submit(spec(priority=500))


async def test_submit_with_no_broker(client: MusterClient) -> None:
    with pytest.raises(MusterError, match=r"nothing listens on .*start it with `muster broker`"):
        await client.submit(spec())


async def test_submit_timeout_names_the_job(client: MusterClient, nats_url: str) -> None:
    silent = await nats.connect(nats_url)
    try:
        await silent.subscribe(client.subjects.submit("ml"))  # listens, never answers
        await flush(silent)
        with pytest.raises(MusterError, match=r"no answer on .* within 0\.2s.*as job resnet-"):
            await client.submit(spec(), timeout=0.2)
    finally:
        await silent.close()  # drain would wait for the unread submission


# -- API ---------------------------------------------------------------------------------


async def test_api_verbs(client: MusterClient, standin: StandInBroker) -> None:
    job_id = (await client.submit(spec())).job_id
    assert job_id is not None

    view = await client.get(job_id)
    assert view.job_id == job_id and view.state == "queued" and view.gpus == 8
    assert view.spec is not None and view.spec.gang[0].replicas == 2

    jobs = await client.list(queue="ml", state="queued", limit=10)
    assert [j.job_id for j in jobs] == [job_id]
    assert await client.list(queue="elsewhere") == []

    why = await client.why(job_id)
    assert why.position == 0 and why.reasons[0].code == "quota"

    queues = await client.queues()
    assert isinstance(queues[0], QueueView) and queues[0].flavors[0].resources[0].used == 12

    clusters = await client.clusters()
    assert isinstance(clusters[0], ClusterView) and clusters[0].flavors[0].gpu_free == 24

    cancelled = await client.cancel(job_id, "no longer needed")
    assert cancelled.state == "cancelled" and cancelled.reason == "no longer needed"

    # request bodies are the API Structs, as JSON
    bodies = {verb: data for verb, data in standin.requests}
    assert msgspec.json.decode(bodies["get"], type=JobRef) == JobRef(job_id=job_id)
    assert msgspec.json.decode(bodies["list"], type=ListRequest) == ListRequest(queue="elsewhere")
    assert msgspec.json.decode(bodies["cancel"], type=CancelRequest) == CancelRequest(
        job_id=job_id, reason="no longer needed"
    )
    assert msgspec.json.decode(bodies["queues"], type=Empty) == Empty()


async def test_server_errors_become_muster_errors(
    client: MusterClient, standin: StandInBroker
) -> None:
    with pytest.raises(MusterError, match=r"^unknown job 'nope'$"):
        await client.get("nope")
    standin.fail_verb = "queues"
    with pytest.raises(MusterError, match=r"^queues is broken today$"):
        await client.queues()


async def test_api_with_no_broker(client: MusterClient) -> None:
    with pytest.raises(MusterError, match=r"no broker answers on t\w+\.api\.get; is the broker"):
        await client.get("x")


async def test_unreadable_reply(client: MusterClient, nats_url: str) -> None:
    liar = await nats.connect(nats_url)

    async def answer(msg: nats.aio.msg.Msg) -> None:
        await msg.respond(b'{"ok": true, "result": {"job_id": 1}}')

    try:
        await liar.subscribe(client.subjects.api("get"), cb=answer)
        await flush(liar)
        with pytest.raises(MusterError, match="unreadable get reply"):
            await client.get("x")
    finally:
        await liar.drain()


# -- connection --------------------------------------------------------------------------


async def test_connect_failure_is_one_clear_error() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    with pytest.raises(MusterError, match=r"cannot reach NATS at .*start it with `muster broker`"):
        await MusterClient(NatsOptions(url=url)).connect()


async def test_not_connected() -> None:
    with pytest.raises(MusterError, match="not connected"):
        await MusterClient().get("x")


# -- watch -------------------------------------------------------------------------------


async def test_watch_until_terminal(client: MusterClient, standin: StandInBroker) -> None:
    job_id = (await client.submit(spec())).job_id or ""
    seen: list[JobEvent] = []

    async def follow() -> None:
        async for ev in client.watch(job_id):
            seen.append(ev)

    task = asyncio.create_task(follow())
    # the watch subscribes, then asks for the job's state: once the stand-in saw that `get`,
    # the subscription is in place
    for _ in range(500):
        if any(verb == "get" for verb, _ in standin.requests):
            break
        await asyncio.sleep(0.01)
    assert standin.nc is not None
    await standin.nc.publish(client.subjects.job_events(job_id), b"not json")  # skipped
    for kind, state in [
        ("admitted", "admitted"),
        ("running", "running"),
        ("checkpointed", "running"),
        ("succeeded", "succeeded"),
        ("running", "running"),  # after the end: not read
    ]:
        await standin.publish_event(
            JobEvent(job_id=job_id, kind=kind, at=1.0, state=state, attempt=1, cluster="c")  # type: ignore[arg-type]
        )
    await asyncio.wait_for(task, 5)
    assert [e.kind for e in seen] == ["admitted", "running", "checkpointed", "succeeded"]


async def test_watch_of_a_finished_job_ends_at_once(
    client: MusterClient, standin: StandInBroker
) -> None:
    job_id = (await client.submit(spec())).job_id or ""
    await client.cancel(job_id)
    events = [e async for e in client.watch(job_id)]
    assert events == []


async def test_watch_unknown_job(client: MusterClient, standin: StandInBroker) -> None:
    with pytest.raises(MusterError, match="unknown job 'ghost'"):
        async for _ in client.watch("ghost"):
            pass


async def test_watch_idle_timeout(client: MusterClient, standin: StandInBroker) -> None:
    job_id = (await client.submit(spec())).job_id or ""
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
