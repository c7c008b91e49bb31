"""Agent configuration (YAML): which cluster, which backend, and how the fake cluster behaves.

One `AgentConfig` runs one agent; a `FleetConfig` runs many (fake) agents in one process over
one NATS connection, which is how the demo and the load tests get 50 clusters cheaply. The
`kube` section stays a plain mapping here: the kube backend validates it into its own Struct.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import yaml
from msgspec import Meta

from schemas.agent import MAX_BATCH, NodeTaint, ProvisionPool
from schemas.fieldhints import explain
from schemas.job import CapacityType
from schemas.quantity import QuantityError, cpu_milli, memory_bytes

ClusterName = Annotated[
    str,
    Meta(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$",
        description="letters, digits, '-' and '_' (it is a NATS subject token)",
    ),
]
FlavorName = Annotated[
    str,
    Meta(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63),
]
Quantity = str | int | float
Positive = Annotated[float, Meta(gt=0)]
NonNegFloat = Annotated[float, Meta(ge=0)]


def _check_quantities(where: str, obj: Any) -> None:
    """`obj.cpu` and `obj.memory` are Kubernetes quantities; the error names `where`."""
    for fname, parse in (("cpu", cpu_milli), ("memory", memory_bytes)):
        try:
            parse(getattr(obj, fname))
        except QuantityError as exc:
            raise ValueError(f"{where}: {fname}: {exc}") from None


class AgentConfigError(ValueError):
    """An agent/fleet config that does not validate; the text names the file and the field."""


ZONE_LABEL = "topology.kubernetes.io/zone"
NodeLabel = Annotated[
    str,
    Meta(
        pattern=r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$",
        max_length=317,
        description="a node label key, e.g. cloud.google.com/gce-topology-block",
    ),
]


class TopologyConfig(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """The cluster's topology levels, coarsest first: node labels, as the `spec.levels` of a
    Kueue `Topology` object (`topology_from_kueue` reads one). The zone comes first; the agent
    sends each node's values in this order and the broker keeps gangs within one domain."""

    levels: Annotated[list[NodeLabel], Meta(min_length=1, max_length=8)] = msgspec.field(
        default_factory=lambda: [ZONE_LABEL, "kubernetes.io/hostname"]
    )

    def __post_init__(self) -> None:
        if len(set(self.levels)) != len(self.levels):
            raise ValueError(f"topology.levels: a label is listed twice in {self.levels}")
        if self.levels[0] != ZONE_LABEL:
            raise ValueError(
                f"topology.levels: the first level must be {ZONE_LABEL} (gangs stay within one "
                f"zone by default); got {self.levels[0]!r}"
            )


def topology_from_kueue(obj: Any) -> TopologyConfig:
    """A Kueue `Topology` object (kueue.x-k8s.io, `spec.levels[].nodeLabel`) as this config;
    the zone level is put first when the object does not start with it."""
    if not isinstance(obj, dict) or obj.get("kind") != "Topology":
        raise ValueError("not a Kueue Topology object (kind: Topology, spec.levels[].nodeLabel)")
    levels = [lv.get("nodeLabel") for lv in (obj.get("spec") or {}).get("levels") or []]
    if not levels or not all(isinstance(lv, str) and lv for lv in levels):
        raise ValueError("Topology spec.levels: give at least one level with a nodeLabel")
    if ZONE_LABEL not in levels:
        levels.insert(0, ZONE_LABEL)
    return TopologyConfig(levels=levels)


class FakeFlavor(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One pool of identical simulated nodes (mirrors schemas.agent.FlavorInfo plus sizes)."""

    name: FlavorName
    capacity_type: CapacityType = "on-demand"
    gpu_type: Annotated[str, Meta(max_length=64)] = "a100"
    price_per_gpu_hour: NonNegFloat = 0.0
    gpu_memory_mib: Annotated[int, Meta(ge=0)] = 0
    nodes: Annotated[int, Meta(ge=0, le=100_000)] = 4
    gpu_per_node: Annotated[int, Meta(ge=0, le=64)] = 8
    cpu: Quantity = "96"
    memory: Quantity = "768Gi"
    # Where the nodes sit when the cluster declares `topology`: node i goes to rack
    # i mod (zones x blocks x racks), racks numbered within blocks within zones.
    zones: Annotated[int, Meta(ge=1, le=64)] = 1
    blocks: Annotated[int, Meta(ge=1, le=1024)] = 1  # per zone
    racks: Annotated[int, Meta(ge=1, le=1024)] = 1  # per block
    # The provider behind an autoscaled pool (declare the pool in the agent's `pools`).
    autoscale: FakeAutoscale | None = None

    def __post_init__(self) -> None:
        _check_quantities(f"flavor {self.name!r}", self)

    def place(self, index: int) -> tuple[str, str, str]:
        """(zone, block, rack) of the flavor's node number `index`."""
        slot = index % (self.zones * self.blocks * self.racks)
        zone, rest = divmod(slot, self.blocks * self.racks)
        block, rack = divmod(rest, self.racks)
        return f"zone-{zone}", f"block-{zone}-{block}", f"rack-{zone}-{block}-{rack}"


class FakeAutoscale(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """How the simulated provider answers a request to grow the flavor (a `provision`
    command): each node comes up after a log-normal delay around `delay_s` (seeded by the
    cluster's `seed`), unless the request falls in a stockout. Simulated seconds."""

    delay_s: NonNegFloat = 120.0  # median seconds to a Ready node
    spread: Annotated[float, Meta(ge=0, le=3)] = 0.25  # sigma of the log-normal delay
    # Chance that a request gets no node at all (no capacity in the zone).
    stockout_p: Annotated[float, Meta(ge=0, le=1)] = 0.0
    # [start, end) simulated seconds after the cluster starts during which every request
    # stocks out (a spot drought).
    stockouts: Annotated[list[tuple[NonNegFloat, NonNegFloat]], Meta(max_length=1024)] = []
    # The provider's own limit on the flavor's nodes (a cloud quota), 0 = none: an ask past it
    # gets only the nodes that fit, the rest never come (the broker counts a stockout).
    max_nodes: Annotated[int, Meta(ge=0, le=100_000)] = 0


class BambooTrace(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Replay a spot trace onto one flavor: Bamboo's `time_ms,add|remove,node` rows, or
    SkyPilot's spot-traces JSON counts (`agents/fake/trace.py`).

    Trace time `t` becomes simulated second `t / 1000 / speedup` after the cluster starts;
    events at or before `start_ms` are applied before the first snapshot (initial nodes)."""

    path: Annotated[str, Meta(min_length=1)]
    flavor: FlavorName
    speedup: Positive = 1.0
    start_ms: Annotated[int, Meta(ge=0)] = 0
    max_events: Annotated[int, Meta(ge=1)] | None = None


class FakeClusterConfig(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """How a simulated cluster behaves. Durations are simulated seconds; `time_scale`
    simulated seconds pass per real second (10 = ten times faster than real time)."""

    flavors: Annotated[list[FakeFlavor], Meta(min_length=1, max_length=256)] = msgspec.field(
        default_factory=lambda: [FakeFlavor(name="spot-a100", capacity_type="spot")]
    )
    time_scale: Positive = 1.0
    spot_notice_s: NonNegFloat = 120.0
    spot_rate_per_node_hour: NonNegFloat = 0.0
    trace: BambooTrace | None = None
    start_delay_s: NonNegFloat = 1.0
    checkpoint_write_s: NonNegFloat = 0.0
    enforce_capacity: bool = True
    tick_s: Annotated[float, Meta(gt=0, le=10)] = 0.02  # real seconds between ticker wakeups
    seed: int | None = None
    # Report node topology: the fake fills the levels in order with each node's zone, block,
    # rack and name (a level past those gets its name too). None: no topology reported.
    topology: TopologyConfig | None = None

    def __post_init__(self) -> None:
        names = [f.name for f in self.flavors]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"flavors: duplicate flavor names {dupes}")
        if self.trace is not None and self.trace.flavor not in names:
            raise ValueError(f"trace.flavor {self.trace.flavor!r} is not one of flavors {names}")


class LocalNode(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A slot group on this machine that the broker sees as one node of a flavor."""

    gpu: Annotated[int, Meta(ge=0, le=64)] = 0
    cpu: Quantity = "4"
    memory: Quantity = "8Gi"


class LocalFlavor(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One pool of slot groups. On spot, a notice gives `spot_notice_s` before the replicas
    get SIGTERM, and `grace_s` after that before SIGKILL (as a node drain would)."""

    name: FlavorName
    capacity_type: CapacityType = "on-demand"
    gpu_type: Annotated[str, Meta(max_length=64)] = "cpu"
    price_per_gpu_hour: NonNegFloat = 0.0
    nodes: Annotated[list[LocalNode], Meta(min_length=1, max_length=256)] = msgspec.field(
        default_factory=lambda: [LocalNode()]
    )
    spot_notice_s: NonNegFloat = 30.0
    grace_s: NonNegFloat = 10.0

    def __post_init__(self) -> None:
        for i, node in enumerate(self.nodes):
            _check_quantities(f"flavor {self.name!r}: nodes[{i}]", node)


class LocalClusterConfig(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Replicas as local processes. `workdir` holds one directory per attempt (replica
    working directories, logs, pid and fence files); relative paths are relative to the
    config file. `trace` injects spot notices like the fake backend's (real seconds)."""

    workdir: Annotated[str, Meta(min_length=1)] = "muster-local"
    flavors: Annotated[list[LocalFlavor], Meta(min_length=1, max_length=64)] = msgspec.field(
        default_factory=lambda: [LocalFlavor(name="local")]
    )
    trace: BambooTrace | None = None
    cancel_grace_s: Annotated[float, Meta(ge=0, le=600)] = 2.0
    poll_s: Annotated[float, Meta(gt=0, le=10)] = 0.1
    log_tail_lines: Annotated[int, Meta(ge=1, le=200)] = 10
    # torchrun's --max-restarts for an elastic podset: a node that leaves fails the worker
    # group once (a restart); a node that joins does not count.
    elastic_max_restarts: Annotated[int, Meta(ge=0, le=1000)] = 20

    def __post_init__(self) -> None:
        names = [f.name for f in self.flavors]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"flavors: duplicate flavor names {dupes}")
        if self.trace is not None and self.trace.flavor not in names:
            raise ValueError(f"trace.flavor {self.trace.flavor!r} is not one of flavors {names}")


Token = Annotated[
    str,
    Meta(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$",
        description="letters, digits, '-' and '_' (a queue or team name is a NATS subject token)",
    ),
]
NamespaceName = Annotated[str, Meta(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)]


class FrontDoorNamespace(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A namespace whose marked workloads the agent submits: the queues they may name (as a
    Kueue LocalQueue lets a namespace reach its ClusterQueue) and the team the agent acts as
    for them (its API and event subjects; none = the untenanted subjects)."""

    queues: Annotated[list[Token], Meta(min_length=1, max_length=256)]
    team: Token | None = None


class FrontDoorConfig(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """The Kubernetes front door (agents/kube/frontdoor.py): which namespaces of the home
    cluster may submit with `kubectl apply`, and how often the agent looks at them."""

    namespaces: Annotated[dict[NamespaceName, FrontDoorNamespace], Meta(min_length=1)]
    poll_s: Annotated[float, Meta(gt=0, le=300)] = 2.0
    # How long one broker request (submit, get, cancel) may take before the next poll retries.
    request_timeout_s: Annotated[float, Meta(gt=0, le=60)] = 5.0


LabelValue = Annotated[str, Meta(max_length=63)]


class TaintConfig(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    key: NodeLabel
    value: LabelValue = ""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] = "NoSchedule"


class PoolConfig(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """An autoscaled node pool behind one flavor, as the agent declares it to the broker
    (`FlavorInfo.provision`): the broker counts the nodes it can still add as capacity that
    arrives `ready_s` after it asks, and a request unmet after `window_s` as a stockout."""

    flavor: FlavorName
    gpu_per_node: Annotated[int, Meta(ge=1, le=1024)]
    # The pool's limit in nodes (a node group's max size) and/or in GPUs (a NodePool's
    # `limits`); give one at least.
    max_nodes: Annotated[int, Meta(ge=0, le=1_000_000)] = 0
    max_gpus: Annotated[int, Meta(ge=0, le=2**31)] = 0
    cpu: Quantity = 0
    memory: Quantity = 0
    labels: Annotated[
        dict[NodeLabel, Annotated[str, Meta(max_length=63)]], Meta(max_length=64)
    ] = {}
    taints: Annotated[list[TaintConfig], Meta(max_length=64)] = []
    ready_s: Annotated[float, Meta(ge=0, le=86_400)] = 300.0
    window_s: Annotated[float, Meta(gt=0, le=86_400)] = 900.0

    def __post_init__(self) -> None:
        _check_quantities(f"pools: flavor {self.flavor!r}", self)
        if not self.max_nodes and not self.max_gpus:
            raise ValueError(
                f"pools: flavor {self.flavor!r}: give max_nodes or max_gpus (the pool's limit)"
            )
        if self.window_s < self.ready_s:
            raise ValueError(
                f"pools: flavor {self.flavor!r}: window_s ({self.window_s:g}) is shorter than "
                f"ready_s ({self.ready_s:g}); every request would count as a stockout"
            )

    def provision(self) -> ProvisionPool:
        """What the agent reports for the flavor."""
        return ProvisionPool(
            max_nodes=self.max_nodes,
            max_gpus=self.max_gpus,
            node_gpu=self.gpu_per_node,
            node_cpu_milli=cpu_milli(self.cpu),
            node_memory=memory_bytes(self.memory),
            labels=dict(self.labels),
            taints=[NodeTaint(t.key, t.value, t.effect) for t in self.taints],
            ready_s=self.ready_s,
            window_s=self.window_s,
        )


class AgentConfig(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One agent: a cluster name, its backend and the runtime's batching/heartbeat knobs."""

    cluster: ClusterName
    backend: Literal["fake", "kube", "local"]
    heartbeat_s: Positive = 1.0
    batch_max: Annotated[int, Meta(ge=1, le=MAX_BATCH)] = 1000
    batch_interval_s: Annotated[float, Meta(ge=0, le=10)] = 0.01
    subject_prefix: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")] = "muster"
    fake: FakeClusterConfig | None = None
    kube: dict[str, Any] | None = None
    local: LocalClusterConfig | None = None
    # The cluster's topology levels (what a kube agent reads from node labels).
    topology: TopologyConfig | None = None
    # Prometheus /metrics on 127.0.0.1:<port> (`muster-agent --metrics-port` overrides).
    metrics_port: Annotated[int, Meta(ge=1, le=65535)] | None = None
    # `kubectl apply` submission from this cluster (kube backend only; docs/kubernetes.md).
    frontdoor: FrontDoorConfig | None = None
    # Autoscaled pools behind this cluster's flavors (docs/operations.md, "Autoscaled pools").
    pools: Annotated[list[PoolConfig], Meta(max_length=256)] = []

    def __post_init__(self) -> None:
        if self.frontdoor is not None and self.backend != "kube":
            raise ValueError("frontdoor: only the kube backend has one; remove it or use kube")
        if self.pools:
            self._check_pools()
        if self.backend == "fake" and self.fake is None:
            raise ValueError("fake: required when backend is 'fake' (give at least `fake: {}`)")
        if self.backend == "kube" and self.kube is None:
            raise ValueError("kube: required when backend is 'kube'")
        if self.backend == "local" and self.local is None:
            raise ValueError("local: required when backend is 'local' (give at least `local: {}`)")

    def _check_pools(self) -> None:
        names = [p.flavor for p in self.pools]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"pools: flavors {dupes} are declared twice")
        if self.backend == "local":
            raise ValueError(
                "pools: the local backend has no autoscaler to grow a pool; remove `pools` or "
                "use the fake or kube backend"
            )
        if self.backend == "kube":
            raw = (self.kube or {}).get("flavors") or []
            flavors = {str(f.get("name")) for f in raw if isinstance(f, dict)}
        else:
            flavors = {f.name for f in self.fake.flavors} if self.fake is not None else set()
        unknown = sorted(set(names) - flavors)
        if unknown:
            raise ValueError(
                f"pools: {unknown} are not flavors of this cluster ({sorted(flavors)})"
            )


class FleetConfig(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Many agents in one process sharing one NATS connection (fake clusters, mostly)."""

    clusters: Annotated[list[AgentConfig], Meta(min_length=1, max_length=10_000)]

    def __post_init__(self) -> None:
        names = [c.cluster for c in self.clusters]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"clusters: duplicate cluster names {dupes}")


def _read_yaml(path: str | Path) -> Any:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise AgentConfigError(f"{p}: cannot read config: {exc}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise AgentConfigError(f"{p}: not valid YAML: {exc}") from None


def _resolve_trace(cfg: AgentConfig, base: Path, source: str) -> None:
    """Relative trace paths (and the local backend's workdir) are relative to the config file,
    not to the working directory; a trace that is not there stops the agent before it starts,
    with the path it looked at."""
    if cfg.fake is not None and cfg.fake.trace is not None:
        tp = Path(cfg.fake.trace.path)
        if not tp.is_absolute():
            cfg.fake.trace.path = str((base / tp).resolve())
        if not Path(cfg.fake.trace.path).is_file():
            raise AgentConfigError(
                f"{source}: cluster {cfg.cluster}: fake.trace.path: no file at "
                f"{cfg.fake.trace.path} (a relative path is relative to the config file; the "
                "Bamboo traces ship in the repository's data/traces/)"
            )
    if cfg.local is not None:
        if cfg.local.trace is not None and not Path(cfg.local.trace.path).is_absolute():
            cfg.local.trace.path = str((base / cfg.local.trace.path).resolve())
        if not Path(cfg.local.workdir).is_absolute():
            cfg.local.workdir = str((base / cfg.local.workdir).resolve())


def _invalid(source: str, kind: str, exc: msgspec.ValidationError, root: Any) -> AgentConfigError:
    """`file: invalid fleet config: clusters[0].fake.flavors: ...`, with a hint for the
    common slips (an empty list, a misspelt field)."""
    text = explain(str(exc), root)
    if "length >= 1" in text and text.split(":", 1)[0].endswith("flavors"):
        text += "; list at least one flavor, e.g. {name: spot-a100, capacity_type: spot, nodes: 4}"
    return AgentConfigError(f"{source}: invalid {kind} config: {text}")


def convert_agent_config(raw: Any, source: str = "agent config") -> AgentConfig:
    """Validate an already-parsed mapping; msgspec's message names the field (`$.fake...`)."""
    try:
        return msgspec.convert(raw, AgentConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise _invalid(source, "agent", exc, AgentConfig) from None


def load_agent_config(path: str | Path) -> AgentConfig:
    """Read one agent's YAML config; errors name the file and the offending field."""
    p = Path(path)
    cfg = convert_agent_config(_read_yaml(p), str(p))
    _resolve_trace(cfg, p.parent, str(p))
    return cfg


def load_fleet_config(path: str | Path) -> FleetConfig:
    """Read a fleet YAML (`clusters: [...]`); a single agent's YAML is accepted as a fleet of 1."""
    p = Path(path)
    raw = _read_yaml(p)
    try:
        if isinstance(raw, dict) and "clusters" not in raw and "cluster" in raw:
            fleet = FleetConfig(clusters=[msgspec.convert(raw, AgentConfig, strict=False)])
        else:
            fleet = msgspec.convert(raw, FleetConfig, strict=False)
    except msgspec.ValidationError as exc:
        single = isinstance(raw, dict) and "clusters" not in raw
        raise _invalid(str(p), "fleet", exc, AgentConfig if single else FleetConfig) from None
    for cfg in fleet.clusters:
        _resolve_trace(cfg, p.parent, str(p))
    return fleet


def make_fleet_configs(
    count: int,
    fake: FakeClusterConfig,
    *,
    prefix: str = "fake",
    heartbeat_s: float = 1.0,
    batch_max: int = 1000,
    batch_interval_s: float = 0.01,
    subject_prefix: str = "muster",
) -> list[AgentConfig]:
    """`count` identical fake clusters named `<prefix>-<i>` (load tests, demos)."""
    if not 1 <= count <= 10_000:
        raise ValueError(f"count must be between 1 and 10000, got {count}")
    out: list[AgentConfig] = []
    for i in range(count):
        fk = msgspec.structs.replace(fake, seed=None if fake.seed is None else fake.seed + i)
        out.append(
            AgentConfig(
                cluster=f"{prefix}-{i}",
                backend="fake",
                heartbeat_s=heartbeat_s,
                batch_max=batch_max,
                batch_interval_s=batch_interval_s,
                subject_prefix=subject_prefix,
                fake=fk,
            )
        )
    return out
