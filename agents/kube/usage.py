"""Foreign usage of nodes: what pods Muster did not place (and Muster's own pods of ended
attempts, still terminating) hold on each node.

The watch of every unfinished pod feeds `ForeignPods` one pod at a time; `ForeignUsage` keeps
a few integers per pod and a summed vector per node, so a node's `NodeInfo` can subtract what
others use without a cache of every pod of the cluster.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from agents.kube.attempts import Attempts
from agents.kube.client import Pacer
from agents.kube.decode import ZERO, KPod, Usage, pod_usage
from agents.kube.nodewatch import NodeWatch
from agents.kube.pools import is_placeholder
from kinds.base import LABEL_JOB


class ForeignUsage:
    """Per pod uid: (node, (cpu, memory, GPUs per resource)); per node: their sum. Usage is
    kept per GPU resource, so a pod requesting a MIG slice is never counted against a node's
    whole GPUs."""

    def __init__(self, resources: Iterable[str]) -> None:
        self.resources = tuple(sorted(set(resources)))
        self.pods: dict[str, tuple[str, tuple[int, ...]]] = {}
        self.nodes: dict[str, list[int]] = {}  # node -> summed foreign usage

    def other(self, node: str, resource: str) -> Usage:
        """What pods not of the node's Muster attempts use there, for one GPU resource."""
        vec = self.nodes.get(node)
        if vec is None:
            return ZERO
        return Usage(vec[2 + self.resources.index(resource)], vec[0], vec[1])

    def demand(self, pod: KPod) -> tuple[int, ...]:
        """(cpu, memory, GPUs of each configured resource) that a pod holds on its node."""
        first = pod_usage(pod, self.resources[0])
        gpus = [first.gpu] + [pod_usage(pod, r).gpu for r in self.resources[1:]]
        return (first.cpu_milli, first.memory, *gpus)

    def set(self, uid: str, node: str | None, usage: tuple[int, ...], touched: set[str]) -> bool:
        """Record what pod `uid` holds now (`node` None or zero usage: nothing); the nodes
        whose sum changed are added to `touched`. False when nothing changed."""
        old = self.pods.pop(uid, None)
        if old is not None and node == old[0] and usage == old[1]:
            self.pods[uid] = old  # unchanged (a re-list, a status-only change)
            return False
        if old is not None:
            vec = self.nodes[old[0]]
            for i, v in enumerate(old[1]):
                vec[i] -= v
            touched.add(old[0])
        if node and any(usage):
            self.pods[uid] = (node, usage)
            vec = self.nodes.setdefault(node, [0] * (2 + len(self.resources)))
            for i, v in enumerate(usage):
                vec[i] += v
            touched.add(node)
        for n in (old[0],) if old is not None else ():
            if not any(self.nodes.get(n, ())):
                self.nodes.pop(n, None)
        return True


class ForeignPods:
    """The watch of every unfinished pod, all namespaces: what each pod not of a running
    Muster attempt holds, and each pod's DisruptionTarget for the node watch."""

    def __init__(
        self,
        usage: ForeignUsage,
        node_watch: NodeWatch,
        attempts: Attempts,
        namespaces: Collection[str],
    ) -> None:
        self.usage = usage
        self.node_watch = node_watch
        self.attempts = attempts
        self.namespaces = namespaces

    async def page(self, items: list[KPod]) -> None:
        """One page of a (re-)list of every unfinished pod. Nodes are refreshed once per
        page, not once per pod."""
        touched: set[str] = set()
        pacer = Pacer()
        async for pod in pacer.each(items):
            if pod.metadata.uid:
                self.event("MODIFIED", pod, touched)
        async for name in pacer.each(touched):
            entry = self.node_watch.nodes.get(name)
            if entry is not None:
                self.node_watch.refresh(entry)

    async def listed(self, seen: set[str], complete: bool) -> None:
        """The list is complete: pods it did not hold are gone. Linear: one pass over what
        the backend holds, set lookups only, yielding as it goes."""
        if not complete:
            return  # an undecodable pod may be one of them: nothing is taken as gone
        owned = self.attempts.pod_key  # Muster's own pods are the muster-pods watch's to forget
        pacer = Pacer()
        gone: set[str] = set()
        for held in (self.usage.pods, self.node_watch.disruptions):
            async for uid in pacer.each(list(held)):
                if uid not in seen and uid not in owned:
                    gone.add(uid)
        async for uid in pacer.each(gone):
            self.set(uid, None, ())
            self.node_watch.drop_disruption(uid)

    def event(self, kind: str, pod: KPod, touched: set[str] | None = None) -> None:
        """Every unfinished pod of the cluster (field selector): capacity and signals.
        With `touched`, the nodes whose usage changed are collected there, not refreshed."""
        meta = pod.metadata
        uid = meta.uid or f"{meta.namespace}/{meta.name}"
        deleted = kind == "DELETED"
        self.node_watch.note_disruption(uid, pod, deleted)
        if LABEL_JOB in meta.labels and meta.namespace in self.namespaces:
            return  # Muster's own: the muster-pods watch accounts for it
        if is_placeholder(meta.labels) and meta.namespace in self.namespaces:
            return  # holds a new node for the gang the broker will place there
        node = pod.spec.nodeName
        active = not deleted and node and pod.status.phase not in ("Succeeded", "Failed")
        usage = self.usage.demand(pod) if active else ()
        self.set(uid, node if active else None, usage, touched)

    def hold(self, uid: str, pod: KPod, deleted: bool) -> None:
        """A Muster pod of an attempt that ended (cancelled, or reported finished) but still
        terminating holds its GPUs: the broker has released them, so count them as foreign
        until the pod is gone."""
        key = self.attempts.pod_key.get(uid)
        w = self.attempts.workloads.get(key) if key is not None else None
        node = pod.spec.nodeName
        held = (
            w is not None
            and (w.cancelled or w.terminal)
            and not deleted
            and bool(node)
            and pod.status.phase not in ("Succeeded", "Failed")
        )
        self.set(uid, node if held else None, self.usage.demand(pod) if held else ())

    def set(
        self,
        uid: str,
        node: str | None,
        usage: tuple[int, ...],
        touched: set[str] | None = None,
    ) -> None:
        """Record what a pod holds; refresh the nodes it changed, or with `touched`, collect
        them there."""
        changed: set[str] = set() if touched is None else touched
        if not self.usage.set(uid, node, usage, changed) or touched is not None:
            return
        for n in changed:
            entry = self.node_watch.nodes.get(n)
            if entry is not None:
                self.node_watch.refresh(entry)
