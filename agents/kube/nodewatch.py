"""The kube backend's node watch: what it keeps per node, and `assess_node`, one node's
signals judged.

`NodeWatch` takes the Node objects of the node watch and the DisruptionTargets of the pod
watches, and sends `NodeUpsert`, `NodeGone`, `SpotNotice` and `GpuHealth`. The verdict
(going away, takes no new pods and why, lost, GPU health) is computed without I/O in
`assess_node`, so the rules can be read and tested apart from the watches that deliver the
input and the events that carry the result.

What is sent: `NodeUpsert` whenever a node's `NodeInfo` changes (capacity, readiness, foreign
usage, GPU health, spot deadline), `NodeGone` when a node is deleted or stops matching a
flavor (nodes that match no configured flavor are not reported). `SpotNotice(node, deadline =
now + provider deadline)` once per node when a reclaim taint or condition appears
(`config.DEFAULT_SPOT_TAINTS`) or when any pod on the node gets a `DisruptionTarget` condition
whose reason means the node is going away; re-armed when the signal clears. `GpuHealth(node,
healthy, xid, reason)` whenever the healthy GPU count changes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import aiohttp

from agents.kube.client import BadInput, KubeApiError, KubeRest, Pacer
from agents.kube.config import FlavorConfig, KubeBackendConfig, Provider
from agents.kube.decode import KNode, KPod, Usage, parse_time
from agents.kube.nodes import (
    GpuState,
    Notice,
    Rules,
    counts_for_node,
    detect_provider,
    gfd_memory_mib,
    gpu_product_mismatch,
    gpu_state,
    match_flavor,
    node_info,
    not_ready_since,
    notices,
    untolerated_taints,
)
from agents.kube.status import disruption
from kinds.base import LABEL_JOB
from schemas.agent import (
    AgentEvent,
    Dispatch,
    GpuHealth,
    NodeGone,
    NodeInfo,
    NodeUpsert,
    SpotNotice,
)

# Non-graceful node shutdown (kubernetes.io/docs/reference/labels-annotations-taints): an
# operator's statement that the node is off, so its containers no longer run.
OUT_OF_SERVICE = "node.kubernetes.io/out-of-service"

# A pod's DisruptionTarget as the node watch reads it: (node, text, when, reason, whether
# the pod is Muster's own).
PodDisruption = tuple[str, str, float | None, str, bool]


@dataclass(frozen=True, slots=True)
class NodeSignals:
    """What the watch has judged of one node so far: the timers of its signals (clock seconds
    when first seen) and the verdict. Frozen: `assess_node` returns a new one, so a judgement
    can be replayed and compared without the watch."""

    gpu: GpuState | None = None  # last GPU state
    known_gpu: int = 0  # most GPUs seen: a capacity that drops is a dip, not a new size
    spot_deadline: float | None = None
    spot_reason: str = ""
    notice_seen: float | None = None
    dip_since: float | None = None
    not_ready_seen: float | None = None
    mismatch: str = ""  # GPU product disagreeing with the flavor, once logged
    lost: bool = False  # NotReady past the grace period
    why: tuple[str, ...] = ()  # why it takes no new pods

    @property
    def timed(self) -> bool:
        """A signal is being timed (a dip debounced, a NotReady within its grace): the clock
        alone can change the verdict."""
        return self.dip_since is not None or self.not_ready_seen is not None


@dataclass(frozen=True, slots=True)
class Observation:
    """One node as seen now: its object and flavor, the pods' DisruptionTargets, and whether
    it left the node selector or its flavor."""

    node: KNode
    flavor: FlavorConfig
    disruptions: tuple[PodDisruption, ...] = ()
    unselected: bool = False
    left_flavor: bool = False


class NodeEntry:
    """What the backend keeps per node: the raw object, its flavor, what was reported, and
    the latest judgement of its signals."""

    __slots__ = ("flavor", "info", "left_flavor", "raw", "signals", "unselected")

    def __init__(self, raw: KNode, flavor: FlavorConfig | None) -> None:
        self.raw = raw
        self.flavor = flavor
        self.info: NodeInfo | None = None  # last NodeInfo emitted
        self.signals = NodeSignals()
        self.unselected = False  # left the node label selector (a DELETED that is no deletion)
        self.left_flavor = False  # its labels match no flavor any more


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
    old: NodeSignals,
    seen: Observation,
    cfg: KubeBackendConfig,
    rules: Rules,
    now: float,
) -> tuple[NodeSignals, Assessment]:
    """Every signal of one node: going away (a notice with a deadline), takes no new pods
    (with the reasons), lost (NotReady past the grace period), explicit GPU faults. Pure:
    returns the node's new signals and what is news; `old` is left as it was."""
    out = Assessment()
    node, flavor = seen.node, seen.flavor
    name = node.metadata.name
    provider = detect_provider(node)
    # Going away: the earliest deadline among the signals, from each signal's own time.
    found = notices(node, rules, provider)
    node_found = list(found)
    for pod_node, text, at, dis, own in seen.disruptions:
        if pod_node == name and counts_for_node(dis, own, node, node_found):
            found.append(Notice(text, at, rules.windows.for_provider(provider)))
    notice_seen, spot_deadline, spot_reason = old.notice_seen, old.spot_deadline, old.spot_reason
    if not found:
        notice_seen, spot_deadline, spot_reason = None, None, ""
    elif spot_deadline is None:
        notice_seen = notice_seen or now
        spot_deadline = min((n.at if n.at is not None else notice_seen) + n.window_s for n in found)
        spot_reason = f"{provider}: " + ", ".join(n.reason for n in found)[:900]
        out.notice = SpotNotice(node=name, deadline=spot_deadline, reason=spot_reason)
        out.going_away_in_s = round(spot_deadline - now, 1)
    # Takes no new pods.
    why: list[str] = []
    if node.spec.unschedulable:
        why.append("cordoned")
    if node.metadata.deletionTimestamp:
        why.append("being deleted")
    why += [f"taint {t} not tolerated" for t in untolerated_taints(node, flavor, rules)]
    not_ready, since = not_ready_since(node)
    lost = False
    not_ready_seen: float | None = None
    if not_ready:
        not_ready_seen = old.not_ready_seen or now
        start = since if since is not None else not_ready_seen
        shut_down = any(t.key == OUT_OF_SERVICE for t in node.spec.taints)
        if now - start >= cfg.not_ready_grace_s and shut_down:
            # Proof the containers are gone: an operator declared the node shut down.
            lost = True
            out.newly_lost = not old.lost
        else:
            # A partitioned node or a hung kubelet keeps its containers running, and
            # taint-based eviction only marks the pods: NotReady alone proves nothing.
            why.append(
                f"NotReady; its replicas count as lost once it is deleted or tainted "
                f"{OUT_OF_SERVICE} (and {cfg.not_ready_grace_s:g}s NotReady)"
            )
    gpu = gpu_state(node, rules, rules.resource(flavor))
    if gpu.clamped:
        out.bad_input.append(
            ("GPU count above the schema bound", {"node": name, "detail": gpu.clamped})
        )
    known_gpu = old.known_gpu
    if gpu.healthy is None and gpu.total < known_gpu:
        # Capacity shrank (the device plugin went away): a dip of the GPUs known.
        gone = known_gpu - gpu.total + gpu.missing
        res = rules.resource(flavor)
        gpu = GpuState(
            known_gpu, missing=gone, missing_reason=f"{gone} of {known_gpu} {res} not allocatable"
        )
    elif gpu.healthy is None and not gpu.missing:
        known_gpu = gpu.total
    dip_since: float | None = None
    if gpu.missing:
        dip_since = old.dip_since or now
        if now - dip_since >= cfg.allocatable_debounce_s:
            why.append(gpu.missing_reason)
    mismatch = gpu_product_mismatch(node.metadata.labels, flavor.gpu_type)
    if mismatch:
        why.append(mismatch)
        if old.mismatch != mismatch:
            out.bad_input.append(
                ("GPU product disagrees with its flavor", {"node": name, "detail": mismatch})
            )
    if seen.unselected:
        why.append("left the node selector")
    if seen.left_flavor:
        why.append("matches no flavor any more")
    # GPU health: only explicit faults and their recovery are news.
    if (old.gpu.healthy if old.gpu else None) != gpu.healthy:
        out.health = GpuHealth(
            node=name,
            healthy=gpu.total if gpu.healthy is None else gpu.healthy,
            xid=gpu.xid,
            reason=gpu.reason or "GPUs healthy again",
        )
    new = NodeSignals(
        gpu=gpu,
        known_gpu=known_gpu,
        spot_deadline=spot_deadline,
        spot_reason=spot_reason,
        notice_seen=notice_seen,
        dip_since=dip_since,
        not_ready_seen=not_ready_seen,
        mismatch=mismatch or "",
        lost=lost,
        why=tuple(why),
    )
    return new, out


class NodeWatch:
    """Every node of a configured flavor, judged on each change of the node or of a pod's
    DisruptionTarget, and re-judged on the clock while a signal is being timed."""

    def __init__(
        self,
        config: KubeBackendConfig,
        rules: Rules,
        other: Callable[[str, str], Usage],
        namespaces: Collection[str],
        topology_levels: Sequence[str],
        clock: Callable[[], float],
        bad_input: BadInput,
        log: Any,
        send: Callable[[AgentEvent], None],
        rest: Callable[[], KubeRest],
        spawn: Callable[[Coroutine[Any, Any, None]], None],
        on_gone: Callable[[str], None],
    ) -> None:
        self.config = config
        self.rules = rules
        self.other = other  # what pods not of running attempts use: (node, resource)
        self.namespaces = namespaces
        self.topology_levels = tuple(topology_levels)
        self._clock = clock
        self.bad_input = bad_input
        self.log = log
        self._send = send
        self._rest = rest
        self._spawn = spawn  # runs a check in the background
        self._on_gone = on_gone  # a node was deleted: its replicas are lost
        self.nodes: dict[str, NodeEntry] = {}
        # Recently deleted nodes: a pod event can arrive after its node's deletion (separate
        # watches), and its replica is lost all the same.
        self.gone: OrderedDict[str, None] = OrderedDict()
        # pod uid -> (node, text, when, reason, Muster's own pod) while its DisruptionTarget
        # may say the node goes away (nodes.counts_for_node decides)
        self.disruptions: dict[str, PodDisruption] = {}

    @property
    def rest(self) -> KubeRest:
        return self._rest()

    def node_signals(self) -> Mapping[str, NodeSignals]:
        """Each node's latest judged signals, by name (a copy; the signals are frozen)."""
        return MappingProxyType({name: n.signals for name, n in self.nodes.items()})

    def send_outstanding(self) -> None:
        """Send the spot notices and GPU faults the first lists found (before the backend
        was live, nothing was sent)."""
        for name, n in self.nodes.items():
            if n.flavor is None:
                continue
            sig = n.signals
            if sig.spot_deadline is not None:
                self._send(
                    SpotNotice(node=name, deadline=sig.spot_deadline, reason=sig.spot_reason)
                )
            gpu = sig.gpu
            if gpu is not None and gpu.healthy is not None:
                self._send(
                    GpuHealth(node=name, healthy=gpu.healthy, xid=gpu.xid, reason=gpu.reason)
                )

    def provider_of(self, cmd: Dispatch) -> Provider:
        """The provider of the nodes an attempt goes to (its pods' spot grace)."""
        for a in cmd.assignment:
            for name in a.nodes:
                entry = self.nodes.get(name)
                if entry is not None:
                    return detect_provider(entry.raw)
        return "other"

    def gpu_memory_mib(self) -> dict[str, int]:
        """Per flavor, the least GPU memory its nodes report (GPU feature discovery)."""
        mem: dict[str, int] = {}
        for n in self.nodes.values():
            if n.flavor is not None:
                m = gfd_memory_mib(n.raw)
                if m:
                    mem[n.flavor.name] = min(mem.get(n.flavor.name, m), m)
        return mem

    async def replace_nodes(self, items: list[KNode]) -> None:
        seen = set()
        async for node in Pacer().each(items):
            if node.metadata.name:
                seen.add(node.metadata.name)
                self._upsert_node(node)
        for name in [n for n in self.nodes if n not in seen]:
            self._node_missing(name, "node gone (not in re-list)")

    def node_event(self, kind: str, node: KNode) -> None:
        if not node.metadata.name:
            self.bad_input.note("Node", "no name")
            return
        if kind == "DELETED":
            self._node_missing(node.metadata.name, "node deleted")
        else:
            self._upsert_node(node)

    def _node_missing(self, name: str, reason: str) -> None:
        """A node left the watch. Without a label selector that is a deletion. With one, it
        may only have stopped matching (the API server says DELETED for both): ask."""
        entry = self.nodes.get(name)
        if entry is not None and entry.unselected:
            return
        if not self.config.node_label_selector:
            self._remove_node(name, reason)
            return
        self._spawn(self._confirm_gone(name, reason))

    async def _confirm_gone(self, name: str, reason: str) -> None:
        try:
            data = await self.rest.request("GET", f"/api/v1/nodes/{name}", ok_missing=True)
        except (TimeoutError, KubeApiError, OSError, aiohttp.ClientError) as exc:
            self.log.warning(
                "could not tell a deleted node from an unselected one",
                node=name,
                error=str(exc)[:200],
            )
            return  # the next resync asks again
        entry = self.nodes.get(name)
        if data is None:
            self._remove_node(name, reason)
        elif entry is not None:
            entry.unselected = True
            self.evaluate(entry)

    def _remove_node(self, name: str, reason: str) -> None:
        self.gone[name] = None
        while len(self.gone) > 4096:
            self.gone.popitem(last=False)
        entry = self.nodes.pop(name, None)
        if entry is not None and entry.info is not None:
            self._send(NodeGone(node=name, reason=reason))
        self._on_gone(name)

    def _upsert_node(self, node: KNode) -> None:
        name = node.metadata.name
        self.gone.pop(name, None)
        flavor = match_flavor(node, self.config.flavors)
        entry = self.nodes.get(name)
        if entry is None:
            entry = self.nodes[name] = NodeEntry(node, flavor)
        entry.raw = node
        entry.unselected = False
        if flavor is None:
            if entry.info is None:
                entry.flavor = None
                return
            # Its labels changed under it: it takes no new pods; what runs there stays.
            entry.left_flavor = True
        else:
            entry.flavor, entry.left_flavor = flavor, False
        self.evaluate(entry)

    def evaluate(self, entry: NodeEntry) -> None:
        """Assess one node (`nodewatch.assess_node`), log and count what it found, refresh
        its NodeInfo, then send what is news."""
        flavor = entry.flavor
        if flavor is None:
            return
        name = entry.raw.metadata.name
        seen = Observation(
            entry.raw,
            flavor,
            tuple(self.disruptions.values()),
            unselected=entry.unselected,
            left_flavor=entry.left_flavor,
        )
        entry.signals, found = assess_node(
            entry.signals, seen, self.config, self.rules, self._clock()
        )
        if found.going_away_in_s is not None:
            self.log.info(
                "node going away",
                node=name,
                reason=entry.signals.spot_reason,
                deadline_in_s=found.going_away_in_s,
            )
        if found.newly_lost:
            self.log.warning(
                "node NotReady and out of service: replicas lost",
                node=name,
                grace_s=self.config.not_ready_grace_s,
            )
        for reason, detail in found.bad_input:
            self.bad_input.note("Node", reason, **detail)
        self.refresh(entry)
        if found.notice is not None:
            self._send(found.notice)
        if found.health is not None:
            self._send(found.health)

    def evaluate_timers(self) -> None:
        """Re-read the nodes whose verdict depends on time (a dip being debounced, a NotReady
        within its grace): the clock alone can change their state."""
        for entry in list(self.nodes.values()):
            if entry.flavor is not None and entry.signals.timed:
                self.evaluate(entry)

    def refresh(self, entry: NodeEntry) -> None:
        """Recompute the node's NodeInfo and emit NodeUpsert when it changed."""
        if entry.flavor is None:
            return
        name = entry.raw.metadata.name
        signals = entry.signals
        info = node_info(
            entry.raw,
            entry.flavor,
            self.rules,
            self.other(name, self.rules.resource(entry.flavor)),
            signals.spot_deadline,
            signals.gpu,
            lost=signals.lost,
            no_new_pods=list(signals.why),
            topology_levels=self.topology_levels,
        )
        if info != entry.info:
            entry.info = info
            self._send(NodeUpsert(node=info))

    def note_disruption(self, uid: str, pod: KPod, deleted: bool) -> None:
        """A node-level DisruptionTarget on any pod is a notice for its node."""
        node = pod.spec.nodeName
        dis = disruption(pod)
        if dis in self.rules.disruption_reasons and node and not deleted:
            if uid not in self.disruptions:
                at = next(
                    (
                        parse_time(c.lastTransitionTime)
                        for c in pod.status.conditions
                        if c.type == "DisruptionTarget"
                    ),
                    None,
                )
                own = LABEL_JOB in pod.metadata.labels and (
                    pod.metadata.namespace in self.namespaces
                )
                text = f"pod {pod.metadata.name}: {dis}"
                self.disruptions[uid] = (node, text, at, dis, own)
                entry = self.nodes.get(node)
                if entry is not None:
                    self.evaluate(entry)
        else:
            self.drop_disruption(uid)

    def drop_disruption(self, uid: str) -> None:
        old = self.disruptions.pop(uid, None)
        if old is not None:
            entry = self.nodes.get(old[0])
            if entry is not None:
                self.evaluate(entry)
