"""The client-facing job description (JSON): what a user publishes to `muster.submit.<queue>`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from schemas.quantity import QuantityError, cpu_milli, memory_bytes

# DNS-1123 label: what Kubernetes accepts as a name, and a valid NATS subject token.
DnsLabel = Annotated[
    str,
    Meta(
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        max_length=63,
        description="lower-case letters, digits and '-', starting and ending alphanumeric",
    ),
]
JobId = Annotated[
    str,
    Meta(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$",
        description="letters, digits, '-' and '_', at most 63 characters (used in subjects)",
    ),
]
Quantity = Annotated[
    str | int | float,
    Meta(description="a Kubernetes quantity: 4, '500m', '16Gi'"),
]
ShortText = Annotated[str, Meta(max_length=1024)]
CapacityPreference = Literal["spot", "on-demand", "spot-then-on-demand", "any"]
CapacityType = Literal["spot", "on-demand"]

MAX_PODSETS = 16
MAX_REPLICAS = 4096
MAX_GPU_PER_REPLICA = 64


# Fabric resources of multi-node training counted per node (EFA `vpc.amazonaws.com/efa`,
# RDMA device plugins `rdma/...`, `hugepages-<size>` in bytes): name -> amount.
MAX_EXTENDED = 16
ExtendedResource = Annotated[
    str,
    Meta(
        pattern=r"^(vpc\.amazonaws\.com/efa|rdma/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?|hugepages-[0-9]+[KMGT]i?)$",
        max_length=253,
        description="a fabric resource: vpc.amazonaws.com/efa, rdma/<name>, hugepages-<size>",
    ),
]
ExtendedAmounts = Annotated[
    dict[ExtendedResource, Annotated[int, Meta(ge=0, le=2**53)]], Meta(max_length=MAX_EXTENDED)
]

TopologyLevelName = Annotated[
    str,
    Meta(
        pattern=r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$",
        max_length=317,
        description="a topology level: its node label (cloud.google.com/gce-topology-block) "
        "or short name (zone, block, subblock, rack, host)",
    ),
]


class PodSetTopology(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A topology level the GPU replicas must stay within (`required`: else they wait) or
    should (`preferred`: else the next level up that fits, with a note). Kueue's
    `podset-required-topology` / `podset-preferred-topology`."""

    required: TopologyLevelName | None = None
    preferred: TopologyLevelName | None = None


class GangTopology(PodSetTopology, forbid_unknown_fields=True, omit_defaults=True):
    """`PodSetTopology` for the whole gang. A gang of more than one node stays within one zone
    unless `spread` is set (cross-zone links are slower and billed; zonal volumes pin pods)."""

    spread: bool = False


class PodSet(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A group of identical replicas (master, worker, launcher, ps) and what each one needs."""

    name: DnsLabel
    replicas: Annotated[int, Meta(ge=1, le=MAX_REPLICAS)] = 1
    gpu: Annotated[int, Meta(ge=0, le=MAX_GPU_PER_REPLICA)] = 0
    cpu: Quantity = "1"
    memory: Quantity = "1Gi"
    # Partial admission (Kueue's job-min-parallelism): when quota or capacity is short, the
    # podset may start with as few as this many replicas. None = all of them, always.
    min_replicas: Annotated[int, Meta(ge=1, le=MAX_REPLICAS)] | None = None
    # Elastic (TorchElastic, Volcano minAvailable, Kueue elastic jobs): the podset runs with
    # any count in [min_replicas, max_replicas], is admitted at the most that fits, loses
    # replicas in place on a spot notice while at or above the minimum and grows back to
    # this when capacity returns. None = not elastic (at most `replicas`).
    max_replicas: Annotated[int, Meta(ge=1, le=MAX_REPLICAS)] | None = None
    # An elastic podset's measured throughput (steps/s, or any unit) at some replica counts,
    # {"2": 1.9, "4": 3.5}: the broker weighs "shrink and continue" against "move whole" by it
    # (counts in between are interpolated). None: linear scaling with a stated efficiency.
    throughput: (
        dict[Annotated[int, Meta(ge=1, le=MAX_REPLICAS)], Annotated[float, Meta(gt=0)]] | None
    ) = None
    # Binds the whole gang's GPU replicas (stricter than Kueue, which binds each podset).
    topology: PodSetTopology | None = None
    # Fabric resources per replica (hugepages in bytes): a node must have them free to take it.
    extended: ExtendedAmounts = {}

    def __post_init__(self) -> None:
        try:
            cpu_milli(self.cpu)
            memory_bytes(self.memory)
        except QuantityError as exc:
            raise ValueError(f"podset {self.name!r}: {exc}") from None
        if self.min_replicas is not None and self.min_replicas > self.replicas:
            raise ValueError(
                f"podset {self.name!r}: min_replicas {self.min_replicas} is more than its "
                f"{self.replicas} replicas; set min_replicas between 1 and replicas"
            )
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise ValueError(
                f"podset {self.name!r}: max_replicas {self.max_replicas} is less than its "
                f"{self.replicas} replicas; an elastic podset needs min_replicas <= replicas "
                "<= max_replicas, so raise max_replicas or lower replicas"
            )

    @property
    def elastic(self) -> bool:
        """Whether the podset may shrink and grow while it runs."""
        return self.max_replicas is not None

    @property
    def most(self) -> int:
        """The most replicas it may run with: `max_replicas` when elastic, else `replicas`."""
        return self.replicas if self.max_replicas is None else self.max_replicas

    @property
    def least(self) -> int:
        """The fewest replicas it may run with."""
        return self.replicas if self.min_replicas is None else self.min_replicas

    def admits(self, count: int) -> bool:
        """Whether a dispatch may run this podset with `count` replicas (fewer than
        `replicas` only under partial admission or elasticity, never below `min_replicas`,
        more only when elastic, up to `max_replicas`)."""
        return self.least <= count <= self.most


class CheckpointSpec(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Where the workload writes checkpoints; passed to it as MUSTER_CHECKPOINT_URI."""

    uri: Annotated[str, Meta(min_length=1, max_length=1024)]
    # The fastest the job can progress: a reported step beyond resume step + this x running
    # time is refused as forged. None: no bound.
    max_steps_per_s: Annotated[float, Meta(gt=0, le=1e9)] | None = None
    # How often the workload checkpoints on its own (s of running time); the broker prices
    # the work a reclaim loses by it. None: 600 s is assumed.
    interval_s: Annotated[float, Meta(ge=1, le=7 * 86_400)] | None = None
    # What one checkpoint write costs (s, measured by the workload); with it the broker
    # advises a Young/Daly interval (MUSTER_CHECKPOINT_INTERVAL_S). None: no advice.
    cost_s: Annotated[float, Meta(ge=0, le=86_400)] | None = None
    # What reading a checkpoint back costs (s) when an attempt resumes; the start timeout
    # grows by it. None: taken as `cost_s`.
    restore_s: Annotated[float, Meta(ge=0, le=86_400)] | None = None


class Deadline(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Finish within `within_s` of submission. The job uses spot while its slack allows and
    moves to on-demand early enough to finish (slack = time left - work left - restart)."""

    within_s: Annotated[float, Meta(gt=0, le=365 * 86_400)]
    # Running time of the whole job without interruptions, on the pools it accepts.
    runtime_s: Annotated[float, Meta(gt=0, le=365 * 86_400)]
    # Steps of the whole job: progress is the newest checkpoint's step / total_steps.
    total_steps: Annotated[int, Meta(ge=1, le=10**12)]


class RestartPolicy(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Separate budgets: infrastructure losses are not the job's fault, its own errors are."""

    max_restarts_on_error: Annotated[int, Meta(ge=0, le=1000)] = 3
    max_preemptions: Annotated[int, Meta(ge=0, le=100_000)] | None = None  # None = unlimited
    retriable_exit_codes: Annotated[
        list[Annotated[int, Meta(ge=0, le=255)]], Meta(max_length=64)
    ] = []
    backoff_s: Annotated[float, Meta(ge=0, le=3600)] = 5.0
    max_backoff_s: Annotated[float, Meta(ge=0, le=86_400)] = 300.0
    # Start failures in a row (start timeout, refused dispatch) before the job fails; None =
    # retry forever. 6 is a Kubernetes Job's default backoffLimit.
    max_start_failures: Annotated[int, Meta(ge=0, le=1000)] | None = 6


class SpotPolicy(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """When a `spot-then-on-demand` job gives up on spot."""

    fallback_after_preemptions: Annotated[int, Meta(ge=0, le=1000)] = 2
    fallback_after_wait_s: Annotated[float, Meta(ge=0, le=86_400 * 7)] = 600.0
    # Spot preemptions in a row without a new checkpoint before a spot-then-on-demand job
    # falls back and a spot-only job fails (None = retry forever).
    max_preemptions_without_progress: Annotated[int, Meta(ge=1, le=1000)] | None = 3


class Simulation(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """How the fake backend plays this job: steps at a rate, checkpoints every K steps."""

    total_steps: Annotated[int, Meta(ge=1, le=10**9)] = 100
    steps_per_second: Annotated[float, Meta(gt=0, le=1e6)] = 10.0
    checkpoint_every: Annotated[int, Meta(ge=1, le=10**9)] = 10
    fail_at_step: Annotated[int, Meta(ge=0)] | None = None
    exit_code: Annotated[int, Meta(ge=0, le=255)] = 1


WorkloadKind = Literal["indexed-job", "pytorchjob", "manifest"]


class SecretKeyRef(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A key of a Kubernetes Secret in the workload namespace. The kubelet resolves it in the
    cluster, so the value never passes through Muster (literal `env` values do, and are
    stored in JetStream: they are not secret)."""

    name: Annotated[str, Meta(pattern=r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")]
    key: Annotated[str, Meta(pattern=r"^[-._a-zA-Z0-9]{1,253}$")]
    optional: bool = False


class Workload(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """What runs. `manifest` carries a user's own Kubernetes object (PyTorchJob, MPIJob, ...)."""

    kind: WorkloadKind = "indexed-job"
    image: Annotated[str, Meta(max_length=512)] = ""
    command: Annotated[list[ShortText], Meta(max_length=256)] = []
    args: Annotated[list[ShortText], Meta(max_length=256)] = []
    env: Annotated[dict[str, ShortText], Meta(max_length=256)] = {}
    # Env vars read from Secrets in the cluster (`valueFrom.secretKeyRef`); kube backend only.
    secret_env: Annotated[dict[str, SecretKeyRef], Meta(max_length=256)] = {}
    port: Annotated[int, Meta(ge=1, le=65535)] = 29500
    manifest: dict[str, Any] | None = None
    simulate: Simulation | None = None


class JobSpec(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A gang job. Either `gang` lists the podsets, or `workload.manifest` lets the broker
    derive them from a Kubernetes manifest."""

    name: DnsLabel
    gang: Annotated[list[PodSet], Meta(max_length=MAX_PODSETS)] = []
    queue: DnsLabel | None = None
    job_id: JobId | None = None
    priority: Annotated[int, Meta(ge=-1_000_000, le=1_000_000)] = 0
    gpu_types: Annotated[list[Annotated[str, Meta(max_length=64)]], Meta(max_length=16)] = []
    # This job's relative speed per GPU type (e.g. {"a100": 3, "t4": 1}; only ratios matter, so
    # give two types at least): wins over its measured step rates and the broker's
    # `scheduling.gpu_speeds` (broker/core/speed.py).
    gpu_speeds: Annotated[
        dict[Annotated[str, Meta(max_length=64)], Annotated[float, Meta(gt=0, le=1e6)]],
        Meta(max_length=16),
    ] = {}
    capacity: CapacityPreference = "any"
    spot: SpotPolicy = msgspec.field(default_factory=SpotPolicy)
    checkpoint: CheckpointSpec | None = None
    restart: RestartPolicy = msgspec.field(default_factory=RestartPolicy)
    start_timeout_s: Annotated[float, Meta(gt=0, le=86_400)] | None = None
    workload: Workload = msgspec.field(default_factory=Workload)
    labels: Annotated[dict[str, ShortText], Meta(max_length=64)] = {}
    deadline: Deadline | None = None
    topology: GangTopology | None = None

    def __post_init__(self) -> None:
        if self.deadline is not None and self.capacity == "spot":
            raise ValueError(
                "deadline: a spot-only job cannot switch to on-demand to meet it; use "
                "capacity spot-then-on-demand or any"
            )
        names = [p.name for p in self.gang]
        if len(set(names)) != len(names):
            raise ValueError("gang: podset names must be unique")
        if not self.gang and self.workload.manifest is None:
            raise ValueError(
                "gang: give at least one podset (e.g. {'name': 'worker', 'replicas': 2, "
                "'gpu': 8}) or a Kubernetes manifest in workload.manifest"
            )

    @property
    def total_gpus(self) -> int:
        return sum(p.replicas * p.gpu for p in self.gang)

    @property
    def total_replicas(self) -> int:
        return sum(p.replicas for p in self.gang)
