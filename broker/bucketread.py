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
from typing import Any

import structlog
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import api
from nats.js.client import JetStreamContext
from nats.js.errors import APIError, NotFoundError

from schemas.codec import encode_json
from shell.natsio import deliver_inline, js_api_prefix, js_connection

log = structlog.get_logger("muster.bucketread")

BATCH = 10_000  # messages a pull request asks for
INACTIVE_S = 10.0  # the server drops the consumer by then if this broker dies mid-read
HEARTBEAT_S = 1.0  # the server's sign of a live pull request while it has nothing to send
# Nothing at all for this long: the consumer is gone (a dropped consumer's pull requests may
# just stop). Two missed heartbeats, as the mirror's ordered consumer is reset after.
SILENT_S = 2.0
FIRST_PAUSE_S = 0.05  # before the first try again; doubled each time up to MAX_PAUSE_S
MAX_PAUSE_S = 1.0
ASK_S = 2.0  # one JetStream API call (consumer create, stream info) waits this long

# What says "try again" on an R3 cluster, and what the ordered consumer (the standby's mirror)
# rides over by recreating itself from the next sequence (nats-py 2.16, nats/js/client.py,
# `_JSI.reset_ordered_consumer`, `recreate_consumer`):
# - a pull request's status: "503" is no responders, nobody (yet) subscribed to the
#   consumer's MSG.NEXT subject (nats-py aio/client.py NO_RESPONDERS_STATUS: the consumer's
#   leader not elected yet, or its interest not yet across the routes); "409 Leadership
#   Change" and "409 Consumer Deleted" end every waiting pull request of a consumer whose
#   leader changed or that was deleted (nats-server server/consumer.go, checkPendingRequests
#   and releaseAnyPendingRequests); "408 Request Timeout" and "404 No Messages" end a request
#   early; nats-py's own fetch treats 404, 408 and 409 as temporary
#   (`JetStreamContext._is_temporary_error`).
# - a JetStream API call's answer: 503 (nats-server server/errors.json: 10008
#   JSClusterNotAvailErr "JetStream system temporarily unavailable", 10023 insufficient
#   resources, 10004 incomplete results; nats-py raises ServiceUnavailableError), 500 (10009
#   JSClusterNotLeaderErr "JetStream cluster can not handle request", 10007 not assigned,
#   10012 consumer create failed), no responders at all, or no answer in time.
# Anything else (a 400: the request is wrong) will not change by asking again.
TRY_AGAIN_STATUSES = {"503", "408", "404"}
TRY_AGAIN_409 = {"Leadership Change", "Consumer Deleted"}


class ReadStopped(RuntimeError):
    """The read did not catch up within its time (the stream had no leader, or the server kept
    ending it), or the server refused it for good: the caller reads again."""


class StreamMissing(ReadStopped):
    """The stream does not exist (the server said so: not a leaderless moment)."""


class _TryAgain(Exception):
    """This consumer's read ended early for a reason that passes (see TRY_AGAIN_STATUSES)."""


def _passes(exc: BaseException) -> bool:
    """A JetStream API call's failure that asking again may cure."""
    if isinstance(exc, NoRespondersError | NatsTimeoutError | TimeoutError):
        return True
    return isinstance(exc, APIError) and (exc.code or 0) >= 500


async def read_newest(
    js: JetStreamContext,
    stream: str,
    subjects: str,
    take: Callable[[Msg, int], None],
    done: asyncio.Future[None],
    expires_s: float,
    applied: Callable[[], int] = lambda: 0,
) -> None:
    """Hand the newest message of every subject matching `subjects` to `take(msg, stream
    sequence)` in stream order, then the ones written meanwhile, until `take` resolves `done`
    (it knows the sequence it waits for).

    A read the server ends early (see TRY_AGAIN_STATUSES), or that goes silent (a dropped
    consumer's pull requests may just stop, heartbeats and all), is read again by a new
    consumer, after a pause and once the stream's leader answers, from the sequence after
    `applied()` (the newest one `take` has applied): what the ordered consumer does. Only
    `done` ends the read; ReadStopped once `expires_s` has passed or the server refused it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + expires_s
    pause, tries = FIRST_PAUSE_S, 0
    bound = log.bind(stream=stream)
    while True:
        tries += 1
        try:
            await _read_once(js, stream, subjects, take, done, deadline, applied())
            return
        except _TryAgain as exc:
            reason = str(exc)
        bound.info("bucketread.try_again", reason=reason, tries=tries, applied=applied())
        if await _leader_info(js, stream, deadline, pause) is None:
            raise ReadStopped(
                f"reading {stream} did not catch up in {expires_s:.0f} s ({tries} tries, the "
                f"last ended by {reason}); check that the stream has a leader: "
                f"`nats stream info {stream}`"
            )
        pause = min(2 * pause, MAX_PAUSE_S)


async def leader_state(js: JetStreamContext, stream: str, expires_s: float) -> api.StreamInfo:
    """The stream's info as its leader gives it, asked again while it has no leader (an R3
    stream electing one, after a server's death) until `expires_s` has passed: then
    ReadStopped, as for a read."""
    deadline = asyncio.get_running_loop().time() + expires_s
    info = await _leader_info(js, stream, deadline, 0.0)
    if info is None:
        raise ReadStopped(
            f"the leader of stream {stream} did not answer in {expires_s:.0f} s; check that "
            f"the stream has a leader: `nats stream info {stream}`"
        )
    return info


def last_seq_of(info: api.StreamInfo) -> int:
    """The stream's last sequence, 0 while it holds no message."""
    return info.state.last_seq if info.state.messages else 0


async def _leader_info(
    js: JetStreamContext, stream: str, deadline: float, pause: float
) -> api.StreamInfo | None:
    """After `pause`, and pauses doubling from it, the stream's info once its leader answers;
    None at `deadline`. In a cluster the leader answers STREAM.INFO, and so does a member that
    has known for `lostQuorumInterval` (10 s) that the group has no leader
    (nats-server server/jetstream_cluster.go, `isGroupLeaderless`): that answer names no
    leader, and its state is that member's own, which may lag the stream's, so it is asked
    again."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(max(0.0, min(pause, deadline - loop.time())))
        left = deadline - loop.time()
        if left <= 0:
            return None
        try:
            async with asyncio.timeout(min(ASK_S, left)):
                info = await js.stream_info(stream)
            if info.cluster is None or info.cluster.leader:
                return info
        except NotFoundError as exc:
            raise StreamMissing(f"reading {stream}: the stream does not exist") from exc
        except Exception as exc:
            if not _passes(exc):
                raise ReadStopped(f"reading {stream}: the stream cannot be read: {exc}") from exc
        pause = min(max(2 * pause, FIRST_PAUSE_S), MAX_PAUSE_S)


async def _read_once(
    js: JetStreamContext,
    stream: str,
    subjects: str,
    take: Callable[[Msg, int], None],
    done: asyncio.Future[None],
    deadline: float,
    after: int,
) -> None:
    """One consumer's read from the sequence after `after` (or of every subject's newest):
    returns once `done` is resolved, raises _TryAgain when it ended early for a reason that
    passes."""
    nc = js_connection(js)
    loop = asyncio.get_running_loop()
    config = api.ConsumerConfig(
        deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
        ack_policy=api.AckPolicy.NONE,
        filter_subject=subjects,
        max_deliver=1,
        mem_storage=True,
        num_replicas=1,
        inactive_threshold=INACTIVE_S,
    )
    if after:
        # Every subject's newest up to `after` is taken already; whatever came later, in
        # order, brings the rest (nats-py's ordered consumer resumes the same way).
        config.deliver_policy = api.DeliverPolicy.BY_START_SEQUENCE
        config.opt_start_seq = after + 1
    try:
        left = max(0.1, min(ASK_S, deadline - loop.time()))
        consumer = (await js.add_consumer(stream, config=config, timeout=left)).name
    except Exception as exc:
        if _passes(exc):
            raise _TryAgain(f"consumer create: {exc!r}") from exc
        raise ReadStopped(f"reading {stream}: the server refused its consumer: {exc}") from exc
    next_subject = f"{js_api_prefix(js)}.CONSUMER.MSG.NEXT.{stream}.{consumer}"
    request = encode_json(
        {
            "batch": BATCH,
            "expires": int(max(deadline - loop.time(), 1.0) * 1e9),
            "idle_heartbeat": int(HEARTBEAT_S * 1e9),
        }
    )
    inbox = nc.new_inbox()
    ended: asyncio.Future[BaseException] = loop.create_future()
    asked = delivered = heard = 0
    asking: list[asyncio.Task[None]] = []

    def ask() -> None:
        nonlocal asked
        asked += BATCH
        asking.append(loop.create_task(nc.publish(next_subject, request, reply=inbox)))

    def end(exc: BaseException) -> None:
        if not ended.done():
            ended.set_result(exc)

    def on_msg(msg: Msg) -> None:  # runs inside nats-py's reader: never raises
        nonlocal delivered, heard
        heard += 1
        if not msg.reply:  # a status: a heartbeat, or the pull request ended
            headers = msg.headers or {}
            status = headers.get("Status")
            # nats-py leaves the header lines after a bare status ("503") in its description.
            description = (headers.get("Description") or "").split("\n")[0].strip()
            if status == "100":
                return
            said = f"status {status} {description}".rstrip()
            if status in TRY_AGAIN_STATUSES or (status == "409" and description in TRY_AGAIN_409):
                end(_TryAgain(said))
            else:
                end(ReadStopped(f"reading {stream} stopped: {said}"))
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
        either: set[asyncio.Future[Any]] = {done, ended}
        quiet_since, seen = loop.time(), heard
        while not done.done():
            await asyncio.wait(either, timeout=HEARTBEAT_S, return_when=asyncio.FIRST_COMPLETED)
            if done.done():
                break
            if ended.done():
                raise ended.result()
            if loop.time() >= deadline:
                raise _TryAgain("no time left")
            if heard != seen:
                quiet_since, seen = loop.time(), heard
            elif loop.time() - quiet_since > SILENT_S:
                raise _TryAgain(f"nothing heard for {SILENT_S} s")
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
