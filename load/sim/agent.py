"""One simulated cluster and its agent, on the simulator's virtual clock: batches, snapshots,
resyncs, workload progress, and the policy's view of node losses."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Any, Protocol

import msgspec

from agents.backend import BackendError
from agents.config import FakeClusterConfig, FakeFlavor
from agents.fake.model import (
    ManualClock,
    WorkloadTiming,
)
from load import skypilot
from load.sim.jobs import (
    SimJob,
)
from load.sim.policies import Policy
from load.sim.world import (
    ACK,
    CLUSTER_DUE,
    ENDED,
    NODE_CPU,
    NODE_GONE_SEEN,
    NODE_GPUS,
    NODE_MEMORY,
    RECLAIMED,
    AttemptLog,
    ElasticModel,
    pool_levels,
    size_speed,
)
from load.simconfig import (
    PoolSpec,
    SimConfig,
)
from schemas.agent import (
    AgentEvent,
    Cancel,
    CheckpointNow,
    CheckpointReport,
    ClusterSnapshot,
    Dispatch,
    EventBatch,
    NodeGone,
    Provision,
    ProvisionPool,
    Resync,
    SpotNotice,
    WorkloadStatus,
)
from schemas.quantity import cpu_milli, memory_bytes


class Host(Protocol):
    """What a simulated agent reads and calls of the simulator around it (load/sim/loop.py
    `Sim`), stated here so the agent does not import the loop that imports it."""

    cfg: SimConfig
    policy: Policy
    clock: ManualClock
    now: float
    speed: dict[str, float]
    jobs_by_id: dict[str, SimJob]
    logs: dict[str, list[AttemptLog]]
    live_copies: dict[str, tuple[str, int]]
    node_home: dict[str, tuple[str, str]]
    node_place: dict[str, tuple[str, str]]
    node_spans: dict[str, list[float]]

    def push(self, t: float, kind: int, payload: Any) -> None: ...

    def draw(self, job_id: str, attempt: int, what: str) -> float: ...

    def violation(self, now: float, kind: str, detail: str) -> None: ...

    def note_span(self, log: AttemptLog, nodes: set[str]) -> None: ...

    def provision(self, agent: SimAgent, cmd: Provision, now: float) -> None: ...


class SimAgent:
    """One simulated cluster and its agent. The cluster is the fake backend's `ClusterModel`
    on the simulator's virtual clock; around it this plays the agent (batches with a `seq`,
    a snapshot first and after a resync, refusing a deposed leader's commands), keeps the
    ground-truth `AttemptLog`s and applies the policy's view of losses (no notices, or a
    node loss the broker only finds by polling)."""

    def __init__(self, sim: Host, name: str, pools: Sequence[PoolSpec]) -> None:
        self.sim = sim
        self.name = name
        self.pools = {p.flavor: p for p in pools}
        flavors = [
            FakeFlavor(
                name=p.flavor,
                capacity_type=p.capacity_type,
                gpu_type=p.gpu_type,
                price_per_gpu_hour=p.price,
                nodes=0,  # the simulator adds them by name (trace slots)
                gpu_per_node=NODE_GPUS,
                cpu=NODE_CPU,
                memory=NODE_MEMORY,
            )
            for p in pools
        ]
        self.model = ElasticModel(name, FakeClusterConfig(flavors=flavors), sim.clock)
        self.model.places = sim.node_place
        self.model.levelled = frozenset(p.flavor for p in pools if p.topology)
        self.model.timing = self._timing
        self.model.on_schedule = self._on_schedule
        self.due_at = math.inf  # the CLUSTER_DUE on the simulator's heap
        self.live: dict[tuple[str, int], AttemptLog] = {}
        self.outbox: list[AgentEvent] = []
        self.held: list[AgentEvent] = []  # evictions the broker learns of with the node loss
        self.instance = f"{name}-sim-1"
        self.seq = 0
        self.snapshot_due = True  # the first batch of an instance is a snapshot
        self.highest_epoch = 0
        self.unreported: set[str] = set()  # gone, but the polling broker does not know yet
        self.empty_since: dict[str, float] = {}  # autoscaled nodes found empty, since when

    def start(self) -> None:
        """From now on the model's events go to the broker (setup is the first snapshot)."""
        self.model.emit = self._emit

    # -- agent side -------------------------------------------------------------------
    def _declared(self, snap: ClusterSnapshot) -> ClusterSnapshot:
        """The snapshot with each pool's size declared, as an autoscaler's limits would be:
        every trace slot of every zone, so a zone that starts empty is not taken for small;
        an autoscaled pool declares what it can grow to (`FlavorInfo.provision`)."""
        flavors = []
        for f in snap.flavors:
            p = self.pools[f.name]
            grow = None
            if p.autoscale is not None:
                a = p.autoscale
                grow = ProvisionPool(
                    max_nodes=a.max_nodes,
                    node_gpu=NODE_GPUS,
                    node_cpu_milli=cpu_milli(NODE_CPU),
                    node_memory=memory_bytes(NODE_MEMORY),
                    ready_s=a.ready_s,
                    window_s=a.window_s,
                )
            size = p.nodes + sum(z[2] for z in p.zones)
            levels = pool_levels(p)
            flavors.append(
                msgspec.structs.replace(
                    f, max_nodes=size, node_gpu=NODE_GPUS, provision=grow, topology_levels=levels
                )
            )
        return msgspec.structs.replace(snap, flavors=flavors)

    def take_batches(self, now: float) -> list[EventBatch]:
        """What the agent publishes now. Deltas already queued go out first, in order; a due
        snapshot (first batch of an instance, or after a resync request) follows them."""
        out: list[EventBatch] = []
        if self.outbox and self.seq > 0:
            out.append(self._batch(self.outbox, now))
            self.outbox = []
        if self.snapshot_due:
            self.snapshot_due = False
            out.append(self._batch([self._declared(self.model.view()), *self.outbox], now))
            self.outbox = []
        return out

    def _batch(self, events: list[AgentEvent], now: float) -> EventBatch:
        self.seq += 1
        return EventBatch(
            cluster=self.name, instance=self.instance, seq=self.seq, events=events, sent_at=now
        )

    def _emit(self, event: AgentEvent) -> None:
        """An event of the model: note it in the attempt logs, then pass it on (or not)."""
        sim = self.sim
        if isinstance(event, WorkloadStatus):
            key = (event.job_id, event.attempt)
            log = self.live.get(key)
            if log is not None and event.phase == "running":
                log.running_at = sim.now
            elif log is not None and event.phase in ENDED:
                cause: str = event.phase
                if event.phase == "evicted":
                    cause = "node-gone" if event.reason == RECLAIMED else event.reason
                self._ended(key, log, event.step, cause)
            if event.phase == "evicted" and event.reason == RECLAIMED and sim.policy.detect_s:
                self.held.append(event)
                return
        elif isinstance(event, CheckpointReport):
            log = self.live.get((event.job_id, event.attempt))
            if log is not None:
                log.ckpt_steps.append(event.step)
                log.ckpt_times.append(sim.now)
        elif isinstance(event, SpotNotice):
            if not sim.policy.notices:
                return
        elif isinstance(event, NodeGone) and sim.policy.detect_s > 0:  # found by the next poll
            self.unreported.add(event.node)
            found = [*self.held, event]
            self.held = []
            sim.push(sim.now + sim.policy.detect_s, NODE_GONE_SEEN, (self, event.node, found))
            return
        self.outbox.append(event)

    def _ended(self, key: tuple[str, int], log: AttemptLog, step: int | None, cause: str) -> None:
        del self.live[key]
        log.ended_at = self.sim.now
        log.end_step = log.start_step if step is None else step
        log.cause = cause
        if self.sim.live_copies.get(key[0]) == key:
            del self.sim.live_copies[key[0]]

    def _on_schedule(self, due: float) -> None:
        """Keep one CLUSTER_DUE on the heap at the model's earliest due time."""
        if due < self.due_at:
            self.due_at = due
            self.sim.push(due, CLUSTER_DUE, self)

    def due(self, t: float) -> bool:
        """Whether the model has something to do at `t`: not when a due time was superseded
        by an earlier one, nor when what was due has ended meanwhile (then wait for the
        next)."""
        if t != self.due_at:
            return False
        nxt = self.model.next_due()
        if nxt <= t:
            return True
        self.due_at = math.inf
        self._on_schedule(nxt)
        return False

    def advance(self) -> None:
        self.due_at = math.inf
        self.model.advance()
        self._on_schedule(self.model.next_due())

    def _every(self, cmd: Dispatch, job: SimJob) -> float | None:
        """The attempt's periodic checkpoint interval: the job's own, or the broker's advice;
        None when it writes none (no checkpoints, or hindsight)."""
        policy = self.sim.policy
        if not policy.checkpoints or policy.foresight or job.ckpt_every is None:
            return None
        if policy.follows_advice and cmd.checkpoint_interval_s:
            return cmd.checkpoint_interval_s
        return job.ckpt_every

    def _timing(self, cmd: Dispatch) -> WorkloadTiming:
        """Start-up drawn per (job, attempt), GPU speed per type, the job's checkpoint cost."""
        sim = self.sim
        cfg = sim.cfg
        job = sim.jobs_by_id[cmd.job_id]
        lo, hi = cfg.start_delay_s
        delay = lo + (hi - lo) * sim.draw(cmd.job_id, cmd.attempt, "start")
        if sim.policy.skypilot:  # a fresh VM for every attempt: provisioning and setup
            lo, hi = skypilot.PROVISION_S
            delay += lo + (hi - lo) * sim.draw(cmd.job_id, cmd.attempt, "provision")
        every = self._every(cmd, job)
        return WorkloadTiming(
            start_delay_s=delay + cfg.start_delay_per_replica_s * (job.replicas - 1),
            restore_s=cfg.restore_factor * job.ckpt_cost,  # reading the checkpoint back
            speed=sim.speed.get(self.pools[cmd.flavor].gpu_type, 1.0) * size_speed(cmd),
            checkpoint_every_s=math.inf if every is None else every,
            checkpoint_stall_s=job.ckpt_cost,
            checkpoint_write_s=0.0 if sim.policy.foresight else job.ckpt_cost,
        )

    # -- commands ----------------------------------------------------------------------
    def command(self, cmd: Any, now: float) -> None:
        epoch = getattr(cmd, "epoch", 0)
        if epoch < self.highest_epoch:  # agents refuse a deposed leader's commands
            self.sim.violation(now, "stale-epoch", f"{self.name}: {type(cmd).__name__}")
            return
        self.highest_epoch = epoch
        if isinstance(cmd, Dispatch):
            self.dispatch(cmd, now)
        elif isinstance(cmd, Cancel):
            keys = [
                k
                for k in self.live
                if k[0] == cmd.job_id and (cmd.attempt is None or k[1] == cmd.attempt)
            ]
            for key in keys:
                status = self.model.workload(*key)
                self.model.remove(key[0], key[1], cmd.reason)  # silent, as a real agent's
                step = status.step if status is not None else None
                self._ended(key, self.live[key], step, f"cancel: {cmd.reason}")
        elif isinstance(cmd, CheckpointNow):
            # Writing takes the job's checkpoint cost; if the node goes first, the checkpoint
            # is lost with it.
            self.model.checkpoint(cmd.job_id, cmd.attempt)
        elif isinstance(cmd, Resync):
            self.snapshot_due = True
        elif isinstance(cmd, Provision):
            self.sim.provision(self, cmd, now)

    def dispatch(self, cmd: Dispatch, now: float) -> None:
        sim = self.sim
        key = (cmd.job_id, cmd.attempt)
        ack = now + sim.cfg.ack_latency_s
        if key in self.live:  # idempotent on (job_id, attempt)
            if cmd.revision > 0:  # an elastic attempt's new nodes, as the fake agent applies
                with contextlib.suppress(BackendError):
                    self.model.resize_workload(cmd)
                    job = sim.jobs_by_id[cmd.job_id]
                    replicas = sum(len(a.nodes) for a in cmd.assignment)
                    self.live[key].resize(replicas * job.gpu_per_replica, now)
            sim.push(ack, ACK, (cmd.job_id, cmd.attempt, True, ""))
            return
        if cmd.resume_from is not None and not sim.policy.resume:
            cmd = msgspec.structs.replace(cmd, resume_from=None)
        try:
            self.model.create(cmd)
        except BackendError as exc:
            error = str(exc)
            if not (sim.policy.detect_s > 0 and "is not in cluster" in error):
                # (A broker that learns of losses by polling may still place on a node
                # that is already gone: the agent refuses and the broker requeues.)
                sim.violation(now, "dispatch-refused", f"{self.name} {key}: {error}")
            sim.push(ack, ACK, (cmd.job_id, cmd.attempt, False, error))
            return
        live = sim.live_copies.get(cmd.job_id)
        if live is not None:
            sim.violation(now, "two-live-copies", f"{key} while {live} still runs")
        job = sim.jobs_by_id[cmd.job_id]
        pool = self.pools[cmd.flavor]
        every = self._every(cmd, job)
        log = AttemptLog(
            job_id=cmd.job_id,
            attempt=cmd.attempt,
            cluster=self.name,
            flavor=cmd.flavor,
            capacity_type=pool.capacity_type,
            price=pool.price,
            gpus=sum(len(a.nodes) for a in cmd.assignment) * job.gpu_per_replica,
            dispatched_at=now,
            start_step=min(cmd.resume_from.step if cmd.resume_from else 0, job.duration),
            speed=sim.speed.get(pool.gpu_type, 1.0),
            gpu_type=pool.gpu_type,
            ckpt_every=every,
        )
        sim.note_span(log, {n for a in cmd.assignment for n in a.nodes})
        self.live[key] = log
        sim.live_copies[cmd.job_id] = key
        sim.logs.setdefault(cmd.job_id, []).append(log)
        sim.push(ack, ACK, (cmd.job_id, cmd.attempt, True, ""))

    # -- nodes -------------------------------------------------------------------------
    def add_node(self, name: str, flavor: str) -> None:
        """A node joins (announced once the agent has started)."""
        self.model.add_node(flavor, name)
        self.sim.node_home[name] = (self.name, flavor)
        self.sim.node_spans[name] = [self.sim.now, math.inf]

    def remove_node(self, name: str, reason: str) -> None:
        """A node leaves (reclaimed, scaled down); its span in the capacity log ends now."""
        self.model.remove_node(name, reason=reason)
        span = self.sim.node_spans.get(name)
        if span is not None:
            span[1] = min(span[1], self.sim.now)

    def consolidate(self, now: float) -> None:
        """Autoscaled pools drop nodes beyond their minimum that stayed empty `idle_s`."""
        for p in self.pools.values():
            a = p.autoscale
            if a is None:
                continue
            names = self.model.nodes_of(p.flavor)
            extra = len(names) - p.nodes
            for name in names:
                if extra <= 0:
                    break
                node = self.model.node_state(name)
                if node is None or node.workloads or node.used_gpu:
                    self.empty_since.pop(name, None)
                    continue
                since = self.empty_since.setdefault(name, now)
                if now - since >= a.idle_s:
                    del self.empty_since[name]
                    self.remove_node(name, reason="consolidated")
                    extra -= 1
