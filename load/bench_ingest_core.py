"""Agent event ingest in the core alone: CPU a node/GPU event costs the lifecycle machine.

    python -m load.bench_ingest_core [--clusters 50] [--nodes 200] [--events 500000]
                                     [--batch 500] [--runs 5] [--json out.json]

The batches of `load.bench_ingest` (each cluster's snapshot, then batches of NodeUpsert and
GpuHealth events over its nodes), decoded from their wire bytes and handed to `Machine.handle`
as the broker's agent link does, without NATS or the broker's process around it. Each run
builds a new machine, applies the snapshots, freezes what lives (as the broker's collector
pacing does), then times decoding and applying the delta batches by this process's CPU time:
the decoded events are new objects, as in the broker, and the cycle collector's passes over
them count. `load.bench_ingest`
measures events applied a second by the broker process over NATS, which a two-core machine
shares with nats-server and the publisher; this figure is the core's own share of it, and
reads within a few per cent from run to run. Prints every run, the median and one
`RESULT {...}` line.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Annotated, Any

import typer

from broker.core.effects import BatchApplied
from broker.core.inputs import AgentBatch
from broker.core.machine import Machine
from load.bench_ingest import Batch, delta_events, snapshot
from load.command import Count, JsonOut, Nodes, Options, program, summary
from load.common import emit
from schemas.agent import EventBatch
from schemas.codec import decode_event_batch, encode_msgpack
from schemas.config import BrokerConfig, QueueConfig

NOW = 1_700_000_000.0


def one_run(clusters: int, nodes: int, events: int, batch: int) -> float:
    """CPU seconds per event of the delta batches, on a new machine."""
    m = Machine(BrokerConfig(queues=[QueueConfig(name="default")]))
    seqs = [1] * clusters
    for c in range(clusters):
        first = EventBatch(cluster=f"c{c}", instance="i", seq=1, events=[snapshot(c, nodes)])
        m.handle(AgentBatch(f"c{c}", first), NOW)
    batches: list[tuple[str, bytes]] = []
    for c in range(clusters):
        for b in range(max(1, events // clusters // batch)):
            seqs[c] += 1
            evs = delta_events(c, b, batch, nodes)
            data = EventBatch(cluster=f"c{c}", instance="i", seq=seqs[c], events=evs)
            batches.append((f"c{c}", encode_msgpack(data)))
    gc.collect()
    gc.freeze()  # as the broker's GcPacer freezes what has lived a second (bench_core)
    now = NOW
    answers = []
    started = time.process_time()
    for cluster, wire in batches:
        now += 0.001
        answers.append(m.handle(AgentBatch(cluster, decode_event_batch(wire)), now))
    spent = time.process_time() - started
    gc.unfreeze()
    applied = sum(any(isinstance(e, BatchApplied) for e in effects) for effects in answers)
    if applied != len(batches):
        raise RuntimeError(f"only {applied} of {len(batches)} batches were applied")
    return spent / (len(batches) * batch)


app = program()


@app.command(help=summary(__doc__))
def bench_ingest_core(
    clusters: Count = 50,
    nodes: Nodes = 200,
    events: Count = 500_000,
    batch: Batch = 500,
    runs: Annotated[int, typer.Option(min=1, max=50, help="runs, each on a new machine")] = 5,
    json_out: JsonOut = None,
) -> None:
    run_bench(
        Options(
            clusters=clusters, nodes=nodes, events=events, batch=batch, runs=runs, json=json_out
        )
    )


def run_bench(args: Options) -> dict[str, Any]:
    print(
        f"core ingest bench: {args.clusters} clusters x {args.nodes} nodes, "
        f"{args.events:,} events in batches of {args.batch}, {args.runs} runs"
    )
    per_event_us = []
    for run in range(args.runs):
        per_event_us.append(one_run(args.clusters, args.nodes, args.events, args.batch) * 1e6)
        print(f"run {run + 1}: {per_event_us[-1]:.2f} us of CPU an event")
    median = statistics.median(per_event_us)
    print(f"median: {median:.2f} us of CPU an event ({1e6 / median:,.0f} events per CPU-s)")
    result: dict[str, Any] = {
        "bench": "ingest_core",
        "clusters": args.clusters,
        "nodes": args.nodes,
        "batch": args.batch,
        "cpu_us_per_event_median": round(median, 3),
        "cpu_us_per_event": [round(x, 3) for x in per_event_us],
        "events_per_cpu_s_median": round(1e6 / median),
    }
    emit(result, args.json)
    return result


if __name__ == "__main__":
    app(prog_name="python -m load.bench_ingest_core")
