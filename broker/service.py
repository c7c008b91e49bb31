"""The broker process: the pure core behind NATS.

Everything that touches the machine runs on the event loop between awaits, so the machine is
never entered twice at once. `Broker` composes the broker's duties, each in a module of its
own: the process (`broker/process.py`: lease, leadership, restore, start and stop), the effect
executor (`broker/executor.py`), the submission intake (`broker/intakeloop.py`) and the agent
link (`broker/agentio.py`), over the state they share (`broker/fields.py`). What stays here is
the API, the storage probe, the clock loop that paces admission cycles, and `run_broker`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec
import nats
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg

from broker import api as broker_api
from broker import tenancy
from broker.agentio import AgentLink
from broker.core.effects import Effect, dispatches
from broker.core.inputs import CYCLE, TICK
from broker.core.machine import Machine
from broker.embedded import EmbeddedNats, free_port
from broker.executor import EffectExecutor, _storage_full
from broker.intakeloop import SubmissionIntake
from broker.pacing import cycle_due, next_cycle_at
from broker.process import BrokerProcess
from schemas import healthz
from schemas.codec import encode_json
from schemas.config import BrokerConfig, Replication
from schemas.natsopts import NatsOptions
from shell.gcpacing import paused
from shell.natsstate import NatsStateLog

log = structlog.get_logger("muster.broker")

TICK_MIN_INTERVAL_S = 0.05
STORAGE_PROBE_S = 1.0


class Broker(BrokerProcess, EffectExecutor, SubmissionIntake, AgentLink):
    """One broker: its duties composed over their shared state (`broker/fields.py`)."""

    @property
    def storage_full(self) -> bool:
        # A lease suspended by a full server store counts too: the stream cannot store.
        suspended = self.leading.is_set() and not self.lease.proven.is_set()
        return self._persist_full or self._probe_full or suspended

    def _storage_error(self) -> str | None:
        if not self.storage_full:
            return None
        self.stats["storage_full_rejections"] += 1
        self.stats["rejected"] += 1
        if not self.lease.proven.is_set() and self.lease.suspended_for == "no-leader":
            return (
                "unavailable: JetStream is electing a leader for the broker's lease (a NATS "
                "server failover); retry in a few seconds with the same job_id"
            )
        return (
            "storage full: the broker cannot persist new jobs (the JetStream store or the job "
            "bucket is full); retry later. Operators: free or grow JetStream storage "
            "(see docs/operations.md, Limits and storage)"
        )

    async def _probe_storage(self) -> None:
        """Once a second, a tiny write to the job bucket (a delete marker under a key no job
        can have) tells whether the store takes writes: a full store is noticed before a job
        is lost to it, and submissions are refused with the reason instead of going
        unanswered (the submission stream cannot store them either)."""
        store = self.store
        assert store is not None
        for _ in range(10**9):
            try:
                async with asyncio.timeout(5.0):
                    await store.probe()
                self._probe_full = False
            except Exception as exc:
                if _storage_full(str(exc)):
                    if not self._probe_full:
                        log.error("broker.storage_full", error=str(exc), probe=True)
                    self._probe_full = True
            await asyncio.sleep(STORAGE_PROBE_S)

    async def _on_api(self, msg: Msg) -> None:
        machine = self.machine
        if machine is None or not msg.reply:
            return
        if not tenancy.reply_allowed(msg.reply, self._rendezvous.own_inbox):
            self.refused["api"] += 1  # a reply that is no inbox: the broker answers nobody
            return
        team, verb = tenancy.split_api_subject(self.subjects.prefix, msg.subject)
        if team is not None and verb == "logs":
            owned = self._team_queues.get(team, frozenset())
            routed = tenancy.forward_logs(team, owned, machine, self.subjects, msg.data)
            if isinstance(routed, bytes):
                await msg.respond(routed)
            else:  # the agent streams to the team's inbox; only the check is the broker's
                await self.nc.publish(routed[0], routed[1], reply=msg.reply)
            return
        if verb == "stats" and team is None:
            await msg.respond(encode_json(self.snapshot_stats()))
            return
        try:
            if team is None:
                payload, effects = broker_api.handle(machine, verb, msg.data, self.clock())
            else:
                owned = self._team_queues.get(team, frozenset())
                payload, effects = tenancy.handle_as(
                    team, owned, machine, verb, msg.data, self.clock()
                )
        except Exception as exc:  # the handler boundary: answer with the reason
            self.refused["api"] += 1
            log.warning("broker.api_failed", verb=verb, error=repr(exc)[:300])
            error = f"request could not be processed: {type(exc).__name__}: {exc}"
            with contextlib.suppress(Exception):
                await msg.respond(encode_json({"ok": False, "error": error[:1000]}))
            return
        if effects:
            fut = self._push(effects, wait=True)
            if fut is not None:
                await fut
        await msg.respond(payload)

    def _team_of_job(self, job_id: str) -> str | None:
        record = self.machine.jobs.get(job_id) if self.machine is not None else None
        return self._team_of_queue.get(record.queue) if record is not None else None

    def snapshot_stats(self) -> dict[str, Any]:
        """Counters for operators and benchmarks (`muster.api.stats`)."""
        machine = self.machine
        return {
            **self.stats,
            "refused": dict(self.refused),
            "storage_full": self.storage_full,
            "lease_renew_failures": self.lease.renew_failures,
            "lease_recreated": self.lease.recreated,
            "lease_taken_from_dead": self.lease.taken_from_dead,
            "lease_suspended": not self.lease.proven.is_set(),
            "epoch": self.lease.epoch,
            # of the job bucket, by this leadership's writer processes (broker/snapshotwriter.py)
            "snapshots_written": self.snapshots.written if self.snapshots else 0,
            "snapshots_failed": self.snapshots.failed if self.snapshots else 0,
            "snapshot_seq": self.snapshots.last_seq if self.snapshots else 0,
            "restore_s": round(self.restore_s, 4),
            "restored_jobs": self.restored_jobs,
            "jobs": len(machine.jobs) if machine else 0,
            "pending": machine.views.pending_count() if machine else 0,
            "live": machine.views.live_count() if machine else 0,
            "clusters": len(machine.agents) if machine else 0,
            # asyncio or uvloop (`--event-loop`): which one a benchmark measured
            "event_loop": type(asyncio.get_running_loop()).__module__.split(".")[0],
        }

    async def _clock_loop(self) -> None:
        """Timers and admission cycles: wakes on input, at least every 100 ms.

        A cycle has a fixed cost (a snapshot, the queues' turns, the heads of a deep backlog)
        that can dwarf one job's. So after a cycle the next one waits CYCLE_GAP_FACTOR times
        as long as it took (at most CYCLE_MAX_GAP_S; after a cycle that admitted a job,
        ADMITTING_GAP_FACTOR times; broker/pacing.py): under a stream of submissions the
        inputs of a few ms are admitted together, while a small or idle broker still admits at
        once. Timers are checked at most every TICK_MIN_INTERVAL_S."""
        loop = asyncio.get_running_loop()
        next_tick = 0.0
        while True:
            machine = self.machine
            if machine is None:
                return
            wait = 0.1
            if machine.wants_cycle:  # a cycle is deferred: come back when it is due
                wait = min(wait, self._next_cycle - loop.time())
            if wait > 0 and not self._wake.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):  # no Task per wait, unlike wait_for
                        await self._wake.wait()
            self._wake.clear()
            started = loop.time()
            machine = self.machine
            if machine is None:
                return
            effects: list[Effect] = []
            if started >= next_tick:
                # Timers (start timeouts, preemption deadlines, backoff, silent agents) are
                # seconds long and were only ever checked every 100 ms when idle; checking
                # them on every wake cost a scan of every starting job each time.
                effects = machine.handle(TICK, self.clock())
                next_tick = started + TICK_MIN_INTERVAL_S
            effects.extend(self._cycle_if_due(machine))
            self._push(effects)
            for (cluster, flavor), state, cause in machine.lifecycle.health.drain_changes():
                log.warning(
                    "broker.dispatch_breaker",
                    cluster=cluster,
                    flavor=flavor,
                    state=state,
                    cause=cause,
                )
            if self._gc is not None:
                self._gc.tick(time.monotonic())
            await asyncio.sleep(0)

    def _cycle_if_due(self, machine: Machine) -> list[Effect]:
        """One admission cycle, unless the pause after the last one is not over (the clock
        loop then comes back when it is)."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        if not cycle_due(started, self._next_cycle, machine.wants_cycle):
            return []
        # No collector pass inside a cycle when the process's collector is ours (gcpacing.py)
        with paused() if self._gc is not None else contextlib.nullcontext():
            effects = machine.handle(CYCLE, self.clock())
        self._next_cycle = next_cycle_at(started, loop.time(), bool(dispatches(effects)))
        return effects


# ---------------------------------------------------------------------- process entry
async def connect(opts: NatsOptions, name: str) -> Client:
    kwargs = opts.connect_kwargs()
    kwargs.setdefault("name", name)
    state = NatsStateLog(
        log,
        opts.url,
        "is nats-server running there? Without --nats, `muster broker` starts its own",
    )
    nc = await nats.connect(**kwargs, **state.callbacks())
    state.connected(nc)
    return nc


def _preferred_port(port: int = 4222) -> int:
    """The embedded NATS port: 4222 ($MUSTER_NATS_PORT), unless a live socket holds it.

    The probe binds with SO_REUSEADDR, as nats-server's own listener does: connections of the
    previous run left in TIME_WAIT must not move a restarted broker to a random port, which
    would strand every agent still dialling the old URL."""
    port = int(os.environ.get("MUSTER_NATS_PORT", port))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return port
        except OSError:
            log.warning("nats port taken; using a free one", port=port)
            return free_port()


def _lock_state_dir(state_dir: Path) -> Any:
    """One broker per state directory: its identity (and so its lease) lives there."""
    import fcntl

    handle = (state_dir / "broker.lock").open("w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise SystemExit(
            f"another muster broker is using {state_dir}; give each broker its own --state-dir"
        ) from None
    return handle


def _broker_identity(state_dir: Path) -> str:
    """A stable name for this broker, so a restart reclaims its own lease at once."""
    path = state_dir / "broker-id"
    if not path.exists():
        path.write_text(f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}\n")
    return path.read_text().strip()


async def run_broker(
    *,
    config: BrokerConfig,
    nats: NatsOptions | None,
    state_dir: Path,
    holder: str | None = None,
    metrics_port: int | None = None,
    ui_port: int | None = None,
    ui_host: str = "127.0.0.1",
) -> None:
    """`muster broker`: with no NATS options, start an embedded nats-server first."""
    state_dir.mkdir(parents=True, exist_ok=True)
    lock = _lock_state_dir(state_dir)
    holder = holder or _broker_identity(state_dir)
    embedded: EmbeddedNats | None = None
    if nats is None:
        embedded = EmbeddedNats(store_dir=state_dir / "nats", port=_preferred_port())
        await embedded.start()
        (state_dir / "nats.url").write_text(embedded.url + "\n")
        print(
            f"muster: embedded NATS at {embedded.url} (agents and clients: --nats {embedded.url})"
        )
        nats = NatsOptions(url=embedded.url)
        # One server holds one copy: more replicas could never be placed.
        config = msgspec.structs.replace(config, replication=Replication())
    nc = await connect(nats, "muster-broker")
    agent_nc = await connect(nats, "muster-broker-agents")
    broker = Broker(config, nc, holder=holder, pace_gc=True, agent_nc=agent_nc, nats_options=nats)
    if metrics_port is not None:
        broker.metrics.serve(metrics_port)
    health_port = healthz.port_from_env()
    health = await healthz.serve(health_port, lambda: nc.is_connected) if health_port else None
    dashboard = None
    if ui_port is not None:
        from broker.ui.server import start_dashboard

        dashboard = await start_dashboard(broker, ui_host, ui_port)
        print(f"muster: dashboard at {dashboard.url} (read-only; put it behind your auth)")
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, broker.stopped.set)
    try:
        await broker.run()
    finally:
        if health is not None:
            health.close()
        if dashboard is not None:
            await dashboard.stop()
        for conn in (agent_nc, nc):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.drain(), 5)
        if embedded is not None:
            await embedded.stop()
            with contextlib.suppress(FileNotFoundError):
                (state_dir / "nats.url").unlink()
        lock.close()
