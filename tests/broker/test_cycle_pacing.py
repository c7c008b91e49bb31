"""Admission-cycle pacing in the shell: after a cycle the next waits CYCLE_GAP_FACTOR times as
long as the cycle took, at most CYCLE_MAX_GAP_S, so a small cycle is followed at once and a
long one lets inputs batch up. Driven with a fake loop clock; no timing is asserted."""

from __future__ import annotations

import asyncio
from typing import Any

import nats
import pytest

from broker.core.inputs import Cycle
from broker.service import CYCLE_GAP_FACTOR, CYCLE_MAX_GAP_S, Broker
from tests.broker.conftest import Harness


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0


class StubMachine:
    """Only what `_cycle_if_due` touches: wants a cycle, and a cycle takes `cost` seconds."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.cost = 0.0
        self.cycles = 0
        self.wants_cycle = True

    def handle(self, event: object, now: float) -> list[Any]:
        assert isinstance(event, Cycle)
        self.cycles += 1
        self.clock.now += self.cost
        return []


async def test_the_pause_after_a_cycle_scales_with_its_cost(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker = Broker(harness.config, await nats.connect(harness.url))
    try:
        clock = Clock()
        monkeypatch.setattr(asyncio.get_running_loop(), "time", lambda: clock.now)
        machine = StubMachine(clock)
        run = broker._cycle_if_due

        machine.cost = 0.0005  # a small cycle: the next may start 2 ms later
        run(machine)  # type: ignore[arg-type]
        assert machine.cycles == 1
        clock.now += CYCLE_GAP_FACTOR * 0.0005 * 0.5
        run(machine)  # type: ignore[arg-type]
        assert machine.cycles == 1  # still in the pause
        clock.now += CYCLE_GAP_FACTOR * 0.0005
        run(machine)  # type: ignore[arg-type]
        assert machine.cycles == 2

        machine.cost = 0.2  # a long cycle: the pause is capped
        clock.now += CYCLE_GAP_FACTOR * 0.0005
        run(machine)  # type: ignore[arg-type]
        assert machine.cycles == 3
        clock.now += CYCLE_MAX_GAP_S * 0.9
        run(machine)  # type: ignore[arg-type]
        assert machine.cycles == 3
        clock.now += CYCLE_MAX_GAP_S * 0.2
        machine.cost = 0.0
        run(machine)  # type: ignore[arg-type]
        assert machine.cycles == 4

        machine.wants_cycle = False  # nothing to do: no cycle, whatever the clock
        clock.now += 1.0
        run(machine)  # type: ignore[arg-type]
        assert machine.cycles == 4
    finally:
        await broker.nc.close()
