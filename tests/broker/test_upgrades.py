"""Version skew the broker acts on: job records of a newer format than it understands (it does
not lead on them, so it never rewrites them without what it cannot read), and agents whose wire
major version differs from its own (their batches are refused, and the agent told why)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import uuid
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
import structlog
from hypothesis import given
from hypothesis import strategies as st

from broker.agentio import _peek_wire
from broker.backup import BackupError, backup, read_backup
from broker.core.records import RECORD_FORMAT, record_decoder
from broker.service import Broker
from broker.store import JobStore, NewerRecords, compact_bucket
from schemas.agent import CommandAck, WireRefused
from schemas.codec import decode_command, encode_msgpack
from schemas.config import BrokerConfig
from schemas.subjects import Subjects
from schemas.wire import WIRE_VERSION
from tests.broker.conftest import OD_A100, Harness
from tests.broker.jobs import job
from tests.broker.wire import WireAgent, next_item, nodes
from tests.nats.previous_release import previous_messages
from tests.support import wait_for


def newer_record(old: bytes, job_id: str) -> bytes:
    """The 0.1.0 record as a broker one format ahead would write it: a field this one lacks."""
    fields = msgspec.msgpack.decode(old)
    fields.update(job_id=job_id, format=RECORD_FORMAT + 1, placement_v2={"zones": ["a", "b"]})
    return msgspec.msgpack.encode(fields)


async def test_a_broker_does_not_lead_on_records_newer_than_it_understands(
    harness: Harness,
) -> None:
    await harness.start_broker()
    reply = await harness.submit(job("kept", replicas=1, gpu=8))
    await harness.stop_broker()
    js = harness.nc.jetstream()
    prefix = f"$KV.{harness.subjects.jobs_bucket}."
    old = previous_messages()["JobRecord"]
    assert record_decoder.decode(old).format == 1  # 0.1.0 wrote no format: the first
    await js.publish(prefix + "fx-1", old)
    newer = newer_record(old, "fx-new")
    await js.publish(prefix + "fx-new", newer)

    broker = Broker(harness.config, await nats.connect(harness.url), holder="old")
    with structlog.testing.capture_logs() as logs:
        task = asyncio.create_task(broker.run())
        try:
            await wait_for(lambda: broker.stats["newer_records"] == 1, 15, what="the refusal")
            refusal = await wait_for(
                lambda: next((e for e in logs if e["event"] == "broker.refused_to_lead"), None)
            )
            assert not broker.leading.is_set() and broker.machine is None
            assert refusal["jobs"] == ["fx-new"]
            assert (refusal["record_format"], refusal["understood"]) == (2, RECORD_FORMAT)
            assert "upgrade this broker" in refusal["error"]
            # The newer record is untouched (a leader would have rewritten it without the
            # field it cannot read), and the lease is free for a broker that understands it.
            entry = await js.get_last_msg(f"KV_{harness.subjects.jobs_bucket}", prefix + "fx-new")
            assert entry.data == newer
            lease = await js.key_value(harness.subjects.leader_bucket)
            await wait_for(lambda: _lease_free(lease), 5, what="the lease released")
        finally:
            await broker.stop()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(task, 15)
            await broker.nc.close()

    # Once the newer record is gone (a newer broker finished that job), this one leads on
    # every record it understands, the previous release's among them.
    await js.publish(prefix + "fx-new", b"", headers={"KV-Operation": "DEL"})
    leader = await harness.start_broker()
    assert leader.machine is not None
    assert {"fx-1", reply.job_id} <= set(leader.machine.jobs)
    assert leader.stats["newer_records"] == 0


async def _lease_free(lease: Any) -> bool:
    try:
        entry = await lease.get("leader")
    except Exception:
        return True
    return not entry.value


async def test_an_agent_of_another_wire_major_is_refused_and_told_why(
    harness: Harness,
) -> None:
    broker = await harness.start_broker()
    future = WireAgent(
        harness.nc, harness.subjects, "mars", [OD_A100], nodes("mars", OD_A100.name, 2)
    )
    future.wire = "2.0"
    harness.agents.append(future)
    with structlog.testing.capture_logs() as logs:
        await future.start()
        told = await wait_for(
            lambda: next((c for c in future.commands if isinstance(c, WireRefused)), None),
            10,
            what="the agent told of the refusal",
        )
        logged = [e for e in logs if e["event"] == "broker.agent_wire_refused"]
    assert (told.agent_wire, told.broker_wire) == ("2.0", WIRE_VERSION)
    assert "'mars'" in told.reason and "major version 1" in told.reason
    assert logged and logged[0]["cluster"] == "mars"
    assert (logged[0]["agent_wire"], logged[0]["broker_wire"]) == ("2.0", WIRE_VERSION)
    assert broker.refused["agent_wire"] >= 1
    assert not harness.synced("mars")  # nothing it sent was applied
    assert len([c for c in future.commands if isinstance(c, WireRefused)]) == 1  # not per batch

    # Same major, a newer minor: accepted. And the refused agent, once upgraded, syncs.
    newer = WireAgent(
        harness.nc, harness.subjects, "venus", [OD_A100], nodes("venus", OD_A100.name, 2)
    )
    newer.wire = "1.9"
    harness.agents.append(newer)
    await newer.start()
    await harness.wait_for(lambda: harness.synced("venus"))
    future.wire = WIRE_VERSION
    await future.send(future.snapshot())
    await harness.wait_for(lambda: harness.synced("mars"))


async def test_backup_and_compaction_refuse_records_newer_than_they_understand(
    nc: Any, tmp_path: Path
) -> None:
    """An older CLI would write a backup without them, or rewrite them without what it cannot
    read: it says so instead, and changes nothing."""
    config = BrokerConfig(subject_prefix=f"u{uuid.uuid4().hex[:10]}")
    subjects = Subjects(prefix=config.subject_prefix)
    js = nc.jetstream()
    store = await JobStore.open(js, subjects.jobs_bucket)
    old = previous_messages()["JobRecord"]
    await js.publish(store.prefix + "fx-1", old)
    newer = newer_record(old, "fx-new")
    await js.publish(store.prefix + "fx-new", newer)
    path = tmp_path / "jobs.backup"
    with pytest.raises(BackupError, match=r"fx-new.*format 2, newer than the 1"):
        await backup(nc, config, path)
    assert not path.exists()
    with pytest.raises(NewerRecords, match="upgrade this broker or CLI"):
        await compact_bucket(js, subjects.jobs_bucket, expire_before=1e12)
    entry = await js.get_last_msg(store.stream, store.prefix + "fx-new")
    assert entry.data == newer

    # A backup file holding a newer record is not restored by this release either.
    await js.publish(store.prefix + "fx-new", b"", headers={"KV-Operation": "DEL"})
    await backup(nc, config, path)
    header, *lines = path.read_text().splitlines()
    entry_line = {"job_id": "fx-new", "record": base64.b64encode(newer).decode()}
    path.write_text("\n".join([header, json.dumps(entry_line)]) + "\n")
    with pytest.raises(BackupError, match=r":2: job fx-new is a record of format 2"):
        read_backup(path, config)
    assert len(lines) == 1


async def test_a_batch_of_another_major_that_does_not_decode_here_is_refused_by_its_version(
    harness: Harness,
) -> None:
    """A newer major may send events this broker has no type for: it is still told why,
    rather than counted as garbage."""
    broker = await harness.start_broker()
    told: asyncio.Queue[Any] = asyncio.Queue()

    async def on_cmd(msg: Any) -> None:
        told.put_nowait(decode_command(msg.data))
        await msg.respond(encode_msgpack(CommandAck(ok=True)))

    sub = await harness.nc.subscribe(harness.subjects.agent_cmd("pluto"), cb=on_cmd)
    batch = {
        "cluster": "pluto",
        "instance": "i-3",
        "seq": 1,
        "events": [{"type": "quantum_flux", "level": 3}],
        "wire": "3.2",
    }
    await harness.nc.publish(harness.subjects.agent_events("pluto"), msgspec.msgpack.encode(batch))
    cmd = await next_item(told, 10)
    assert isinstance(cmd, WireRefused)
    assert (cmd.agent_wire, cmd.broker_wire) == ("3.2", WIRE_VERSION)
    assert broker.refused["agent_wire"] == 1 and broker.stats["bad_batches"] == 0
    await sub.unsubscribe()


@given(st.binary(max_size=200))
def test_reading_the_wire_version_of_any_bytes_never_raises(data: bytes) -> None:
    """It runs on batches that did not decode: whatever they hold, a version or None."""
    wire = _peek_wire(data)
    assert wire is None or isinstance(wire, str)


@given(
    st.text(max_size=40),
    st.dictionaries(st.text(max_size=8), st.integers(-(2**63), 2**63 - 1), max_size=3),
)
def test_the_version_a_batch_carries_is_read_whatever_else_it_holds(
    wire: str, extra: dict[str, int]
) -> None:
    fields: dict[str, Any] = {**extra, "events": [{"type": "from-the-future"}], "wire": wire}
    assert _peek_wire(msgspec.msgpack.encode(fields)) == wire


@given(st.integers(1, 1_000_000))
def test_a_records_format_survives_decoding_beside_fields_it_does_not_know(fmt: int) -> None:
    fields = msgspec.msgpack.decode(previous_messages()["JobRecord"])
    fields.update(format=fmt, from_the_future=[1, 2])
    assert record_decoder.decode(msgspec.msgpack.encode(fields)).format == fmt
