"""The simulator's ground truth and shared vocabulary: attempt logs, heap event kinds, spot
slots, samples and the run's result, and the fake cluster model with elastic speeds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agents.config import ZONE_LABEL as ZONE
from agents.fake.model import (
    ClusterModel,
    NodeState,
)
from broker.core.elastic import speed as elastic_speed
from broker.core.records import JobRecord
from load.sim.jobs import (
    SimJob,
)
from load.simconfig import (
    PoolSpec,
)
from schemas.agent import (
    Dispatch,
)

NODE_GPUS = 8
NODE_CPU = "96"
NODE_MEMORY = "1152Gi"


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
    gpu_type: str = ""  # the pool's GPU type (V100, A100, T4, ...)
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
