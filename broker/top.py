"""`muster top`: the dashboard's live view in the terminal (rich Live).

Without a terminal (a pipe, a file, a cron job) a live view would print nothing until Ctrl-C, so
the command prints one plain-text snapshot of the same view and exits.

Driven by the job event subject: the views are refetched when an event arrives (at most once per
`min_interval_s`) and every few seconds otherwise, so heartbeats and free GPUs stay fresh. Only
running jobs are listed, never the whole job table.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from broker.client import MusterClient
from broker.ui.live import Interruptions
from schemas.api import ClusterView, JobView, QueueView
from schemas.codec import DecodeError, decode_job_event

BUSIEST = 10
IDLE_REFRESH_S = 3.0


class TopView:
    """What `muster top` shows, refreshed from the broker's API and its events."""

    def __init__(self) -> None:
        self.clusters: list[ClusterView] = []
        self.queues: list[QueueView] = []
        self.busiest: list[JobView] = []
        self.interruptions = Interruptions(limit=BUSIEST)
        self.events = 0
        self.error: str | None = None

    async def refresh(self, client: MusterClient, timeout: float = 5.0) -> None:
        from broker.client import MusterError

        try:
            self.clusters = await client.clusters(timeout=timeout)
            self.queues = await client.queues(timeout=timeout)
            running = await client.list(state="running", limit=1000, timeout=timeout)
            self.error = None
        except MusterError as exc:
            self.error = str(exc)
            return
        self.busiest = sorted(running, key=lambda j: (-j.gpus, j.submitted_at))[:BUSIEST]

    def on_event(self, data: bytes) -> None:
        try:
            ev = decode_job_event(data)
        except DecodeError:
            return
        self.events += 1
        self.interruptions.observe(ev)

    def render(self, now: float | None = None, *, live: bool = True) -> RenderableType:
        from broker.render import clusters_table, jobs_table, queues_table

        now = time.time() if now is None else now
        parts: list[RenderableType] = [
            Text.assemble(
                ("muster top", "bold"),
                f"  {time.strftime('%H:%M:%S', time.localtime(now))}  events seen: {self.events}"
                + ("  (Ctrl-C to quit)" if live else "  (snapshot: no terminal)"),
            )
        ]
        if self.error:
            parts.append(Text(self.error, style="red"))
        parts += [
            Text("\nClusters", style="bold cyan"),
            clusters_table(self.clusters, now),
            Text("\nQueues", style="bold cyan"),
            queues_table(self.queues),
            Text(f"\nBusiest jobs (top {BUSIEST} running, by GPUs)", style="bold cyan"),
            jobs_table(self.busiest, now),
            Text("\nRecent interruptions", style="bold cyan"),
            interruptions_table(self.interruptions.newest_first(BUSIEST), now),
        ]
        return Group(*parts)


def interruptions_table(items: list[dict[str, Any]], now: float) -> Table:
    from broker.render import fmt_ago

    table = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("NOTICE", "JOB", "ATTEMPT", "CAUSE", "FROM", "TO", "RESUMED FROM", "LATENCY"):
        table.add_column(col, no_wrap=True)
    for i in items:
        latency = i["latency_s"]
        table.add_row(
            fmt_ago(i["notice_at"], now),
            i["job_id"],
            str(i["attempt"]),
            i["cause"],
            f"{i['cluster'] or '-'}/{i['flavor'] or '-'}",
            i["new_cluster"] or "waiting",
            "-" if i["resume_from_step"] is None else str(i["resume_from_step"]),
            "-" if latency is None else f"{latency:.2f}s",
        )
    return table


async def snapshot_top(client: MusterClient, console: Console) -> TopView:
    """The live view's panels once, as plain text, for output that is not a terminal (where a
    live view would print nothing until Ctrl-C). A broker that does not answer is an error."""
    from broker.client import MusterError

    view = TopView()
    await view.refresh(client)
    if view.error:
        raise MusterError(view.error)
    console.print(view.render(live=False))
    return view


async def run_top(
    client: MusterClient,
    console: Console,
    *,
    min_interval_s: float = 1.0,
    max_updates: int | None = None,
    view: TopView | None = None,
    on_ready: Callable[[], None] | None = None,
) -> TopView:
    """Until cancelled (Ctrl-C), or after `max_updates` redraws. `on_ready` runs once the
    first view is on screen."""
    view = view or TopView()
    changed = asyncio.Event()

    async def on_msg(msg: Any) -> None:
        view.on_event(msg.data)
        changed.set()

    # A team sees its own jobs: the API answers it about them only, and these are the events
    # NATS lets it read.
    events = (
        client.subjects.team_events(client.team, "*")
        if client.team
        else client.subjects.job_events_all
    )
    sub = await client.nc.subscribe(events, cb=on_msg)
    try:
        await view.refresh(client)
        updates = 0
        with Live(view.render(), console=console, auto_refresh=False) as live:
            if on_ready is not None:
                on_ready()
            while max_updates is None or updates < max_updates:
                try:
                    async with asyncio.timeout(IDLE_REFRESH_S):
                        await changed.wait()
                except TimeoutError:
                    pass
                changed.clear()
                await view.refresh(client)
                live.update(view.render(), refresh=True)
                updates += 1
                await asyncio.sleep(min_interval_s)
    finally:
        await sub.unsubscribe()
    return view
