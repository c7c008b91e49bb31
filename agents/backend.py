"""The seam between the agent runtime and a cluster: `kube` and `fake` implement `Backend`.

The runtime (`agents/runtime.py`) owns NATS, batching, sequence numbers, heartbeats, epoch
fencing and idempotency on (job_id, attempt). A backend only knows its cluster: it reports what
changes through `emit` and carries out commands the runtime has already vetted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple, Protocol, runtime_checkable

from schemas.agent import (
    AgentEvent,
    ClusterSnapshot,
    Dispatch,
    LogRequest,
    NodeOpName,
    Provision,
)

Emit = Callable[[AgentEvent], None]


class BackendError(RuntimeError):
    """A command the backend could not carry out; the text goes back in the CommandAck."""


class JobRefused(BackendError):
    """A dispatch refused for this job alone (its namespace's quota), not for the cluster:
    acknowledged with `job_only`, so one team cannot open the pool's breaker for everyone."""


class LogTail(NamedTuple):
    """The newest lines of an attempt's containers (each prefixed `[podset-replica] `), and
    whether the attempt has ended, so a follow knows when to stop."""

    lines: list[str]
    ended: bool


class Backend(Protocol):
    cluster: str

    async def start(self, emit: Emit) -> None:
        """Begin watching the cluster. Deltas (NodeUpsert, NodeGone, GpuHealth, SpotNotice,
        WorkloadStatus, CheckpointReport) go to `emit`, which never blocks."""
        ...

    async def snapshot(self) -> ClusterSnapshot:
        """The whole cluster now: flavors, nodes, and every workload Muster owns."""
        ...

    async def dispatch(self, cmd: Dispatch) -> None:
        """Create the attempt's workload on the assigned nodes. Raise BackendError if it
        cannot be created. Called once per (job_id, attempt)."""
        ...

    async def cancel(self, job_id: str, attempt: int | None, reason: str) -> None:
        """Delete the attempt's workload (every attempt of the job when attempt is None).
        Deleting what does not exist is not an error."""
        ...

    async def checkpoint_now(self, job_id: str, attempt: int, deadline: float) -> None:
        """Ask the workload to write a checkpoint before `deadline` (unix seconds)."""
        ...

    async def read_logs(self, req: LogRequest) -> LogTail:
        """The last `req.tail_lines` lines of the attempt's selected containers. Raise
        BackendError naming the cluster and attempt when its pods are gone."""
        ...

    async def stop(self) -> None: ...


class CannotResize(BackendError):
    """The attempt's workload cannot change size in place (its kind has no such field, or
    its pods cannot follow the new nodes); the text says why."""


class Resizing(Protocol):
    """What a backend that can change a running attempt's nodes adds to `Backend` (fake, local
    for a single elastic podset under torchrun, kube for the kinds whose adapter has
    `resize_patch`): optional, so it is not a member of `Backend`."""

    async def resize(self, cmd: Dispatch) -> None:
        """Attempt `cmd.attempt` now runs on `cmd.assignment` (an elastic gang shrank or grew,
        `cmd.revision` > 0): stop the replicas on nodes it no longer lists, start the ones on
        nodes it adds, keep the rest running. The runtime skips backends without it (their
        replicas on a reclaimed node end with the node)."""
        ...


@runtime_checkable
class Fencing(Protocol):
    """What a backend that the cluster itself can fence adds to `Backend` (fake, local and
    kube): optional, so it is not a member of `Backend`. The runtime finds it with
    `isinstance(backend, Fencing)`, never by probing method names one at a time."""

    async def fence(self, job_id: str, attempt: int, until: float) -> None:
        """The attempt's workload must be stopped by `until` (unix seconds) unless fenced
        again, by the cluster itself, without the agent: a frozen or dead agent must not keep
        it alive (kube: a pod deadline such as activeDeadlineSeconds, or an in-cluster
        watchdog). Extending a fence that has lapsed must not revive anything. The runtime
        skips backends without it, and then only self-fencing protects the cluster."""
        ...

    def fence_after(self, job_id: str, attempt: int) -> float:
        """The fence window of an attempt found at startup (0: none), so an agent that
        restarts keeps extending the fence an earlier one gave it."""
        ...


@runtime_checkable
class ClusterFencing(Fencing, Protocol):
    """A `Fencing` backend with one fence for the whole cluster (kube: a Lease) that stops
    only some attempts by itself (those a fence watchdog watches)."""

    async def renew_fence(self, since: float) -> None:
        """The broker heard this agent at `since`: move the cluster's one fence on from it.
        One call, whatever the number of attempts; raises when the fence cannot be moved."""
        ...

    def fences(self, job_id: str, attempt: int) -> bool:
        """Whether the cluster itself ends this attempt when its fence lapses."""
        ...


class Provisioner(Protocol):
    """What a backend that can grow an autoscaled pool adds to `Backend` (the fake, and kube
    through agents/kube/pools.py): optional, like `Fencing`. The runtime refuses `provision`
    for a backend without it."""

    async def provision(self, cmd: Provision) -> None:
        """Ask the pool behind `cmd.flavor` for `cmd.nodes` more nodes; they are reported as
        ordinary nodes once Ready. Asking again for the same job changes nothing."""
        ...


class NodeOpResult(NamedTuple):
    """The nodes an operator's action changed, and the attempts a drain ended (job_id,
    attempt)."""

    nodes: list[str]
    attempts: list[tuple[str, int]]


class NodeOps(Protocol):
    """What a backend that lets an operator cordon, uncordon, drain or (simulated clusters)
    announce a spot notice adds to `Backend`: optional, the agent refuses without it."""

    async def node_op(self, op: NodeOpName, node: str | None, reason: str) -> NodeOpResult:
        """Carry out `op` on `node` (None: every node). Raise BackendError, changing nothing,
        when the node is unknown or the cluster cannot do `op`."""
        ...


def pick_nodes(cluster: str, known: Iterable[str], node: str | None) -> list[str]:
    """The nodes an operator's action is for: `node`, or every known node when None. An
    unknown name is refused with the names that exist, so a typo changes nothing."""
    names = list(known)
    if node is None:
        return names
    if node not in names:
        shown = ", ".join(sorted(names)[:20]) + (" ..." if len(names) > 20 else "")
        raise BackendError(
            f"cluster {cluster!r} has no node {node!r}; its nodes: {shown or '(none)'}"
        )
    return [node]
