"""Reading a job's container logs through the agent of the cluster its attempt ran on.

The broker only says where an attempt ran (`muster.api.get`); the lines come straight from
that cluster's agent as LogChunks on a private inbox, so logs never pass through the broker.
An admin asks the agent directly. A team asks on `muster.api.<team>.logs`: the broker checks
the job is the team's and forwards the request to the agent with the team's reply subject.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from nats.aio.client import Client

from broker.client import MusterClient, MusterError
from schemas.agent import LogChunk, LogRequest
from schemas.api import JobView
from schemas.codec import DecodeError, encode_json, json_decoder
from schemas.subjects import Subjects

_chunk = json_decoder(LogChunk, "LogChunk")
_request = json_decoder(LogRequest, "LogRequest")
FIRST_CHUNK_S = 5.0  # an agent that says nothing for this long is taken as gone
QUIET_S = 30.0  # the longest a follow waits between chunks before checking it is still wanted


def where_it_ran(view: JobView, attempt: int | None) -> tuple[int, str]:
    """The attempt (default: the latest) and the cluster it ran on, or a MusterError."""
    job_id = view.job_id
    if attempt is None:
        attempt = view.attempt
        if attempt == 0:
            raise MusterError(
                f"job {job_id} has not started yet (state {view.state}); "
                f"`muster why {job_id}` says why"
            )
    where = next((a for a in view.attempts if a.attempt == attempt), None)
    if where is None:
        known = ", ".join(str(a.attempt) for a in view.attempts) or "none yet"
        raise MusterError(f"job {job_id} has no attempt {attempt}; its attempts: {known}")
    return attempt, where.cluster


async def read_logs(
    client: MusterClient,
    job_id: str,
    *,
    attempt: int | None = None,
    podset: str | None = None,
    replica: int | None = None,
    tail_lines: int = 100,
    follow: bool = False,
    follow_s: float = 600.0,
) -> AsyncIterator[list[str]]:
    """Yield lines as the agent sends them; MusterError says which job, attempt or cluster is
    at fault when there is nothing to read."""
    attempt, cluster = where_it_ran(await client.get(job_id), attempt)
    try:
        req = LogRequest(
            job_id=job_id,
            attempt=attempt,
            podset=podset,
            replica=replica,
            tail_lines=tail_lines,
            follow=follow,
            follow_s=follow_s,
        )
        _request(encode_json(req))  # the agent's limits, checked here first
    except (DecodeError, ValueError) as exc:
        raise MusterError(str(exc)) from None
    async for lines in stream_chunks(client.nc, client.subjects, cluster, req, team=client.team):
        yield lines


async def stream_chunks(
    nc: Client,
    subjects: Subjects,
    cluster: str,
    req: LogRequest,
    *,
    first_s: float = FIRST_CHUNK_S,
    team: str | None = None,
) -> AsyncIterator[list[str]]:
    """Ask `cluster`'s agent for `req` (as `team`: through the broker's ownership check) and
    yield each chunk's lines until the last."""
    inbox = nc.new_inbox()
    sub: Any = await nc.subscribe(inbox)
    attempt, job_id, follow = req.attempt, req.job_id, req.follow
    try:
        ask = subjects.api_as(team, "logs") if team else subjects.agent_logs(cluster)
        await nc.publish(ask, encode_json(req), reply=inbox)
        gone = (
            f"attempt {attempt} of job {job_id} ran on cluster {cluster!r}, whose agent does "
            "not answer: the cluster is gone or unreachable"
        )
        expected = 0
        wait = first_s
        while True:
            try:
                msg = await sub.next_msg(timeout=wait)
            except Exception:
                if expected == 0:
                    raise MusterError(gone) from None
                if follow:
                    continue
                raise MusterError(f"cluster {cluster!r} stopped sending logs") from None
            if msg.headers and msg.headers.get("Status") == "503":
                raise MusterError(gone)
            try:
                chunk = _chunk(msg.data)
            except DecodeError as exc:
                raise MusterError(f"bad log chunk from cluster {cluster!r}: {exc}") from None
            if chunk.error:
                raise MusterError(chunk.error)
            if chunk.seq != expected:
                raise MusterError(f"log chunks from cluster {cluster!r} were lost; retry")
            if chunk.lines:
                yield chunk.lines
            if chunk.eof:
                return
            expected += 1
            wait = QUIET_S if follow else first_s
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
