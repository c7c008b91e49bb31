"""Placement decisions per second of the pure scheduling core, on one core.

    python -m load.bench_core [--runs 5] [--jobs 100000] [--clusters 50] [--nodes 200]
                              [--queues 100] [--json out.json]

Fleet: `clusters` x `nodes` nodes of 8 GPUs (96 cores, 1 TiB). Each cluster offers two of three
GPU types (a100, h100, l4), each as a spot and an on-demand flavor, so 4 pools per cluster
with published-style prices. Queues: `queues` queues in cohorts of 10, weights 1-3, each with a
nominal GPU quota of 1/queues of every flavor class and no borrowing limit (so quota and
cohort arithmetic run on every decision). Jobs: gang sizes sampled from Philly (fixed seed),
mapped to podsets as in load/traces.py; capacity preference, GPU types and checkpointing mixed.

Per run, on a fresh scheduler:
- `fill`: one `schedule()` over all pending jobs on an empty fleet (admits until full;
  `max_admissions_per_cycle` is raised to `jobs` so the budget does not cut the cycle short);
- `full`: 2% of the admitted jobs end, then one cycle over `jobs` new pending jobs while the
  fleet is nearly full (most are rejected): the steady state;
- `back`: a fifth of the jobs on spot end, and one cycle over the spot-only jobs left waiting
  for spot, passed as waiters (`back_cpu_s`: CPU seconds of that cycle).
A decision is one pending job considered (admitted or given reasons). Each cycle is timed by
the wall clock and by this process's CPU time (the one-core figure when the machine is shared).
Before each timed cycle the heap is frozen (`gc.freeze`), as the broker's `GcPacer` freezes
what has lived a second (shell/gcpacing.py); without it the cycle collector walks every job
record several times per cycle, which the broker process never does. Each cycle runs with the
collector paused and what it left frozen at its end, as the broker runs its cycles
(`gcpacing.paused`); `--collector-in-cycle` lets it run, as every figure before 2026-12-04
22:40 UTC was taken. After each cycle, outside its time, a young-and-middle collector pass is
timed: what the cycle left for the next pass to walk.
Prints every run, the medians, and one machine-readable `RESULT {...}` line.
"""

from __future__ import annotations

import gc
import json
import random
import statistics
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Annotated, Any

import typer

from broker.core.scheduler import Scheduler
from broker.core.types import GangRequest
from load.command import Count, JsonOut, Nodes, Options, program, summary
from load.traces import default_traces_dir, gang_demands, philly_gang_sizes
from schemas.agent import FlavorInfo, NodeInfo
from schemas.config import (
    BrokerConfig,
    FlavorClass,
    FlavorQuota,
    QueueConfig,
    ResourceQuota,
    SchedulingConfig,
)
from schemas.job import CapacityPreference
from shell.gcpacing import paused

GPU_TYPES = ("a100", "h100", "l4")
PRICES = {  # $/GPU-hour: (on-demand, spot)
    "a100": (3.67, 1.47),
    "h100": (6.98, 2.79),
    "l4": (0.85, 0.34),
}
GPUS_PER_NODE = 8
SEED = 20171009
FALLBACK_SIZES = [1] * 93 + [2, 2, 4, 4, 8, 8, 16]


def cluster_types(c: int) -> tuple[str, str]:
    return GPU_TYPES[c % 3], GPU_TYPES[(c + 1) % 3]


def fleet(clusters: int, nodes: int) -> list[tuple[str, list[FlavorInfo], list[NodeInfo]]]:
    out = []
    for c in range(clusters):
        name = f"c{c:03d}"
        flavors: list[FlavorInfo] = []
        for t in cluster_types(c):
            od, spot = PRICES[t]
            flavors.append(FlavorInfo(f"{t}-od", "on-demand", t, od))
            flavors.append(FlavorInfo(f"{t}-spot", "spot", t, spot))
        node_list = [
            NodeInfo(
                name=f"{name}-n{i:04d}",
                flavor=flavors[i % len(flavors)].name,
                gpu=GPUS_PER_NODE,
                cpu_milli=96_000,
                memory=1024 * 2**30,
            )
            for i in range(nodes)
        ]
        out.append((name, flavors, node_list))
    return out


def config(clusters: int, nodes: int, queues: int, max_admissions: int) -> BrokerConfig:
    classes = [
        FlavorClass(name=f"{t}-{ct}", capacity_type=ct, gpu_type=t)
        for t in GPU_TYPES
        for ct in ("on-demand", "spot")
    ]
    per_class: dict[str, int] = {fc.name: 0 for fc in classes}
    per_pool_nodes = nodes // 4
    for c in range(clusters):
        for t in cluster_types(c):
            per_class[f"{t}-on-demand"] += per_pool_nodes * GPUS_PER_NODE
            per_class[f"{t}-spot"] += per_pool_nodes * GPUS_PER_NODE
    qcs = [
        QueueConfig(
            name=f"q{i:03d}",
            cohort=f"cohort-{i // 10}",
            weight=float(1 + i % 3),
            quotas=[
                FlavorQuota(
                    flavor=cls, resources={"gpu": ResourceQuota(nominal=max(1, n // queues))}
                )
                for cls, n in per_class.items()
            ],
        )
        for i in range(queues)
    ]
    return BrokerConfig(
        queues=qcs,
        flavors=classes,
        scheduling=SchedulingConfig(max_admissions_per_cycle=max_admissions),
    )


CAPACITY: list[tuple[CapacityPreference, float]] = [
    ("any", 0.5),
    ("spot", 0.2),
    ("on-demand", 0.15),
    ("spot-then-on-demand", 0.15),
]


def jobs(n: int, queues: int, sizes: list[int], seed: int, start: int) -> list[GangRequest]:
    rng = random.Random(seed)
    prefs = [c for c, _ in CAPACITY]
    weights = [w for _, w in CAPACITY]
    out = []
    for i in range(start, start + n):
        gpus = rng.choice(sizes)
        types = frozenset() if rng.random() < 0.6 else frozenset({rng.choice(GPU_TYPES)})
        out.append(
            GangRequest(
                job_id=f"job-{i}",
                attempt=1,
                queue=f"q{rng.randrange(queues):03d}",
                priority=0,
                order=i,
                podsets=gang_demands(gpus),
                gpu_types=types,
                capacity=rng.choices(prefs, weights)[0],
                checkpoint_interval_s=600.0 if rng.random() < 0.7 else None,
            )
        )
    return out


def one_run(args: Options, sizes: list[int], run: int) -> dict[str, float]:
    cfg = config(args.clusters, args.nodes, args.queues, max(args.jobs, 1))
    t0 = time.perf_counter()
    sched = Scheduler(cfg)
    now = 1_700_000_000.0
    for name, flavors, nodes in fleet(args.clusters, args.nodes):
        sched.apply_snapshot(name, flavors, nodes, now)
    build_s = time.perf_counter() - t0
    pending = jobs(args.jobs, args.queues, sizes, SEED + run, 0)

    gc.freeze()  # as the broker's GcPacer does (see the module docstring)
    cycle = nullcontext if args.collector_in_cycle else paused
    t0, c0 = time.perf_counter(), time.process_time()
    with cycle():
        res = sched.schedule(pending, now + 1)
    fill_s = time.perf_counter() - t0
    fill_cpu = time.process_time() - c0
    fill_after = collector_after_cycle()
    fill_decisions = len(res.admitted) + len(res.pending)
    by_id = {r.job_id: r for r in pending}
    fill_gpus = sum(by_id[j].total_gpu for j, _ in res.admitted)
    fleet_gpus = args.clusters * args.nodes * GPUS_PER_NODE
    assert fill_decisions == len(pending), (fill_decisions, len(pending))

    rng = random.Random(SEED + run)
    ended = rng.sample(res.admitted, len(res.admitted) // 50)
    for job_id, _ in ended:
        sched.release(job_id, 1)
    more = jobs(args.jobs, args.queues, sizes, SEED + 1000 + run, args.jobs)
    gc.freeze()
    t0, c0 = time.perf_counter(), time.process_time()
    with cycle():
        res2 = sched.schedule(more, now + 2)
    full_s = time.perf_counter() - t0
    full_cpu = time.process_time() - c0
    full_after = collector_after_cycle()
    full_decisions = len(res2.admitted) + len(res2.pending)
    assert full_decisions == len(more)

    # Spot comes back: a fifth of the jobs running on spot end, and a cycle offers that spot
    # to the spot-only jobs left waiting for it (passed in as the machine passes them).
    on_spot = [j for j, p in (*res.admitted, *res2.admitted) if p.flavor.endswith("-spot")]
    for job_id in rng.sample(on_spot, len(on_spot) // 5):
        sched.release(job_id, 1)
    by_id.update((r.job_id, r) for r in more)
    waiting = [by_id[j] for j in sched.spot_waiters.ids]
    gc.freeze()
    c0 = time.process_time()
    with cycle():
        res3 = sched.schedule(waiting, now + 3, waiting)
    back_cpu = time.process_time() - c0
    gc.unfreeze()  # the next run starts from a fresh scheduler
    return {
        "build_s": build_s,
        "fill_s": fill_s,
        "fill_decisions_per_s": fill_decisions / fill_s,
        "fill_decisions_per_cpu_s": fill_decisions / fill_cpu,
        "fill_admitted": float(len(res.admitted)),
        "fill_gpu_utilization": fill_gpus / fleet_gpus,
        "fill_gc_after_ms": fill_after * 1000,
        "full_s": full_s,
        "full_decisions_per_s": full_decisions / full_s,
        "full_decisions_per_cpu_s": full_decisions / full_cpu,
        "full_admitted": float(len(res2.admitted)),
        "full_preemptions": float(len(res2.preemptions)),
        "full_gc_after_ms": full_after * 1000,
        "back_waiters": float(len(waiting)),
        "back_admitted": float(len(res3.admitted)),
        "back_cpu_s": back_cpu,
    }


def collector_after_cycle() -> float:
    """CPU seconds of a young-and-middle collector pass right after a cycle (not in its
    time): what the cycle left for the next pass to walk, had it not been frozen."""
    c0 = time.process_time()
    gc.collect(1)
    return time.process_time() - c0


app = program()


@app.command(help=summary(__doc__))
def bench_core(
    runs: Count = 5,
    jobs: Annotated[int, typer.Option(min=1, max=1_000_000, help="pending jobs")] = 100_000,
    clusters: Count = 50,
    nodes: Nodes = 200,
    queues: Count = 100,
    collector_in_cycle: Annotated[
        bool,
        typer.Option(
            "--collector-in-cycle",
            help="let the cycle collector run inside each cycle (as before 2026-12-04)",
        ),
    ] = False,
    json_out: JsonOut = None,
) -> None:
    run_bench(
        Options(
            runs=runs,
            jobs=jobs,
            clusters=clusters,
            nodes=nodes,
            queues=queues,
            collector_in_cycle=collector_in_cycle,
            json=json_out,
        )
    )


def run_bench(args: Options) -> dict[str, Any]:

    philly = default_traces_dir() / "philly.csv"
    sizes = philly_gang_sizes(philly) if philly.exists() else FALLBACK_SIZES
    print(
        f"core bench: {args.clusters} clusters x {args.nodes} nodes x {GPUS_PER_NODE} GPUs, "
        f"{args.queues} queues, {args.jobs} pending jobs, gang sizes from "
        f"{'philly.csv' if philly.exists() else 'a built-in Philly-like mix'}"
    )
    runs = []
    for r in range(args.runs):
        out = one_run(args, sizes, r)
        runs.append(out)
        print(
            f"run {r + 1}: fill {out['fill_decisions_per_s']:,.0f} decisions/s "
            f"({out['fill_decisions_per_cpu_s']:,.0f}/cpu-s; {out['fill_s']:.2f} s, "
            f"{out['fill_admitted']:.0f} admitted, "
            f"{out['fill_gpu_utilization']:.1%} of GPUs used); "
            f"nearly full {out['full_decisions_per_s']:,.0f} decisions/s "
            f"({out['full_decisions_per_cpu_s']:,.0f}/cpu-s; {out['full_s']:.2f} s, "
            f"{out['full_admitted']:.0f} admitted, {out['full_preemptions']:.0f} preemptions); "
            f"inventory build {out['build_s']:.2f} s; a collector pass right after each "
            f"cycle {out['fill_gc_after_ms']:.1f} / {out['full_gc_after_ms']:.1f} ms; "
            f"spot back: {out['back_waiters']:.0f} spot-only waiters, "
            f"{out['back_admitted']:.0f} admitted in {out['back_cpu_s']:.2f} CPU-s"
        )
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(
        f"median: fill {med['fill_decisions_per_s']:,.0f} decisions/s "
        f"({med['fill_decisions_per_cpu_s']:,.0f} per CPU-second), "
        f"nearly full {med['full_decisions_per_s']:,.0f} decisions/s "
        f"({med['full_decisions_per_cpu_s']:,.0f} per CPU-second)"
    )
    result: dict[str, Any] = {
        "bench": "core",
        "clusters": args.clusters,
        "nodes_per_cluster": args.nodes,
        "gpus_per_node": GPUS_PER_NODE,
        "queues": args.queues,
        "pending_jobs": args.jobs,
        "collector_in_cycle": args.collector_in_cycle,
        "runs": args.runs,
        "fill_decisions_per_s_median": round(med["fill_decisions_per_s"]),
        "full_decisions_per_s_median": round(med["full_decisions_per_s"]),
        "fill_decisions_per_cpu_s_median": round(med["fill_decisions_per_cpu_s"]),
        "full_decisions_per_cpu_s_median": round(med["full_decisions_per_cpu_s"]),
        "fill_admitted_median": round(med["fill_admitted"]),
        "fill_gpu_utilization_median": round(med["fill_gpu_utilization"], 4),
        "full_preemptions_median": round(med["full_preemptions"]),
        "fill_gc_after_ms_median": round(med["fill_gc_after_ms"], 1),
        "full_gc_after_ms_median": round(med["full_gc_after_ms"], 1),
        "back_waiters_median": round(med["back_waiters"]),
        "back_admitted_median": round(med["back_admitted"]),
        "back_cpu_s_median": round(med["back_cpu_s"], 3),
        "fill_decisions_per_s": [round(r["fill_decisions_per_s"]) for r in runs],
        "full_decisions_per_s": [round(r["full_decisions_per_s"]) for r in runs],
        "target_decisions_per_s": 50_000,  # per CPU-second, fill phase
    }
    line = json.dumps(result, sort_keys=True)
    print("RESULT " + line)
    if args.json:
        Path(args.json).write_text(line + "\n")
    return result


if __name__ == "__main__":
    app(prog_name="python -m load.bench_core")
