"""Live updates for the dashboard and `muster top`, fed by the broker's job event subject.

The hub subscribes once to `<prefix>.events.job.*` (what the broker already publishes) and fans
each event out, as the bytes it arrived as, to every client's bounded queue. A client whose
queue is full is skipped ahead: its backlog is dropped and it is told to reload what it shows,
so a slow reader costs the broker one `put_nowait` per event and never a wait.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from schemas.api import JobEvent
from schemas.codec import DecodeError, decode_job_event
from schemas.subjects import Subjects
from shell.natsio import flush

CLIENT_QUEUE = 256  # events a client may lag behind before it is skipped ahead
MAX_CLIENTS = 64
RECENT_INTERRUPTIONS = 200
OVERFLOW = b"overflow"  # sentinel: the client missed events and must reload its view
CLOSING = b"closing"  # sentinel: the dashboard stops; the stream ends now


@dataclass(slots=True)
class Interruption:
    """A spot notice on one attempt and, once it happened, the attempt that replaced it."""

    job_id: str
    attempt: int
    cluster: str | None
    flavor: str | None
    notice_at: float
    cause: str
    recovered_at: float | None = None
    new_attempt: int | None = None
    new_cluster: str | None = None
    resume_from_step: int | None = None
    running_at: float | None = None  # the new attempt's gang running

    @property
    def latency_s(self) -> float | None:
        """Notice -> new attempt admitted (0 when it was reserved at the notice itself)."""
        if self.recovered_at is None:
            return None
        return self.recovered_at - self.notice_at

    @property
    def running_s(self) -> float | None:
        """Notice -> new attempt running: what the job actually waited."""
        if self.running_at is None:
            return None
        return self.running_at - self.notice_at

    def to_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "attempt": self.attempt,
            "cluster": self.cluster,
            "flavor": self.flavor,
            "notice_at": self.notice_at,
            "cause": self.cause,
            "recovered_at": self.recovered_at,
            "new_attempt": self.new_attempt,
            "new_cluster": self.new_cluster,
            "resume_from_step": self.resume_from_step,
            "latency_s": self.latency_s,
            "running_s": self.running_s,
        }


class Interruptions:
    """The recent spot notices and their recoveries, bounded."""

    CAUSES = frozenset({"spot-notice", "node-lost", "cluster-lost", "gpu-failure"})

    def __init__(self, limit: int = RECENT_INTERRUPTIONS) -> None:
        self.recent: deque[Interruption] = deque(maxlen=limit)
        self._open: dict[str, Interruption] = {}
        self._moving: dict[str, Interruption] = {}  # placed again, not yet running
        self.total = 0  # interruptions of a job seen, listed or not

    def observe(self, ev: JobEvent) -> None:
        reason = ev.reason or ""
        if reason.startswith("fenced: cluster "):  # a silent cluster's fence lapsed
            reason = "cluster-lost"
        if ev.kind in ("preempting", "requeued") and reason in self.CAUSES:
            if ev.job_id in self._open and self._open[ev.job_id].attempt == ev.attempt:
                return  # preempting then requeued: one interruption
            item = Interruption(
                job_id=ev.job_id,
                attempt=ev.attempt,
                cluster=ev.cluster,
                flavor=ev.flavor,
                notice_at=ev.at,
                cause=reason,
            )
            self.recent.append(item)
            self.total += 1
            self._open[ev.job_id] = item
            if len(self._open) > 4 * self.recent.maxlen:  # type: ignore[operator]
                self._open.pop(next(iter(self._open)))
        elif ev.kind == "admitted":
            was = self._open.get(ev.job_id)
            if was is not None and ev.attempt > was.attempt:
                was.recovered_at = ev.at
                was.new_attempt = ev.attempt
                was.new_cluster = ev.cluster
                was.resume_from_step = ev.resume_from_step
                del self._open[ev.job_id]
                self._moving[ev.job_id] = was
                if len(self._moving) > 4 * self.recent.maxlen:  # type: ignore[operator]
                    self._moving.pop(next(iter(self._moving)))
        elif ev.kind == "running":
            moved = self._moving.get(ev.job_id)
            if moved is not None and ev.attempt == moved.new_attempt:
                moved.running_at = ev.at
                del self._moving[ev.job_id]
        elif ev.kind in ("succeeded", "failed", "cancelled"):
            self._open.pop(ev.job_id, None)
            self._moving.pop(ev.job_id, None)

    def newest_first(self, limit: int) -> list[dict[str, Any]]:
        return [i.to_dict() for i in reversed(self.recent)][:limit]


class Subscriber:
    """One live client: a bounded queue of raw event payloads, optionally for one job."""

    def __init__(self, job_id: str | None = None, size: int = CLIENT_QUEUE) -> None:
        self.job_id = job_id
        self.queue: asyncio.Queue[bytes] = asyncio.Queue(size)
        self.skipped = 0  # times this client fell behind and was skipped ahead

    def close(self) -> None:
        """End the client's stream: whatever it had not read yet is dropped."""
        while not self.queue.empty():
            self.queue.get_nowait()
        self.queue.put_nowait(CLOSING)

    def offer(self, data: bytes) -> None:
        try:
            self.queue.put_nowait(data)
        except asyncio.QueueFull:
            self.skipped += 1
            while not self.queue.empty():
                self.queue.get_nowait()
            self.queue.put_nowait(OVERFLOW)


class EventHub:
    """The one subscription to job events; everything live reads from here."""

    def __init__(self, nc: Client, subjects: Subjects, max_clients: int = MAX_CLIENTS) -> None:
        self.nc = nc
        self.subjects = subjects
        self.max_clients = max_clients
        self.clients: set[Subscriber] = set()
        self.interruptions = Interruptions()
        self.events_seen = 0
        self._sub: Any = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(
            self.subjects.job_events_all,
            cb=self._on_event,
            pending_msgs_limit=100_000,
            pending_bytes_limit=64 * 1024 * 1024,
        )
        # The server knows the subscription once this returns: no event published after the
        # dashboard started is missed.
        await flush(self.nc)

    async def stop(self) -> None:
        # Open event streams end at once: a web server shutting down would otherwise wait
        # for each of them until its own shutdown timeout (a minute per stage in aiohttp).
        for client in list(self.clients):
            client.close()
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    async def _on_event(self, msg: Msg) -> None:
        try:
            ev = decode_job_event(msg.data)
        except DecodeError:
            return
        self.events_seen += 1
        self.interruptions.observe(ev)
        for client in self.clients:
            if client.job_id is None or client.job_id == ev.job_id:
                client.offer(msg.data)

    def join(self, job_id: str | None = None) -> Subscriber | None:
        """A new client, or None when the hub already serves `max_clients`."""
        if len(self.clients) >= self.max_clients:
            return None
        client = Subscriber(job_id)
        self.clients.add(client)
        return client

    def leave(self, client: Subscriber) -> None:
        self.clients.discard(client)
