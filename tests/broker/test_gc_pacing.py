"""The broker process's cycle collector (shell/gcpacing.py): an admission cycle runs with
no collector pass inside it when the broker owns the collector, and leaves it as it was
when it does not (an in-process broker beside other code)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from tests.broker.conftest import Harness
from tests.broker.jobs import job


@pytest.fixture
def collector_restored() -> Iterator[None]:
    yield
    gc.enable()
    gc.unfreeze()


@pytest.mark.parametrize("pace_gc", [True, False])
async def test_admission_cycles_run_with_the_collector_paused_when_the_broker_owns_it(
    harness: Harness, collector_restored: None, pace_gc: bool
) -> None:
    broker = await harness.start_broker(pace_gc=pace_gc)
    assert broker.machine is not None
    during: list[bool] = []
    broker.machine.cycle_observers.append(lambda _: during.append(gc.isenabled()))
    await harness.agent("c1", count=1)
    reply = await harness.submit(job("a", replicas=1, gpu=8))
    await harness.wait_event(reply.job_id, "running", timeout=10)
    assert during, "no admission cycle ran"
    assert during == [not pace_gc] * len(during)
    assert gc.isenabled()  # back on between cycles
    await harness.stop_broker()
