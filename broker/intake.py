"""Submission intake: one durable pull consumer per queue, read in turn.

A single consumer over the whole submission stream hands messages out in arrival order, so a
flood into one queue held every other queue's submissions behind it (about 75 s behind a
200,000-job flood). Here every queue name (and alias) has its own durable consumer filtered to
its submit subject, each with a pull request kept outstanding, and a batch takes messages from
the queues in turn: a submission to a quiet queue waits behind at most one share of a batch
per busy queue, never behind a busy queue's backlog. Delivery is unchanged: each message is
acked once its record is persisted (at least once), and the dead-letter path and the
per-queue pending cap apply per message as before.

The stream is a work queue, whose consumers may not overlap, so the stream takes only the
configured queues' subjects; a submission to any other subject is answered by the broker at
once (see `unknown_queue_reply`) and never stored.

What a submission must pass before the machine sees it lives here too: its submitter's rate
(`TokenBuckets`) and its parsing, as a JobSpec or a Kubernetes manifest (`parse_submission`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict, deque
from collections.abc import Iterable
from typing import Any

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import api
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError

from broker.core.submission import DEFAULT_QUEUE, unknown_queue_text
from schemas.codec import DecodeError, decode_jobspec, decode_json_object, encode_json
from schemas.config import BrokerConfig
from schemas.job import JobSpec
from schemas.subjects import Subjects

log = structlog.get_logger("muster.intake")

CONSUMER_PREFIX = "muster-intake-"
LEGACY_CONSUMER = "muster-broker"  # the one unfiltered consumer of earlier versions
ACK_WAIT_S = 5
MAX_ACK_PENDING = 20_000  # per queue
MIN_SHARE = 32  # the smallest pull request of one queue


def intake_names(config: BrokerConfig) -> list[str]:
    """Every name a submission subject may carry: queues, aliases, and `default` (the
    subject of a job that names no queue: the core answers it, with its own reason, even when
    no queue has that name)."""
    names = {q.name for q in config.queues} | set(config.queue_aliases) | {DEFAULT_QUEUE}
    return sorted(names)


def consumer_name(queue: str) -> str:
    return CONSUMER_PREFIX + queue


def unknown_queue_error(
    config: BrokerConfig, known: frozenset[str], queue: str | None
) -> str | None:
    """The refusal for a submission whose subject names no intake queue, else None. `known`
    is `intake_names(config)` as a set, made once: every plain copy of a submission is
    checked, and building the names again for each one took 7 % of a broker taking a flood
    of submissions to 100 queues."""
    if queue is not None and queue in known:
        return None
    return unknown_queue_text(queue, (q.name for q in config.queues))


async def ensure_intake(
    js: JetStreamContext, subjects: Subjects, stream: str, names: Iterable[str]
) -> None:
    """Make the stream take exactly these queues' subjects and give each its consumer.

    Consumers that no longer fit (the unfiltered one of earlier versions, queues dropped from
    the config) are deleted first; a work-queue stream keeps every unacked message, so the
    new per-queue consumers deliver what the old ones had not finished."""
    wanted = {consumer_name(n): subjects.submit(n) for n in names}
    info = await js.stream_info(stream)
    existing = [c.name for c in await js.consumers_info(stream)]
    for name in existing:
        if name == LEGACY_CONSUMER or (name.startswith(CONSUMER_PREFIX) and name not in wanted):
            log.info("intake.consumer_removed", consumer=name)
            with contextlib.suppress(NotFoundError):
                await js.delete_consumer(stream, name)
    subject_list = sorted(wanted.values())
    if sorted(info.config.subjects or []) != subject_list:
        info.config.subjects = subject_list
        await js.update_stream(info.config)
    for name, subject in wanted.items():
        if name in existing:
            continue
        await js.add_consumer(
            stream,
            api.ConsumerConfig(
                durable_name=name,
                filter_subject=subject,
                ack_policy=api.AckPolicy.EXPLICIT,
                ack_wait=ACK_WAIT_S,
                max_ack_pending=MAX_ACK_PENDING,
            ),
        )


class SubmitPuller:
    """The submission stream's durable pull consumer, read with one pull request kept
    outstanding so every submission is handed over as soon as the server delivers it.

    nats-py's `fetch(n, timeout)` waits, once the stream is idle, until n messages or the
    timeout: at 1,000 submissions/s that held each one for up to half a second. Here the
    consumer is the same, messages are acked by the caller exactly as before, and a batch is
    whatever arrived while the previous one was being processed."""

    def __init__(
        self,
        nc: Client,
        api_prefix: str,
        stream: str,
        consumer: str,
        wake: asyncio.Event | None = None,
    ) -> None:
        self.nc = nc
        self.next_subject = f"{api_prefix}.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self.inbox = nc.new_inbox()
        self.sub: Any = None
        self.pending: deque[Msg] = deque()
        self._wake = wake or asyncio.Event()  # shared by the pullers of one FairPuller
        self._left = 0  # messages the outstanding request may still deliver
        self._expires_at = 0.0

    async def start(self) -> None:
        self.sub = await self.nc.subscribe(
            self.inbox, cb=self._on_msg, pending_msgs_limit=-1, pending_bytes_limit=-1
        )

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            await self.sub.unsubscribe()

    async def _on_msg(self, msg: Msg) -> None:
        headers = msg.headers
        if headers and not msg.data and headers.get("Status"):
            if headers["Status"] != "100":  # 404/408/409: the pull request is over
                self._left = 0
                self._wake.set()
            return
        self.pending.append(msg)
        self._left -= 1
        self._wake.set()

    async def rearm(self, limit: int, timeout: float) -> None:
        """Keep a pull request outstanding once the last one is spent or expired."""
        if self._left <= 0 or asyncio.get_running_loop().time() >= self._expires_at:
            await self._pull(limit, timeout)

    async def _pull(self, batch: int, expires_s: float) -> None:
        # A request lives a little longer than one wait, so an idle broker re-asks about
        # once per `expires_s` and a busy one once per `batch` messages.
        expires = expires_s + 1.0
        self._left = batch
        self._expires_at = asyncio.get_running_loop().time() + expires
        request = {"batch": batch, "expires": int(expires * 1e9)}
        await self.nc.publish(self.next_subject, encode_json(request), reply=self.inbox)


class FairPuller:
    """One SubmitPuller per queue consumer, all waking one event; a batch takes one message
    from each queue with messages in turn, starting from a different queue every time."""

    def __init__(self, nc: Client, api_prefix: str, stream: str, queues: Iterable[str]) -> None:
        self._wake = asyncio.Event()
        self.pullers = [
            SubmitPuller(nc, api_prefix, stream, consumer_name(q), self._wake) for q in queues
        ]
        self._start = 0

    async def start(self) -> None:
        for puller in self.pullers:
            await puller.start()

    async def stop(self) -> None:
        for puller in self.pullers:
            await puller.stop()

    async def next_batch(self, limit: int, timeout: float) -> list[Msg]:
        """Messages delivered so far (at most `limit`, shared among the queues), waiting up
        to `timeout` for one. Every queue keeps a pull request outstanding meanwhile, so a
        quiet queue's submission is delivered while a busy queue's backlog is being taken."""
        # Each queue asks for its share of a batch: what waits in memory unprocessed (and
        # so ages towards its ack deadline) stays about one batch, however many queues.
        share = max(MIN_SHARE, limit // len(self.pullers))
        for puller in self.pullers:
            if not puller.pending:
                await puller.rearm(share, timeout)
        if not any(p.pending for p in self.pullers):
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
        n = len(self.pullers)
        order = [self.pullers[(self._start + i) % n] for i in range(n)]
        self._start = (self._start + 1) % n
        out: list[Msg] = []
        while len(out) < limit:
            took = False
            for puller in order:
                if puller.pending and len(out) < limit:
                    out.append(puller.pending.popleft())
                    took = True
            if not took:
                break
        return out


MAX_SUBMITTERS = 100_000  # token buckets kept at once


class TokenBuckets:
    """Submission rate per submitter: `rate` per second sustained, `burst` at once."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = float(burst)
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def take(self, key: str, now: float) -> bool:
        if self.rate <= 0:
            return True
        tokens, at = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        ok = tokens >= 1.0
        self._buckets[key] = (tokens - 1.0 if ok else tokens, now)
        while len(self._buckets) > MAX_SUBMITTERS:
            self._buckets.popitem(last=False)
        return ok


def parse_submission(data: bytes, limit: int, queue: str | None) -> JobSpec:
    """A JSON JobSpec, or a Kubernetes manifest (PyTorchJob, MPIJob, ...) to derive one from."""
    if b'"apiVersion"' in data[:4096] and b'"kind"' in data:
        from broker.manifests import ManifestError, is_manifest, jobspec_from_manifest

        obj = decode_json_object(data, limit)
        if is_manifest(obj):
            try:
                return jobspec_from_manifest(obj, queue=queue)
            except ManifestError as exc:
                raise DecodeError(f"invalid manifest: {exc}") from None
    spec = decode_jobspec(data, limit)
    if spec.workload.manifest is None:
        return spec
    from broker.manifests import ManifestError, with_manifest_checked

    try:
        return with_manifest_checked(spec)
    except ManifestError as exc:
        raise DecodeError(f"invalid workload.manifest: {exc}") from None
