"""A pure kube-scheduler + kubelet admission stand-in: which node each Pending pod binds to.

It filters as the default scheduler's required plugins do: node unschedulable, taints and
tolerations (NoSchedule / NoExecute), nodeSelector, required node affinity (matchExpressions on
labels, matchFields on `metadata.name`; terms ORed, requirements ANDed), required pod affinity
and anti-affinity (both directions: the incoming pod's terms, and the terms of pods already on
a node against the incoming pod), and free allocatable resources (cpu, memory, pods and every
extended resource such as `nvidia.com/gpu`). Pods are taken one at a time, in the order given,
with no backtracking and no preemption, so a gang whose templates allow a bad early choice can
deadlock here exactly as on a real cluster. Among feasible nodes it takes the least allocated
(the default scoring), or a seeded random one (`rng`) to explore the choices a real scheduler
may make.

A pod that fits nowhere stays Pending with `PodScheduled=False`, reason `Unschedulable`, and a
message in the scheduler's "0/N nodes are available: ..." form.
"""

from __future__ import annotations

import copy
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from schemas.quantity import cpu_milli, memory_bytes, parse_quantity

Obj = dict[str, Any]


def _quantity(resource: str, value: Any) -> int:
    if resource == "cpu":
        return cpu_milli(value)
    if resource in ("memory", "ephemeral-storage") or resource.startswith("hugepages-"):
        return memory_bytes(value)
    return int(parse_quantity(value))


def _container_requests(container: Obj) -> Counter[str]:
    resources = container.get("resources") or {}
    requests = dict(resources.get("limits") or {})  # a missing request defaults to the limit
    requests.update(resources.get("requests") or {})
    return Counter({k: _quantity(k, v) for k, v in requests.items()})


def pod_requests(pod: Obj) -> Counter[str]:
    """What a pod takes from a node, as the scheduler counts it, written independently of
    `kinds.requests` (so the two can disagree in a test) as the kubelet's timeline of the pod:
    each init container runs beside the native sidecars started before it; a sidecar keeps
    running; then the containers run beside every sidecar. The pod needs the peak of that
    timeline per resource; pod-level `spec.resources.requests` (cpu, memory, hugepages-*)
    override it; the RuntimeClass `spec.overhead` comes on top. Rules: Kubernetes
    component-helpers `PodRequests` and the sidecar KEP (sig-node 753), docs/kubernetes.md."""
    spec = pod.get("spec") or {}
    running: Counter[str] = Counter()  # sidecars started so far
    steps: list[Counter[str]] = []
    for c in spec.get("initContainers") or []:
        req = _container_requests(c)
        if c.get("restartPolicy") == "Always":
            running = running + req
            steps.append(Counter(running))
        else:
            steps.append(running + req)
    main: Counter[str] = Counter(running)
    for c in spec.get("containers") or []:
        main.update(_container_requests(c))
    steps.append(main)
    out: Counter[str] = Counter()
    for step in steps:
        for k, v in step.items():
            out[k] = max(out[k], v)
    level = (spec.get("resources") or {}).get("requests") or {}
    for k, v in level.items():
        if k in ("cpu", "memory") or k.startswith("hugepages-"):
            out[k] = _quantity(k, v)
    for k, v in (spec.get("overhead") or {}).items():
        out[k] += _quantity(k, v)
    out["pods"] = 1
    return out


def node_allocatable(node: Obj) -> Counter[str]:
    alloc = (node.get("status") or {}).get("allocatable") or {}
    out = Counter({k: _quantity(k, v) for k, v in alloc.items()})
    out.setdefault("pods", 110)
    return out


def _labels(obj: Obj) -> dict[str, str]:
    return dict((obj.get("metadata") or {}).get("labels") or {})


def _name(obj: Obj) -> str:
    return str((obj.get("metadata") or {}).get("name", ""))


def _namespace(obj: Obj) -> str:
    return str((obj.get("metadata") or {}).get("namespace") or "default")


def _requirement(req: Obj, value: str | None) -> bool:
    op = req.get("operator")
    values = [str(v) for v in req.get("values") or []]
    if op == "In":
        return value is not None and value in values
    if op == "NotIn":
        return value is None or value not in values
    if op == "Exists":
        return value is not None
    if op == "DoesNotExist":
        return value is None
    if op in ("Gt", "Lt") and value is not None and values:
        try:
            a, b = int(value), int(values[0])
        except ValueError:
            return False
        return a > b if op == "Gt" else a < b
    return False


def _node_term(term: Obj, node: Obj) -> bool:
    exprs = term.get("matchExpressions") or []
    fields = term.get("matchFields") or []
    if not exprs and not fields:
        return False  # an empty term matches no node
    labels = _labels(node)
    if not all(_requirement(r, labels.get(r.get("key", ""))) for r in exprs):
        return False
    name = _name(node)
    return all(_requirement(r, name if r.get("key") == "metadata.name" else None) for r in fields)


def _label_selector(selector: Obj | None, labels: dict[str, str]) -> bool:
    if selector is None:
        return False  # a nil selector matches nothing
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    return all(
        _requirement(r, labels.get(r.get("key", "")))
        for r in selector.get("matchExpressions") or []
    )


def _tolerates(taint: Obj, tolerations: list[Obj]) -> bool:
    for t in tolerations:
        if t.get("effect") and t.get("effect") != taint.get("effect"):
            continue
        op = t.get("operator") or "Equal"
        if not t.get("key"):
            if op == "Exists":
                return True
            continue
        if t.get("key") != taint.get("key"):
            continue
        if op == "Exists" or (t.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


def _terms(pod: Obj, kind: str) -> list[Obj]:
    affinity = (pod.get("spec") or {}).get("affinity") or {}
    return list(
        (affinity.get(kind) or {}).get("requiredDuringSchedulingIgnoredDuringExecution") or []
    )


def _term_matches(term: Obj, owner: Obj, other: Obj) -> bool:
    namespaces = term.get("namespaces") or [_namespace(owner)]
    if _namespace(other) not in namespaces and term.get("namespaceSelector") is None:
        return False
    return _label_selector(term.get("labelSelector"), _labels(other))


@dataclass
class Cluster:
    """Nodes and the pods bound to them; `schedule()` binds more."""

    nodes: list[Obj]
    bound: list[tuple[Obj, str]] = field(default_factory=list)  # (pod, node name)

    def used(self, node: str) -> Counter[str]:
        out: Counter[str] = Counter()
        for pod, where in self.bound:
            if where == node:
                out.update(pod_requests(pod))
        return out

    def _node(self, name: str) -> Obj | None:
        return next((n for n in self.nodes if _name(n) == name), None)

    def _domain_pods(self, node: Obj, key: str) -> list[Obj]:
        value = _labels(node).get(key)
        if value is None:
            return []
        out = []
        for pod, where in self.bound:
            other = self._node(where)
            if other is not None and _labels(other).get(key) == value:
                out.append(pod)
        return out

    def why_not(self, pod: Obj, node: Obj) -> str | None:
        """None when `pod` may bind to `node`, else the scheduler's reason."""
        spec = pod.get("spec") or {}
        node_spec = node.get("spec") or {}
        if node_spec.get("unschedulable"):
            return "node(s) were unschedulable"
        tolerations = list(spec.get("tolerations") or [])
        for taint in node_spec.get("taints") or []:
            if taint.get("effect") in ("NoSchedule", "NoExecute") and not _tolerates(
                taint, tolerations
            ):
                shown = f"{taint.get('key')}: {taint.get('value', '')}"
                return f"node(s) had untolerated taint {{{shown}}}"
        labels = _labels(node)
        for k, v in (spec.get("nodeSelector") or {}).items():
            if labels.get(k) != v:
                return "node(s) didn't match Pod's node affinity/selector"
        required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution"
        )
        if required is not None and not any(
            _node_term(t, node) for t in required.get("nodeSelectorTerms") or []
        ):
            return "node(s) didn't match Pod's node affinity/selector"
        for term in _terms(pod, "podAntiAffinity"):
            domain = self._domain_pods(node, term.get("topologyKey", ""))
            if any(_term_matches(term, pod, other) for other in domain):
                return "node(s) didn't match pod anti-affinity rules"
        for pod_b, where in self.bound:
            other_node = self._node(where)
            if other_node is None:
                continue
            for term in _terms(pod_b, "podAntiAffinity"):
                key = term.get("topologyKey", "")
                same = _labels(other_node).get(key)
                if same is not None and same == labels.get(key) and _term_matches(term, pod_b, pod):
                    return "node(s) didn't satisfy existing pods anti-affinity rules"
        for term in _terms(pod, "podAffinity"):
            domain = self._domain_pods(node, term.get("topologyKey", ""))
            anywhere = any(_term_matches(term, pod, p) for p, _ in self.bound)
            self_match = _term_matches(term, pod, pod)
            if not any(_term_matches(term, pod, p) for p in domain) and (
                anywhere or not self_match
            ):
                return "node(s) didn't match pod affinity rules"
        free = node_allocatable(node)
        free.subtract(self.used(_name(node)))
        for resource, amount in pod_requests(pod).items():
            if amount > free.get(resource, 0):
                return f"Insufficient {resource}"
        return None

    def schedule(self, pods: list[Obj], rng: random.Random | None = None) -> list[Obj]:
        """Bind each Pending pod in order (or leave it Pending); returns updated copies."""
        out: list[Obj] = []
        for pod in pods:
            pod = copy.deepcopy(pod)
            status = pod.setdefault("status", {})
            node_name = (pod.get("spec") or {}).get("nodeName")
            if node_name:
                self.bound.append((pod, node_name))
                out.append(pod)
                continue
            reasons: Counter[str] = Counter()
            feasible = []
            for node in self.nodes:
                why = self.why_not(pod, node)
                if why is None:
                    feasible.append(node)
                else:
                    reasons[why] += 1
            if not feasible:
                listed = ", ".join(f"{n} {r}" for r, n in sorted(reasons.items()))
                status["phase"] = "Pending"
                status["conditions"] = [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": f"0/{len(self.nodes)} nodes are available: {listed}.",
                    }
                ]
                out.append(pod)
                continue
            if rng is not None:
                chosen = rng.choice(feasible)
            else:
                chosen = max(feasible, key=self._free_share)
            pod["spec"]["nodeName"] = _name(chosen)
            status["phase"] = "Pending"
            status["conditions"] = [{"type": "PodScheduled", "status": "True"}]
            self.bound.append((pod, _name(chosen)))
            out.append(pod)
        return out

    def _free_share(self, node: Obj) -> tuple[float, str]:
        alloc = node_allocatable(node)
        used = self.used(_name(node))
        shares = [1 - used[r] / alloc[r] for r in ("cpu", "memory") if alloc.get(r)]
        return (sum(shares) / len(shares) if shares else 0.0, _name(node))


def schedule(nodes: list[Obj], pods: list[Obj], rng: random.Random | None = None) -> list[Obj]:
    """Bind `pods` (already-bound ones first claim their nodes) onto `nodes`."""
    cluster = Cluster(nodes)
    bound = [p for p in pods if (p.get("spec") or {}).get("nodeName")]
    pending = [p for p in pods if not (p.get("spec") or {}).get("nodeName")]
    cluster.schedule(bound)
    return cluster.schedule(pending, rng)


def unscheduled(pods: list[Obj]) -> list[Obj]:
    return [p for p in pods if not (p.get("spec") or {}).get("nodeName")]


def pods_from_template(
    template: Obj, count: int, prefix: str, namespace: str = "default"
) -> list[Obj]:
    """The pods a controller creates from one pod template (names `<prefix>-<i>`)."""
    out = []
    for i in range(count):
        meta = copy.deepcopy(template.get("metadata") or {})
        meta["name"] = f"{prefix}-{i}"
        meta["namespace"] = namespace
        out.append(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": meta,
                "spec": copy.deepcopy(template["spec"]),
            }
        )
    return out


def make_node(
    name: str,
    gpu: int = 8,
    cpu: str = "96",
    memory: str = "768Gi",
    labels: dict[str, str] | None = None,
    taints: list[Obj] | None = None,
    gpu_resource: str = "nvidia.com/gpu",
) -> Obj:
    """A Node object as the API server reports it (hostname label set like the kubelet)."""
    node: Obj = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
        "spec": {"taints": list(taints or [])},
        "status": {
            "allocatable": {"cpu": cpu, "memory": memory, gpu_resource: str(gpu), "pods": "110"}
        },
    }
    return node
