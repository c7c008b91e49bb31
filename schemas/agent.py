"""The agent protocol (msgpack): cluster events in, commands out.

Agents publish `EventBatch` on `muster.agent.<cluster>.events`. The broker sends `Command`s as
requests on `muster.agent.<cluster>.cmd` and the agent answers with a `CommandAck` (a
`DispatchBatch` with `DispatchAcks`). Events and
commands are tagged unions so one decoder handles the whole batch in one pass.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from schemas.job import CapacityType, ExtendedAmounts, JobSpec

Name = Annotated[str, Meta(min_length=1, max_length=253)]
ClusterName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")]
NonNeg = Annotated[int, Meta(ge=0)]
Attempt = Annotated[int, Meta(ge=1, le=2**31)]
Epoch = Annotated[int, Meta(ge=0, le=2**62)]
Reason = Annotated[str, Meta(max_length=1024)]
# Unix seconds; finite and bounded so a hostile agent cannot send inf or NaN deadlines.
Timestamp = Annotated[float, Meta(ge=0, le=1e11)]

# Bounds on what one agent may claim, so a hostile or broken agent cannot make the broker
# allocate without limit (the scheduler keeps per-node and per-GPU-count structures).
MAX_NODES = 100_000  # nodes per cluster (one snapshot)
MAX_BATCH = 100_000  # events per batch
MAX_GPUS_PER_NODE = 1024
MAX_CPU_MILLI = 2**40  # ~1.1 billion cores
MAX_MEMORY = 2**60  # 1 EiB
MAX_PRICE = 1e6  # per GPU-hour
MAX_SEQ = 2**62
GpuCount = Annotated[int, Meta(ge=0, le=MAX_GPUS_PER_NODE)]
CpuMilli = Annotated[int, Meta(ge=0, le=MAX_CPU_MILLI)]
Bytes = Annotated[int, Meta(ge=0, le=MAX_MEMORY)]
ExitCode = Annotated[int, Meta(ge=-(2**31), le=2**32)]  # also an XID code
MAX_TOPOLOGY_LEVELS = 8
# A topology level: the node label that names it (Kueue's `Topology` levels), and a value.
TopologyLevel = Annotated[str, Meta(min_length=1, max_length=317)]
TopologyValue = Annotated[str, Meta(max_length=253)]
MAX_NODE_LABELS = 64
LabelKey = Annotated[str, Meta(min_length=1, max_length=317)]
LabelValue = Annotated[str, Meta(max_length=63)]
TaintEffect = Literal["NoSchedule", "PreferNoSchedule", "NoExecute"]


class NodeTaint(msgspec.Struct, frozen=True, omit_defaults=True):
    """A taint the pool's new nodes carry (a Kubernetes taint: key, value, effect)."""

    key: LabelKey
    value: LabelValue = ""
    effect: TaintEffect = "NoSchedule"


class ProvisionPool(msgspec.Struct, frozen=True, omit_defaults=True):
    """Capacity a flavor can still grow by: an autoscaled node pool (a Karpenter NodePool, a
    cluster-autoscaler node group, a GKE node pool) that adds nodes of one template when asked.

    The broker counts nodes the pool may still add (`max_nodes` less the nodes it has and
    those already asked for) as capacity that arrives `ready_s` after it asks, and a request
    not met within `window_s` as a stockout. Its capacity type is the flavor's."""

    # The node template: what each new node brings.
    node_gpu: Annotated[int, Meta(ge=1, le=MAX_GPUS_PER_NODE)]
    # The most nodes the pool may hold at once (a node group's max size), and the most GPUs
    # (a Karpenter NodePool's `limits` on nvidia.com/gpu); 0 = not declared, one at least.
    max_nodes: Annotated[int, Meta(ge=0, le=1_000_000)] = 0
    max_gpus: Annotated[int, Meta(ge=0, le=2**31)] = 0
    node_cpu_milli: CpuMilli = 0  # 0 = not declared (not checked)
    node_memory: Bytes = 0
    labels: Annotated[dict[LabelKey, LabelValue], Meta(max_length=MAX_NODE_LABELS)] = {}
    taints: Annotated[list[NodeTaint], Meta(max_length=MAX_NODE_LABELS)] = []
    # Expected seconds from asking to a Ready node, and how long a request may take before
    # it counts as a stockout (no capacity in the zone, quota spent at the provider).
    ready_s: Annotated[float, Meta(ge=0, le=86_400)] = 300.0
    window_s: Annotated[float, Meta(gt=0, le=86_400)] = 900.0

    def __post_init__(self) -> None:
        if not self.max_nodes and not self.max_gpus:
            raise ValueError("an autoscaled pool declares max_nodes or max_gpus (or both)")

    @property
    def limit(self) -> int:
        """The most nodes of the template the pool may hold at once."""
        by_gpus = self.max_gpus // self.node_gpu if self.max_gpus else self.max_nodes
        return min(self.max_nodes, by_gpus) if self.max_nodes else by_gpus


class FlavorInfo(msgspec.Struct, frozen=True, omit_defaults=True):
    """One pool of identical capacity in one cluster: a capacity type and a GPU type."""

    name: Name
    capacity_type: CapacityType
    gpu_type: Annotated[str, Meta(max_length=64)] = ""
    price_per_gpu_hour: Annotated[float, Meta(ge=0, le=MAX_PRICE)] = 0.0
    gpu_memory_mib: Annotated[int, Meta(ge=0, le=2**31)] = 0
    # The size the pool may reach, as its autoscaler or configuration declares it (a node
    # pool's max size, a spot zone's limit); 0 = not declared. Until the pool has held nodes,
    # whether a gang could ever fit there is judged by it (placement.empty_fit).
    max_nodes: Annotated[int, Meta(ge=0, le=1_000_000)] = 0
    node_gpu: GpuCount = 0
    node_cpu_milli: CpuMilli = 0
    node_memory: Bytes = 0
    # The cluster's topology levels for this pool, coarsest first, zone first (e.g.
    # topology.kubernetes.io/zone, cloud.google.com/gce-topology-block, kubernetes.io/hostname):
    # named once here, so each node sends only its values (`NodeInfo.topology`). Empty = none.
    topology_levels: Annotated[tuple[TopologyLevel, ...], Meta(max_length=MAX_TOPOLOGY_LEVELS)] = ()
    # Fabric resources every node of the pool has (EFA, rdma/..., hugepages-... in bytes), as
    # the operator declares them; a node's own report (`NodeInfo.extended`) wins.
    node_extended: ExtendedAmounts = {}
    # Nodes the pool can still add when asked (an autoscaled pool); None = it only has the
    # nodes it reports (what agents of wire 1.1 and older send).
    provision: ProvisionPool | None = None


class NodeInfo(msgspec.Struct, omit_defaults=True):
    """A node's allocatable capacity and what pods Muster did not place already use on it."""

    name: Name
    flavor: Name
    gpu: GpuCount = 0
    cpu_milli: CpuMilli = 0
    memory: Bytes = 0
    gpu_healthy: GpuCount | None = None  # None = all GPUs healthy
    ready: bool = True
    spot_deadline: Timestamp | None = None  # set while a spot notice is outstanding
    other_gpu: GpuCount = 0
    other_cpu_milli: CpuMilli = 0
    other_memory: Bytes = 0
    # Takes no new pods (cordon, an untolerated NoSchedule taint, a deletion in progress, a
    # short NotReady, GPUs briefly not allocatable): placements skip it, replicas already on it
    # keep running. `ready` False means the replicas are lost.
    no_new_pods: bool = False
    note: Reason = ""  # why it takes no new pods, for `muster clusters` and logs
    # The node's value for each of its flavor's `topology_levels`, in that order ("" when the
    # label is missing; trailing missing values may be left out). Empty = not reported.
    topology: Annotated[tuple[TopologyValue, ...], Meta(max_length=MAX_TOPOLOGY_LEVELS)] = ()
    # Allocatable fabric resources (`status.allocatable`), hugepages in bytes. Empty = not
    # reported (an older agent reports none): the flavor's `node_extended` holds.
    extended: ExtendedAmounts = {}


WorkloadPhase = Literal["created", "running", "succeeded", "failed", "evicted"]
# The phases a workload ends in: an attempt reported so has ended, whatever comes after.
TERMINAL_PHASES: frozenset[str] = frozenset({"succeeded", "failed", "evicted"})


class WorkloadStatus(msgspec.Struct, tag="workload", omit_defaults=True):
    """A transition of one attempt's workload. `running` means every replica runs."""

    job_id: Name
    attempt: Attempt
    phase: WorkloadPhase
    running_replicas: Annotated[int, Meta(ge=0, le=MAX_NODES)] = 0
    total_replicas: Annotated[int, Meta(ge=0, le=MAX_NODES)] = 0
    exit_codes: Annotated[list[ExitCode], Meta(max_length=4096)] = []
    reason: Reason = ""
    step: Annotated[int, Meta(ge=0, le=MAX_SEQ)] | None = None
    nodes: Annotated[list[Name], Meta(max_length=4096)] = []


class ClusterSnapshot(msgspec.Struct, tag="snapshot", omit_defaults=True):
    """Full cluster state, sent on connect and on resync; replaces everything known before."""

    flavors: Annotated[list[FlavorInfo], Meta(max_length=256)]
    nodes: Annotated[list[NodeInfo], Meta(max_length=MAX_NODES)]
    workloads: Annotated[list[WorkloadStatus], Meta(max_length=MAX_NODES)] = []


class NodeUpsert(msgspec.Struct, tag="node", omit_defaults=True):
    node: NodeInfo


class NodeGone(msgspec.Struct, tag="node_gone", omit_defaults=True):
    node: Name
    reason: Reason = ""


class GpuHealth(msgspec.Struct, tag="gpu_health", omit_defaults=True):
    """GPUs on a node failed (XID) or recovered; `healthy` is the count that still works."""

    node: Name
    healthy: GpuCount
    xid: ExitCode | None = None
    reason: Reason = ""


class SpotNotice(msgspec.Struct, tag="spot", omit_defaults=True):
    """The provider will reclaim `node` at `deadline` (unix seconds)."""

    node: Name
    deadline: Timestamp
    reason: Reason = ""


class CheckpointReport(msgspec.Struct, tag="checkpoint", omit_defaults=True):
    job_id: Name
    attempt: Attempt
    step: Annotated[int, Meta(ge=0, le=MAX_SEQ)]
    uri: Annotated[str, Meta(max_length=2048)]
    at: Timestamp = 0.0
    # The attempt's checkpoint token (Dispatch.checkpoint_token): proves a report sent by a
    # workload straight to the broker comes from that attempt. Agents' reports need none.
    token: Annotated[str, Meta(max_length=128)] = ""


class Heartbeat(msgspec.Struct, tag="heartbeat", omit_defaults=True):
    at: Timestamp = 0.0
    # Seconds the agent's view of its cluster has been stale (its watches failing past a
    # threshold); 0 = fresh. The broker places nothing there while it is stale.
    stale_s: Annotated[float, Meta(ge=0, le=1e9)] = 0.0


AgentEvent = (
    ClusterSnapshot
    | NodeUpsert
    | NodeGone
    | GpuHealth
    | SpotNotice
    | WorkloadStatus
    | CheckpointReport
    | Heartbeat
)


class EventBatch(msgspec.Struct, omit_defaults=True):
    """What an agent publishes. `instance` changes on every agent start; `seq` counts batches
    of one instance from 1, so the broker sees a gap and asks for a resync."""

    cluster: ClusterName
    instance: Annotated[str, Meta(min_length=1, max_length=64)]
    seq: Annotated[int, Meta(ge=1, le=MAX_SEQ)]
    events: Annotated[list[AgentEvent], Meta(max_length=MAX_BATCH)]
    sent_at: Timestamp = 0.0
    # The sender's protocol version (schemas/wire.py); "" from the 0.1.0 release.
    wire: Annotated[str, Meta(max_length=16)] = ""


# -- commands: broker -> agent ------------------------------------------------------------


class CheckpointRef(msgspec.Struct, frozen=True, omit_defaults=True):
    """A checkpoint to resume from: its step, where it is, and the attempt that wrote it
    (every attempt writes below its own prefix, `<checkpoint.uri>/attempt-<n>`). 0 = unknown."""

    step: NonNeg
    uri: Annotated[str, Meta(max_length=2048)]
    attempt: Annotated[int, Meta(ge=0, le=1_000_000)] = 0


class PodSetAssignment(msgspec.Struct, omit_defaults=True):
    """One node name per replica, in replica order."""

    podset: Name
    nodes: Annotated[list[Name], Meta(max_length=4096)]


class Dispatch(msgspec.Struct, tag="dispatch", omit_defaults=True):
    job_id: Name
    attempt: Attempt
    epoch: Epoch
    flavor: Name
    assignment: list[PodSetAssignment]
    spec: JobSpec
    resume_from: CheckpointRef | None = None
    checkpoint_uri: str = ""
    # Self-fencing: an agent cut off from NATS this long deletes the workload itself, before
    # the broker declares the cluster lost and starts the job elsewhere. 0 = never.
    fence_after_s: Annotated[float, Meta(ge=0, le=86_400)] = 0.0
    # A secret only this attempt's replicas get (MUSTER_CHECKPOINT_TOKEN); the broker accepts
    # a workload's own checkpoint report only with it, so no job can report for another.
    checkpoint_token: Annotated[str, Meta(max_length=128)] = ""
    # The broker's advised checkpoint interval for this attempt's pool (Young/Daly from the
    # pool's interruption rate and the job's checkpoint cost): MUSTER_CHECKPOINT_INTERVAL_S.
    # 0 = no advice.
    checkpoint_interval_s: Annotated[float, Meta(ge=0, le=7 * 86_400)] = 0.0
    # The attempt's placement changed in place (an elastic gang shrank or grew): revision n
    # of the same attempt, with the nodes it runs on now. 0 = the first dispatch. An agent
    # that predates it takes a revision for a duplicate and acknowledges it (wire 1.2).
    revision: Annotated[int, Meta(ge=0, le=1_000_000)] = 0


class Cancel(msgspec.Struct, tag="cancel", omit_defaults=True):
    """Stop an attempt. `attempt` None means every attempt of the job (stale-copy cleanup)."""

    job_id: Name
    epoch: Epoch
    attempt: Attempt | None = None
    reason: Reason = ""


class CheckpointNow(msgspec.Struct, tag="checkpoint_now", omit_defaults=True):
    job_id: Name
    attempt: Attempt
    epoch: Epoch
    deadline: Timestamp = 0.0


class Resync(msgspec.Struct, tag="resync", omit_defaults=True):
    """Ask the agent for a full ClusterSnapshot (after a sequence gap or a broker restart)."""

    epoch: Epoch
    reason: Reason = ""


class Applied(msgspec.Struct, tag="applied", omit_defaults=True):
    """The broker has applied and persisted every batch of agent `instance` up to `seq`: the
    agent may forget the outcomes (endings, checkpoints) it was keeping until then."""

    epoch: Epoch
    instance: Annotated[str, Meta(min_length=1, max_length=64)]
    seq: Annotated[int, Meta(ge=1, le=MAX_SEQ)]


class WireRefused(msgspec.Struct, tag="wire_refused", omit_defaults=True):
    """The broker applies none of this agent's batches: their wire major version differs from
    its own (schemas/wire.py). Only ever sent to an agent of another major, so no peer of the
    same major has to understand it; the agent logs both versions and carries on sending, so
    upgrading either side heals the link without a restart."""

    epoch: Epoch
    broker_wire: Annotated[str, Meta(max_length=16)]
    agent_wire: Annotated[str, Meta(max_length=16)]
    reason: Reason = ""


class Provision(msgspec.Struct, tag="provision", omit_defaults=True):
    """Grow `flavor` by `nodes` nodes of its pool's template for `job_id`'s gang: the broker
    asks one cluster, the one it chose, and binds the gang to the nodes once they are
    reported. Sent only to an agent that declared the flavor's `provision` (wire 1.2 and
    newer), so no older agent ever receives one. Asking again for the same job is a no-op."""

    job_id: Name
    epoch: Epoch
    flavor: Name
    nodes: Annotated[int, Meta(ge=1, le=MAX_NODES)]
    # Unix seconds after which the broker counts the request as a stockout and moves on; the
    # agent may withdraw what has not come up by then.
    deadline: Timestamp = 0.0


Command = Dispatch | Cancel | CheckpointNow | Resync | Applied | WireRefused | Provision

MAX_BATCH_DISPATCHES = 256  # Dispatches in one DispatchBatch


class DispatchBatch(msgspec.Struct, tag="dispatch_batch", omit_defaults=True):
    """Several Dispatches to one cluster in one request (wire 1.3): an admission cycle that
    places many jobs on a cluster asks its agent once, not once per job. The agent carries
    each out as if it had come alone, in order, and answers with `DispatchAcks`. Sent only to
    an agent whose batches say wire 1.3 or newer, so no older agent ever receives one."""

    epoch: Epoch
    dispatches: Annotated[list[Dispatch], Meta(min_length=1, max_length=MAX_BATCH_DISPATCHES)]


# What the broker sends on an agent's command subject: a core's Command, or the shell's batch.
WireCommand = Command | DispatchBatch


class CommandAck(msgspec.Struct, omit_defaults=True):
    ok: bool
    error: Reason = ""
    stale_epoch: bool = False  # refused because the sender's epoch is older than one seen
    epoch: Epoch = 0  # with stale_epoch: the newer epoch the agent has seen
    # A refusal about this job alone (its team namespace's ResourceQuota is full), not about
    # the cluster: the broker places the job elsewhere without holding it against the pool.
    job_only: bool = False
    # A Dispatch revision the workload cannot take in place (its kind cannot change size, or
    # its pods cannot follow the new nodes): the broker moves the whole gang instead.
    resize_refused: bool = False
    # A Cancel's answer, when the attempt had already ended here and the broker has not yet
    # acknowledged the batch that says so: that ending. The broker learns it before it starts
    # the job again (a success reported just before a spot notice must not run it twice).
    ended: WorkloadStatus | None = None


class DispatchAcks(msgspec.Struct, omit_defaults=True):
    """The answer to a DispatchBatch: one ack per Dispatch, in the batch's order. A refusal of
    the whole batch (its epoch is stale, it did not decode) is one CommandAck instead."""

    acks: Annotated[list[CommandAck], Meta(min_length=1, max_length=MAX_BATCH_DISPATCHES)]


# -- logs (JSON on `muster.agent.<cluster>.logs`) ----------------------------------------------
MAX_LOG_LINE = 16_384  # characters; longer lines are cut
MAX_LOG_CHUNK_BYTES = 64 * 1024


class LogRequest(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Read an attempt's container logs through the agent of the cluster it ran on. The agent
    answers on the request's reply subject with `LogChunk`s until one has `eof`."""

    job_id: Name
    attempt: Attempt
    podset: Name | None = None  # None: every podset
    replica: Annotated[int, Meta(ge=0, le=4095)] | None = None  # None: every replica
    tail_lines: Annotated[int, Meta(ge=1, le=10_000)] = 100
    limit_bytes: Annotated[int, Meta(ge=1, le=1 << 20)] = 256 * 1024
    follow: bool = False
    follow_s: Annotated[float, Meta(gt=0, le=3600)] = 600.0  # the longest a follow lasts


class LogChunk(msgspec.Struct, omit_defaults=True):
    """Lines in order; `seq` counts chunks from 0 so a reader can tell one was lost."""

    seq: NonNeg
    lines: Annotated[
        list[Annotated[str, Meta(max_length=MAX_LOG_LINE)]], Meta(max_length=10_000)
    ] = []
    eof: bool = False
    error: Reason = ""


# -- node operations (JSON on `muster.agent.<cluster>.nodeops`, operators only) ----------------
NodeOpName = Literal["cordon", "uncordon", "drain", "notice"]


class NodeOpRequest(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """An operator's action on a cluster's nodes, carried out by that cluster's agent.

    cordon: the node takes no new gangs (reported as `NodeInfo.no_new_pods`); uncordon
    reverses it; drain: cordon, then the attempts running there end as `evicted` (an
    infrastructure loss: the broker moves them from their latest checkpoint); notice: a spot
    notice, on simulated clusters only. `node` omitted acts on every node, and only with
    `all_nodes` (as `kubectl drain` needs a selector), so a missing argument never drains a
    cluster by mistake."""

    op: NodeOpName
    node: Name | None = None
    all_nodes: bool = False
    reason: Reason = ""


class NodeOpReply(msgspec.Struct, omit_defaults=True):
    """What the agent did: the nodes it changed and the attempts a drain ended ("job/n"), or
    why it changed nothing (`ok` False, `error` says what to fix)."""

    ok: bool
    op: NodeOpName | None = None
    nodes: Annotated[list[Name], Meta(max_length=MAX_NODES)] = []
    attempts: Annotated[list[Name], Meta(max_length=MAX_NODES)] = []
    error: Reason = ""
