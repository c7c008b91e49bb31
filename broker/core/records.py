"""The durable job record: what the broker persists in JetStream and rebuilds itself from.

Only decisions that matter after a crash live here (state, attempts with their placement, the
latest checkpoint, budgets spent). Cluster state is never persisted: agents resend it.
"""

from __future__ import annotations

import math
from typing import Annotated

import msgspec
from msgspec import Meta

from broker.core.sharing import EMPTY, ByIdentity, frozen
from broker.core.speed import GpuRate, job_figures
from broker.core.topology import need_of, need_of_parts
from broker.core.types import GangRequest, PodSetDemand, TopologyNeed
from schemas.agent import CheckpointRef, PodSetAssignment
from schemas.api import JobState
from schemas.job import JobSpec, PodSet, Workload
from schemas.quantity import cpu_milli, memory_bytes


class AttemptRecord(msgspec.Struct, omit_defaults=True):
    attempt: int
    cluster: str
    flavor: str
    flavor_class: str
    assignment: list[PodSetAssignment]
    dispatched_at: float
    capacity_type: str = ""
    gpu_type: str = ""
    price_per_gpu_hour: float = 0.0
    acked_at: float | None = None
    running_at: float | None = None
    ended_at: float | None = None
    end_cause: str | None = None
    resume_from: CheckpointRef | None = None
    gpu_seconds: float = 0.0
    gpu_seconds_lost: float = 0.0
    cost: float = 0.0
    # The checkpoint interval advised to this attempt (Young/Daly for its pool); None: none.
    advised_interval_s: float | None = None
    # Times its placement changed in place (elastic.py); sent as `Dispatch.revision`.
    revision: int = 0
    # Nodes growth added (elastic.py), in order: what is given back first to a queued job.
    grown: list[str] = []
    # An elastic attempt's last resize, and the GPU-seconds it used before it (accounting.py).
    resized_at: float | None = None
    gpu_seconds_before: float = 0.0
    # What the agent last took while a resize is unacknowledged (None: it took the newest): a
    # refused revision that only grew goes back to it (`AttemptLifecycle.give_back_refused`).
    settled: list[PodSetAssignment] | None = None
    # A revision went unanswered since the agent last took one: what it runs is unknown.
    unsettled: bool = False
    # Why the workload cannot grow in place (its cluster refused a growth): it is not grown again.
    grow_refused: str = ""
    # The broker ended this attempt and sent its Cancel, which no agent has acknowledged yet
    # (nor was its cluster declared lost): it may still run, so no later attempt of the job
    # is dispatched before it is heard (`cancels_before`), and a new leader asks again.
    cancel_unacked: bool = False

    @property
    def live(self) -> bool:
        return self.ended_at is None


class LatestCheckpoint(msgspec.Struct, omit_defaults=True):
    step: int
    uri: str
    at: float
    attempt: int


class Preempting(msgspec.Struct, omit_defaults=True):
    """An attempt being ended on purpose: we asked for a checkpoint and wait until `deadline`
    (or until a checkpoint newer than `step_at_start` lands)."""

    cause: str
    deadline: float
    started_at: float
    step_at_start: int | None = None
    # make-before-break: the next attempt's placement, reserved at once when one fit.
    replacement: AttemptRecord | None = None
    # who it makes room for and why ("to accommodate hi (priority 100) of queue q ...")
    detail: str = ""


def preempting_text(p: Preempting) -> str:
    """`cause: detail`, as the victim's events and status show it."""
    return f"{p.cause}: {p.detail}" if p.detail else p.cause


class AvoidPool(msgspec.Struct, array_like=True):
    cluster: str
    flavor: str
    until: float


# The job record's format. A broker decodes records of this format and older; a newer one may
# hold fields or meanings this broker would drop on its next write, so it does not lead on it
# (docs/operations.md "Upgrades"). Records without `format` (release 0.1.0) are format 1.
RECORD_FORMAT = 1


class JobRecord(msgspec.Struct, omit_defaults=True):
    job_id: str
    spec: JobSpec
    queue: str
    order: int
    submitted_at: float
    state: JobState = "queued"
    reason: str | None = None
    attempt: int = 0  # the newest attempt number handed out
    attempts: list[AttemptRecord] = []
    latest_checkpoint: LatestCheckpoint | None = None
    preemptions: int = 0  # infrastructure losses and preemptions (their own budget)
    spot_preemptions: int = 0
    errors: int = 0  # the job's own failures (max_restarts_on_error)
    start_failures: int = 0
    not_before: float = 0.0  # backoff: not admitted before this time
    queued_at: float = 0.0
    spot_exhausted: bool = False
    # Why it fell back, when no setting says so (views.py); None: its settings say why.
    spot_fallback: str | None = None
    avoid: list[AvoidPool] = []
    preempting: Preempting | None = None
    finished_at: float | None = None
    # The deadline's slack ran out: on-demand from now on (never back to spot).
    deadline_on_demand: bool = False
    # Steps per GPU type it ran on, from its checkpoints (speed.py); dropped when it ends.
    speeds: list[GpuRate] = []
    # RECORD_FORMAT of the broker that wrote it; left out while it is the first (1).
    format: Annotated[int, Meta(ge=1, le=1_000_000)] = 1

    @property
    def current(self) -> AttemptRecord | None:
        """The live attempt, if any (there is never more than one)."""
        if self.attempts and self.attempts[-1].live:
            return self.attempts[-1]
        return None

    @property
    def total_gpus(self) -> int:
        return self.spec.total_gpus

    @property
    def cancels_unsettled(self) -> bool:
        """Whether an attempt's Cancel is unacknowledged: a copy may still run, and this record
        is what a restored leader sends that Cancel again from."""
        return any(a.cancel_unacked for a in self.attempts)

    def resume_point(self) -> CheckpointRef | None:
        ckpt = self.latest_checkpoint
        if ckpt is None:
            return None
        return CheckpointRef(step=ckpt.step, uri=ckpt.uri, attempt=ckpt.attempt)


record_encoder = msgspec.msgpack.Encoder()
record_decoder = msgspec.msgpack.Decoder(JobRecord)


def demands_of(spec: JobSpec) -> tuple[PodSetDemand, ...]:
    return tuple(
        PodSetDemand(
            podset=p.name,
            replicas=p.most,  # an elastic podset is asked for at its maximum
            gpu=p.gpu,
            cpu_milli=cpu_milli(p.cpu),
            memory=memory_bytes(p.memory),
            extended=tuple(sorted(p.extended.items())),
        )
        for p in spec.gang
    )


def gang_request(record: JobRecord, now: float, demands: tuple[PodSetDemand, ...]) -> GangRequest:
    """The scheduler's view of a job for its next attempt."""
    spec = record.spec
    least, elastic, topology = _gang_parts(spec.gang)
    capacity = spec.capacity
    if record.deadline_on_demand:
        capacity = "on-demand"
    return GangRequest(
        job_id=record.job_id,
        attempt=record.attempt + 1,
        queue=record.queue,
        priority=spec.priority,
        order=record.order,
        podsets=demands,
        gpu_types=_gpu_type_set(spec.gpu_types),
        capacity=capacity,
        avoid_pools=(
            frozenset((a.cluster, a.flavor) for a in record.avoid if a.until > now)
            if record.avoid
            else EMPTY
        ),
        spot_exhausted=record.spot_exhausted,
        checkpoint_interval_s=pricing_interval_s(spec),
        spot_ok=spot_ok(spec),
        min_replicas=least,
        elastic=elastic,
        topology=topology if spec.topology is None else need_of(spec),
        speeds=job_figures(spec.gpu_speeds, record.speeds),
    )


_NO_MINIMUM: dict[str, int] = {}  # shared: a request's dict is read, never changed

# What a request reads from its spec's gang and GPU types, once for each shared copy of them
# (sharing.share_spec): most jobs hold one of a few, and deriving them for every job was a
# sixth of `Machine._submit` in a 60,000-job burst (py-spy).
GangParts = tuple[dict[str, int], frozenset[str], TopologyNeed | None]
_from_gang: ByIdentity[list[PodSet], GangParts] = ByIdentity()
_from_types: ByIdentity[list[str], frozenset[str]] = ByIdentity()


def _gang_parts(gang: list[PodSet]) -> GangParts:
    """The gang's replica minimums, elastic podsets and topology need (without the spec's own
    topology, which the caller adds)."""
    hit = _from_gang.get(gang)
    if hit is None:
        least = {p.name: p.least for p in gang if p.least < p.most} or _NO_MINIMUM
        elastic = frozen(frozenset(p.name for p in gang if p.elastic))
        hit = _from_gang.put(gang, (least, elastic, need_of_parts(None, gang)))
    return hit


def _gpu_type_set(types: list[str]) -> frozenset[str]:
    """The job's GPU types, lower-cased, as the scheduler matches them."""
    hit = _from_types.get(types)
    if hit is None:
        hit = _from_types.put(types, frozen(frozenset(t.lower() for t in types)))
    return hit


# On a job's labels: spot is fine without checkpoints (its queue says so, or the job does).
SPOT_OK_LABEL = "muster.dev/spot-ok"


def spot_ok(spec: JobSpec) -> bool:
    """Whether a job that may run on either capacity (`any`, `spot-then-on-demand`) may go to
    spot at its price: it writes checkpoints, or it (or its queue, at submission) set
    `muster.dev/spot-ok`. A reclaim loses all of a job that does not checkpoint, so cheap spot
    is not cheap for it (placement.capacity_rank says what each preference does then)."""
    return spec.checkpoint is not None or spec.labels.get(SPOT_OK_LABEL) in ("true", "queue")


DEFAULT_INTERVAL_S = 600.0  # what a job that checkpoints but does not say how often is taken for
START_S = 60.0  # start-up of a new attempt the broker assumes (image pull, rendezvous)
_PRICING_STEP_S = 300.0


def restart_overhead_s(spec: JobSpec) -> float:
    """What a move costs in running time: a checkpoint before it, start-up and a restore."""
    cost = spec.checkpoint.cost_s if spec.checkpoint is not None else None
    return START_S + 2.0 * (cost or 0.0)


def pricing_interval_s(spec: JobSpec) -> float | None:
    """The interval the risk term prices (risk.py loses half of it per reclaim): the job's own
    interval plus twice its restart overhead, so a reclaim costs the work since the last
    checkpoint plus the move. Rounded up to `_PRICING_STEP_S` so that jobs share the
    scheduler's per-shape caches. None: the job never checkpoints."""
    ck = spec.checkpoint
    if ck is None:
        return None
    raw = (ck.interval_s or DEFAULT_INTERVAL_S) + 2.0 * restart_overhead_s(spec)
    return math.ceil(raw / _PRICING_STEP_S) * _PRICING_STEP_S


def compact(record: JobRecord) -> bool:
    """Drop what an ended job no longer needs from its record: the workload (image, command,
    env, manifest), the bulk of a large spec. What idempotency (the job id), `muster status`,
    `why` and accounting read stays; so do not its learned GPU speeds (speed.py). True when
    the record changed (it must be persisted)."""
    spec = record.spec
    dropped = bool(record.speeds)
    record.speeds = []
    if spec.workload == _BARE.get(spec.workload.kind) or not spec.gang:
        return dropped  # already compact; or a manifest job, whose manifest holds its gang
    bare = _BARE.setdefault(spec.workload.kind, Workload(kind=spec.workload.kind))
    record.spec = msgspec.structs.replace(spec, workload=bare)
    return True


_BARE: dict[str, Workload] = {}
