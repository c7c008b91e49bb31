"""Dispatches to one cluster sent as one request (wire 1.3), and the answer shared out.

An admission cycle that places many jobs on one cluster used to cost a request and a reply per
job, on both ends: a third of the broker's time is nats-py's cost per message. Now the
Dispatches the effect pipeline carries out in one pass go to each cluster whose agent speaks
wire 1.3 in `DispatchBatch`es (at most MAX_BATCH_DISPATCHES, and `limit` bytes, each), and the
agent answers every Dispatch of a batch in one `DispatchAcks`.

A batch whose answer does not come in its wait is handed to the one-by-one path
(broker/executor.py, `_send_dispatch`), each Dispatch with the batch as its first copy, still
outstanding: `SharedReply` turns the batch's late answer into one answer per Dispatch, so it
counts as the late ack of a single copy would. An answer that is not one ack per Dispatch (a
refusal of the whole batch, an agent that does not know batches) sends each Dispatch again on
its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
from nats.errors import NoRespondersError

from schemas.agent import MAX_BATCH_DISPATCHES, CommandAck, Dispatch
from schemas.codec import DecodeError, decode_command_ack, decode_dispatch_acks, encode_msgpack
from shell.natsio import Asked

MAX_BATCH_BYTES = 256 * 1024  # a batch's bytes at most (NATS allows 1 MiB a message by default)


class _RawBatch(msgspec.Struct, tag="dispatch_batch", omit_defaults=True):
    """`DispatchBatch` as the broker writes it: each Dispatch encoded once, to size the batch."""

    epoch: int
    dispatches: list[msgspec.Raw]


def dispatch_batches(
    cmds: list[Dispatch], most: int = MAX_BATCH_DISPATCHES, limit: int = MAX_BATCH_BYTES
) -> Iterator[tuple[list[Dispatch], bytes]]:
    """The requests `cmds` go out in, in order, each with its bytes: a new batch when one
    would pass `most` Dispatches or `limit` bytes, or when the epoch changes. A group of one
    is the Dispatch alone, as an agent of any version reads it (`most` 1: every one alone)."""
    group: list[Dispatch] = []
    raws: list[msgspec.Raw] = []
    size = 0

    def request() -> bytes:
        if len(raws) == 1:
            return bytes(raws[0])
        return encode_msgpack(_RawBatch(group[0].epoch, raws))

    for cmd in cmds:
        raw = msgspec.Raw(encode_msgpack(cmd))
        if group and (len(group) >= most or size + len(raw) > limit or cmd.epoch != group[0].epoch):
            yield group, request()
            group, raws, size = [], [], 0
        group.append(cmd)
        raws.append(raw)
        size += len(raw)
    if group:
        yield group, request()


BatchAnswer = list[CommandAck] | CommandAck | str


def _unanswered(cluster: str, exc: Exception) -> str:
    """Why a reply future holds no answer."""
    if isinstance(exc, NoRespondersError):
        return f"no agent is listening for cluster {cluster!r}"
    return f"no answer from cluster {cluster!r}: {type(exc).__name__}: {exc}"


def read_ack(cluster: str, reply: asyncio.Future[Any]) -> CommandAck | str:
    """A copy's answer: the agent's ack, or why it is none (nobody listens, not an ack). A
    batch's share of its answer (`SharedReply`) is read already."""
    try:
        got = reply.result()
    except Exception as exc:
        return _unanswered(cluster, exc)
    if isinstance(got, CommandAck | str):
        return got
    try:
        return decode_command_ack(got.data)
    except DecodeError as exc:
        return f"bad ack from cluster {cluster!r}: {exc}"


def read_batch_answer(cluster: str, reply: asyncio.Future[Any], count: int) -> BatchAnswer:
    """A batch's answer: one ack per Dispatch; one ack for the whole batch (a stale epoch,
    a batch the agent refused as such); or why there is none (nobody listens, not an ack)."""
    try:
        data = reply.result().data
    except Exception as exc:
        return _unanswered(cluster, exc)
    try:
        acks = decode_dispatch_acks(data).acks
    except DecodeError:
        return read_ack(cluster, reply)
    if len(acks) != count:
        return f"bad ack from cluster {cluster!r}: {len(acks)} acks for {count} dispatches"
    return acks


class SharedReply:
    """A batch's reply as one future per Dispatch (`parts`), each resolving with its own
    ack, the whole batch's, or why there is none: what `read_ack` reads from a copy. The
    batch's request is forgotten once every part is done or forgotten."""

    def __init__(self, asked: Asked, cluster: str, count: int, forget: Callable[[Asked], None]):
        loop = asyncio.get_running_loop()
        self._asked = asked
        self._cluster = cluster
        self._forget = forget
        self._open = count
        self.parts = [
            Asked(f"{asked.token}/{i}", loop.create_future(), asked.sent) for i in range(count)
        ]
        for part in self.parts:
            part.reply.add_done_callback(self._closed)
        asked.reply.add_done_callback(self._answered)

    def _answered(self, reply: asyncio.Future[Any]) -> None:
        if reply.cancelled():
            for part in self.parts:
                part.reply.cancel()
            return
        got = read_batch_answer(self._cluster, reply, len(self.parts))
        for i, part in enumerate(self.parts):
            share: asyncio.Future[Any] = part.reply
            if not share.done():
                share.set_result(got[i] if isinstance(got, list) else got)

    def _closed(self, _: asyncio.Future[Any]) -> None:
        self._open -= 1
        if self._open == 0:
            self._forget(self._asked)
