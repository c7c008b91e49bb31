"""The agent runtime: the same NATS side for every backend (kube, fake).

It owns what must be identical everywhere: batching and per-instance sequence numbers on the
events subject, heartbeats, full snapshots (first batch, on resync, after a reconnect), epoch
fencing and idempotency on (job_id, attempt) for commands. A backend only reports deltas
through `emit` and carries out vetted commands.

Several runtimes may share one NATS connection (a fleet of fake clusters in one process), so
the runtime never installs connection callbacks itself: whoever owns the connection calls
`on_reconnected()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
import uuid
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any, Protocol, cast

import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg

from agents.backend import (
    Backend,
    BackendError,
    CannotResize,
    ClusterFencing,
    Fencing,
    JobRefused,
    Resizing,
)
from agents.gate import CommandGate, Duplicate, Refuse, Resize
from agents.logs import LogServer
from agents.nodeops import NodeOpServer
from schemas.agent import (
    TERMINAL_PHASES,
    AgentEvent,
    Applied,
    Cancel,
    CheckpointNow,
    CheckpointReport,
    ClusterSnapshot,
    CommandAck,
    Dispatch,
    DispatchAcks,
    DispatchBatch,
    EventBatch,
    FlavorInfo,
    Heartbeat,
    Provision,
    ProvisionPool,
    Resync,
    WireRefused,
    WorkloadStatus,
)
from schemas.codec import DecodeError, decode_command, encode_msgpack
from schemas.subjects import DEFAULT_SUBJECTS, Subjects
from schemas.wire import WIRE_VERSION
from shell.natsio import flush
from shell.tasks import Shared, cancel_and_wait

MAX_ERROR_CHARS = 1000  # CommandAck.error is capped at 1024 by the schema
STOP_TIMEOUT_S = 5.0
RETRY_S = 0.2  # pause after a failed publish/snapshot so a dead connection cannot spin us
# A job command that arrives before the first snapshot is learnt waits at most this long (under
# the broker's first ack wait, `timeouts.dispatch_ack_s`, 2 s by default), then is refused.
HOLD_MAX_S = 1.5
# Outcomes (endings, checkpoints) kept until the broker says they are persisted. Past the cap
# the oldest are dropped, loudly: a broker away that long has bigger problems.
MAX_OUTBOX = 100_000
OUTBOX_RESEND_S = 5.0  # unacknowledged this long: resend them all in a snapshot
SENT_TIMES_KEPT = 4096  # send times of recent batches, for fencing
# The Cancels of other jobs still under way when a Dispatch arrived, with their jobs (set in the
# Dispatch's own task): it waits for them, at most CANCEL_WAIT_S, before it takes nodes, so the
# nodes a Cancel frees (a preemption's victim's) are free by then. Commands of different jobs
# run concurrently, and a Dispatch reached the backend before the Cancel that arrived first
# (the fake backend refused it as over-committed, and the preemption went round again). The
# bound keeps a slow Cancel from holding Dispatches for long, and any wait from closing a cycle.
CANCELS_BEFORE: ContextVar[tuple[tuple[asyncio.Task[None], str], ...]] = ContextVar(
    "cancels_before", default=()
)
CANCEL_WAIT_S = 5.0


def _outbox_key(ev: AgentEvent) -> tuple[str, int, bool] | None:
    """Outcomes kept until acknowledged: one ending and the newest checkpoint per attempt."""
    if isinstance(ev, CheckpointReport):
        return (ev.job_id, ev.attempt, True)
    if isinstance(ev, WorkloadStatus) and ev.phase in TERMINAL_PHASES:
        return (ev.job_id, ev.attempt, False)
    return None


def _with_pools(snap: ClusterSnapshot, pools: Mapping[str, ProvisionPool]) -> ClusterSnapshot:
    """The snapshot with each declared pool on its flavor (`FlavorInfo.provision`)."""
    flavors: list[FlavorInfo] = [
        msgspec.structs.replace(f, provision=pools[f.name]) if f.name in pools else f
        for f in snap.flavors
    ]
    return msgspec.structs.replace(snap, flavors=flavors)


def _essential(ev: AgentEvent) -> bool:
    """Events a snapshot does not replace: checkpoints and workload endings (a finished
    workload is no longer in the snapshot, so its ending must still be told)."""
    if isinstance(ev, CheckpointReport):
        return True
    return isinstance(ev, WorkloadStatus) and ev.phase in TERMINAL_PHASES


def heartbeat_phase(cluster: str) -> float:
    """Where in the heartbeat period a cluster's agent beats, in (0, 1]: fixed per cluster
    (a hash of its name, so seeded and the same after a restart) and spread across clusters."""
    digest = hashlib.blake2b(cluster.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") % 1000 + 1) / 1000


class Companion(Protocol):
    """Something beside the backend that speaks on the runtime's connection (the kube front
    door): started once the backend is up, stopped before it."""

    async def start(self, nc: Client) -> None: ...

    async def stop(self) -> None: ...


class AgentRuntime:
    """Connects one Backend to the broker over NATS (see module docstring)."""

    def __init__(
        self,
        backend: Backend,
        nc: Client,
        *,
        subjects: Subjects = DEFAULT_SUBJECTS,
        heartbeat_s: float = 1.0,
        batch_max: int = 1000,
        batch_interval_s: float = 0.01,
        companion: Companion | None = None,
        pools: Mapping[str, ProvisionPool] | None = None,
    ) -> None:
        if heartbeat_s <= 0 or batch_max < 1 or batch_interval_s < 0:
            raise ValueError("heartbeat_s > 0, batch_max >= 1 and batch_interval_s >= 0 required")
        self.backend = backend
        # The fences the backend keeps, found once: an isinstance of a runtime-checkable
        # Protocol walks its members on every call, and fences are extended on every Dispatch
        # and every Applied.
        self._fencing: Fencing | None = backend if isinstance(backend, Fencing) else None
        self._cluster_fencing: ClusterFencing | None = (
            backend if isinstance(backend, ClusterFencing) else None
        )
        self.companion = companion
        # flavor -> the autoscaled pool behind it, reported in every snapshot's flavors
        self.pools: dict[str, ProvisionPool] = dict(pools or {})
        # Flavors whose pool the backend reads from the cluster (kube: Karpenter NodePools),
        # as its last snapshot reported them.
        self.read_pools: set[str] = set()
        self.nc = nc
        self.subjects = subjects
        self.cluster = backend.cluster
        self.heartbeat_s = heartbeat_s
        self.batch_max = batch_max
        self.batch_interval_s = batch_interval_s
        self.events_subject = subjects.agent_events(self.cluster)
        self.cmd_subject = subjects.agent_cmd(self.cluster)
        self.instance = ""
        self.seq = 0
        self.partitioned = False
        self._fence_failing = False  # the cluster's fence could not be renewed lately
        self.stats: dict[str, int] = {
            "batches": 0,
            "events": 0,
            "snapshots": 0,
            "commands": 0,
            "refused": 0,
            "errors": 0,
            "cancels_joined": 0,  # copies of a Cancel answered by the copy already under way
            "late_dispatches": 0,  # Dispatches refused: read after the fence lapsed (gate.py)
        }
        self.log = structlog.get_logger("muster.agent").bind(cluster=self.cluster)
        self.gate = CommandGate()
        # seq -> unix time the batch left: an Applied(seq) proves the broker heard from us then.
        self._sent_at: dict[int, float] = {}
        # key -> (event, seq of the batch that last carried it, 0 = not sent yet, sent at)
        self._outbox: dict[tuple[str, int, bool], tuple[AgentEvent, int, float]] = {}
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}
        # Cancels under way by (job, attempt, epoch): a resent copy waits for that one's answer
        self._cancelling: Shared[tuple[str, int | None, int], CommandAck] = Shared()
        self._queue: list[AgentEvent] = []
        self._first_at = 0.0
        self._snapshot_pending = False
        self._next_heartbeat = 0.0
        self._retry_at = 0.0  # after a failed publish or snapshot, wait before retrying
        self._wake = asyncio.Event()
        # Set once a snapshot of this start has been learnt: until then the gate does not know
        # the attempts already in the cluster, and a revision would look like a new dispatch.
        self._learnt = asyncio.Event()
        self._flush_lock = asyncio.Lock()
        self._sub: Any = None
        self._loop_task: asyncio.Task[None] | None = None
        self._cmd_tasks: set[asyncio.Task[None]] = set()
        # Cancels under way -> their job (CANCELS_BEFORE)
        self._cancel_tasks: dict[asyncio.Task[None], str] = {}
        self._running = False
        self._last_contact = time.monotonic()  # last proven round trip to the NATS server
        self._probing = False
        self._next_probe = 0.0

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        """New instance id, seq from 1; starts the backend, subscribes to commands, then
        publishes the first batch (a full snapshot) before returning. Job commands that
        arrive before that snapshot is learnt are held until it is (`_when_learnt`)."""
        if self._running:
            return
        self.instance = uuid.uuid4().hex[:16]
        self.seq = 0
        self.gate.started(time.time())  # no batch of this instance acknowledged yet
        self._queue = []
        self._snapshot_pending = True
        self._learnt.clear()
        self._running = True
        self.log = self.log.bind(instance=self.instance)
        await self.backend.start(self._emit)
        self._sub = await self.nc.subscribe(self.cmd_subject, cb=self._on_msg)
        self._logs = LogServer(
            self.nc, self.subjects.agent_logs(self.cluster), self.cluster, self.backend
        )
        await self._logs.start()
        self._nodeops = NodeOpServer(
            self.nc, self.subjects.agent_nodeops(self.cluster), self.cluster, self.backend
        )
        await self._nodeops.start()
        with contextlib.suppress(Exception):  # the server knows the subscription before we speak
            await flush(self.nc, timeout=2)
        self._last_contact = time.monotonic()
        self._queue_heartbeat()
        await self._flush()
        # The next heartbeat at this cluster's own phase of the period: agents started
        # together (a fleet's rollout, a fake fleet in one process) would otherwise beat, and
        # be acknowledged, and extend every fence, all in the same few milliseconds.
        self._next_heartbeat = time.monotonic() + self.heartbeat_s * heartbeat_phase(self.cluster)
        self._loop_task = asyncio.create_task(self._loop(), name=f"agent-{self.cluster}")
        if self.companion is not None:
            await self.companion.start(self.nc)
        self.log.info("agent started", events=self.events_subject, commands=self.cmd_subject)

    async def stop(self) -> None:
        """Stop answering, flush what is queued (best effort), then stop the backend."""
        if not self._running:
            return
        self._running = False
        if self.companion is not None:
            await self.companion.stop()
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None
        await self._logs.stop()
        await self._nodeops.stop()
        task, self._loop_task = self._loop_task, None
        await cancel_and_wait(task)
        if self._cmd_tasks:
            await asyncio.wait(set(self._cmd_tasks), timeout=STOP_TIMEOUT_S)
        if self._queue and not self.partitioned and self.nc.is_connected:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(STOP_TIMEOUT_S):
                    await self._flush()
        with contextlib.suppress(Exception):
            await self.backend.stop()
        self.log.info("agent stopped", seq=self.seq)

    async def on_reconnected(self) -> None:
        """Wire to nats-py's reconnected_cb: the broker may have missed anything, so the next
        batch is a full snapshot with every workload (the broker reconciles stale attempts)."""
        self.log.info("reconnected; resending snapshot")
        self._last_contact = time.monotonic()
        self.request_snapshot()

    def request_snapshot(self) -> None:
        """Send a full ClusterSnapshot in the next batch."""
        self._snapshot_pending = True
        self._wake.set()

    @property
    def queue_size(self) -> int:
        """Events waiting to be published (exported as a metric)."""
        return len(self._queue)

    def set_partitioned(self, on: bool) -> None:
        """Simulate a network partition (fake outages): no events, heartbeats or replies
        while on; on heal, behave as after a reconnect."""
        self.partitioned = on
        self._snapshot_pending = True
        if not on:
            self._last_contact = time.monotonic()
            self.log.info("partition healed; resending snapshot")
        self._wake.set()

    # -- events --------------------------------------------------------------------------
    def _emit(self, ev: AgentEvent) -> None:
        """Given to the backend; never blocks. Deltas that a pending snapshot will cover are
        dropped at once, which also bounds memory while partitioned. A backend whose flavors
        changed (kube: a NodePool) emits a ClusterSnapshot: a full one goes in the next batch."""
        if isinstance(ev, ClusterSnapshot):
            self.request_snapshot()
            return
        if isinstance(ev, WorkloadStatus) and ev.phase in TERMINAL_PHASES:
            self.gate.ended(ev.job_id, ev.attempt)
        key = _outbox_key(ev)
        if key is not None:
            self._keep(key, ev)
        if self._snapshot_pending and not _essential(ev):
            return
        queue = self._queue
        queue.append(ev)
        n = len(queue)
        if n == 1:
            self._first_at = time.monotonic()
            self._wake.set()
        elif n >= self.batch_max:
            self._wake.set()
            if n >= 100 * self.batch_max:  # far behind (or partitioned): compact
                self._compact_queue()

    def _keep(self, key: tuple[str, int, bool], ev: AgentEvent) -> None:
        outbox = self._outbox
        old = outbox.pop(key, None)
        if (
            old is not None
            and isinstance(ev, CheckpointReport)
            and isinstance(old[0], CheckpointReport)
            and old[0].step > ev.step
        ):
            ev = old[0]
        outbox[key] = (ev, 0, 0.0)
        if len(outbox) > MAX_OUTBOX:
            dropped = next(iter(outbox))
            del outbox[dropped]
            self.stats["outbox_dropped"] = self.stats.get("outbox_dropped", 0) + 1
            self.log.error("outbox full; oldest unacknowledged outcome dropped", key=dropped)

    async def _on_applied(self, cmd: Applied) -> None:
        """The broker persisted every batch of this instance up to `cmd.seq`: forget those
        outcomes, and extend the fences of live attempts from the moment that batch left.
        The broker heard from this cluster no earlier, and declares it lost only
        `lost_after_s` after it last heard, so a fence of `fence_after_s` (shorter) from then
        has lapsed, by the cluster's own hand, before any second copy can start."""
        if cmd.instance != self.instance:
            return
        done = [k for k, (_, seq, _) in self._outbox.items() if 0 < seq <= cmd.seq]
        for key in done:
            del self._outbox[key]
        sent = self._sent_at.get(cmd.seq)
        if sent is not None:
            self.gate.heard(sent)
            await self._extend_fences(sent)

    async def _extend_fences(self, since: float, job_id: str | None = None) -> None:
        """Move the fences forward from `since`. A backend with one fence per cluster
        (`renew_fence`, kube: a Lease) gets one call, whatever the number of attempts."""
        cluster_fencing = self._cluster_fencing
        if cluster_fencing is not None:
            try:
                await cluster_fencing.renew_fence(since)
            except Exception as exc:
                self.stats["fence_failures"] = self.stats.get("fence_failures", 0) + 1
                if not self._fence_failing:  # one line per outage, not one per ack
                    self.log.warning("fence renewal failing; retried at every ack", error=str(exc))
                self._fence_failing = True
                return
            if self._fence_failing:
                self.log.warning("fence renewed again")
            self._fence_failing = False
            return
        backend = self._fencing
        if backend is None:
            return
        one = self.gate.get(job_id) if job_id is not None else None
        tracks = self.gate.tracks() if job_id is None else [(job_id, one)] if one else []
        failed = False
        for jid, track in tracks:
            for attempt in list(track.live):
                after = track.fence_after.get(attempt, 0.0)
                if after <= 0:
                    continue
                try:
                    await backend.fence(jid, attempt, since + after)
                except Exception as exc:
                    # the cluster may stop the attempt at its old fence: one line per outage
                    self.stats["fence_failures"] = self.stats.get("fence_failures", 0) + 1
                    if not self._fence_failing:
                        self.log.warning(
                            "fence extension failing; retried at every ack",
                            job_id=jid,
                            attempt=attempt,
                            until=since + after,
                            error=str(exc),
                        )
                    self._fence_failing = failed = True
        if self._fence_failing and not failed and job_id is None:
            self.log.warning("fence extended again")
            self._fence_failing = False

    def outbox_size(self) -> int:
        return len(self._outbox)

    def _compact_queue(self) -> None:
        """Replace deltas by a snapshot; keep endings and the newest checkpoint per attempt."""
        latest: dict[tuple[str, int], int] = {}
        for i, ev in enumerate(self._queue):
            if isinstance(ev, CheckpointReport):
                latest[(ev.job_id, ev.attempt)] = i
        keep = set(latest.values())
        self._queue = [
            ev
            for i, ev in enumerate(self._queue)
            if (isinstance(ev, WorkloadStatus) and ev.phase in TERMINAL_PHASES) or i in keep
        ]
        self._snapshot_pending = True
        self.log.warning("event queue compacted; a snapshot replaces dropped deltas")

    def _queue_heartbeat(self) -> None:
        stale = getattr(self.backend, "stale_s", None)  # a backend that can go stale says so
        self._queue.append(Heartbeat(at=time.time(), stale_s=stale() if stale else 0.0))
        if len(self._queue) == 1:
            self._first_at = time.monotonic()
        # On the cluster's own grid (see `start`): a beat made late by a busy moment does not
        # move the next ones, so agents held up together do not go on beating together.
        now, period = time.monotonic(), self.heartbeat_s
        due = self._next_heartbeat + period
        if due <= now:
            due += ((now - due) // period + 1) * period
        self._next_heartbeat = due

    def _next_due(self, now: float) -> float:
        if self.partitioned:
            return now + 1.0
        if self._snapshot_pending or len(self._queue) >= self.batch_max:
            return max(now, self._retry_at)
        due = self._next_heartbeat
        if self._queue:
            due = min(due, self._first_at + self.batch_interval_s)
        return max(due, self._retry_at)

    async def _loop(self) -> None:
        """The one flusher: wakes on the first queued event, on a full batch, on a snapshot
        request, and for heartbeats."""
        while self._running:
            try:
                delay = self._next_due(time.monotonic()) - time.monotonic()
                if delay > 0:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(delay):
                            await self._wake.wait()
                self._wake.clear()
                now = time.monotonic()
                await self._fence_if_cut_off(now)
                if self.partitioned or now < self._retry_at:
                    continue
                self._resend_overdue(now)
                beat = now >= self._next_heartbeat
                if beat:
                    self._queue_heartbeat()
                if (
                    beat
                    or self._snapshot_pending
                    or (
                        self._queue
                        and (
                            len(self._queue) >= self.batch_max
                            or now >= self._first_at + self.batch_interval_s
                        )
                    )
                ):
                    await self._flush()
            except asyncio.CancelledError:
                raise
            except Exception:
                self.stats["errors"] += 1
                self.log.exception("event loop error")
                await asyncio.sleep(0.1)

    def _resend_overdue(self, now: float) -> None:
        """Outcomes sent but unacknowledged for OUTBOX_RESEND_S (the broker was away, or lost
        the batch) go again, inside a snapshot, which a broker applies whatever its state."""
        for _, seq, sent_at in self._outbox.values():
            if seq > 0 and now - sent_at > OUTBOX_RESEND_S:
                self._snapshot_pending = True
                return

    async def _fence_if_cut_off(self, now: float) -> None:
        """Self-fencing. Cut off from NATS for `fence_after_s` (set per attempt by the broker,
        shorter than the time after which it declares this cluster lost and starts the job
        elsewhere), delete the attempt here, so a partition never leaves two live copies."""
        linked = not self.partitioned and self.nc.is_connected
        if linked and not self._probing and now >= self._next_probe:
            self._probing = True
            self._next_probe = now + max(0.5, self.heartbeat_s / 2)
            task = asyncio.create_task(self._probe())
            self._cmd_tasks.add(task)
            task.add_done_callback(self._cmd_tasks.discard)
        cut_for = now - self._last_contact
        if cut_for < 1.0:
            return
        for job_id, track in self.gate.tracks():
            for attempt in sorted(track.live):
                after = track.fence_after.get(attempt, 0.0)
                if after <= 0 or cut_for < after or self._cluster_fences(job_id, attempt):
                    continue
                reason = f"fenced: cut off from the broker for {cut_for:.0f}s"
                with contextlib.suppress(Exception):
                    await self.backend.cancel(job_id, attempt, reason)
                self.gate.fenced(job_id, attempt)
                self.stats["fenced"] = self.stats.get("fenced", 0) + 1
                self.log.warning("self-fenced", job_id=job_id, attempt=attempt, cut_for=cut_for)

    def _cluster_fences(self, job_id: str, attempt: int) -> bool:
        """A backend that keeps fences stops the workload itself, agent or not; one that
        does so only for some kinds (kube: batch Jobs) says which (`fences`)."""
        if self._cluster_fencing is not None:
            return self._cluster_fencing.fences(job_id, attempt)
        return self._fencing is not None

    async def _probe(self) -> None:
        """A PING/PONG round trip proves the link to the server is alive right now."""
        try:
            await flush(self.nc, timeout=max(1.0, self.heartbeat_s))
            if not self.partitioned:
                self._last_contact = time.monotonic()
        except Exception:
            pass
        finally:
            self._probing = False

    async def _flush(self) -> None:
        """Publish everything queued, a snapshot first when one is pending."""
        async with self._flush_lock:
            if self.partitioned:
                return
            events, self._queue = self._queue, []
            if self._snapshot_pending:
                self._snapshot_pending = False
                try:
                    snap = await self.backend.snapshot()
                except Exception as exc:
                    self.stats["errors"] += 1
                    self.log.exception("snapshot failed; retrying", error=str(exc))
                    self._snapshot_pending = True
                    self._queue = [e for e in events if _essential(e)] + self._queue
                    self._retry_at = time.monotonic() + RETRY_S
                    return
                self._learn(snap)
                if self.pools:
                    snap = _with_pools(snap, self.pools)
                queued = {_outbox_key(e) for e in events} - {None}
                unacked = [ev for key, (ev, _, _) in self._outbox.items() if key not in queued]
                events = self._around_snapshot(snap, unacked + events)
                post, self._queue = self._queue, []
                events.extend(post)
                self.stats["snapshots"] += 1
            for start in range(0, len(events), self.batch_max):
                chunk = events[start : start + self.batch_max]
                try:
                    await self._publish(chunk)
                except Exception as exc:
                    self.stats["errors"] += 1
                    self.log.warning("publish failed; will resend a snapshot", error=str(exc))
                    rest = [e for e in events[start:] if _essential(e)]
                    self._queue = rest + self._queue
                    self._snapshot_pending = True
                    self._retry_at = time.monotonic() + RETRY_S
                    return

    @staticmethod
    def _around_snapshot(snap: ClusterSnapshot, queued: list[AgentEvent]) -> list[AgentEvent]:
        """Place what the snapshot does not replace so the broker cannot misread it.

        The broker treats a live attempt missing from a snapshot as lost, and skips events
        before the snapshot when it is out of sync. So endings queued before the snapshot ride
        inside it (as terminal entries of `workloads`), and checkpoint reports go both before
        it (applied while the attempt is still current) and after it (applied if the broker
        was out of sync); the broker ignores a step it already has."""
        have = {(w.job_id, w.attempt) for w in snap.workloads}
        endings: dict[tuple[str, int], WorkloadStatus] = {}
        ckpts: list[AgentEvent] = []
        heartbeat: list[AgentEvent] = []
        for e in queued:
            if isinstance(e, WorkloadStatus) and e.phase in TERMINAL_PHASES:
                if (e.job_id, e.attempt) not in have:
                    endings[(e.job_id, e.attempt)] = e
            elif isinstance(e, CheckpointReport):
                ckpts.append(e)
            elif isinstance(e, Heartbeat):
                heartbeat = [e]
        if endings:
            snap = msgspec.structs.replace(snap, workloads=[*snap.workloads, *endings.values()])
        return [*ckpts, snap, *ckpts, *heartbeat]

    async def _publish(self, events: list[AgentEvent]) -> None:
        """One EventBatch; halves it when it exceeds the server's max payload."""
        seq = self.seq + 1
        batch = EventBatch(
            cluster=self.cluster,
            instance=self.instance,
            seq=seq,
            events=events,
            sent_at=time.time(),
            wire=WIRE_VERSION,
        )
        data = encode_msgpack(batch)
        limit = self.nc.max_payload or len(data)
        if len(data) > limit:
            if len(events) > 1:
                half = len(events) // 2
                await self._publish(events[:half])
                await self._publish(events[half:])
                return
            self.stats["errors"] += 1
            self.log.error(
                "event larger than the NATS max payload; dropped",
                kind=type(events[0]).__name__,
                size=len(data),
                max_payload=limit,
            )
            return
        sent = time.time()
        await self.nc.publish(self.events_subject, data)
        self.seq = seq
        self._sent_at[seq] = sent
        if len(self._sent_at) > SENT_TIMES_KEPT:
            del self._sent_at[next(iter(self._sent_at))]
        self.stats["batches"] += 1
        self.stats["events"] += len(events)
        outbox = self._outbox
        if outbox:
            now = time.monotonic()
            for ev in events:
                key = _outbox_key(ev)
                kept = outbox.get(key) if key is not None else None
                if kept is not None and kept[0] is ev:
                    outbox[key] = (ev, seq, now)  # type: ignore[index]
            for ev in events:
                if isinstance(ev, ClusterSnapshot):
                    for w in ev.workloads:
                        key = _outbox_key(w)
                        kept = outbox.get(key) if key is not None else None
                        if kept is not None and kept[0] is w:
                            outbox[key] = (w, seq, now)  # type: ignore[index]

    def _learn(self, snap: ClusterSnapshot) -> None:
        """After a restart the snapshot tells which attempts already exist here; and which
        flavors the backend reads an autoscaled pool for."""
        self.read_pools = {f.name for f in snap.flavors if f.provision is not None}
        fence_after = self._fencing.fence_after if self._fencing is not None else None
        for w in snap.workloads:
            live = w.phase not in TERMINAL_PHASES
            # adopted from an earlier agent: keep extending the fence it was given
            after = fence_after(w.job_id, w.attempt) if live and fence_after else None
            self.gate.adopt(w.job_id, w.attempt, live=live, fence_after=after)
        self._learnt.set()

    # -- commands ------------------------------------------------------------------------
    async def _on_msg(self, msg: Msg) -> None:
        """The command boundary: whatever a message holds, it is answered and counted; nothing
        it raises reaches the connection's callback loop."""
        try:
            await self._on_command(msg)
        except Exception as exc:
            self.stats["refused"] += 1
            self.log.exception("command refused", error=repr(exc)[:300])
            err = f"agent could not process the command: {type(exc).__name__}: {exc}"
            await self._reply(msg, CommandAck(ok=False, error=err[:MAX_ERROR_CHARS]))

    async def _on_command(self, msg: Msg) -> None:
        """Decode and fence in arrival order; per-job work runs concurrently but in order."""
        if self.partitioned or not self._running:
            return  # a partitioned cluster never sees the request
        self.stats["commands"] += 1
        try:
            cmd = decode_command(msg.data)
        except DecodeError as exc:
            self.stats["refused"] += 1
            self.log.warning("malformed command", error=str(exc)[:200])
            await self._reply(msg, CommandAck(ok=False, error=str(exc)[:MAX_ERROR_CHARS]))
            return
        except Exception as exc:  # decode_command promises DecodeError; be safe anyway
            await self._reply(msg, CommandAck(ok=False, error=f"undecodable command: {exc}"))
            return
        stale = self.gate.epoch_refusal(cmd.epoch)
        if stale is not None:
            self.stats["refused"] += 1
            await self._reply(msg, stale)
            return
        if isinstance(cmd, Applied):
            await self._on_applied(cmd)
            await self._reply(msg, CommandAck(ok=True))
            return
        if isinstance(cmd, WireRefused):
            # Nothing this agent sends is applied until it or the broker is upgraded.
            self.stats["wire_refused"] = self.stats.get("wire_refused", 0) + 1
            self.log.error(
                "broker refuses this agent's wire version",
                agent_wire=cmd.agent_wire,
                broker_wire=cmd.broker_wire,
                reason=cmd.reason,
            )
            await self._reply(msg, CommandAck(ok=True))
            return
        if isinstance(cmd, Provision):
            await self._reply(msg, await self._provision(cmd))
            return
        if isinstance(cmd, Resync):
            self.log.info("resync requested", reason=cmd.reason, epoch=cmd.epoch)
            self.request_snapshot()
            await self._reply(msg, CommandAck(ok=True))
            return
        if isinstance(cmd, Cancel):
            task = asyncio.create_task(self._run_job_command(msg, cmd))
            self._cancel_tasks[task] = cmd.job_id
            task.add_done_callback(lambda t: self._cancel_tasks.pop(t, None))
        else:
            # The task takes a copy of the context, with the Cancels under way now.
            token = CANCELS_BEFORE.set(tuple(self._cancel_tasks.items()))
            try:
                if isinstance(cmd, DispatchBatch):
                    task = asyncio.create_task(self._run_dispatch_batch(msg, cmd))
                else:
                    task = asyncio.create_task(self._run_job_command(msg, cmd))
            finally:
                CANCELS_BEFORE.reset(token)
        self._cmd_tasks.add(task)
        task.add_done_callback(self._cmd_tasks.discard)

    async def _provision(self, cmd: Provision) -> CommandAck:
        """Grow a declared pool for one job's gang (refused for an undeclared flavor, or by a
        backend that cannot grow pools)."""
        log = self.log.bind(job_id=cmd.job_id, flavor=cmd.flavor, nodes=cmd.nodes)
        grow = getattr(self.backend, "provision", None)
        if cmd.flavor not in self.pools and cmd.flavor not in self.read_pools:
            err = f"flavor {cmd.flavor!r} of cluster {self.cluster} declares no autoscaled pool"
        elif grow is None:
            err = f"the backend of cluster {self.cluster} cannot grow pools"
        else:
            try:
                await grow(cmd)
            except BackendError as exc:
                err = str(exc)
            else:
                self.stats["provisions"] = self.stats.get("provisions", 0) + 1
                log.info("pool asked to grow", deadline=cmd.deadline)
                return CommandAck(ok=True)
        self.stats["refused"] += 1
        log.warning("provision refused", error=err)
        return CommandAck(ok=False, error=err[:MAX_ERROR_CHARS])

    async def _run_job_command(self, msg: Msg, cmd: Dispatch | Cancel | CheckpointNow) -> None:
        await self._reply(msg, await self._job_ack(cmd))

    async def _run_dispatch_batch(self, msg: Msg, batch: DispatchBatch) -> None:
        """Each Dispatch of the batch carried out as if it had come alone, in the batch's
        order (each job's commands still one after the other); one answer with every ack."""
        acks = await asyncio.gather(*(self._batched_ack(cmd) for cmd in batch.dispatches))
        await self._reply(msg, DispatchAcks(acks=list(acks)))

    async def _batched_ack(self, cmd: Dispatch) -> CommandAck:
        """One Dispatch of a batch: its own epoch checked as a lone one's is on arrival."""
        stale = self.gate.epoch_refusal(cmd.epoch)
        if stale is not None:
            self.stats["refused"] += 1
            return stale
        return await self._job_ack(cmd)

    async def _job_ack(self, cmd: Dispatch | Cancel | CheckpointNow) -> CommandAck:
        if not isinstance(cmd, Cancel):
            return await self._in_turn(cmd)
        # A copy of a Cancel already waiting or under way (the broker asks again when the
        # answer is slow) is answered with that one's ack: on kube a Cancel may list every
        # workload kind, and doing it once per copy spent the API budget the work needed.
        key = (cmd.job_id, cmd.attempt, cmd.epoch)
        if self._cancelling.under_way(key):
            self.stats["cancels_joined"] += 1
        return await self._cancelling.run(key, lambda: self._in_turn(cmd))

    async def _in_turn(self, cmd: Dispatch | Cancel | CheckpointNow) -> CommandAck:
        """Carry out `cmd` after every command of its job that arrived before it."""
        job_id = cmd.job_id
        hold_until = asyncio.get_running_loop().time() + HOLD_MAX_S  # from arrival, not the lock
        lock, users = self._locks.get(job_id, (None, 0))
        if lock is None:
            lock = asyncio.Lock()
        self._locks[job_id] = (lock, users + 1)
        try:
            async with lock:
                ack = await self._when_learnt(cmd, hold_until)
        finally:
            lk, n = self._locks[job_id]
            if n <= 1:
                del self._locks[job_id]
            else:
                self._locks[job_id] = (lk, n - 1)
        if not ack.ok:
            self.stats["refused"] += 1
        return ack

    async def _when_learnt(
        self, cmd: Dispatch | Cancel | CheckpointNow, hold_until: float
    ) -> CommandAck:
        """Carry out `cmd` once the attempts already in the cluster are known. Held behind the
        first snapshot of a start (the subscription comes first so that no command meets an
        empty subject; the hold costs no more than that snapshot), so that a revision of an
        adopted attempt is a resize and a Cancel is not undone by an older snapshot."""
        if not self._learnt.is_set():
            try:
                async with asyncio.timeout_at(hold_until):
                    await self._learnt.wait()
            except TimeoutError:
                self.log.warning("command refused: cluster not read yet", job_id=cmd.job_id)
                err = (
                    f"the agent of cluster {self.cluster} has not read its cluster yet (its "
                    f"first snapshot took over {HOLD_MAX_S} s), so the command was not carried "
                    "out; if this repeats, look for 'snapshot failed' in the agent's log and "
                    "fix its access to the cluster"
                )
                return CommandAck(ok=False, error=err)
        return await self._execute(cmd)

    async def _execute(self, cmd: Dispatch | Cancel | CheckpointNow) -> CommandAck:
        log = self.log.bind(job_id=cmd.job_id, attempt=cmd.attempt, epoch=cmd.epoch)
        try:
            if isinstance(cmd, Dispatch):
                return await self._dispatch(cmd, log)
            if isinstance(cmd, Cancel):
                await self.backend.cancel(cmd.job_id, cmd.attempt, cmd.reason or "cancelled")
                self.gate.cancelled(cmd.job_id, cmd.attempt)
                log.info("cancelled", reason=cmd.reason)
                return CommandAck(ok=True, ended=self._unapplied_ending(cmd))
            # CheckpointNow goes only to this attempt's own pods, through the backend's
            # per-pod channel: never on NATS, where every workload could hear it.
            await self.backend.checkpoint_now(cmd.job_id, cmd.attempt, cmd.deadline)
            log.info("checkpoint requested", deadline=cmd.deadline)
            return CommandAck(ok=True)
        except BackendError as exc:
            log.warning("backend refused command", error=str(exc))
            job_only = isinstance(exc, JobRefused)
            return CommandAck(ok=False, error=str(exc)[:MAX_ERROR_CHARS], job_only=job_only)
        except Exception as exc:
            self.stats["errors"] += 1
            log.exception("command failed")
            return CommandAck(ok=False, error=f"agent error: {type(exc).__name__}: {exc}"[:1000])

    def _unapplied_ending(self, cmd: Cancel) -> WorkloadStatus | None:
        """The attempt's ending, if it ended before the Cancel and no Applied has covered the
        batch that told it: the broker may be about to start the job again (a spot notice
        moved it while the success was on its way), and learns it from the answer first."""
        if cmd.attempt is None:
            return None
        kept = self._outbox.get((cmd.job_id, cmd.attempt, False))
        return kept[0] if kept is not None and isinstance(kept[0], WorkloadStatus) else None

    async def _dispatch(self, cmd: Dispatch, log: Any) -> CommandAck:
        received = time.time()
        verdict = self.gate.judge(cmd, received)
        if isinstance(verdict, Refuse):
            if verdict.fence_lapsed:
                self.stats["late_dispatches"] += 1
                log.warning("dispatch read after its fence lapsed", error=verdict.ack.error)
            return verdict.ack
        if isinstance(verdict, Resize):
            return await self._resize(cmd, log)
        if isinstance(verdict, Duplicate):
            log.debug("duplicate dispatch acknowledged")
            return CommandAck(ok=True)
        for old in verdict.supersede:
            await self.backend.cancel(cmd.job_id, old, f"superseded by attempt {cmd.attempt}")
            self.gate.ended(cmd.job_id, old)
            log.info("cancelled older attempt", old_attempt=old)
        base = self.gate.fence_base(received)
        before = [t for t, job in CANCELS_BEFORE.get() if job != cmd.job_id and not t.done()]
        if before:  # what they free is free before this takes nodes
            await asyncio.wait(before, timeout=CANCEL_WAIT_S)
        if self._cluster_fencing is not None and cmd.fence_after_s > 0:
            await self._extend_fences(base)  # the cluster's fence covers it before it exists
        await self.backend.dispatch(cmd)
        self.gate.ran(cmd)
        await self._extend_fences(base, cmd.job_id)
        log.debug("dispatched", flavor=cmd.flavor)
        return CommandAck(ok=True)

    async def _resize(self, cmd: Dispatch, log: Any) -> CommandAck:
        """A revision of a running attempt: its nodes changed in place (an elastic gang).
        Acknowledged, unless the workload says it cannot change size (CannotResize): then
        the broker moves the whole gang. A backend without `resize`, or one that failed for
        another reason, leaves the replicas on a reclaimed node to end with it."""
        self.gate.resized(cmd)
        resize = getattr(self.backend, "resize", None)
        if resize is None:
            log.info("backend cannot resize in place", revision=cmd.revision)
            return CommandAck(ok=True)
        try:
            await cast("Resizing", self.backend).resize(cmd)
        except CannotResize as exc:
            log.warning("workload cannot resize in place", revision=cmd.revision, why=str(exc))
            error = f"cannot resize in place: {exc}"[:MAX_ERROR_CHARS]
            return CommandAck(ok=False, error=error, resize_refused=True)
        except BackendError as exc:
            log.warning("resize failed", revision=cmd.revision, error=str(exc))
            return CommandAck(ok=True)
        log.info("attempt resized", revision=cmd.revision, nodes=_node_count(cmd))
        return CommandAck(ok=True)

    async def _reply(self, msg: Msg, ack: CommandAck | DispatchAcks) -> None:
        if not msg.reply:
            return
        try:
            await msg.respond(encode_msgpack(ack))
        except Exception as exc:
            self.log.warning("could not send ack", error=str(exc))

    # -- introspection -------------------------------------------------------------------
    @property
    def max_epoch(self) -> int:
        return self.gate.max_epoch

    def live_attempts(self, job_id: str) -> set[int]:
        return self.gate.live(job_id)

    @property
    def looping(self) -> bool:
        """The background loop (batches, heartbeats, retries, self-fencing) is running."""
        return self._loop_task is not None and not self._loop_task.done()

    def cluster_fences(self, job_id: str, attempt: int) -> bool:
        """The cluster ends this attempt by its own hand once its fence lapses, so the
        runtime does not self-fence it."""
        return self._cluster_fences(job_id, attempt)

    def adopt(self, snap: ClusterSnapshot) -> None:
        """Take in a backend snapshot without publishing it (the attempts it holds, as after a
        restart), for a caller that drives the runtime by hand."""
        self._learn(snap)

    async def carry_out(self, cmd: Dispatch | Cancel | CheckpointNow) -> CommandAck:
        """Run one broker command through the gate and the backend, as when it arrives on the
        command subject, for a caller that drives the runtime by hand; returns its ack."""
        return await self._execute(cmd)

    async def acknowledged(self, cmd: Applied, sent_at: float) -> None:
        """The broker's Applied for batch `cmd.seq`, which left at `sent_at` (unix time):
        handled as when it arrives on the command subject, for a caller with its own clock."""
        self._sent_at[cmd.seq] = sent_at
        await self._on_applied(cmd)


def _node_count(cmd: Dispatch) -> int:
    return sum(len(a.nodes) for a in cmd.assignment)
