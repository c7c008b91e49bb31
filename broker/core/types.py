"""Plain value types shared by the scheduling core and the job lifecycle machine.

Everything in `broker/core` is pure and synchronous: no awaits, no I/O, no clock reads, no
logging. Time always arrives as an argument (`now`, unix seconds).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from schemas.job import CapacityPreference

PoolKey = tuple[str, str]  # (cluster, flavor): one pool of identical capacity
# An amount of capacity: (GPUs, cpu millicores, memory bytes). A plain tuple: summed and
# compared in the scheduler's innermost loops.
Vec = tuple[int, int, int]


class PodSetDemand(NamedTuple):
    """Per-replica needs of one podset, in integers (cpu millicores, memory bytes). A named
    tuple, not a dataclass: gang shapes key the scheduler's per-cycle caches and are hashed
    for every queue head a cycle examines; a tuple hashes in C."""

    podset: str
    replicas: int
    gpu: int
    cpu_milli: int
    memory: int
    # Fabric resources per replica, (name, amount) sorted by name (hugepages in bytes).
    extended: tuple[tuple[str, int], ...] = ()


class TopologyNeed(NamedTuple):
    """Where a gang's GPU replicas must (or should) stay: level names, each a node label
    (`cloud.google.com/gce-topology-block`) or its short name (`block`; see topology.py).
    `spread` lets a multi-node gang span zones (by default it stays within one zone).
    `within`: a domain path (values of the pool's first levels) the replicas must stay in: a
    running gang's own domain, for the replicas it grows back (Scheduler.grow)."""

    required: tuple[str, ...] = ()
    preferred: tuple[str, ...] = ()
    spread: bool = False
    within: tuple[str, ...] = ()


@dataclass(slots=True)
class GangRequest:
    """What the scheduler needs to know about one pending job."""

    job_id: str
    attempt: int  # the attempt an admission would create (allocations are keyed by both)
    queue: str
    priority: int
    order: int  # FIFO key inside a queue: lower = earlier (submission sequence)
    podsets: tuple[PodSetDemand, ...]
    gpu_types: frozenset[str] = frozenset()  # empty = any GPU type
    capacity: CapacityPreference = "any"
    # Pools to skip for this attempt (the one just lost); the caller expires them.
    avoid_pools: frozenset[PoolKey] = frozenset()
    # For a `spot-then-on-demand` job that has fallen back: on-demand only.
    spot_exhausted: bool = False
    # Seconds between checkpoints we expect (for the risk term); None = no checkpoints.
    checkpoint_interval_s: float | None = None
    # Whether an `any` or `spot-then-on-demand` job may go to spot at its price. False for a
    # job that writes no checkpoint (a reclaim loses all its work): `any` takes on-demand
    # first, spot only when no on-demand pool could ever host the gang; `spot-then-on-demand`
    # takes whichever is cheaper with that loss priced into spot (placement.capacity_rank).
    spot_ok: bool = True
    # Partial admission: podset -> fewest replicas it may start with (absent = all of them)
    min_replicas: dict[str, int] = field(default_factory=dict)
    # Elastic podsets (elastic.py): asked for at their maximum; the note says how many came.
    elastic: frozenset[str] = frozenset()
    # Topology levels the gang requires or prefers; None = the default (one zone when
    # the gang spans nodes).
    topology: TopologyNeed | None = None
    # The job's own relative speeds by GPU type (speed.job_figures); empty = the broker's
    # priors. Placement divides a pool's cost by the speed: it ranks by cost per unit of work.
    speeds: tuple[tuple[str, float], ...] = ()
    # `assigner.shape_of(self)`, kept by the scheduler the first time it needs it (a request
    # is asked about in every cycle while it waits). Not an input: `replace` starts it afresh.
    shape_memo: tuple[object, ...] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    # GPUs of the whole gang, summed once: every cycle reads it of each request it keeps
    # waiting (the spot waits), and `replace` sums it afresh. Podsets are not changed in place.
    total_gpu: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.total_gpu = sum(p.replicas * p.gpu for p in self.podsets)

    @property
    def total_cpu_milli(self) -> int:
        return sum(p.replicas * p.cpu_milli for p in self.podsets)

    @property
    def total_memory(self) -> int:
        return sum(p.replicas * p.memory for p in self.podsets)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a whole gang goes: one cluster, one flavor, one node per replica."""

    cluster: str
    flavor: str
    flavor_class: str
    # (podset name, node name per replica, in replica order)
    assignment: tuple[tuple[str, tuple[str, ...]], ...]
    expected_cost_per_hour: float = 0.0
    # Set under partial admission: how many replicas of how many, and what kept the rest out.
    note: str = ""

    @property
    def pool(self) -> PoolKey:
        return (self.cluster, self.flavor)

    @property
    def nodes(self) -> frozenset[str]:
        return frozenset(n for _, nodes in self.assignment for n in nodes)


ReasonCode = Literal[
    "unknown-queue",
    "no-clusters",
    "no-matching-flavor",  # no flavor has an accepted GPU type / capacity type
    "gang-too-large",  # could never fit, even on an empty cluster x flavor
    "insufficient-capacity",  # would fit an empty pool, does not fit now (per-node packing)
    "quota-exceeded",  # nominal + borrowable quota does not cover it
    "cohort-exhausted",  # borrowing would exceed what the cohort lends
    "strict-fifo-blocked",  # a StrictFIFO queue's head is blocked
    "cluster-unhealthy",
    "circuit-open",  # the pool's dispatch breaker is open: its dispatches failed (health.py)
    "pool-avoided",  # the pool that just lost this job is avoided for this attempt
    "backoff",  # waiting before the next attempt
    "waiting-for-preemption",  # victims chosen; waiting for them to end
    "preemption-protected",  # victims exist but ran less than the minimum runtime: wait for it
    "max-admissions",  # the cycle's admission budget ran out
    "spot-first",  # per pool: fits on-demand, but the job waits for spot first
    "spot-held",  # spot fits, but an earlier spot-only job waits for it (placement.py)
    "fits-now",  # per pool: nothing binds; the next cycle can admit it here
    "topology-unfit",  # fits the pool, but no single domain of the level it needs (topology.py)
    "waiting-for-nodes",  # an autoscaled pool is adding nodes for this gang (provision.py)
]


class Bound(NamedTuple):
    """The numbers behind a refusal: of `resource`, `used` is in use, `needed` is what the
    gang asks for, `limit` is the most that may be in use (quota or capacity). Amounts are in
    the core's units: GPUs, cpu millicores, memory bytes."""

    resource: str
    used: int
    needed: int
    limit: int


@dataclass(frozen=True, slots=True)
class Reason:
    """Why a job is not admitted (typed; rendered by `muster why`)."""

    code: ReasonCode
    message: str
    cluster: str | None = None
    flavor: str | None = None
    bound: Bound | None = None  # the binding constraint's numbers, when one binds


@dataclass(slots=True)
class Preemption:
    """The scheduler wants `victims` ended so that `preemptor` fits on `pool`."""

    preemptor: str
    victims: tuple[str, ...]
    pool: PoolKey
    kind: Literal["within-queue", "reclaim"]


@dataclass(slots=True, frozen=True)
class Ask:
    """Grow `flavor` of `cluster` by `nodes` for `job_id`'s gang (the `provision` command,
    provision.py); `deadline` is when the wait counts as a stockout."""

    job_id: str
    cluster: str
    flavor: str
    nodes: int
    deadline: float


@dataclass(slots=True)
class CycleResult:
    admitted: list[tuple[str, Placement]] = field(default_factory=list)
    preemptions: list[Preemption] = field(default_factory=list)
    pending: dict[str, tuple[Reason, ...]] = field(default_factory=dict)
    provisions: list[Ask] = field(default_factory=list)  # pools asked to grow, one per job
    # job -> why it skipped spot an earlier spot-only job waits for (placement.spot_kept_for)
    spot_held: dict[str, str] = field(default_factory=dict)


def add_amounts(into: dict[str, int], amounts: Mapping[str, int], sign: int) -> None:
    """Add (sign 1) or take away (sign -1) named amounts; a name at zero is dropped."""
    for res, amount in amounts.items():
        left = into.get(res, 0) + sign * amount
        if left:
            into[res] = left
        else:
            into.pop(res, None)
