"""The agent protocol (msgpack): cluster events in, commands out.

Agents publish `EventBatch` on `muster.agent.<cluster>.events`. The broker sends `Command`s as
requests on `muster.agent.<cluster>.cmd` and the agent answers with a `CommandAck`. Events and
commands are tagged unions so one decoder handles the whole batch in one pass.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from schemas.job import CapacityType, JobSpec

Name = Annotated[str, Meta(min_length=1, max_length=253)]
ClusterName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")]
NonNeg = Annotated[int, Meta(ge=0)]
Attempt = Annotated[int, Meta(ge=1)]
Epoch = Annotated[int, Meta(ge=0)]
Reason = Annotated[str, Meta(max_length=1024)]
# Unix seconds; finite and bounded so a hostile agent cannot send inf or NaN deadlines.
Timestamp = Annotated[float, Meta(ge=0, le=1e11)]

MAX_NODES = 100_000
MAX_BATCH = 100_000


class FlavorInfo(msgspec.Struct, frozen=True, omit_defaults=True):
    """One pool of identical capacity in one cluster: a capacity type and a GPU type."""

    name: Name
    capacity_type: CapacityType
    gpu_type: Annotated[str, Meta(max_length=64)] = ""
    price_per_gpu_hour: Annotated[float, Meta(ge=0)] = 0.0
    gpu_memory_mib: NonNeg = 0


class NodeInfo(msgspec.Struct, omit_defaults=True):
    """A node's allocatable capacity and what pods Muster did not place already use on it."""

    name: Name
    flavor: Name
    gpu: NonNeg = 0
    cpu_milli: NonNeg = 0
    memory: NonNeg = 0
    gpu_healthy: NonNeg | None = None  # None = all GPUs healthy
    ready: bool = True
    spot_deadline: Timestamp | None = None  # set while a spot notice is outstanding
    other_gpu: NonNeg = 0
    other_cpu_milli: NonNeg = 0
    other_memory: NonNeg = 0


WorkloadPhase = Literal["created", "running", "succeeded", "failed", "evicted"]


class WorkloadStatus(msgspec.Struct, tag="workload", omit_defaults=True):
    """A transition of one attempt's workload. `running` means every replica runs."""

    job_id: Name
    attempt: Attempt
    phase: WorkloadPhase
    running_replicas: NonNeg = 0
    total_replicas: NonNeg = 0
    exit_codes: Annotated[list[int], Meta(max_length=4096)] = []
    reason: Reason = ""
    step: NonNeg | None = None
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
    healthy: NonNeg
    xid: int | None = None
    reason: Reason = ""


class SpotNotice(msgspec.Struct, tag="spot", omit_defaults=True):
    """The provider will reclaim `node` at `deadline` (unix seconds)."""

    node: Name
    deadline: Timestamp
    reason: Reason = ""


class CheckpointReport(msgspec.Struct, tag="checkpoint", omit_defaults=True):
    job_id: Name
    attempt: Attempt
    step: NonNeg
    uri: Annotated[str, Meta(max_length=2048)]
    at: Timestamp = 0.0


class Heartbeat(msgspec.Struct, tag="heartbeat", omit_defaults=True):
    at: Timestamp = 0.0


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
    seq: Annotated[int, Meta(ge=1)]
    events: Annotated[list[AgentEvent], Meta(max_length=MAX_BATCH)]
    sent_at: Timestamp = 0.0


# -- commands: broker -> agent ------------------------------------------------------------


class CheckpointRef(msgspec.Struct, frozen=True, omit_defaults=True):
    step: NonNeg
    uri: Annotated[str, Meta(max_length=2048)]


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


Command = Dispatch | Cancel | CheckpointNow | Resync


class CommandAck(msgspec.Struct, omit_defaults=True):
    ok: bool
    error: Reason = ""
    stale_epoch: bool = False  # refused because the sender's epoch is older than one seen


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
