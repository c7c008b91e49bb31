"""What the kube backend keeps per node, and `assess_node`: one node's signals judged.

The backend's node watch feeds every Node object here; the verdict (going away, takes no new
pods and why, lost, GPU health) is computed without I/O, so the rules can be read and tested
apart from the watches that deliver the input and the events that carry the result.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from agents.kube.config import FlavorConfig, KubeBackendConfig
from agents.kube.decode import KNode
from agents.kube.nodes import (
    GpuState,
    Notice,
    Rules,
    counts_for_node,
    detect_provider,
    gpu_product_mismatch,
    gpu_state,
    not_ready_since,
    notices,
    untolerated_taints,
)
from schemas.agent import GpuHealth, NodeInfo, SpotNotice

# Non-graceful node shutdown (kubernetes.io/docs/reference/labels-annotations-taints): an
# operator's statement that the node is off, so its containers no longer run.
OUT_OF_SERVICE = "node.kubernetes.io/out-of-service"

# A pod's DisruptionTarget as the node watch reads it: (node, text, when, reason, whether
# the pod is Muster's own).
PodDisruption = tuple[str, str, float | None, str, bool]


class NodeEntry:
    """What the backend keeps per node: the raw object, its flavor, what was reported, and
    the timers of its signals (clock seconds when first seen)."""

    __slots__ = (
        "dip_since",
        "flavor",
        "gpu",
        "info",
        "known_gpu",
        "left_flavor",
        "lost",
        "mismatch",
        "not_ready_seen",
        "notice_seen",
        "raw",
        "spot_deadline",
        "spot_reason",
        "unselected",
        "why",
    )

    def __init__(self, raw: KNode, flavor: FlavorConfig | None) -> None:
        self.raw = raw
        self.flavor = flavor
        self.info: NodeInfo | None = None  # last NodeInfo emitted
        self.gpu: GpuState | None = None  # last GPU state
        self.known_gpu = 0  # most GPUs seen: a capacity that drops is a dip, not a new size
        self.spot_deadline: float | None = None
        self.spot_reason = ""
        self.notice_seen: float | None = None
        self.dip_since: float | None = None
        self.not_ready_seen: float | None = None
        self.unselected = False  # left the node label selector (a DELETED that is no deletion)
        self.left_flavor = False  # its labels match no flavor any more
        self.mismatch = ""  # GPU product disagreeing with the flavor, once logged
        self.lost = False  # NotReady past the grace period
        self.why: list[str] = []  # why it takes no new pods


@dataclass
class Assessment:
    """The news of one assessment: events to send (after the node's NodeInfo is refreshed),
    and what to log or count as bad input."""

    notice: SpotNotice | None = None
    health: GpuHealth | None = None
    going_away_in_s: float | None = None  # set when the notice is new: log it
    newly_lost: bool = False  # NotReady and out of service past the grace: log it
    bad_input: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


def assess_node(
    entry: NodeEntry,
    flavor: FlavorConfig,
    disruptions: Iterable[PodDisruption],
    cfg: KubeBackendConfig,
    rules: Rules,
    now: float,
) -> Assessment:
    """Every signal of one node: going away (a notice with a deadline), takes no new pods
    (with the reasons), lost (NotReady past the grace period), explicit GPU faults. Updates
    the entry's signal timers and verdict; returns what is news."""
    out = Assessment()
    node = entry.raw
    name = node.metadata.name
    provider = detect_provider(node)
    # Going away: the earliest deadline among the signals, from each signal's own time.
    found = notices(node, rules, provider)
    node_found = list(found)
    for pod_node, text, at, dis, own in disruptions:
        if pod_node == name and counts_for_node(dis, own, node, node_found):
            found.append(Notice(text, at, rules.windows.for_provider(provider)))
    if not found:
        entry.notice_seen, entry.spot_deadline, entry.spot_reason = None, None, ""
    elif entry.spot_deadline is None:
        seen = entry.notice_seen = entry.notice_seen or now
        deadline = min((n.at if n.at is not None else seen) + n.window_s for n in found)
        entry.spot_deadline = deadline
        entry.spot_reason = f"{provider}: " + ", ".join(n.reason for n in found)[:900]
        out.notice = SpotNotice(node=name, deadline=deadline, reason=entry.spot_reason)
        out.going_away_in_s = round(deadline - now, 1)
    # Takes no new pods.
    why: list[str] = []
    if node.spec.unschedulable:
        why.append("cordoned")
    if node.metadata.deletionTimestamp:
        why.append("being deleted")
    why += [f"taint {t} not tolerated" for t in untolerated_taints(node, flavor, rules)]
    not_ready, since = not_ready_since(node)
    was_lost, entry.lost = entry.lost, False
    if not_ready:
        entry.not_ready_seen = entry.not_ready_seen or now
        start = since if since is not None else entry.not_ready_seen
        shut_down = any(t.key == OUT_OF_SERVICE for t in node.spec.taints)
        if now - start >= cfg.not_ready_grace_s and shut_down:
            # Proof the containers are gone: an operator declared the node shut down.
            entry.lost = True
            out.newly_lost = not was_lost
        else:
            # A partitioned node or a hung kubelet keeps its containers running, and
            # taint-based eviction only marks the pods: NotReady alone proves nothing.
            why.append(
                f"NotReady; its replicas count as lost once it is deleted or tainted "
                f"{OUT_OF_SERVICE} (and {cfg.not_ready_grace_s:g}s NotReady)"
            )
    else:
        entry.not_ready_seen = None
    gpu = gpu_state(node, rules, rules.resource(flavor))
    if gpu.clamped:
        out.bad_input.append(
            ("GPU count above the schema bound", {"node": name, "detail": gpu.clamped})
        )
    if gpu.healthy is None and gpu.total < entry.known_gpu:
        # Capacity shrank (the device plugin went away): a dip of the GPUs known.
        gone = entry.known_gpu - gpu.total + gpu.missing
        res = rules.resource(flavor)
        gpu = GpuState(
            entry.known_gpu,
            missing=gone,
            missing_reason=f"{gone} of {entry.known_gpu} {res} not allocatable",
        )
    elif gpu.healthy is None and not gpu.missing:
        entry.known_gpu = gpu.total
    if gpu.missing:
        entry.dip_since = entry.dip_since or now
        if now - entry.dip_since >= cfg.allocatable_debounce_s:
            why.append(gpu.missing_reason)
    else:
        entry.dip_since = None
    mismatch = gpu_product_mismatch(node.metadata.labels, flavor.gpu_type)
    if mismatch:
        why.append(mismatch)
        if entry.mismatch != mismatch:
            out.bad_input.append(
                ("GPU product disagrees with its flavor", {"node": name, "detail": mismatch})
            )
    entry.mismatch = mismatch or ""
    if entry.unselected:
        why.append("left the node selector")
    if entry.left_flavor:
        why.append("matches no flavor any more")
    entry.why = why
    # GPU health: only explicit faults and their recovery are news.
    prev = entry.gpu
    if (prev.healthy if prev else None) != gpu.healthy:
        out.health = GpuHealth(
            node=name,
            healthy=gpu.total if gpu.healthy is None else gpu.healthy,
            xid=gpu.xid,
            reason=gpu.reason or "GPUs healthy again",
        )
    entry.gpu = gpu
    return out
