"""The request/reply API on `muster.api.<verb>`: decode, ask the machine, encode.

Kept free of NATS so it can be tested and reused; the service wires it to subjects.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from broker.core.effects import Effect, refusal
from broker.core.inputs import CancelJob
from broker.core.machine import Machine
from schemas.api import ApiReply, CancelRequest, Empty, JobRef, ListRequest
from schemas.codec import DecodeError, encode_json, json_decoder

_job_ref = json_decoder(JobRef, "JobRef")
_cancel = json_decoder(CancelRequest, "CancelRequest")
_list = json_decoder(ListRequest, "ListRequest")
_empty = json_decoder(Empty, "request")

Handler = Callable[[Machine, bytes, float], tuple[ApiReply[Any], list[Effect]]]


def _ok(result: Any) -> ApiReply[Any]:
    return ApiReply(ok=True, result=result)


def _err(error: str) -> ApiReply[Any]:
    return ApiReply(ok=False, error=error)


def _get(m: Machine, data: bytes, now: float) -> tuple[ApiReply[Any], list[Effect]]:
    ref = _job_ref(data)
    view = m.views.job_view(ref.job_id, now)
    return (_ok(view) if view else _err(f"unknown job {ref.job_id!r}")), []


def _list_jobs(m: Machine, data: bytes, now: float) -> tuple[ApiReply[Any], list[Effect]]:
    req = _list(data or b"{}")
    jobs = m.views.list_jobs(
        now, queue=req.queue, state=req.state, cluster=req.cluster, limit=req.limit
    )
    return _ok(jobs), []


def _cancel_job(m: Machine, data: bytes, now: float) -> tuple[ApiReply[Any], list[Effect]]:
    req = _cancel(data)
    effects = m.handle(CancelJob(req.job_id, req.reason), now)
    error = refusal(effects)
    if error:
        return _err(error), []
    return _ok(m.views.job_view(req.job_id, now, with_spec=False)), effects


def _why(m: Machine, data: bytes, now: float) -> tuple[ApiReply[Any], list[Effect]]:
    ref = _job_ref(data)
    view = m.views.why(ref.job_id, now)
    return (_ok(view) if view else _err(f"unknown job {ref.job_id!r}")), []


def _queues(m: Machine, data: bytes, now: float) -> tuple[ApiReply[Any], list[Effect]]:
    _empty(data or b"{}")
    return _ok(m.views.queue_views()), []


def _clusters(m: Machine, data: bytes, now: float) -> tuple[ApiReply[Any], list[Effect]]:
    _empty(data or b"{}")
    return _ok(m.views.cluster_views(now)), []


HANDLERS: dict[str, Handler] = {
    "get": _get,
    "list": _list_jobs,
    "cancel": _cancel_job,
    "why": _why,
    "queues": _queues,
    "clusters": _clusters,
}


def handle(machine: Machine, verb: str, data: bytes, now: float) -> tuple[bytes, list[Effect]]:
    """Every outcome is a JSON ApiReply; bad input never raises."""
    handler = HANDLERS.get(verb)
    if handler is None:
        known = ", ".join(sorted(HANDLERS))
        return encode_json(_err(f"unknown API verb {verb!r}; use one of: {known}")), []
    try:
        reply, effects = handler(machine, data, now)
    except DecodeError as exc:
        return encode_json(_err(str(exc))), []
    return encode_json(reply), effects
