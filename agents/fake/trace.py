"""Spot traces parsed for replay, in the two public formats Muster ships.

- Bamboo (`time_ms,add|remove,node_id`, no header; NSDI'23).
- SkyPilot's spot-traces JSON (`{"metadata": {"gap_seconds": g}, "data": [n0, n1, ...]}`:
  the number of spot instances available at every tick; "Can't Be Late", NSDI'24). A rise
  of the count adds nodes, a fall removes the most recently added ones; the trace's length
  is its ticks x gap, which is where it loops.

The one parser: the fake and local clusters replay with it, and the simulator and the load
scripts (`load/traces.py`, `load/sim/`) read the same files through it without a cluster.
A row (or count) that is not valid is an error naming the file and where; nothing is skipped
but blank lines and `#` comments in the CSV.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, NamedTuple

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


class SpotTrace(NamedTuple):
    """A parsed trace and its own length when the format records one (a count per tick
    covers ticks x gap, however early its last change)."""

    events: list[TraceEvent]
    length_ms: int | None = None


def parse_counts_json(text: str, source: str = "trace") -> SpotTrace:
    """SkyPilot spot-traces JSON: available instances per tick, as node add/remove events."""
    try:
        doc: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{source}:{exc.lineno}: not JSON: {exc.msg}") from None
    where = f"{source}: expected {{'metadata': {{'gap_seconds': s}}, 'data': [counts]}}"
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        raise TraceError(f"{where}; 'data' is missing or not a list")
    meta = doc.get("metadata")
    gap = meta.get("gap_seconds") if isinstance(meta, dict) else None
    if isinstance(gap, bool) or not isinstance(gap, int | float) or not gap > 0:
        raise TraceError(f"{where}; metadata.gap_seconds must be a positive number, got {gap!r}")
    gap_ms = round(gap * 1000)
    live: list[str] = []
    added = 0
    out: list[TraceEvent] = []
    for i, count in enumerate(doc["data"]):
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise TraceError(
                f"{source}: data[{i}] = {count!r} is not a count of instances (an integer >= 0)"
            )
        t = i * gap_ms
        while len(live) < count:
            added += 1
            live.append(f"n{added}")
            out.append(TraceEvent(t, "add", live[-1]))
        while len(live) > count:
            out.append(TraceEvent(t, "remove", live.pop()))
    return SpotTrace(out, len(doc["data"]) * gap_ms)


def load_trace(path: str | Path, max_events: int | None = None) -> SpotTrace:
    """A trace file in either format: `.json` is SkyPilot's counts, anything else Bamboo."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise TraceError(f"{p}: cannot read trace: {exc}") from None
    if p.suffix == ".json":
        trace = parse_counts_json(text, str(p))
        if max_events is not None:
            return SpotTrace(trace.events[:max_events], trace.length_ms)
        return trace
    return SpotTrace(parse_bamboo(text, str(p), max_events))


def load_bamboo(path: str | Path, max_events: int | None = None) -> list[TraceEvent]:
    """The events of a trace file (either format; see `load_trace`)."""
    return load_trace(path, max_events).events


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
