"""A simulated GPU cluster as a pure model over an injected clock.

Nodes, GPUs, gang workloads that step and checkpoint, spot notices, and the fences by which
an attempt must stop. Nothing here reads the wall clock or awaits: the fake backend
(agents/fake/cluster.py) runs it on real time, tests drive a `ManualClock` by hand.

Why it looks like this: 50 clusters x 200 nodes must be cheap in one process, so the model is
driven by a heap of due times (no task per workload, no per-tick scan), and a workload's step
is computed from the clock only when something is due. Every duration in the config and in
the injection API is in simulated seconds; deadlines on the wire (SpotNotice.deadline,
NodeInfo.spot_deadline) are unix seconds, converted through the clock's `scale`.

The same model is the simulator's cluster (load/sim/, on a virtual clock): how fast an
attempt steps, what its checkpoints cost and how long it takes to start are a
`WorkloadTiming` per dispatch, the fake backend's fixed config being the default.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from agents.backend import BackendError, Emit, LogTail, NodeOpResult, pick_nodes
from agents.config import ZONE_LABEL, FakeAutoscale, FakeClusterConfig, FakeFlavor
from agents.fake.output import simulated_output
from agents.fake.trace import TraceEvent, load_bamboo
from schemas.agent import (
    AgentEvent,
    CheckpointReport,
    ClusterSnapshot,
    Dispatch,
    FlavorInfo,
    GpuHealth,
    LogRequest,
    NodeGone,
    NodeInfo,
    NodeOpName,
    NodeUpsert,
    SpotNotice,
    WorkloadStatus,
)
from schemas.job import Simulation
from schemas.quantity import cpu_milli, memory_bytes

DEFAULT_SIMULATION = Simulation()  # 100 steps at 10 steps/s, a checkpoint every 10 steps
MAX_DUE_PER_TICK = 200_000  # bounds one `advance`

Demand = tuple[str, int, int, int]  # node, gpu, cpu_milli, memory bytes of one replica


def ignore_event(_: AgentEvent) -> None:
    return None


class Clock(Protocol):
    """Simulated seconds (`now`), the unix time they correspond to, and how many simulated
    seconds pass per unix second (`scale`)."""

    scale: float

    def now(self) -> float: ...

    def unix(self) -> float: ...


@dataclass(slots=True)
class ManualClock:
    """A clock that moves only when told to: tests and simulations step it."""

    t: float = 0.0
    unix0: float = 1_700_000_000.0
    scale: float = 1.0

    def now(self) -> float:
        return self.t

    def unix(self) -> float:
        return self.unix0 + self.t / self.scale

    def advance(self, seconds: float) -> None:
        self.t += max(0.0, seconds)


def _ignore_due(_: float) -> None:
    return None


def _raise(_: str, exc: Exception) -> None:
    raise exc


@dataclass(frozen=True, slots=True)
class WorkloadTiming:
    """How one attempt spends time: its start-up, its speed, and what checkpoints cost it.

    The fake backend uses one for every dispatch (from its config); the simulator gives each
    attempt its own (GPU type, the job's checkpoint cost, the broker's advised interval)."""

    start_delay_s: float = 1.0  # created -> running
    restore_s: float = 0.0  # added to the start delay when resuming from a checkpoint
    speed: float = 1.0  # multiplies the job's steps_per_second (a faster GPU type)
    # Periodic checkpoints every this many seconds of compute since the run began, each one
    # pausing the steps for `checkpoint_stall_s`. None: every `Simulation.checkpoint_every`
    # steps, at no cost; inf: none (the workload checkpoints only when asked).
    checkpoint_every_s: float | None = None
    checkpoint_stall_s: float = 0.0
    checkpoint_write_s: float = 0.0  # an asked-for checkpoint is written this much later


def _pods(cmd: Dispatch) -> list[tuple[str, str]]:
    """(podset-replica, node) per replica of the assignment."""
    return [(f"{a.podset}-{r}", node) for a in cmd.assignment for r, node in enumerate(a.nodes)]


@dataclass(slots=True)
class AttemptRecord:
    """What one attempt of a job did on this cluster (tests read `cluster.history[job_id]`).

    `end_phase` is None while the attempt lives, then succeeded | failed | evicted | cancelled.
    Progress lost by an eviction is `last_step - (last_checkpoint_step or started_from_step)`."""

    attempt: int
    cluster: str
    flavor: str
    started_from_step: int
    last_step: int
    end_phase: str | None = None
    reason: str = ""
    nodes: list[str] = field(default_factory=list)
    last_checkpoint_step: int | None = None
    checkpoints: int = 0
    saved: list[int] = field(default_factory=list)  # every step it checkpointed, in order
    created_at: float = 0.0  # unix seconds
    running_at: float | None = None
    ended_at: float | None = None
    pods: list[tuple[str, str]] = field(default_factory=list)  # (podset-replica, node)
    log_every: int = 1  # the simulated workload prints a line every this many steps


def provider_delays(
    rng: random.Random, count: int, delay_s: float, spread: float, stockout_p: float
) -> list[float]:
    """A provider's answer to an ask for `count` nodes: each one's delay to Ready, log-normal
    around `delay_s` (sigma `spread`), or none at all when the ask stocks out."""
    if stockout_p and rng.random() < stockout_p:
        return []
    return [delay_s * (math.exp(rng.gauss(0.0, spread)) if spread else 1.0) for _ in range(count)]


@dataclass(slots=True, eq=False)
class _Grow:
    """A node the provider will bring up for an autoscaled flavor (an entry of the heap)."""

    flavor: str
    alive: bool = True


NO_SCALE = FakeAutoscale()


@dataclass(slots=True, eq=False)
class NodeState:
    """One node's shape and what is placed on it; the fake and local backends keep these."""

    name: str
    flavor: str
    gpu: int
    cpu_milli: int
    memory: int
    gpu_healthy: int | None = None
    spot_deadline: float | None = None  # unix seconds
    notice_id: int = 0
    used_gpu: int = 0
    used_cpu: int = 0
    used_memory: int = 0
    workloads: set[tuple[str, int]] = field(default_factory=set)
    alive: bool = True
    topology: tuple[str, ...] = ()  # its value per topology level of the cluster
    cordon_note: str = ""  # set while an operator has cordoned it: why, for `muster clusters`

    @property
    def usable_gpu(self) -> int:
        return self.gpu if self.gpu_healthy is None else self.gpu_healthy

    def info(self) -> NodeInfo:
        return NodeInfo(
            name=self.name,
            flavor=self.flavor,
            gpu=self.gpu,
            cpu_milli=self.cpu_milli,
            memory=self.memory,
            gpu_healthy=self.gpu_healthy,
            spot_deadline=self.spot_deadline,
            topology=self.topology,
            no_new_pods=bool(self.cordon_note),
            note=self.cordon_note,
        )

    def take(self, gpu: int, cpu: int, memory: int) -> None:
        self.used_gpu += gpu
        self.used_cpu += cpu
        self.used_memory += memory

    def give_back(self, gpu: int, cpu: int, memory: int) -> None:
        self.used_gpu = max(0, self.used_gpu - gpu)
        self.used_cpu = max(0, self.used_cpu - cpu)
        self.used_memory = max(0, self.used_memory - memory)

    def clear(self) -> None:
        """Back to empty and unannounced, as a node that rejoins after a reclaim."""
        self.spot_deadline = None
        self.cordon_note = ""
        self.used_gpu = self.used_cpu = self.used_memory = 0
        self.workloads.clear()


def cordon_note(reason: str) -> str:
    return f"cordoned by an operator: {reason}"[:1000] if reason else "cordoned by an operator"


def drain_reason(reason: str) -> str:
    """The eviction reason of an attempt a drain ends (an infrastructure loss, not a cancel)."""
    return f"node-drained: {reason}"[:1000] if reason else "node-drained"


class _Announcer(Protocol):
    cluster: str

    def spot_notice(self, node: str, lead_s: float | None = None) -> float | None: ...

    def capacity_of(self, node: str) -> str: ...

    def report(self, event: AgentEvent) -> None: ...


def operate(
    cluster: _Announcer,
    nodes: Mapping[str, NodeState],
    op: NodeOpName,
    node: str | None,
    reason: str,
    drain: Callable[[str, str], list[tuple[str, int]]],
) -> NodeOpResult:
    """An operator's action on fake or local `nodes` (see NodeOpRequest): cordon and uncordon
    set the node's note and report it; a drain also ends what runs there through `drain`."""
    names = pick_nodes(cluster.cluster, nodes, node)
    if op == "notice":
        return NodeOpResult(notice_nodes(cluster, names, node), [])
    ended: list[tuple[str, int]] = []
    for name in names:
        n = nodes[name]
        n.cordon_note = cordon_note(reason) if op != "uncordon" else ""
        cluster.report(NodeUpsert(node=n.info()))
        if op == "drain":
            ended += drain(name, drain_reason(reason))
    return NodeOpResult(names, ended)


def notice_nodes(cluster: _Announcer, names: list[str], node: str | None) -> list[str]:
    """An operator's spot notice (fake and local clusters): one named spot node only."""
    if node is None:
        raise BackendError(
            f"a spot notice names one node of cluster {cluster.cluster!r}; `--all` is not "
            "accepted for notices"
        )
    kind = cluster.capacity_of(node)
    if kind != "spot":
        raise BackendError(
            f"node {node!r} of cluster {cluster.cluster!r} is {kind} capacity; only spot "
            "nodes get spot notices (drain it to move what runs there)"
        )
    cluster.spot_notice(node)
    return names


HOST_LABELS = frozenset({"kubernetes.io/hostname", "cloud.google.com/gce-topology-host"})


def fake_topology(levels: Sequence[str], where: tuple[str, str, str], name: str) -> tuple[str, ...]:
    """A fake node's value per level: the zone for the zone label, its name for a host label,
    and for the other levels in order its block, then its rack, then its name."""
    zone, block, rack = where
    inner = iter((block, rack))
    out = []
    for level in levels:
        if level == ZONE_LABEL:
            out.append(zone)
        elif level in HOST_LABELS:
            out.append(name)
        else:
            out.append(next(inner, name))
    return tuple(out)


def check_capacity(nodes: Mapping[str, NodeState], demands: Iterable[Demand]) -> None:
    """Refuse demands that do not fit every node's free GPUs, CPU and memory, as a kubelet
    refuses pods that do not fit."""
    need: dict[str, list[int]] = {}
    for node_name, gpu, cpu, mem in demands:
        acc = need.setdefault(node_name, [0, 0, 0])
        acc[0] += gpu
        acc[1] += cpu
        acc[2] += mem
    for node_name, (gpu, cpu, mem) in need.items():
        n = nodes[node_name]
        if n.used_gpu + gpu > n.usable_gpu:
            raise BackendError(
                f"node {node_name} over-committed: {gpu} GPUs asked, "
                f"{n.usable_gpu - n.used_gpu} free"
            )
        if n.used_cpu + cpu > n.cpu_milli:
            raise BackendError(
                f"node {node_name} over-committed: {cpu}m CPU asked, "
                f"{n.cpu_milli - n.used_cpu}m free"
            )
        if n.used_memory + mem > n.memory:
            raise BackendError(
                f"node {node_name} over-committed: {mem} bytes of memory asked, "
                f"{n.memory - n.used_memory} free"
            )


def gang_demands(cmd: Dispatch, nodes: Mapping[str, NodeState], cluster: str) -> list[Demand]:
    """What each replica of the dispatched gang asks of its node; refuses an assignment that
    does not match the gang or names a node this cluster does not have (any backend)."""
    podsets = {p.name: p for p in cmd.spec.gang}
    out: list[Demand] = []
    if not cmd.assignment:
        raise BackendError("dispatch has an empty assignment")
    for a in cmd.assignment:
        ps = podsets.get(a.podset)
        if podsets and ps is None:
            raise BackendError(f"assignment names podset {a.podset!r} not in the job's gang")
        if ps is not None and not ps.admits(len(a.nodes)):
            raise BackendError(
                f"podset {a.podset!r} has {ps.replicas} replicas but the assignment "
                f"lists {len(a.nodes)} nodes"
            )
        gpu = ps.gpu if ps is not None else 0
        cpu = cpu_milli(ps.cpu) if ps is not None else 0
        mem = memory_bytes(ps.memory) if ps is not None else 0
        for node_name in a.nodes:
            node = nodes.get(node_name)
            if node is None:
                raise BackendError(f"node {node_name!r} is not in cluster {cluster}")
            if gpu > 0 and node.flavor != cmd.flavor:
                raise BackendError(
                    f"node {node_name!r} is flavor {node.flavor!r}, not {cmd.flavor!r}"
                )
            out.append((node_name, gpu, cpu, mem))
    missing = set(podsets) - {a.podset for a in cmd.assignment}
    if missing:
        raise BackendError(f"assignment is missing podsets {sorted(missing)}")
    return out


@dataclass(slots=True, eq=False)
class _Workload:
    job_id: str
    attempt: int
    flavor: str
    nodes: list[str]  # distinct nodes, in assignment order
    demands: list[Demand]  # per replica
    total_replicas: int
    sim: Simulation
    from_step: int
    end_step: int
    fails: bool
    ckpt_base: str  # "" = the job set no checkpoint location: it never checkpoints
    record: AttemptRecord
    phase: str = "created"
    run_start: float = 0.0  # simulated seconds
    next_ckpt: int = 0
    last_ckpt: int | None = None
    alive: bool = True
    rate: float = 1.0  # steps per second of compute
    every_s: float | None = None  # WorkloadTiming.checkpoint_every_s
    stall_s: float = 0.0  # per periodic checkpoint, when `every_s` is finite
    write_s: float = 0.0  # an asked-for checkpoint
    end_at: float = math.inf  # simulated seconds; set when it runs
    ckpt_pending: bool = False  # an asked-for checkpoint is being written

    @property
    def key(self) -> tuple[str, int]:
        return (self.job_id, self.attempt)

    @property
    def stalls(self) -> bool:
        """Periodic checkpoints pause the steps (none without a place to write them)."""
        every = self.every_s
        return (
            self.stall_s > 0 and every is not None and math.isfinite(every) and bool(self.ckpt_base)
        )

    def step_at(self, now: float) -> int:
        """Progress: compute time at `rate`, minus the stalls of periodic checkpoints."""
        if self.phase != "running":
            return self.from_step
        if now >= self.end_at:
            return self.end_step
        t = max(0.0, now - self.run_start)
        if self.stalls:
            assert self.every_s is not None
            cycle = self.every_s + self.stall_s
            k = int(t // cycle)
            t = k * self.every_s + min(t - k * cycle, self.every_s)
        return min(self.end_step, self.from_step + int(t * self.rate + 1e-9))

    def time_of_step(self, step: int) -> float:
        """When `step` is reached (no stalls: step-based checkpoints cost nothing)."""
        return self.run_start + (step - self.from_step) / self.rate

    def done_at(self) -> float:
        """When the last step is done: compute time plus one stall per checkpoint before it."""
        compute = (self.end_step - self.from_step) / self.rate
        if not self.stalls:
            return self.run_start + compute
        assert self.every_s is not None
        stalls = max(0, math.ceil(compute / self.every_s - 1e-9) - 1)
        return self.run_start + compute + stalls * self.stall_s


class ClusterModel:
    """A simulated cluster: nodes per flavor, gang workloads that step and checkpoint, and an
    injection API (spot notices, GPU failures, node churn) for tests and load. Time moves only
    through the clock; `advance()` then runs whatever fell due."""

    def __init__(self, cluster: str, config: FakeClusterConfig, clock: Clock) -> None:
        self.cluster = cluster
        self.config = config
        self.clock = clock
        self.history: dict[str, list[AttemptRecord]] = {}
        self.emit: Emit = ignore_event
        # Called with each newly scheduled due time, so a real-time driver can wake early.
        self.on_schedule: Callable[[float], None] = _ignore_due
        # Called when a due event fails; the default raises (the fake backend logs instead,
        # so a bug in one workload does not stop its cluster).
        self.on_error: Callable[[str, Exception], None] = _raise
        # How each dispatched attempt spends time; the default is the config's.
        self.timing: Callable[[Dispatch], WorkloadTiming] = self._config_timing
        self._default_timing = WorkloadTiming(
            start_delay_s=config.start_delay_s, checkpoint_write_s=config.checkpoint_write_s
        )
        self._rng = random.Random(self.config.seed)
        self._levels = config.topology.levels if config.topology is not None else []
        self._placed: dict[str, int] = {}  # flavor -> nodes given a topology place so far
        self._flavors: dict[str, FakeFlavor] = {f.name: f for f in self.config.flavors}
        self._flavor_infos = [
            FlavorInfo(
                name=f.name,
                capacity_type=f.capacity_type,
                gpu_type=f.gpu_type,
                price_per_gpu_hour=f.price_per_gpu_hour,
                gpu_memory_mib=f.gpu_memory_mib,
                topology_levels=tuple(self._levels),
            )
            for f in self.config.flavors
        ]
        self._next_index: dict[str, int] = dict.fromkeys(self._flavors, 0)
        self._nodes: dict[str, NodeState] = {}
        self._workloads: dict[tuple[str, int], _Workload] = {}
        # Fences: unix time by which each attempt must have stopped unless extended. Kept by
        # the "cluster", not the agent, as a pod's activeDeadlineSeconds is kept by the kubelet:
        # a frozen or dead agent cannot keep its workloads alive past it.
        self._fences: dict[tuple[str, int], float] = {}
        # (until, attempt) for every fence set, earliest first: `enforce_fences` runs on every
        # command and looks only at the fences that can be due. An entry whose fence was
        # extended or whose workload ended is stale and dropped when it comes up.
        self._fence_due: list[tuple[float, tuple[str, int]]] = []
        self._fence_after: dict[tuple[str, int], float] = {}  # as dispatched
        self._heap: list[tuple[float, int, str, Any, int]] = []
        self._counter = itertools.count()
        self._notice_ids = itertools.count(1)
        self._next_poisson = math.inf
        self._trace: list[tuple[float, str, str, float]] = []  # (due, op, node, lead)
        self._trace_pos = 0
        self.counters: dict[str, int] = {
            "dispatched": 0,
            "resized": 0,
            "succeeded": 0,
            "failed": 0,
            "evicted": 0,
            "cancelled": 0,
            "checkpoints": 0,
            "spot_notices": 0,
            "nodes_removed": 0,
            "provision_asks": 0,
            "provisioned_nodes": 0,
            "stockouts": 0,
        }
        self._asked: set[tuple[str, str, float]] = set()  # (job, flavor, deadline) asked
        self._coming: dict[str, int] = {}  # flavor -> nodes the provider is bringing up
        for fl in self.config.flavors:
            for _ in range(fl.nodes):
                self._new_node(fl.name)
        if self.config.trace is not None:
            self._load_trace()
        self._resample_poisson()

    # -- clock ---------------------------------------------------------------------------
    def now(self) -> float:
        """Simulated seconds on this cluster's clock."""
        return self.clock.now()

    def _unix_at(self, sim_t: float) -> float:
        return self.clock.unix() + (sim_t - self.clock.now()) / self.clock.scale

    def advance(self) -> None:
        """Run everything due by the clock's now: fences, workload steps, trace and Poisson
        spot arrivals."""
        self.enforce_fences()
        now = self.now()
        self._process_due(now)
        self._trace_due(now)
        self._poisson_due(now)

    def next_due(self) -> float:
        """The simulated time of the next thing `advance` would do (inf when idle); entries of
        ended workloads and removed nodes are dropped, so they wake no one."""
        heap = self._heap
        while heap and not heap[0][3].alive:
            heapq.heappop(heap)
        nxt = heap[0][0] if heap else math.inf
        if self._trace_pos < len(self._trace):
            nxt = min(nxt, self._trace[self._trace_pos][0])
        return min(nxt, self._next_poisson)

    # -- what a cluster is asked to do -----------------------------------------------------
    def view(self) -> ClusterSnapshot:
        self.enforce_fences()
        now = self.now()
        return ClusterSnapshot(
            flavors=list(self._flavor_infos),
            nodes=[n.info() for n in self._nodes.values()],
            workloads=[self._status(w, w.phase, now) for w in self._workloads.values()],
        )

    def create(self, cmd: Dispatch) -> None:
        """Validate the assignment against real node capacity, then create the workload."""
        self.enforce_fences()
        key = (cmd.job_id, cmd.attempt)
        if key in self._workloads:
            return
        if cmd.flavor not in self._flavors:
            raise BackendError(
                f"cluster {self.cluster} has no flavor {cmd.flavor!r}; "
                f"known: {sorted(self._flavors)}"
            )
        demands = self._demands(cmd)
        if self.config.enforce_capacity:
            check_capacity(self._nodes, demands)
        sim = cmd.spec.workload.simulate or DEFAULT_SIMULATION
        from_step = cmd.resume_from.step if cmd.resume_from is not None else 0
        fails = sim.fail_at_step is not None and from_step <= sim.fail_at_step < sim.total_steps
        end_step = sim.fail_at_step if fails and sim.fail_at_step is not None else sim.total_steps
        end_step = max(end_step, from_step)
        nodes = list(dict.fromkeys(d[0] for d in demands))
        timing = self.timing(cmd)
        # A job without checkpoint settings has nowhere to write one: it never checkpoints
        # (a preemption costs it everything since the start), as a real one would.
        base = cmd.checkpoint_uri or (cmd.spec.checkpoint.uri if cmd.spec.checkpoint else "")
        base = base.rstrip("/")
        record = AttemptRecord(
            attempt=cmd.attempt,
            cluster=self.cluster,
            flavor=cmd.flavor,
            started_from_step=from_step,
            last_step=from_step,
            nodes=nodes,
            last_checkpoint_step=cmd.resume_from.step if cmd.resume_from is not None else None,
            created_at=self.clock.unix(),
            pods=_pods(cmd),
            log_every=sim.checkpoint_every,
        )
        wl = _Workload(
            job_id=cmd.job_id,
            attempt=cmd.attempt,
            flavor=cmd.flavor,
            nodes=nodes,
            demands=demands,
            total_replicas=len(demands),
            sim=sim,
            from_step=from_step,
            end_step=end_step,
            fails=fails,
            ckpt_base=base,
            record=record,
            last_ckpt=record.last_checkpoint_step,
            rate=sim.steps_per_second * timing.speed,
            every_s=timing.checkpoint_every_s,
            stall_s=timing.checkpoint_stall_s,
            write_s=timing.checkpoint_write_s,
        )
        for node_name, gpu, cpu, mem in demands:
            node = self._nodes[node_name]
            node.take(gpu, cpu, mem)
            node.workloads.add(key)
        self._workloads[key] = wl
        self._fence_after[key] = cmd.fence_after_s
        self.history.setdefault(cmd.job_id, []).append(record)
        self.counters["dispatched"] += 1
        self.emit(self._status(wl, "created", self.now()))
        delay = timing.start_delay_s + (timing.restore_s if from_step > 0 else 0.0)
        self._schedule(self.now() + delay, "run", wl)

    def resize_workload(self, cmd: Dispatch) -> None:
        """A running attempt's nodes changed in place (an elastic gang): replicas on nodes the
        revision drops end and give their capacity back, new ones take theirs; progress and
        the attempt go on."""
        wl = self._workloads.get((cmd.job_id, cmd.attempt))
        if wl is None:
            raise BackendError(f"attempt {cmd.attempt} of job {cmd.job_id} does not run here")
        demands = self._demands(cmd)  # refuses nodes this cluster does not have, first
        for node_name, gpu, cpu, mem in wl.demands:
            node = self._nodes.get(node_name)
            if node is not None:
                node.give_back(gpu, cpu, mem)
                node.workloads.discard(wl.key)
        for node_name, gpu, cpu, mem in demands:
            node = self._nodes[node_name]
            node.take(gpu, cpu, mem)
            node.workloads.add(wl.key)
        wl.demands = demands
        wl.nodes = list(dict.fromkeys(d[0] for d in demands))
        wl.total_replicas = len(demands)
        wl.record.nodes = list(wl.nodes)
        wl.record.pods = _pods(cmd)
        self.counters["resized"] += 1

    def set_fence(self, job_id: str, attempt: int, until: float) -> None:
        """The attempt must stop by `until` (unix seconds) unless fenced again later; a fence
        that has already lapsed cannot be extended (the workload is gone)."""
        self.enforce_fences()
        key = (job_id, attempt)
        if key in self._workloads and until > self._fences.get(key, 0.0):
            self._fences[key] = until
            due = self._fence_due
            heapq.heappush(due, (until, key))
            if len(due) > 2 * len(self._fences) + 64:  # mostly stale: keep it bounded
                due[:] = [(t, k) for k, t in self._fences.items()]
                heapq.heapify(due)

    def fence_after(self, job_id: str, attempt: int) -> float:
        """The fence window the attempt was dispatched with, for an agent that restarts."""
        return self._fence_after.get((job_id, attempt), 0.0)

    def enforce_fences(self) -> None:
        """End every workload whose fence lapsed, as of the moment it lapsed: whatever was
        frozen since (this process stopped) never ran past it."""
        due = self._fence_due
        if not due:
            return
        unix = self.clock.unix()
        while due and due[0][0] <= unix:
            until, key = heapq.heappop(due)
            if self._fences.get(key) != until:
                continue  # extended since, or the workload ended
            del self._fences[key]
            wl = self._workloads.get(key)
            if wl is None:
                continue
            sim_at = self.now() - (unix - until) * self.clock.scale
            reason = "fence lapsed: no word from the broker in time; stopped by the cluster"
            self._end(wl, "evicted", reason, sim_at)
            wl.record.ended_at = until
            self.counters["fenced"] = self.counters.get("fenced", 0) + 1

    def remove(self, job_id: str, attempt: int | None, reason: str) -> None:
        """Silent removal: no status is emitted, the next snapshot simply omits the workload."""
        if attempt is not None:
            keys = [(job_id, attempt)] if (job_id, attempt) in self._workloads else []
        else:
            keys = [k for k in self._workloads if k[0] == job_id]
        now = self.now()
        for key in keys:
            self._end(self._workloads[key], "cancelled", reason or "cancelled", now, emit=False)

    def checkpoint(self, job_id: str, attempt: int) -> None:
        """Write a checkpoint of the current step (after the timing's `checkpoint_write_s`;
        lost if the workload ends first); no-op when the workload is unknown, not running yet
        (nothing new to save), has no checkpoint location (it cannot save) or is already
        writing one (a second request asks for the same checkpoint)."""
        wl = self._workloads.get((job_id, attempt))
        if wl is None or wl.phase != "running" or not wl.ckpt_base or wl.ckpt_pending:
            return
        now = self.now()
        step = wl.step_at(now)
        if wl.write_s <= 0:
            self._write_checkpoint(wl, step)
        else:
            wl.ckpt_pending = True
            self._schedule(now + wl.write_s, "ckpt_now", wl, step)

    def logs(self, req: LogRequest) -> LogTail:
        """What the simulated workload printed (agents/fake/output.py), while its nodes last."""
        record = next(
            (r for r in self.history.get(req.job_id, []) if r.attempt == req.attempt), None
        )
        if record is None:
            raise BackendError(
                f"attempt {req.attempt} of job {req.job_id} never ran on cluster {self.cluster}"
            )
        gone = [n for n in record.nodes if n not in self._nodes]
        if gone:
            raise BackendError(
                f"attempt {req.attempt} of job {req.job_id} on cluster {self.cluster}: its pods "
                f"are gone with node {gone[0]}"
            )
        pods = [
            (pod, node)
            for pod, node in record.pods
            if (req.podset is None or pod.rsplit("-", 1)[0] == req.podset)
            and (req.replica is None or pod.rsplit("-", 1)[1] == str(req.replica))
        ]
        if not pods:
            known = ", ".join(p for p, _ in record.pods)
            raise BackendError(f"attempt {req.attempt} has no such pod; its pods are: {known}")
        wl = self._workloads.get((req.job_id, req.attempt))
        step = wl.step_at(self.now()) if wl is not None else record.last_step
        lines = simulated_output(
            pods,
            attempt=record.attempt,
            from_step=record.started_from_step,
            step=step,
            every=record.log_every,
            last_checkpoint=record.last_checkpoint_step,
            ended=record.end_phase,
            reason=record.reason,
            tail=req.tail_lines,
        )
        return LogTail(lines=lines, ended=record.end_phase is not None)

    # -- injection API -------------------------------------------------------------------
    def spot_notice(self, node: str, lead_s: float | None = None) -> float | None:
        """Announce that `node` is reclaimed in `lead_s` simulated seconds (default
        `spot_notice_s`). Returns the unix deadline, or None when the node is unknown."""
        n = self._nodes.get(node)
        if n is None:
            return None
        if n.spot_deadline is not None:
            return n.spot_deadline
        lead = self.config.spot_notice_s if lead_s is None else max(0.0, lead_s)
        due = self.now() + lead
        n.spot_deadline = self._unix_at(due)
        n.notice_id = next(self._notice_ids)
        self.counters["spot_notices"] += 1
        self.emit(SpotNotice(node=node, deadline=n.spot_deadline, reason="spot-interruption"))
        self._schedule(due, "reclaim", n, n.notice_id)
        return n.spot_deadline

    def apply_node_op(self, op: NodeOpName, node: str | None, reason: str) -> NodeOpResult:
        """An operator's cordon, uncordon, drain or spot notice (see NodeOpRequest); a drain
        evicts what runs on the node, as a reclaim does, so the broker moves it."""
        return operate(self, self._nodes, op, node, reason, self._drain_node)

    def _drain_node(self, name: str, reason: str) -> list[tuple[str, int]]:
        n = self._nodes[name]
        ended = sorted(n.workloads)
        self._evict_on(n, reason)
        return ended

    def fail_gpu(self, node: str, count: int = 1, xid: int = 79) -> bool:
        """`count` GPUs of `node` fail with an XID; workloads there are evicted."""
        n = self._nodes.get(node)
        if n is None:
            return False
        n.gpu_healthy = max(0, n.usable_gpu - max(0, count))
        reason = f"gpu-failure-xid-{xid}"
        self.emit(GpuHealth(node=node, healthy=n.gpu_healthy, xid=xid, reason=reason))
        self._evict_on(n, reason)
        return True

    def add_node(self, flavor: str, name: str | None = None) -> str:
        """Add a node of `flavor` (named `<cluster>-<flavor>-<i>` unless given); emits it."""
        if flavor not in self._flavors:
            raise KeyError(f"cluster {self.cluster} has no flavor {flavor!r}")
        n = self._new_node(flavor, name)
        self.emit(NodeUpsert(node=n.info()))
        self._resample_poisson()
        return n.name

    def grow(self, job_id: str, flavor: str, count: int, deadline: float = 0.0) -> int:
        """An autoscaler asked for `count` nodes of `flavor` for a job: each comes up after
        the flavor's `autoscale` delay (log-normal, from the seeded generator), or none does
        when the request stocks out; no more than the provider's own `max_nodes` (nodes there
        and coming) ever come. Returns the nodes that will come; asking again with the same
        deadline changes nothing (the broker resends until acknowledged)."""
        fl = self._flavors.get(flavor)
        if fl is None:
            raise BackendError(f"cluster {self.cluster} has no flavor {flavor!r}")
        key = (job_id, flavor, deadline)
        if key in self._asked:
            return 0
        self._asked.add(key)
        scale = fl.autoscale or NO_SCALE
        now = self.now()
        self.counters["provision_asks"] += 1
        delays = provider_delays(self._rng, count, scale.delay_s, scale.spread, scale.stockout_p)
        if scale.max_nodes:
            have = len(self.nodes_of(flavor)) + self._coming.get(flavor, 0)
            delays = delays[: max(0, scale.max_nodes - have)]
        if not delays or any(a <= now < b for a, b in scale.stockouts):
            self.counters["stockouts"] += 1
            return 0
        for delay in delays:
            self._schedule(now + delay, "grow", _Grow(flavor))
        self._coming[flavor] = self._coming.get(flavor, 0) + len(delays)
        return len(delays)

    def remove_node(self, node: str, reason: str = "node-removed") -> bool:
        """The node disappears now (no notice); its workloads are evicted with `reason`."""
        n = self._nodes.get(node)
        if n is None:
            return False
        self._evict_on(n, reason)
        n.alive = False
        del self._nodes[node]
        self.counters["nodes_removed"] += 1
        self.emit(NodeGone(node=node, reason=reason))
        self._resample_poisson()
        return True

    # -- views for tests and load --------------------------------------------------------
    @property
    def nodes(self) -> list[str]:
        return list(self._nodes)

    def capacity_of(self, node: str) -> str:
        return self._flavors[self._nodes[node].flavor].capacity_type

    def report(self, event: AgentEvent) -> None:
        self.emit(event)

    def node_info(self, node: str) -> NodeInfo | None:
        n = self._nodes.get(node)
        return None if n is None else n.info()

    def nodes_of(self, flavor: str) -> list[str]:
        return [n.name for n in self._nodes.values() if n.flavor == flavor]

    def workload(self, job_id: str, attempt: int) -> WorkloadStatus | None:
        wl = self._workloads.get((job_id, attempt))
        return None if wl is None else self._status(wl, wl.phase, self.now())

    def live_workloads(self) -> list[tuple[str, int]]:
        self.enforce_fences()
        return list(self._workloads)

    def free_gpus(self, node: str) -> int:
        n = self._nodes[node]
        return n.usable_gpu - n.used_gpu

    def node_state(self, node: str) -> NodeState | None:
        """The node's record (read it, do not change it), or None when it is gone."""
        return self._nodes.get(node)

    def node_states(self) -> Iterable[NodeState]:
        """Every present node's record, in the order the nodes joined."""
        return self._nodes.values()

    # -- internals -----------------------------------------------------------------------
    def _new_node(self, flavor: str, name: str | None = None) -> NodeState:
        fl = self._flavors[flavor]
        if name is None:
            while True:
                i = self._next_index[flavor]
                self._next_index[flavor] = i + 1
                name = f"{self.cluster}-{flavor}-{i}"
                if name not in self._nodes:
                    break
        elif name in self._nodes:
            return self._nodes[name]
        topology: tuple[str, ...] = ()
        if self._levels:
            i = self._placed.get(flavor, 0)
            self._placed[flavor] = i + 1
            topology = fake_topology(self._levels, fl.place(i), name)
        n = NodeState(
            name=name,
            flavor=flavor,
            gpu=fl.gpu_per_node,
            cpu_milli=cpu_milli(fl.cpu),
            memory=memory_bytes(fl.memory),
            topology=topology,
        )
        self._nodes[name] = n
        return n

    def _config_timing(self, _: Dispatch) -> WorkloadTiming:
        return self._default_timing

    def _demands(self, cmd: Dispatch) -> list[Demand]:
        return gang_demands(cmd, self._nodes, self.cluster)

    def _status(
        self,
        wl: _Workload,
        phase: str,
        now: float,
        reason: str = "",
        codes: list[int] | None = None,
    ) -> WorkloadStatus:
        running = wl.total_replicas if phase == "running" else 0
        return WorkloadStatus(
            job_id=wl.job_id,
            attempt=wl.attempt,
            phase=phase,  # type: ignore[arg-type]
            running_replicas=running,
            total_replicas=wl.total_replicas,
            exit_codes=codes or [],
            reason=reason,
            step=wl.step_at(now),
            nodes=list(wl.nodes),
        )

    def _schedule(self, due: float, kind: str, obj: Any, arg: int = 0) -> None:
        heapq.heappush(self._heap, (due, next(self._counter), kind, obj, arg))
        self.on_schedule(due)
        if len(self._heap) > 4 * (len(self._workloads) + len(self._nodes)) + 10_000:
            self._compact_heap()

    def _compact_heap(self) -> None:
        """Drop entries of ended workloads and removed nodes so churn cannot grow the heap."""
        self._heap = [e for e in self._heap if getattr(e[3], "alive", True)]
        heapq.heapify(self._heap)

    def _write_checkpoint(self, wl: _Workload, step: int) -> None:
        if step >= wl.end_step or (wl.last_ckpt is not None and step <= wl.last_ckpt):
            return  # nothing new, or nothing left to resume
        wl.last_ckpt = step
        wl.record.last_checkpoint_step = step
        wl.record.checkpoints += 1
        wl.record.saved.append(step)
        wl.record.last_step = max(wl.record.last_step, step)
        self.counters["checkpoints"] += 1
        self.emit(
            CheckpointReport(
                job_id=wl.job_id,
                attempt=wl.attempt,
                step=step,
                uri=f"{wl.ckpt_base}/step-{step}",
                at=self.clock.unix(),
            )
        )

    def _end(
        self,
        wl: _Workload,
        phase: str,
        reason: str,
        now: float,
        *,
        emit: bool = True,
        codes: list[int] | None = None,
    ) -> None:
        step = wl.step_at(now)
        status = self._status(wl, phase, now, reason, codes) if emit else None
        wl.alive = False
        self._workloads.pop(wl.key, None)
        self._fences.pop(wl.key, None)
        self._fence_after.pop(wl.key, None)
        for node_name, gpu, cpu, mem in wl.demands:
            node = self._nodes.get(node_name)
            if node is not None:
                node.give_back(gpu, cpu, mem)
                node.workloads.discard(wl.key)
        rec = wl.record
        rec.last_step = max(rec.last_step, step)
        rec.end_phase = phase
        rec.reason = reason
        rec.ended_at = self.clock.unix()
        self.counters[phase] = self.counters.get(phase, 0) + 1
        if status is not None:
            self.emit(status)

    def _evict_on(self, node: NodeState, reason: str) -> None:
        now = self.now()
        for key in sorted(node.workloads):
            wl = self._workloads.get(key)
            if wl is not None:
                self._end(wl, "evicted", reason, now)

    def _reclaim(self, node: NodeState, notice_id: int) -> None:
        if node.alive and node.notice_id == notice_id and node.name in self._nodes:
            self.remove_node(node.name, reason="spot-reclaimed")

    def _on_run(self, wl: _Workload, now: float) -> None:
        wl.phase = "running"
        wl.run_start = now
        wl.record.running_at = self.clock.unix()
        self.emit(self._status(wl, "running", now))
        wl.end_at = wl.done_at()
        if wl.every_s is not None:
            if wl.ckpt_base and now + wl.every_s < wl.end_at:
                self._schedule(now + wl.every_s + wl.stall_s, "ckpt", wl)
        else:
            k = wl.sim.checkpoint_every
            wl.next_ckpt = (wl.from_step // k + 1) * k
            if wl.ckpt_base and wl.next_ckpt < wl.end_step:
                self._schedule(wl.time_of_step(wl.next_ckpt), "ckpt", wl)
        self._schedule(wl.end_at, "end", wl)

    def _on_ckpt(self, wl: _Workload, now: float) -> None:
        if wl.every_s is not None:  # every so many seconds of compute, after the stall
            if now + wl.every_s < wl.end_at:
                self._schedule(now + wl.every_s + wl.stall_s, "ckpt", wl)
            self._write_checkpoint(wl, wl.step_at(now))
            return
        step = wl.step_at(now)
        k = wl.sim.checkpoint_every
        latest = (step // k) * k
        if latest >= wl.next_ckpt:
            self._write_checkpoint(wl, latest)
            wl.next_ckpt = latest + k
            if wl.next_ckpt < wl.end_step:
                self._schedule(wl.time_of_step(wl.next_ckpt), "ckpt", wl)
        elif wl.next_ckpt < wl.end_step:  # float rounding: come back a moment later
            self._schedule(now + 0.5 / wl.rate, "ckpt", wl)

    def _on_end(self, wl: _Workload, now: float) -> None:
        if wl.fails:
            reason = f"exit code {wl.sim.exit_code} at step {wl.end_step}"
            self._end(wl, "failed", reason, now, codes=[wl.sim.exit_code])
        else:
            self._end(wl, "succeeded", "", now, codes=[0])

    def _process_due(self, now: float) -> None:
        heap = self._heap
        for _ in range(MAX_DUE_PER_TICK):
            if not heap or heap[0][0] > now:
                break
            _, _, kind, obj, arg = heapq.heappop(heap)
            if not obj.alive:
                continue
            try:
                if kind == "run":
                    self._on_run(obj, now)
                elif kind == "ckpt":
                    self._on_ckpt(obj, now)
                elif kind == "end":
                    self._on_end(obj, now)
                elif kind == "ckpt_now":
                    obj.ckpt_pending = False
                    self._write_checkpoint(obj, arg)
                elif kind == "reclaim":
                    self._reclaim(obj, arg)
                elif kind == "grow":
                    obj.alive = False
                    self._coming[obj.flavor] -= 1
                    self.add_node(obj.flavor)
                    self.counters["provisioned_nodes"] += 1
            except Exception as exc:
                self.on_error(kind, exc)

    # -- spot arrivals: Poisson and trace ------------------------------------------------
    def _spot_candidates(self) -> list[NodeState]:
        return [
            n
            for n in self._nodes.values()
            if n.spot_deadline is None and self._flavors[n.flavor].capacity_type == "spot"
        ]

    def _resample_poisson(self) -> None:
        rate_h = self.config.spot_rate_per_node_hour
        if rate_h <= 0:
            self._next_poisson = math.inf
            return
        n = sum(
            1 for nd in self._nodes.values() if self._flavors[nd.flavor].capacity_type == "spot"
        )
        if n == 0:
            self._next_poisson = math.inf
            return
        self._next_poisson = self.now() + self._rng.expovariate(rate_h * n / 3600.0)

    def _poisson_due(self, now: float) -> None:
        if now < self._next_poisson:
            return
        candidates = self._spot_candidates()
        if candidates:
            self.spot_notice(self._rng.choice(candidates).name)
        self._resample_poisson()

    def _load_trace(self) -> None:
        tr = self.config.trace
        assert tr is not None
        events: list[TraceEvent] = load_bamboo(tr.path, tr.max_events)
        lead = self.config.spot_notice_s
        pending: list[tuple[float, str, str, float]] = []
        added: dict[str, float] = {}
        for ev in events:
            name = f"{self.cluster}-{tr.flavor}-{ev.node}"
            if ev.time_ms <= tr.start_ms:
                if ev.op == "add":
                    self._new_node(tr.flavor, name)
                else:
                    n = self._nodes.pop(name, None)
                    if n is not None:
                        n.alive = False
                continue
            t = (ev.time_ms - tr.start_ms) / 1000.0 / tr.speedup
            if ev.op == "add":
                added[name] = t
                pending.append((t, "add", name, 0.0))
            else:
                # Announced `lead` before the removal, as the provider would, but never
                # before the node exists; the removal itself lands at the trace's time.
                due = max(t - lead, added.get(name, 0.0))
                pending.append((due, "remove", name, t - due))
        pending.sort(key=lambda x: (x[0], x[1] == "remove"))
        self._trace = pending
        self._trace_pos = 0

    def _trace_due(self, now: float) -> None:
        tr = self.config.trace
        if tr is None:
            return
        for _ in range(MAX_DUE_PER_TICK):
            if self._trace_pos >= len(self._trace) or self._trace[self._trace_pos][0] > now:
                break
            _, op, name, lead = self._trace[self._trace_pos]
            self._trace_pos += 1
            if op == "add":
                if name not in self._nodes:
                    self.add_node(tr.flavor, name)
            else:
                self.spot_notice(name, lead_s=lead)

    def trace_remaining(self) -> int:
        return len(self._trace) - self._trace_pos
