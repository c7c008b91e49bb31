"""What the shell feeds the lifecycle machine: one typed value per kind of input.

`Machine.handle(input, now)` takes any of these and returns the effects to carry out, in order.
Answers to the sender (a submission's reply, a refusal, a batch that may be acknowledged) are
effects too (see `effects.py`), so every input has the same shape: value in, effects out.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from broker.core.records import JobRecord
from schemas.agent import CheckpointReport, EventBatch, WorkloadStatus
from schemas.job import JobSpec


class SubmitJob(msgspec.Struct, frozen=True):
    """A submission. `order` is the stream sequence (FIFO key); `subject_queue` the queue of
    the subject it arrived on; `id_token` names a job that gives no `job_id`."""

    spec: JobSpec
    order: int | None = None
    subject_queue: str | None = None
    id_token: str | None = None


class CancelJob(msgspec.Struct, frozen=True):
    """A user's cancel request."""

    job_id: str
    reason: str


class AgentBatch(msgspec.Struct, frozen=True):
    """One event batch of a cluster's agent, as it arrived on that cluster's subject."""

    cluster: str
    batch: EventBatch


class DispatchAcked(msgspec.Struct, frozen=True):
    """The agent's answer to a Dispatch (or the shell giving up on it: `ok=False`)."""

    job_id: str
    attempt: int
    ok: bool
    error: str = ""
    job_only: bool = False  # refused for this job alone (CommandAck.job_only)
    resize_refused: bool = False  # a revision the workload cannot take (CommandAck)


class CancelSettled(msgspec.Struct, frozen=True):
    """The Cancel of an attempt was acknowledged by its agent, or given up on because its
    cluster was declared lost (its fence has ended the attempt): it no longer runs. `ended`:
    the ending the agent's answer carried (`CommandAck.ended`), from `cluster`."""

    job_id: str
    attempt: int
    cluster: str = ""
    ended: WorkloadStatus | None = None


class Checkpoint(msgspec.Struct, frozen=True):
    """A checkpoint reported by the workload's SDK (the shell has checked its token)."""

    report: CheckpointReport


class Tick(msgspec.Struct, frozen=True):
    """Time passed: agent silence, start and checkpoint deadlines, backoff, spot fallback."""


class Cycle(msgspec.Struct, frozen=True):
    """Run one admission cycle (the shell paces them; see `Machine.wants_cycle`)."""


class Restore(msgspec.Struct, frozen=True):
    """A new leader's state: the persisted records. The effects resend every Cancel not yet
    acknowledged and every dispatch that was persisted without an acknowledgement."""

    records: Sequence[JobRecord]


Input = (
    SubmitJob
    | CancelJob
    | AgentBatch
    | DispatchAcked
    | CancelSettled
    | Checkpoint
    | Tick
    | Cycle
    | Restore
)

TICK = Tick()
CYCLE = Cycle()
