"""The cycle benchmark's set-up holds what it measures: a full fleet (every filler admitted,
spot included) and exactly `depth` jobs queued behind it, none admitted by a timed cycle."""

from __future__ import annotations

from load.bench_cycle import build, time_cycles


def test_the_fleet_is_full_and_the_backlog_is_the_depth_asked_for() -> None:
    m, now = build(300, seed=1)
    assert m.views.pending_count() == 300
    cycles = time_cycles(m, now, 2)  # asserts every timed cycle admits nothing
    assert len(cycles) == 2
