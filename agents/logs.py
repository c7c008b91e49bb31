"""The agent's side of `muster logs`: answers LogRequests on `<prefix>.agent.<cluster>.logs`.

Each request is served by its own task and streamed back as LogChunks on the request's reply
subject: at most MAX_CHUNK_BYTES a chunk, at most `limit_bytes` in all (the newest lines are
kept), and an `eof` chunk last. A follow re-reads the tail every FOLLOW_POLL_S and sends the
lines it has not sent yet, until the attempt ends or `follow_s` runs out. At most MAX_STREAMS
requests are served at once per agent; more are refused with a reason.
"""

from __future__ import annotations

import asyncio
from typing import ClassVar

import structlog
from nats.aio.client import Client

from agents.backend import Backend, BackendError
from agents.service import Replier
from schemas.agent import MAX_LOG_CHUNK_BYTES, MAX_LOG_LINE, LogChunk, LogRequest
from schemas.codec import json_decoder

log = structlog.get_logger("muster.agent.logs")
_decode = json_decoder(LogRequest, "LogRequest")
MAX_STREAMS = 16
FOLLOW_POLL_S = 0.5


class LogServer(Replier[LogRequest]):
    too_large: ClassVar[str] = "log request too large"

    def __init__(self, nc: Client, subject: str, cluster: str, backend: Backend) -> None:
        super().__init__(nc, subject, cluster, backend, _decode)
        self.streams: set[asyncio.Task[None]] = set()

    async def stop(self) -> None:
        await super().stop()
        for task in list(self.streams):
            task.cancel()
        if self.streams:
            await asyncio.wait(set(self.streams), timeout=2)

    async def serve(self, data: bytes, reply: str) -> None:
        req = self.read(data)
        if isinstance(req, str):
            await self.send(reply, LogChunk(seq=0, eof=True, error=req))
            return
        if len(self.streams) >= MAX_STREAMS:
            error = f"cluster {self.cluster!r} is serving {MAX_STREAMS} log streams; retry soon"
            await self.send(reply, LogChunk(seq=0, eof=True, error=error))
            return
        task = asyncio.create_task(self._stream(req, reply))
        self.streams.add(task)
        task.add_done_callback(self.streams.discard)

    async def _stream(self, req: LogRequest, reply: str) -> None:
        seq = 0
        reader = getattr(self.backend, "read_logs", None)
        if reader is None:
            error = f"the agent of cluster {self.cluster!r} cannot read logs"
            await self.send(reply, LogChunk(seq=0, eof=True, error=error))
            return
        loop = asyncio.get_running_loop()
        until = loop.time() + req.follow_s
        sent: list[str] = []
        budget = req.limit_bytes
        try:
            while True:
                try:
                    tail = await reader(req)
                except BackendError as exc:
                    await self.send(reply, LogChunk(seq=seq, eof=True, error=str(exc)[:1000]))
                    return
                fresh = _after(sent, tail.lines)
                sent = (sent + fresh)[-req.tail_lines :]
                fresh, budget = _within(fresh, budget)
                for lines in _chunks(fresh):
                    await self.send(reply, LogChunk(seq=seq, lines=lines))
                    seq += 1
                if not req.follow or tail.ended or budget <= 0 or loop.time() >= until:
                    break
                await asyncio.sleep(FOLLOW_POLL_S)
        except Exception as exc:  # a backend bug must not leave the reader waiting
            log.exception("logs.failed", job_id=req.job_id, attempt=req.attempt)
            await self.send(reply, LogChunk(seq=seq, eof=True, error=f"log read failed: {exc}"))
            return
        await self.send(reply, LogChunk(seq=seq, eof=True))


def _after(sent: list[str], lines: list[str]) -> list[str]:
    """The lines of a new tail that follow what was already sent (tails only grow at the end)."""
    if not sent:
        return lines
    last = sent[-1]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i] == last:
            return lines[i + 1 :]
    return lines


def _within(lines: list[str], budget: int) -> tuple[list[str], int]:
    """The newest lines that fit in `budget` bytes (each cut to MAX_LOG_LINE characters)."""
    lines = [line[:MAX_LOG_LINE] for line in lines]
    kept: list[str] = []
    for line in reversed(lines):
        size = len(line.encode()) + 1
        if size > budget:
            budget = 0
            break
        kept.append(line)
        budget -= size
    kept.reverse()
    return kept, budget


def _chunks(lines: list[str]) -> list[list[str]]:
    out: list[list[str]] = []
    current: list[str] = []
    size = 0
    for line in lines:
        n = len(line.encode()) + 8
        if current and size + n > MAX_LOG_CHUNK_BYTES - 256:
            out.append(current)
            current, size = [], 0
        current.append(line)
        size += n
    if current:
        out.append(current)
    return out
