"""The cycle collector's pacing (shell/gcpacing.py): what has lived a while leaves the
collector's passes, cyclic garbage among it is still reclaimed by the periodic full pass, and
the agent process's ticker leaves nothing frozen when it ends."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator

import pytest

from shell.gcpacing import GcPacer, paced_gc, paused


class Held:
    """A tracked object the collector can walk (and a cycle can be made of)."""

    def __init__(self) -> None:
        self.other: Held | None = None


def walked(obj: object) -> bool:
    """Whether the collector's generations hold `obj` (a frozen object is in none)."""
    return any(o is obj for o in gc.get_objects())


@pytest.fixture(autouse=True)
def thawed() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()
    gc.enable()


def test_what_lived_a_freeze_period_leaves_the_collectors_passes() -> None:
    pacer = GcPacer()
    before = Held()
    pacer.start(100.0)
    assert not walked(before)  # what existed at start: frozen at once
    young = Held()
    pacer.tick(100.0 + GcPacer.FREEZE_EVERY_S / 2)
    assert walked(young)  # not a period old yet
    pacer.tick(100.0 + GcPacer.FREEZE_EVERY_S)
    assert not walked(young)


def test_a_frozen_cycle_is_reclaimed_by_the_full_pass() -> None:
    pacer = GcPacer()
    a, b = Held(), Held()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    pacer.start(0.0)
    del a, b
    gc.collect()
    assert gone() is not None  # frozen: the cycle detector skips it
    pacer.tick(GcPacer.FULL_EVERY_S - 0.001)
    assert gone() is not None  # a plain freeze tick collects nothing
    pacer.tick(GcPacer.FULL_EVERY_S)
    assert gone() is None
    kept = Held()
    pacer.tick(GcPacer.FULL_EVERY_S + 0.001)
    assert walked(kept)  # the periods count again from the full pass


class Quick(GcPacer):
    FREEZE_EVERY_S = 0.01


async def test_the_ticker_freezes_while_it_runs_and_thaws_when_cancelled() -> None:
    task = asyncio.create_task(paced_gc(Quick()))
    await asyncio.sleep(0)
    assert gc.get_freeze_count() > 0
    late = Held()
    for _ in range(500):
        if not walked(late):
            break
        await asyncio.sleep(0.01)
    assert not walked(late)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gc.get_freeze_count() == 0
    assert walked(late)


def test_paused_runs_a_block_without_collector_passes_and_freezes_what_it_leaves() -> None:
    gc.enable()
    with paused():
        assert not gc.isenabled()
        a = Held()
        a.other = a
        gone = weakref.ref(a)
        del a
        kept = [Held() for _ in range(20_000)]  # far past the young generation's threshold
        assert gone() is not None  # no pass ran to reclaim the cycle
    assert gc.isenabled()
    assert not walked(kept[0])  # what the block left is frozen: no young pass walks it all
    gc.unfreeze()  # as the pacer's full pass does
    gc.collect()
    assert gone() is None and len(kept) == 20_000
    with pytest.raises(RuntimeError), paused():
        raise RuntimeError("the block failed")
    assert gc.isenabled()  # restored however the block ended
    gc.disable()
    with paused():
        left = Held()
    assert not gc.isenabled()  # a collector that was off is left as it was
    assert walked(left)
