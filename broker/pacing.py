"""Admission-cycle pacing: when the next cycle may start, from how long the last one took.

A cycle has a fixed cost (a snapshot, the queues' turns, the heads of a deep backlog looked
at again) that can dwarf one job's, so after a cycle the next waits CYCLE_GAP_FACTOR times
as long as it took, at most CYCLE_MAX_GAP_S: under a stream of submissions the inputs of a few
ms are admitted together, while a small or idle broker still admits at once. Cycles then take
at most ~1/(1 + factor) of the loop.

A cycle that admitted a job is followed sooner (ADMITTING_GAP_FACTOR): the jobs arriving behind
it are likely to fit as well, and one admitted before its submission's record is written is
persisted in one write instead of two. The long pause is for the cycle that admitted nothing,
a backlog that does not fit: the expensive kind to repeat, whose heads fit no sooner for being
asked again. Pure, so it is tested without a loop or a broker.

The other pause a broker's loop can take, Python's cycle collector, is paced by
`shell.gcpacing.GcPacer`, which the agent process shares.
"""

from __future__ import annotations

CYCLE_GAP_FACTOR = 4.0  # after a cycle that admitted nothing
ADMITTING_GAP_FACTOR = 1.0  # after one that admitted a job
CYCLE_MAX_GAP_S = 0.01


def cycle_due(now: float, next_cycle: float, wants_cycle: bool) -> bool:
    """Whether a cycle runs now: one is wanted and the pause after the last is over."""
    return wants_cycle and now >= next_cycle


def next_cycle_at(started: float, ended: float, admitted: bool) -> float:
    """The earliest start of the next cycle after one that ran from `started` to `ended` and
    admitted a job or not."""
    factor = ADMITTING_GAP_FACTOR if admitted else CYCLE_GAP_FACTOR
    return ended + min(CYCLE_MAX_GAP_S, factor * (ended - started))
