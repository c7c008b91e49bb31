"""Configuration of the Kubernetes backend: how to reach the API server, which nodes form which
flavor, and which taints/conditions mean "spot reclaim" or "GPU failure".

It is one msgspec Struct so a typo in the agent's YAML fails at start with the field's path
(`... - at $.flavors[0].capacity_type`) instead of silently being ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from agents.kube.signals import (
    BUILTIN_GPU_FAILURE_CONDITIONS,
    BUILTIN_GPU_FAILURE_TAINTS,
    BUILTIN_NODE_DISRUPTION_REASONS,
    BUILTIN_NOTICE_TAINTS,
    Provider,
    TimeSource,
)
from kinds.plan import WorkloadPlan
from kinds.pods import PodPolicy
from kinds.workload import build_workload as kinds_build_workload
from schemas.agent import Dispatch, FlavorInfo
from schemas.job import CapacityType, DnsLabel, ExtendedAmounts

__all__ = ["Provider"]
ShortStr = Annotated[str, Meta(max_length=253)]
LabelKey = Annotated[str, Meta(min_length=1, max_length=317)]
LabelValue = Annotated[str, Meta(max_length=63)]

# The provider signals are in `agents.kube.signals`; the lists below are what configuration
# ADDS to them (the built-in ones need no configuration).
DEFAULT_SPOT_TAINTS: tuple[str, ...] = tuple(t.key for t in BUILTIN_NOTICE_TAINTS)
DEFAULT_NODE_DISRUPTION_REASONS = BUILTIN_NODE_DISRUPTION_REASONS
DEFAULT_GPU_FAILURE_CONDITIONS = BUILTIN_GPU_FAILURE_CONDITIONS
DEFAULT_GPU_FAILURE_TAINTS = BUILTIN_GPU_FAILURE_TAINTS


class KubeConfigError(ValueError):
    """The kube backend's configuration is invalid; the text names the field."""


class Toleration(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, rename="camel"):
    """A Kubernetes toleration, written as in a Pod or a Kueue ResourceFlavor (camelCase)."""

    key: Annotated[str, Meta(max_length=317)] = ""
    operator: Literal["Exists", "Equal"] = "Equal"
    value: LabelValue = ""
    effect: Literal["", "NoSchedule", "PreferNoSchedule", "NoExecute"] = ""
    toleration_seconds: Annotated[int, Meta(ge=0)] | None = None

    def to_k8s(self) -> dict[str, Any]:
        """The toleration as the API server expects it in a pod spec."""
        out: dict[str, Any] = msgspec.to_builtins(self)
        out.setdefault("operator", self.operator)
        return out

    def __post_init__(self) -> None:
        if self.operator == "Exists" and self.value:
            raise ValueError("tolerations: operator Exists takes no value")
        if not self.key and self.operator != "Exists":
            raise ValueError("tolerations: an empty key needs operator Exists")


DEDICATED_TAINT_KEY = "muster.dev/dedicated"


class DedicatedTaint(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """The taint a pool dedicated to Muster carries (`kubectl taint nodes <n>
    muster.dev/dedicated=muster:NoSchedule`, or the node group's taints): no pod without the
    matching toleration is scheduled there, so another scheduler cannot fill the nodes the
    broker chose before Muster's gang binds. Muster's pods of the flavor tolerate it."""

    key: LabelKey = DEDICATED_TAINT_KEY
    value: LabelValue = "muster"
    effect: Literal["NoSchedule", "NoExecute"] = "NoSchedule"

    def toleration(self) -> Toleration:
        return Toleration(key=self.key, operator="Equal", value=self.value, effect=self.effect)


class FlavorConfig(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One pool of identical nodes, like Kueue's ResourceFlavor: `node_labels` select the
    nodes (and become the workload's nodeSelector), `tolerations` are added to its pods.

    A node belongs to the first flavor (in config order) whose labels all match AND whose
    `capacity_type` agrees with the capacity type detected from the node's provider labels
    (when one is detectable), so a mislabelled spot node never lands in an on-demand flavor.
    """

    name: DnsLabel
    capacity_type: CapacityType
    gpu_type: Annotated[str, Meta(max_length=64)] = ""
    price_per_gpu_hour: Annotated[float, Meta(ge=0)] = 0.0
    # 0 = take it from the GPU Feature Discovery label `nvidia.com/gpu.memory` of the nodes.
    gpu_memory_mib: Annotated[int, Meta(ge=0)] = 0
    node_labels: Annotated[dict[LabelKey, LabelValue], Meta(max_length=64)] = {}
    tolerations: Annotated[list[Toleration], Meta(max_length=64)] = []
    # The extended resource its pods request ("" = the backend's `gpu_resource`): e.g.
    # `amd.com/gpu`, or a MIG profile `nvidia.com/mig-1g.10gb` as a flavor of its own.
    gpu_resource: Annotated[str, Meta(max_length=253)] = ""
    # terminationGracePeriodSeconds of the flavor's pods: the provider's notice window, so the
    # workload can checkpoint. None: 120 s on spot flavors, the pod's own value otherwise.
    termination_grace_period_s: Annotated[int, Meta(ge=0, le=86_400)] | None = None
    # The taint that keeps every other pod off the pool's nodes (docs/kubernetes.md "Holding
    # the chosen nodes"); None: the pool is shared and nothing holds a node until the gang binds.
    dedicated_taint: DedicatedTaint | None = None
    # Fabric resources every node of the pool has (vpc.amazonaws.com/efa, rdma/...,
    # hugepages-... in bytes), for nodes whose allocatable does not list them; what a node's
    # `status.allocatable` lists wins.
    node_extended: ExtendedAmounts = {}

    def __post_init__(self) -> None:
        taint = self.dedicated_taint
        if taint is not None and (
            "/" not in taint.key or taint.key.endswith("/gpu") or taint.key == self.gpu_resource
        ):
            raise ValueError(
                f"flavors[{self.name}].dedicated_taint: key {taint.key!r} must be a prefixed "
                "key of its own (e.g. muster.dev/dedicated), not an extended resource name: "
                "the ExtendedResourceToleration admission plugin gives every pod that requests "
                "that resource the toleration, so other schedulers' GPU pods would pass it"
            )

    def pod_tolerations(self) -> list[Toleration]:
        """What the flavor's pods tolerate: its tolerations and its dedicated taint."""
        extra = [self.dedicated_taint.toleration()] if self.dedicated_taint else []
        return [*self.tolerations, *extra]

    def info(self, gpu_memory_mib: int = 0) -> FlavorInfo:
        return FlavorInfo(
            name=self.name,
            capacity_type=self.capacity_type,
            gpu_type=self.gpu_type,
            price_per_gpu_hour=self.price_per_gpu_hour,
            gpu_memory_mib=self.gpu_memory_mib or gpu_memory_mib,
            node_extended=self.node_extended,
        )


Seconds = Annotated[float, Meta(gt=0, le=3600)]


class SpotDeadlines(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Seconds between a reclaim notice and the node's end, per provider. AWS gives a 2-minute
    interruption notice; GCP and Azure give 30 seconds."""

    aws: Seconds = 120.0
    gcp: Seconds = 30.0
    azure: Seconds = 30.0
    other: Seconds = 30.0

    def for_provider(self, provider: Provider) -> float:
        value: float = getattr(self, provider)
        return value


class NoticeTaintConfig(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A taint meaning "this node is going away", added to the built-in ones."""

    key: LabelKey
    value: LabelValue = ""
    window_s: Seconds | None = None
    time: TimeSource = "seen"


class PriorityClassRule(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Jobs of `min_priority` or more run as the PriorityClass `name`."""

    name: DnsLabel
    min_priority: Annotated[int, Meta(ge=-1_000_000, le=1_000_000)]


def priority_class(rules: list[PriorityClassRule], priority: int) -> str | None:
    """The class of the highest `min_priority` at or below `priority`."""
    fitting = [r for r in rules if r.min_priority <= priority]
    return max(fitting, key=lambda r: r.min_priority).name if fitting else None


REPORT_PORT = 8470
# The Service deploy/agent/service.yaml creates in front of the agent.
REPORT_SERVICE_URL = f"http://muster-agent-report.muster-system.svc:{REPORT_PORT}"


class ReportConfig(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """The endpoint workloads post checkpoint reports to (agents/kube/report.py). Pods need
    no Kubernetes RBAC for it: the attempt's MUSTER_CHECKPOINT_TOKEN is the credential."""

    enabled: bool = True
    # Where the agent listens. Every interface by default: pods reach it through a Service.
    listen_host: Annotated[str, Meta(max_length=253)] = "0.0.0.0"
    listen_port: Annotated[int, Meta(ge=0, le=65_535)] = REPORT_PORT
    # The base URL pods use (MUSTER_REPORT_URL is this plus /v1/checkpoint). "" = the
    # address the agent bound (one machine: development and tests).
    url: Annotated[str, Meta(max_length=1024)] = REPORT_SERVICE_URL
    max_body_bytes: Annotated[int, Meta(ge=512, le=65_536)] = 8192
    # A request that has not sent its whole body by then is answered 408.
    timeout_s: Annotated[float, Meta(gt=0, le=300)] = 10.0

    def __post_init__(self) -> None:
        if self.url and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"report.url: {self.url!r} must start with http:// or https://")


class NamespaceRule(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The jobs of `queues` run in `namespace`: a team's own namespace, where its
    ConfigMaps, Secrets and PersistentVolumeClaims already are and no other team's job runs.
    The agent needs the RoleBinding of deploy/agent/team-namespace.yaml there."""

    namespace: DnsLabel
    queues: Annotated[list[DnsLabel], Meta(min_length=1, max_length=256)]


class NodeFigures(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """What one node of a NodePool brings, declared where its requirements do not say (no
    single `karpenter.k8s.aws/instance-gpu-count` value, say)."""

    gpu: Annotated[int, Meta(ge=1, le=1024)]
    cpu: str | int | float = 0
    memory: str | int | float = 0


class AutoscalingConfig(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Autoscaled pools read from the cluster and how the agent asks them to grow
    (agents/kube/pools.py, docs/kubernetes.md "Autoscaled pools")."""

    # Read Karpenter `karpenter.sh/v1` NodePools (and their NodeClaims) as autoscaled pools.
    nodepools: bool = True
    # Ask for a gang's nodes with a ProvisioningRequest (best-effort-atomic-scale-up): "auto"
    # when the cluster serves autoscaling.x-k8s.io/v1 provisioningrequests, else placeholder
    # pods that an autoscaler acts on; "on" / "off" force either.
    provisioning_request: Literal["auto", "on", "off"] = "auto"
    # Expected seconds from asking to a Ready node, and how long before a request counts as
    # a stockout, reported for every NodePool (ProvisionPool.ready_s / window_s).
    ready_s: Annotated[float, Meta(ge=0, le=86_400)] = 300.0
    window_s: Annotated[float, Meta(gt=0, le=86_400)] = 900.0
    # The nodes a NodePool without `spec.limits` may add.
    unlimited_nodes: Annotated[int, Meta(ge=1, le=100_000)] = 100
    # Per NodePool name: its node figures when the requirements do not give them.
    node_figures: Annotated[dict[LabelValue, NodeFigures], Meta(max_length=256)] = {}

    def __post_init__(self) -> None:
        if self.window_s < self.ready_s:
            raise ValueError(
                f"autoscaling: window_s ({self.window_s:g}) is shorter than ready_s "
                f"({self.ready_s:g}); every request would count as a stockout"
            )


class KubeBackendConfig(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Everything the kube backend needs. `kubeconfig` None and `in_cluster` false means the
    default kubeconfig ($KUBECONFIG or ~/.kube/config)."""

    flavors: Annotated[list[FlavorConfig], Meta(min_length=1, max_length=256)]
    # Where workloads run unless `namespaces` maps their queue elsewhere; the cluster's fence
    # Lease lives here too.
    namespace: DnsLabel = "muster-workloads"
    # Per team (or per queue): the namespace a job's workload runs in, by the job's queue.
    # Empty: every workload runs in `namespace`.
    namespaces: Annotated[list[NamespaceRule], Meta(max_length=256)] = []
    kubeconfig: Annotated[str, Meta(min_length=1, max_length=4096)] | None = None
    context: ShortStr | None = None
    in_cluster: bool = False
    gpu_resource: Annotated[str, Meta(min_length=1, max_length=253)] = "nvidia.com/gpu"
    spot_deadlines_s: SpotDeadlines = msgspec.field(default_factory=SpotDeadlines)
    # Each list below ADDS to the built-in provider signals (agents.kube.signals).
    spot_taints: Annotated[list[LabelKey], Meta(max_length=64)] = []  # keys, any value
    notice_taints: Annotated[list[NoticeTaintConfig], Meta(max_length=64)] = []
    node_disruption_reasons: Annotated[list[ShortStr], Meta(max_length=64)] = []
    gpu_failure_conditions: Annotated[list[ShortStr], Meta(max_length=64)] = []
    gpu_failure_taints: Annotated[list[LabelKey], Meta(max_length=64)] = []
    # A node NotReady this long (from its Ready condition's lastTransitionTime) AND tainted
    # node.kubernetes.io/out-of-service is gone and its replicas lost; otherwise it only takes
    # no new pods (a partitioned node's containers may still run; the fence covers it).
    not_ready_grace_s: Annotated[float, Meta(ge=0, le=86_400)] = 300.0
    # GPUs missing from allocatable (a device-plugin restart withdraws them all for seconds)
    # are reported only after this long, as "takes no new pods"; a dip never ends an attempt.
    allocatable_debounce_s: Annotated[float, Meta(ge=0, le=3600)] = 90.0
    # Watches failing this long mark the agent's heartbeat stale: the broker stops placing
    # work on this cluster until they recover.
    stale_after_s: Annotated[float, Meta(gt=0, le=86_400)] = 60.0
    # Replay of the local cache to the handlers this often (as client-go's resync: no
    # request to the API server), plus garbage collection.
    resync_period_s: Annotated[float, Meta(ge=1, le=86_400)] = 300.0
    # Server-side timeoutSeconds of one watch request; the watch then resumes from its
    # resourceVersion without a re-list.
    watch_timeout_s: Annotated[int, Meta(ge=1, le=3600)] = 290
    list_page_size: Annotated[int, Meta(ge=1, le=10_000)] = 500
    # The agent's API budget (every request but watches): a token bucket of `api_qps` with
    # `api_burst` (a checkpoint request to a 1,000-pod gang goes out at once) and at most
    # `api_inflight` requests in flight; a 429 holds every request for its Retry-After.
    api_qps: Annotated[float, Meta(gt=0, le=10_000)] = 50.0
    api_burst: Annotated[int, Meta(ge=1, le=100_000)] = 1000
    api_inflight: Annotated[int, Meta(ge=1, le=1024)] = 32
    request_timeout_s: Annotated[float, Meta(gt=0, le=600)] = 30.0
    backoff_initial_s: Annotated[float, Meta(gt=0, le=60)] = 0.2
    backoff_max_s: Annotated[float, Meta(gt=0, le=600)] = 30.0
    delete_propagation: Literal["Background", "Foreground"] = "Background"
    # Once an attempt has finished (succeeded or failed), its pods that still run (MPI workers
    # waiting in sshd, replicas a success policy left behind) are deleted at once, so their
    # GPUs are free before ttlSecondsAfterFinished; finished pods (and their logs) stay.
    release_finished_pods: bool = True
    # A fence watchdog (deploy/watchdog/) runs beside this agent: every workload object then
    # carries its fence as the annotation muster.dev/fence-until, the watchdog deletes it once
    # lapsed, and the cluster fences every kind without the agent. Safe only while the fence
    # window exceeds the watchdog's period + skew + the pods' termination grace.
    fence_watchdog: bool = False
    # Finished workload objects delete themselves after this long (ttlSecondsAfterFinished,
    # where the kind has it); the agent's own garbage collection covers the rest.
    ttl_seconds_after_finished: Annotated[int, Meta(ge=0, le=30 * 86_400)] | None = 3600
    # serviceAccountNames a user manifest may ask for; anything else is refused.
    allowed_service_accounts: Annotated[list[DnsLabel], Meta(max_length=256)] = msgspec.field(
        default_factory=lambda: ["default"]
    )
    # Restrict the node list/watch (e.g. "nvidia.com/gpu.present=true"); "" = every node.
    node_label_selector: Annotated[str, Meta(max_length=1024)] = ""
    # The PriorityClass of a job's pods by its `priority`: the class of the highest
    # `min_priority` at or below it (none below every one: no class). Empty: pods carry none.
    # The classes must exist in the cluster (docs/kubernetes.md "PriorityClass" has a set).
    priority_classes: Annotated[list[PriorityClassRule], Meta(max_length=64)] = []
    # Checkpoint reports from pods (docs/kubernetes.md "Checkpoint reports from pods").
    report: ReportConfig = msgspec.field(default_factory=ReportConfig)
    # Autoscaled pools (Karpenter NodePools, ProvisioningRequest); None: not read.
    autoscaling: AutoscalingConfig | None = None

    def __post_init__(self) -> None:
        names = [f.name for f in self.flavors]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"flavors: duplicate flavor names {dupes}")
        if self.in_cluster and self.kubeconfig is not None:
            raise ValueError("in_cluster: set either in_cluster or kubeconfig, not both")
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("backoff_max_s: must be >= backoff_initial_s")
        queues = [q for rule in self.namespaces for q in rule.queues]
        twice = sorted({q for q in queues if queues.count(q) > 1})
        if twice:
            raise ValueError(
                f"namespaces: queues {twice} are mapped more than once; give each queue one "
                "namespace"
            )

    def namespace_for(self, queue: str | None) -> str:
        """The namespace the workloads of a job of `queue` run in."""
        for rule in self.namespaces:
            if queue in rule.queues:
                return rule.namespace
        return self.namespace

    def workload_namespaces(self) -> list[str]:
        """Every namespace workloads may run in, the default one first."""
        return list(dict.fromkeys([self.namespace, *(r.namespace for r in self.namespaces)]))

    def flavor(self, name: str) -> FlavorConfig | None:
        for f in self.flavors:
            if f.name == name:
                return f
        return None


def convert_kube_config(raw: Any) -> KubeBackendConfig:
    """Validate an already-parsed YAML/JSON mapping; raise KubeConfigError naming the field."""
    try:
        return msgspec.convert(raw, KubeBackendConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise KubeConfigError(f"invalid kube backend config: {exc}") from None


# Graceful shutdown a spot flavor's pods get when none is configured, per provider:
# * AWS: the EC2 spot interruption notice comes two minutes ahead (docs.aws.amazon.com
#   AWSEC2/latest/UserGuide/spot-instance-termination-notices.html): 120 s;
# * GKE: spot and preemptible nodes give non-system pods 15 s of graceful node shutdown,
#   whatever terminationGracePeriodSeconds says (cloud.google.com/kubernetes-engine/docs/
#   concepts/spot-vms, "Termination and graceful shutdown of Spot VMs"): 15 s, also a cap;
# * Azure: Scheduled Events announce a spot eviction (Preempt) at least 30 s ahead
#   (learn.microsoft.com/azure/virtual-machines/linux/scheduled-events): 30 s;
# * unknown: 120 s, the longest notice of the three.
SPOT_GRACE_S: dict[Provider, int] = {"aws": 120, "gcp": 15, "azure": 30, "other": 120}
SPOT_GRACE_CAP_S: dict[Provider, int] = {"gcp": 15}


def pod_policy(
    flavor: FlavorConfig,
    config: KubeBackendConfig | None = None,
    provider: Provider = "other",
    priority: int = 0,
    report_url: str | None = None,
    annotations: dict[str, str] | None = None,
) -> PodPolicy:
    """What the flavor and the agent's configuration add to every pod template; `provider`
    is that of the nodes the pods go to (their spot grace)."""
    grace = flavor.termination_grace_period_s
    spot = flavor.capacity_type == "spot"
    if grace is None and spot:
        grace = SPOT_GRACE_S[provider]
    return PodPolicy(
        node_labels=dict(flavor.node_labels),
        tolerations=[t.to_k8s() for t in flavor.pod_tolerations()],
        grace_seconds=grace,
        grace_cap_s=SPOT_GRACE_CAP_S.get(provider) if spot else None,
        priority_class=priority_class(config.priority_classes, priority) if config else None,
        ttl_seconds=config.ttl_seconds_after_finished if config is not None else None,
        service_accounts=frozenset(
            config.allowed_service_accounts if config is not None else ("default",)
        ),
        report_url=report_url,
        annotations=dict(annotations or {}),
    )


def build_workload(
    cmd: Dispatch,
    flavor: FlavorConfig,
    namespace: str,
    gpu_resource: str = "nvidia.com/gpu",
    config: KubeBackendConfig | None = None,
    provider: Provider = "other",
    report_url: str | None = None,
    annotations: dict[str, str] | None = None,
) -> WorkloadPlan:
    """Dispatch -> the objects to create on this flavor, by `spec.workload.kind` (kinds/);
    `report_url` is where the pods post checkpoint reports (None: no such endpoint)."""
    policy = pod_policy(flavor, config, provider, cmd.spec.priority, report_url, annotations)
    return kinds_build_workload(cmd, policy, namespace, gpu_resource)
