"""Admission-cycle time of the lifecycle machine against queue depth.

    python -m load.bench_cycle [--depths 1000,10000,100000] [--runs 7] [--json out.json]

A fleet of 4 clusters x 50 nodes x 8 GPUs is filled with running 8-GPU jobs, then `depth`
more jobs of Philly gang sizes queue behind them (three queues). Each timed cycle follows a
capacity change (one node re-reported), so the machine reconsiders the heads of every queue
(`Backlog.lookahead` per queue) and finds nothing fits. That is the steady state of a deep
backlog on a full fleet. The cycle time should not grow with the depth: only the heads are
examined. Prints the median and spread per depth, and one `RESULT {...}` line.

    python -m load.bench_cycle --arrivals 1,6,30 [--runs 300]

times the paced regime instead: the end-to-end benchmark's fleet (50 clusters x 200 nodes x 8
GPUs, half spot) holding its 20,000-job burst, then cycles that each follow a few arrivals (at
1,000 submissions/s a cycle every few ms sees a handful), every Dispatch acknowledged. What a
cycle costs beyond its jobs is what the pause after it (broker/pacing.py) saves.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from collections.abc import Sequence
from typing import Annotated, Any

import typer

from broker.core.effects import Effect, dispatches, split_reply
from broker.core.inputs import CYCLE, AgentBatch, DispatchAcked, SubmitJob
from broker.core.machine import Machine
from load.command import JsonOut, Options, program, summary
from load.common import emit
from load.traces import gang_shape
from schemas.agent import ClusterSnapshot, EventBatch, FlavorInfo, NodeInfo, NodeUpsert
from schemas.config import BrokerConfig, QueueConfig
from schemas.job import CheckpointSpec, JobSpec, PodSet

CLUSTERS = 4
NODES = 50
GPUS = 8
QUEUES = ("research", "production", "dev")
SIZES = [1] * 93 + [2, 2, 4, 4, 8, 8, 16]  # Philly's mix: 93 % single-GPU jobs


def _node(cluster: str, i: int) -> NodeInfo:
    flavor = "spot" if i % 2 else "od"
    return NodeInfo(
        name=f"{cluster}-n{i:03d}", flavor=flavor, gpu=GPUS, cpu_milli=96_000, memory=2**40
    )


def _spec(i: int, gpus: int, queue: str) -> JobSpec:
    replicas, per = gang_shape(gpus)
    return JobSpec(
        name=f"j{i}",
        job_id=f"j{i}",
        queue=queue,
        gang=[PodSet(name="worker", replicas=replicas, gpu=per, cpu="4", memory="16Gi")],
        capacity="any",
        # Checkpointed, so spot nodes take them too (a job without one stays off spot).
        checkpoint=CheckpointSpec(uri=f"s3://ckpt/j{i}"),
    )


FLAVORS = [
    FlavorInfo(name="od", capacity_type="on-demand", gpu_type="a100", price_per_gpu_hour=4.1),
    FlavorInfo(name="spot", capacity_type="spot", gpu_type="a100", price_per_gpu_hour=1.5),
]


def report(m: Machine, now: float, clusters: int, nodes: int) -> None:
    """Each cluster's agent reports its nodes."""
    for c in range(clusters):
        name = f"c{c}"
        snap = ClusterSnapshot(flavors=FLAVORS, nodes=[_node(name, i) for i in range(nodes)])
        m.handle(
            AgentBatch(name, EventBatch(cluster=name, instance="i", seq=1, events=[snap])), now
        )


def fill(m: Machine, now: float, queues: Sequence[str]) -> int:
    """The fleet reports, and 8-GPU jobs of `queues` fill it; returns the next job number."""
    report(m, now, CLUSTERS, NODES)
    i = 0
    for _ in range(CLUSTERS * NODES):
        split_reply(m.handle(SubmitJob(_spec(i, GPUS, queues[i % len(queues)])), now))
        i += 1
    m.handle(CYCLE, now)
    return i


def build(depth: int, seed: int) -> tuple[Machine, float]:
    """A full fleet and `depth` queued jobs; returns the machine and the virtual time."""
    m = Machine(BrokerConfig(queues=[QueueConfig(name=q) for q in QUEUES]))
    now = 1_700_000_000.0
    i = fill(m, now, QUEUES)
    rng = random.Random(seed)
    for _ in range(depth):
        split_reply(m.handle(SubmitJob(_spec(i, rng.choice(SIZES), QUEUES[i % 3])), now))
        i += 1
    m.handle(CYCLE, now)  # the fresh jobs get their first look (and are parked)
    return m, now


def time_cycles(m: Machine, now: float, cycles: int) -> list[tuple[float, float]]:
    """(wall, this process's CPU) seconds of each cycle: CPU time is the one-core figure
    when other work shares the machine."""
    out = []
    seq = 1
    for k in range(cycles):
        now += 1.0
        seq += 1
        node = _node("c0", k % NODES)
        batch = EventBatch(cluster="c0", instance="i", seq=seq, events=[NodeUpsert(node=node)])
        m.handle(AgentBatch("c0", batch), now)
        assert m.wants_cycle
        t0, c0 = time.perf_counter(), time.process_time()
        effects = m.handle(CYCLE, now)
        out.append((time.perf_counter() - t0, time.process_time() - c0))
        assert not effects, "the fleet is full: nothing may be admitted"
    return out


# The paced regime: load.bench_e2e's fleet and burst.
PACED_CLUSTERS, PACED_NODES, PACED_BURST = 50, 200, 20_000
PACED_QUEUES = tuple(f"q{i}" for i in range(10))
PACED_GAP_S = 0.006  # virtual time between cycles: six arrivals' worth at 1,000/s


class Paced:
    """A machine in the paced regime, and what the next arrivals need."""

    def __init__(
        self,
        seed: int,
        clusters: int = PACED_CLUSTERS,
        nodes: int = PACED_NODES,
        burst: int = PACED_BURST,
    ) -> None:
        self.m = Machine(BrokerConfig(queues=[QueueConfig(name=q) for q in PACED_QUEUES]))
        self.now = 1_700_000_000.0
        self.rng = random.Random(seed)
        self.next_job = 0
        report(self.m, self.now, clusters, nodes)
        self.arrive(burst)
        while self.admit():  # the burst, admitted cycle by cycle until one admits none
            pass

    def arrive(self, n: int) -> None:
        for _ in range(n):
            i = self.next_job
            queue = PACED_QUEUES[i % len(PACED_QUEUES)]
            split_reply(self.m.handle(SubmitJob(_spec(i, self.rng.choice(SIZES), queue)), self.now))
            self.next_job += 1

    def admit(self) -> int:
        """One cycle, its Dispatches acknowledged by their agents: how many it admitted."""
        return self.acknowledge(self.m.handle(CYCLE, self.now))

    def acknowledge(self, effects: Sequence[Effect]) -> int:
        sent = dispatches(effects)
        for d in sent:
            self.m.handle(DispatchAcked(d.job_id, d.attempt, True, ""), self.now)
        return len(sent)

    def timed_cycles(self, arrivals: int, cycles: int) -> tuple[list[float], int]:
        """CPU seconds of each of `cycles` cycles, each after `arrivals` submissions, and the
        jobs they admitted in all."""
        cpu, admitted = [], 0
        for _ in range(cycles):
            self.now += PACED_GAP_S
            self.arrive(arrivals)
            c0 = time.process_time()
            effects = self.m.handle(CYCLE, self.now)
            cpu.append(time.process_time() - c0)
            admitted += self.acknowledge(effects)
        return cpu, admitted


app = program()


@app.command(help=summary(__doc__))
def bench_cycle(
    depths: Annotated[
        str, typer.Option(help="queued jobs per measurement, comma-separated")
    ] = "1000,10000,100000",
    arrivals: Annotated[
        str | None,
        typer.Option(
            help="time the paced regime instead: cycles each after this many arrivals, "
            "comma-separated (e.g. 1,6,30)",
            show_default=False,
        ),
    ] = None,
    runs: Annotated[int, typer.Option(min=1, help="timed cycles per depth")] = 7,
    seed: int = 1,
    json_out: JsonOut = None,
) -> None:
    if arrivals is not None:
        counts = _counts(arrivals, "--arrivals", 1_000)
        run_paced(Options(arrivals=counts, runs=runs, seed=seed, json=json_out))
        return
    sizes = _counts(depths, "--depths", 1_000_000)
    run_bench(Options(depths=sizes, runs=runs, seed=seed, json=json_out))


def _counts(text: str, hint: str, most: int) -> list[int]:
    try:
        counts = [int(d) for d in text.split(",") if d.strip()]
    except ValueError:
        raise typer.BadParameter(
            f"{text!r}: give whole numbers separated by commas, e.g. 1,10", param_hint=hint
        ) from None
    if not counts or any(not 1 <= d <= most for d in counts):
        raise typer.BadParameter(f"each must be 1..{most:,}", param_hint=hint)
    return counts


def run_paced(args: Options) -> dict[str, Any]:
    print(
        f"paced cycle bench: {PACED_CLUSTERS} clusters x {PACED_NODES} nodes x {GPUS} GPUs "
        f"holding a {PACED_BURST:,}-job burst; {len(PACED_QUEUES)} queues; {args.runs} cycles "
        "per arrival count"
    )
    t0 = time.perf_counter()
    paced = Paced(args.seed)
    # As the broker does (shell/gcpacing.py, GcPacer): what the burst left is frozen, so a
    # timed cycle is not charged for a full collection walking 20,000 jobs.
    gc.collect()
    gc.freeze()
    print(f"set-up {time.perf_counter() - t0:.1f} s, {paced.m.views.live_count():,} jobs live")
    result: dict[str, Any] = {"bench": "cycle-paced", "runs": args.runs, "arrivals": {}}
    for n in args.arrivals:
        cpu, admitted = paced.timed_cycles(n, args.runs)
        med = statistics.median(cpu)
        print(
            f"{n:>4} arrivals: cycle median {med * 1e3:.3f} ms CPU, "
            f"{med * 1e3 / n:.3f} ms per arrival (max {max(cpu) * 1e3:.2f} ms; "
            f"{admitted} of {n * args.runs} admitted)"
        )
        result["arrivals"][str(n)] = {
            "median_cpu_ms": round(med * 1e3, 4),
            "per_arrival_cpu_ms": round(med * 1e3 / n, 4),
            "max_cpu_ms": round(max(cpu) * 1e3, 3),
            "admitted": admitted,
            "arrived": n * args.runs,
        }
    emit(result, args.json)
    return result


def run_bench(args: Options) -> dict[str, Any]:
    depths: list[int] = args.depths
    result: dict[str, Any] = {"bench": "cycle", "runs": args.runs, "depths": {}}
    print(
        f"cycle bench: {CLUSTERS} clusters x {NODES} nodes x {GPUS} GPUs, full; "
        f"{len(QUEUES)} queues; cycle after one node update, {args.runs} cycles per depth"
    )
    for depth in depths:
        t0 = time.perf_counter()
        m, now = build(depth, args.seed)
        setup = time.perf_counter() - t0
        assert m.views.pending_count() == depth, (m.views.pending_count(), depth)
        pairs = time_cycles(m, now, args.runs)
        times = [w for w, _ in pairs]
        cpu = [c for _, c in pairs]
        med = statistics.median(times)
        print(
            f"{depth:>7,} queued: cycle median {med * 1e3:7.2f} ms wall, "
            f"{statistics.median(cpu) * 1e3:7.2f} ms CPU "
            f"(wall min {min(times) * 1e3:.2f}, max {max(times) * 1e3:.2f}; setup {setup:.1f} s)"
        )
        result["depths"][str(depth)] = {
            "median_ms": round(med * 1e3, 3),
            "median_cpu_ms": round(statistics.median(cpu) * 1e3, 3),
            "min_ms": round(min(times) * 1e3, 3),
            "max_ms": round(max(times) * 1e3, 3),
        }
    emit(result, args.json)
    return result


if __name__ == "__main__":
    app(prog_name="python -m load.bench_cycle")
