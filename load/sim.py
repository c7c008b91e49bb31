"""Virtual-clock simulator: the pure lifecycle `Machine` driven by real traces.

Production runs the `Machine` behind an asyncio shell over NATS. Here a discrete-event loop
plays the shell instead: it feeds the machine inputs with a virtual `now`, carries out its
effects at once (`Send` goes to a simulated cluster, `Publish` updates the metrics), and the
simulated clusters answer as agents would, with `EventBatch`es (snapshot first, increasing
`seq`), heartbeats, spot notices and workload progress. Each simulated cluster is the fake
backend's `ClusterModel` (agents/fake/model.py) on this loop's virtual clock, with a
`WorkloadTiming` per dispatch for GPU speed, checkpoint cost and restore delay. Nothing sleeps
and nothing does I/O after the traces are read, so a week of Philly jobs replays in seconds.

Jobs come from Philly (`philly.csv`), spot reclaims from Bamboo (`bamboo-p3.csv`,
`bamboo-g4dn.csv`) or a Poisson process. Policies differ only in what the simulated workloads
and job specs do with checkpoints, so the broker under test is the same code every time.

Run `python -m load.sim --help`.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import json
import math
import random
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
import typer

from agents.backend import BackendError
from agents.config import ZONE_LABEL as ZONE
from agents.config import FakeClusterConfig, FakeFlavor
from agents.fake.model import (
    ClusterModel,
    ManualClock,
    NodeState,
    WorkloadTiming,
    provider_delays,
)
from agents.fake.trace import SpotTrace, TraceEvent, load_trace
from broker.core.effects import Effect, Persist, Publish, Send, refusal, split_reply
from broker.core.elastic import speed as elastic_speed
from broker.core.inputs import AgentBatch, Cycle, DispatchAcked, SubmitJob, Tick
from broker.core.invariants import unordered_dispatches, violations
from broker.core.machine import Machine
from broker.core.records import JobRecord
from broker.core.states import TERMINAL
from load import skypilot, traces
from load.command import Options, program
from load.command import run as run_command
from load.simconfig import (
    NOTICE_S,
    PoolSpec,
    SimConfig,
    on_demand_pools,
)
from schemas.agent import (
    AgentEvent,
    Cancel,
    CheckpointNow,
    CheckpointReport,
    ClusterSnapshot,
    Dispatch,
    EventBatch,
    Heartbeat,
    NodeGone,
    Provision,
    ProvisionPool,
    Resync,
    SpotNotice,
    WorkloadStatus,
)
from schemas.api import JobEvent
from schemas.config import BrokerConfig, QueueConfig, Timeouts
from schemas.job import (
    CapacityPreference,
    CheckpointSpec,
    JobSpec,
    PodSet,
    Simulation,
    SpotPolicy,
    Workload,
)
from schemas.quantity import cpu_milli, memory_bytes

if TYPE_CHECKING:
    from load.oracle import Bound

NODE_GPUS = 8
GOLDEN = (5**0.5 - 1) / 2  # successive multiples mod 1 spread evenly over [0, 1)
NODE_CPU = "96"
NODE_MEMORY = "1152Gi"
MAX_PUMP_ROUNDS = 64  # agent <-> broker exchanges per step before we call it a livelock


# ------------------------------------------------------------------------------ policies
@dataclass(frozen=True, slots=True)
class Policy:
    """What a policy changes: only the workloads' use of checkpoints and the spot preference."""

    name: str
    checkpoints: bool  # specs carry a checkpoint location, workloads write checkpoints
    resume: bool  # a new attempt starts from `Dispatch.resume_from`
    capacity_map: tuple[tuple[str, CapacityPreference], ...] = ()
    about: str = ""
    notices: bool = True  # the broker sees spot notices (else only the node's loss)
    detect_s: float = 0.0  # the loss of a node reaches the broker this late (polling)
    on_demand_only: bool = False  # spot slots are on-demand nodes at the on-demand price
    # Hindsight: the workload knew each reclaim was coming, so it writes no periodic
    # checkpoints and its checkpoint at the notice is already written (costs nothing).
    foresight: bool = False
    # The workloads checkpoint at the broker's advised interval (Dispatch.checkpoint_interval_s,
    # MUSTER_CHECKPOINT_INTERVAL_S) instead of their own.
    follows_advice: bool = False
    spot_return: bool = True  # the broker moves on-demand jobs back to spot when it pays
    # Multi-replica jobs are elastic (`PodSet.max_replicas`: down to half their replicas):
    # admitted at what fits, shrunk in place on a reclaim when that beats a move, grown back.
    elastic: bool = False
    # SkyPilot's managed-job recovery (load/skypilot.py): the strategy's name; price-ranked
    # placement, no Muster spot rules, a fresh VM provisioned for every attempt.
    skypilot: str | None = None


POLICIES: dict[str, Policy] = {
    "muster": Policy(
        "muster",
        True,
        True,
        about="checkpoint-aware re-dispatch, make-before-break, Young/Daly advice followed, "
        "spot-return",
        follows_advice=True,
    ),
    "muster-fixed": Policy(
        "muster-fixed",
        True,
        True,
        about="muster, but workloads keep their own 10 min interval (no advice)",
    ),
    "muster-no-return": Policy(
        "muster-no-return",
        True,
        True,
        about="muster, but jobs that fell back to on-demand stay there",
        follows_advice=True,
        spot_return=False,
    ),
    "scratch": Policy(
        "scratch",
        False,
        False,
        about="restart preempted jobs from step 0 (SkyPilot default, Armada resubmit)",
        spot_return=False,
    ),
    "spot-only": Policy(
        "spot-only",
        True,
        True,
        (("spot-then-on-demand", "spot"),),
        about="muster, but spot-then-on-demand jobs never fall back",
        follows_advice=True,
    ),
    "fallback": Policy(
        "fallback",
        True,
        True,
        (("spot", "spot-then-on-demand"),),
        about="muster, but spot-only jobs may fall back to on-demand",
        follows_advice=True,
    ),
    "on-demand-only": Policy(
        "on-demand-only",
        True,
        True,
        (("spot", "any"), ("spot-then-on-demand", "any")),
        about="every spot slot is an on-demand node at the on-demand price; nothing is reclaimed",
        on_demand_only=True,
    ),
    "checkpoint-restart": Policy(
        "checkpoint-restart",
        True,
        True,
        about="periodic checkpoints; the broker never sees the notice, only the node's loss",
        notices=False,
        spot_return=False,
    ),
    "skypilot-like": Policy(
        "skypilot-like",
        True,
        True,
        about="SkyPilot managed jobs, EAGER_NEXT_REGION (load/skypilot.py): no notice, the loss "
        "found by a 15 s poll, relaunched on a fresh VM (minutes) away from the lost pool, "
        "placed by price, resumed from the job's own last checkpoint",
        notices=False,
        detect_s=skypilot.JOB_STATUS_CHECK_GAP_S,
        spot_return=False,
        skypilot="EAGER_NEXT_REGION",
    ),
    "skypilot-failover": Policy(
        "skypilot-failover",
        True,
        True,
        about="skypilot-like with SkyPilot's FAILOVER recovery: the lost pool is not avoided",
        notices=False,
        detect_s=skypilot.JOB_STATUS_CHECK_GAP_S,
        spot_return=False,
        skypilot="FAILOVER",
    ),
    "elastic": Policy(
        "elastic",
        True,
        True,
        about="muster, with every multi-replica job elastic between half its replicas and "
        "all of them (speed: linear scaling at 90% efficiency)",
        follows_advice=True,
        elastic=True,
    ),
    "foresight": Policy(
        "foresight",
        True,
        True,
        (("spot", "any"), ("spot-then-on-demand", "any"), ("on-demand", "any")),
        about="Muster's placement with foresight: each workload knew its reclaims in advance, "
        "writes no periodic checkpoints and has its checkpoint ready at every notice; every "
        "job may use any pool. A policy, not a bound (load/oracle.py computes the bound)",
        foresight=True,
    ),
}
BASELINES = ("on-demand-only", "spot-only", "checkpoint-restart", "scratch", "skypilot-like")

COMPARISON = (*BASELINES, "muster")  # each run also gets its hindsight bound (load/oracle.py)
ABLATIONS = ("muster-fixed", "muster-no-return")  # muster without one of its policies
EXTENSIONS = ("elastic",)  # muster with more of the job's cooperation


_DEFAULTS = SimConfig()


# ------------------------------------------------------------------------------ traces
# Loaders belong to load/traces.py (shared with the core benchmarks); cached here because
# every run of a multi-policy comparison reads the same files.
@lru_cache(maxsize=2)
def load_philly(path: Path) -> tuple[traces.PhillyJob, ...]:
    """All Philly rows sorted by submit time (the file is not sorted)."""
    return tuple(traces.load_philly(traces.require_trace(path.name, path.parent)))


@lru_cache(maxsize=16)
def cached_trace(path: Path) -> SpotTrace:
    """The spot trace at `path` (Bamboo CSV or SkyPilot JSON), parsed once per process
    (agents/fake/trace.py)."""
    return load_trace(path)


# ------------------------------------------------------------------------------ jobs
@dataclass(slots=True)
class SimJob:
    index: int
    job_id: str
    arrival: float  # virtual seconds since the run's start
    duration: int  # seconds of work = steps (1 step per second)
    replicas: int
    gpu_per_replica: int
    queue: str
    capacity: CapacityPreference
    ckpt_every: float | None  # None: the job never checkpoints
    vc: str
    ckpt_cost: float = 0.0  # seconds to write one checkpoint (restore: x restore_factor)

    @property
    def gpus(self) -> int:
        return self.replicas * self.gpu_per_replica


def make_jobs(cfg: SimConfig) -> list[SimJob]:
    """The job window; the same seed gives the same jobs under every policy."""
    rows = load_philly(cfg.philly)
    # A window longer than what follows the offset starts earlier: `--jobs 82247` is the
    # whole trace whatever the offset.
    offset = min(cfg.offset, max(0, len(rows) - cfg.jobs))
    window = rows[offset : offset + cfg.jobs]
    if not window:
        return []
    rng = random.Random(f"jobs-{cfg.seed}")
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.cluster] = counts.get(r.cluster, 0) + 1
    ranked = sorted(counts, key=lambda v: (-counts[v], v))
    queue_of = {vc: cfg.queues[i % len(cfg.queues)] for i, vc in enumerate(ranked)}
    prefs = [p for p, _ in cfg.mix]
    weights = [w for _, w in cfg.mix]
    t0 = window[0].arrival
    cost_rng = random.Random(f"ckpt-cost-{cfg.seed}")  # its own stream: the mix stays put
    lo, hi = cfg.ckpt_cost_s
    jobs: list[SimJob] = []
    for i, r in enumerate(window):
        replicas, per = traces.gang_shape(max(1, r.num_gpus))
        ckpt = cfg.checkpoint_every_s if rng.random() < cfg.checkpoint_fraction else None
        jobs.append(
            SimJob(
                index=i,
                job_id=f"p{offset + i:05d}",
                arrival=(r.arrival - t0) / cfg.compress,
                duration=max(1, int(min(r.duration, cfg.max_duration_s))),
                replicas=replicas,
                gpu_per_replica=per,
                queue=queue_of[r.cluster],
                capacity=rng.choices(prefs, weights)[0],
                ckpt_every=ckpt,
                vc=r.cluster,
                ckpt_cost=lo + (hi - lo) * cost_rng.random(),
            )
        )
    return jobs


def job_spec(job: SimJob, policy: Policy) -> JobSpec:
    capacity = dict(policy.capacity_map).get(job.capacity, job.capacity)
    # With hindsight every job can write the one checkpoint it needs, just before a reclaim.
    ckpt = (job.ckpt_every is not None or policy.foresight) and policy.checkpoints
    per = job.gpu_per_replica
    elastic = policy.elastic and job.replicas > 1
    return JobSpec(
        name=f"philly-{job.index}",
        job_id=job.job_id,
        queue=job.queue,
        gang=[
            PodSet(
                name="worker",
                replicas=job.replicas,
                min_replicas=max(1, job.replicas // 2) if elastic else None,
                max_replicas=job.replicas if elastic else None,
                gpu=per,
                cpu=str(max(1, 4 * per)),
                memory=f"{max(1, 16 * per)}Gi",
            )
        ],
        capacity=capacity,
        spot=skypilot.SPOT_POLICY if policy.skypilot else SpotPolicy(),
        checkpoint=CheckpointSpec(
            uri=f"s3://sim-ckpt/{job.job_id}",
            interval_s=job.ckpt_every,
            cost_s=round(job.ckpt_cost, 1),
        )
        if ckpt
        else None,
        workload=Workload(
            kind="pytorchjob" if job.replicas > 1 else "indexed-job",
            simulate=Simulation(
                total_steps=job.duration,
                steps_per_second=1.0,
                checkpoint_every=max(1, int(job.ckpt_every or job.duration)),
            ),
        ),
        labels={"philly-vc": job.vc},
    )


def broker_config(cfg: SimConfig, policy: Policy | None = None) -> BrokerConfig:
    """The broker's settings for a run; a SkyPilot baseline gets SkyPilot's (load/skypilot.py)."""
    config = _broker_config(cfg)
    if policy is not None and policy.skypilot:
        return skypilot.broker_config(config, policy.skypilot)
    return config


def _broker_config(cfg: SimConfig) -> BrokerConfig:
    return BrokerConfig(
        queues=[QueueConfig(name=q) for q in cfg.queues],
        timeouts=Timeouts(
            heartbeat_s=cfg.heartbeat_s,
            unreachable_after_s=3 * cfg.heartbeat_s,
            lost_after_s=6 * cfg.heartbeat_s,
            start_s=300.0,
            checkpoint_grace_s=30.0,
        ),
    )


# ------------------------------------------------------------------------------ world
@dataclass(slots=True)
class AttemptLog:
    """Ground truth for one attempt, kept by the simulated agent (not the broker)."""

    job_id: str
    attempt: int
    cluster: str
    flavor: str
    capacity_type: str
    price: float
    gpus: int
    dispatched_at: float
    start_step: int
    running_at: float | None = None
    ended_at: float | None = None
    end_step: int = 0
    cause: str = ""
    noticed_at: float | None = None  # a spot notice named one of its nodes
    ckpt_steps: list[int] = field(default_factory=list)
    ckpt_times: list[float] = field(default_factory=list)  # when each was written
    speed: float = 1.0  # work per second of one GPU here, relative to a V100
    ckpt_every: float | None = None  # the interval this attempt checkpointed at
    # An elastic attempt's GPU-seconds before its last resize, and when that was.
    gpu_s_before: float = 0.0
    resized_at: float | None = None
    # Where its first placement sat: GPU nodes, the zones and the blocks they span (blocks 0
    # when the pool declares none).
    gpu_nodes: int = 0
    zones: int = 0
    blocks: int = 0

    @property
    def succeeded(self) -> bool:
        return self.cause == "succeeded"

    def held_s(self, now: float) -> float:
        end = self.ended_at if self.ended_at is not None else now
        return max(0.0, end - self.dispatched_at)

    def gpu_s(self, now: float) -> float:
        """GPU-seconds held: each size of an elastic attempt for its time."""
        end = self.ended_at if self.ended_at is not None else now
        since = self.resized_at if self.resized_at is not None else self.dispatched_at
        return self.gpu_s_before + max(0.0, end - since) * self.gpus

    def resize(self, gpus: int, now: float) -> None:
        """The attempt runs on `gpus` GPUs from `now` (an elastic shrink or growth)."""
        self.gpu_s_before = self.gpu_s(now)
        self.resized_at = now
        self.gpus = gpus


BLOCK_LEVEL = "cloud.google.com/gce-topology-block"
HOST_LEVEL = "kubernetes.io/hostname"


def pool_levels(p: PoolSpec) -> tuple[str, ...]:
    """The topology levels a simulated pool reports (none unless its scenario declares them)."""
    if not p.topology:
        return ()
    return (ZONE, BLOCK_LEVEL, HOST_LEVEL) if p.block_nodes else (ZONE, HOST_LEVEL)


# heap event kinds
ARRIVAL, ACK, CLUSTER_DUE = 0, 1, 2
SPOT_TRACE, RECLAIM, TICK, CYCLE, HEARTBEAT, SAMPLE, POISSON, SLOT_RETURN = range(6, 14)
NODE_GONE_SEEN, CANCEL_ARRIVES, NODE_UP = 14, 15, 16
ENDED = frozenset({"succeeded", "failed", "evicted"})
RECLAIMED = "spot-reclaimed"


@dataclass(slots=True)
class Violation:
    at: float
    kind: str
    detail: str


def size_speed(cmd: Dispatch) -> float:
    """An elastic gang's speed at its dispatched size, as a share of its speed at its maximum
    (the broker's own model, `elastic.speed`: linear scaling at 90% efficiency); 1 for a
    gang that is not elastic."""
    return elastic_speed(cmd.spec, {a.podset: len(a.nodes) for a in cmd.assignment})


class ElasticModel(ClusterModel):
    """The fake cluster model, with an elastic workload's step rate following its size: the
    fake backend keeps the rate through a resize (its tests need only the nodes), while the
    simulator's figures need a shrunk gang to be slower and a grown one faster. A node of a
    pool that declares topology reports its zone (and block) where the simulator put it."""

    places: dict[str, tuple[str, str]] | None = None  # node -> (zone, block or "")
    levelled: frozenset[str] = frozenset()  # flavors that report topology

    def _new_node(self, flavor: str, name: str | None = None) -> NodeState:
        n = super()._new_node(flavor, name)
        where = self.places.get(n.name) if self.places is not None else None
        if where is not None and flavor in self.levelled:
            zone, block = where
            n.topology = (zone, block, n.name) if block else (zone, n.name)
        return n

    def resize_workload(self, cmd: Dispatch) -> None:
        wl = self._workloads.get((cmd.job_id, cmd.attempt))
        # The simulator's gangs have one podset: its replicas are the workload's.
        was = (
            elastic_speed(cmd.spec, {p.name: wl.total_replicas for p in cmd.spec.gang})
            if wl is not None
            else 1.0
        )
        super().resize_workload(cmd)
        if wl is None or was <= 0:
            return
        now = self.now()
        if wl.phase == "running":  # the steps so far at the old rate, the rest at the new one
            wl.from_step = wl.step_at(now)
            wl.run_start = now
        wl.rate *= size_speed(cmd) / was
        if wl.phase == "running":
            wl.end_at = wl.done_at()
            self._schedule(wl.end_at, "end", wl)

    def _on_end(self, wl: Any, now: float) -> None:
        """An end scheduled before a shrink moved it later is not the end."""
        if now + 1e-6 < wl.end_at:
            return
        super()._on_end(wl, now)


class SimAgent:
    """One simulated cluster and its agent. The cluster is the fake backend's `ClusterModel`
    on the simulator's virtual clock; around it this plays the agent (batches with a `seq`,
    a snapshot first and after a resync, refusing a deposed leader's commands), keeps the
    ground-truth `AttemptLog`s and applies the policy's view of losses (no notices, or a
    node loss the broker only finds by polling)."""

    def __init__(self, sim: Sim, name: str, pools: Sequence[PoolSpec]) -> None:
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


@dataclass(slots=True)
class Slot:
    """A place for one spot node in a pool; trace node ids are bound to free slots."""

    index: int
    node: str | None = None
    key: tuple[int, str] | None = None  # (trace loop, trace node id)
    generation: int = 0


@dataclass(slots=True)
class SpotPool:
    spec: PoolSpec
    slots: list[Slot]
    zone: int = 0  # which of the pool's zones (each driven by its own trace)
    trace: str | None = None
    phase_s: float = 0.0
    bound: dict[tuple[int, str], int] = field(default_factory=dict)
    carry: list[int] = field(default_factory=list)  # slots kept up across a trace loop
    loop: int = 0


@dataclass(slots=True)
class Sample:
    t: float  # hours since start
    capacity: int  # GPUs on present nodes
    allocated: int  # GPUs held by workloads (starting or running)
    running: int  # GPUs of gangs whose every replica runs
    spot_capacity: int
    pending: int  # queued jobs
    live: int  # live attempts


@dataclass(slots=True)
class SimResult:
    policy: str
    config: dict[str, Any]
    jobs: list[SimJob]
    records: dict[str, JobRecord]
    logs: dict[str, list[AttemptLog]]
    samples: list[Sample]
    violations: list[Violation]
    checks: int
    steps: int
    base: float  # unix seconds at virtual zero
    end: float  # virtual seconds at the end
    wall_s: float
    spot_notices: int
    batch_errors: list[str]
    first_admit: dict[str, float]
    # Autoscaled pools: what every present node cost (idle included), asks, nodes, stockouts.
    capacity_cost_usd: float = 0.0
    provision_asks: int = 0
    provisioned: int = 0
    stockouts: int = 0


class Sim:
    """The discrete-event loop: one heap, one virtual clock, the Machine, the clusters."""

    def __init__(self, cfg: SimConfig, policy: Policy | str = "muster") -> None:
        self.cfg = cfg
        self.policy = POLICIES[policy] if isinstance(policy, str) else policy
        self.spot_rng = random.Random(f"spot-{cfg.seed}")
        self.speed = dict(cfg.gpu_speed)
        self.jobs = make_jobs(cfg)
        self.jobs_by_id = {j.job_id: j for j in self.jobs}
        self.base = 1.5e9  # unix seconds at virtual zero (Philly time is not kept)
        self.now = self.base
        # The clusters' clock: the models count unix seconds too, so due times need no
        # conversion on the way to and from this heap.
        self.clock = ManualClock(t=self.base, unix0=0.0)
        self.machine = Machine(broker_config(cfg, self.policy))
        self.machine.spot_return = self.policy.spot_return
        self.heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self.logs: dict[str, list[AttemptLog]] = {}
        self.live_copies: dict[str, tuple[str, int]] = {}
        # (job, attempt) of each Cancel on its way -> the dispatches ordered after it
        self._cancelling: dict[tuple[str, int | None], list[tuple[SimAgent, Dispatch]]] = {}
        self.node_home: dict[str, tuple[str, str]] = {}
        self.node_place: dict[str, tuple[str, str]] = {}  # node -> (zone, block or "")
        self.node_spans: dict[str, list[float]] = {}  # node -> [up, gone] (unix s): capacity log
        self.violations: list[Violation] = []
        self.batch_errors: list[str] = []
        self.state: dict[str, str] = {}
        self.first_admit: dict[str, float] = {}
        self.samples: list[Sample] = []
        self.spot_notices = 0
        self.notice_log: list[tuple[float, str]] = []  # (virtual s, node): for tests/plots
        self.reclaim_log: list[tuple[float, str]] = []
        self.checks = 0
        self.steps = 0
        self._cycle_pending = False
        self._done_count = 0
        self._touched: set[str] = set()
        self._open: set[str] = set()  # jobs not yet terminal: what a full sweep reads
        self._claims: dict[str, dict[str, int]] = {}
        self._usage: dict[str, int] = {}
        self.pools = on_demand_pools(cfg.pools) if self.policy.on_demand_only else cfg.pools
        # autoscaled pools: asks answered, nodes brought up, stockouts, and what every node
        # present cost (idle or not), summed at each sample
        self.provision_rng = random.Random(f"provision-{cfg.seed}")
        self._asked: set[tuple[str, str, str, float]] = set()
        self.provision_asks = self.provisioned = self.stockouts = 0
        self.capacity_cost = 0.0
        self._sampled_at = self.base
        by_cluster: dict[str, list[PoolSpec]] = {}
        for p in self.pools:
            by_cluster.setdefault(p.cluster, []).append(p)
        self.clusters = {c: SimAgent(self, c, ps) for c, ps in by_cluster.items()}
        self.spot_pools: list[SpotPool] = []
        self._build_nodes()
        for agent in self.clusters.values():
            agent.start()

    # -- heap --------------------------------------------------------------------------
    def push(self, t: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self.heap, (t, self._seq, kind, payload))

    def draw(self, job_id: str, attempt: int, what: str) -> float:
        """A uniform [0, 1) number fixed by (seed, job, attempt, what): the same attempt gets
        the same start-up delay whatever order the machine happened to emit effects in."""
        key = f"{self.cfg.seed}:{job_id}:{attempt}:{what}".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") / 2**64

    def violation(self, now: float, kind: str, detail: str) -> None:
        if len(self.violations) < 1000:
            self.violations.append(Violation(now - self.base, kind, detail))

    # -- world setup -------------------------------------------------------------------
    def _build_nodes(self) -> None:
        for p in self.pools:
            cluster = self.clusters[p.cluster]
            spot_driven = (
                p.capacity_type == "spot"
                and self.cfg.spot != "none"
                and not self.policy.on_demand_only
                and p.autoscale is None
            )
            parts = [(p.trace, p.trace_phase_s, p.nodes), *p.zones]
            if not spot_driven:
                i = 0
                for zone, (_, _, nodes) in enumerate(parts):
                    for index in range(nodes):
                        name = f"{p.cluster}-{p.flavor}-{i:03d}"
                        self._place(p, zone, index, name)
                        cluster.add_node(name, p.flavor)
                        i += 1
                continue
            for zone, (trace, phase, nodes) in enumerate(parts):
                pool = SpotPool(p, [Slot(i) for i in range(nodes)], zone, trace, phase)
                self.spot_pools.append(pool)
                if self.cfg.spot == "poisson" or trace is None:
                    for slot in pool.slots:
                        self._slot_up(pool, slot)
                    self._next_poisson(pool)
                else:
                    self._schedule_trace(pool)

    def capacity_spans(self) -> list[tuple[tuple[str, str], int, float, float]]:
        """Every node's ((cluster, flavor), GPUs, up, gone) in seconds from the start: the
        capacity that was really there, for the hindsight bound (load/oracle.py)."""
        return [
            (self.node_home[name], NODE_GPUS, up - self.base, gone - self.base)
            for name, (up, gone) in self.node_spans.items()
        ]

    def _slot_up(self, pool: SpotPool, slot: Slot) -> None:
        slot.generation += 1
        p = pool.spec
        zone = f"z{pool.zone}-" if pool.zone else ""
        name = f"{p.cluster}-{p.flavor}-{zone}{slot.index:03d}-g{slot.generation}"
        slot.node = name
        self._place(p, pool.zone, slot.index, name)
        self.clusters[p.cluster].add_node(name, p.flavor)

    def _place(self, p: PoolSpec, zone: int, index: int, name: str) -> None:
        """Where a node sits: its pool's zone and, where the pool declares blocks of
        `block_nodes`, its block (slot `index` of the zone)."""
        block = f"z{zone}-b{index // p.block_nodes}" if p.block_nodes else ""
        self.node_place[name] = (f"z{zone}", block)

    def note_span(self, log: AttemptLog, nodes: set[str]) -> None:
        """The zones and blocks an attempt's GPU nodes span (what the report's shares read)."""
        places = [self.node_place.get(n, ("", "")) for n in nodes]
        log.gpu_nodes = len(places)
        log.zones = len({z for z, _ in places})
        log.blocks = len({(z, b) for z, b in places}) if all(b for _, b in places) else 0

    def _schedule_trace(self, pool: SpotPool) -> None:
        """Loop the spot trace over the horizon; the state at the phase is the start."""
        assert pool.trace is not None
        path = self._trace_path(pool.trace)
        events, length_ms = cached_trace(traces.require_trace(path.name, path.parent))
        if not events:
            return
        declared = dict(self.cfg.trace_lengths).get(pool.trace)
        if declared is None and length_ms is not None:
            declared = length_ms / 1000.0  # a count per tick: the trace's own length
        period = traces.trace_period_s([e.seconds for e in events], declared)
        phase = (
            pool.phase_s + self.cfg.trace_phase_s + self.cfg.trace_phase_frac * period
        ) % period
        horizon = (self.jobs[-1].arrival if self.jobs else 0.0) + self.cfg.drain_s
        loops = min(1000, int((phase + horizon) / period) + 1)
        for loop in range(loops):
            for e in events:
                pool_t = loop * period + e.seconds
                if pool_t <= phase:
                    self._trace_apply(pool, loop, e, announce=False)
                elif pool_t - phase <= horizon:
                    self.push(self.base + pool_t - phase, SPOT_TRACE, (pool, loop, e))

    def _trace_path(self, trace: str) -> Path:
        """A short name (`p3`) is bamboo-p3.csv in the traces folder; else a file path
        (relative: from the traces folder)."""
        if "/" in trace or trace.endswith((".csv", ".json")):
            path = Path(trace)
            return path if path.is_absolute() else self.cfg.traces / path
        return self.cfg.traces / f"bamboo-{trace}.csv"

    def _trace_apply(self, pool: SpotPool, loop: int, e: TraceEvent, *, announce: bool) -> None:
        if loop != pool.loop:
            # A new pass over the trace: nodes still up are re-bound to its first adds.
            pool.loop = loop
            pool.carry = [s.index for s in pool.slots if s.node is not None]
            pool.bound = {}
            for s in pool.slots:
                s.key = None
        key = (loop, e.node)
        if e.op == "add":
            if key in pool.bound:
                return
            if pool.carry:
                idx = pool.carry.pop(0)
                pool.bound[key] = idx
                pool.slots[idx].key = key
                return
            free = next((s for s in pool.slots if s.node is None), None)
            if free is None:
                return  # the pool is smaller than the trace's fleet: this node is not ours
            pool.bound[key] = free.index
            free.key = key
            self._slot_up(pool, free)
            return
        if key not in pool.bound:
            return
        slot = pool.slots[pool.bound.pop(key)]
        slot.key = None
        if slot.node is None:
            return
        if not announce:  # before the start: the first snapshot will not have it
            self.clusters[pool.spec.cluster].remove_node(slot.node, reason="node-removed")
            slot.node = None
            return
        self._notice(pool, slot)

    def _notice(self, pool: SpotPool, slot: Slot) -> None:
        """A reclaim: notice now, node gone at the deadline; the slot is busy until then."""
        assert slot.node is not None
        cluster = self.clusters[pool.spec.cluster]
        node = cluster.model.node_state(slot.node)
        if node is None or node.spot_deadline is not None:
            return
        for key in node.workloads:
            log = cluster.live.get(key)
            if log is not None and log.noticed_at is None:
                log.noticed_at = self.now
        lead = NOTICE_S.get(pool.spec.provider, 120.0)
        deadline = self.now + lead
        cluster.model.spot_notice(slot.node, lead)
        self.spot_notices += 1
        self.notice_log.append((self.now - self.base, slot.node))
        self.push(deadline, RECLAIM, (pool, slot, slot.node))

    def _next_poisson(self, pool: SpotPool) -> None:
        """Reclaim instants at rate x slots; each takes 1-4 live nodes at once (Bamboo-like)."""
        mean_group = 2.0
        rate_per_s = self.cfg.poisson_rate * len(pool.slots) / mean_group / 3600.0
        if rate_per_s <= 0:
            return
        self.push(self.now + self.spot_rng.expovariate(rate_per_s), POISSON, pool)

    def _poisson(self, pool: SpotPool) -> None:
        live = [s for s in pool.slots if s.node is not None]
        k = min(len(live), self.spot_rng.choice((1, 1, 2, 4)))
        for slot in self.spot_rng.sample(live, k):
            self._notice(pool, slot)
        self._next_poisson(pool)

    # -- the loop ----------------------------------------------------------------------
    def run(self) -> SimResult:
        started = time.perf_counter()
        cfg = self.cfg
        for job in self.jobs:
            self.push(self.base + job.arrival, ARRIVAL, job)
        for c in self.clusters.values():
            self.push(self.base + _stagger(c.name), HEARTBEAT, c)
        self.push(self.base, TICK, None)
        self.push(self.base, SAMPLE, None)
        self._pump()  # initial snapshots
        end_at = self.base + (self.jobs[-1].arrival if self.jobs else 0.0) + cfg.drain_s
        arrived = 0
        next_report = started + cfg.progress_s
        while self.heap and self.steps < cfg.max_steps:
            t, _, kind, payload = heapq.heappop(self.heap)
            if t > end_at:
                break
            if kind == CLUSTER_DUE and not payload.due(t):
                continue
            self.now = max(self.now, t)
            self.clock.t = self.now
            self.steps += 1
            if kind == ARRIVAL:
                arrived += 1
            self._handle(kind, payload)
            self._pump()
            self._check_touched()
            if self.steps % cfg.full_check_every == 0:
                self.check_all(everything=False)
                if cfg.progress_s > 0 and time.perf_counter() >= next_report:
                    next_report = time.perf_counter() + cfg.progress_s
                    self._progress(started, arrived)
            if arrived == len(self.jobs) and self._all_done():
                break
        self.check_all()
        self._sample()
        return SimResult(
            policy=self.policy.name,
            config=_config_dict(cfg),
            jobs=self.jobs,
            records=self.machine.jobs,
            logs=self.logs,
            samples=self.samples,
            violations=self.violations,
            checks=self.checks,
            steps=self.steps,
            base=self.base,
            end=self.now - self.base,
            wall_s=time.perf_counter() - started,
            spot_notices=self.spot_notices,
            batch_errors=self.batch_errors,
            first_admit=self.first_admit,
            capacity_cost_usd=self.capacity_cost,
            provision_asks=self.provision_asks,
            provisioned=self.provisioned,
            stockouts=self.stockouts,
        )

    def _progress(self, started: float, arrived: int) -> None:
        """One line on stderr: virtual time, jobs done, queue, and how fast time passes."""
        wall = time.perf_counter() - started
        virtual_h = (self.now - self.base) / 3600.0
        views = self.machine.views
        print(
            f"[{self.policy.name} seed {self.cfg.seed}] virtual {virtual_h:7.1f} h | "
            f"arrived {arrived:,}/{len(self.jobs):,} done {self._done_count:,} | "
            f"queued {views.pending_count():,} live {views.live_count():,} | "
            f"wall {wall:6.0f} s, {virtual_h / 24 / max(wall, 1e-9):.2f} virtual days/s, "
            f"{self.steps / max(wall, 1e-9):,.0f} steps/s",
            file=sys.stderr,
            flush=True,
        )

    def _all_done(self) -> bool:
        return self._done_count == len(self.jobs)

    def _handle(self, kind: int, payload: Any) -> None:
        now = self.now
        m = self.machine
        if kind == ARRIVAL:
            job: SimJob = payload
            reply, effects = split_reply(m.handle(SubmitJob(job_spec(job, self.policy)), now))
            if not reply.accepted:
                # Not an invariant: a gang this fleet can never hold (e.g. 16 nodes of
                # on-demand for an on-demand job) is refused at submit, as it should be.
                self.batch_errors.append(f"rejected {job.job_id}: {reply.error}")
                self.state[job.job_id] = "failed"
                self._done_count += 1
            self._execute(effects)
        elif kind == ACK:
            job_id, attempt, ok, error = payload
            self._touched.add(job_id)
            self._execute(m.handle(DispatchAcked(job_id, attempt, ok, error), now))
        elif kind == CLUSTER_DUE:
            payload.advance()
        elif kind == SPOT_TRACE:
            pool, loop, e = payload
            self._trace_apply(pool, loop, e, announce=True)
        elif kind == RECLAIM:
            pool, slot, name = payload
            # (The model reclaims the node at its deadline too; whichever comes first.)
            self.clusters[pool.spec.cluster].remove_node(name, reason=RECLAIMED)
            self.reclaim_log.append((now - self.base, name))
            if slot.node == name:
                slot.node = None
                if self.cfg.spot == "poisson" or pool.spec.trace is None:
                    self.push(
                        now + self.spot_rng.expovariate(1.0 / self.cfg.poisson_down_s),
                        SLOT_RETURN,
                        (pool, slot),
                    )
        elif kind == POISSON:
            self._poisson(payload)
        elif kind == CANCEL_ARRIVES:
            target, cmd = payload
            target.command(cmd, now)
            for waiting, dispatch in self._cancelling.pop((cmd.job_id, cmd.attempt), []):
                waiting.command(dispatch, now)
        elif kind == NODE_GONE_SEEN:
            gone_from, name, found = payload
            gone_from.unreported.discard(name)
            gone_from.outbox.extend(found)
        elif kind == SLOT_RETURN:
            pool, slot = payload
            if slot.node is None:
                self._slot_up(pool, slot)
        elif kind == TICK:
            effects = m.handle(Tick(), now)
            if m.wants_cycle:
                effects.extend(m.handle(Cycle(), now))
                self._cycle_pending = False
            self._execute(effects)
            busy = m.views.pending_count() > 0 or m.views.live_count() > 0
            self.push(now + (self.cfg.tick_s if busy else self.cfg.idle_tick_s), TICK, None)
        elif kind == CYCLE:
            self._cycle_pending = False
            self._execute(m.handle(Cycle(), now))
        elif kind == HEARTBEAT:
            cluster: SimAgent = payload
            cluster.outbox.append(Heartbeat(at=now))
            self.push(now + self.cfg.heartbeat_s, HEARTBEAT, cluster)
        elif kind == SAMPLE:
            self._sample()
            for agent in self.clusters.values():
                agent.consolidate(now)
            self.push(now + self.cfg.sample_s, SAMPLE, None)
        elif kind == NODE_UP:
            agent, flavor = payload
            self.provisioned += 1
            agent.add_node(f"{agent.name}-{flavor}-as{self.provisioned}", flavor)

    def _pump(self) -> None:
        """Deliver every cluster's outbox to the machine until nothing more is said."""
        for _ in range(MAX_PUMP_ROUNDS):
            said = False
            for cluster in self.clusters.values():
                if not cluster.outbox and not cluster.snapshot_due:
                    continue
                for batch in cluster.take_batches(self.now):
                    said = True
                    for e in batch.events:
                        jid = getattr(e, "job_id", None)
                        if jid is not None:
                            self._touched.add(jid)
                    out = self.machine.handle(AgentBatch(cluster.name, batch), self.now)
                    error = refusal(out)
                    if error is not None:
                        self.batch_errors.append(error)
                    self._execute(out)
            if not said:
                break
        else:
            self.violation(self.now, "livelock", "agents and broker kept answering each other")
        if self.machine.wants_cycle and not self._cycle_pending:
            self._cycle_pending = True
            self.push(self.now + self.cfg.cycle_delay_s, CYCLE, None)

    def _execute(self, effects: list[Effect]) -> None:
        for problem in unordered_dispatches(self.machine, effects):
            self.violation(self.now, "unordered-dispatch", problem)
        for eff in effects:
            if isinstance(eff, Send):
                cluster = self.clusters.get(eff.cluster)
                cmd = eff.command
                jid = getattr(cmd, "job_id", None)
                if jid is not None:
                    self._touched.add(jid)
                if cluster is None:
                    self.violation(self.now, "unknown-cluster", eff.cluster)
                    continue
                if isinstance(cmd, Cancel) and self.cfg.cancel_latency_s > 0:
                    self._cancelling.setdefault((cmd.job_id, cmd.attempt), [])
                    self.push(self.now + self.cfg.cancel_latency_s, CANCEL_ARRIVES, (cluster, cmd))
                    continue
                after = eff.after_cancel_of
                if isinstance(cmd, Dispatch) and after is not None and self.cfg.keep_order:
                    held = self._cancelling.get((cmd.job_id, after))
                    if held is not None:
                        held.append((cluster, cmd))
                        continue
                cluster.command(cmd, self.now)
            elif isinstance(eff, Publish):
                self._on_event(eff.event)
            elif isinstance(eff, Persist):
                self._touched.add(eff.record.job_id)

    def _on_event(self, event: JobEvent) -> None:
        jid = event.job_id
        self._touched.add(jid)
        before = self.state.get(jid)
        self.state[jid] = event.state
        if event.kind == "admitted" and jid not in self.first_admit:
            self.first_admit[jid] = event.at
        if event.state in TERMINAL and before not in TERMINAL:
            self._done_count += 1
            self._open.discard(jid)
        elif event.state not in TERMINAL:
            self._open.add(jid)

    # -- invariants --------------------------------------------------------------------
    def _claims_of(self, record: JobRecord) -> dict[str, int]:
        """GPUs per node that the machine's record says this job holds (live + reserved)."""
        claims: dict[str, int] = {}
        per = {p.name: p.gpu for p in record.spec.gang}
        attempts = []
        current = record.current
        if current is not None:
            attempts.append(current)
        if record.preempting is not None and record.preempting.replacement is not None:
            attempts.append(record.preempting.replacement)
        for a in attempts:
            for ps in a.assignment:
                for n in ps.nodes:
                    claims[n] = claims.get(n, 0) + per.get(ps.podset, 0)
        return claims

    def _check_record(self, record: JobRecord, nodes: set[str]) -> None:
        live = [a for a in record.attempts if a.ended_at is None]
        if len(live) > 1 or (live and live[-1] is not record.attempts[-1]):
            self.violation(
                self.now,
                "two-live-attempts",
                f"{record.job_id}: live attempts {[a.attempt for a in live]}",
            )
        attempts = list(live)
        if record.preempting is not None and record.preempting.replacement is not None:
            attempts.append(record.preempting.replacement)
        for a in attempts:
            got = {ps.podset: len(ps.nodes) for ps in a.assignment}
            # Whole, or between an elastic podset's minimum and maximum.
            if not all(p.admits(got.get(p.name, 0)) for p in record.spec.gang):
                self.violation(self.now, "partial-gang", f"{record.job_id}#{a.attempt}")
            for ps in a.assignment:
                for n in ps.nodes:
                    home = self.node_home.get(n)
                    if home != (a.cluster, a.flavor):
                        self.violation(
                            self.now,
                            "gang-split",
                            f"{record.job_id}#{a.attempt} on {a.cluster}/{a.flavor} "
                            f"uses node {n} of {home}",
                        )
        claims = self._claims_of(record)
        old = self._claims.get(record.job_id, {})
        if claims != old:
            for n, g in old.items():
                self._usage[n] = self._usage.get(n, 0) - g
                nodes.add(n)
            for n, g in claims.items():
                self._usage[n] = self._usage.get(n, 0) + g
                nodes.add(n)
            if claims:
                self._claims[record.job_id] = claims
            else:
                self._claims.pop(record.job_id, None)

    def _check_nodes(self, nodes: Iterable[str]) -> None:
        for n in nodes:
            used = self._usage.get(n, 0)
            if used <= 0:
                continue
            home = self.node_home.get(n)
            node = self.clusters[home[0]].model.node_state(n) if home else None
            if node is None:
                if home is not None and n in self.clusters[home[0]].unreported:
                    continue  # the broker cannot know yet: its poll has not come round
                self.violation(self.now, "claim-on-gone-node", f"{n}: {used} GPUs")
            elif used > node.gpu:
                self.violation(self.now, "over-commit", f"{n}: {used} > {node.gpu} GPUs")

    def _check_touched(self) -> None:
        if not self._touched:
            return
        self.checks += 1
        nodes: set[str] = set()
        jobs = self.machine.jobs
        for jid in self._touched:
            record = jobs.get(jid)
            if record is not None:
                self._check_record(record, nodes)
        self._touched.clear()
        self._check_nodes(nodes)

    def check_all(self, *, everything: bool = True) -> None:
        """Every record and every node, not just those touched by the last step. The periodic
        sweep (`everything=False`) reads only open records and those still holding claims: a
        terminal record was checked when it turned terminal, so it costs O(open jobs), not
        O(jobs ever submitted); the final sweep reads them all."""
        self.checks += 1
        for problem in violations(self.machine):
            self.violation(self.now, "core-invariant", problem)
        nodes: set[str] = set()
        jobs = self.machine.jobs
        ids = jobs.keys() if everything else sorted(self._open | self._claims.keys())
        for jid in ids:
            record = jobs.get(jid)
            if record is not None:
                self._check_record(record, nodes)
        usage: dict[str, int] = {}
        for claims in self._claims.values():
            for n, g in claims.items():
                usage[n] = usage.get(n, 0) + g
        if {k: v for k, v in self._usage.items() if v} != usage:
            self.violation(self.now, "accounting", "incremental node usage drifted")
            self._usage = usage
        self._check_nodes(usage)
        for c in self.clusters.values():
            for node in c.model.node_states():
                if node.used_gpu > node.usable_gpu:
                    self.violation(self.now, "cluster-over-commit", f"{node.name}: {node.used_gpu}")

    def provision(self, agent: SimAgent, cmd: Provision, now: float) -> None:
        """The pool's provider: each node comes after a seeded log-normal delay, or none does
        when the ask stocks out. An ask is answered once (the broker may resend it)."""
        spec = agent.pools[cmd.flavor].autoscale
        key = (agent.name, cmd.job_id, cmd.flavor, cmd.deadline)
        if spec is None or key in self._asked:
            return
        self._asked.add(key)
        self.provision_asks += 1
        delays = provider_delays(
            self.provision_rng, cmd.nodes, spec.ready_s, spec.spread, spec.stockout_p
        )
        if not delays:
            self.stockouts += 1
        for delay in delays:
            self.push(now + delay, NODE_UP, (agent, cmd.flavor))

    def _sample(self) -> None:
        cap = spot = alloc = running = 0
        dt_h = (self.now - self._sampled_at) / 3600.0
        self._sampled_at = self.now
        for c in self.clusters.values():
            for node in c.model.node_states():
                self.capacity_cost += node.gpu * c.pools[node.flavor].price * dt_h
                cap += node.gpu
                if c.pools[node.flavor].capacity_type == "spot":
                    spot += node.gpu
            for log in c.live.values():
                alloc += log.gpus
                if log.running_at is not None:
                    running += log.gpus
        self.samples.append(
            Sample(
                t=(self.now - self.base) / 3600.0,
                capacity=cap,
                allocated=alloc,
                running=running,
                spot_capacity=spot,
                pending=self.machine.views.pending_count(),
                live=self.machine.views.live_count(),
            )
        )


def _stagger(name: str) -> float:
    """Spread heartbeats of different clusters over a second, deterministically."""
    return (sum(name.encode()) % 100) / 100.0


def _config_dict(cfg: SimConfig) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in cfg.__dataclass_fields__:
        v = getattr(cfg, k)
        if k == "pools":
            v = [p.flavor + "@" + p.cluster + f"x{p.nodes}" for p in v]
        elif isinstance(v, Path):
            v = v.name
        elif isinstance(v, tuple):
            v = list(v)
        out[k] = v
    return out


def run(cfg: SimConfig, policy: str) -> SimResult:
    return Sim(cfg, policy).run()


def bound_for(sim: Sim, result: SimResult, *, timed: bool = False) -> Bound:
    """The bound for the jobs a finished run completed, on the capacity that run had; `timed`:
    each job also done no later than the run finished it (the cheapest way to match the
    run's completion times, a tighter bound for that run)."""
    from load import oracle  # SciPy: only when a bound is asked for

    mapped = dict(sim.policy.capacity_map)
    pools = [
        oracle.BoundPool(
            (p.cluster, p.flavor), p.capacity_type, p.price, sim.speed.get(p.gpu_type, 1.0)
        )
        for p in sim.pools
    ]
    jobs = [
        oracle.BoundJob(
            j.arrival,
            j.gpus,
            float(j.gpus * j.duration),
            mapped.get(j.capacity, j.capacity),
            r.finished_at - result.base if timed and r.finished_at is not None else None,
        )
        for j in result.jobs
        if (r := result.records.get(j.job_id)) is not None and r.state == "succeeded"
    ]
    capacity = oracle.slot_capacity(sim.capacity_spans(), result.end)
    return oracle.hindsight_bound(jobs, pools, capacity, result.end)


def _run_summary(args: tuple[SimConfig, str]) -> dict[str, Any]:
    """One run's summary row, with the hindsight bound for the jobs it completed."""
    from load.oracle import bound_summary
    from load.report import summarize

    sim = Sim(*args)
    result = sim.run()
    summary = summarize(result)
    bound, timed = bound_for(sim, result), bound_for(sim, result, timed=True)
    summary.update(bound_summary(bound, summary, timed))
    return {"summary": summary, "series": _series(result)}


def _series(result: SimResult) -> dict[str, Any]:
    """What the plots need, small enough to send back from a worker process."""
    from load.report import jct_hours, lost_by_job, queue_delays_s

    return {
        "jct_h": jct_hours(result),
        "queue_s": queue_delays_s(result),
        "lost_gpu_h": lost_by_job(result),
        "finish_h": sorted(
            (r.finished_at - result.base) / 3600.0
            for r in result.records.values()
            if r.finished_at is not None
        ),
        "samples": [
            [s.t, s.capacity, s.allocated, s.running, s.spot_capacity, s.pending]
            for s in result.samples
        ],
    }


def _finite(value: Any) -> Any:
    """JSON has no inf/NaN: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


class _Spot(StrEnum):
    """`--spot`: where the reclaims come from."""

    trace = "trace"
    poisson = "poisson"
    none = "none"


app = program()


@app.command(
    help="Replay Philly jobs and Bamboo spot reclaims through the Muster core under a virtual "
    "clock and compare recovery policies."
)
def sim(
    jobs: Annotated[int, typer.Option(min=1)] = 3000,
    offset: Annotated[int, typer.Option(min=0, help="first Philly row")] = _DEFAULTS.offset,
    compress: Annotated[float, typer.Option(min=0.0)] = _DEFAULTS.compress,
    max_duration_h: Annotated[float, typer.Option(min=0.0)] = _DEFAULTS.max_duration_s / 3600,
    drain_h: Annotated[
        float,
        typer.Option(min=0.0, help="stop this long after the last arrival even if jobs are left"),
    ] = _DEFAULTS.drain_s / 3600,
    policy: Annotated[
        str,
        typer.Option(
            help="a policy, a comma-separated list, both (muster+scratch), all, or compare "
            "(the baselines side by side: " + ", ".join(COMPARISON) + ", with the ablations "
            "and elastic)"
        ),
    ] = "both",
    windows: Annotated[
        int,
        typer.Option(
            help="also replay this many further Philly windows (each WINDOW_STRIDE rows later)"
        ),
    ] = 1,
    spot: _Spot = _Spot.trace,
    poisson_rate: Annotated[float, typer.Option(min=0.0)] = _DEFAULTS.poisson_rate,
    scale: Annotated[float, typer.Option(min=0.0, help="multiply every pool's node count")] = 1.0,
    seed: int = 1,
    seeds: Annotated[int, typer.Option(help="run seeds seed..seed+n-1, medians")] = 1,
    workers: Annotated[int, typer.Option(min=1, help="processes (one run each)")] = 2,
    out: Annotated[str, typer.Option(help="folder for PNGs ('' = no plots)")] = "docs/img",
    json_out: Annotated[str | None, typer.Option("--json", help="write the summaries here")] = None,
    scenario: Annotated[
        str | None,
        typer.Option(
            help="YAML file with the pools, spot traces, GPU speeds and checkpoint costs "
            "(see load/scenarios/)"
        ),
    ] = None,
    traces_dir: Annotated[
        str | None,
        typer.Option(help="folder holding philly.csv and the bamboo-*.csv spot traces"),
    ] = None,
    progress: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="print a progress line to stderr every this many wall seconds (0 = never)",
        ),
    ] = 15.0,
) -> None:
    options = {k: v for k, v in locals().items() if k not in ("json_out", "spot")}
    raise typer.Exit(_run(Options(**options, json=json_out, spot=spot.value)))


WINDOW_STRIDE = 7919  # Philly rows between the windows of `--windows`


def config_from_args(args: Options, seed: int, window: int = 0) -> SimConfig:
    pools = tuple(replace(p, nodes=max(1, round(p.nodes * args.scale))) for p in _DEFAULTS.pools)
    cfg = SimConfig(
        jobs=args.jobs,
        offset=(args.offset + window * WINDOW_STRIDE) % 82_247,
        compress=args.compress,
        max_duration_s=args.max_duration_h * 3600.0,
        drain_s=args.drain_h * 3600.0,
        seed=seed,
        # Each further seed also replays the spot traces from another point, spread over the
        # whole of each trace (golden-ratio steps), not only its first hours.
        trace_phase_frac=((seed - args.seed) * GOLDEN) % 1.0,
        pools=pools,
        spot=args.spot,
        poisson_rate=args.poisson_rate,
        progress_s=args.progress,
    )
    if args.traces_dir:
        folder = Path(args.traces_dir)
        cfg = replace(cfg, philly=folder / "philly.csv", traces=folder)
    if args.scenario:
        from load.scenario import apply_scenario, load_scenario

        cfg = apply_scenario(cfg, load_scenario(args.scenario))
        scaled = (
            replace(p, nodes=max(0 if p.autoscale else 1, round(p.nodes * args.scale)))
            for p in cfg.pools
        )
        cfg = replace(cfg, pools=tuple(scaled))
    return cfg


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m load.sim ARGS` as a function: its exit status."""
    return run_command(app, sys.argv[1:] if argv is None else argv, "python -m load.sim")


def _run(args: Options) -> int:
    from load import report

    if args.policy == "both":
        names = ["muster", "scratch"]
    elif args.policy == "all":
        names = list(POLICIES)
    elif args.policy == "compare":
        names = [*COMPARISON, *ABLATIONS, *EXTENSIONS]
    else:
        names = [n.strip() for n in args.policy.split(",")]
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        print(f"unknown policy {unknown}; choose from {sorted(POLICIES)}", file=sys.stderr)
        return 2
    seeds = list(range(args.seed, args.seed + max(1, args.seeds)))
    if args.scenario:
        try:
            config_from_args(args, args.seed)
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 2
    windows = range(max(1, args.windows))
    tasks = [(config_from_args(args, s, w), n) for s in seeds for w in windows for n in names]
    cfg0 = tasks[0][0]
    try:  # one clear line, not a traceback from a worker, when a trace is not there
        traces.require_trace(cfg0.philly.name, cfg0.philly.parent)
    except traces.MissingTraceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    if args.workers > 1 and len(tasks) > 1:
        from concurrent.futures import ProcessPoolExecutor

        load_philly(tasks[0][0].philly)  # parse once before forking
        with ProcessPoolExecutor(max_workers=min(args.workers, len(tasks))) as pool:
            outputs = list(pool.map(_run_summary, tasks))
    else:
        outputs = [_run_summary(t) for t in tasks]
    runs = [
        {"policy": n, "seed": cfg.seed, "offset": cfg.offset, **out}
        for (cfg, n), out in zip(tasks, outputs, strict=True)
    ]
    print(report.format_table(runs))
    if {"on-demand-only", "checkpoint-restart"} & set(names):
        print()
        print(report.format_comparison(runs))
    print(f"\n{len(tasks)} run(s) in {time.perf_counter() - started:.1f}s wall")
    if args.out:
        for path in report.plot_all(runs, Path(args.out)):
            print(f"wrote {path}")
        if {"on-demand-only", "checkpoint-restart"} & set(names):
            print(f"wrote {report.plot_comparison(runs, Path(args.out))}")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": _finite(runs)}, indent=1, default=str))
        print(f"wrote {args.json}")
    bad = sum(r["summary"]["violations"] for r in runs)
    return 1 if bad else 0


if __name__ == "__main__":
    app(prog_name="python -m load.sim")
