"""Bamboo spot traces (`time_ms,add|remove,node_id`, no header) parsed for replay.

The one parser: the fake and local clusters replay with it, and the simulator and the load
scripts (`load/traces.py`, `load/sim.py`) read the same files through it without a cluster.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, NamedTuple

TraceOp = Literal["add", "remove"]


class TraceError(ValueError):
    """A trace line that is not `time_ms,add|remove,node`; the text names the line."""


class TraceEvent(NamedTuple):
    """One trace row; a tuple, so it compares equal to `(time_ms, op, node)`."""

    time_ms: int
    op: TraceOp
    node: str

    @property
    def seconds(self) -> float:
        """Seconds from the trace's start."""
        return self.time_ms / 1000.0


def parse_bamboo(
    text: str, source: str = "trace", max_events: int | None = None
) -> list[TraceEvent]:
    """Parse trace text; blank lines and `#` comments are skipped, order is by time (stable)."""
    out: list[TraceEvent] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            raise TraceError(f"{source}:{lineno}: expected 'time_ms,add|remove,node', got {line!r}")
        t_text, op, node = parts
        try:
            t = int(float(t_text))
        except ValueError:
            raise TraceError(f"{source}:{lineno}: time_ms {t_text!r} is not a number") from None
        if t < 0:
            raise TraceError(f"{source}:{lineno}: time_ms {t} is negative")
        if op not in ("add", "remove"):
            raise TraceError(f"{source}:{lineno}: op must be 'add' or 'remove', got {op!r}")
        if not node or len(node) > 200:
            raise TraceError(f"{source}:{lineno}: node id must be 1-200 characters")
        out.append(TraceEvent(t, op, node))  # type: ignore[arg-type]
        if max_events is not None and len(out) >= max_events:
            break
    out.sort(key=lambda e: e.time_ms)
    return out


def load_bamboo(path: str | Path, max_events: int | None = None) -> list[TraceEvent]:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise TraceError(f"{p}: cannot read trace: {exc}") from None
    return parse_bamboo(text, str(p), max_events)


def removals_per_node_hour(events: list[TraceEvent]) -> float:
    """Observed removal rate (the Bamboo p3 trace gives ~0.6): removals / live node-hours."""
    live = 0
    node_ms = 0
    last = events[0].time_ms if events else 0
    removals = 0
    for ev in events:
        node_ms += live * (ev.time_ms - last)
        last = ev.time_ms
        if ev.op == "add":
            live += 1
        else:
            live = max(0, live - 1)
            removals += 1
    hours = node_ms / 3_600_000
    return removals / hours if hours > 0 else 0.0
