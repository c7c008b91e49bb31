"""A full job store or a full server store: the broker keeps leading with the same epoch,
refuses new submissions with a clear "storage full" error, never exits, and takes work again
once the store has room."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest_asyncio
from nats.aio.client import Client

from broker.embedded import free_port, nats_server_binary
from broker.lease import RENEWALS_PER_TTL
from broker.service import Broker
from schemas.codec import decode_submit_reply, encode_json
from schemas.config import BrokerConfig
from schemas.subjects import Subjects
from tests.broker.conftest import broker_config
from tests.broker.jobs import job
from tests.support import listening, wait_for

STORE_BYTES = 2 * 1024 * 1024


@pytest_asyncio.fixture
async def tiny_nats() -> AsyncIterator[str]:
    """A nats-server whose JetStream file store holds only STORE_BYTES."""
    with tempfile.TemporaryDirectory(prefix="muster-tiny-") as tmp:
        port = free_port()
        conf = Path(tmp) / "nats.conf"
        conf.write_text(
            f"listen: 127.0.0.1:{port}\n"
            f'jetstream {{ store_dir: "{tmp}", max_file_store: {STORE_BYTES}, '
            "max_memory_store: 1048576 }\n"
        )
        proc = await asyncio.create_subprocess_exec(
            nats_server_binary(),
            "-c",
            str(conf),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        try:
            await listening(port)
            yield f"nats://127.0.0.1:{port}"
        finally:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 10)


@contextlib.asynccontextmanager
async def running_broker(
    url: str,
) -> AsyncIterator[tuple[Client, Broker, asyncio.Task[None], Subjects, BrokerConfig]]:
    """A broker with 256 KiB streams and a 1 s lease on the tiny server, leading."""
    prefix = f"t{uuid.uuid4().hex[:10]}"
    config = broker_config(prefix, lease_ttl_s=1.0)
    config.limits.jobs_bucket_max_bytes = 256 * 1024
    config.limits.submit_stream_max_bytes = 256 * 1024
    client = await nats.connect(url)
    bnc = await nats.connect(url)
    broker = Broker(config, bnc)
    task = asyncio.create_task(broker.run())
    try:
        await asyncio.wait_for(broker.leading.wait(), 15)
        yield client, broker, task, Subjects(prefix=prefix), config
    finally:
        await broker.stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 15)
        await bnc.close()
        await client.close()


async def test_full_job_bucket_keeps_the_lease_and_refuses_submissions(tiny_nats: str) -> None:
    async with running_broker(tiny_nats) as (client, broker, task, subjects, config):
        epoch = broker.lease.epoch
        # Fat jobs (64 labels of 1,000 characters) fill the job bucket in a few submissions.
        labels = {f"k{i}": "v" * 1000 for i in range(64)}
        accepted = 0
        for i in range(40):  # bounded: the bucket holds ~4 such records
            with contextlib.suppress(Exception):
                msg = await client.request(
                    subjects.submit("default"), encode_json(job(f"fat{i}", 1, 1, labels=labels)), 2
                )
                if decode_submit_reply(msg.data).accepted:
                    accepted += 1
            if broker.storage_full:
                break
        assert broker.storage_full and 0 < accepted < 40
        msg = await client.request(subjects.submit("default"), encode_json(job("c", 1, 1)), 10)
        reply = decode_submit_reply(msg.data)
        assert not reply.accepted and reply.error and reply.error.startswith("storage full")
        # Three lease renewals later the broker still leads with the same epoch.
        renewed = broker.lease.revision
        await wait_for(
            lambda: broker.lease.revision >= renewed + 3,
            10 * config.timeouts.lease_ttl_s,
            what="three lease renewals",
        )
        assert broker.leading.is_set() and broker.lease.epoch == epoch
        assert not task.done()
        stats = await client.request(subjects.api("stats"), b"{}", timeout=5)
        assert b'"storage_full":true' in stats.data
        # The operator grows the bucket: the stuck records land, submissions are accepted.
        js = client.jetstream()
        info = await js.stream_info(f"KV_{subjects.jobs_bucket}")
        info.config.max_bytes = 1024 * 1024
        await js.update_stream(info.config)
        await wait_for(lambda: not broker.storage_full, 10, what="the store to take records")
        msg = await client.request(subjects.submit("default"), encode_json(job("d", 1, 1)), 10)
        assert decode_submit_reply(msg.data).accepted
        assert broker.leading.is_set() and broker.lease.epoch == epoch


async def _fill(js: object, subject: str) -> None:
    """Publish into an unlimited foreign stream until the server store refuses."""
    chunk = b"x" * 64 * 1024
    for _ in range(1000):  # bounded; the store holds ~32 chunks
        try:
            await js.publish(subject, chunk)  # type: ignore[attr-defined]
        except Exception as exc:
            assert "insufficient" in str(exc).lower(), exc
            return
    raise AssertionError("the store never filled")


async def test_filled_server_store_keeps_the_leader_and_refuses_submissions(
    tiny_nats: str,
) -> None:
    """Another tenant fills the whole server store: nats-server then refuses every write to a
    file-backed stream, the lease renewal included, so no broker can take the lease either.
    The leader suspends instead of stepping down: it keeps leading with the same epoch,
    answers submissions with "storage full", changes nothing, and resumes once there is room."""
    from nats.js import api

    async with running_broker(tiny_nats) as (client, broker, task, subjects, config):
        epoch = broker.lease.epoch
        js = client.jetstream()
        await js.add_stream(api.StreamConfig(name="FILLER", subjects=["filler"]))
        await _fill(js, "filler")
        # A renewal runs every quarter TTL.
        await wait_for(lambda: broker.lease.suspensions, 20, what="the lease suspended")
        assert broker.lease.suspensions == 1 and not broker.lease.proven.is_set()
        stats = await client.request(subjects.api("stats"), b"{}", timeout=5)
        assert b'"lease_suspended":true' in stats.data
        # Several TTLs on, the lease key has long expired: still the same leader. Renewals
        # are tried RENEWALS_PER_TTL times a TTL: three TTLs' worth of them fail.
        for _ in range(3):
            msg = await client.request(subjects.submit("default"), encode_json(job("x", 1, 1)), 10)
            reply = decode_submit_reply(msg.data)
            assert not reply.accepted and (reply.error or "").startswith("storage full")
            goal = broker.lease.renew_failures + RENEWALS_PER_TTL
            await wait_for(
                lambda goal=goal: broker.lease.renew_failures >= goal,
                10 * config.timeouts.lease_ttl_s,
                what="a TTL of refused renewals",
            )

        async def expired() -> bool:
            return await broker.lease.current() is None

        await wait_for(expired, 10, what="the lease key expired")
        assert broker.leading.is_set() and broker.lease.epoch == epoch
        assert not task.done(), task.exception() if task.done() else None
        # Room again: the next renewal recreates the expired key right after its own revision,
        # and the broker carries on with the same epoch.
        await js.delete_stream("FILLER")
        await asyncio.wait_for(broker.lease.proven.wait(), 20)
        assert broker.leading.is_set() and broker.lease.epoch == epoch
        await wait_for(lambda: not broker.storage_full, 10, what="storage available again")
        msg = await client.request(subjects.submit("default"), encode_json(job("after", 1, 1)), 10)
        assert decode_submit_reply(msg.data).accepted
        assert broker.lease.epoch == epoch and not task.done()
