"""Admission-cycle pacing (broker/pacing.py): after a cycle the next waits CYCLE_GAP_FACTOR
times as long as the cycle took, at most CYCLE_MAX_GAP_S, so a small cycle is followed at once
and a long one lets inputs batch up. A pure calculation, tested as one: no loop, no broker."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from broker.pacing import CYCLE_GAP_FACTOR, CYCLE_MAX_GAP_S, cycle_due, next_cycle_at

T0 = 1000.0


def test_a_small_cycle_is_followed_almost_at_once() -> None:
    nxt = next_cycle_at(T0, T0 + 0.0005)
    assert nxt == T0 + 0.0005 + CYCLE_GAP_FACTOR * 0.0005
    assert not cycle_due(nxt - 1e-6, nxt, True)  # still in the pause
    assert cycle_due(nxt, nxt, True)


def test_a_long_cycle_pause_is_capped() -> None:
    nxt = next_cycle_at(T0, T0 + 0.2)
    assert nxt == T0 + 0.2 + CYCLE_MAX_GAP_S
    assert not cycle_due(T0 + 0.2 + CYCLE_MAX_GAP_S * 0.9, nxt, True)
    assert cycle_due(T0 + 0.2 + CYCLE_MAX_GAP_S * 1.1, nxt, True)


def test_no_cycle_when_none_is_wanted() -> None:
    assert not cycle_due(T0 + 1.0, T0, False)
    assert cycle_due(T0 + 1.0, T0, True)


@given(
    cost=st.floats(min_value=0.0, max_value=10.0, allow_nan=False),
    started=st.floats(min_value=0.0, max_value=1e6, allow_nan=False),
)
def test_cycles_never_take_more_than_their_share_of_the_loop(cost: float, started: float) -> None:
    """The pause is factor times cost, capped: a cycle shorter than the cap / factor takes at most
    1 / (1 + factor) of the time until the next one may start, and no pause is ever longer
    than the cap."""
    ended = started + cost
    pause = next_cycle_at(started, ended) - ended
    assert 0.0 <= pause <= CYCLE_MAX_GAP_S + 1e-9
    if cost * CYCLE_GAP_FACTOR <= CYCLE_MAX_GAP_S:
        assert pause >= CYCLE_GAP_FACTOR * cost * (1 - 1e-9) - 1e-9
