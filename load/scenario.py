"""Scenario files: the simulated fleet, its spot traces and the cost model, in YAML.

    python -m load.sim --scenario load/scenarios/multicloud.yaml

A scenario replaces the built-in pools (`load.simconfig.DEFAULT_POOLS`) and may set the GPU speeds
and checkpoint costs. Trace names are Bamboo short names (`p3` = bamboo-p3.csv in the traces
folder) or paths to any `time_ms,add|remove,node` file (relative paths: from the traces folder).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from load.simconfig import AutoscaleSpec, PoolSpec, SimConfig

Positive = Annotated[float, Meta(gt=0)]


class ZoneSpec(msgspec.Struct, forbid_unknown_fields=True):
    """A further zone of a pool: its own trace and slot count."""

    trace: str
    nodes: Annotated[int, Meta(ge=1, le=100_000)]
    phase_h: Annotated[float, Meta(ge=0)] = 0.0


class AutoscaleEntry(msgspec.Struct, forbid_unknown_fields=True):
    """An autoscaled pool (load.simconfig.AutoscaleSpec): its limit, time to a Ready node,
    stockout chance and the idle time after which empty extra nodes go; `trace` an
    availability trace capping what each ask gets (started `phase_h` in)."""

    max_nodes: Annotated[int, Meta(ge=1, le=100_000)]
    ready_s: Annotated[float, Meta(ge=0)] = 300.0
    spread: Annotated[float, Meta(ge=0, le=3)] = 0.3
    window_s: Annotated[float, Meta(gt=0)] = 900.0
    stockout_p: Annotated[float, Meta(ge=0, le=1)] = 0.0
    idle_s: Annotated[float, Meta(ge=0)] = 600.0
    trace: str | None = None
    phase_h: Annotated[float, Meta(ge=0)] = 0.0


class TopologyEntry(msgspec.Struct, forbid_unknown_fields=True):
    """The topology a pool reports: its nodes' zones (the pool's `zones` parts) and, with
    `block_nodes`, blocks of that many nodes within each zone. `reported: false` keeps the
    places for the report but the agent reports none (the same fleet, topology-blind)."""

    block_nodes: Annotated[int, Meta(ge=1, le=100_000)] | None = None
    reported: bool = True


class PoolEntry(msgspec.Struct, forbid_unknown_fields=True):
    cluster: str
    flavor: str
    capacity: Literal["spot", "on-demand"]
    gpu: str
    price: Annotated[float, Meta(ge=0)]
    nodes: Annotated[int, Meta(ge=0, le=100_000)]
    trace: str | None = None
    phase_h: Annotated[float, Meta(ge=0)] = 0.0
    provider: Literal["aws", "gcp", "azure"] = "aws"
    zones: list[ZoneSpec] = []
    autoscale: AutoscaleEntry | None = None
    topology: TopologyEntry | None = None

    def __post_init__(self) -> None:
        if self.nodes == 0 and self.autoscale is None:
            raise ValueError(f"pool {self.flavor}: nodes 0 needs autoscale (it would stay empty)")
        if self.autoscale is not None and (self.trace or self.zones):
            raise ValueError(
                f"pool {self.flavor}: an autoscaled pool takes no spot trace or zones; "
                "name an availability trace under its autoscale: (trace:, phase_h:)"
            )
        if self.autoscale is not None and self.topology is not None:
            raise ValueError(
                f"pool {self.flavor}: an autoscaled pool's new nodes have no place; "
                "declare topology on fixed pools only"
            )


class Scenario(msgspec.Struct, forbid_unknown_fields=True):
    pools: Annotated[list[PoolEntry], Meta(min_length=1)]
    gpu_speed: dict[str, Positive] = {}
    ckpt_cost_s: Annotated[
        list[Annotated[float, Meta(ge=0)]], Meta(min_length=2, max_length=2)
    ] = []
    restore_factor: Annotated[float, Meta(ge=0)] | None = None
    # A trace's own length (h) by trace name, when it runs past its last event (a zone that is
    # up once in two days); others loop at load.traces.trace_period_s.
    trace_length_h: dict[str, Positive] = {}


def load_scenario(path: str | Path) -> Scenario:
    """Parse and validate; a bad file raises ValueError naming the file and the problem."""
    p = Path(path)
    try:
        return msgspec.yaml.decode(p.read_bytes(), type=Scenario)
    except (OSError, msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ValueError(f"scenario {p}: {exc}") from None


def _autoscale(e: AutoscaleEntry) -> AutoscaleSpec:
    fields = msgspec.structs.asdict(e)
    fields["trace_phase_s"] = fields.pop("phase_h") * 3600.0
    return AutoscaleSpec(**fields)


def apply_scenario(cfg: SimConfig, scenario: Scenario) -> SimConfig:
    pools = tuple(
        PoolSpec(
            cluster=e.cluster,
            flavor=e.flavor,
            capacity_type=e.capacity,
            gpu_type=e.gpu,
            price=e.price,
            nodes=e.nodes,
            trace=e.trace,
            trace_phase_s=e.phase_h * 3600.0,
            provider=e.provider,
            zones=tuple((z.trace, z.phase_h * 3600.0, z.nodes) for z in e.zones),
            autoscale=None if e.autoscale is None else _autoscale(e.autoscale),
            topology=e.topology is not None and e.topology.reported,
            block_nodes=(e.topology.block_nodes or 0) if e.topology is not None else 0,
        )
        for e in scenario.pools
    )
    cfg = replace(cfg, pools=pools)
    if scenario.gpu_speed:
        cfg = replace(cfg, gpu_speed=tuple(scenario.gpu_speed.items()))
    if scenario.ckpt_cost_s:
        lo, hi = scenario.ckpt_cost_s
        cfg = replace(cfg, ckpt_cost_s=(min(lo, hi), max(lo, hi)))
    if scenario.restore_factor is not None:
        cfg = replace(cfg, restore_factor=scenario.restore_factor)
    if scenario.trace_length_h:
        lengths = tuple((name, h * 3600.0) for name, h in scenario.trace_length_h.items())
        cfg = replace(cfg, trace_lengths=lengths)
    return cfg
