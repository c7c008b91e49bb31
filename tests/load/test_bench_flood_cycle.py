"""The flood-cycle benchmark's set-up holds what it measures: a full fleet, the queued jobs
tried once and filed as spot waiters where they want spot, and cycles that admit nothing
while each batch of new jobs queues behind them."""

from __future__ import annotations

from load.bench_flood_cycle import build, time_flood


def test_the_fleet_is_full_and_each_cycle_only_queues_more() -> None:
    m, rng = build(queues=7, depth=300, seed=1)
    assert m.views.pending_count() == 300
    assert len(m.backlog.earlier_waiters) > 0  # tried, and wanting spot
    cycles = time_flood(m, rng, queues=7, depth=300, batch=5, cycles=4)
    assert len(cycles) == 4
    assert m.views.pending_count() == 320  # nothing was admitted
