"""One read of a KV bucket's newest message per key, in large batches: how a broker that
leads at once (a restart) and a backup read the job records.

The standby's mirror (`broker.store.RecordMirror`) follows the bucket with nats-py's ordered
push consumer: every message goes through its sequence check, metadata parse and flow
control. A read that stops once caught up needs none of that: an ephemeral pull consumer (last
per subject, no acks) delivers into a plain subscription whose messages are taken as nats-py
parses them (`shell.natsio.deliver_inline`), with pull requests of `BATCH`
messages kept outstanding so the server holds at most about two batches for this client (a
flood of 100,000 could exceed its pending limit and cut the connection as a slow consumer).
Each message goes to the mirror's own taker, its stream sequence read from the reply subject.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from nats.aio.msg import Msg
from nats.js import api
from nats.js.client import JetStreamContext

from schemas.codec import encode_json
from shell.natsio import deliver_inline, js_api_prefix, js_connection

BATCH = 10_000  # messages a pull request asks for
INACTIVE_S = 10.0  # the server drops the consumer by then if this broker dies mid-read
HEARTBEAT_S = 1.0  # the server's sign of a live pull request while it has nothing to send
SILENT_S = 5.0  # nothing at all for this long: the consumer is gone (the server need not say)


class ReadStopped(RuntimeError):
    """The server ended the read before it was caught up (the consumer was deleted, its
    stream's leader changed): the caller reads again."""


async def read_newest(
    js: JetStreamContext,
    stream: str,
    subjects: str,
    take: Callable[[Msg, int], None],
    done: asyncio.Future[None],
    expires_s: float,
) -> None:
    """Hand the newest message of every subject matching `subjects` to `take(msg, stream
    sequence)` in stream order, then the ones written meanwhile, until `take` resolves `done`
    (it knows the sequence it waits for). Raises ReadStopped when the server ends the read
    first, or goes silent (a deleted consumer's pull requests may just stop, heartbeats and
    all); the caller bounds it in time."""
    nc = js_connection(js)
    config = api.ConsumerConfig(
        deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
        ack_policy=api.AckPolicy.NONE,
        filter_subject=subjects,
        max_deliver=1,
        mem_storage=True,
        num_replicas=1,
        inactive_threshold=INACTIVE_S,
    )
    consumer = (await js.add_consumer(stream, config=config)).name
    next_subject = f"{js_api_prefix(js)}.CONSUMER.MSG.NEXT.{stream}.{consumer}"
    request = encode_json(
        {
            "batch": BATCH,
            "expires": int(expires_s * 1e9),
            "idle_heartbeat": int(HEARTBEAT_S * 1e9),
        }
    )
    inbox = nc.new_inbox()
    loop = asyncio.get_running_loop()
    asked = delivered = heard = 0
    asking: list[asyncio.Task[None]] = []

    def ask() -> None:
        nonlocal asked
        asked += BATCH
        asking.append(loop.create_task(nc.publish(next_subject, request, reply=inbox)))

    def on_msg(msg: Msg) -> None:  # runs inside nats-py's reader: never raises
        nonlocal delivered, heard
        heard += 1
        if not msg.reply:  # a status: a heartbeat, or the pull request ended (408, 409, 503)
            status = (msg.headers or {}).get("Status")
            if status != "100" and not done.done():
                done.set_exception(ReadStopped(f"reading {stream} stopped: status {status}"))
            return
        try:
            take(msg, stream_seq(msg))
        except Exception as exc:
            if not done.done():
                done.set_exception(exc)
            return
        delivered += 1
        if asked - delivered < BATCH and not done.done():
            ask()

    sub = await nc.subscribe(inbox, pending_msgs_limit=-1, pending_bytes_limit=-1)
    deliver_inline(sub, on_msg)
    try:
        ask()
        ask()
        quiet_since, seen = loop.time(), heard
        while not done.done():
            await asyncio.wait({done}, timeout=HEARTBEAT_S)
            if heard != seen:
                quiet_since, seen = loop.time(), heard
            elif not done.done() and loop.time() - quiet_since > SILENT_S:
                raise ReadStopped(f"reading {stream} stopped: nothing heard for {SILENT_S} s")
        done.result()
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(1.0):
                await js.delete_consumer(stream, consumer)
        for task in asking:
            task.cancel()


def stream_seq(msg: Msg) -> int:
    """`msg.metadata.sequence.stream` without building the whole Metadata (two dataclasses
    and a datetime per record, a tenth of a restart): the sequence is a token of the ack
    subject, `$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>`, or the
    longer form with domain and account hash, where it is the 8th token."""
    tokens = (msg.reply or "").split(".")
    if tokens[:2] == ["$JS", "ACK"]:
        if len(tokens) == 9:
            return int(tokens[5])
        if len(tokens) >= 11:
            return int(tokens[7])
    return int(msg.metadata.sequence.stream)
