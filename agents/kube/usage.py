"""Foreign usage of nodes: what pods Muster did not place (and Muster's own pods of ended
attempts, still terminating) hold on each node.

The pod watches feed it one pod at a time; it keeps a few integers per pod and a summed
vector per node, so a node's `NodeInfo` can subtract what others use without a cache of
every pod of the cluster.
"""

from __future__ import annotations

from collections.abc import Iterable

from agents.kube.decode import ZERO, KPod, Usage, pod_usage


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
