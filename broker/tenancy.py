"""Team-scoped API calls on `muster.api.<team>.<verb>`.

NATS authorization (`muster nats-config`) lets a team's user publish only under its own team
token, so the subject names the caller and no payload or header can claim another team. Here
the broker answers only about that team's jobs: another team's job is "unknown", exactly as a
job that does not exist, so ids are not confirmed to outsiders.
"""

from __future__ import annotations

from typing import Any

from broker import api as broker_api
from broker.core.effects import Effect
from broker.core.machine import Machine
from schemas.agent import LogChunk, LogRequest
from schemas.api import ApiReply, ListRequest
from schemas.codec import DecodeError, encode_json, json_decoder
from schemas.config import BrokerConfig
from schemas.subjects import Subjects

_list = json_decoder(ListRequest, "ListRequest")
_job_id = json_decoder(dict[str, Any], "request")
_log_request = json_decoder(LogRequest, "LogRequest")

# Verbs about one job (checked by owner) and verbs with no job data in them.
_JOB_VERBS = frozenset({"get", "why", "cancel"})
_OPEN_VERBS = frozenset({"queues", "clusters"})


def team_queues(config: BrokerConfig) -> dict[str, frozenset[str]]:
    owned: dict[str, set[str]] = {}
    for q in config.queues:
        if q.team:
            owned.setdefault(q.team, set()).add(q.name)
    return {team: frozenset(qs) for team, qs in owned.items()}


def team_of_queue(config: BrokerConfig) -> dict[str, str]:
    return {q.name: q.team for q in config.queues if q.team}


def split_api_subject(prefix: str, subject: str) -> tuple[str | None, str]:
    """`<prefix>.api.<verb>` -> (None, verb); `<prefix>.api.<team>.<verb>` -> (team, verb)."""
    rest = subject[len(prefix) + len(".api.") :].split(".")
    return (None, rest[0]) if len(rest) == 1 else (rest[0], rest[-1])


def reply_allowed(reply: str, own_prefix: str) -> bool:
    """Whether the broker may answer on `reply`. A requester picks its reply subject, and the
    broker may publish anywhere: without this check a reply of `$KV.<bucket>.<job_id>` or
    `muster.submit.<queue>` would make the broker overwrite its own job records or submit in
    another team's name. Only inboxes qualify (`_INBOX.`, `_INBOX_<user>.`), never the
    broker's own, where its JetStream deliveries arrive."""
    head = reply.split(".", 1)[0]
    shared = own_prefix == "_INBOX"  # no private inboxes: nothing of the broker's to protect
    return head.startswith("_INBOX") and "." in reply and (shared or head != own_prefix)


def inbox_prefix_of(nc: Any) -> str:
    """The inbox prefix a connection was opened with."""
    return str(nc.new_inbox()).split(".", 1)[0]


def forward_logs(
    team: str, owned: frozenset[str], machine: Machine, subjects: Subjects, data: bytes
) -> tuple[str, bytes] | bytes:
    """A team's log read: (the agent's log subject, the request to forward with the team's
    reply subject) for its own job's attempt, or a LogChunk refusing it. The lines then flow
    from the agent straight to the team's inbox; only the ownership check passes through here.
    The cluster is the broker's record of where the attempt ran, never the caller's word."""
    try:
        req = _log_request(data)
    except DecodeError as exc:
        return encode_json(LogChunk(seq=0, eof=True, error=str(exc)[:1000]))
    record = machine.jobs.get(req.job_id)
    if record is None or record.queue not in owned:
        error = f"unknown job {req.job_id!r} (team {team!r} reads only its own jobs' logs)"
        return encode_json(LogChunk(seq=0, eof=True, error=error))
    where = next((a for a in record.attempts if a.attempt == req.attempt), None)
    if where is None:
        known = ", ".join(str(a.attempt) for a in record.attempts) or "none yet"
        error = f"job {req.job_id} has no attempt {req.attempt}; its attempts: {known}"
        return encode_json(LogChunk(seq=0, eof=True, error=error))
    return subjects.agent_logs(where.cluster), data


def id_taken(
    machine: Machine, owners: dict[str, str], job_id: str | None, queue: str | None
) -> str | None:
    """Why a client-chosen `job_id` may not be answered "duplicate": it names a job of another
    owner (team, or admins for queues without one). Job ids are global, so without this one
    team could submit another's predictable id first and have the victim's job silently never
    exist. A retry by the same owner stays a harmless duplicate."""
    existing = machine.jobs.get(job_id) if job_id else None
    if existing is None or queue is None:
        return None
    target = machine.config.queue_aliases.get(queue, queue)
    if owners.get(existing.queue) == owners.get(target):
        return None
    return (
        f"job_id {job_id!r} is already taken; choose another, or leave job_id out and the "
        "broker picks an unguessable one"
    )


def _err(error: str) -> bytes:
    return encode_json(ApiReply[Any](ok=False, error=error))


def handle_as(
    team: str, owned: frozenset[str], machine: Machine, verb: str, data: bytes, now: float
) -> tuple[bytes, list[Effect]]:
    """The API as `team` sees it; anything else is refused and changes nothing."""
    try:
        if verb in _JOB_VERBS:
            job_id = _job_id(data or b"{}").get("job_id")
            record = machine.jobs.get(job_id) if isinstance(job_id, str) else None
            if record is None or record.queue not in owned:
                return _err(f"unknown job {job_id!r} (team {team!r} sees only its own jobs)"), []
        elif verb == "list":
            req = _list(data or b"{}")
            if req.queue is not None and req.queue not in owned:
                mine = ", ".join(sorted(owned)) or "none"
                return _err(f"queue {req.queue!r} is not team {team!r}'s; its queues: {mine}"), []
            jobs = [
                view
                for q in sorted(owned if req.queue is None else {req.queue})
                for view in machine.views.list_jobs(
                    now, queue=q, state=req.state, cluster=req.cluster, limit=req.limit
                )
            ]
            return encode_json(ApiReply[Any](ok=True, result=jobs[: req.limit])), []
        elif verb not in _OPEN_VERBS:
            allowed = ", ".join(sorted(_JOB_VERBS | _OPEN_VERBS | {"list"}))
            return _err(f"verb {verb!r} is not open to teams; use one of: {allowed}"), []
    except DecodeError as exc:
        return _err(str(exc)), []
    return broker_api.handle(machine, verb, data, now)
