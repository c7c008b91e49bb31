"""What the lifecycle machine asks the shell to do. The shell executes effects in order."""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from broker.core.records import JobRecord
from schemas.agent import Command, Dispatch
from schemas.api import JobEvent, SubmitReply


class Persist(msgspec.Struct, frozen=True):
    """Write the record durably before any later effect of the same batch is carried out.

    `deferred`: nothing waits on this write, and a restore without it is safe (the lifecycle
    says why for each): the shell may write it up to `timeouts.deferred_write_s` later, or
    with the job's next write that is not deferred, whichever comes first."""

    record: JobRecord
    deferred: bool = False


class Send(msgspec.Struct, frozen=True):
    """Send a command to a cluster's agent (request/reply with ack).

    `after_cancel_of`: for a Dispatch, the earlier attempts of the same job whose Cancels must
    all be acknowledged (or given up on) before this is sent: the attempt just before it and
    every older one whose Cancel is unacknowledged, so two copies of a job never run at once,
    even for the milliseconds two agents would otherwise race."""

    cluster: str
    command: Command
    after_cancel_of: tuple[int, ...] = ()


class Publish(msgspec.Struct, frozen=True):
    """Publish a lifecycle event on `muster.events.job.<job_id>`."""

    event: JobEvent


class Submitted(msgspec.Struct, frozen=True):
    """The answer to a submission (accepted, duplicate, or rejected with the reason)."""

    reply: SubmitReply


class Refused(msgspec.Struct, frozen=True):
    """The input was refused and changed nothing; `error` says why, for the sender or log."""

    error: str


class BatchApplied(msgspec.Struct, frozen=True):
    """Every event of the agent's batch was applied: once the records persisted before this
    are durable, the agent may be told its outcomes up to `seq` are safe."""

    cluster: str
    instance: str
    seq: int


class Forget(msgspec.Struct, frozen=True):
    """Delete the job's record: it ended longer ago than `limits.ended_retention_s`."""

    job_id: str


Effect = Persist | Send | Publish | Submitted | Refused | BatchApplied | Forget


def split_reply(effects: Iterable[Effect]) -> tuple[SubmitReply, list[Effect]]:
    """A submission's reply, and the effects to carry out."""
    reply: SubmitReply | None = None
    rest: list[Effect] = []
    for eff in effects:
        if isinstance(eff, Submitted):
            reply = eff.reply
        else:
            rest.append(eff)
    if reply is None:
        raise ValueError("no Submitted effect: the input was not a submission")
    return reply, rest


def refusal(effects: Iterable[Effect]) -> str | None:
    """Why the input was refused, or None when it was taken."""
    for eff in effects:
        if isinstance(eff, Refused):
            return eff.error
    return None


def applied(effects: Iterable[Effect]) -> BatchApplied | None:
    """The batch acknowledgement among an agent batch's effects, when it was applied in full."""
    for eff in effects:
        if isinstance(eff, BatchApplied):
            return eff
    return None


def dispatches(effects: Iterable[Effect]) -> list[Dispatch]:
    """The Dispatches among some effects (what a cycle admitted), in order."""
    return [e.command for e in effects if isinstance(e, Send) and isinstance(e.command, Dispatch)]
