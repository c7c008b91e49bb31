"""How `make demo` looks: the live jobs table, event log lines, and the closing summary.

Pure rendering (rich renderables and strings) from plain data, so the orchestration stays
readable and the same lines serve the live display and plain (CI, pipe) output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from agents.config import FakeFlavor
from schemas.api import JobEvent

STATE_STYLE = {
    "queued": "yellow",
    "admitted": "cyan",
    "running": "green",
    "preempting": "bold magenta",
    "succeeded": "bold green",
    "failed": "bold red",
    "cancelled": "red",
}
EVENT_STYLE = {
    "queued": "dim",
    "admitted": "cyan",
    "running": "green",
    "checkpointed": "dim",
    "preempting": "bold magenta",
    "requeued": "yellow",
    "succeeded": "bold green",
    "failed": "bold red",
    "cancelled": "red",
}
HEALTH_STYLE = {"healthy": "green", "unreachable": "yellow", "lost": "bold red"}


@dataclass
class JobRow:
    """One line of the live table, merged from the API, the events and the fake clusters."""

    job_id: str
    name: str
    queue: str
    total_steps: int
    state: str = "queued"
    cluster: str | None = None
    flavor: str | None = None
    attempt: int = 0
    step: int = 0
    preemptions: int = 0
    note: str = ""


@dataclass
class ClusterRow:
    name: str
    health: str = "healthy"
    partitioned: bool = False
    pools: list[str] = field(default_factory=list)


def flavor_label(
    flavors: dict[tuple[str, str], FakeFlavor], cluster: str | None, fl: str | None
) -> str:
    """'spot A100' for (spot-east, a100-spot); the raw name when unknown."""
    if cluster is None or fl is None:
        return ""
    f = flavors.get((cluster, fl))
    return fl if f is None else f"{f.capacity_type} {f.gpu_type}"


def _bar(step: int, total: int, width: int = 16) -> Text:
    frac = 0.0 if total <= 0 else max(0.0, min(1.0, step / total))
    full = round(frac * width)
    bar = Text("█" * full, style="green")
    bar.append("░" * (width - full), style="dim")
    return bar


def jobs_table(
    rows: list[JobRow], flavors: dict[tuple[str, str], FakeFlavor], elapsed: float
) -> Table:
    table = Table(
        title=f"Muster demo · {elapsed:5.1f} s",
        title_justify="left",
        expand=False,
        header_style="bold",
    )
    for col, kw in (
        ("job", {"no_wrap": True}),
        ("queue", {}),
        ("state", {"no_wrap": True}),
        ("cluster", {"no_wrap": True}),
        ("flavor", {"no_wrap": True}),
        ("att.", {"justify": "right"}),
        ("progress", {"no_wrap": True}),
        ("step / total", {"justify": "right", "no_wrap": True}),
        ("preempt.", {"justify": "right"}),
    ):
        table.add_column(col, **kw)
    for r in rows:
        table.add_row(
            r.job_id,
            r.queue,
            Text(r.state, style=STATE_STYLE.get(r.state, "")),
            r.cluster or "",
            flavor_label(flavors, r.cluster, r.flavor),
            str(r.attempt or ""),
            _bar(r.step, r.total_steps),
            f"{r.step} / {r.total_steps}",
            str(r.preemptions or ""),
        )
    return table


def clusters_grid(clusters: list[ClusterRow]) -> Table:
    """One line per cluster: health as the broker sees it, and free GPUs per pool."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(no_wrap=True)
    grid.add_column(no_wrap=True)
    grid.add_column()
    for c in clusters:
        health = Text(c.health, style=HEALTH_STYLE.get(c.health, "yellow"))
        if c.partitioned:
            health.append(" (partitioned)", style="bold red")
        grid.add_row(c.name, health, Text(" · ".join(c.pools), style="dim"))
    return grid


def live_view(
    rows: list[JobRow],
    clusters: list[ClusterRow],
    flavors: dict[tuple[str, str], FakeFlavor],
    elapsed: float,
) -> RenderableType:
    return Group(jobs_table(rows, flavors, elapsed), clusters_grid(clusters))


def event_line(
    event: JobEvent, t: float, flavors: dict[tuple[str, str], FakeFlavor], width: int
) -> Text:
    """One log line per JobEvent: when, which job, what happened, where, and why."""
    line = Text(f"[{t:5.1f}s] ", style="dim")
    line.append(f"{event.job_id:<{width}} ")
    line.append(f"{event.kind:<12} ", style=EVENT_STYLE.get(event.kind, ""))
    parts: list[str] = []
    if event.kind == "checkpointed":
        parts.append(f"step {event.step}")
    elif event.kind != "queued" and event.cluster:
        where = f"{event.cluster}/{event.flavor}"
        label = flavor_label(flavors, event.cluster, event.flavor)
        where = f"{where} ({label})" if label else where
        if event.kind == "requeued":
            parts.append(f"attempt {event.attempt} on {where} ended")
        else:
            parts.append(f"attempt {event.attempt} on {where}")
    if event.kind == "admitted" and event.resume_from_step is not None:
        parts.append(f"resuming from checkpoint step {event.resume_from_step}")
    if event.reason and event.kind != "succeeded":
        parts.append(f"reason: {event.reason}")
    line.append("  ".join(parts))
    line.rstrip()
    return line


def trouble_line(t: float, text: str) -> Text:
    line = Text(f"[{t:5.1f}s] ", style="dim")
    line.append(">>> " + text, style="bold yellow")
    return line


# -- summary ---------------------------------------------------------------------------------


def summary_table(views: list[dict[str, Any]]) -> RenderableType:
    """Per job, from `muster.api.get`: what the losses cost, then every attempt.

    The attempts are lines under the table, not a column of it: a column as wide as
    "#2 mixed-central/a100-od, from step 237 → succeeded" left no room at 80 columns for the
    figures, which rich then cut to `pre-emp…` or dropped."""
    table = Table(
        title="Summary (from muster.api.get)",
        title_justify="left",
        header_style="bold",
        box=box.SIMPLE_HEAD,
        show_edge=False,
    )
    table.add_column("job", no_wrap=True)
    for header in ("pre-\nempted", "GPU-s\nused", "GPU-s\nlost", "good-\nput", "cost $"):
        table.add_column(header, justify="right", no_wrap=True)
    attempts = Text()
    totals = [0.0, 0.0, 0.0]
    for v in views:
        acc = v.get("accounting", {})
        state = v.get("state", "?")
        attempts.append(f"\n{v['job_id']}\n", style=STATE_STYLE.get(state, ""))
        for a in v.get("attempts", []):
            resume = a.get("resume_from_step")
            start = f", from step {resume}" if resume else ""
            end = a.get("end_cause") or ("running" if a.get("ended_at") is None else "?")
            attempts.append(f"  #{a['attempt']} {a['cluster']}/{a['flavor']}{start} → {end}\n")
        if not v.get("attempts"):
            attempts.append(f"  never started ({state})\n")
        used = float(acc.get("gpu_seconds_used", 0.0))
        lost = float(acc.get("gpu_seconds_lost", 0.0))
        cost = float(acc.get("cost", 0.0))
        totals[0] += used
        totals[1] += lost
        totals[2] += cost
        table.add_row(
            Text(v["job_id"], style=STATE_STYLE.get(state, "")),
            str(acc.get("preemptions", 0)),
            f"{used:,.0f}",
            f"{lost:,.0f}",
            f"{100 * float(acc.get('goodput', 1.0)):.1f}%",
            f"{cost:.3f}",
        )
    used, lost, cost = totals
    goodput = (used - lost) / used if used > 0 else 1.0
    table.add_section()
    table.add_row(
        Text("all jobs", style="bold"),
        "",
        f"{used:,.0f}",
        f"{lost:,.0f}",
        f"{100 * goodput:.1f}%",
        f"{cost:.3f}",
    )
    attempts.rstrip()
    return Group(table, Text("\nAttempts: cluster/flavor → how each ended", style="bold"), attempts)
