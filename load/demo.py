"""`make demo`: Muster end to end in one process, in about a minute.

An embedded nats-server, the broker, and three fake GPU clusters (spot-heavy, on-demand,
mixed) start on 127.0.0.1. A handful of gang jobs are submitted as plain JSON over NATS, then
trouble is injected: a spot notice under one job, a GPU (XID) failure under another, and (in the
full run) a whole-cluster outage. A live table shows where every job runs and how far it got;
a summary from the API shows what each loss cost.

    python -m load.demo [--fast] [--seed N] [--no-live]

Exit code 0 when every job succeeded. The scenario itself is in `load/demo_scenario.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import sys
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

import nats
import structlog
import typer
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from rich.console import Console, RenderableType
from rich.live import Live
from rich.text import Text

from agents.fake.cluster import AttemptRecord
from agents.fleet import Fleet, start_fake_fleet
from broker.core.states import LIVE_STATES
from broker.embedded import EmbeddedNats
from broker.service import Broker
from load import demo_scenario as scenario
from load.command import program, summary
from load.demo_view import (
    ClusterRow,
    JobRow,
    event_line,
    flavor_label,
    live_view,
    summary_table,
    trouble_line,
)
from schemas.api import TERMINAL_STATES, JobEvent
from schemas.codec import DecodeError, decode_job_event
from schemas.subjects import Subjects
from shell.natsio import submit_request

TIMES = "\N{MULTIPLICATION SIGN}"
HARD_CAP_S = 90.0  # the whole run, start to exit
TICK_S = 0.05  # injections and the live-copies check
POLL_S = 0.25  # the API poll behind the table
RENDER_S = 0.25
PLAIN_PROGRESS_S = 5.0  # without a TTY: one progress line per job this often


@dataclass
class DemoOptions:
    fast: bool = False
    seed: int = 7
    live: bool | None = None  # None: a live display when stdout is a terminal
    jobs_deadline_s: float | None = None  # from submission; default 70 s (fast: 40 s)


@dataclass
class Injection:
    """One piece of trouble the demo caused, for the explanation and the test."""

    kind: str
    job_id: str
    cluster: str
    node: str | None
    at: float  # seconds since the start of the demo
    attempt: int
    step: int


@dataclass
class DemoResult:
    exit_code: int
    elapsed_s: float
    views: dict[str, dict[str, Any]] = field(default_factory=dict)  # muster.api.get results
    injections: list[Injection] = field(default_factory=list)
    max_live_copies: dict[str, int] = field(default_factory=dict)
    histories: dict[str, list[AttemptRecord]] = field(default_factory=dict)
    events: dict[str, list[JobEvent]] = field(default_factory=dict)
    stray_tasks: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class Demo:
    """Owns everything the demo starts, so one `finally` can stop all of it in order."""

    def __init__(self, options: DemoOptions, console: Console) -> None:
        self.opts = options
        self.console = console
        self.use_live = console.is_terminal if options.live is None else options.live
        self.subjects = Subjects(prefix=scenario.PREFIX)
        self.flavors = scenario.flavor_table()
        self.rng = random.Random(options.seed)
        self.t0 = time.monotonic()
        self.t0_wall = time.time()
        self.result = DemoResult(exit_code=1, elapsed_s=0.0)
        self.rows: dict[str, JobRow] = {}
        self.clusters: list[ClusterRow] = [ClusterRow(c.name) for c in scenario.CLUSTERS]
        self.events: dict[str, list[JobEvent]] = defaultdict(list)
        self.live: Live | None = None
        self.nats: EmbeddedNats | None = None
        self.nc: Client | None = None
        self.broker_nc: Client | None = None
        self.fleet_nc: Client | None = None
        self.broker: Broker | None = None
        self.broker_task: asyncio.Task[None] | None = None
        self.fleet: Fleet | None = None
        self.id_width = 16
        self._heal_at: dict[str, float] = {}
        self._held: list[tuple[JobEvent, float]] | None = None  # held back while submitting

    # -- output ----------------------------------------------------------------------------
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def say(self, renderable: RenderableType | str = "") -> None:
        """Print above the live table (or plainly): rich routes it either way."""
        self.console.print(renderable, highlight=False, soft_wrap=not self.use_live)

    def note(self, text: str) -> None:
        self.say(trouble_line(self.elapsed(), text))

    # -- lifecycle -------------------------------------------------------------------------
    async def run(self) -> DemoResult:
        before = set(asyncio.all_tasks())
        try:
            await self._start()
            job_ids = await self._submit_all()
            finished = await self._watch(job_ids)
            self._stop_live()
            await self._report(job_ids, finished)
        finally:
            await self._shutdown()
            self.result.elapsed_s = self.elapsed()
            current = asyncio.current_task()
            self.result.stray_tasks = sorted(
                t.get_name()
                for t in asyncio.all_tasks() - before
                if t is not current and not t.done()
            )
            self.result.events = dict(self.events)
        return self.result

    async def _start(self) -> None:
        self.say(Text("Muster demo: gang admission across three GPU clusters", style="bold"))
        self.nats = await EmbeddedNats().start()
        url = self.nats.url
        self.say(f"embedded nats-server on {url} (JetStream in a temp dir)")
        self.broker_nc = await _connect(url, "muster-broker", self.result.errors)
        self.broker = Broker(scenario.broker_config(), self.broker_nc)
        self.broker_task = asyncio.create_task(self.broker.run(), name="demo-broker")
        await _bounded(self.broker.leading.wait(), 15, "the broker did not start leading")
        self.say("broker leading: queues research + prod (cohort ml)")
        self.fleet_nc = await _connect(url, "muster-fake-fleet", self.result.errors)
        self.fleet = await start_fake_fleet(
            self.fleet_nc, scenario.agent_configs(self.opts.seed), self.subjects
        )
        for c in scenario.CLUSTERS:
            pools = ", ".join(
                f"{f.nodes}{TIMES}{f.gpu_per_node} {f.capacity_type} {f.gpu_type} "
                f"${f.price_per_gpu_hour:.2f}/GPU-h"
                for f in c.flavors
            )
            self.say(f"fake cluster {c.name:<14} {c.blurb:<11} {pools}")
        self.say(
            f"(simulated training runs {scenario.TIME_SCALE:g}x faster than real time; "
            "costs and GPU-seconds are wall-clock)"
        )
        names = {"spot-notice": "a spot notice", "gpu-failure": "a GPU failure (XID)"}
        kinds = [
            names.get(t.kind, "a whole-cluster outage") for t in scenario.troubles(self.opts.fast)
        ]
        trouble = ", ".join(kinds[:-1]) + " and " + kinds[-1] if len(kinds) > 1 else kinds[0]
        self.say(
            Text(
                "Next: gang jobs are submitted and placed, then "
                f"{trouble} hit some of them while they train.",
                style="bold",
            )
        )
        self.nc = await _connect(url, "muster-demo-client", self.result.errors)
        await self.nc.subscribe(self.subjects.job_events_all, cb=self._on_event)
        await self._wait_ready()

    async def _wait_ready(self) -> None:
        """The broker must be answering and the agents' first snapshots must have landed
        before jobs can be placed."""
        assert self.nc is not None
        deadline = time.monotonic() + 15
        names = {c.name for c in scenario.CLUSTERS}
        while time.monotonic() < deadline:
            reply = await self._api("clusters", {}, timeout=1.0, quiet=True)
            ready = {
                c["name"]
                for c in (reply or {}).get("result") or []
                if c.get("health") == "healthy" and c.get("flavors")
            }
            if names <= ready:
                return
            await asyncio.sleep(0.05)
        raise RuntimeError("the fake clusters did not register with the broker in 15 s")

    async def _shutdown(self) -> None:
        """Stop in dependency order; every step is bounded and none may raise."""
        self._stop_live()
        steps: list[tuple[str, Callable[[], Awaitable[Any]]]] = []
        if self.fleet is not None:
            steps.append(("fleet", self.fleet.stop))
        if self.broker is not None:
            steps.append(("broker", self._stop_broker))
        for name in ("nc", "fleet_nc", "broker_nc"):
            client = getattr(self, name)
            if client is not None and not client.is_closed:
                steps.append((name, client.close))
        if self.nats is not None:
            steps.append(("nats", self.nats.stop))
        for name, step in steps:
            try:
                await asyncio.wait_for(step(), 15)
            except Exception as exc:
                self.result.errors.append(f"shutdown {name}: {type(exc).__name__}: {exc}")

    def _stop_live(self) -> None:
        if self.live is not None:
            with contextlib.suppress(Exception):
                self.live.stop()
            self.live = None

    async def _stop_broker(self) -> None:
        assert self.broker is not None
        await self.broker.stop()
        if self.broker_task is not None:
            await self.broker_task

    # -- NATS helpers ----------------------------------------------------------------------
    async def _api(
        self, verb: str, body: dict[str, Any], timeout: float = 2.0, quiet: bool = False
    ) -> dict[str, Any] | None:
        assert self.nc is not None
        try:
            msg = await self.nc.request(
                self.subjects.api(verb), json.dumps(body).encode(), timeout=timeout
            )
        except (NoRespondersError, NatsTimeoutError, TimeoutError) as exc:
            if not quiet:
                self.result.errors.append(f"muster.api.{verb}: {type(exc).__name__}")
            return None
        out: dict[str, Any] = json.loads(msg.data)
        return out

    async def _on_event(self, msg: Any) -> None:
        try:
            event = decode_job_event(msg.data)
        except DecodeError as exc:
            self.result.errors.append(f"bad job event: {exc}")
            return
        self.events[event.job_id].append(event)
        row = self.rows.get(event.job_id)
        if row is not None:  # events are fresher than the last API poll
            row.state = event.state
            if event.cluster:
                row.cluster, row.flavor, row.attempt = event.cluster, event.flavor, event.attempt
        t = max(0.0, event.at - self.t0_wall)
        if self._held is not None:
            self._held.append((event, t))
        else:
            self.say(event_line(event, t, self.flavors, self.id_width))

    # -- submit ----------------------------------------------------------------------------
    async def _submit_all(self) -> list[str]:
        assert self.nc is not None
        specs = scenario.jobs(self.opts.fast, self.opts.seed)
        self.say()
        self.say(Text("Submitting jobs: plain JSON on muster.submit.<queue>", style="bold"))
        self.say(Text(json.dumps(specs[0]), style="dim"))
        job_ids: list[str] = []
        self._held = []
        for spec in specs:
            subject = self.subjects.submit(spec["queue"])
            reply = await self._request_submit(subject, json.dumps(spec).encode())
            self.say(f"→ {subject:<24} {_describe(spec)}")
            self.say(
                Text(f"  ← {json.dumps(reply)}", style="green" if reply["accepted"] else "red")
            )
            if not reply.get("accepted"):
                raise RuntimeError(f"the broker refused {spec['name']}: {reply.get('error')}")
            job_id = reply["job_id"]
            job_ids.append(job_id)
            self.rows[job_id] = JobRow(
                job_id=job_id,
                name=spec["name"],
                queue=spec["queue"],
                total_steps=spec["workload"]["simulate"]["total_steps"],
            )
        self.id_width = max(len(j) for j in job_ids)
        self.say()
        held, self._held = self._held, None
        for event, t in held:
            self.say(event_line(event, t, self.flavors, self.id_width))
        return job_ids

    async def _request_submit(self, subject: str, data: bytes) -> dict[str, Any]:
        assert self.nc is not None
        for _ in range(50):
            try:
                msg = await submit_request(self.nc, subject, data, 5)
                out: dict[str, Any] = json.loads(msg.data)
                return out
            except NoRespondersError:
                await asyncio.sleep(0.05)
        raise RuntimeError(f"nobody answered on {subject}")

    # -- watch -----------------------------------------------------------------------------
    async def _watch(self, job_ids: list[str]) -> bool:
        """Until every job is finished or the deadline: inject trouble, check that no job has
        two live copies, poll the API and draw. Returns whether every job finished."""
        assert self.fleet is not None
        default = 40.0 if self.opts.fast else 70.0
        deadline = time.monotonic() + (self.opts.jobs_deadline_s or default)
        deadline = min(deadline, self.t0 + HARD_CAP_S - 10)
        submitted = self.elapsed()
        pending = list(scenario.troubles(self.opts.fast))
        copies = self.result.max_live_copies
        next_poll = next_render = next_plain = 0.0
        if self.use_live:
            self.live = Live(console=self.console, auto_refresh=False, transient=True)
            self.live.start()
        while time.monotonic() < deadline:
            now = time.monotonic()
            for job_id in job_ids:
                n = len(self.fleet.live_copies(job_id))
                copies[job_id] = max(copies.get(job_id, 0), n)
                if n > 1:
                    self.result.errors.append(f"{job_id} had {n} live copies")
            pending = [t for t in pending if not self._maybe_inject(t, submitted)]
            self._maybe_heal()
            if now >= next_poll:
                next_poll = now + POLL_S
                if await self._poll() and not self._heal_at:
                    self._draw()
                    return True
            if self.live is not None and now >= next_render:
                next_render = now + RENDER_S
                self._draw()
            elif self.live is None and now >= next_plain:
                if next_plain:
                    self._plain_progress()
                next_plain = now + PLAIN_PROGRESS_S
            await asyncio.sleep(TICK_S)
        for trouble in pending:
            self.note(f"{trouble.kind} under {trouble.job} never happened (the job never got far)")
        return False

    async def _poll(self) -> bool:
        """Refresh the rows from `muster.api.list` and the clusters' health; True when every
        job is finished."""
        reply = await self._api("list", {"limit": 1000}, quiet=True)
        if not reply or not reply.get("ok"):
            return False
        for view in reply.get("result") or []:
            row = self.rows.get(view["job_id"])
            if row is None:
                continue
            row.state = view["state"]
            row.attempt = view.get("attempt", 0)
            row.preemptions = view.get("accounting", {}).get("preemptions", 0)
            if view.get("cluster"):
                row.cluster, row.flavor = view["cluster"], view.get("flavor")
            row.step = self._step_of(row, view)
        clusters = await self._api("clusters", {}, timeout=1.0, quiet=True)
        if clusters and clusters.get("ok"):
            by_name = {c["name"]: c for c in clusters.get("result") or []}
            assert self.fleet is not None
            for crow in self.clusters:
                c = by_name.get(crow.name, {})
                crow.health = c.get("health", "lost")
                crow.partitioned = self.fleet[crow.name].partitioned
                crow.pools = [
                    f"{f['name']} {f.get('gpu_free', 0)}/{f.get('gpu_total', 0)} GPUs free"
                    for f in c.get("flavors", [])
                ]
        return bool(self.rows) and all(r.state in TERMINAL_STATES for r in self.rows.values())

    def _step_of(self, row: JobRow, view: dict[str, Any]) -> int:
        """The live step from the fake cluster; else where the job would resume."""
        if row.state == "succeeded":
            return row.total_steps
        live = self._live_workload(row.job_id)
        if live is not None and live[1] == row.attempt and row.state in LIVE_STATES:
            return live[2]
        ckpt = view.get("latest_checkpoint") or {}
        return int(ckpt.get("step", 0))

    def _live_workload(self, job_id: str) -> tuple[str, int, int, str] | None:
        """(cluster, attempt, step, phase) of the newest live copy of a job in the fleet."""
        assert self.fleet is not None
        best: tuple[str, int, int, str] | None = None
        for name, cluster in self.fleet.clusters.items():
            for jid, attempt in cluster.live_workloads():
                if jid != job_id or (best is not None and attempt < best[1]):
                    continue
                status = cluster.workload(jid, attempt)
                if status is not None:
                    best = (name, attempt, status.step or 0, status.phase)
        return best

    def _draw(self) -> None:
        if self.live is None:
            return
        rows = list(self.rows.values())
        self.live.update(live_view(rows, self.clusters, self.flavors, self.elapsed()), refresh=True)

    def _plain_progress(self) -> None:
        parts = [
            f"{r.name} {r.state} {100 * r.step // max(1, r.total_steps)}%"
            for r in self.rows.values()
        ]
        self.say(Text(f"[{self.elapsed():5.1f}s] progress: " + ", ".join(parts), style="dim"))

    # -- trouble ---------------------------------------------------------------------------
    def _maybe_inject(self, trouble: scenario.Trouble, submitted: float) -> bool:
        """Inject once the target runs far enough; True when done (or no longer possible)."""
        assert self.fleet is not None
        row = next((r for r in self.rows.values() if r.name == trouble.job), None)
        if row is None:
            return True
        if row.state in TERMINAL_STATES:
            self.note(f"{trouble.kind} under {row.job_id} skipped: the job already finished")
            return True
        if self.elapsed() - submitted < trouble.not_before or row.state != "running":
            return False
        live = self._live_workload(row.job_id)
        if live is None:
            return False
        cluster_name, attempt, step, phase = live
        if phase != "running" or attempt != row.attempt or cluster_name != row.cluster:
            return False
        if step < trouble.fraction * row.total_steps:
            return False
        cluster = self.fleet[cluster_name]
        status = cluster.workload(row.job_id, attempt)
        nodes = [
            n
            for n in (status.nodes if status else [])
            if (info := cluster.node_info(n)) is not None and info.flavor == row.flavor
        ]
        node = self.rng.choice(sorted(nodes)) if nodes else None
        where = f"{row.job_id} (attempt {attempt}, step {step})"
        label = flavor_label(self.flavors, cluster_name, row.flavor)
        if trouble.kind == "spot-notice":
            if node is None:
                return False
            cluster.spot_notice(node, lead_s=scenario.SPOT_LEAD_S)
            lead = scenario.SPOT_LEAD_S / scenario.TIME_SCALE
            self.note(
                f"spot notice: {cluster_name} will reclaim {label} node {node} in {lead:g} s; "
                f"it hosts {where}"
            )
        elif trouble.kind == "gpu-failure":
            if node is None:
                return False
            cluster.fail_gpu(node, count=1, xid=79)
            self.note(
                f"GPU failure: XID 79 (GPU fell off the bus) on node {node} of {cluster_name}, "
                f"under {where}; no warning this time"
            )
        else:
            cluster.outage(True)
            self._heal_at[cluster_name] = time.monotonic() + trouble.heal_after
            self.note(
                f"cluster outage: {cluster_name} drops off the network (its agent goes silent, "
                f"its pods keep running); it hosts {where}"
            )
        self.result.injections.append(
            Injection(trouble.kind, row.job_id, cluster_name, node, self.elapsed(), attempt, step)
        )
        return True

    def _maybe_heal(self) -> None:
        assert self.fleet is not None
        for name, at in list(self._heal_at.items()):
            if time.monotonic() >= at:
                del self._heal_at[name]
                self.fleet[name].outage(False)
                self.note(f"{name} is back on the network: its agent resends a full snapshot")

    # -- report ----------------------------------------------------------------------------
    async def _report(self, job_ids: list[str], finished: bool) -> None:
        if not finished:
            self.say(Text("Deadline reached: cancelling the jobs still going", style="bold red"))
            for job_id in job_ids:
                if self.rows[job_id].state not in TERMINAL_STATES:
                    await self._api("cancel", {"job_id": job_id, "reason": "demo deadline"})
        await asyncio.sleep(0.3)  # let the last events print before the summary
        for job_id in job_ids:
            reply = await self._api("get", {"job_id": job_id})
            if reply and reply.get("ok"):
                self.result.views[job_id] = reply["result"]
        assert self.fleet is not None
        self.result.histories = {j: self.fleet.history(j) for j in job_ids}
        views = [self.result.views[j] for j in job_ids if j in self.result.views]
        self.say()
        self.say(summary_table(views))
        self.say()
        self.say(Text("What you just saw", style="bold"))
        self.console.print(self._explain(), highlight=False, soft_wrap=False)
        ok = len(views) == len(job_ids) and all(v["state"] == "succeeded" for v in views)
        twice = {j: n for j, n in self.result.max_live_copies.items() if n > 1}
        if twice:
            self.say(Text(f"BUG: jobs seen with two live copies: {twice}", style="bold red"))
        verdict = "every job succeeded" if ok else "some jobs did not succeed"
        self.say(Text(f"\n{verdict} in {self.elapsed():.1f} s", style="bold"))
        self.result.exit_code = 0 if ok and not twice else 1

    def _explain(self) -> str:
        """One paragraph, built from what actually happened in this run."""
        sentences = [
            "Every job was admitted whole (all replicas at once, gang admission) onto one "
            "cluster and one flavor, chosen by its capacity preference and then by expected "
            "cost: spot jobs on the cheapest spot pool, prod jobs on on-demand."
        ]
        for inj in self.result.injections:
            view = self.result.views.get(inj.job_id, {})
            attempts = view.get("attempts", [])
            nxt = next((a for a in attempts if a["attempt"] == inj.attempt + 1), None)
            if nxt is None:
                continue
            where = (
                f"{nxt['cluster']} ({flavor_label(self.flavors, nxt['cluster'], nxt['flavor'])})"
            )
            resume = nxt.get("resume_from_step") or 0
            started = self._event_time(inj.job_id, "admitted", inj.attempt + 1)
            delay = "" if started is None else f" {_duration(started - inj.at)} later"
            old = next(
                (r for r in self.result.histories.get(inj.job_id, []) if r.attempt == inj.attempt),
                None,
            )
            # The table's measure, from the same record: GPU-seconds of the ended attempt's
            # work since its last checkpoint.
            ended: dict[str, Any] = next((a for a in attempts if a["attempt"] == inj.attempt), {})
            lost = f"{float(ended.get('gpu_seconds_lost', 0.0)):,.0f} GPU-seconds"
            if inj.kind == "spot-notice":
                sentences.append(
                    f"When the spot notice hit {inj.job_id}, Muster asked it to checkpoint, "
                    f"reserved a placement elsewhere at once (make-before-break) and{delay} "
                    f"started attempt {nxt['attempt']} on {where} from step {resume}, before "
                    f"the node was even gone: it lost {lost}, the work done after the "
                    "checkpoint it resumed from."
                )
            elif inj.kind == "gpu-failure":
                sentences.append(
                    f"The XID failure gave {inj.job_id} no warning: the attempt ended at once "
                    f"and{delay} restarted on {where} from its last periodic checkpoint "
                    f"(step {resume}), losing {lost} of work done since then."
                )
            else:
                stale = ""
                if old is not None and old.end_phase == "cancelled":
                    stale = (
                        f"the stale copy still running there (at step {old.last_step}, work "
                        "nobody would keep) was cancelled, fenced by its attempt number, and "
                    )
                sentences.append(
                    f"When {inj.cluster} went silent the broker declared it lost after "
                    f"{scenario.broker_config().timeouts.lost_after_s:g} s (MultiKueue waits "
                    f"15 minutes) and requeued {inj.job_id}; when the cluster came back, "
                    f"{stale}the job resumed on {where} from its checkpoint at step {resume}."
                )
        copies = max(self.result.max_live_copies.values(), default=0)
        if copies <= 1:
            sentences.append(
                "Throughout, the demo checked the fake clusters many times a second: no job ever "
                "had two live copies."
            )
        sentences.append(
            "Work lost, in the table and above, is one measure: the GPU-seconds each ended "
            "attempt ran after the checkpoint the next attempt resumed from; goodput is the "
            "useful share. Next: README.md, docs/architecture.md, and "
            "`muster --help` to do the same against your own NATS."
        )
        return " ".join(sentences)

    def _event_time(self, job_id: str, kind: str, attempt: int) -> float | None:
        for e in self.events.get(job_id, []):
            if e.kind == kind and e.attempt == attempt:
                return e.at - self.t0_wall
        return None


# -- helpers -----------------------------------------------------------------------------------


async def _connect(url: str, name: str, errors: list[str]) -> Client:
    async def on_error(exc: Exception) -> None:
        errors.append(f"{name}: {type(exc).__name__}: {exc}")

    return await nats.connect(
        url, name=name, connect_timeout=5, max_reconnect_attempts=3, error_cb=on_error
    )


async def _bounded(aw: Awaitable[Any], timeout: float, what: str) -> None:
    try:
        await asyncio.wait_for(aw, timeout)
    except TimeoutError:
        raise RuntimeError(f"{what} in {timeout:g} s") from None


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


def _describe(spec: dict[str, Any]) -> str:
    """'master x1 + worker x3 (8 GPU) · A100 · spot-then-on-demand · 3000 steps'"""
    gang = " + ".join(
        f"{p['name']}{TIMES}{p['replicas']}" + (f" ({p['gpu']} GPU)" if p.get("gpu") else "")
        for p in spec["gang"]
    )
    steps = spec["workload"]["simulate"]["total_steps"]
    types = "/".join(spec["gpu_types"])
    return f"{spec['name']}: {gang} · {types} · {spec['capacity']} · {steps} steps"


@contextlib.contextmanager
def _quiet_logs() -> Any:
    """The broker and agents log for operators; the demo tells its own story. Errors still
    reach stderr. The previous structlog configuration is restored afterwards."""
    old = structlog.get_config()
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    try:
        yield
    finally:
        structlog.configure(**old)


async def run_demo(options: DemoOptions, console: Console | None = None) -> DemoResult:
    """The whole demo; the test calls this in-process."""
    console = console or make_console()
    with _quiet_logs():
        async with asyncio.timeout(HARD_CAP_S):
            return await Demo(options, console).run()


def make_console() -> Console:
    """Rich output; without a terminal, no colours and a width wide enough for the tables."""
    if sys.stdout.isatty() or "COLUMNS" in os.environ:
        return Console()
    return Console(width=120)


app = program()


@app.command(help=summary(__doc__))
def demo(
    fast: Annotated[bool, typer.Option("--fast", help="fewer, shorter jobs (~20 s)")] = False,
    seed: Annotated[int, typer.Option(help="job lengths and injection nodes")] = 7,
    no_live: Annotated[
        bool, typer.Option("--no-live", help="plain log lines, no live table")
    ] = False,
) -> None:
    raise typer.Exit(_run(DemoOptions(fast=fast, seed=seed, live=False if no_live else None)))


def _run(options: DemoOptions) -> int:
    console = make_console()
    try:
        result = asyncio.run(run_demo(options, console))
    except KeyboardInterrupt:
        console.print("interrupted")
        return 130
    except (RuntimeError, TimeoutError) as exc:
        console.print(Text(f"demo failed: {exc}", style="bold red"))
        return 1
    for error in result.errors:
        console.print(Text(f"note: {error}", style="yellow"))
    return result.exit_code


if __name__ == "__main__":
    app(prog_name="python -m load.demo")
