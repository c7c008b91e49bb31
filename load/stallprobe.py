"""`muster broker` with its event loop's long turns recorded, for `load.bench_e2e --stalls`.

    python load/stallprobe.py OUT_JSON THRESHOLD_MS broker --nats URL ...

Run as a script, it needs nothing of the tree it sits in, so `--baseline` runs another
checkout's broker under it (that checkout's `muster` on PYTHONPATH).

Every callback the loop runs (`asyncio.Handle._run`: a task step, a timer, a reader) that
takes longer than THRESHOLD_MS of wall time is recorded with the CPU time its thread spent in
it (`time.thread_time`): a long turn with little CPU is the broker waiting for a core, one with
as much CPU as wall time is work that stalls every submission behind it. The cycle collector's
passes are recorded too (generation, objects collected, pause). What asyncio's debug mode
reports with `loop.slow_callback_duration`, without debug mode's cost on every call. Every
callback, long or not, is also counted with its CPU by kind (the task's coroutine or the
callback's name) per tenth of a second, so the benchmark can say how many turns of the loop a
job costs in its window. Written to OUT_JSON when the broker exits.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

# At most this many records of each kind: the probe is bounded like any load loop.
MAX_RECORDS = 20_000


# Every callback is also counted, with its CPU, by kind in buckets of this many seconds, so a
# benchmark can count the loop's callbacks per job in its window.
CALL_BUCKET_S = 0.1


def _task_name(handle: asyncio.events.Handle) -> str | None:
    """`task <coroutine>` when the callback is a task's step, else None."""
    owner = getattr(handle._callback, "__self__", None)  # type: ignore[attr-defined]
    if isinstance(owner, asyncio.Task):
        coro = owner.get_coro()
        return f"task {getattr(coro, '__qualname__', repr(coro))}"
    return None


def describe(handle: asyncio.events.Handle) -> str:
    """The coroutine a task step ran (its qualified name), else the callback's repr."""
    return _task_name(handle) or repr(handle)[:300]


def kind(handle: asyncio.events.Handle) -> str:
    """`describe` without a repr: cheap enough for every callback."""
    callback = handle._callback  # type: ignore[attr-defined]
    name = _task_name(handle) or getattr(callback, "__qualname__", None)
    return str(name or type(callback).__name__)


class Probe:
    def __init__(self, threshold_ms: float, split_cpu: bool = False) -> None:
        """`split_cpu`: each long turn also says how much of its CPU ran the process's own
        code (`user_ms`) and how much the kernel spent on its behalf (`sys_ms`: page faults,
        and the reclaim a loaded machine's memory pressure adds to them), at the cost of two
        `getrusage` calls per callback. The kernel splits a thread's CPU in clock ticks: the
        two parts are good to a few ms (their sum may pass `cpu_ms` by as much)."""
        self.threshold_s = threshold_ms / 1000
        self.split_cpu = split_cpu
        self.turns: list[dict[str, Any]] = []
        self.collections: list[dict[str, Any]] = []
        self.callbacks = 0
        # bucket number (time // CALL_BUCKET_S) -> kind -> [callbacks, CPU seconds]
        self.calls: dict[int, dict[str, list[float]]] = {}
        self._gc_t0 = self._gc_c0 = 0.0

    def install(self) -> None:
        run = asyncio.events.Handle._run
        probe = self

        def timed(handle: asyncio.events.Handle) -> None:
            split = probe.split_cpu
            r0 = resource.getrusage(resource.RUSAGE_THREAD) if split else None
            t0, c0 = time.perf_counter(), time.thread_time()
            run(handle)
            wall = time.perf_counter() - t0
            probe.callbacks += 1
            probe.count(handle, time.thread_time() - c0)
            if wall > probe.threshold_s and len(probe.turns) < MAX_RECORDS:
                turn: dict[str, Any] = {
                    "at": round(time.time(), 4),
                    "wall_ms": round(wall * 1000, 2),
                    "cpu_ms": round((time.thread_time() - c0) * 1000, 2),
                    "what": describe(handle),
                }
                if r0 is not None:
                    r1 = resource.getrusage(resource.RUSAGE_THREAD)
                    turn["user_ms"] = round((r1.ru_utime - r0.ru_utime) * 1000, 2)
                    turn["sys_ms"] = round((r1.ru_stime - r0.ru_stime) * 1000, 2)
                probe.turns.append(turn)

        asyncio.events.Handle._run = timed  # type: ignore[method-assign,assignment]
        gc.callbacks.append(self._on_gc)

    def count(self, handle: asyncio.events.Handle, cpu_s: float) -> None:
        bucket = int(time.time() // CALL_BUCKET_S)
        kinds = self.calls.get(bucket)
        if kinds is None:
            if len(self.calls) >= MAX_RECORDS:
                return
            kinds = self.calls[bucket] = {}
        entry = kinds.setdefault(kind(handle), [0, 0.0])
        entry[0] += 1
        entry[1] += cpu_s

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
            "call_bucket_s": CALL_BUCKET_S,
            "calls": [
                [
                    round(b * CALL_BUCKET_S, 3),
                    {k: [n, round(c * 1000, 3)] for k, (n, c) in kinds.items()},
                ]
                for b, kinds in sorted(self.calls.items())
            ],
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
