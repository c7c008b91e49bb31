"""Autoscaled pools on Kubernetes: what Karpenter NodePools can still add, and asking an
autoscaler for a gang's nodes (docs/kubernetes.md "Autoscaled pools").

Reading: every `karpenter.sh/v1` NodePool (kubernetes-sigs/karpenter, Apache-2.0) is matched to
the first flavor (config order) whose node labels its nodes would carry (the template's labels,
or a requirement `In` that admits the value) and whose capacity type it may launch
(`karpenter.sh/capacity-type`; Karpenter's default is on-demand). Per flavor the NodePool of
highest `weight` (then name) is reported as `FlavorInfo.provision`: one node's GPUs, CPU and
memory (`autoscaling.node_figures`, else its `node.kubernetes.io/instance-type` requirement
looked up in instance_types.json, else the single-valued `karpenter.k8s.aws/instance-gpu-count`,
`-instance-cpu`, `-instance-memory` requirements), its taints, and its limit:
the nodes the flavor has now plus what `spec.limits` (the GPU resource, or `cpu`) leaves
beside the pool's NodeClaims. A NodePool whose node figures are unknown is skipped (logged).
A pool declared in the agent config's `pools:` wins over a read one (agents/runtime.py).

Asking (`provision`): the broker asks one cluster for `nodes` nodes of a flavor for a job, and
places the gang once the nodes are reported. Where the cluster serves
`autoscaling.x-k8s.io/v1` ProvisioningRequest (kubernetes/autoscaler, Apache-2.0), one
`best-effort-atomic-scale-up` request for the whole gang (a PodTemplate of one node's worth,
`count` = nodes), so the autoscaler adds all of the nodes or none; the gang's pods then carry
`autoscaling.x-k8s.io/consume-provisioning-request`. Otherwise placeholder pods, one per node,
pinned by the pool's labels and tolerating its taints, which any autoscaler that acts on
Pending pods (Karpenter, cluster-autoscaler, GKE NAP) provisions for; they are deleted when
the gang is dispatched and do not count as other pods' usage. A request that fails
(`Failed=True`) is deleted with its placeholders and template; the broker counts the stockout
when the request's window passes without the nodes, as with any pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgspec
import structlog

from agents.backend import BackendError
from agents.kube.client import KubeApiError, KubeRest, Reflector
from agents.kube.config import AutoscalingConfig, FlavorConfig, KubeBackendConfig
from agents.kube.decode import (
    KNodeClaim,
    KNodePool,
    KObject,
    KProvisioningRequest,
    Resources,
)
from schemas.agent import NodeTaint, Provision, ProvisionPool
from schemas.quantity import QuantityError, cpu_milli, memory_bytes, parse_quantity

NODEPOOLS = "/apis/karpenter.sh/v1/nodepools"
NODECLAIMS = "/apis/karpenter.sh/v1/nodeclaims"
NODEPOOL_LABEL = "karpenter.sh/nodepool"
CAPACITY_TYPE = "karpenter.sh/capacity-type"
GPU_COUNT = "karpenter.k8s.aws/instance-gpu-count"
CPU_COUNT = "karpenter.k8s.aws/instance-cpu"
MEMORY_MIB = "karpenter.k8s.aws/instance-memory"
INSTANCE_TYPE = "node.kubernetes.io/instance-type"
INSTANCE_TYPES = Path(__file__).with_name("instance_types.json")
PROVREQ_API = "autoscaling.x-k8s.io/v1"
ATOMIC = "best-effort-atomic-scale-up.autoscaling.x-k8s.io"
CONSUME = "autoscaling.x-k8s.io/consume-provisioning-request"
CLASS_ANNOTATION = "autoscaling.x-k8s.io/provisioning-class-name"
# Marks what the agent creates to ask for nodes (placeholders, templates, requests): its
# value is the request's name. Not Muster's job label, so no workload is made of it.
LABEL_ASK = "muster.dev/provision"
ANN_ASK_JOB = "muster.dev/provision-job"
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
# Karpenter launches on-demand when a NodePool does not constrain the capacity type.
KARPENTER_DEFAULT_CAPACITY = ("on-demand",)

log = structlog.get_logger()


# -- reading NodePools (pure) -----------------------------------------------------------------


def admits(pool: KNodePool, key: str, value: str) -> bool:
    """Whether the pool's nodes can carry label `key=value` (Karpenter picks a requirement's
    value to suit the pod's selector)."""
    tmpl = pool.spec.template
    if key == NODEPOOL_LABEL:
        return value == pool.metadata.name
    if key in tmpl.metadata.labels:
        return tmpl.metadata.labels[key] == value
    for req in tmpl.spec.requirements:
        if req.key == key:
            return req.operator == "In" and value in req.values
    return False


def capacity_types(pool: KNodePool) -> tuple[str, ...]:
    for req in pool.spec.template.spec.requirements:
        if req.key == CAPACITY_TYPE and req.operator == "In":
            return tuple(req.values)
    return KARPENTER_DEFAULT_CAPACITY


def flavor_of(pool: KNodePool, flavors: list[FlavorConfig]) -> FlavorConfig | None:
    """The first flavor whose nodes this pool makes."""
    for f in flavors:
        if f.capacity_type in capacity_types(pool) and all(
            admits(pool, k, v) for k, v in f.node_labels.items()
        ):
            return f
    return None


def _single(pool: KNodePool, key: str) -> str | None:
    for req in pool.spec.template.spec.requirements:
        if req.key == key and req.operator == "In" and len(req.values) == 1:
            return req.values[0]
    return None


class InstanceType(msgspec.Struct, frozen=True):
    gpu: int
    cpu: str
    memory: str
    gpu_name: str = ""
    gpu_memory_mib: int = 0


@functools.cache
def instance_types() -> dict[str, InstanceType]:
    """GPU instance types as Karpenter's AWS provider documents them (instance_types.json:
    its source, commit and licence inside): GPUs and allocatable cpu and memory."""
    raw = json.loads(INSTANCE_TYPES.read_text())
    return msgspec.convert(raw["types"], dict[str, InstanceType])


def _instance_figures(pool: KNodePool) -> tuple[int, int, int] | None:
    """From a `node.kubernetes.io/instance-type In [...]` requirement whose every type is
    known: the smallest of each figure (whichever type Karpenter launches)."""
    for req in pool.spec.template.spec.requirements:
        if req.key != INSTANCE_TYPE or req.operator != "In" or not req.values:
            continue
        known = [instance_types().get(v) for v in req.values]
        if any(t is None for t in known):
            return None
        types = [t for t in known if t is not None]
        return (
            min(t.gpu for t in types),
            min(cpu_milli(t.cpu) for t in types),
            min(memory_bytes(t.memory) for t in types),
        )
    return None


def node_figures(pool: KNodePool, cfg: AutoscalingConfig) -> tuple[int, int, int] | None:
    """(GPUs, CPU millicores, memory bytes) of one node of the pool: declared, else from its
    instance-type requirement, else from its instance-gpu-count (and -cpu, -memory)
    requirements; None when unknown."""
    declared = cfg.node_figures.get(pool.metadata.name)
    if declared is not None:
        return declared.gpu, cpu_milli(declared.cpu), memory_bytes(declared.memory)
    by_type = _instance_figures(pool)
    if by_type is not None:
        return by_type
    gpu = _single(pool, GPU_COUNT)
    if gpu is None or not gpu.isdigit() or int(gpu) < 1:
        return None
    cpu = _single(pool, CPU_COUNT)
    mem = _single(pool, MEMORY_MIB)
    return (
        int(gpu),
        int(cpu) * 1000 if cpu and cpu.isdigit() else 0,
        int(mem) * 2**20 if mem and mem.isdigit() else 0,
    )


def _amount(resources: Resources, name: str) -> float:
    raw = resources.get(name)
    if raw is None:
        return 0.0
    try:
        return float(cpu_milli(raw)) / 1000 if name == "cpu" else float(parse_quantity(raw))
    except QuantityError:
        return 0.0


def room_nodes(
    pool: KNodePool, claims: list[KNodeClaim], per_node: Mapping[str, float], unlimited: int
) -> int:
    """Nodes the pool may still add: each limited resource's limit less what its NodeClaims
    hold (their capacity once launched, else their requests), over one node's share."""
    limits = {k: _amount(pool.spec.limits, k) for k in per_node if k in pool.spec.limits}
    if not limits:
        return unlimited
    room = unlimited
    for name, limit in limits.items():
        held = sum(_amount(c.status.capacity or c.spec.resources.requests, name) for c in claims)
        room = min(room, int((limit - held) // per_node[name]) if per_node[name] else room)
    return max(0, room)


def pool_info(
    pool: KNodePool,
    claims: list[KNodeClaim],
    flavor: FlavorConfig,
    gpu_resource: str,
    have_nodes: int,
    cfg: AutoscalingConfig,
) -> ProvisionPool | None:
    """What the agent reports for `flavor` from this NodePool (None: nothing to add and no
    node there, or its node figures are unknown)."""
    figures = node_figures(pool, cfg)
    if figures is None:
        return None
    gpu, cpu, memory = figures
    per_node = {gpu_resource: float(gpu), "cpu": cpu / 1000}
    limit = have_nodes + room_nodes(pool, claims, per_node, cfg.unlimited_nodes)
    if limit < 1:
        return None
    labels = {NODEPOOL_LABEL: pool.metadata.name, CAPACITY_TYPE: flavor.capacity_type}
    labels.update(flavor.node_labels)
    taints = [
        NodeTaint(t.key, t.value, t.effect)  # type: ignore[arg-type]
        for t in pool.spec.template.spec.taints
        if t.effect in ("NoSchedule", "PreferNoSchedule", "NoExecute")
    ]
    return ProvisionPool(
        node_gpu=gpu,
        max_nodes=limit,
        node_cpu_milli=cpu,
        node_memory=memory,
        labels=labels,
        taints=taints,
        ready_s=cfg.ready_s,
        window_s=cfg.window_s,
    )


def read_pools(
    pools: list[KNodePool],
    claims: list[KNodeClaim],
    config: KubeBackendConfig,
    cfg: AutoscalingConfig,
    flavor_nodes: Mapping[str, int],
) -> dict[str, ProvisionPool]:
    """Per flavor, the pool its highest-weight NodePool gives."""
    by_pool: dict[str, list[KNodeClaim]] = {}
    for c in claims:
        by_pool.setdefault(c.metadata.labels.get(NODEPOOL_LABEL, ""), []).append(c)
    out: dict[str, ProvisionPool] = {}
    for p in sorted(pools, key=lambda p: (-p.spec.weight, p.metadata.name)):
        flavor = flavor_of(p, config.flavors)
        if flavor is None or flavor.name in out:
            continue
        resource = flavor.gpu_resource or config.gpu_resource
        info = pool_info(
            p,
            by_pool.get(p.metadata.name, []),
            flavor,
            resource,
            flavor_nodes.get(flavor.name, 0),
            cfg,
        )
        if info is not None:
            out[flavor.name] = info
    return out


# -- asking for nodes -------------------------------------------------------------------------


def ask_name(job_id: str, flavor: str) -> str:
    """A DNS-1123 name for one job's ask on one flavor."""
    digest = hashlib.sha1(f"{job_id}\0{flavor}".encode()).hexdigest()[:10]
    return f"muster-ask-{digest}"


def node_pod_spec(pool: ProvisionPool, flavor: FlavorConfig, gpu_resource: str) -> dict[str, Any]:
    """A pod that takes one whole node of the pool: what the autoscaler provisions for."""
    tolerations = [t.to_k8s() for t in flavor.pod_tolerations()]
    tolerations += [
        {"key": t.key, "operator": "Equal", "value": t.value, "effect": t.effect}
        for t in pool.taints
    ]
    requests: dict[str, str] = {gpu_resource: str(pool.node_gpu)}
    return {
        "nodeSelector": {**flavor.node_labels, **pool.labels},
        "tolerations": tolerations,
        "terminationGracePeriodSeconds": 0,
        "containers": [
            {
                "name": "hold",
                "image": PAUSE_IMAGE,
                "resources": {"requests": requests, "limits": dict(requests)},
            }
        ],
    }


class Autoscaling:
    """The NodePool and NodeClaim watches, and the asks in flight, of one kube backend."""

    def __init__(
        self,
        rest: KubeRest,
        config: KubeBackendConfig,
        cfg: AutoscalingConfig,
        reflector_args: dict[str, Any],
        on_change: Callable[[], None] | None = None,
        declared: Mapping[str, ProvisionPool] | None = None,
    ) -> None:
        self.rest = rest
        # The agent config's `pools:` (node groups, GKE NAP): asked like read ones, and they
        # win over a NodePool read for the same flavor.
        self.declared = dict(declared or {})
        self.config = config
        self.cfg = cfg
        self.log = log.bind(component="autoscaling")
        self.reflectors: list[Reflector[Any]] = []
        self.reflector_args = reflector_args
        self.failed: list[str] = []  # jobs whose request the autoscaler gave up on
        self._tasks: set[asyncio.Task[None]] = set()
        self.on_change = on_change  # the pools reported would change: a snapshot is due
        self._reported: dict[str, ProvisionPool] = {}
        self._flavor_nodes: dict[str, int] = {}
        self.asks: dict[str, tuple[str, str]] = {}  # job_id -> (namespace, ask name)
        self.use_requests: bool | None = {"on": True, "off": False}.get(cfg.provisioning_request)
        if cfg.nodepools:
            self.pools = Reflector(
                rest,
                NODEPOOLS,
                KNodePool,
                _keep,
                self._pool_event,
                name="nodepools",
                absent_retry_s=config.resync_period_s,
                **reflector_args,
            )
            self.claims = Reflector(
                rest,
                NODECLAIMS,
                KNodeClaim,
                _keep,
                _ignore,
                name="nodeclaims",
                absent_retry_s=config.resync_period_s,
                **reflector_args,
            )
            self.reflectors = [self.pools, self.claims]

    async def list_once(self) -> None:
        """The first lists; a cluster without Karpenter's CRDs is noted, not an error."""
        for r in self.reflectors:
            try:
                await r.list_once()
            except KubeApiError as exc:
                if not r.note_absent(exc):
                    raise
        if self.use_requests is None:
            self.use_requests = await self._serves_requests()
        if self.use_requests:
            ns = self.config.namespace
            self.requests = Reflector(
                self.rest,
                f"/apis/{PROVREQ_API}/namespaces/{ns}/provisioningrequests",
                KProvisioningRequest,
                _keep,
                self._request_event,
                label_selector=LABEL_ASK,
                name="provisioningrequests",
                absent_retry_s=self.config.resync_period_s,
                **self.reflector_args,
            )
            await self.requests.list_once()
            self.reflectors.append(self.requests)

    @classmethod
    async def start(
        cls,
        rest: KubeRest,
        config: KubeBackendConfig,
        declared: Mapping[str, ProvisionPool],
        reflector_args: dict[str, Any],
        on_change: Callable[[], None],
    ) -> Autoscaling | None:
        """Listed, with an earlier agent's asks adopted (withdrawn a window from now unless
        their gang comes); None when the agent neither reads nor declares a pool."""
        cfg = config.autoscaling
        if cfg is None and declared:
            cfg = AutoscalingConfig(nodepools=False)  # ask declared pools, read none
        if cfg is None:
            return None
        self = cls(rest, config, cfg, reflector_args, on_change, declared)
        await self.list_once()
        for job_id in await self.adopt():
            self.withdraw_later(job_id, cfg.window_s)
        return self

    async def ask(
        self, cmd: Provision, read: Mapping[str, ProvisionPool], now: float, cluster: str
    ) -> None:
        """The broker's `provision`: the declared pool of the flavor, else the one read;
        what is still asked for at the broker's deadline is withdrawn."""
        flavor = self.config.flavor(cmd.flavor)
        pool = self.declared.get(cmd.flavor) or read.get(cmd.flavor)
        if flavor is None or pool is None:
            raise BackendError(
                f"flavor {cmd.flavor!r} of cluster {cluster} has no autoscaled pool (no "
                "NodePool matches its node labels and capacity type, and the agent's `pools:` "
                "declares none)"
            )
        try:
            await self.provision(cmd, pool, flavor)
        except KubeApiError as exc:
            raise BackendError(f"asking pool {cmd.flavor!r} for nodes: {exc}") from None
        if cmd.deadline:
            self.withdraw_later(cmd.job_id, max(0.0, cmd.deadline - now))

    def withdraw_later(self, job_id: str, delay: float) -> None:
        """Release the job's ask after `delay` seconds (at once with 0)."""
        task = asyncio.create_task(self._withdraw_after(job_id, delay))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _withdraw_after(self, job_id: str, delay: float) -> None:
        await asyncio.sleep(delay)
        await self.release(job_id)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def adopt(self) -> list[str]:
        """Asks an earlier agent made (its placeholder pods or its ProvisioningRequests) are
        this one's: the gang's dispatch or a cancel releases them. Returns their jobs."""
        ns = self.config.namespace
        found: list[KObject | KProvisioningRequest] = []
        if self.use_requests:
            found.extend(self.requests.cache.values())
        else:
            pods, _ = await self.rest.list_all(f"/api/v1/namespaces/{ns}/pods", KObject, LABEL_ASK)
            found.extend(pods)
        for obj in found:
            job_id = obj.metadata.annotations.get(ANN_ASK_JOB, "")
            name = obj.metadata.labels.get(LABEL_ASK, "")
            if job_id and name and job_id not in self.asks:
                self.asks[job_id] = (ns, name)
        if self.asks:
            self.log.info("asks of an earlier agent adopted", jobs=sorted(self.asks))
        return sorted(self.asks)

    def _request_event(self, kind: str, pr: KProvisioningRequest) -> None:
        """A request the autoscaler gave up on (`Failed`, or its booking expired before the
        gang came) is withdrawn with its template; the broker counts the stockout when its
        window passes without the nodes."""
        ended = [
            c
            for c in pr.status.conditions
            if c.type in ("Failed", "BookingExpired") and c.status == "True"
        ]
        job_id = pr.metadata.annotations.get(ANN_ASK_JOB, "")
        if kind == "DELETED" or not ended or self.asks.get(job_id, ("", ""))[1] != pr.metadata.name:
            return
        self.log.warning(
            "provisioning request ended",
            job_id=job_id,
            request=pr.metadata.name,
            condition=ended[0].type,
            reason=ended[0].reason,
            message=ended[0].message[:300],
        )
        self.failed.append(job_id)
        task = asyncio.create_task(self.release(job_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serves_requests(self) -> bool:
        path = f"/apis/{PROVREQ_API}/namespaces/{self.config.namespace}/provisioningrequests"
        try:
            await self.rest.request("GET", path, query=[("limit", "1")])
        except KubeApiError as exc:
            if exc.status in (403, 404):
                return False
            raise
        return True

    def pools_by_flavor(self, flavor_nodes: Mapping[str, int]) -> dict[str, ProvisionPool]:
        """What to report now (and remembered, to tell when a NodePool changes it)."""
        if not self.cfg.nodepools:
            return {}
        self._flavor_nodes = dict(flavor_nodes)
        self._reported = read_pools(
            list(self.pools.cache.values()),
            list(self.claims.cache.values()),
            self.config,
            self.cfg,
            flavor_nodes,
        )
        return self._reported

    def _pool_event(self, kind: str, pool: KNodePool) -> None:
        """A NodePool added, edited or removed: the broker learns its new limit or template
        with a snapshot, asked for only when what would be reported differs. NodeClaims
        coming and going while a pool grows wait for the next snapshot."""
        if self.on_change is None:
            return
        now = read_pools(
            list(self.pools.cache.values()),
            list(self.claims.cache.values()),
            self.config,
            self.cfg,
            self._flavor_nodes,
        )
        if now != self._reported:
            self._reported = now
            self.on_change()

    async def provision(self, cmd: Provision, pool: ProvisionPool, flavor: FlavorConfig) -> None:
        """Ask for `cmd.nodes` nodes of the pool for the job (once per job)."""
        if cmd.job_id in self.asks:
            return
        ns = self.config.namespace
        name = ask_name(cmd.job_id, cmd.flavor)
        resource = flavor.gpu_resource or self.config.gpu_resource
        spec = node_pod_spec(pool, flavor, resource)
        bound = self.log.bind(job_id=cmd.job_id, flavor=cmd.flavor, nodes=cmd.nodes, ask=name)
        self.asks[cmd.job_id] = (ns, name)
        try:
            await self._ask(cmd, pool, spec, ns, name)
        except BaseException:
            await self.release(cmd.job_id)  # nothing half-asked stays; a resent ask starts over
            raise
        bound.info("provisioning request created" if self.use_requests else "placeholders created")

    async def _ask(
        self, cmd: Provision, pool: ProvisionPool, spec: dict[str, Any], ns: str, name: str
    ) -> None:
        meta = {"labels": {LABEL_ASK: name}, "annotations": {ANN_ASK_JOB: cmd.job_id}}
        if self.use_requests:
            await self._create(
                f"/api/v1/namespaces/{ns}/podtemplates",
                {
                    "apiVersion": "v1",
                    "kind": "PodTemplate",
                    "metadata": {"name": name, **meta},
                    "template": {"metadata": {"labels": {LABEL_ASK: name}}, "spec": spec},
                },
            )
            await self._create(
                f"/apis/{PROVREQ_API}/namespaces/{ns}/provisioningrequests",
                {
                    "apiVersion": PROVREQ_API,
                    "kind": "ProvisioningRequest",
                    "metadata": {"name": name, **meta},
                    "spec": {
                        "provisioningClassName": ATOMIC,
                        "parameters": {"ValidUntilSeconds": str(int(pool.window_s))},
                        "podSets": [{"count": cmd.nodes, "podTemplateRef": {"name": name}}],
                    },
                },
            )
        else:
            for i in range(cmd.nodes):
                await self._create(
                    f"/api/v1/namespaces/{ns}/pods",
                    {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "metadata": {
                            "name": f"{name}-{i}",
                            "labels": {LABEL_ASK: name},
                            "annotations": {
                                **meta["annotations"],
                                "karpenter.sh/do-not-disrupt": "true",
                                "cluster-autoscaler.kubernetes.io/safe-to-evict": "false",
                            },
                        },
                        "spec": spec,
                    },
                )

    async def _create(self, collection: str, body: dict[str, Any]) -> None:
        await self.rest.create(collection, body)  # None: it exists (a resent ask)

    def consume(self, job_id: str) -> dict[str, str]:
        """The annotations the job's pods carry: the ProvisioningRequest they consume."""
        ask = self.asks.get(job_id)
        if ask is None or not self.use_requests:
            return {}
        return {CONSUME: ask[1], CLASS_ANNOTATION: ATOMIC}

    async def release(self, job_id: str, keep_request: bool = False) -> None:
        """The gang is placed (its placeholders go; the request stays while it books the
        nodes) or its ask failed (everything goes)."""
        ask = self.asks.get(job_id)
        if ask is None:
            return
        ns, name = ask
        if self.use_requests and keep_request:
            return
        self.asks.pop(job_id, None)
        items = (
            [
                f"/apis/{PROVREQ_API}/namespaces/{ns}/provisioningrequests/{name}",
                f"/api/v1/namespaces/{ns}/podtemplates/{name}",
            ]
            if self.use_requests
            else [f"/api/v1/namespaces/{ns}/pods/{name}-{i}" for i in range(_MAX_ASK)]
        )
        for item in items:
            try:
                if not await self.rest.delete(item, "Background") and not self.use_requests:
                    break  # placeholders are numbered from 0: the first missing ends them
            except KubeApiError as exc:
                self.log.warning("releasing an ask failed", item=item, error=str(exc)[:300])


_MAX_ASK = 4096


async def _keep(items: list[Any]) -> None:
    """Lists are kept in the reflector's cache; nothing else to do."""


def _ignore(kind: str, obj: Any) -> None:
    """Events update the reflector's cache; the next snapshot reads it."""


def is_placeholder(labels: Mapping[str, str]) -> bool:
    """A pod the agent created only to make an autoscaler add a node."""
    return LABEL_ASK in labels
