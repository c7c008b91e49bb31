"""Client-facing replies, events and the request/reply API on `muster.api.<verb>` (JSON)."""

from __future__ import annotations

from typing import Annotated, Generic, Literal, TypeVar

import msgspec
from msgspec import Meta

from schemas.job import JobSpec

JobState = Literal[
    "queued",  # waiting for admission (possibly backing off)
    "admitted",  # placed and dispatched; not every replica runs yet
    "running",  # every replica of the current attempt runs
    "preempting",  # the current attempt is being ended (checkpoint requested or deadline)
    "succeeded",
    "failed",
    "cancelled",
]
TERMINAL_STATES: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})

EventKind = Literal[
    "queued",
    "admitted",
    "running",
    "restarted",  # containers restarted in place; the attempt goes on (reason says which)
    "checkpointed",
    "checkpoint-refused",  # a reported checkpoint outside the job's location (reason says)
    "preempting",
    "resized",  # an elastic gang lost or gained replicas in place; the attempt goes on
    "requeued",
    "succeeded",
    "failed",
    "cancelled",
]


class SubmitReply(msgspec.Struct, omit_defaults=True):
    accepted: bool
    job_id: str | None = None
    error: str | None = None
    duplicate: bool = False  # the job_id was known already; nothing new was created


class JobEvent(msgspec.Struct, omit_defaults=True):
    """Published on `muster.events.job.<job_id>`."""

    job_id: str
    kind: EventKind
    at: float
    state: JobState
    attempt: int = 0
    cluster: str | None = None
    flavor: str | None = None
    reason: str | None = None
    step: int | None = None
    resume_from_step: int | None = None
    accounting: Accounting | None = None  # on terminal events: what the whole job cost


# -- requests ---------------------------------------------------------------------------


class JobRef(msgspec.Struct, forbid_unknown_fields=True):
    job_id: Annotated[str, Meta(min_length=1, max_length=63)]


class CancelRequest(msgspec.Struct, forbid_unknown_fields=True):
    job_id: Annotated[str, Meta(min_length=1, max_length=63)]
    reason: Annotated[str, Meta(max_length=1024)] = "cancelled by user"


class ListRequest(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    queue: str | None = None
    state: JobState | None = None
    cluster: str | None = None
    limit: Annotated[int, Meta(ge=1, le=10_000)] = 1000


class Empty(msgspec.Struct, forbid_unknown_fields=True):
    pass


# -- views ------------------------------------------------------------------------------


class CheckpointView(msgspec.Struct, omit_defaults=True):
    step: int
    uri: str
    at: float = 0.0
    attempt: int = 0


class AttemptView(msgspec.Struct, omit_defaults=True):
    attempt: int
    cluster: str
    flavor: str
    capacity_type: str = ""
    gpu_type: str = ""
    dispatched_at: float = 0.0
    running_at: float | None = None
    ended_at: float | None = None
    end_cause: str | None = None  # preempted, node-lost, gpu-failure, cluster-lost, error, ...
    resume_from_step: int | None = None
    gpu_seconds: float = 0.0
    gpu_seconds_lost: float = 0.0
    cost: float = 0.0


class Accounting(msgspec.Struct, omit_defaults=True):
    attempts: int = 0
    preemptions: int = 0
    errors: int = 0
    gpu_seconds_used: float = 0.0
    gpu_seconds_lost: float = 0.0
    goodput: float = 1.0  # useful / used GPU-seconds
    cost: float = 0.0


class JobView(msgspec.Struct, omit_defaults=True):
    job_id: str
    name: str
    queue: str
    state: JobState
    priority: int
    submitted_at: float
    gpus: int
    attempt: int = 0
    cluster: str | None = None
    flavor: str | None = None
    reason: str | None = None
    # A queued or preempting job: the short form of `muster why` (code: first message)
    waiting: str | None = None
    latest_checkpoint: CheckpointView | None = None
    # A placed elastic job: its current and target size ("worker runs 3 of 8 replicas
    # (min 2; grows back when its pool has room)")
    size: str | None = None
    attempts: list[AttemptView] = []
    accounting: Accounting = msgspec.field(default_factory=Accounting)
    spec: JobSpec | None = None


class ReasonBound(msgspec.Struct, omit_defaults=True):
    """The numbers of a binding constraint: of `resource`, `used` is in use, the job needs
    `needed`, at most `limit` may be in use. GPUs in devices, cpu in cores, memory in bytes."""

    resource: str  # gpu | cpu | memory
    used: float
    needed: float
    limit: float


class PendingReason(msgspec.Struct, omit_defaults=True):
    """Why a job is not admitted, per the core's typed reasons."""

    code: str
    message: str
    cluster: str | None = None
    flavor: str | None = None
    bound: ReasonBound | None = None


class WhyView(msgspec.Struct, omit_defaults=True):
    job_id: str
    state: JobState
    reasons: list[PendingReason] = []
    position: int | None = None  # place in its queue, 0 = head
    queue: str | None = None
    # What it waits for: quota | capacity | checkpoint | backoff | gpu-type | cluster | cycle
    waiting_for: str | None = None
    # One entry per known cluster x flavor: the binding constraint there, with numbers
    candidates: list[PendingReason] = []
    # The expected cost per unit of work of its pool (or the best) and of the next-best one
    work_price: str | None = None


class ResourceUsage(msgspec.Struct, omit_defaults=True):
    resource: str  # gpu | cpu | memory
    nominal: int | None = None  # None = unlimited
    borrowing_limit: int | None = None
    lending_limit: int | None = None
    used: int = 0
    borrowed: int = 0
    lent: int = 0


class FlavorUsage(msgspec.Struct, omit_defaults=True):
    flavor: str
    resources: list[ResourceUsage] = []


class QueueView(msgspec.Struct, omit_defaults=True):
    name: str
    cohort: str | None
    strategy: str
    weight: float
    pending: int = 0
    admitted: int = 0
    dominant_share: float = 0.0
    flavors: list[FlavorUsage] = []
    # No quotas configured: any flavor, without limit. False with no `flavors`: a queue whose
    # quota lists no flavor class (an imported Kueue ClusterQueue without resourceGroups), which
    # admits nothing.
    unlimited: bool = False


class FlavorView(msgspec.Struct, omit_defaults=True):
    name: str
    capacity_type: str
    gpu_type: str
    price_per_gpu_hour: float
    flavor_class: str
    nodes: int = 0
    gpu_total: int = 0
    gpu_free: int = 0
    draining_nodes: int = 0
    interruptions: int = 0
    interruption_rate_per_node_hour: float = 0.0
    # Spot pools: the prior rate the estimate starts from (config spot_prior_rate)
    interruption_prior: float | None = None
    # The pool's dispatch breaker (broker/core/health.py): "" while closed with no failures,
    # else closed | open | half-open, with the failures in a row and the latest cause.
    breaker: str = ""
    breaker_failures: int = 0
    breaker_reason: str = ""
    # An autoscaled pool (FlavorInfo.provision): the nodes it may reach (0 = not autoscaled),
    # the nodes asked for and not come yet, and its recent stockouts (a count that halves
    # every scheduling.stockout_half_life_s).
    autoscale_max_nodes: int = 0
    nodes_coming: int = 0
    stockouts: float = 0.0


ClusterHealth = Literal["healthy", "unreachable", "lost"]


class ClusterView(msgspec.Struct, omit_defaults=True):
    name: str
    health: ClusterHealth
    last_heartbeat: float | None = None
    flavors: list[FlavorView] = []
    running_jobs: int = 0
    stale_s: float = 0.0  # the agent's Kubernetes watches have been failing this long


T = TypeVar("T")


class ApiReply(msgspec.Struct, Generic[T], omit_defaults=True):
    """Every API reply: `{"ok": true, "result": ...}` or `{"ok": false, "error": "..."}`."""

    ok: bool
    result: T | None = None
    error: str | None = None
