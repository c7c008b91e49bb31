"""Pacing Python's cycle collector in a process that holds a large, long-lived heap.

A broker's job records and a kube agent's node cache live long and form no cycles, yet each
full collection walks all of them: ~0.2 s per 20,000 jobs in a broker; 10-22 ms per pass in
an agent listing a 5,000-node cluster, a pass every few thousand allocations while the cache
grows, and every pause holds the event loop (`load/bench_kube_agent.py` reports the longest).
So what has survived FREEZE_EVERY_S is frozen (`gc.freeze`: reference counting still frees
it, only the cycle detector skips it), and once per FULL_EVERY_S everything is unfrozen,
fully collected and frozen again, so cyclic garbage that outlived a freeze is still reclaimed.

An admission cycle runs with the collector paused (`paused`), and what it leaves is frozen
at its end: a cycle of 100,000 pending jobs allocates millions of objects, frees the transient
ones by reference counting and makes no cyclic garbage (its collections found none to
collect), yet each pass inside it walked what the cycle had built so far: about a tenth of the
cycle's CPU (`load/bench_core.py`, docs/benchmarks.md, "An admission cycle with the collector
paused").

The process owns the policy (the collector is process-wide): `muster broker` ticks it from
its loop, `muster agent` from `paced_gc`. In-process brokers and agents (tests) leave the
host's collector alone.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager


class GcPacer:
    """Freeze what has lived FREEZE_EVERY_S; a full collection every FULL_EVERY_S."""

    FREEZE_EVERY_S = 1.0
    FULL_EVERY_S = 600.0

    def __init__(self) -> None:
        self._next_freeze = 0.0
        self._next_full = 0.0

    def start(self, now: float) -> None:
        gc.freeze()  # what was just loaded or restored; no collection here: start time counts
        self._next_freeze = now + self.FREEZE_EVERY_S
        self._next_full = now + self.FULL_EVERY_S

    def tick(self, now: float) -> None:
        if now >= self._next_full:
            gc.unfreeze()
            gc.collect()
            gc.freeze()
            self._next_full = now + self.FULL_EVERY_S
            self._next_freeze = now + self.FREEZE_EVERY_S
        elif now >= self._next_freeze:
            gc.freeze()
            self._next_freeze = now + self.FREEZE_EVERY_S


@contextmanager
def paused() -> Iterator[None]:
    """Run a synchronous block (an admission cycle) with no collector pass inside it, then
    freeze what it leaves, as the pacer would within FREEZE_EVERY_S: the first young pass
    after the block would otherwise walk all of it at once. A collector that was off is left
    as it was."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.freeze()
            gc.enable()


async def paced_gc(pacer: GcPacer | None = None) -> None:
    """Tick a pacer (started here) every FREEZE_EVERY_S, until cancelled: for a process whose
    loop has no step of its own to tick from. Cancelled, it unfreezes what it froze."""
    pacer = pacer or GcPacer()
    pacer.start(time.monotonic())
    try:
        while True:
            await asyncio.sleep(pacer.FREEZE_EVERY_S)
            pacer.tick(time.monotonic())
    finally:
        gc.unfreeze()
