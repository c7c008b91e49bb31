"""The simulator's configuration: the fleet's pools, prices, GPU speeds, the capacity mix and
every knob of one run (`SimConfig`). Scenario files (load/scenario.py) and the simulator
(load/sim/) both build on it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from load import traces
from schemas.job import CapacityPreference, CapacityType

TRACES_DIR = traces.default_traces_dir()
SpotMode = Literal["trace", "poisson", "none"]


@dataclass(frozen=True, slots=True)
class AutoscaleSpec:
    """An autoscaled pool: it grows to `max_nodes` when the broker asks, each node Ready after
    a log-normal delay around `ready_s` (sigma `spread`), unless the ask stocks out
    (probability `stockout_p`); nodes beyond the pool's `nodes` that stay empty for
    `idle_s` are removed (Karpenter's consolidateAfter, cluster-autoscaler's scale-down).
    With an availability `trace` (a SkyPilot count per tick, looped, started `trace_phase_s`
    in like the spot traces) an ask gets at most the count the trace grants at that moment,
    and nothing (a stockout) while it grants none."""

    max_nodes: int
    ready_s: float = 300.0
    spread: float = 0.3
    window_s: float = 900.0
    stockout_p: float = 0.0
    idle_s: float = 600.0
    trace: str | None = None  # a path to a trace file, as PoolSpec.trace
    trace_phase_s: float = 0.0


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """One (cluster, flavor) pool; `trace` names the Bamboo file that drives its spot nodes."""

    cluster: str
    flavor: str
    capacity_type: CapacityType
    gpu_type: str
    price: float  # dollars per GPU-hour
    nodes: int
    trace: str | None = None  # "p3" | "g4dn" (bamboo-<name>.csv) or a path to a trace file
    trace_phase_s: float = 0.0  # start this pool this far into the (looped) trace
    provider: str = "aws"  # sets the notice window (NOTICE_S)
    # A pool spanning zones: further (trace, phase_s, nodes) parts, each driven by its own
    # trace; `nodes` and `trace` above are the first zone's.
    zones: tuple[tuple[str, float, int], ...] = ()
    # Autoscaled: `nodes` are kept warm (the pool's minimum); the rest come when asked.
    autoscale: AutoscaleSpec | None = None
    # Topology the pool reports: each node's zone (the part of `zones` it is in) and, with
    # `block_nodes`, its block (every `block_nodes` slots of a zone); none unless declared.
    topology: bool = False
    block_nodes: int = 0


# Prices per GPU-hour after AWS list prices (p4d, p3.16xlarge, g4dn.metal) and typical spot
# discounts; the on-prem pool is priced at an amortised rate. ~816 GPUs when every spot slot
# is up, ~670 on average under the Bamboo traces.
DEFAULT_POOLS: tuple[PoolSpec, ...] = (
    PoolSpec("us-east", "v100-spot", "spot", "V100", 0.92, 32, "p3"),
    PoolSpec("us-east", "v100-od", "on-demand", "V100", 3.06, 8),
    PoolSpec("us-west", "t4-spot", "spot", "T4", 0.36, 24, "g4dn"),
    PoolSpec("us-west", "t4-od", "on-demand", "T4", 0.98, 6),
    PoolSpec("eu-west", "a100-spot", "spot", "A100", 1.50, 16, "p3", 5.7 * 3600),
    PoolSpec("eu-west", "a100-od", "on-demand", "A100", 4.10, 8),
    PoolSpec("on-prem", "a100-reserved", "on-demand", "A100", 2.50, 8),
)

# Spot interruption notice per provider: AWS gives two minutes; GCP preemption and Azure
# eviction give 30 s.
NOTICE_S: dict[str, float] = {"aws": 120.0, "gcp": 30.0, "azure": 30.0}

# Training speed per GPU type relative to a V100 (Philly durations are read as V100-seconds
# of work). Approximate public training-throughput figures: A100 about 2.2x V100 (Lambda Labs
# PyTorch training benchmarks, mixed precision, averaged over models); T4 about 0.3x V100
# (NVIDIA data sheets: 65 vs 125 FP16 tensor TFLOPS, 320 vs 900 GB/s memory bandwidth). A
# scenario file may set its own.
GPU_SPEED: dict[str, float] = {"V100": 1.0, "A100": 2.2, "T4": 0.3}

DEFAULT_MIX: tuple[tuple[CapacityPreference, float], ...] = (
    ("spot", 0.30),
    ("spot-then-on-demand", 0.40),
    ("on-demand", 0.15),
    ("any", 0.15),
)


def on_demand_pools(pools: Sequence[PoolSpec]) -> tuple[PoolSpec, ...]:
    """The same fleet with every spot pool bought on-demand: the on-demand price of its GPU
    type in its own cluster (else the highest on-demand price of that type anywhere)."""
    od: dict[tuple[str, str], float] = {}
    anywhere: dict[str, float] = {}
    for p in pools:
        if p.capacity_type == "on-demand":
            od[(p.cluster, p.gpu_type)] = max(od.get((p.cluster, p.gpu_type), 0.0), p.price)
            anywhere[p.gpu_type] = max(anywhere.get(p.gpu_type, 0.0), p.price)
    out = []
    for p in pools:
        if p.capacity_type == "spot":
            price = od.get((p.cluster, p.gpu_type), anywhere.get(p.gpu_type, p.price))
            p = replace(p, capacity_type="on-demand", price=price)
        out.append(p)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Every knob of one run. Defaults: 3000 Philly jobs onto ~670 GPUs, Bamboo reclaims."""

    jobs: int = 3000
    offset: int = 48_000  # first Philly row (sorted by submit time) of the window
    compress: float = 3.0  # divide inter-arrival gaps by this
    max_duration_s: float = 12 * 3600.0  # cap Philly's multi-week jobs
    seed: int = 1
    pools: tuple[PoolSpec, ...] = DEFAULT_POOLS
    mix: tuple[tuple[CapacityPreference, float], ...] = DEFAULT_MIX
    queues: tuple[str, ...] = ("research", "production", "dev")
    checkpoint_fraction: float = 0.85
    checkpoint_every_s: float = 600.0
    spot: SpotMode = "trace"
    trace_phase_s: float = 0.0  # added to every pool's own phase (pick another trace window)
    # ... and this share of each trace's period, so runs sample the whole of a long trace.
    trace_phase_frac: float = 0.0
    # Declared lengths of spot traces (trace name, seconds); others: traces.trace_period_s.
    trace_lengths: tuple[tuple[str, float], ...] = ()
    poisson_rate: float = 0.6  # reclaims per node-hour (Bamboo shows ~0.6)
    poisson_down_s: float = 1800.0  # mean time before a reclaimed slot returns
    gpu_speed: tuple[tuple[str, float], ...] = tuple(GPU_SPEED.items())
    # The broker's prior per GPU type (`scheduling.gpu_speeds`; () = its defaults), which may
    # differ from the world's `gpu_speed` above: how placement fares on a wrong prior.
    prior_speed: tuple[tuple[str, float], ...] = ()
    # False: every job declares the prior as its own speeds, so its measured step rates never
    # count (placement on the prior alone).
    learn_speeds: bool = True
    # Checkpoint write cost: each job draws a stall (s) uniformly from this range; periodic
    # checkpoints stall the job that long, and a checkpoint asked for at a notice takes as
    # long (and is lost if the node goes first). Restoring takes `restore_factor` times it.
    ckpt_cost_s: tuple[float, float] = (10.0, 90.0)
    restore_factor: float = 1.0
    ack_latency_s: float = 0.2
    # A Cancel reaches its agent this long after it is sent (0: at once). A Dispatch the core
    # ordered after it (`Send.after_cancel_of`) waits for it, unless `keep_order` is off,
    # which only shows what the ordering prevents.
    cancel_latency_s: float = 0.0
    keep_order: bool = True
    start_delay_s: tuple[float, float] = (20.0, 60.0)  # image pull, rendezvous
    start_delay_per_replica_s: float = 5.0
    tick_s: float = 5.0
    idle_tick_s: float = 60.0
    heartbeat_s: float = 10.0
    cycle_delay_s: float = 0.1  # admission cycles coalesce inputs like the shell's loop
    sample_s: float = 300.0
    drain_s: float = 86_400.0  # stop this long after the last arrival even if jobs remain
    full_check_every: int = 2000  # steps between full invariant sweeps (touched jobs: always)
    max_steps: int = 50_000_000
    progress_s: float = 0.0  # print a progress line to stderr this often (wall s; 0 = never)
    philly: Path = TRACES_DIR / "philly.csv"
    traces: Path = TRACES_DIR
