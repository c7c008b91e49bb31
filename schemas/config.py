"""Broker configuration (one YAML file): queues, cohorts, quotas, flavors and timeouts.

It is expressive enough for Kueue's ClusterQueue/ResourceFlavor/Cohort (nominal quota, borrowing
and lending limits, hierarchical cohorts, preemption policies, StrictFIFO/BestEffortFIFO),
Volcano's Queue (weight, capability, reclaimable, parent queues) and ElasticQuota trees.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from schemas.job import CapacityType, DnsLabel, ExtendedAmounts

Resource = Literal["gpu", "cpu", "memory"]
# A PriorityClass / WorkloadPriorityClass name (a DNS subdomain) and the job priority it means.
PriorityClassName = Annotated[
    str, Meta(max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
]
PriorityValue = Annotated[int, Meta(ge=-1_000_000, le=1_000_000)]
Amount = Annotated[int, Meta(ge=0)]


class ResourceQuota(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Kueue's per-resource quota. cpu in millicores, memory in bytes, gpu in devices.
    YAML may give cpu/memory as Kubernetes quantities; the loader normalises them."""

    nominal: Amount = 0
    borrowing_limit: Amount | None = None  # None = may borrow all the cohort lends
    lending_limit: Amount | None = None  # None = lends all its unused nominal quota


class FlavorQuota(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    flavor: DnsLabel
    resources: dict[Resource, ResourceQuota]
    # The most of each fabric resource (vpc.amazonaws.com/efa, rdma/..., hugepages-... in
    # bytes) the queue's admitted gangs may hold in this flavor class: the queue's own cap, not
    # lent or borrowed in a cohort. An unlisted one is not limited.
    extended: ExtendedAmounts = {}


class PreemptionPolicy(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    within_queue: Literal["Never", "LowerPriority"] = "LowerPriority"
    reclaim_within_cohort: Literal["Never", "LowerPriority", "Any"] = "Any"


class QueueConfig(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    name: DnsLabel
    # The team that owns the queue: `muster nats-config` lets only that team's NATS user
    # submit here and read its jobs' events. None: admins only.
    team: DnsLabel | None = None
    cohort: DnsLabel | None = None
    weight: Annotated[float, Meta(gt=0, le=1e6)] = 1.0
    strategy: Literal["StrictFIFO", "BestEffortFIFO"] = "BestEffortFIFO"
    # None = no quota: the queue may use any flavor without limit (handy for demos).
    quotas: list[FlavorQuota] | None = None
    # A resource that a listed flavor class omits: "unlimited" (Muster's default) or "zero",
    # Kueue's rule that a ClusterQueue admits only the resources it lists.
    unlisted_resources: Literal["unlimited", "zero"] = "unlimited"
    preemption: PreemptionPolicy = msgspec.field(default_factory=PreemptionPolicy)
    # Volcano's `reclaimable`: may other queues take back what this queue borrowed?
    reclaimable: bool = True
    # May its `capacity: any` and `spot-then-on-demand` jobs that write no checkpoint go to
    # spot at its price? By default `any` ones take on-demand first (a reclaim loses all their
    # work) and spot only when no on-demand pool could ever host them; `spot-then-on-demand`
    # ones take spot only where it is cheaper with that loss priced in.
    spot_without_checkpoint: bool = False
    # Flavor classes in the order the queue prefers them (a Kueue ClusterQueue's flavor list):
    # the first with room wins, cost decides only among pools of one class. Empty: by cost.
    flavor_order: Annotated[list[DnsLabel], Meta(max_length=64)] = []


class CohortConfig(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A node of a quota tree above the queues (Kueue's Cohort, a Koordinator parent quota, a
    Volcano parent queue). Its own quotas add to what its subtree shares; its borrowing limit
    bounds what the whole subtree takes from its parent, its lending limit what it gives up.
    Queues name their cohort; cohorts no config lists exist implicitly, with no quota."""

    name: DnsLabel
    parent: DnsLabel | None = None
    quotas: list[FlavorQuota] = []


class FlavorClass(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Kueue's ResourceFlavor across clusters: cluster flavors whose capacity type and GPU
    type match belong to this class, and quotas are written against the class name."""

    name: DnsLabel
    capacity_type: CapacityType | None = None
    gpu_type: str | None = None


class Timeouts(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    heartbeat_s: Annotated[float, Meta(gt=0)] = 1.0
    # Failure detection: an agent silent this long gets no new placements (seconds).
    unreachable_after_s: Annotated[float, Meta(gt=0)] = 5.0
    # Re-dispatch: a silent cluster's jobs start elsewhere only this long after the broker
    # last heard its agent (earlier on proof the old copy is gone: its node deleted or
    # out-of-service, its workload reported gone). Its agent was granted a fence of
    # lost_after_s - fence_lead_s (15 minutes): a control-plane upgrade, an agent rollout,
    # a broker failover or a NATS restart shorter than that costs nothing.
    lost_after_s: Annotated[float, Meta(gt=0)] = 1080.0
    # The least wait for an agent's ack; the broker waits longer for a cluster whose acks it
    # has seen take longer, and doubles the wait on each retry, up to dispatch_ack_max_s
    # (broker/ackwait.py). An ack to an earlier copy of a retried request still counts.
    dispatch_ack_s: Annotated[float, Meta(gt=0)] = 2.0
    dispatch_ack_max_s: Annotated[float, Meta(gt=0)] = 20.0
    dispatch_retries: Annotated[int, Meta(ge=0, le=100)] = 3
    start_s: Annotated[float, Meta(gt=0)] = 300.0
    # Added to every start timeout for pulling the image on a fresh node (start_s covers
    # scheduling and start-up); a resumed attempt also gets its checkpoint's restore time.
    image_pull_s: Annotated[float, Meta(ge=0)] = 0.0
    checkpoint_grace_s: Annotated[float, Meta(ge=0)] = 30.0
    # Failover after a crash takes about this long; renewed every quarter of it. 2.5 s kept
    # every renewal in time beside two CPU burners (docs/operations.md, "Tuning").
    lease_ttl_s: Annotated[float, Meta(ge=1)] = 2.5
    # A fence lapses this long before the broker would re-dispatch: it must cover the pods'
    # termination grace (spot: 120 s) plus the fence watchdog's period and clock skew, so the
    # old copy has stopped before a new one starts (docs/kubernetes.md, "Fencing"). 0 = off.
    fence_lead_s: Annotated[float, Meta(ge=0)] = 180.0
    # An acknowledged dispatch the agent has not reported (created or running) this long
    # after its ack was swallowed: the attempt is given up, the job goes elsewhere at once and
    # the pool's dispatch breaker counts a failure (docs/operations.md). 0 = off.
    dispatch_report_s: Annotated[float, Meta(ge=0)] = 30.0
    # A record change nothing waits on (an attempt found running) is written at most this
    # long after it, or earlier with the job's next urgent write; a crash in between costs
    # the agent's snapshot reporting it again (broker/core/lifecycle.py). 0 = at once.
    deferred_write_s: Annotated[float, Meta(ge=0, le=10)] = 2.0

    @property
    def fence_window_s(self) -> float:
        """The fence every Dispatch grants (`Dispatch.fence_after_s`); 0 when fencing is off."""
        lead, lost = self.fence_lead_s, self.lost_after_s
        return lost - lead if lead > 0 and lost > lead else 0.0


# Relative training speeds of common GPUs (V100 = 1), as docs/simulation.md cites them:
# Lambda Labs' PyTorch training benchmarks for A100 vs V100; NVIDIA data sheets' FP16 tensor
# throughput and memory bandwidth for T4 vs V100.
DEFAULT_GPU_SPEEDS: dict[str, float] = {"v100": 1.0, "a100": 2.2, "t4": 0.3}


class SchedulingConfig(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    # Expected-cost weighting: dollars charged per GPU-hour of work at risk of being lost.
    risk_weight: Annotated[float, Meta(ge=0)] = 1.0
    # Prior interruption rate (per node-hour) for spot pools with no history yet.
    spot_prior_rate: Annotated[float, Meta(ge=0)] = 0.5
    # Half-life of the observed interruption rate, in seconds.
    rate_half_life_s: Annotated[float, Meta(gt=0)] = 6 * 3600.0
    # How long the pool that just lost a job is avoided for its next attempt.
    avoid_lost_pool_s: Annotated[float, Meta(ge=0)] = 600.0
    max_admissions_per_cycle: Annotated[int, Meta(ge=1)] = 10_000
    # A gang admitted less than this long ago is never chosen as a preemption or reclaim victim
    # (Slurm's PreemptExemptTime), so a job cannot be evicted again and again as it restarts.
    preemption_min_runtime_s: Annotated[float, Meta(ge=0, le=86_400)] = 60.0
    # Dispatch breaker per cluster x flavor: this many failed dispatches in a row (refused, or
    # never reported), each of a different job, stop placements there for a cool-down; then one
    # probe decides. 0 = off. See docs/operations.md, "Dispatch breakers".
    breaker_failures: Annotated[int, Meta(ge=0, le=1000)] = 3
    breaker_cool_down_s: Annotated[float, Meta(gt=0, le=86_400)] = 60.0
    # Autoscaled pools (broker/core/provision.py): waiting w seconds for new nodes is priced
    # as w / provision_wait_horizon_s of an hour at the pool's cost; a stockout multiplies a
    # pool's score by 1 + its stockouts, a count halving every stockout_half_life_s, and the
    # job skips that pool for stockout_avoid_s.
    provision_wait_horizon_s: Annotated[float, Meta(gt=0, le=30 * 86_400)] = 3600.0
    stockout_half_life_s: Annotated[float, Meta(gt=0, le=30 * 86_400)] = 1800.0
    stockout_avoid_s: Annotated[float, Meta(ge=0, le=30 * 86_400)] = 600.0
    # Relative training speed per GPU type (broker/core/speed.py's prior): placement ranks
    # pools by expected cost per unit of work, price / speed. A type not listed counts as 1.
    gpu_speeds: Annotated[
        dict[
            Annotated[str, Meta(min_length=1, max_length=64)], Annotated[float, Meta(gt=0, le=1e6)]
        ],
        Meta(max_length=256),
    ] = msgspec.field(default_factory=lambda: dict(DEFAULT_GPU_SPEEDS))


class Limits(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Admission limits and JetStream sizing (see docs/operations.md, "Limits and storage")."""

    # Queued jobs one queue may hold; a submission beyond it is refused. 0 = no limit.
    max_pending_per_queue: Annotated[int, Meta(ge=0)] = 100_000
    # Token bucket per submitter (the queue and the job's `user` label): sustained rate and burst.
    # 0 = no limit.
    submit_rate_per_s: Annotated[float, Meta(ge=0)] = 0.0
    submit_burst: Annotated[int, Meta(ge=1)] = 1000
    # Per team (or per queue without a team): the bytes its jobs' records may hold in the job
    # bucket, and how many of its jobs may be unfinished at once; a submission beyond either is
    # refused. Ended jobs' records are compacted (their workload dropped). 0 = no limit.
    team_store_max_bytes: Annotated[int, Meta(ge=0)] = 256 * 2**20
    team_store_max_records: Annotated[int, Meta(ge=0)] = 200_000
    # An ended job's record is deleted this long after it ended (checked once a minute); until
    # then its id is answered as a duplicate. 0 = kept until `muster store-compact` expires it.
    ended_retention_s: Annotated[float, Meta(ge=0)] = 0.0
    # Per cluster: what its agent's batches may cost the broker (broker/agentlink.py). Batches
    # over the rates wait in the cluster's mailbox (at most agent_pending_bytes, beyond it they
    # are dropped); a snapshot replaces whatever its cluster had waiting. 0 rates = no limit.
    agent_msgs_per_s: Annotated[float, Meta(ge=0)] = 1000.0
    agent_burst_msgs: Annotated[int, Meta(ge=1)] = 5000
    agent_bytes_per_s: Annotated[int, Meta(ge=0)] = 4 * 2**20
    agent_burst_bytes: Annotated[int, Meta(ge=1)] = 16 * 2**20
    agent_snapshots_per_s: Annotated[float, Meta(ge=0)] = 1.0
    agent_pending_bytes: Annotated[int, Meta(ge=1)] = 64 * 2**20
    # Stream sizes in bytes, reserved in the JetStream store when the streams are created. A
    # full stream refuses new writes (discard new) and never drops what it holds. Keep their
    # sum (with the lease bucket's) under the server's max_file_store: a server store filled
    # up refuses every write, the lease renewal included. 0 = unlimited (not recommended).
    submit_stream_max_bytes: Annotated[int, Meta(ge=0)] = 256 * 2**20
    jobs_bucket_max_bytes: Annotated[int, Meta(ge=0)] = 1024 * 2**20
    # A snapshot of the job bucket (every newest record in one object, broker/snapshot.py) is
    # written once this many records were written since the last one, at most once every
    # records_snapshot_gap_s, by a process of its own: a restart reads it and only the records
    # written after it. 0 = never (a restart reads every record). Its object store holds two
    # snapshots while one replaces the other: give it twice what the job bucket holds.
    records_snapshot_after_writes: Annotated[int, Meta(ge=0)] = 20_000
    records_snapshot_gap_s: Annotated[float, Meta(ge=1)] = 60.0
    snapshot_bucket_max_bytes: Annotated[int, Meta(ge=0)] = 2048 * 2**20
    lease_bucket_max_bytes: Annotated[int, Meta(ge=4096)] = 64 * 1024


PlacementTag = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9:._-]+$")]


class Replication(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Where JetStream keeps the submission stream, the job bucket and the lease bucket.

    `replicas` is the Raft group size of each: 3 keeps every acknowledged write through the
    loss of any one server (5: two), 1 loses what the one server held. A single nats-server
    (the broker's embedded one) holds R1 only. The broker applies these to new streams and
    changes existing ones to match at start (JetStream re-replicates a stream in place).
    `placement_cluster` / `placement_tags` pick the servers (nats-server `server_tags`)."""

    replicas: Annotated[int, Meta(ge=1, le=5)] = 1
    placement_cluster: Annotated[str, Meta(min_length=1, max_length=64)] | None = None
    placement_tags: list[PlacementTag] = []


class BrokerConfig(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    subject_prefix: str = "muster"
    queues: list[QueueConfig] = msgspec.field(default_factory=lambda: [QueueConfig(name="default")])
    cohorts: list[CohortConfig] = []
    flavors: list[FlavorClass] = []
    timeouts: Timeouts = msgspec.field(default_factory=Timeouts)
    scheduling: SchedulingConfig = msgspec.field(default_factory=SchedulingConfig)
    max_payload_bytes: Annotated[int, Meta(ge=1024, le=64 * 2**20)] = 1024 * 1024
    # Kueue's LocalQueue: another name users submit to (`muster.submit.<alias>`) for a queue.
    queue_aliases: dict[DnsLabel, DnsLabel] = {}
    limits: Limits = msgspec.field(default_factory=Limits)
    replication: Replication = msgspec.field(default_factory=Replication)
    # A manifest's `priorityClassName` / `kueue.x-k8s.io/priority-class` -> the job's priority
    # (also imported from PriorityClass and WorkloadPriorityClass objects).
    priority_classes: dict[PriorityClassName, PriorityValue] = {}
    # The service accounts a manifest may name (`serviceAccountName`), as the agents'
    # `allowed_service_accounts` (default `default`): refused at submission, not at dispatch.
    # None: not checked here.
    workload_service_accounts: Annotated[list[DnsLabel], Meta(max_length=256)] | None = (
        msgspec.field(default_factory=lambda: ["default"])
    )

    def __post_init__(self) -> None:
        names = [q.name for q in self.queues]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"queues: duplicate queue names {dupes}; each name must be unique")
        _check_cohort_tree(self.cohorts)
        for alias, target in self.queue_aliases.items():
            if alias in names:
                raise ValueError(f"queue_aliases: {alias!r} is already a queue name")
            if target not in names:
                raise ValueError(
                    f"queue_aliases: {alias!r} points to unknown queue {target!r}; "
                    f"known queues: {', '.join(sorted(names))}"
                )


def _check_cohort_tree(cohorts: list[CohortConfig]) -> None:
    parents: dict[str, str | None] = {}
    for c in cohorts:
        if c.name in parents:
            raise ValueError(f"cohorts: {c.name!r} is declared twice; keep one")
        if c.parent == c.name:
            raise ValueError(f"cohorts: {c.name!r} names itself as parent; remove parent")
        parents[c.name] = c.parent
    for c in cohorts:
        seen = {c.name}
        up = c.parent
        while up is not None:
            if up in seen:
                raise ValueError(
                    f"cohorts: {c.name!r} is its own ancestor (via {up!r}); a cohort tree "
                    "has no cycles, so drop one parent"
                )
            seen.add(up)
            up = parents.get(up)
