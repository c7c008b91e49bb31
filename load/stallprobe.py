"""`muster broker` with its event loop's long turns recorded, for `load.bench_e2e --stalls`.

    python load/stallprobe.py OUT_JSON THRESHOLD_MS broker --nats URL ...

Run as a script, it needs nothing of the tree it sits in, so `--baseline` runs another
checkout's broker under it (that checkout's `muster` on PYTHONPATH).

Every callback the loop runs (`asyncio.Handle._run`: a task step, a timer, a reader) that
takes longer than THRESHOLD_MS of wall time is recorded with the CPU time its thread spent in
it (`time.thread_time`): a long turn with little CPU is the broker waiting for a core, one with
as much CPU as wall time is work that stalls every submission behind it. The cycle collector's
passes are recorded too (generation, objects collected, pause). What asyncio's debug mode
reports with `loop.slow_callback_duration`, without debug mode's cost on every call. Written to
OUT_JSON when the broker exits.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

# At most this many records of each kind: the probe is bounded like any load loop.
MAX_RECORDS = 20_000


def describe(handle: asyncio.events.Handle) -> str:
    """The coroutine a task step ran (its qualified name), else the callback's repr."""
    callback = handle._callback  # type: ignore[attr-defined]
    owner = getattr(callback, "__self__", None)
    if isinstance(owner, asyncio.Task):
        coro = owner.get_coro()
        return f"task {getattr(coro, '__qualname__', repr(coro))}"
    return repr(handle)[:300]


class Probe:
    def __init__(self, threshold_ms: float) -> None:
        self.threshold_s = threshold_ms / 1000
        self.turns: list[dict[str, Any]] = []
        self.collections: list[dict[str, Any]] = []
        self.callbacks = 0
        self._gc_t0 = self._gc_c0 = 0.0

    def install(self) -> None:
        run = asyncio.events.Handle._run
        probe = self

        def timed(handle: asyncio.events.Handle) -> None:
            t0, c0 = time.perf_counter(), time.thread_time()
            run(handle)
            wall = time.perf_counter() - t0
            probe.callbacks += 1
            if wall > probe.threshold_s and len(probe.turns) < MAX_RECORDS:
                probe.turns.append(
                    {
                        "at": round(time.time(), 4),
                        "wall_ms": round(wall * 1000, 2),
                        "cpu_ms": round((time.thread_time() - c0) * 1000, 2),
                        "what": describe(handle),
                    }
                )

        asyncio.events.Handle._run = timed  # type: ignore[method-assign,assignment]
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_t0, self._gc_c0 = time.perf_counter(), time.thread_time()
        elif len(self.collections) < MAX_RECORDS:
            self.collections.append(
                {
                    "at": round(time.time(), 4),
                    "generation": info.get("generation"),
                    "collected": info.get("collected"),
                    "pause_ms": round((time.perf_counter() - self._gc_t0) * 1000, 3),
                    "cpu_ms": round((time.thread_time() - self._gc_c0) * 1000, 3),
                }
            )

    def dump(self, path: Path) -> None:
        out = {
            "threshold_ms": self.threshold_s * 1000,
            "callbacks": self.callbacks,
            "turns": self.turns,
            "collections": self.collections,
        }
        path.write_text(json.dumps(out) + "\n")


def main() -> None:
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]  # run as a script: this directory's modules must not shadow others
    path, threshold_ms = Path(sys.argv[1]), float(sys.argv[2])
    probe = Probe(threshold_ms)
    probe.install()
    atexit.register(probe.dump, path)
    from muster.cli import app

    app(args=sys.argv[3:], prog_name="muster")


if __name__ == "__main__":
    main()
