"""The job state machine: every transition of `JobRecord.state` in one table.

`move` is the only writer of `record.state` in the core (tests/test_architecture.py checks it
from the source). A transition the table does not have raises `BadTransition`: that is a bug in
the core, never something a user or an agent can cause, so it is not caught anywhere.

The states are the wire's (`schemas.api.JobState`): records on disk and events keep the same
strings. The terminal states are the ones the table leads nowhere from; `TERMINAL` is derived
from the table, not written down again.

`Cause` names the attempt-ending causes the core branches on. They are `StrEnum`s, so a
persisted `Preempting.cause` or `AttemptRecord.end_cause` keeps its old string; the text shown
to people (`Preempting.detail`, reasons) stays separate.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final, get_args

from broker.core.records import JobRecord
from schemas.api import JobState


class Cause(StrEnum):
    """Causes that steer what happens after an attempt ends."""

    SPOT_NOTICE = "spot-notice"  # the pool is avoided for a while after the move
    SPOT_RETURN = "spot-return"  # a planned move back to spot: not a loss
    DEADLINE_MOVE = "deadline"  # a planned move to on-demand for a deadline: not a loss
    SPOT_YIELD = "spot-yield"  # a planned move to on-demand for a spot-only waiter: not a loss


# Planned moves are the broker's choice, not a loss: no preemption budget is charged.
PLANNED_MOVES: Final = frozenset({Cause.SPOT_RETURN, Cause.DEADLINE_MOVE, Cause.SPOT_YIELD})


class Event(StrEnum):
    """What happens to a job. Internal to the core: never persisted or sent."""

    DISPATCH = "dispatch"  # an attempt is placed and sent (a new one, or a reserved replacement)
    ALL_RUNNING = "all-running"  # every replica of the live attempt runs
    PREEMPT = "preempt"  # the live attempt is being ended on purpose
    REQUEUE = "requeue"  # the attempt ended; the job waits for admission again
    RESTORE_UNPLACED = "restore-unplaced"  # restored as live without an attempt: queue it
    SUCCEED = "succeed"
    FAIL = "fail"
    CANCEL = "cancel"


_ENDS: Final[dict[Event, JobState]] = {
    Event.SUCCEED: "succeeded",
    Event.FAIL: "failed",
    Event.CANCEL: "cancelled",
}
_ACTIVE: Final[tuple[JobState, ...]] = ("queued", "admitted", "running", "preempting")

# (from-state, event) -> to-state. Anything not here is a bug.
TRANSITIONS: Final[dict[tuple[JobState, Event], JobState]] = {
    ("queued", Event.DISPATCH): "admitted",
    # A preemption's reserved replacement is dispatched once the old attempt has ended.
    ("preempting", Event.DISPATCH): "admitted",
    ("admitted", Event.ALL_RUNNING): "running",
    ("admitted", Event.PREEMPT): "preempting",
    ("running", Event.PREEMPT): "preempting",
    ("admitted", Event.REQUEUE): "queued",
    ("running", Event.REQUEUE): "queued",
    ("preempting", Event.REQUEUE): "queued",
    ("admitted", Event.RESTORE_UNPLACED): "queued",
    ("running", Event.RESTORE_UNPLACED): "queued",
    ("preempting", Event.RESTORE_UNPLACED): "queued",
    # Any job not yet ended can end: cancelled by its user, failed by a budget or a policy,
    # succeeded by its live attempt or by one given up on that finished after all.
    **{(s, e): to for s in _ACTIVE for e, to in _ENDS.items()},
}

STATES: Final[frozenset[JobState]] = frozenset(get_args(JobState))
TERMINAL: Final[frozenset[JobState]] = STATES - {s for s, _ in TRANSITIONS}
LIVE_STATES: Final[frozenset[JobState]] = frozenset(
    {"admitted", "running", "preempting"}  # a job with a live attempt
)
INITIAL: Final[JobState] = "queued"  # a submitted job's state; no transition enters it first


class BadTransition(RuntimeError):
    """The core tried a transition its table does not have: a bug in the core."""


def end_event(state: JobState) -> Event:
    """The event that ends a job in `state` (one of `TERMINAL`)."""
    for event, to in _ENDS.items():
        if to == state:
            return event
    raise BadTransition(f"{state!r} is not a terminal state; it is one of {sorted(TERMINAL)}")


def move(record: JobRecord, event: Event) -> JobState:
    """Move `record` by `event` as the table says; returns the new state."""
    to = TRANSITIONS.get((record.state, event))
    if to is None:
        raise BadTransition(f"job {record.job_id}: no transition from {record.state!r} on {event}")
    record.state = to
    return to


def table_markdown() -> str:
    """The table as docs/architecture.md shows it: one row per event (a test keeps them equal)."""
    rows = ["| event | from | to |", "|---|---|---|"]
    for event in Event:
        froms = [s for (s, e) in TRANSITIONS if e == event]
        tos = sorted({TRANSITIONS[(s, event)] for s in froms})
        rows.append(f"| `{event}` | {', '.join(froms)} | {', '.join(tos)} |")
    return "\n".join(rows)
