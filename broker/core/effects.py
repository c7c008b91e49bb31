"""What the lifecycle machine asks the shell to do. The shell executes effects in order."""

from __future__ import annotations

from dataclasses import dataclass

from broker.core.records import JobRecord
from schemas.agent import Command
from schemas.api import JobEvent


@dataclass(frozen=True, slots=True)
class Persist:
    """Write the record durably before any later effect of the same batch is carried out."""

    record: JobRecord


@dataclass(frozen=True, slots=True)
class Send:
    """Send a command to a cluster's agent (request/reply with ack)."""

    cluster: str
    command: Command


@dataclass(frozen=True, slots=True)
class Publish:
    """Publish a lifecycle event on `muster.events.job.<job_id>`."""

    event: JobEvent


Effect = Persist | Send | Publish
