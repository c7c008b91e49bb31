"""Admission-cycle pacing: when the next cycle may start, from how long the last one took.

A cycle has a fixed cost (the core rebuilds its candidate pools per gang shape) that dwarfs
one job's, so after a cycle the next waits CYCLE_GAP_FACTOR times as long as it took, at most
CYCLE_MAX_GAP_S: under a stream of submissions the inputs of a few ms are admitted together,
while a small or idle broker still admits at once. Cycles then take at most ~1/(1 + factor)
of the loop. Pure, so it is tested without a loop or a broker.
"""

from __future__ import annotations

CYCLE_GAP_FACTOR = 4.0
CYCLE_MAX_GAP_S = 0.01


def cycle_due(now: float, next_cycle: float, wants_cycle: bool) -> bool:
    """Whether a cycle runs now: one is wanted and the pause after the last is over."""
    return wants_cycle and now >= next_cycle


def next_cycle_at(started: float, ended: float) -> float:
    """The earliest start of the next cycle after one that ran from `started` to `ended`."""
    return ended + min(CYCLE_MAX_GAP_S, CYCLE_GAP_FACTOR * (ended - started))
