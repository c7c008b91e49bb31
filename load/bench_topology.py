"""Fragmentation with topology against a topology-blind core: the share of multi-node gangs
placed within one rack, one block and one zone.

    python -m load.bench_topology [--runs 3] [--clusters 4] [--zones 2] [--blocks 4]
                                  [--racks 4] [--nodes 4] [--rounds 40] [--arrivals 500]
                                  [--lifetime 8] [--json out.json]

Fleet: `clusters` x `zones` x `blocks` x `racks` x `nodes` nodes of 8 GPUs, one on-demand pool
per cluster at one price, with the levels zone, block (`cloud.google.com/gce-topology-block`),
rack (`...-subblock`) and host. The same fleet and the same job stream run twice: `aware`
(the pool declares its levels: one zone by default, the finest level that fits, BestFit among
its domains) and `blind` (the pool declares none: the core's per-node packing alone; the nodes
still carry their paths, which is how the blind placements are measured). Jobs: Philly gang
sizes (fixed seed; load/traces.py `gang_demands`) that ask for no level. Each round
`arrivals` jobs arrive, one cycle runs over everything pending (at most 4 x `arrivals` wait),
then each running job ends with probability 1/`lifetime`: churn is what fragments a fleet.

Per mode: the share of admitted multi-node gangs (GPU replicas on more than one node) within
one rack / block / zone, the mean GPU utilisation after each cycle, and decisions (pending
jobs considered) per CPU-second of the cycles. Prints every run, the medians and a `RESULT`
line; keep the fleet small on a shared machine (the defaults run in seconds).
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Annotated, Any

import typer

from broker.core.scheduler import Scheduler
from broker.core.types import GangRequest, Placement
from load.command import Count, JsonOut, Options, program, summary
from load.common import emit
from load.traces import default_traces_dir, gang_demands, philly_gang_sizes
from schemas.agent import FlavorInfo, NodeInfo
from schemas.config import BrokerConfig, QueueConfig, SchedulingConfig

LEVELS = (
    "topology.kubernetes.io/zone",
    "cloud.google.com/gce-topology-block",
    "cloud.google.com/gce-topology-subblock",
    "kubernetes.io/hostname",
)
GPUS_PER_NODE = 8
SEED = 20171009
FALLBACK_SIZES = [1] * 80 + [2, 4, 4, 8, 8, 8, 16, 16, 16, 32, 32, 64, 64, 128] * 2
MODES = ("aware", "blind")


def fleet(args: Options, aware: bool) -> list[tuple[str, list[FlavorInfo], list[NodeInfo]]]:
    out = []
    levels = LEVELS if aware else ()
    for c in range(args.clusters):
        name = f"c{c:03d}"
        flavor = FlavorInfo("a100", "on-demand", "a100", 3.0, topology_levels=levels)
        nodes = [
            NodeInfo(
                name=f"{name}-z{z}-b{b}-r{r}-n{n}",
                flavor="a100",
                gpu=GPUS_PER_NODE,
                cpu_milli=96_000,
                memory=1024 * 2**30,
                topology=(f"z{z}", f"b{b}", f"r{r}", f"{name}-z{z}-b{b}-r{r}-n{n}"),
            )
            for z in range(args.zones)
            for b in range(args.blocks)
            for r in range(args.racks)
            for n in range(args.nodes)
        ]
        out.append((name, [flavor], nodes))
    return out


def spans(
    p: Placement, paths: dict[tuple[str, str], tuple[str, ...]], req: GangRequest
) -> tuple[int, int, int, int] | None:
    """(nodes, zones, blocks, racks) of a gang's GPU replicas; None for a one-node gang."""
    gpu_sets = {d.podset for d in req.podsets if d.gpu}
    nodes = {n for ps, names in p.assignment if ps in gpu_sets for n in names}
    if len(nodes) < 2:
        return None
    where = [paths[(p.cluster, n)] for n in nodes]
    return (
        len(nodes),
        len({w[:1] for w in where}),
        len({w[:2] for w in where}),
        len({w[:3] for w in where}),
    )


def one_mode(args: Options, sizes: list[int], run: int, aware: bool) -> dict[str, float]:
    cfg = BrokerConfig(
        queues=[QueueConfig(name="q")],
        scheduling=SchedulingConfig(max_admissions_per_cycle=4 * args.arrivals),
    )
    sched = Scheduler(cfg)
    now = 1_700_000_000.0
    paths: dict[tuple[str, str], tuple[str, ...]] = {}
    for name, flavors, nodes in fleet(args, aware):
        sched.apply_snapshot(name, flavors, nodes, now)
        paths.update(((name, n.name), n.topology) for n in nodes)
    fleet_gpus = args.clusters * args.zones * args.blocks * args.racks * args.nodes * GPUS_PER_NODE
    rng = random.Random(SEED + run)  # the same stream in both modes
    pending: list[GangRequest] = []
    running: dict[str, int] = {}  # job -> GPUs
    multi = rack = block = zone = 0
    decisions = 0
    cpu = 0.0
    util: list[float] = []
    seq = 0
    for _ in range(args.rounds):
        for _ in range(args.arrivals):
            seq += 1
            pending.append(GangRequest(f"j{seq}", 1, "q", 0, seq, gang_demands(rng.choice(sizes))))
        del pending[: max(0, len(pending) - 4 * args.arrivals)]  # the oldest give up
        now += 60.0
        c0 = time.process_time()
        res = sched.schedule(pending, now)
        cpu += time.process_time() - c0
        decisions += len(pending)
        by_id = {r.job_id: r for r in pending}
        for job_id, p in res.admitted:
            req = by_id[job_id]
            running[job_id] = req.total_gpu
            s = spans(p, paths, req)
            if s is not None:
                multi += 1
                zone += s[1] == 1
                block += s[2] == 1
                rack += s[3] == 1
        admitted = {j for j, _ in res.admitted}
        pending = [r for r in pending if r.job_id not in admitted]
        util.append(sum(running.values()) / fleet_gpus)
        for job_id in [j for j in running if rng.random() < 1.0 / args.lifetime]:
            sched.release(job_id, 1)
            del running[job_id]
    share = max(multi, 1)
    return {
        "multi_node_gangs": float(multi),
        "within_rack": rack / share,
        "within_block": block / share,
        "within_zone": zone / share,
        "gpu_utilization": statistics.fmean(util),
        "decisions_per_cpu_s": decisions / cpu if cpu else 0.0,
    }


app = program()


@app.command(help=summary(__doc__))
def bench_topology(
    runs: Count = 3,
    clusters: Count = 4,
    zones: Count = 2,
    blocks: Count = 4,
    racks: Count = 4,
    nodes: Annotated[int, typer.Option(min=1, help="per rack")] = 4,
    rounds: Count = 40,
    arrivals: Count = 500,
    lifetime: Annotated[float, typer.Option(min=1.0, help="mean rounds a job runs")] = 8.0,
    json_out: JsonOut = None,
) -> None:
    run_bench(
        Options(
            runs=runs,
            clusters=clusters,
            zones=zones,
            blocks=blocks,
            racks=racks,
            nodes=nodes,
            rounds=rounds,
            arrivals=arrivals,
            lifetime=lifetime,
            json=json_out,
        )
    )


def run_bench(args: Options) -> dict[str, Any]:
    philly = default_traces_dir() / "philly.csv"
    sizes = philly_gang_sizes(philly) if philly.exists() else FALLBACK_SIZES
    print(
        f"topology bench: {args.clusters} clusters x {args.zones} zones x {args.blocks} blocks x "
        f"{args.racks} racks x {args.nodes} nodes x {GPUS_PER_NODE} GPUs; {args.rounds} rounds "
        f"of {args.arrivals} arrivals, mean lifetime {args.lifetime} rounds; gang sizes from "
        f"{'philly.csv' if philly.exists() else 'a built-in Philly-like mix'}"
    )
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    for r in range(args.runs):
        for mode in MODES:
            out = one_mode(args, sizes, r, mode == "aware")
            runs[mode].append(out)
            print(
                f"run {r + 1} {mode}: {out['multi_node_gangs']:.0f} multi-node gangs, within "
                f"one rack {out['within_rack']:.1%}, block {out['within_block']:.1%}, zone "
                f"{out['within_zone']:.1%}; GPUs used {out['gpu_utilization']:.1%}; "
                f"{out['decisions_per_cpu_s']:,.0f} decisions per CPU-s"
            )
    result: dict[str, Any] = {"bench": "topology", **{k: v for k, v in vars(args).items()}}
    result.pop("json", None)
    for mode in MODES:
        med = {k: statistics.median(r[k] for r in runs[mode]) for k in runs[mode][0]}
        print(
            f"median {mode}: within one rack {med['within_rack']:.1%}, block "
            f"{med['within_block']:.1%}, zone {med['within_zone']:.1%}; GPUs used "
            f"{med['gpu_utilization']:.1%}; {med['decisions_per_cpu_s']:,.0f} decisions per CPU-s"
        )
        result[mode] = {k: round(v, 4) for k, v in med.items()}
        result[mode]["within_block_runs"] = [round(r["within_block"], 4) for r in runs[mode]]
    emit(result, args.json)
    return result


if __name__ == "__main__":
    app(prog_name="python -m load.bench_topology")
