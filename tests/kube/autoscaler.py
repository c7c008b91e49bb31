"""Autoscalers for the stand-in API server: a Karpenter-like provisioner and the cluster
autoscaler's ProvisioningRequest, both test stand-ins, NOT the real controllers.

Karpenter (kubernetes-sigs/karpenter, `karpenter.sh/v1`, Apache-2.0; the CRDs vendored in
`tests/kube/crds/` unmodified, so the API server validates NodePools and NodeClaims strictly,
and every object this module writes is checked against them too):

* a Pending, unbound pod that fits no existing node (the scheduling stand-in's filters:
  nodeSelector, required node affinity, taints and tolerations, free resources) and fits the
  node a NodePool would make (its template's labels, the single-valued `In` requirements,
  `karpenter.sh/nodepool`, its taints and the instance type's allocatable) gets a NodeClaim of
  that pool, highest `spec.weight` first, within the pool's `spec.limits` counted over all its
  NodeClaims; one NodeClaim (one node) per pod, no bin-packing;
* after a seeded delay the NodeClaim launches: a Ready Node with the template's labels and
  taints and the instance type's capacity, and the NodeClaim's status (`providerID`,
  `nodeName`, capacity, conditions `Launched`, `Registered`, `Initialized`, `Ready`);
* a pool listed in `stockouts` cannot launch: its NodeClaim gets `Launched=False` with reason
  `InsufficientCapacity` and is deleted, and the pod is tried again after `retry_s`;
* consolidation, drift and expiry are not modelled (nodes stay until a test removes them).

ProvisioningRequest (kubernetes/autoscaler `cluster-autoscaler/apis/provisioningrequest`,
`autoscaling.x-k8s.io/v1`, Apache-2.0; condition reasons from
`cluster-autoscaler/provisioningrequest/conditions/conditions.go`), served only with
`provisioning_requests=True` (else the group answers 404, as when the CRD is not installed):

* `check-capacity.autoscaling.x-k8s.io`: `Provisioned=True` (`CapacityIsFound`) when every pod
  of every podSet fits the existing nodes at once, else `Provisioned=False`
  (`CapacityIsNotFound`);
* `best-effort-atomic-scale-up.autoscaling.x-k8s.io`: `Accepted=True`, then all or nothing
  for the whole request: NodeClaims for every pod (within the pools' limits) and
  `Provisioned=True` (`CapacityIsProvisioned`) once every node is Ready; a pod no pool can hold,
  a limit, or one stocked-out NodeClaim gives `Failed=True` and deletes every NodeClaim of the
  request. `BookingExpired=True` (`CapacityReservationTimeExpired`) `booking_s` after
  `Provisioned` when no pod carries `autoscaling.x-k8s.io/consume-provisioning-request` with
  its name; a pod that carries it is not provisioned for on its own.

Time is what `reconcile(now)` is given: tests drive it (deterministic), or `run()` drives it
from the loop's clock every `tick_s`.
"""

from __future__ import annotations

import asyncio
import copy
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from tests.kube.fake_apiserver import FakeApiServer, now_rfc3339
from tests.kube.scheduling import Cluster, make_node, node_allocatable
from tests.kube.validation import rejection

Obj = dict[str, Any]

KARPENTER = "karpenter.sh/v1"
NODEPOOLS = "/apis/karpenter.sh/v1/nodepools"
NODECLAIMS = "/apis/karpenter.sh/v1/nodeclaims"
NODES = "/api/v1/nodes"
PROVREQ = "autoscaling.x-k8s.io/v1"
NODEPOOL_LABEL = "karpenter.sh/nodepool"
CAPACITY_TYPE_LABEL = "karpenter.sh/capacity-type"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
CONSUME = "autoscaling.x-k8s.io/consume-provisioning-request"
CHECK_CAPACITY = "check-capacity.autoscaling.x-k8s.io"
ATOMIC = "best-effort-atomic-scale-up.autoscaling.x-k8s.io"


@dataclass(frozen=True)
class InstanceType:
    """What one node of a type brings (the cloud provider's catalogue in real Karpenter)."""

    gpu: int = 8
    cpu: str = "96"
    memory: str = "1152Gi"


@dataclass
class _Claim:
    name: str
    pool: str
    due: float
    pod_uid: str = ""
    request: str = ""  # namespace/name of the ProvisioningRequest it is part of
    launched: bool = False
    node: str = ""  # the node it launched


def _cond(type_: str, status: str, reason: str, message: str) -> Obj:
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": now_rfc3339(),
    }


def _set_cond(obj: Obj, cond: Obj) -> None:
    conds = obj.setdefault("status", {}).setdefault("conditions", [])
    conds[:] = [c for c in conds if c.get("type") != cond["type"]] + [cond]


def _has(obj: Obj, type_: str, status: str = "True") -> bool:
    conds = (obj.get("status") or {}).get("conditions") or []
    return any(c.get("type") == type_ and c.get("status") == status for c in conds)


def _checked(obj: Obj) -> Obj:
    """What a controller writes passes the API server's validation too."""
    bad = rejection(obj)
    assert bad is None, bad
    return obj


@dataclass
class Autoscaler:
    """The provisioners of one stand-in cluster (see the module docstring)."""

    server: FakeApiServer
    instance_types: dict[str, InstanceType] = field(
        default_factory=lambda: {"p4d.24xlarge": InstanceType()}
    )
    delay_s: tuple[float, float] = (0.05, 0.2)
    seed: int = 0
    stockouts: set[str] = field(default_factory=set)
    retry_s: float = 1.0
    booking_s: float = 600.0
    provisioning_requests: bool = False
    tick_s: float = 0.02
    launched: list[str] = field(default_factory=list)  # node names, in launch order
    failed_claims: list[str] = field(default_factory=list)
    _claims: dict[str, _Claim] = field(default_factory=dict)
    _retry_at: dict[str, float] = field(default_factory=dict)  # pod uid -> not before
    _provisioned_at: dict[str, float] = field(default_factory=dict)
    _rng: random.Random = field(init=False)
    _serial: int = 0

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        if not self.provisioning_requests:
            self.server.missing_groups.add("autoscaling.x-k8s.io")

    async def run(self) -> None:
        """Reconcile every `tick_s` on the loop's clock until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            self.reconcile(loop.time())
            await asyncio.sleep(self.tick_s)

    # -- views ----------------------------------------------------------------------------
    def pools(self) -> list[Obj]:
        items = self.server.items(KARPENTER, "nodepools")
        return sorted(items, key=lambda p: (-int(p["spec"].get("weight") or 0), _name(p)))

    def nodeclaims(self, pool: str | None = None) -> list[Obj]:
        items = self.server.items(KARPENTER, "nodeclaims")
        if pool is None:
            return items
        return [c for c in items if c["metadata"].get("labels", {}).get(NODEPOOL_LABEL) == pool]

    def _instance(self, pool: Obj) -> tuple[str, InstanceType]:
        for req in pool["spec"]["template"]["spec"].get("requirements") or []:
            if req.get("key") == INSTANCE_TYPE_LABEL and req.get("operator") == "In":
                for name in req.get("values") or []:
                    if name in self.instance_types:
                        return name, self.instance_types[name]
        name = sorted(self.instance_types)[0]
        return name, self.instance_types[name]

    def node_of(self, pool: Obj, name: str) -> Obj:
        """The Node the pool makes: template labels, single-valued `In` requirements, the
        pool's label, the instance type's capacity, the template's taints."""
        tmpl = pool["spec"]["template"]
        labels = dict((tmpl.get("metadata") or {}).get("labels") or {})
        itype, shape = self._instance(pool)
        for req in tmpl["spec"].get("requirements") or []:
            values = req.get("values") or []
            if req.get("operator") == "In" and values:
                labels.setdefault(req["key"], values[0])
        labels[INSTANCE_TYPE_LABEL] = itype
        labels.setdefault(CAPACITY_TYPE_LABEL, "on-demand")
        labels[NODEPOOL_LABEL] = _name(pool)
        taints = copy.deepcopy(tmpl["spec"].get("taints") or [])
        node = make_node(name, shape.gpu, shape.cpu, shape.memory, labels, taints)
        node["status"]["capacity"] = dict(node["status"]["allocatable"])
        return node

    def _within_limits(self, pool: Obj, extra: int) -> bool:
        """The pool's NodeClaims plus `extra` more nodes stay within `spec.limits`."""
        limits = pool["spec"].get("limits") or {}
        if not limits:
            return True
        per_node = node_allocatable(self.node_of(pool, "x"))
        held: Counter[str] = Counter()
        for _ in range(len(self.nodeclaims(_name(pool))) + extra):
            held.update(per_node)
        wanted = node_allocatable({"status": {"allocatable": limits}})
        return all(held.get(k, 0) <= v for k, v in wanted.items() if k != "pods")

    def _cluster(self) -> Cluster:
        """The Ready nodes and what is on them: bound pods, and pods nominated to the node
        their NodeClaim launched (Karpenter counts them there until the scheduler binds)."""
        nodes = [n for n in self.server.items("v1", "nodes") if _ready(n)]
        nominated = {c.pod_uid: c.node for c in self._claims.values() if c.pod_uid and c.node}
        bound = []
        for p in self.server.items("v1", "pods"):
            if p.get("status", {}).get("phase") in _DONE:
                continue
            where = p["spec"].get("nodeName") or nominated.get(p["metadata"].get("uid", ""))
            if where:
                bound.append((p, where))
        return Cluster(nodes, bound)

    def _pool_for(self, pod: Obj, taken: Counter[str]) -> Obj | None:
        """The first pool by weight whose node the pod fits, with room for one more node
        beside its NodeClaims and the `taken` ones not created yet."""
        for pool in self.pools():
            probe = Cluster([self.node_of(pool, "probe")])
            if probe.why_not(pod, probe.nodes[0]) is None and self._within_limits(
                pool, taken[_name(pool)] + 1
            ):
                return pool
        return None

    # -- reconcile ------------------------------------------------------------------------
    def reconcile(self, now: float) -> None:
        """One pass of every controller at time `now`."""
        if self.provisioning_requests:
            self._requests(now)
        self._pending_pods(now)
        self._launch(now)

    def _pending_pods(self, now: float) -> None:
        nominated = {c.pod_uid for c in self._claims.values() if c.pod_uid}
        cluster = self._cluster()
        for pod in self.server.items("v1", "pods"):
            meta = pod["metadata"]
            uid = meta.get("uid", "")
            if (
                pod["spec"].get("nodeName")
                or meta.get("deletionTimestamp")
                or pod.get("status", {}).get("phase") in _DONE
                or CONSUME in (meta.get("annotations") or {})
                or uid in nominated
                or self._retry_at.get(uid, 0.0) > now
            ):
                continue
            if any(cluster.why_not(pod, n) is None for n in cluster.nodes):
                continue  # the scheduler binds it; nothing to provision
            pool = self._pool_for(pod, Counter())  # its claim counts at once
            if pool is not None:
                self._new_claim(pool, now, pod_uid=uid)

    def _new_claim(self, pool: Obj, now: float, pod_uid: str = "", request: str = "") -> str:
        self._serial += 1
        name = f"{_name(pool)}-{self._rng.getrandbits(24):06x}{self._serial}"
        tmpl = pool["spec"]["template"]
        labels = {**((tmpl.get("metadata") or {}).get("labels") or {}), NODEPOOL_LABEL: _name(pool)}
        _itype, shape = self._instance(pool)
        claim: Obj = {
            "apiVersion": KARPENTER,
            "kind": "NodeClaim",
            "metadata": {
                "name": name,
                "labels": labels,
                "ownerReferences": [
                    {
                        "apiVersion": KARPENTER,
                        "kind": "NodePool",
                        "name": _name(pool),
                        "uid": pool["metadata"]["uid"],
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": {
                "nodeClassRef": copy.deepcopy(tmpl["spec"]["nodeClassRef"]),
                "requirements": copy.deepcopy(tmpl["spec"].get("requirements") or []),
                "taints": copy.deepcopy(tmpl["spec"].get("taints") or []),
                "resources": {"requests": {"nvidia.com/gpu": str(shape.gpu)}},
            },
        }
        if not claim["spec"]["taints"]:
            del claim["spec"]["taints"]
        self.server.put(NODECLAIMS, _checked(claim))
        lo, hi = self.delay_s
        due = now + lo + (hi - lo) * self._rng.random()
        self._claims[name] = _Claim(name, _name(pool), due, pod_uid, request)
        return name

    def _launch(self, now: float) -> None:
        pools = {_name(p): p for p in self.pools()}
        for c in sorted(self._claims.values(), key=lambda c: (c.due, c.name)):
            if c.launched or c.due > now or c.name not in self._claims:
                continue  # (a request that failed meanwhile released it)
            obj = self.server.get(f"{NODECLAIMS}/{c.name}")
            pool = pools.get(c.pool)
            if obj is None or pool is None:
                self._claims.pop(c.name, None)
                continue
            obj = copy.deepcopy(obj)
            if c.pool in self.stockouts:
                self._stock_out(c, obj, now)
                continue
            node_name = f"ip-10-0-{self._serial % 250}-{len(self.launched) + 1}.ec2.internal"
            node = self.node_of(pool, node_name)
            node["spec"]["providerID"] = f"aws:///us-east-1a/i-{c.name[-8:]}"
            node["status"]["conditions"] = [
                {"type": "Ready", "status": "True", "reason": "KubeletReady"}
            ]
            self.server.put(NODES, node)
            status = obj.setdefault("status", {})
            status.update(
                providerID=node["spec"]["providerID"],
                nodeName=node_name,
                capacity=dict(node["status"]["capacity"]),
                allocatable=dict(node["status"]["allocatable"]),
            )
            for t in ("Launched", "Registered", "Initialized", "Ready"):
                _set_cond(obj, _cond(t, "True", t, ""))
            self.server.put(NODECLAIMS, _checked(obj))
            c.launched, c.node = True, node_name
            self.launched.append(node_name)

    def _stock_out(self, c: _Claim, obj: Obj, now: float) -> None:
        msg = f"all requested instance types were unavailable during launch (pool {c.pool})"
        _set_cond(obj, _cond("Launched", "False", "InsufficientCapacity", msg))
        self.server.put(NODECLAIMS, _checked(obj))
        self.server.delete(f"{NODECLAIMS}/{c.name}")
        del self._claims[c.name]
        self.failed_claims.append(c.name)
        if c.pod_uid:
            self._retry_at[c.pod_uid] = now + self.retry_s
        if c.request:
            self._fail_request(c.request, f"NodeClaim {c.name}: {msg}")

    # -- ProvisioningRequest ----------------------------------------------------------------
    def requests(self) -> list[Obj]:
        return self.server.items(PROVREQ, "provisioningrequests")

    def _path(self, ns: str, name: str = "") -> str:
        base = f"/apis/{PROVREQ}/namespaces/{ns}/provisioningrequests"
        return f"{base}/{name}" if name else base

    def _pods_of(self, pr: Obj) -> list[Obj] | None:
        """The pods the request's podSets stand for, or None when a template is missing."""
        ns = pr["metadata"]["namespace"]
        out = []
        for ps in pr["spec"]["podSets"]:
            tmpl = self.server.get(
                f"/api/v1/namespaces/{ns}/podtemplates/{ps['podTemplateRef']['name']}"
            )
            if tmpl is None:
                return None
            for i in range(int(ps["count"])):
                pod = {
                    "metadata": {"name": f"{ps['podTemplateRef']['name']}-{i}", "namespace": ns},
                    "spec": copy.deepcopy(tmpl["template"]["spec"]),
                }
                out.append(pod)
        return out

    def _write(self, pr: Obj) -> None:
        self.server.put(self._path(pr["metadata"]["namespace"]), pr)

    def _requests(self, now: float) -> None:
        for pr in self.requests():
            pr = copy.deepcopy(pr)
            key = f"{pr['metadata']['namespace']}/{pr['metadata']['name']}"
            if _has(pr, "Failed") or _has(pr, "BookingExpired"):
                continue
            cls = pr["spec"]["provisioningClassName"]
            if cls == CHECK_CAPACITY and not (pr.get("status") or {}).get("conditions"):
                self._check_capacity(pr)
            elif cls == ATOMIC and not _has(pr, "Accepted"):
                self._accept(pr, key, now)
            elif cls == ATOMIC and not _has(pr, "Provisioned"):
                mine = [c for c in self._claims.values() if c.request == key]
                if mine and all(c.launched for c in mine):
                    _set_cond(
                        pr,
                        _cond(
                            "Provisioned",
                            "True",
                            "CapacityIsProvisioned",
                            "Capacity is found in the cluster",
                        ),
                    )
                    self._write(pr)
                    self._provisioned_at[key] = now
            elif (
                _has(pr, "Provisioned")
                and now - self._provisioned_at.get(key, now) >= self.booking_s
            ) and not any(
                (p["metadata"].get("annotations") or {}).get(CONSUME) == pr["metadata"]["name"]
                for p in self.server.items("v1", "pods")
            ):
                _set_cond(
                    pr,
                    _cond(
                        "BookingExpired",
                        "True",
                        "CapacityReservationTimeExpired",
                        "Capacity reservation time is expired",
                    ),
                )
                self._write(pr)

    def _check_capacity(self, pr: Obj) -> None:
        pods = self._pods_of(pr) or []
        cluster = self._cluster()
        fits = bool(pods)
        for pod in pods:
            node = next((n for n in cluster.nodes if cluster.why_not(pod, n) is None), None)
            if node is None:
                fits = False
                break
            cluster.bound.append((pod, _name(node)))
        if fits:
            cond = _cond(
                "Provisioned", "True", "CapacityIsFound", "Capacity is found in the cluster"
            )
        else:
            cond = _cond("Provisioned", "False", "CapacityIsNotFound", "Capacity is not found")
        _set_cond(pr, cond)
        self._write(pr)

    def _accept(self, pr: Obj, key: str, now: float) -> None:
        _set_cond(
            pr,
            _cond(
                "Accepted",
                "True",
                "Accepted",
                "ProvisioningRequest is accepted by ClusterAutoscaler",
            ),
        )
        pods = self._pods_of(pr)
        taken: Counter[str] = Counter()
        chosen: list[Obj] = []
        for pod in pods or []:
            pool = self._pool_for(pod, taken)
            if pool is None:
                break
            taken[_name(pool)] += 1
            chosen.append(pool)
        if pods is None or len(chosen) < len(pods):
            why = "a pod template is missing" if pods is None else "no pool can hold the whole gang"
            _set_cond(pr, _cond("Failed", "True", "FailedToBookCapacity", why))
            self._write(pr)
            return
        self._write(pr)
        for pool in chosen:
            self._new_claim(pool, now, request=key)

    def _fail_request(self, key: str, message: str) -> None:
        """All or nothing: one NodeClaim lost fails the request and releases the others."""
        ns, name = key.split("/", 1)
        for c in [c for c in self._claims.values() if c.request == key]:
            del self._claims[c.name]
            obj = self.server.get(f"{NODECLAIMS}/{c.name}")
            node = (obj or {}).get("status", {}).get("nodeName")
            if obj is not None:
                self.server.delete(f"{NODECLAIMS}/{c.name}")
            if node:
                self.server.remove(f"{NODES}/{node}")
        pr = self.server.get(self._path(ns, name))
        if pr is not None:
            pr = copy.deepcopy(pr)
            _set_cond(pr, _cond("Failed", "True", "FailedToBookCapacity", message[:1000]))
            self._write(pr)


_DONE = ("Succeeded", "Failed")


def _name(obj: Obj) -> str:
    return str(obj["metadata"]["name"])


def _ready(node: Obj) -> bool:
    conds = (node.get("status") or {}).get("conditions") or []
    ready = [c for c in conds if c.get("type") == "Ready"]
    return not ready or ready[0].get("status") == "True"


def nodepool(
    name: str,
    labels: dict[str, str] | None = None,
    requirements: list[Obj] | None = None,
    taints: list[Obj] | None = None,
    limits: dict[str, str] | None = None,
    weight: int | None = None,
) -> Obj:
    """A NodePool as a platform team writes it."""
    spec: Obj = {
        "template": {
            "metadata": {"labels": dict(labels or {})},
            "spec": {
                "nodeClassRef": {
                    "group": "karpenter.k8s.aws",
                    "kind": "EC2NodeClass",
                    "name": "default",
                },
                "requirements": list(requirements or []),
            },
        },
    }
    if taints:
        spec["template"]["spec"]["taints"] = taints
    if limits:
        spec["limits"] = limits
    if weight is not None:
        spec["weight"] = weight
    return {"apiVersion": KARPENTER, "kind": "NodePool", "metadata": {"name": name}, "spec": spec}
