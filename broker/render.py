"""Rich renderings of the API's views (pure: Structs in, renderables out), shared by the
one-shot commands in `broker/cli.py` and the live `muster top`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from schemas.api import (
    TERMINAL_STATES,
    ClusterView,
    FlavorView,
    JobEvent,
    JobView,
    QueueView,
    SubmitReply,
    WhyView,
)

_STATE_STYLE = {
    "queued": "yellow",
    "admitted": "cyan",
    "running": "green",
    "preempting": "magenta",
    "succeeded": "bold green",
    "failed": "bold red",
    "cancelled": "dim",
    "checkpointed": "blue",
    "requeued": "yellow",
    "restarted": "magenta",
    "resized": "cyan",
}


def state_text(state: str) -> Text:
    return Text(state, style=_STATE_STYLE.get(state, ""))


def fmt_ago(ts: float | None, now: float) -> str:
    """`12s ago`, `3m ago`, `2h ago`, `4d ago`; '-' when unknown."""
    if not ts:
        return "-"
    return f"{fmt_duration(max(0.0, now - ts))} ago"


def fmt_duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    if seconds < 86400:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def fmt_gpu_hours(gpu_seconds: float) -> str:
    return f"{gpu_seconds / 3600:.2f}"


def _where(cluster: str | None, flavor: str | None) -> str:
    if not cluster:
        return flavor or "-"
    return f"{cluster}/{flavor}" if flavor else cluster


def _row(table: Table, *cells: str | Text) -> None:
    """Add a row; plain strings become Text so '[...]' in a reason is never read as markup."""
    table.add_row(*(Text(c) if isinstance(c, str) else c for c in cells))


def _last_where(j: JobView) -> str:
    """Where the job runs now, else where it last ran (an ended or requeued job)."""
    if j.cluster:
        return _where(j.cluster, j.flavor)
    if j.attempts:
        last = j.attempts[-1]
        return f"{_where(last.cluster, last.flavor)} (last)"
    return "-"


def jobs_table(jobs: Sequence[JobView], now: float | None = None) -> Table:
    """`muster status`: one row per job; REASON is the short form of `muster why`."""
    now = time.time() if now is None else now
    table = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("JOB", "NAME", "QUEUE", "STATE", "GPUS", "ATTEMPT", "WHERE", "SUBMITTED"):
        table.add_column(col, no_wrap=True)
    table.add_column("REASON", overflow="fold")
    for j in jobs:
        _row(
            table,
            j.job_id,
            j.name,
            j.queue,
            state_text(j.state),
            str(j.gpus),
            str(j.attempt) if j.attempt else "-",
            _last_where(j),
            fmt_ago(j.submitted_at, now),
            j.waiting or j.reason or "",
        )
    return table


def job_detail(job: JobView, now: float | None = None) -> Group:
    """`muster status JOB`: state, attempts, accounting and the latest checkpoint."""
    now = time.time() if now is None else now
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    _row(head, "job", job.job_id)
    _row(head, "name", job.name)
    _row(head, "queue", job.queue)
    state = state_text(job.state)
    if job.reason:
        state.append(f"  ({job.reason})", style="")
    _row(head, "state", state)
    _row(head, "priority", str(job.priority))
    _row(head, "gpus", str(job.gpus))
    _row(head, "submitted", fmt_ago(job.submitted_at, now))
    if job.attempt:
        last = job.attempts[-1] if job.attempts else None
        if job.cluster or last is None:
            _row(head, "attempt", f"{job.attempt} on {_where(job.cluster, job.flavor)}")
        else:  # ended: where its last attempt ran
            _row(head, "attempt", f"{job.attempt}, last ran on {_where(last.cluster, last.flavor)}")
    if job.spec is not None and job.spec.gang:
        _row(
            head,
            "gang",
            ", ".join(
                f"{p.name} x{p.replicas} ({p.gpu} gpu, {p.cpu} cpu, {p.memory})"
                for p in job.spec.gang
            ),
        )
    if job.size:
        _row(head, "elastic", job.size)
    parts: list[RenderableType] = [head]

    if job.attempts:
        attempts = Table(title="attempts", title_justify="left", box=None, header_style="bold")
        for col in ("#", "CLUSTER", "FLAVOR", "CAPACITY", "GPU", "DISPATCHED", "RAN", "ENDED"):
            attempts.add_column(col, no_wrap=True)
        for col in ("CAUSE", "RESUMED", "GPU-H", "LOST GPU-H", "COST"):
            attempts.add_column(col, no_wrap=True)
        for a in job.attempts:
            _row(
                attempts,
                str(a.attempt),
                a.cluster,
                a.flavor,
                a.capacity_type or "-",
                a.gpu_type or "-",
                fmt_ago(a.dispatched_at, now),
                fmt_duration((a.ended_at or now) - a.running_at) if a.running_at else "-",
                fmt_ago(a.ended_at, now) if a.ended_at else "-",
                a.end_cause or ("-" if a.ended_at is None else ""),
                f"step {a.resume_from_step}" if a.resume_from_step is not None else "-",
                fmt_gpu_hours(a.gpu_seconds),
                fmt_gpu_hours(a.gpu_seconds_lost),
                f"${a.cost:.2f}",
            )
        parts.append(Text(""))
        parts.append(attempts)

    acc = job.accounting
    parts.append(Text(""))
    parts.append(
        Text.assemble(
            ("accounting  ", "bold"),
            f"attempts {acc.attempts}, preemptions {acc.preemptions}, errors {acc.errors}, "
            f"GPU-hours used {fmt_gpu_hours(acc.gpu_seconds_used)}, "
            f"lost {fmt_gpu_hours(acc.gpu_seconds_lost)}, goodput {acc.goodput:.0%}, "
            f"cost ${acc.cost:.2f}",
        )
    )
    ck = job.latest_checkpoint
    if ck is not None:
        when = f", {fmt_ago(ck.at, now)}" if ck.at else ""
        by = f", attempt {ck.attempt}" if ck.attempt else ""
        parts.append(
            Text.assemble(("checkpoint  ", "bold"), f"step {ck.step} at {ck.uri}{when}{by}")
        )
    else:
        parts.append(Text.assemble(("checkpoint  ", "bold"), "none yet"))
    return Group(*parts)


def why_view(why: WhyView) -> Group:
    """`muster why JOB`: position, what it waits for, and per cluster x flavor what binds."""
    lines: list[RenderableType] = []
    ended = why.state in TERMINAL_STATES
    head = Text.assemble(
        (why.job_id, "bold"), " has ended: " if ended else " is ", state_text(why.state)
    )
    if why.position is not None:
        where = f" in queue {why.queue}" if why.queue else " in its queue"
        ahead = "at the head" if why.position == 0 else f"{why.position} ahead of it"
        head.append(f", position {why.position}{where} ({ahead})")
    lines.append(head)
    if why.waiting_for:
        lines.append(Text(f"waiting for: {why.waiting_for}"))
    if why.work_price:
        lines.append(Text(why.work_price))
    if not why.reasons and not why.candidates:
        if why.state == "queued":
            lines.append(Text("no reason recorded yet; the next scheduling cycle will say"))
        else:
            lines.append(Text("nothing holds it back"))
    for r in why.reasons:
        where = _where(r.cluster, r.flavor)
        prefix = f"  [{r.code}] " + (f"{where}: " if where != "-" else "")
        lines.append(Text(prefix + r.message))  # Text: never parsed as markup
    if why.candidates:
        table = Table(box=None, pad_edge=False, header_style="bold")
        table.add_column("CLUSTER/FLAVOR", no_wrap=True)
        table.add_column("CONSTRAINT", no_wrap=True)
        bound = any(c.bound is not None for c in why.candidates)
        if bound:  # the binding numbers: used + needed > limit
            table.add_column("BINDING", no_wrap=True)
        table.add_column("DETAIL", overflow="fold")
        for c in why.candidates:
            cells = [_where(c.cluster, c.flavor), c.code]
            if bound:
                b = c.bound
                binding = "-"
                if b is not None:
                    k, unit = (2**30, "Gi") if b.resource == "memory" else (1, "")
                    used, needed, limit = (f"{v / k:g}{unit}" for v in (b.used, b.needed, b.limit))
                    binding = f"{b.resource} {used}+{needed}>{limit}"
                cells.append(binding)
            _row(table, *cells, c.message)
        lines.append(Text(""))
        lines.append(table)
    return Group(*lines)


def _amount(resource: str, value: int | None) -> str:
    if value is None:
        return "∞"
    if resource == "cpu":
        return f"{value / 1000:g}"
    if resource == "memory":
        for suffix, size in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20)):
            if value >= size:
                return f"{value / size:.3g}{suffix}"
        return str(value)
    return str(value)


def queues_table(queues: Sequence[QueueView]) -> Table:
    """`muster queues`: usage against quota per flavor class and resource."""
    table = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("QUEUE", "COHORT", "STRATEGY", "WEIGHT", "PENDING", "ADMITTED", "SHARE"):
        table.add_column(col, no_wrap=True)
    table.add_column("USAGE (used/nominal, +borrowed, lent)", overflow="fold")
    for q in queues:
        usage = []
        for f in q.flavors:
            res = []
            for r in f.resources:
                cell = (
                    f"{r.resource} {_amount(r.resource, r.used)}/{_amount(r.resource, r.nominal)}"
                )
                if r.borrowed:
                    cell += f" +{_amount(r.resource, r.borrowed)}"
                if r.lent:
                    cell += f" lent {_amount(r.resource, r.lent)}"
                res.append(cell)
            usage.append(f"{f.flavor}: " + ", ".join(res))
        _row(
            table,
            q.name,
            q.cohort or "-",
            q.strategy,
            f"{q.weight:g}",
            str(q.pending),
            str(q.admitted),
            f"{q.dominant_share:.0%}",
            "; ".join(usage)
            or (
                "no quota (unlimited)" if q.unlimited else "no quota for any flavor: admits nothing"
            ),
        )
    return table


_HEALTH_STYLE = {"healthy": "green", "unreachable": "yellow", "lost": "red"}


def _interruptions(f: FlavorView) -> str:
    """The estimate and what it rests on: the prior alone until a notice has been seen."""
    if f.interruptions == 0 and f.interruption_prior is not None:
        return f"prior {f.interruption_prior:g}/node-h, 0 observed"
    if f.interruptions == 0 and f.interruption_rate_per_node_hour == 0:
        return "-"
    return f"{f.interruption_rate_per_node_hour:.3f}/node-h, {f.interruptions} observed"


def clusters_table(clusters: Sequence[ClusterView], now: float | None = None) -> Table:
    """`muster clusters`: one row per cluster flavor, with capacity and spot risk."""
    now = time.time() if now is None else now
    table = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("CLUSTER", "HEALTH", "HEARTBEAT", "JOBS", "FLAVOR", "CAPACITY", "GPU"):
        table.add_column(col, no_wrap=True)
    for col in (
        "$/GPU-H",
        "NODES",
        "GPUS FREE/TOTAL",
        "DRAINING",
        "INTERRUPTIONS/NODE-H",
        "DISPATCH",
    ):
        table.add_column(col, no_wrap=True)
    for c in clusters:
        health = Text(c.health, style=_HEALTH_STYLE.get(c.health, ""))
        if c.stale_s > 0:  # the agent cannot see its cluster: nothing is placed there
            health = Text(f"{c.health}, stale {c.stale_s:.0f}s", style="yellow")
        common: list[str | Text] = [
            c.name,
            health,
            fmt_ago(c.last_heartbeat, now),
            str(c.running_jobs),
        ]
        if not c.flavors:
            _row(table, *common, "-", "-", "-", "-", "0", "0/0", "0", "-", "-")
        for i, f in enumerate(c.flavors):
            lead: list[Any] = common if i == 0 else ["", "", "", ""]
            _row(
                table,
                *lead,
                f.name,
                f.capacity_type,
                f.gpu_type or "-",
                f"{f.price_per_gpu_hour:.2f}",
                _nodes(f),
                f"{f.gpu_free}/{f.gpu_total}",
                str(f.draining_nodes),
                _interruptions(f),
                _breaker(f),
            )
    return table


def _nodes(f: FlavorView) -> str:
    """Nodes now; for an autoscaled pool also those coming, its limit and recent stockouts."""
    if not f.autoscale_max_nodes:
        return str(f.nodes)
    text = f"{f.nodes} +{f.nodes_coming} of {f.autoscale_max_nodes}"
    if f.stockouts >= 0.05:
        text += f", {f.stockouts:.1f} stockouts"
    return text


def _breaker(f: FlavorView) -> Text:
    """The pool's dispatch breaker: `ok`, or its state and why (`muster why` has the rest)."""
    if not f.breaker:
        return Text("ok")
    if f.breaker == "closed":
        return Text(f"ok, {f.breaker_failures} failed", style="yellow")
    return Text(f"{f.breaker}: {f.breaker_reason}", style="red")


def event_line(ev: JobEvent) -> Text:
    """One line per lifecycle event for `muster watch`."""
    clock = time.strftime("%H:%M:%S", time.localtime(ev.at)) if ev.at else "--:--:--"
    text = Text(f"{clock}  ")
    text.append(f"{ev.kind:<12}", style=_STATE_STYLE.get(ev.kind, ""))
    text.append(" ")  # a kind as long as the column must not run into its details
    details = []
    if ev.attempt:
        details.append(f"attempt {ev.attempt}")
    if ev.cluster:
        details.append(f"on {_where(ev.cluster, ev.flavor)}")
    if ev.step is not None:
        details.append(f"step {ev.step}")
    if ev.resume_from_step is not None:
        details.append(f"resuming from step {ev.resume_from_step}")
    if ev.reason:
        details.append(f"({ev.reason})")
    text.append(" ".join(details))
    return text


def submit_line(reply: SubmitReply, queue: str) -> str:
    if reply.duplicate:
        return f"job {reply.job_id} was already submitted to queue {queue}; nothing new created"
    return f"submitted job {reply.job_id} to queue {queue}"


# -- client commands ---------------------------------------------------------------------


def current_line(view: JobView, now: float | None = None) -> Text:
    """`muster watch`'s first line: where the job stands before any new event."""
    now = time.time() if now is None else now
    clock = time.strftime("%H:%M:%S", time.localtime(now))
    text = Text(f"{clock}  ")
    text.append(f"{'now ' + view.state:<12}", style=_STATE_STYLE.get(view.state, ""))
    text.append(" ")
    details = []
    if view.attempt:
        details.append(f"attempt {view.attempt}")
    where = _last_where(view)
    if where != "-":
        details.append(f"on {where}")
    if view.latest_checkpoint is not None:
        details.append(f"checkpoint step {view.latest_checkpoint.step}")
    note = view.waiting or view.reason
    if note:
        details.append(f"({note})")
    text.append(" ".join(details))
    return text
